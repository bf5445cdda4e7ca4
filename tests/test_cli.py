"""The ``lenscape`` command: help, --version, documented options, clear errors for bad
arguments, and the demo job run end to end on a tiny model saved to a folder."""

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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
    "argv, message",
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["demo", "--prompts", "many"], "argument --prompts: invalid int value: 'many'"),
        (["demo", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith("usage: lenscape") and message in err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert (
        done.value.code == 0 and capsys.readouterr().out.strip() == f"lenscape {package_version()}"
    )


def test_the_installed_command_runs_and_fails_cleanly():
    """The console script from pyproject's [project.scripts] reaches ``main``, and a command
    that fails (an unknown bundled model) exits non-zero naming the fix. One process: each
    start imports torch and transformers (--version is checked in-process above)."""
    script = Path(sys.executable).with_name("lenscape")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (package not installed)")
    bad = subprocess.run(
        [script, "install-models", "gpt-17"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 1
    # One line naming the problem and what exists, not a traceback.
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("lenscape install-models: LookupError: Unknown bundled model 'gpt-17'")
    assert "smollm2-135m" in line


def test_demo_runs_on_a_tiny_model_folder(tmp_path, monkeypatch, capsys, tokenizer, factual):
    """``lenscape demo`` on a tiny model saved to a folder: the store, the charts and the
    README picture are written, and the stored exact map is activation patching of the
    first N factual prompts on that model."""
    folder = tmp_path / "tiny"
    tiny = lsc.models.tiny("llama", n_layers=2, seed=0, tokenizer=tokenizer)
    tiny.hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.chdir(tmp_path)  # --picture writes docs/demo_heatmap.png under the cwd
    argv = ["demo", "--model", str(folder), "--prompts", "2", "--device", "cpu", "--out", "run"]
    assert cli.main([*argv, "--picture"]) == 0
    out = capsys.readouterr().out
    assert "2 factual prompts" in out and "Can I trust the fast map?" in out
    written = [line.strip() for line in out.split("wrote:")[1].splitlines() if line.strip()]
    names = {Path(path).name for path in written}
    assert names == {
        "demo.zarr",
        "activation_patching_heads.png",
        "activation_patching_heads.html",
        "demo_heatmap.png",
        "faithfulness.png",
    }
    for path in written:
        assert (tmp_path / path).exists(), path
        if path.endswith(".png"):
            assert (tmp_path / path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / cli.README_PICTURE).exists()
    report = lsc.open(tmp_path / "run" / "demo.zarr")
    exact = report["exact_heads"]
    assert exact.sizes == {"prompt": 2, "layer": 2, "head": 4}
    assert list(exact["text"].values) == factual.texts[:2]
    expected = lsc.activation_patching(tiny, factual[:2], level="head", progress=False)
    np.testing.assert_allclose(exact.transpose(*expected.dims).values, expected.values, atol=1e-5)


def _subparsers(parser):
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


@pytest.mark.parametrize("command", ["install-models", "demo"])
def test_every_option_has_help_and_shows_its_default(command):
    sub = _subparsers(cli.parser())[command]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.dest} has no help text"
    text = sub.format_help()
    for action in sub._actions:
        if (
            action.option_strings
            and action.default not in (None, argparse.SUPPRESS)
            and not isinstance(action, argparse._HelpAction)
        ):
            assert f"(default: {action.default})" in " ".join(text.split())


def test_make_lab_passes_allow_root_only_as_root():
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    dry = subprocess.run(
        ["make", "-n", "-o", "install", "lab"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    (command,) = [line for line in dry.splitlines() if "jupyter lab" in line]
    assert ("--allow-root" in command) == (os.geteuid() == 0)


def test_make_demo_refreshes_the_readme_picture():
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert "lenscape demo --out out --picture" in makefile
    assert (
        str(cli.README_PICTURE) in (Path(__file__).resolve().parents[1] / "README.md").read_text()
    )
