"""Capture methods: each takes a model and prompts and returns a validated DataArray."""

from .gating import gating_check, head_gating, task_loss
from .logit import direct_logit_attribution
from .masks import apply_mask, block_masks, mask_comparison, masked_loss
from .patching import ablation, activation_patching, attribution_patching
from .to_store import capture_to
from .weights import weight_change, weight_grid, weight_importance

__all__ = [
    "ablation",
    "activation_patching",
    "apply_mask",
    "attribution_patching",
    "block_masks",
    "capture_to",
    "direct_logit_attribution",
    "gating_check",
    "head_gating",
    "mask_comparison",
    "masked_loss",
    "task_loss",
    "weight_change",
    "weight_grid",
    "weight_importance",
]
