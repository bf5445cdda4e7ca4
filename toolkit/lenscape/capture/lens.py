"""Logit lens: what the model would predict if it stopped after each block.

``logit_lens(model, "The Eiffel Tower is in the city of", target=" Paris")`` runs one
forward pass, keeps the residual stream after every block (the input of the next block,
and after the last block the input of the final norm) at every position, and reads each
one through the model's own final norm and unembedding (and Gemma's final logit
soft-capping). The last layer is therefore the model's own output; earlier layers show
where, and how early, the answer forms. The result is the target token's probability as
a DataArray (layer, pos) with the rank of the target and the top tokens as coords, ready
for ``lsc.heatmap(lens, x="pos", y="layer")``.

Given a list of prompts it is a planned method like the others: (prompt, layer, pos), each
prompt's positions from 0 (NaN and "" past its end), streamed with ``store=`` and resumed,
or scored on dask workers with ``client=``. Per prompt, the plan's columns hold, for every
layer and position, p(target), the target's rank and the top tokens' ids and probabilities,
then the target's id; ``finish`` decodes them into the labels.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
import xarray as xr

from .. import schema
from ..data import Prompt, PromptSet, as_prompt_set
from ..models import LensModel
from ..sweep import memory
from ..sweep.backend import Site, get_backend
from ..sweep.inputs import Batch, Inputs, Tokens, batched
from ..sweep.options import UNMEASURED, Options
from ..sweep.plan import Call, Plan, Scores, top_is_target
from ..sweep.registry import method, run
from ..sweep.result import prompt_coords, provenance
from .attention import token_labels

#: Top tokens listed per cell in the ``top_tokens`` coord.
TOP_K = 5
#: Numbers per (layer, pos) cell in a plan's columns: p(target), rank, TOP_K ids and probs.
CELL = 2 + 2 * TOP_K
SINGLE = (str, Prompt, dict)


def _as_prompts(prompts: Any, options: Options) -> Any:
    """One prompt or a list of them (texts, ``Prompt``s or record dicts) as a ``PromptSet``
    (``Tokens`` of a composite method pass through); ``options.target``, when given,
    replaces every prompt's target, and a plain text without it follows the model's own
    prediction (an empty target).

    Raises:
        TypeError: a prompt or target of the wrong type.
    """
    if isinstance(prompts, Tokens):
        return prompts
    target = options.target
    if target is not None and not isinstance(target, str):
        raise TypeError(
            f"target must be a string (one token, e.g. ' Paris') or None, got "
            f"{type(target).__name__} ({target!r})."
        )
    if target is not None and not target.strip():
        raise ValueError(
            f"target {target!r} is empty; give the token to follow with its leading space "
            "(e.g. ' Paris'), or target=None for the model's own prediction."
        )
    given = [prompts] if isinstance(prompts, SINGLE) else prompts
    if isinstance(given, (str, bytes)) or not isinstance(given, (list, tuple, PromptSet)):
        raise TypeError(
            f"prompts must be a string, an lsc.data.Prompt, a record dict with 'text' and "
            f"'target', or a list of them, got {type(prompts).__name__} ({prompts!r}); e.g. "
            "'The Eiffel Tower is in the city of'."
        )
    prompt_set = as_prompt_set([Prompt(p, "") if isinstance(p, str) else p for p in given])
    if target is None:
        return prompt_set
    return PromptSet([replace(p, target=target) for p in prompt_set], name=prompt_set.name)


def lens_sites(n_layers: int) -> list[Site]:
    """The residual stream after each block ``0..n_layers-1``: the input of block
    ``layer + 1``, and after the last block the input of the final norm."""
    return [("resid_pre", layer + 1) for layer in range(n_layers - 1)] + [("resid_final", -1)]


def read_out(model: LensModel, resid: torch.Tensor) -> torch.Tensor:
    """Residual streams (..., d_model) through the final norm and unembedding (and the
    final logit soft-capping where the config has one) -> logits (..., vocab), float32."""
    hf, layout = model.hf, model.spec.layout
    final_norm = hf.get_submodule(layout.final_norm)
    unembed = hf.get_submodule(layout.unembed)
    # ``forward`` directly: module hooks (standing edits on the final norm's input) have
    # already acted on the residual stream the backend kept.
    logits = unembed.forward(final_norm.forward(resid)).float()
    cap = getattr(hf.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _cells(model: LensModel, acts: dict, sites: list[Site], target: torch.Tensor) -> torch.Tensor:
    """(batch, layer, pos, CELL) numbers of each cell read from the kept residual streams
    ``acts`` (batch, pos, d_model) at ``sites``: p(target), its rank, the top ids and probs.
    ``target``: (batch,) token ids."""
    rows = torch.arange(len(target), device=target.device)
    layers = []
    for site in sites:  # one layer at a time: never (layer, pos, vocab) at once
        probs = torch.softmax(read_out(model, acts[site]), dim=-1)  # (batch, pos, vocab)
        chosen = probs[rows, :, target]  # (batch, pos)
        rank = (probs > chosen[..., None]).sum(-1)
        top = probs.topk(TOP_K, dim=-1)
        layers.append(
            torch.cat([chosen[..., None], rank[..., None], top.indices, top.values], dim=-1)
        )
    return torch.stack(layers, 1).float()


def _at_prompt_positions(cells: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """``cells`` (batch, layer, padded pos, CELL) moved to each prompt's own positions
    0..len-1 of ``width`` (NaN past its end), whatever the padding side."""
    rows, n_layers, _, n = cells.shape
    out = cells.new_full((rows, n_layers, width, n), float("nan"))
    for row in range(rows):
        real = mask[row].bool()
        out[row, :, : int(real.sum())] = cells[row][:, real]
    return out


def plan_logit_lens(call: Call) -> Plan[xr.DataArray]:
    """``logit_lens`` as a plan: one clean pass per batch. No pre-pass."""
    model, tokens, options = call.model, call.tokens, call.options
    inputs = batched(model, tokens, options.replace(metric="logit"), level="head")
    sites, width = lens_sites(model.spec.n_layers), tokens.width
    runner = get_backend(model, options.backend)

    def score(batch: Batch, step) -> Scores:
        with torch.no_grad():
            run = runner.run(batch.clean, sites=sites)
            rows = torch.arange(len(batch.index), device=model.device)
            final = read_out(model, run.acts[sites[-1]][rows, batch.clean.read_pos])
            target = torch.where(batch.target >= 0, batch.target, final.argmax(-1))
            cells = _cells(model, run.acts, sites, target)
        placed = _at_prompt_positions(cells.cpu(), batch.clean.attention_mask.cpu(), width)
        values = torch.cat([placed.flatten(1), target.cpu().float()[:, None]], dim=1)
        step()
        # against the given target only: the model's own prediction is right by
        # construction (``prompt_coords`` records no ``correct`` for such a call)
        return Scores(values, top_is_target(run.logits, batch.target).cpu())

    return Plan(
        inputs,
        model.spec.n_layers * width * CELL + 1,
        score,
        lambda values, correct, index: _lens_result(inputs, values, correct, index),
        desc="logit lens",
    )


def _labels(tokenizer: Any, ids: np.ndarray) -> np.ndarray:
    """Token labels of an array of float ids, "" where an id is NaN (decoding each once)."""
    known = np.isfinite(ids)
    shown, where = np.unique(ids[known].astype(np.int64), return_inverse=True)
    labels = np.full(ids.shape, "", dtype=object)
    labels[known] = np.asarray(token_labels(tokenizer, shown.tolist()), dtype=object)[where]
    return labels.astype(str)


def _lens_result(inputs: Inputs, values: Any, correct: Any, index: Any) -> xr.DataArray:
    """The labelled (prompt, layer, pos) result of the plan's ``values`` for prompts
    ``index`` (see the module docstring for the columns)."""
    model, tokens = inputs.model, inputs.tokens
    tokenizer, n_layers = model.tokenizer, model.spec.n_layers
    values = np.asarray(values, dtype=np.float32)
    cells = values[:, :-1].reshape(len(values), n_layers, tokens.width, CELL)
    coords = prompt_coords(inputs, index, correct)
    rows = coords["prompt"]
    top_ids, top_probs = cells[..., 2 : 2 + TOP_K], cells[..., 2 + TOP_K :]
    top_labels = _labels(tokenizer, top_ids)
    top_tokens = np.full(top_labels.shape[:-1], "", dtype=object)
    for cell in zip(*np.nonzero(np.isfinite(top_probs[..., 0])), strict=True):
        top_tokens[cell] = " | ".join(
            f"{str(t)!r} {p:.2f}" for t, p in zip(top_labels[cell], top_probs[cell], strict=True)
        )
    token = np.full((len(rows), tokens.width), np.nan)
    for i, prompt in enumerate(rows):
        ids = tokens.clean_ids[prompt]
        token[i, : len(ids)] = ids
    given = [bool(tokens.prompts[int(prompt)].target) for prompt in rows]
    rank = cells[..., 1]
    coords |= {
        "layer": np.arange(n_layers),
        "pos": np.arange(tokens.width),
        "token": (("prompt", "pos"), _labels(tokenizer, token)),
        "target": ("prompt", _labels(tokenizer, values[:, -1])),
        "target_source": ("prompt", ["given" if g else "model's top prediction" for g in given]),
        "target_rank": (
            ("prompt", "layer", "pos"),
            np.where(np.isfinite(rank), rank, -1).astype(np.int64),
        ),
        "top_token": (("prompt", "layer", "pos"), top_labels[..., 0]),
        "top_tokens": (("prompt", "layer", "pos"), top_tokens.astype(str)),
    }
    attrs = {
        "long_name": "p(target) read through the final norm and unembedding",
        "units": "probability",
        **provenance(inputs, "logit_lens"),
        "metric": "none",
    }
    da = schema.make(
        cells[..., 0],
        dims=("prompt", "layer", "pos"),
        coords=coords,
        attrs=attrs,
        n_layers=n_layers,
    )
    return da.rename("target_prob")


def _one_or_all(result: xr.DataArray, options: Options, prompts: Any) -> xr.DataArray:
    """What ``logit_lens`` returns: for one prompt its (layer, pos) map with the prompt's
    text and target in attrs, for a list the (prompt, layer, pos) result."""
    if not isinstance(prompts, SINGLE):
        return result
    one = result.isel(prompt=0).load()
    target = str(one["target"].values)
    attrs = {
        **one.attrs,
        "long_name": f"p({target!r}) read through the final norm and unembedding",
        "text": str(one["text"].values),
        "target": target,
        "target_source": str(one["target_source"].values),
    }
    dropped = [
        name
        for name in one.coords
        if name in ("prompt", "text", "category", "correct", "target", "target_source")
    ]
    return one.drop_vars(dropped).assign_attrs(attrs)


def logit_lens_memory(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """Footprint of ``logit_lens``: a pass without gradients keeping the residual stream
    after every block, one layer's (batch, pos, vocab) read-out at a time (float32 logits,
    probabilities, the rank comparison) and the per-cell numbers of every prompt."""
    spec, tokens = model.spec, work.rows * work.width
    kept = spec.n_layers * tokens * spec.d_model * memory.element_bytes(model.dtype)
    read_out = 3 * tokens * spec.vocab_size * 4
    cells = 2 * (work.rows + work.n_prompts) * spec.n_layers * work.width * CELL * 4
    return memory.Need(
        activations=memory.forward_pass(model, work.rows, work.width),
        buffers=kept + read_out + cells,
    )


@method(
    plan_logit_lens,
    memory=logit_lens_memory,
    shared=UNMEASURED,
    needs_target=False,
    read_prompts=_as_prompts,
    view=_one_or_all,
)
def logit_lens(
    model: LensModel, prompts: Any, *, target: str | None = None, **shared
) -> xr.DataArray:
    """The target's probability when each layer's residual stream is read as the output.

    Args:
        prompts: one prompt (a text, an ``lsc.data.Prompt`` or a record dict: its ``text``
            is run) or a list of them.
        target: the token to follow, with its leading space (e.g. " Paris"), for every
            prompt; default: each prompt's target, or for a plain text the model's own top
            prediction at the last position (coord/attr ``target_source`` says which).
        backend: "nnsight" or "transformer_lens"; both give the same numbers.

    Returns:
        For one prompt, DataArray ``target_prob`` (layer, pos): p(target) from the residual
        stream after block ``layer`` at position ``pos``; the last layer is the model's own
        softmax. Coords: ``layer``, ``depth`` (layer), ``pos``, ``token`` (pos, the input
        token's text), ``target_rank`` (layer, pos; int, 0 = the top token), ``top_token``
        (layer, pos; str) and ``top_tokens`` (layer, pos; str, the top 5 with their
        probabilities, "' Paris' 0.41 | ' London' 0.12 | ..."). Attrs: provenance,
        ``text``, ``target``, ``target_source``. For a list: (prompt, layer, pos), each
        prompt from position 0, NaN past its end (``target_rank`` -1, tokens ""), with
        ``text``, ``category``, ``target`` and ``target_source`` on ``prompt``, and
        ``correct`` (the model's top prediction is the target) when every prompt has a
        target; a prompt that follows the model's own prediction has no answer to judge,
        so then there is no ``correct`` and the attr ``correct_note`` says why.

    Raises:
        TypeError: a prompt or target of the wrong type.
        ValueError: an empty text, a text longer than the model's context, a target that
            is not one token, or an unknown backend.
    """
    return run(logit_lens, locals())
