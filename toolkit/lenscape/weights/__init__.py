"""Weight-level maps: which weight matrices matter (``maps.weight_importance``), which
changed between two checkpoints (``maps.weight_change``), and a small fine-tune to make a
second checkpoint (``finetune``)."""

from .finetune import finetune
from .maps import weight_change, weight_grid, weight_importance

__all__ = ["finetune", "weight_change", "weight_grid", "weight_importance"]
