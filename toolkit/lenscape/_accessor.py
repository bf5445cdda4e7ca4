"""``da.lsc`` on every DataArray from ``import lenscape`` on, without importing the views.

``import lenscape`` registers the accessor ``lsc`` on ``xarray.DataArray`` (``install``): at
once when xarray is already imported, else the moment xarray is imported (an import hook;
no DataArray exists before that), so ``lenscape --version`` imports neither xarray nor
Altair. What it registers is a stand-in, ``lazy_accessor``: its first use on an array
imports ``lenscape.views.accessor`` (Altair, ipywidgets) and returns that array's
``LenscapeAccessor``, which xarray then caches on the array. So ``import lenscape`` then
``da.lsc.heatmap(x="head", y="layer")`` works whatever the order of the imports, and
``xarray.DataArray.lsc`` is the stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xarray as xr

    from .views.accessor import LenscapeAccessor

#: The accessor's name: ``da.lsc``.
NAME = "lsc"


def lazy_accessor(da: xr.DataArray) -> LenscapeAccessor:
    """lenscape methods on any DataArray: ``da.lsc.heatmap(...)``, ``da.lsc.explore(...)``,
    ``da.lsc.mean("prompt", ci=0.95)`` ... (``lenscape.views.accessor.LenscapeAccessor``)."""
    from .views.accessor import LenscapeAccessor  # Altair and ipywidgets: slow, on first use

    return LenscapeAccessor(da)


def register(xarray: ModuleType) -> None:
    """Register ``lazy_accessor`` as ``DataArray.lsc`` with the imported ``xarray``."""
    xarray.register_dataarray_accessor(NAME)(lazy_accessor)


class _RegisterAfter(importlib.abc.Loader):
    """xarray's own loader, then ``register``; the module keeps xarray's loader."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        register(module)


class _WhenXarrayIsImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``xarray`` it returns the spec the other finders give,
    with a loader that registers the accessor once xarray's code has run, and leaves."""

    def __init__(self) -> None:
        self.searching = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "xarray" or self.searching:
            return None
        self.searching = True  # importlib.util.find_spec asks every finder, this one too
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.searching = False
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


def install() -> None:
    """Register ``da.lsc`` now if xarray is imported, else when it is (once per process)."""
    if "xarray" in sys.modules:
        register(sys.modules["xarray"])
    elif not any(isinstance(finder, _WhenXarrayIsImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenXarrayIsImported())


install()
