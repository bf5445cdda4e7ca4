"""lenscape: see which parts of a language model do the work.

Data flows one way: ``load`` a model -> capture attributions into labeled xarray
DataArrays -> ``save``/``open`` them -> aggregate -> draw with ``heatmap`` -> browse with
``Explorer``.
"""

from . import aggregate, capture, cluster, data, schema
from .capture import *  # noqa: F403  every registered method (lenscape.sweep.registry.METHODS)
from .fits import (
    apply_mask,
    block_mask_estimate,
    block_masks,
    gating_check,
    head_gating,
    mask_comparison,
    masked_loss,
    recorded,
    task_loss,
)
from .models import ArchLayout, LayoutCheckError, LensModel, ModelSpec, check, from_hf, load
from .store import open_result as open
from .store import save
from .sweep.memory import estimate
from .views import (
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
from .views import accessor as _accessor  # registers the ``da.lsc`` accessor
from .weights import finetune, weight_change, weight_grid, weight_importance

del _accessor

__all__ = [
    *capture.__all__,
    "ArchLayout",
    "CircuitExplorer",
    "Explorer",
    "LayoutCheckError",
    "LensModel",
    "ModelSpec",
    "PromptForm",
    "aggregate",
    "agreement_chart",
    "apply_mask",
    "block_mask_estimate",
    "block_masks",
    "check",
    "circuit_graph",
    "cluster",
    "data",
    "edge_heatmap",
    "enable_offline",
    "estimate",
    "export",
    "faithfulness_curve",
    "finetune",
    "from_hf",
    "gating_check",
    "head_gating",
    "heatmap",
    "load",
    "mask_comparison",
    "masked_loss",
    "open",
    "recorded",
    "reliability_chart",
    "save",
    "schema",
    "task_loss",
    "weight_change",
    "weight_grid",
    "weight_importance",
]
