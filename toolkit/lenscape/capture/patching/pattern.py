"""``part="pattern"``: a head's output with its attention pattern taken from the other run.

A head's output is its pattern times its values, z_h = A_h V_g(h), with g(h) the key/value
head query head h reads (grouped-query attention stays grouped: the values are never copied
out to the query heads as separate heads). Patching head h's pattern into a run changes
nothing below its block, so the values it meets are that run's own unedited ones: the
patched output is A_h(source) V_g(h)(target), and patching the pattern is patching z_h with
that value, exactly (``swapped_outputs``). The exact sweeps then run unchanged on the "z"
sites.

Attribution patching follows from dM/dA_h[q, k] = dM/dz_h[q] . V_g(h)[k]: summed against
the pattern's change, grad_z . (A_source - A_target) V_target, the z estimate with the
swapped output as its goal. The other estimators move the values along their path (the
input path of ``ig``, the clean end of the trapezoid rule), where that identity does not
hold: ``check_part`` refuses them.
"""

from __future__ import annotations

import torch

from ...models import ModelSpec
from ...sweep.backend import Site


def pattern_sites(spec: ModelSpec) -> list[Site]:
    """Every block's attention pattern, (batch, n_heads, query_pos, key_pos)."""
    return [("pattern", layer) for layer in range(spec.n_layers)]


def value_sites(spec: ModelSpec) -> list[Site]:
    """Every block's values, (batch, pos, n_kv_heads, d_head)."""
    return [("v", layer) for layer in range(spec.n_layers)]


def swapped_output(spec: ModelSpec, pattern: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(batch, pos, n_heads, d_head): each query head's output with the attention
    ``pattern`` (batch, n_heads, query_pos, key_pos) over the ``values`` (batch, pos,
    n_kv_heads, d_head) of its key/value head."""
    per_group = spec.n_heads // spec.n_kv_heads
    grouped = pattern.view(pattern.shape[0], spec.n_kv_heads, per_group, *pattern.shape[2:]).to(
        values.dtype
    )
    return torch.einsum("bgiqk,bkgd->bqgid", grouped, values).flatten(2, 3)


def swapped_outputs(
    spec: ModelSpec, patterns: dict[Site, torch.Tensor], values: dict[Site, torch.Tensor]
) -> dict[Site, torch.Tensor]:
    """Site ``("z", layer)`` -> ``swapped_output`` of that block's ``patterns[("pattern",
    layer)]`` over its ``values[("v", layer)]``, for every block."""
    return {
        ("z", layer): swapped_output(spec, patterns[("pattern", layer)], values[("v", layer)])
        for layer in range(spec.n_layers)
    }
