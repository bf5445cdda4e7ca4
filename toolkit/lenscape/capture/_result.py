"""Turn per-prompt tensors into validated result DataArrays with provenance."""

from __future__ import annotations

from typing import Any

import torch
import xarray as xr

from .. import schema
from ._backend import Site
from ._inputs import Inputs
from .metrics import LONG_NAMES, UNITS


def components(inputs: Inputs) -> list[tuple[Site, int | None]]:
    """The components a level measures, in result order: (site, head or None).

    Head level: ``(("z", layer), head)`` for every layer and head. Block level:
    ``(("attn", layer), None)`` and ``(("mlp", layer), None)`` for every layer.
    """
    spec = inputs.model.spec
    if inputs.level == "head":
        return [(("z", layer), head) for layer in range(spec.n_layers)
                for head in range(spec.n_heads)]
    return [((kind, layer), None) for layer in range(spec.n_layers)
            for kind in schema.BLOCK_COMPONENTS]


def to_dataarray(inputs: Inputs, values: torch.Tensor, *, method: str, effect: str,
                 **params: Any) -> xr.DataArray:
    """Wrap (prompt, n_components) values in order of ``components(inputs)``.

    Args:
        values: (prompt, n_layers * n_heads) or (prompt, n_layers * 2).
        method: the method's name for attrs (e.g. "ablation").
        effect: how the value relates to the metric, for ``long_name`` (e.g. "change in").
        params: method parameters recorded in attrs (scalars).

    Returns:
        DataArray (prompt, layer, head) or (prompt, layer, component).
    """
    spec, model = inputs.model.spec, inputs.model
    last = (spec.n_heads,) if inputs.level == "head" else (len(schema.BLOCK_COMPONENTS),)
    values = values.reshape(values.shape[0], spec.n_layers, *last)
    dims = ("prompt", "layer", "head" if inputs.level == "head" else "component")
    coords: dict[str, Any] = {"text": inputs.prompts.texts, "category": inputs.prompts.categories}
    if inputs.level == "block":
        coords["component"] = list(schema.BLOCK_COMPONENTS)
    attrs = {
        "long_name": f"{effect} {LONG_NAMES[inputs.metric]}",
        "units": UNITS[inputs.metric],
        "method": method,
        "metric": inputs.metric,
        "level": inputs.level,
        "model": model.name,
        "architecture": spec.architecture,
        "backend": inputs.backend,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "prompt_set": inputs.prompts.name,
        "n_prompts": len(inputs.prompts),
        "batch_size": inputs.batch_size,
        "padding_side": inputs.padding_side,
        **params,
    }
    return schema.make(values, dims=dims, coords=coords, attrs=attrs, n_layers=spec.n_layers)
