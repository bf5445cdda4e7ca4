"""The benchmark report protocol: markdown helpers and how run_all merges sections."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lenscape.models.host import describe_machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _report
import run_all

import notebooks


def test_table_layout():
    text = _report.table(
        ["date", "machine", "time"],
        [["2026-01-01", "2-core CPU", "1.5 s"], ["2026-01-02", "GPU", 3]],
    )
    assert text.splitlines() == [
        "| date | machine | time |",
        "| --- | --- | --- |",
        "| 2026-01-01 | 2-core CPU | 1.5 s |",
        "| 2026-01-02 | GPU | 3 |",
    ]


def test_table_rejects_ragged_rows():
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        _report.table(["a", "b", "c"], [[1, 2]])


def test_section_markers_and_parts():
    text = _report.section("demo", "Demo", "What it measures.\n", "| a |\n| --- |\n| 1 |\n")
    lines = text.splitlines()
    assert lines[0] == "<!-- bench:demo -->"
    assert lines[-1] == "<!-- /bench:demo -->"
    assert lines[1] == "## Demo"
    assert "What it measures.\n\n| a |" in text
    assert text.endswith("\n")
    assert run_all.parse_sections(text) == {"demo": text}


def test_stamp_is_date_and_short_machine():
    info = _report.machine_info()
    assert _report.stamp() == [info["date"], info["short"]]
    machine = describe_machine()  # the one description of the machine, as in recordings
    assert (info["machine"], info["short"]) == (str(machine), machine.short)
    assert set(info["versions"]) == {"python", *_report.PACKAGES}
    assert info["versions"]["lenscape"] != "absent"


def section(name: str, value: str) -> str:
    return _report.section(name, name.title(), f"About {name}.", value)


def test_merge_replaces_keeps_and_sorts():
    old = run_all.render(
        _report.machine_info(), {"b": section("b", "old b"), "c": section("c", "old c")}
    )
    merged = run_all.merge_sections(old, {"b": section("b", "new b"), "a": section("a", "new a")})
    assert list(merged) == ["a", "b", "c"]
    assert "new b" in merged["b"] and "old b" not in merged["b"]
    assert merged["c"] == section("c", "old c")


def test_merge_without_old_file():
    assert run_all.merge_sections("", {"x": section("x", "1")}) == {"x": section("x", "1")}


def test_parse_ignores_inline_markers_and_mismatched_ends():
    inline = section("a", "see `<!-- bench:b -->` in the text")
    broken = "<!-- bench:c -->\n## C\n<!-- /bench:d -->\n"
    assert list(run_all.parse_sections(inline + broken)) == ["a"]


def test_render_round_trips_sections():
    sections = {"a": section("a", "1"), "b": section("b", "2")}
    text = run_all.render(_report.machine_info(), sections)
    assert text.startswith("# Benchmark results\n")
    assert "Written by `make bench` (benchmarks/run_all.py)" in text
    assert run_all.parse_sections(text) == sections


def test_results_file_holds_every_script_section():
    text = (Path(run_all.HERE) / "RESULTS.md").read_text()
    found = run_all.parse_sections(text)
    assert set(found) <= set(run_all.scripts())
    for name in (
        "capture_overhead",
        "faithfulness",
        "head_gating",
        "block_masks",
        "weight_maps",
        "redraw",
    ):
        assert "| date | machine |" in found[name]


def test_scripts_skip_private_modules_and_runner():
    names = run_all.scripts()
    assert "run_all" not in names and "_report" not in names
    assert "capture_overhead" in names


def test_conditions_close_the_section_and_survive_a_reparse():
    text = run_all.with_conditions("a", section("a", "body"), "two recordings paused")
    assert text.endswith("Conditions of this run: two recordings paused\n<!-- /bench:a -->\n")
    assert run_all.parse_sections(text) == {"a": text}


# --------------------------------------------- the notebooks' Run All benchmark (issue 43)


def test_notebook_kernels_run_at_the_thread_count_asked_and_the_environment_comes_back(
    monkeypatch,
):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    with notebooks.kernel_threads(1):
        assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in os.environ
    with notebooks.kernel_threads(None):  # "default": as this process
        assert os.environ["OMP_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in os.environ
    assert notebooks.parse_threads("default,1") == [None, 1]
    for bad in ("0", "two", ""):
        with pytest.raises(SystemExit, match="--threads takes 'default' or positive"):
            notebooks.parse_threads(bad)


def test_the_budget_lines_a_notebook_printed_are_collected():
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(...)")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="x\nBudget: 240 s for the fit\n"),
        nbformat.v4.new_output("stream", name="stderr", text="  Budget: stopped at 30 s\n"),
        nbformat.v4.new_output("execute_result", data={"text/plain": "Budget: no"}),
    ]
    nb.cells = [nbformat.v4.new_markdown_cell("Budget: not code"), cell]
    assert notebooks.budget_lines(nb) == ["Budget: 240 s for the fit", "Budget: stopped at 30 s"]


# ------------------------------------------------------- refine="auto"'s rule, replayed (issue 44)


def test_the_replay_of_refine_auto_picks_the_cells_it_measures(tiny_llama, tmp_path):
    import numpy as np
    import refine_rules
    from faithfulness import aligned_pairs

    import lenscape as lsc

    prompts = aligned_pairs(tiny_llama, lsc.data.prompts("factual")).sample(6, seed=7)
    exact, estimates, errors = refine_rules.draw(tiny_llama, "factual", 7, 6, tmp_path)
    auto = lsc.activation_patching(tiny_llama, prompts, level="head", refine="auto", progress=False)
    measured = auto["measured"].values.reshape(6, -1)
    assert 0 < measured.sum() < measured.size  # some cells measured, not all
    np.testing.assert_array_equal(refine_rules.replay(exact, estimates, errors), measured)
    assert np.array_equal(refine_rules.draw(tiny_llama, "factual", 7, 6, tmp_path)[0], exact)
