"""Learned fits with the model frozen: causal head gating and per-cluster block masks.

``optim`` holds what both share (Adam until the gates stop moving, the precision of the
passes, a fit's wall-time budget and its ``TimeBudgetWarning``); ``gating`` and ``masks``
are the two fits and their causal checks; ``recordings`` ships their reference-protocol
runs (``recorded_data/``), made once and checked on load.
"""

from .gating import gating_check, head_gating, heads_off, task_loss
from .masks import apply_mask, block_mask_estimate, block_masks, mask_comparison, masked_loss
from .optim import TimeBudgetWarning
from .recordings import recorded

__all__ = [
    "TimeBudgetWarning",
    "apply_mask",
    "block_mask_estimate",
    "block_masks",
    "gating_check",
    "head_gating",
    "heads_off",
    "mask_comparison",
    "masked_loss",
    "recorded",
    "task_loss",
]
