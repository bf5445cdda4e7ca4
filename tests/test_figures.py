"""The gallery docs/figures/ (docs/figures.py, ``make figures``): drawn from data, never typed.

F1 and F4 are redrawn here from the shipped recordings (``lsc.recorded``) into a temporary
folder, and the checksum of the numbers they draw must equal the one docs/figures/
sources.json recorded when the gallery was made: a gallery left behind by a new recording,
or numbers typed in by hand, fail. The figures drawn from cached runs are checked to be
listed with their source, present, and shown by the README.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import lenscape as lsc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))

import figures  # docs/figures.py, the script beside the gallery it draws

ROOT = figures.ROOT
RECORDED = ("f1_block_masks", "f4_head_roles")


def committed() -> dict[str, dict[str, str]]:
    return json.loads((figures.GALLERY / figures.SOURCES).read_text())


def test_every_figure_is_listed_with_its_source_and_shown_in_the_readme():
    sources = committed()
    assert list(sources) == list(figures.FIGURES)
    readme = (ROOT / "README.md").read_text()
    for name, entry in sources.items():
        png = figures.GALLERY / entry["file"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert entry["source"] == figures.FIGURES[name][1]
        assert f"](docs/figures/{entry['file']})" in readme, name


@pytest.mark.slow
def test_the_recorded_figures_are_redrawn_from_the_recordings(tmp_path, monkeypatch):
    asked = []
    recorded = lsc.recorded

    def spy(name, **where):
        asked.append((name, where.get("model"), where.get("task")))
        return recorded(name, **where)

    monkeypatch.setattr(lsc, "recorded", spy)
    assert figures.main(["--out", str(tmp_path), "--only", *RECORDED]) == 0
    assert {("block_masks", model, None) for model in figures.F1_MODELS} <= set(asked)
    assert {("head_roles", figures.F4_MODEL, task) for task in figures.F4_TASKS} <= set(asked)
    redrawn = json.loads((tmp_path / figures.SOURCES).read_text())
    for name in RECORDED:
        assert (tmp_path / redrawn[name]["file"]).exists()
        assert redrawn[name]["data_sha256"] == committed()[name]["data_sha256"], (
            f"docs/figures/{redrawn[name]['file']} was not drawn from today's recordings: "
            "run make figures"
        )
