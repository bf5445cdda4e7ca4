"""Lazy re-exports (PEP 562): a package's public names are imported on first use.

``import lenscape`` and the ``lenscape`` command would otherwise import every capture
module, view and fit, with torch, transformers and Altair (16 s for ``lenscape --version``
on a 2-core machine). A package that re-exports lazily keeps one table, public name ->
``"module:attribute"`` (or ``"module"`` for a submodule itself; the module relative to the
package), defines its module ``__getattr__`` and ``__dir__`` with ``export`` and
``listing``, and ends with ``make_lazy(__name__)``: the first ``lsc.heatmap`` imports
``lenscape.views``, and keeps the function as a plain attribute of the package, so the next
access is a dictionary lookup. Static checkers and IDEs read the same names from the
package's ``if TYPE_CHECKING:`` imports (``tests/test_packaging.py`` checks that they match
the table).

``make_lazy`` is needed because a module's ``__getattr__`` is asked only for names that
nothing else has, and nnsight mounts a ``save`` method on every object: without it,
``lsc.save`` touched after ``import nnsight`` and before ``lenscape.store`` is imported
would be nnsight's ``save``, not lenscape's.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any


def export(package: str, table: Mapping[str, str], name: str) -> Any:
    """``package``'s attribute ``name``, imported now: a public name from ``table``, or a
    submodule (``lsc.models``, ``lsc.views``), as after an eager import.

    Args:
        package: the package's ``__name__``.
        table: public name -> ``"module:attribute"`` or ``"module"``, relative to ``package``.
        name: the attribute asked for.

    Returns:
        The object, also set on the package so that later lookups find it directly.

    Raises:
        AttributeError: ``name`` is neither in ``table`` nor a submodule of ``package``.
    """
    if name in table:
        module, _, attribute = table[name].partition(":")
        value = importlib.import_module(f"{package}.{module}")
        if attribute:
            value = getattr(value, attribute)
    elif name in submodules(package, private=True):
        value = importlib.import_module(f"{package}.{name}")
    else:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    setattr(sys.modules[package], name, value)
    return value


@functools.cache
def submodules(package: str, *, private: bool = False) -> frozenset[str]:
    """The modules and subpackages of ``package``, imported or not (a directory listing).

    Args:
        package: the package's ``__name__``.
        private: include the names that start with ``_``.
    """
    found = pkgutil.iter_modules(sys.modules[package].__path__)
    return frozenset(info.name for info in found if private or not info.name.startswith("_"))


def listing(package: str, public: Iterable[str]) -> list[str]:
    """What ``dir(package)`` shows: what it holds so far, the ``public`` names and its public
    submodules, so tab completion offers every name before any of them is imported."""
    return sorted({*vars(sys.modules[package]), *public, *submodules(package)})


class LazyPackage(types.ModuleType):
    """A package whose public names come before the attributes every object has: a name
    that is not set yet is asked of the package's ``__getattr__`` first (the table), and
    only then looked up on the type (``object.save`` once nnsight has mounted it)."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_"):
            return super().__getattribute__(name)
        namespace = super().__getattribute__("__dict__")
        if name in namespace:
            return namespace[name]
        try:
            return namespace["__getattr__"](name)
        except AttributeError as missing:
            try:
                return object.__getattribute__(self, name)
            except AttributeError:
                raise missing from None


def make_lazy(package: str) -> None:
    """Make the imported ``package`` (which defines ``__getattr__``) a ``LazyPackage``."""
    sys.modules[package].__class__ = LazyPackage
