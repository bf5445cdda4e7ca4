"""lenscape: see which parts of a language model do the work.

Data flows one way: ``load`` a model -> capture attributions into labeled xarray
DataArrays -> ``save``/``open`` them -> aggregate -> draw with ``heatmap`` -> browse with
``Explorer``.

Importing lenscape is quick: each public name is imported from its module on first use
(``_EXPORTS``, ``lenscape._lazy``), so ``lsc.heatmap`` brings in Altair and ``lsc.load``
torch and transformers when first touched, while ``dir(lsc)`` and tab completion list every
name before that. ``da.lsc`` works from ``import lenscape`` on (``lenscape._accessor``).
"""

import importlib as _importlib
import typing as _typing

from . import _accessor, _lazy

# What type checkers and IDEs see (F401: re-exported, at run time by ``__getattr__``).
if _typing.TYPE_CHECKING:
    from . import aggregate, cluster, data, schema  # noqa: F401
    from .capture import *  # noqa: F403  every registered method (lenscape.sweep.registry.METHODS)
    from .fits import (  # noqa: F401
        apply_mask,
        block_mask_estimate,
        block_masks,
        gating_check,
        head_gating,
        heads_off,
        mask_comparison,
        masked_loss,
        recorded,
        task_loss,
    )
    from .models import (  # noqa: F401
        ArchLayout,
        LayoutCheckError,
        LensModel,
        ModelSpec,
        check,
        from_hf,
        load,
    )
    from .store import open_result as open  # noqa: F401
    from .store import save  # noqa: F401
    from .sweep.memory import estimate  # noqa: F401
    from .views import (  # noqa: F401
        CircuitExplorer,
        Explorer,
        PromptForm,
        agreement_chart,
        circuit_graph,
        edge_heatmap,
        enable_offline,
        export,
        faithfulness_curve,
        heatmap,
        reliability_chart,
    )
    from .weights import finetune, weight_change, weight_grid, weight_importance  # noqa: F401

del _accessor  # imported for its side effect: ``da.lsc`` is registered

#: Public name -> ``"module:attribute"`` or ``"module"`` (a submodule itself), relative to
#: this package, imported on first use. ``__all__`` is the registered methods
#: (``lenscape.capture``) followed by these.
_EXPORTS = {
    "ArchLayout": "models:ArchLayout",
    "CircuitExplorer": "views:CircuitExplorer",
    "Explorer": "views:Explorer",
    "LayoutCheckError": "models:LayoutCheckError",
    "LensModel": "models:LensModel",
    "ModelSpec": "models:ModelSpec",
    "PromptForm": "views:PromptForm",
    "aggregate": "aggregate",
    "agreement_chart": "views:agreement_chart",
    "apply_mask": "fits:apply_mask",
    "block_mask_estimate": "fits:block_mask_estimate",
    "block_masks": "fits:block_masks",
    "check": "models:check",
    "circuit_graph": "views:circuit_graph",
    "cluster": "cluster",
    "data": "data",
    "edge_heatmap": "views:edge_heatmap",
    "enable_offline": "views:enable_offline",
    "estimate": "sweep.memory:estimate",
    "export": "views:export",
    "faithfulness_curve": "views:faithfulness_curve",
    "finetune": "weights:finetune",
    "from_hf": "models:from_hf",
    "gating_check": "fits:gating_check",
    "head_gating": "fits:head_gating",
    "heads_off": "fits:heads_off",
    "heatmap": "views:heatmap",
    "load": "models:load",
    "mask_comparison": "fits:mask_comparison",
    "masked_loss": "fits:masked_loss",
    "open": "store:open_result",
    "recorded": "fits:recorded",
    "reliability_chart": "views:reliability_chart",
    "save": "store:save",
    "schema": "schema",
    "task_loss": "fits:task_loss",
    "weight_change": "weights:weight_change",
    "weight_grid": "weights:weight_grid",
    "weight_importance": "weights:weight_importance",
}
#: The packages whose methods register themselves on import (``@method``,
#: ``@memory.estimator``): ``estimate`` plans any of them by name, so they come first.
_METHOD_PACKAGES = ("capture", "fits", "weights")


def __getattr__(name: str) -> _typing.Any:
    """A public name or a submodule, imported on first use (PEP 562)."""
    if name == "__all__":
        return _public_names()
    if name == "estimate":
        for package in _METHOD_PACKAGES:
            _importlib.import_module(f"{__name__}.{package}")
    if name in _EXPORTS or name.startswith("_") or name in _lazy.submodules(__name__):
        return _lazy.export(__name__, _EXPORTS, name)
    return _lazy.export(__name__, _table(), name)  # a method's name: capture registers them


def __dir__() -> list[str]:
    return _lazy.listing(__name__, ["__all__", *_public_names()])


def _table() -> dict[str, str]:
    """Every public name -> where it comes from: the registered methods (importing
    ``lenscape.capture`` imports every method module, so that each is registered), then
    ``_EXPORTS``."""
    capture = _importlib.import_module(f"{__name__}.capture")
    return {**{name: f"capture:{name}" for name in capture.__all__}, **_EXPORTS}


def _public_names() -> list[str]:
    """``__all__``, made once: the keys of ``_table()``."""
    if "__all__" not in globals():
        globals()["__all__"] = list(_table())
    return globals()["__all__"]


_lazy.make_lazy(__name__)
