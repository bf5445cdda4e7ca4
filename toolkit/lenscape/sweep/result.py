"""Turn per-prompt tensors into validated result DataArrays with provenance
(``LensModel.provenance``, the one place that writes the attrs naming what produced a result)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from .. import schema
from .backend import Site, heads_of
from .inputs import Inputs
from .metrics import LONG_NAMES, UNITS
from .positions import token_labels

#: The levels a per-component result is measured at: per head, or per attention/MLP block.
LEVELS = ("head", "block")
#: ... and, for the node methods that resolve positions, the residual stream entering each
#: block (``("resid_pre", layer)``; only by position or span).
NODE_LEVELS = (*LEVELS, "resid")


def components(inputs: Inputs) -> list[tuple[Site, int | None]]:
    """The components a level measures, in result order: (site, head or None).

    Head level: ``(("z", layer), head)`` for every layer and head. Block level:
    ``(("attn", layer), None)`` and ``(("mlp", layer), None)`` for every layer. Resid
    level: ``(("resid_pre", layer), None)`` for every layer. With ``inputs.part`` "q",
    "k" or "v": ``((part, layer), head)``, over the key/value heads for "k" and "v"; with
    "pattern", the "z" sites (a head's output with its pattern swapped,
    ``capture/patching/pattern``).
    """
    spec = inputs.model.spec
    if inputs.level == "resid":
        return [(("resid_pre", layer), None) for layer in range(spec.n_layers)]
    if inputs.level == "head" and inputs.part in ("q", "k", "v"):
        heads = heads_of(spec, inputs.part)
        return [
            ((inputs.part, layer), head) for layer in range(spec.n_layers) for head in range(heads)
        ]
    if inputs.level == "head":
        return [
            (("z", layer), head) for layer in range(spec.n_layers) for head in range(spec.n_heads)
        ]
    return [
        ((kind, layer), None) for layer in range(spec.n_layers) for kind in schema.BLOCK_COMPONENTS
    ]


def untargeted(inputs: Inputs) -> int:
    """How many of the call's prompts have no target (a method that takes texts alone:
    the logit lens of a plain text, attention patterns)."""
    return int((inputs.tokens.target < 0).sum())


def prompt_coords(inputs: Inputs, index: Sequence[int] | None, correct: Any) -> dict[str, Any]:
    """Coords of the ``prompt`` dim for prompts ``index`` (None: all): ``prompt`` (their
    positions in the prompt list), ``text``, ``category`` and ``correct`` ((k,) bool).

    ``correct`` is there only when every prompt of the call has a target: without one,
    whether the model answers a prompt right is unknown, and a flag would be made up
    (``provenance`` then writes ``correct_note``). The whole call decides, so every batch
    of a streamed result has the coords of its layout."""
    prompts = inputs.prompts
    rows = range(len(prompts)) if index is None else [int(i) for i in index]
    coords: dict[str, Any] = {
        "prompt": np.asarray(rows, dtype=np.int64),
        "text": ("prompt", [prompts[i].text for i in rows]),
        "category": ("prompt", [prompts[i].category for i in rows]),
    }
    if not untargeted(inputs):
        coords["correct"] = ("prompt", np.asarray(correct, dtype=bool))
    return coords


def correct_note(inputs: Inputs) -> dict[str, str]:
    """The attr saying why a result has no ``correct`` coord (``prompt_coords``); empty
    when it has one."""
    missing = untargeted(inputs)
    if not missing:
        return {}
    return {
        "correct_note": f"no correct coord: {missing} of {len(inputs.prompts)} prompts have "
        "no target, so whether the model answers them right is unknown; give every prompt "
        "a target (lsc.data.Prompt(text, target)) to record it"
    }


def provenance(
    inputs: Inputs, method: str, *, level: str | None = None, **params: Any
) -> dict[str, Any]:
    """The attrs naming what produced a result measured on ``inputs``: the model's
    (``LensModel.provenance``), the run's options (``level`` where it has one) and the
    prompt list, then ``params``."""
    model = inputs.model
    return model.provenance(
        method,
        backend=inputs.backend,
        metric=inputs.metric,
        **({} if level is None else {"level": level}),
        device=str(model.device),
        prompt_set=inputs.prompts.name,
        n_prompts=len(inputs.prompts),
        prompts_sha256=inputs.fingerprint,
        batch_size=inputs.batch_size,
        padding_side=inputs.padding_side,
        **correct_note(inputs),
        **params,
    )


def position_coords(inputs: Inputs, rows: Sequence[int]) -> dict[str, Any]:
    """Coords of the cells of ``inputs.positions`` for prompts ``rows``: for "each" ``pos``
    and ``token`` (prompt, pos), each token's text ("" past a prompt's end); for "spans"
    ``span`` (names in prompt order, "other" last) and ``span_text`` (prompt, span), the
    text of a prompt's tokens in the span ("" where it has none, " ... " between the
    runs of "other"). Empty for "all"."""
    tokens, tokenizer = inputs.tokens, inputs.model.tokenizer
    if inputs.positions == "each":
        labels = np.full((len(rows), tokens.width), "", dtype=object)
        for i, prompt in enumerate(rows):
            ids = tokens.clean_ids[prompt]
            labels[i, : len(ids)] = token_labels(tokenizer, ids)
        return {"pos": np.arange(tokens.width), "token": (("prompt", "pos"), labels.astype(str))}
    if inputs.positions != "spans":
        return {}
    assert tokens.spans is not None and tokens.span_names is not None  # ``inputs.batched``
    names = list(tokens.span_names)
    texts = np.full((len(rows), len(names)), "", dtype=object)
    for i, prompt in enumerate(rows):
        ids, held = tokens.clean_ids[prompt], tokens.spans[prompt] or {}
        pieces = token_labels(tokenizer, ids)
        for k, name in enumerate(names[:-1]):
            texts[i, k] = "".join(pieces[at] for at in held.get(name, []))
        named = {at for positions in held.values() for at in positions}
        runs: list[list[str]] = [[]]  # the "other" tokens, in runs of neighbours
        for at in range(len(ids)):
            if at in named:
                runs.append([])
            else:
                runs[-1].append(pieces[at])
        texts[i, -1] = " ... ".join("".join(run) for run in runs if run)
    return {
        "span": np.asarray(names, dtype=str),
        "span_text": (("prompt", "span"), texts.astype(str)),
    }


def span_order(inputs: Inputs) -> dict[str, str]:
    """The ``span_order`` attr of a ``positions="spans"`` result: its spans in prompt
    order as a JSON list, so a view draws them in that order after a ``sortby`` or
    ``isel`` of ``span`` (``views.encoding.in_label_order``); empty otherwise."""
    if inputs.positions != "spans" or inputs.tokens.span_names is None:
        return {}
    return {"span_order": json.dumps(list(inputs.tokens.span_names))}


def to_dataarray(
    inputs: Inputs,
    values: Any,
    *,
    correct: Any,
    method: str,
    effect: str,
    index: Sequence[int] | None = None,
    **params: Any,
) -> xr.DataArray:
    """Wrap (prompt, n_components) values in order of ``components(inputs)``.

    Args:
        values: (k, n_layers * n_heads * n_cells) or (k, n_layers * 2 * n_cells), or (k,
            n_layers * n_cells) at level "resid", torch or numpy (``inputs.n_cells`` cells
            per component, last: 1 for ``positions="all"``).
        correct: (k,) bool: the model's top clean prediction is the target (coord
            ``correct`` on ``prompt``).
        method: the method's name for attrs (e.g. "ablation").
        effect: how the value relates to the metric, for ``long_name`` (e.g. "change in").
        index: positions of the k prompts in the prompt list (default: all of them).
        params: method parameters recorded in attrs (scalars).

    Returns:
        DataArray (prompt, layer, head) or (prompt, layer, component), then ``pos`` or
        ``span`` with ``positions`` "each" or "spans" ((prompt, layer, pos | span) at level
        "resid"), with the coords ``text``, ``category`` and ``correct`` on ``prompt``
        (``position_coords`` on the cells).
    """
    spec = inputs.model.spec
    coords = prompt_coords(inputs, index, correct)
    rows = coords["prompt"].tolist()
    heads = heads_of(spec, inputs.part)
    last = {"head": (heads,), "block": (len(schema.BLOCK_COMPONENTS),), "resid": ()}
    head_dim = "kv_head" if inputs.part in ("k", "v") else "head"
    dims: tuple[str, ...] = {
        "head": ("prompt", "layer", head_dim),
        "block": ("prompt", "layer", "component"),
        "resid": ("prompt", "layer"),
    }[inputs.level]
    cells: tuple[int, ...] = ()
    if inputs.positions != "all":
        cells = (inputs.n_cells,)
        dims = (*dims, "pos" if inputs.positions == "each" else "span")
        coords |= position_coords(inputs, rows)
    values = values.reshape(len(rows), spec.n_layers, *last[inputs.level], *cells)
    if inputs.level == "block":
        coords["component"] = list(schema.BLOCK_COMPONENTS)
    positional = {} if inputs.positions == "all" else {"positions": inputs.positions}
    positional |= span_order(inputs)
    if inputs.part != "out":
        positional["part"] = inputs.part
    attrs = {
        "long_name": f"{effect} {LONG_NAMES[inputs.metric]}",
        "units": UNITS[inputs.metric],
        **provenance(inputs, method, level=inputs.level),
        **positional,
        **params,
    }
    return schema.make(values, dims=dims, coords=coords, attrs=attrs, n_layers=spec.n_layers)
