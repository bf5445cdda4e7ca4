"""Head detectors: how much of each head's attention follows a pattern of the tokens.

``head_scores(model, prompts, kind="induction")`` runs each prompt once (eager attention),
and scores every query head by TransformerLens's ``head_detector.detect_head`` rule
("mul"): the attention weights times the pattern, summed over the (query, key) pairs of the
prompt's tokens, divided by the summed weights (the number of query positions, each row of
weights adding up to 1). ``rows="pattern"`` divides by the rows the pattern names a key in
only: the share of attention on the pattern where there is one (ARENA's induction score on
a repeated sequence reads the second half alone).

The patterns (``PATTERNS``), from each prompt's token ids:

- ``previous_token``: key = query - 1;
- ``duplicate_token``: earlier keys holding the query's token;
- ``induction``: the key after an earlier copy of the query's token (the duplicate pattern
  shifted right by one);
- a function ``ids -> (n, n)`` array of one prompt's ``n`` token ids: a lower-triangular
  pattern of weights in [0, 1].

On ``lsc.data.prompts("repeated")`` (random words repeated twice) induction heads score
high; ``lsc.ablation`` or the benchmarks confirm them by what switching them off costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xarray as xr

from .. import schema
from ..data import Prompts
from ..models import LensModel
from ..sweep import memory
from ..sweep.backend import get_backend
from ..sweep.inputs import Batch, batched
from ..sweep.options import UNMEASURED, Options
from ..sweep.plan import Call, Plan, Scores, top_is_target
from ..sweep.registry import method, run
from ..sweep.result import prompt_coords, provenance
from .attention import attention_pattern_memory, eager_attention

ROWS = ("all", "pattern")


def previous_token(ids: np.ndarray) -> np.ndarray:
    """(n, n): 1 where the key is the token just before the query."""
    return np.eye(len(ids), k=-1)


def duplicate_token(ids: np.ndarray) -> np.ndarray:
    """(n, n): 1 where an earlier key holds the query's token."""
    same = (ids[:, None] == ids[None, :]).astype(float)
    return np.tril(same, k=-1)


def induction(ids: np.ndarray) -> np.ndarray:
    """(n, n): 1 where the key follows an earlier copy of the query's token."""
    duplicate = duplicate_token(ids)
    shifted = np.zeros_like(duplicate)
    shifted[:, 1:] = duplicate[:, :-1]
    return np.tril(shifted, k=-1)


#: The named patterns ``kind`` takes.
PATTERNS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "previous_token": previous_token,
    "duplicate_token": duplicate_token,
    "induction": induction,
}


def checked_pattern(kind: Any, ids: np.ndarray) -> np.ndarray:
    """The (n, n) pattern of ``kind`` (a name or a function) for token ids ``ids``.

    Raises:
        ValueError: an unknown name, or a function whose pattern is not (n, n), not finite,
            outside [0, 1] or gives weight to a later key.
    """
    if isinstance(kind, str):
        if kind not in PATTERNS:
            raise ValueError(
                f"Unknown head pattern kind={kind!r}; choose one of {list(PATTERNS)} or pass a "
                "function of a prompt's token ids returning an (n, n) pattern."
            )
        return PATTERNS[kind](ids)
    if not callable(kind):
        raise ValueError(f"kind must be a pattern name or a function, got {kind!r}.")
    n = len(ids)
    pattern = np.asarray(kind(ids.copy()), dtype=float)
    if pattern.shape != (n, n):
        raise ValueError(
            f"The pattern function returned shape {pattern.shape} for {n} tokens; it must "
            f"return an (n, n) array (query, key), here ({n}, {n})."
        )
    if not np.isfinite(pattern).all() or pattern.min() < 0 or pattern.max() > 1:
        raise ValueError(
            "The pattern function's weights must be probabilities in [0, 1] (an attention "
            f"pattern), got values from {np.nanmin(pattern):.3g} to {np.nanmax(pattern):.3g}."
        )
    if np.triu(pattern, k=1).any():
        raise ValueError(
            "The pattern function gives weight to keys after their query; a causal model "
            "never attends there, so make it lower-triangular (np.tril)."
        )
    return pattern


def _check_scores(model: LensModel, options: Options) -> None:
    """``head_scores``' own options, before any pass (a pattern function is checked on the
    first prompt's ids by the planner, still before any pass)."""
    if isinstance(options.kind, str):
        checked_pattern(options.kind, np.zeros(1, dtype=np.int64))
    elif not callable(options.kind):
        raise ValueError(f"kind must be a pattern name or a function, got {options.kind!r}.")
    if options.rows not in ROWS:
        raise ValueError(f"Unknown rows {options.rows!r}; choose one of {list(ROWS)}.")


def plan_head_scores(call: Call) -> Plan[xr.DataArray]:
    """``head_scores`` as a plan: one clean pass per batch with every layer's pattern."""
    model, tokens, options = call.model, call.tokens, call.options
    spec = model.spec
    patterns = [checked_pattern(options.kind, np.asarray(ids)) for ids in tokens.clean_ids]
    inputs = batched(model, tokens, options.replace(metric="logit"), level="head")
    runner = get_backend(model, options.backend)
    sites = [("pattern", layer) for layer in range(spec.n_layers)]

    def score(batch: Batch, step) -> Scores:
        with torch.no_grad(), eager_attention(model):
            result = runner.run(batch.clean, sites=sites)
        values = torch.empty((len(batch.index), spec.n_layers, spec.n_heads))
        for row, prompt in enumerate(batch.index.tolist()):
            real = batch.clean.attention_mask[row].bool()
            want = torch.as_tensor(patterns[prompt], dtype=torch.float32)
            rows = (
                want.sum(1) > 0
                if options.rows == "pattern"
                else torch.ones(len(want), dtype=torch.bool)
            )
            for layer, site in enumerate(sites):
                weights = result.acts[site][row][:, real][:, :, real].float().cpu()  # (head, q, k)
                on = (weights * want)[:, rows].sum((1, 2))
                values[row, layer] = on / weights[:, rows].sum((1, 2)).clamp_min(1e-12)
        step()
        return Scores(values.flatten(1), top_is_target(result.logits, batch.target).cpu())

    name = (
        options.kind
        if isinstance(options.kind, str)
        else getattr(options.kind, "__name__", "custom")
    )

    def finish(values, correct, index) -> xr.DataArray:
        values = np.asarray(values, dtype=np.float32).reshape(-1, spec.n_layers, spec.n_heads)
        attrs = {
            "long_name": f"{name.replace('_', '-')} score (share of attention on the pattern)",
            "units": "share",
            **provenance(inputs, "head_scores"),
            "metric": "none",
            "pattern": name,
            "rows": options.rows,
            "rule": "sum(attention x pattern) / sum(attention) over the prompt's (query, key) "
            "pairs (TransformerLens detect_head, 'mul')"
            + ("; query rows with a pattern key only" if options.rows == "pattern" else ""),
        }
        coords = prompt_coords(inputs, index, correct)
        return schema.make(
            values,
            dims=("prompt", "layer", "head"),
            coords=coords,
            attrs=attrs,
            n_layers=spec.n_layers,
        )

    return Plan(inputs, spec.n_layers * spec.n_heads, score, finish, desc=f"{name} scores")


def head_scores_memory(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """Footprint of ``head_scores``: a pass keeping every layer's attention pattern."""
    one = attention_pattern_memory(model, options, work)
    patterns = model.spec.n_layers * model.spec.n_heads * work.rows * work.width**2 * 4
    return memory.Need(activations=one.activations, buffers=one.buffers + patterns)


@method(
    plan_head_scores,
    shared=UNMEASURED,
    needs_target=False,
    memory=head_scores_memory,
    checks=_check_scores,
)
def head_scores(
    model: LensModel,
    prompts: Prompts,
    *,
    kind: str | Callable[[np.ndarray], np.ndarray] = "induction",
    rows: str = "all",
    **shared,
) -> xr.DataArray:
    """Score every query head by the share of its attention that follows a pattern.

    Args:
        prompts: prompts (targets not needed), e.g. ``lsc.data.prompts("repeated")``.
        kind: "induction", "previous_token", "duplicate_token" (``PATTERNS``) or a function
            of one prompt's token ids (n,) returning an (n, n) lower-triangular pattern in
            [0, 1].
        rows: "all" (TransformerLens's ``detect_head``: divided by every query position) or
            "pattern" (only the query positions the pattern names a key for).

    Returns:
        DataArray (prompt, layer, head) in [0, 1].
    """
    return run(head_scores, locals())
