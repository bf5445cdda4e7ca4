"""Attention patterns: where each query position of one prompt looks, per head.

``attention_pattern(model, "The Eiffel Tower is in", layer=5, head=3)`` runs one forward
pass and returns the softmaxed attention weights of that head as a DataArray
(query_pos, key_pos) whose ``query_token`` / ``key_token`` coords hold the tokens, so
``lsc.heatmap(pattern, x="key_pos", y="query_pos")`` labels its ticks with them. Heads are
query heads: a grouped-query model (SmolLM2: 9 query heads sharing 3 key/value heads)
gives one pattern per query head. Both backends read the same thing (the HF attention
module's weights under nnsight, ``hook_pattern`` under TransformerLens); nnsight needs the
model's eager attention, which is switched on for the pass only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from .. import _validate, schema
from ..data import Prompt
from ..models import LensModel
from ..sweep.backend import BACKENDS, get_backend
from ..sweep.inputs import pad
from ..sweep.options import DEFAULTS


@contextlib.contextmanager
def eager_attention(model: LensModel) -> Iterator[None]:
    """Within the block, the HF model computes attention explicitly (its modules return
    the weights); the previous implementation (e.g. SDPA) is restored afterwards."""
    hf = model.hf
    previous = hf.config._attn_implementation
    if previous == "eager":
        yield
        return
    hf.set_attn_implementation("eager")
    try:
        yield
    finally:
        hf.set_attn_implementation(previous)


def token_labels(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token as the text it decodes to (leading spaces kept, newlines shown as ⏎)."""
    return [tokenizer.decode([i]).replace("\n", "⏎") for i in ids]


def _heads(head: int | Sequence[int] | None, n_heads: int) -> list[int]:
    if head is None:
        heads: list[Any] = list(range(n_heads))
    elif isinstance(head, (int, np.integer)):
        heads = [head]
    elif isinstance(head, (list, tuple, range, np.ndarray)):
        heads = list(head)
    else:  # a float, a string, a tensor ...: never iterated into something else
        heads = [head]
    bad = [
        h
        for h in heads
        if not isinstance(h, (int, np.integer)) or isinstance(h, bool) or not 0 <= h < n_heads
    ]
    if bad or not heads:
        raise ValueError(
            f"head={head!r} is not a query head of this model; pass an int in "
            f"0..{n_heads - 1}, a list of them, or None for all heads."
        )
    return [int(h) for h in heads]


def attention_pattern(
    model: LensModel,
    prompt: str | Prompt,
    *,
    layer: int,
    head: int | Sequence[int] | None = None,
    backend: str = DEFAULTS.backend,
) -> xr.DataArray:
    """Attention weights of one prompt at one layer.

    Args:
        model: a loaded model (``lsc.load``).
        prompt: the text, or a ``Prompt`` (its clean ``text`` is used).
        layer: the block, 0..n_layers-1.
        head: a query head, a list of them, or None for every query head.
        backend: "nnsight" or "transformer_lens"; both give the same numbers.

    Returns:
        DataArray (query_pos, key_pos) for one head (``head`` a scalar coord), else
        (head, query_pos, key_pos); each query row sums to 1 over the key positions it may
        see (the rest are 0: causal masking). Coords ``query_token`` and ``key_token`` hold
        the tokens; attrs the provenance and the ``text``.

    Raises:
        ValueError: empty text, a text longer than the model's context, unknown backend,
            or a layer or head the model lacks.
    """
    text = prompt.text if isinstance(prompt, Prompt) else prompt
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"prompt must be a non-empty string or lsc.data.Prompt, got {prompt!r}.")
    _validate.choice("backend", backend, BACKENDS)
    spec = model.spec
    if (
        not isinstance(layer, (int, np.integer))
        or isinstance(layer, bool)
        or not 0 <= layer < spec.n_layers
    ):
        raise ValueError(
            f"layer={layer!r} is not a layer of this model; pass an int in 0..{spec.n_layers - 1}."
        )
    heads = _heads(head, spec.n_heads)
    ids = model.tokenizer(text)["input_ids"]
    model.check_context([len(ids)], what="text")
    tokens = pad([ids], model.tokenizer.pad_token_id, "right").to(model.device)
    site = ("pattern", int(layer))
    with torch.no_grad(), eager_attention(model):
        pattern = get_backend(model, backend).run(tokens, sites=[site]).acts[site]
    values = pattern[0, heads].float().cpu().numpy()  # (head, query_pos, key_pos)
    labels = token_labels(model.tokenizer, ids)
    positions = np.arange(len(ids))
    da = schema.make(
        values,
        dims=("head", "query_pos", "key_pos"),
        coords={
            "head": heads,
            "query_pos": positions,
            "key_pos": positions,
            "query_token": labels,
            "key_token": labels,
        },
        attrs={
            "long_name": "attention weight",
            "units": "probability",
            "metric": "none",
            **model.provenance("attention_pattern", backend=backend, text=text),
        },
    )
    da = da.assign_coords(layer=int(layer))
    return da.squeeze("head") if isinstance(head, (int, np.integer)) else da
