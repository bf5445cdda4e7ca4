"""How many prompts (and stacked variants) fit in one pass, from free memory.

Used when ``batch_size=None`` (or ``variants_per_pass=None``). The activation estimate is
deliberately coarse and generous: per token and layer a pass holds a few residual-width
tensors, the MLP's hidden activations and one row of attention scores per head; a pass that
keeps a graph for a backward pass holds that for every layer at once. Only a share of the
free memory is budgeted (``BUDGET_SHARE``), the rest is left for the allocator and caches.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..models import LensModel

#: Share of free memory one pass may use.
BUDGET_SHARE = {"cuda": 0.5, "cpu": 0.25}
#: Largest automatic batch: on CPU bigger batches barely speed up the matrix products and
#: only delay the progress bar; on a GPU they fill the device.
MAX_BATCH = {"cuda": 256, "cpu": 8}


def free_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bytes_per_sequence(model: LensModel, *, width: int, grad: bool) -> int:
    """Estimated activation bytes of one sequence of ``width`` tokens in one pass."""
    spec, config = model.spec, model.hf.config
    d_ff = (
        getattr(config, "intermediate_size", None)
        or getattr(config, "n_inner", None)
        or 4 * spec.d_model
    )
    per_layer = 6 * spec.d_model + 3 * d_ff + 2 * spec.n_heads * width
    layers = spec.n_layers if grad else 1
    element = torch.finfo(model.dtype).bits // 8
    # + the read position's logits in float32 for the metric
    return width * per_layer * layers * element + 2 * spec.vocab_size * 4


def _fit(model: LensModel, *, width: int, grad: bool) -> int:
    device = model.device
    budget = free_bytes(device) * BUDGET_SHARE.get(device.type, 0.25)
    return int(budget // bytes_per_sequence(model, width=width, grad=grad))


def auto_batch_size(model: LensModel, *, width: int, grad: bool) -> int:
    """Prompts per pass that fit the memory budget (at least 1, at most ``MAX_BATCH``)."""
    cap = MAX_BATCH.get(model.device.type, MAX_BATCH["cpu"])
    return max(1, min(cap, _fit(model, width=width, grad=grad)))


def auto_variants_per_pass(model: LensModel, *, rows: int, width: int, wanted: int) -> int:
    """Copies of a ``rows``-prompt batch that fit in one no-grad pass (1 .. ``wanted``)."""
    return max(1, min(wanted, _fit(model, width=width, grad=False) // max(rows, 1)))
