"""Capture methods: each takes a model and prompts and returns a validated DataArray."""

from .gating import gating_check, head_gating, task_loss
from .logit import direct_logit_attribution
from .masks import apply_mask, block_masks, mask_comparison, masked_loss
from .weights import weight_change, weight_grid, weight_importance
from .patching import ablation, activation_patching, attribution_patching
from .streaming import capture_to

__all__ = ["ablation", "activation_patching", "attribution_patching", "capture_to",
           "direct_logit_attribution", "head_gating", "task_loss", "apply_mask", "block_masks",
           "masked_loss", "weight_change", "weight_importance", "gating_check", "mask_comparison",
           "weight_grid"]
