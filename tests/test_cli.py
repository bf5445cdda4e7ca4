"""The ``lenscape`` command: help, --version, documented options, clear errors for bad
arguments, and the demo job run end to end on a tiny model saved to a folder."""

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _helpers import fresh_python

import lenscape as lsc
from lenscape import cli
from lenscape.schema import package_version


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lenscape") and "install-models" in out and "demo" in out


def test_help_lists_the_commands_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: lenscape")
    assert "install-models" in out and "demo" in out and "--version" in out
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0 and "usage: lenscape demo" in out
    assert "--prompts N" in out and "(default: smollm2-135m)" in out


@pytest.mark.parametrize(
    "argv, usage, message",
    [
        (["frobnicate"], "lenscape [-h]", "invalid choice: 'frobnicate'"),
        (["--no-such-option"], "lenscape [-h]", "unrecognized arguments: --no-such-option"),
        (["demo", "--no-such-option"], "lenscape demo", "unrecognized arguments: --no-such"),
        (["demo", "--out", "o", "extra"], "lenscape demo", "unrecognized arguments: extra"),
        (["install-models", "--bogus"], "lenscape install-models", "unrecognized arguments"),
        (["demo", "--prompts", "many"], "lenscape demo", "at least 1, got 'many'; leave"),
        (["demo", "--prompts", "-3"], "lenscape demo", "at least 1, got '-3'; leave --prompts"),
        (["demo", "--prompts", "0"], "lenscape demo", "at least 1, got '0'"),
        (["demo", "--device", "gpu"], "lenscape demo", "device='gpu' is not a device; use 'auto'"),
        (["demo", "--model", "minilm"], "lenscape demo", "sentence encoder used by lsc.cluster"),
        (["demo", "--model", " "], "lenscape demo", "the model name is empty"),
        (["install-models", "gpt-17"], "lenscape install-models", "unknown bundled weights"),
        (["install-models", "--all", "minilm"], "lenscape install-models", "names or --all"),
    ],
)
def test_bad_arguments_exit_2_with_the_subcommands_usage_and_the_fix(capsys, argv, usage, message):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith(f"usage: {usage}") and message in " ".join(err.split())


def test_a_device_this_machine_lacks_is_refused_before_any_work(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit):
        cli.main(["demo", "--device", "cuda:3"])
    assert "this machine has 1 CUDA device(s), numbered from 0" in capsys.readouterr().err


def test_an_out_path_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        cli.main(["demo", "--out", str(tmp_path / "file")])
    assert "is not a folder; give a folder" in capsys.readouterr().err


def test_only_language_models_are_offered_to_load(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    demo_help = " ".join(capsys.readouterr().out.split())
    assert "smollm2-135m, gemma3-270m" in demo_help and "minilm" not in demo_help
    with pytest.raises(SystemExit):
        cli.main(["install-models", "--help"])
    install_help = " ".join(capsys.readouterr().out.split())
    assert "minilm (sentence encoder for lsc.cluster, default)" in install_help


def test_an_unexpected_error_is_one_line_unless_traceback_is_asked(capsys, monkeypatch):
    def broken_load(*args, **kwargs):
        raise RuntimeError("CUDA error: invalid device ordinal\nCompile with TORCH_USE_CUDA_DSA")

    monkeypatch.setattr(lsc, "load", broken_load)
    assert cli.main(["demo", "--out", "o", "--device", "cpu"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "lenscape demo: unexpected RuntimeError: CUDA error: invalid device ordinal Compile "
        "with TORCH_USE_CUDA_DSA (run again with --traceback to see where)"
    )
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        cli.main(["demo", "--out", "o", "--device", "cpu", "--traceback"])


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert (
        done.value.code == 0 and capsys.readouterr().out.strip() == f"lenscape {package_version()}"
    )


CLI_IMPORTS = textwrap.dedent("""
    import json, sys
    from lenscape.cli import main
    for argv in {commands}:
        try:
            main(argv)
        except SystemExit as done:
            assert done.code == 0, argv
    print(json.dumps(sorted(name for name in {heavy} if name in sys.modules)))
""")
#: Seconds to import each on a 2-core machine (benchmarks/startup.py), or the library's parts.
HEAVY = ("torch", "transformers", "xarray", "altair", "lenscape.capture", "lenscape.views")


@pytest.mark.parametrize(
    "commands, heavy",
    [
        ([["--version"], ["--help"], ["install-models", "--help"]], HEAVY),
        ([["demo", "--help"]], tuple(name for name in HEAVY if name != "xarray")),
    ],
    ids=["version-and-help", "demo-help"],
)
def test_help_and_version_import_neither_torch_nor_the_methods(commands, heavy):
    """``lenscape --version`` and ``--help`` answer at once: the parser is built without
    torch, transformers, xarray or Altair, the capture methods or the views (``demo --help``
    counts the factual prompts, which imports xarray, but not torch)."""
    out = fresh_python(CLI_IMPORTS.format(commands=commands, heavy=heavy))
    assert json.loads(out.splitlines()[-1]) == []


def test_the_installed_command_runs_and_fails_cleanly(tmp_path):
    """The console script from pyproject's [project.scripts] reaches ``main``, and a command
    that fails while working (a model folder that does not exist) exits 1 naming it. One
    process: the demo imports torch and transformers (--version is checked in-process)."""
    script = Path(sys.executable).with_name("lenscape")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (package not installed)")
    bad = subprocess.run(
        [script, "demo", "--model", "./no-such-model", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 1
    # One line naming the problem, not a traceback.
    (line,) = bad.stderr.strip().splitlines()
    assert (
        line == "lenscape demo: LookupError: No model folder at './no-such-model'; check the path."
    )


def test_demo_runs_on_a_tiny_model_folder(tmp_path, monkeypatch, capsys, tokenizer, factual):
    """``lenscape demo`` on a tiny model saved to a folder: the store and the charts are
    written into --out and nowhere else, and the stored exact map is activation patching of
    a seeded sample of N factual prompts (every category in proportion) on that model."""
    folder = tmp_path / "tiny"
    tiny = lsc.models.tiny("llama", n_layers=2, seed=0, tokenizer=tokenizer)
    tiny.hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    before = set(tmp_path.rglob("*"))
    argv = ["demo", "--model", str(folder), "--prompts", "2", "--device", "cpu", "--out", "run"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 factual prompts" in out and "Can I trust the fast map?" in out
    written = [line.strip() for line in out.split("wrote:")[1].splitlines() if line.strip()]
    names = {Path(path).name for path in written}
    assert names == {
        "demo.zarr",
        "activation_patching_heads.png",
        "activation_patching_heads.html",
        "faithfulness.png",
    }
    for path in written:
        assert (tmp_path / path).exists(), path
        if path.endswith(".png"):
            assert (tmp_path / path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    new = set(tmp_path.rglob("*")) - before
    assert all(p.is_relative_to(tmp_path / "run") for p in new)  # only into --out
    report = lsc.open(tmp_path / "run" / "demo.zarr")
    exact = report["exact_heads"]
    assert exact.sizes == {"prompt": 2, "layer": 2, "head": 4}
    sample = factual.sample(2, seed=0)
    assert list(exact["text"].values) == sample.texts
    assert "r (95% interval)" in out and "--prompts all narrows it" in out
    expected = lsc.activation_patching(tiny, sample, level="head", progress=False)
    np.testing.assert_allclose(exact.transpose(*expected.dims).values, expected.values, atol=1e-5)


@pytest.mark.parametrize("command", ["install-models", "demo"])
def test_every_option_has_help_and_shows_its_default_once(command):
    sub = cli._subcommands(cli.parser())[command]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.dest} has no help text"
    text = " ".join(sub.format_help().split())
    for action in sub._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert f"(default: {action.default})" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    options = text.split("options:")[1].split(" -")  # one entry per option
    assert all(entry.count("(default:") <= 1 for entry in options)


def test_make_lab_passes_allow_root_only_as_root():
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    dry = subprocess.run(
        ["make", "-n", "-o", "install", "lab"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    (command,) = [line for line in dry.splitlines() if "jupyter lab" in line]
    assert ("--allow-root" in command) == (os.geteuid() == 0)


def test_make_demo_writes_only_under_out_and_figures_draws_the_gallery():
    """``make demo`` writes into out/ (ignored by git); the README shows the gallery that
    ``make figures`` draws (docs/figures/), never a file the demo rewrites."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    dry = subprocess.run(
        ["make", "-n", "-o", "install", "demo", "figures"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (demo,) = [line for line in dry.splitlines() if "lenscape demo" in line]
    assert demo.endswith("lenscape demo --out out")
    assert any(line.endswith("docs/figures.py") for line in dry.splitlines())
    assert "out/" in (root / ".gitignore").read_text().split()
    readme = (root / "README.md").read_text()
    assert "](docs/figures/" in readme and "docs/demo_heatmap.png" not in readme
