"""Attention patterns: where each query position of one prompt looks, per head.

``attention_pattern(model, "The Eiffel Tower is in", layer=5, head=3)`` runs one forward
pass and returns the softmaxed attention weights of that head as a DataArray
(query_pos, key_pos) whose ``query_token`` / ``key_token`` coords hold the tokens, so
``lsc.heatmap(pattern, x="key_pos", y="query_pos")`` labels its ticks with them. Heads are
query heads: a grouped-query model (SmolLM2: 9 query heads sharing 3 key/value heads)
gives one pattern per query head. Both backends read the same thing (the HF attention
module's weights under nnsight, ``hook_pattern`` under TransformerLens); nnsight needs the
model's eager attention, which is switched on for the pass only. Given a list of prompts
it is a planned method like the others: (prompt, head, query_pos, key_pos), each prompt at
its own positions from 0, streamed with ``store=`` or scored on dask workers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from .. import schema
from ..data import Prompt, PromptSet
from ..models import LensModel
from ..sweep import memory
from ..sweep.backend import get_backend
from ..sweep.inputs import Batch, Tokens, batched
from ..sweep.options import UNMEASURED, Options
from ..sweep.plan import Call, Plan, Scores, top_is_target
from ..sweep.positions import token_labels
from ..sweep.registry import method, run
from ..sweep.result import prompt_coords, provenance


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


def _single(prompts: Any) -> bool:
    return isinstance(prompts, (str, Prompt))


def _as_prompts(prompts: Any, options: Options) -> Any:
    """One prompt or a list (texts or ``Prompt``s) as a ``PromptSet``: a ``Prompt`` keeps
    its text, target and category (the target says whether the model answers it right), a
    text has no target."""
    if isinstance(prompts, Tokens):
        return prompts
    given = [prompts] if _single(prompts) else prompts
    if isinstance(given, (bytes, dict)) or not isinstance(given, (list, tuple, PromptSet)):
        raise ValueError(
            f"prompt must be a non-empty string or lsc.data.Prompt (or a list of them), got "
            f"{prompts!r}."
        )
    for p in given:
        if not isinstance(p, (str, Prompt)) or not (p if isinstance(p, str) else p.text).strip():
            raise ValueError(f"prompt must be a non-empty string or lsc.data.Prompt, got {p!r}.")
    return PromptSet(
        [
            Prompt(p, "") if isinstance(p, str) else Prompt(p.text, p.target, category=p.category)
            for p in given
        ]
    )


def plan_attention_pattern(call: Call) -> Plan[xr.DataArray]:
    """``attention_pattern`` as a plan: one clean pass per batch (eager attention). Per
    prompt, the columns hold every chosen head's (query_pos, key_pos) weights at the
    prompt's own positions (NaN past its end)."""
    model, tokens, options = call.model, call.tokens, call.options
    spec = model.spec
    layer = options.layer
    if (
        not isinstance(layer, (int, np.integer))
        or isinstance(layer, bool)
        or not 0 <= layer < spec.n_layers
    ):
        raise ValueError(
            f"layer={layer!r} is not a layer of this model; pass an int in 0..{spec.n_layers - 1}."
        )
    layer = int(layer)
    heads = _heads(options.head, spec.n_heads)
    inputs = batched(model, tokens, options.replace(metric="logit"), level="head")
    runner, site, width = get_backend(model, options.backend), ("pattern", layer), tokens.width

    def score(batch: Batch, step) -> Scores:
        with torch.no_grad(), eager_attention(model):
            run = runner.run(batch.clean, sites=[site])
        pattern = run.acts[site][:, heads].float().cpu()  # (batch, head, query, key)
        out = torch.full((len(batch.index), len(heads), width, width), float("nan"))
        for row, mask in enumerate(batch.clean.attention_mask.bool().cpu()):
            n = int(mask.sum())
            out[row, :, :n, :n] = pattern[row][:, mask][:, :, mask]
        step()
        # the pass's own logits at the read position: whether the model answers right
        # (kept as the ``correct`` coord only when every prompt has a target)
        return Scores(out.flatten(1), top_is_target(run.logits, batch.target).cpu())

    def finish(values, correct, index) -> xr.DataArray:
        values = np.asarray(values, dtype=np.float32).reshape(-1, len(heads), width, width)
        coords = prompt_coords(inputs, index, correct)
        labels = np.full((len(coords["prompt"]), width), "", dtype=object)
        for i, prompt in enumerate(coords["prompt"]):
            ids = tokens.clean_ids[prompt]
            labels[i, : len(ids)] = token_labels(model.tokenizer, ids)
        positions = np.arange(width)
        coords |= {
            "head": heads,
            "query_pos": positions,
            "key_pos": positions,
            "query_token": (("prompt", "query_pos"), labels.astype(str)),
            "key_token": (("prompt", "key_pos"), labels.astype(str)),
        }
        attrs = {
            "long_name": "attention weight",
            "units": "probability",
            **provenance(inputs, "attention_pattern"),
            "metric": "none",
        }
        da = schema.make(
            values, dims=("prompt", "head", "query_pos", "key_pos"), coords=coords, attrs=attrs
        )
        return da.assign_coords(layer=layer)

    return Plan(inputs, len(heads) * width * width, score, finish, desc="attention patterns")


def _one_or_all(result: xr.DataArray, options: Options, prompts: Any) -> xr.DataArray:
    """What ``attention_pattern`` returns: for one prompt (query_pos, key_pos) per head with
    its text in attrs; for one head (an int) without the head dim."""
    if _single(prompts):
        one = result.isel(prompt=0).load()
        attrs = {**one.attrs, "text": str(one["text"].values)}
        labels = [n for n in ("prompt", "text", "category", "correct") if n in one.coords]
        one = one.drop_vars(labels).assign_attrs(attrs)
        result = one
    if isinstance(options.head, (int, np.integer)):
        return result.squeeze("head")
    return result


def attention_pattern_memory(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """Footprint of ``attention_pattern``: a pass without gradients with eager attention,
    the kept (batch, head, query, key) pattern of its layer and the float32 patterns of
    every prompt."""
    spec = model.spec
    pattern = spec.n_heads * work.width * work.width
    kept = work.rows * pattern * (memory.element_bytes(model.dtype) + 2 * 4)
    return memory.Need(
        activations=memory.forward_pass(model, work.rows, work.width)
        + work.rows * work.width * spec.n_heads * work.width * 4,
        buffers=kept + work.n_prompts * pattern * 4,
    )


@method(
    plan_attention_pattern,
    memory=attention_pattern_memory,
    shared=UNMEASURED,
    needs_target=False,
    read_prompts=_as_prompts,
    view=_one_or_all,
)
def attention_pattern(
    model: LensModel, prompts: Any, *, layer: int, head: int | Sequence[int] | None = None, **shared
) -> xr.DataArray:
    """Attention weights at one layer, for one prompt or a list.

    Args:
        prompts: a text or a ``Prompt`` (its clean ``text`` is run; its ``target``, one
            token, says whether the model answers it right), or a list of them.
        layer: the block, 0..n_layers-1.
        head: a query head, a list of them, or None for every query head.
        backend: "nnsight" or "transformer_lens"; both give the same numbers.

    Returns:
        For one prompt: DataArray (query_pos, key_pos) for one head (``head`` a scalar
        coord), else (head, query_pos, key_pos); each query row sums to 1 over the key
        positions it may see (the rest are 0: causal masking). Coords ``query_token`` and
        ``key_token`` hold the tokens; attrs the provenance and the ``text``. For a list:
        a ``prompt`` dim first, each prompt at its own positions from 0 (NaN past its end,
        tokens ""), with ``text`` and ``category`` on ``prompt``, and ``correct`` (the
        model's top token at the last position is the target, from the same pass) when
        every prompt has a target; otherwise no ``correct`` and the attr ``correct_note``
        says why (``aggregate.correct_only`` refuses such a result).

    Raises:
        ValueError: empty text, a text longer than the model's context, unknown backend,
            a layer or head the model lacks, or a target that is not one token.
    """
    return run(attention_pattern, locals())
