"""Turn per-prompt tensors into validated result DataArrays with provenance
(``LensModel.provenance``, the one place that writes the attrs naming what produced a result)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from .. import schema
from .backend import Site
from .inputs import Inputs
from .metrics import LONG_NAMES, UNITS

#: The levels a per-component result is measured at: per head, or per attention/MLP block.
LEVELS = ("head", "block")


def components(inputs: Inputs) -> list[tuple[Site, int | None]]:
    """The components a level measures, in result order: (site, head or None).

    Head level: ``(("z", layer), head)`` for every layer and head. Block level:
    ``(("attn", layer), None)`` and ``(("mlp", layer), None)`` for every layer.
    """
    spec = inputs.model.spec
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
        values: (k, n_layers * n_heads) or (k, n_layers * 2), torch or numpy.
        correct: (k,) bool: the model's top clean prediction is the target (coord
            ``correct`` on ``prompt``).
        method: the method's name for attrs (e.g. "ablation").
        effect: how the value relates to the metric, for ``long_name`` (e.g. "change in").
        index: positions of the k prompts in the prompt list (default: all of them).
        params: method parameters recorded in attrs (scalars).

    Returns:
        DataArray (prompt, layer, head) or (prompt, layer, component), with the coords
        ``text``, ``category`` and ``correct`` on ``prompt``.
    """
    spec = inputs.model.spec
    coords = prompt_coords(inputs, index, correct)
    last = (spec.n_heads,) if inputs.level == "head" else (len(schema.BLOCK_COMPONENTS),)
    values = values.reshape(len(coords["prompt"]), spec.n_layers, *last)
    dims = ("prompt", "layer", "head" if inputs.level == "head" else "component")
    if inputs.level == "block":
        coords["component"] = list(schema.BLOCK_COMPONENTS)
    attrs = {
        "long_name": f"{effect} {LONG_NAMES[inputs.metric]}",
        "units": UNITS[inputs.metric],
        **provenance(inputs, method, level=inputs.level),
        **params,
    }
    return schema.make(values, dims=dims, coords=coords, attrs=attrs, n_layers=spec.n_layers)
