"""The ``lenscape`` command's surface: help with no command, --version, documented options."""

import argparse
import subprocess
import sys

import pytest

from lenscape import cli
from lenscape.schema import _version


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lenscape") and "install-models" in out and "demo" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"lenscape {_version()}"


def test_the_installed_command_runs():
    out = subprocess.run(
        [sys.executable, "-m", "lenscape.cli", "--version"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out.startswith("lenscape ")


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
