"""Capture methods: each takes a model and prompts and returns a validated DataArray."""

from .edges import (
    circuit,
    circuit_faithfulness,
    edge_agreement,
    edge_attribution,
    edge_patching,
)
from .gating import gating_check, head_gating, task_loss
from .logit import direct_logit_attribution
from .masks import apply_mask, block_mask_estimate, block_masks, mask_comparison, masked_loss
from .patching import ablation, activation_patching, attribution_patching
from .to_store import capture_to
from .weights import weight_change, weight_grid, weight_importance

__all__ = [
    "ablation",
    "activation_patching",
    "apply_mask",
    "attribution_patching",
    "block_mask_estimate",
    "block_masks",
    "capture_to",
    "circuit",
    "circuit_faithfulness",
    "direct_logit_attribution",
    "edge_agreement",
    "edge_attribution",
    "edge_patching",
    "gating_check",
    "head_gating",
    "mask_comparison",
    "masked_loss",
    "task_loss",
    "weight_change",
    "weight_grid",
    "weight_importance",
]
