"""Packaging agreements: environment.yml matches pyproject.toml; the two commands exist."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import lenscape as lsc

ROOT = Path(__file__).resolve().parents[1]


def normalize(requirement: str) -> str:
    name, _, rest = re.match(r"([A-Za-z0-9_.\-]+)(.*)", requirement.strip()).groups() + ("",)
    return re.sub(r"[-_.]+", "-", name).lower() + rest.replace(" ", "")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted |= set(extra)
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:")
    pip = [line.split("- ", 1)[1] for line in lines[start + 1:] if line.startswith("      - ")]
    assert sorted(map(normalize, pip)) == sorted(map(normalize, wanted))


def test_ci_and_readme_use_the_two_commands():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    makefile = (ROOT / "Makefile").read_text()
    for target in ("venv:", "install:", "demo:", "test:", "lab:", "bench:"):
        assert target in makefile


def test_top_level_api():
    public = {name for name in dir(lsc) if not name.startswith("_")}
    assert set(lsc.__all__) <= public
    # Only curated names (and subpackages Python adds on import) are exposed.
    modules = {"accessor", "capture", "cli", "data", "models", "plot", "schema", "store",
               "widgets", "aggregate", "finetune", "cluster", "selfcheck"}
    assert public - set(lsc.__all__) <= modules
