"""lenscape: see which parts of a language model do the work.

Data flows one way: ``load`` a model -> capture attributions into labeled xarray
DataArrays -> ``save``/``open`` them -> aggregate -> draw with ``heatmap`` -> browse with
``Explorer``.
"""

from . import aggregate, cluster, data, schema
from .capture import (
    ablation,
    activation_patching,
    attribution_patching,
    capture_to,
    circuit,
    circuit_faithfulness,
    direct_logit_attribution,
    edge_agreement,
    edge_attribution,
    edge_patching,
)
from .capture.attention import attention_pattern
from .capture.faithfulness import faithfulness
from .capture.inspection import inspect
from .capture.lens import logit_lens
from .fits import (
    apply_mask,
    block_mask_estimate,
    block_masks,
    gating_check,
    head_gating,
    mask_comparison,
    masked_loss,
    task_loss,
)
from .models import ArchLayout, LayoutCheckError, LensModel, ModelSpec, check, from_hf, load
from .recordings import recorded
from .store import open_result as open
from .store import save
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
)
from .views import accessor as _accessor  # registers the ``da.lsc`` accessor
from .weights import finetune, weight_change, weight_grid, weight_importance

del _accessor

__all__ = [
    "ArchLayout",
    "CircuitExplorer",
    "Explorer",
    "LayoutCheckError",
    "LensModel",
    "ModelSpec",
    "PromptForm",
    "ablation",
    "activation_patching",
    "aggregate",
    "agreement_chart",
    "apply_mask",
    "attention_pattern",
    "attribution_patching",
    "block_mask_estimate",
    "block_masks",
    "capture_to",
    "check",
    "circuit",
    "circuit_faithfulness",
    "circuit_graph",
    "cluster",
    "data",
    "direct_logit_attribution",
    "edge_agreement",
    "edge_attribution",
    "edge_heatmap",
    "edge_patching",
    "enable_offline",
    "export",
    "faithfulness",
    "faithfulness_curve",
    "finetune",
    "from_hf",
    "gating_check",
    "head_gating",
    "heatmap",
    "inspect",
    "load",
    "logit_lens",
    "mask_comparison",
    "masked_loss",
    "open",
    "recorded",
    "save",
    "schema",
    "task_loss",
    "weight_change",
    "weight_grid",
    "weight_importance",
]
