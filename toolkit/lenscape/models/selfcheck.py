"""Self-check of a model's layout: do the hooked parts add up to what the model computes?

Capture code trusts the layout (``lenscape.models.layouts``) to say where the per-head outputs,
the attention and MLP contributions, the final norm and the unembedding live. A wrong
path or a missed normalisation would give wrong attributions without a word, so on load
one forward pass over a short probe text checks three identities against the model's own
activations:

- ``heads``: per block, the per-head outputs through ``o_proj`` (each head's slice of the
  ``o_proj`` input times its columns of W_O, plus the bias, through the post-attention norm
  where the family has one) sum to the attention output;
- ``residual``: per block, the residual stream entering it plus its attention and MLP
  outputs equals the residual stream leaving it (so the embedding plus every block's
  contributions equals the final residual stream);
- ``logits``: the final norm and the unembedding (with final logit soft-capping where the
  family has it) of the final residual stream equal the model's logits (at the last
  position).

Each mismatch is relative: max |computed - model| / max |model| over the probe's
positions. ``TOLERANCES`` holds the limit per dtype: float rounding of one extra sum or
norm stays far below it, a wrong layout is off by order 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xarray as xr

from .. import _validate, schema
from .lens_model import LensModel
from .parts import head_outputs, norm_weight, rms_scale

#: Relative mismatch allowed per model dtype (see the module docstring). The check recomputes
#: in float32, as direct logit attribution does, so float64 models get float32's limit.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-4,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
#: identity -> what it says.
IDENTITIES: dict[str, str] = {
    "heads": "the per-head outputs through o_proj sum to the attention output",
    "residual": "the residual stream entering the block plus its attention and MLP outputs "
    "equals the residual stream leaving it",
    "logits": "the final norm and unembedding of the final residual stream equal the "
    "model's logits",
}
PROBE_TEXT = "The capital of France is Paris, and 12 + 30 = 42."
#: (site, layer) -> (pos, ...) activations of the probe row; see ``_capture``.
Acts = dict[tuple[str, int], torch.Tensor]


class LayoutCheckError(ValueError):
    """A layout identity does not hold for the model in hand."""


def _mismatch(computed: torch.Tensor, actual: torch.Tensor) -> float:
    """max |computed - actual| / max |actual|; inf when the shapes differ."""
    if computed.shape != actual.shape:
        return math.inf
    actual = actual.float()
    scale = actual.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return float((computed.float() - actual).abs().max() / scale)


def _capture(model: LensModel, input_ids: torch.Tensor) -> tuple[Acts, torch.Tensor]:
    """One forward pass keeping the layout's sites.

    Returns:
        (acts, logits): acts maps ("resid_pre" | "z" | "attn" | "mlp", layer) and
        ("resid_final", -1) to (pos, ...) tensors of the single probe row; logits (1, vocab)
        at the last position.
    """
    layout = model.spec.layout
    acts: Acts = {}
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def module(path: str) -> torch.nn.Module:
        try:
            return model.hf.get_submodule(path)
        except AttributeError as err:
            raise LayoutCheckError(
                f"The layout of {model.name} names a module that does not exist: '{path}'; "
                "fix the layout (lsc.load(..., layout=...))."
            ) from err

    def keep_input(key: tuple[str, int]) -> Callable[..., None]:
        def hook(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            acts[key] = (args[0] if args else kwargs["hidden_states"])[0].detach()

        return hook

    def keep_output(key: tuple[str, int], first_of_tuple: bool) -> Callable[..., None]:
        def hook(_: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            acts[key] = (output[0] if first_of_tuple else output)[0].detach()

        return hook

    try:
        for layer in range(model.spec.n_layers):
            block = f"{layout.layers}.{layer}"
            handles += [
                module(block).register_forward_pre_hook(
                    keep_input(("resid_pre", layer)), with_kwargs=True
                ),
                module(f"{block}.{layout.o_proj}").register_forward_pre_hook(
                    keep_input(("z", layer)), with_kwargs=True
                ),
                module(f"{block}.{layout.attn_out}").register_forward_hook(
                    keep_output(("attn", layer), layout.attn_out_tuple)
                ),
                module(f"{block}.{layout.mlp_out}").register_forward_hook(
                    keep_output(("mlp", layer), False)
                ),
            ]
        handles.append(
            module(layout.final_norm).register_forward_pre_hook(
                keep_input(("resid_final", -1)), with_kwargs=True
            )
        )
        with torch.no_grad():
            # Logits at the last position only: the unembedding of every position would
            # cost as much as the rest of the pass on big-vocabulary models.
            logits = model.hf(input_ids=input_ids, logits_to_keep=1).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    return acts, logits


def _head_sum(model: LensModel, layer: int, z: torch.Tensor) -> torch.Tensor:
    """Sum over heads of the per-head outputs, as direct logit attribution computes them.

    Args:
        z: (pos, n_heads * d_head), the ``o_proj`` input.

    Returns:
        (pos, d_model) in float32.
    """
    spec = model.spec
    heads = head_outputs(model, layer, z.view(z.shape[0], spec.n_heads, spec.d_head))
    total = heads.sum(1)
    bias = getattr(model.module(spec.layout.o_proj, layer), "bias", None)
    return total if bias is None else total + bias.float()


def _final_logits(model: LensModel, resid: torch.Tensor) -> torch.Tensor:
    """Final norm, unembedding and soft-capping of resid (pos, d_model) -> (pos, vocab)."""
    layout, x = model.spec.layout, resid.float()
    norm = model.hf.get_submodule(layout.final_norm)
    if layout.layer_norm:
        bias = getattr(norm, "bias", None)
        eps = getattr(norm, "eps", 0.0) or getattr(norm, "variance_epsilon", 1e-5)
        normed = torch.nn.functional.layer_norm(
            x, x.shape[-1:], norm.weight.float(), None if bias is None else bias.float(), eps
        )
    else:
        normed = x * rms_scale(x, norm) * norm_weight(norm, layout.norm_offset)
    unembed = model.hf.get_submodule(layout.unembed)
    # In the weights' own dtype, as the model does: no float32 copy of the (vocab, d_model)
    # matrix per check.
    logits = (normed.to(unembed.weight.dtype) @ unembed.weight.T).float()
    if getattr(unembed, "bias", None) is not None:
        logits = logits + unembed.bias.float()
    cap = getattr(model.hf.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _residuals(model: LensModel, acts: Acts, logits: torch.Tensor) -> dict[str, Any]:
    spec = model.spec
    heads, residual = np.full(spec.n_layers, np.nan), np.full(spec.n_layers, np.nan)
    for layer in range(spec.n_layers):
        z, attn = acts[("z", layer)], acts[("attn", layer)]
        try:
            heads[layer] = _mismatch(_head_sum(model, layer, z), attn)
        except RuntimeError:  # z or W_O cannot be split into (n_heads, d_head)
            heads[layer] = math.inf
        after = (
            acts[("resid_pre", layer + 1)]
            if layer + 1 < spec.n_layers
            else acts[("resid_final", -1)]
        )
        before, mlp = acts[("resid_pre", layer)], acts[("mlp", layer)]
        residual[layer] = (
            _mismatch(before.float() + attn.float() + mlp.float(), after)
            if all(p.shape == after.shape for p in (before, attn, mlp))
            else math.inf
        )
    resid_final = acts[("resid_final", -1)]
    final = (
        _mismatch(_final_logits(model, resid_final[-1:]), logits)
        if resid_final.shape[-1] == spec.d_model
        else math.inf
    )
    return {"heads": heads, "residual": residual, "logits": final}


def check(model: LensModel, *, strict: bool = True) -> xr.Dataset:
    """Verify the model's layout on a short probe text (runs on load unless check=False).

    Args:
        model: a ``LensModel``.
        strict: raise ``LayoutCheckError`` when an identity fails; with False, only return.

    Returns:
        Dataset of relative mismatches: ``heads`` (layer), ``residual`` (layer) and
        ``logits`` (scalar); attrs ``tolerance``, ``dtype``, ``passed``, ``probe_tokens``.

    Raises:
        LayoutCheckError: (a ValueError) naming the identity, the first layer where it
            fails and the size of the mismatch.
    """
    strict = _validate.flag("strict", strict)
    input_ids = torch.tensor([model.tokenizer(PROBE_TEXT)["input_ids"]], device=model.device)
    acts, logits = _capture(model, input_ids)
    values = _residuals(model, acts, logits)
    tolerance = TOLERANCES.get(model.dtype, TOLERANCES[torch.float32])
    # NaN (a module not reached by the forward pass) fails like any mismatch.
    passed = {name: bool(np.all(np.asarray(v) <= tolerance)) for name, v in values.items()}
    attrs = {
        "long_name": "Layout self-check mismatch",
        "units": "relative",
        "metric": "relative mismatch",
        **model.provenance(
            "check",
            tolerance=tolerance,
            passed=all(passed.values()),
            probe_tokens=int(input_ids.shape[1]),
        ),
    }
    n_layers = model.spec.n_layers
    result = xr.Dataset(
        {
            "heads": schema.make(values["heads"], dims=("layer",), attrs=attrs, n_layers=n_layers),
            "residual": schema.make(
                values["residual"], dims=("layer",), attrs=attrs, n_layers=n_layers
            ),
            "logits": xr.DataArray(values["logits"], attrs=attrs),
        },
        attrs=attrs,
    )
    if strict:
        for name in IDENTITIES:
            if not passed[name]:
                raise LayoutCheckError(_failure(model, name, result[name], tolerance))
    return result


def _failure(model: LensModel, identity: str, mismatch: xr.DataArray, tolerance: float) -> str:
    if "layer" in mismatch.dims:
        bad = np.flatnonzero(~(mismatch.values <= tolerance))
        where = (
            f"at layer {bad[0]} (of layers {bad.tolist()} that fail)"
            if len(bad) > 1
            else f"at layer {bad[0]}"
        )
        size = float(mismatch.values[bad[0]])
    else:
        where, size = "at the output", float(mismatch)
    return (
        f"Layout self-check failed for {model.name} ({model.spec.architecture}): "
        f"'{identity}' ({IDENTITIES[identity]}) is off by {size:.2g} (relative; tolerance "
        f"{tolerance:g} for {str(model.dtype).removeprefix('torch.')}) {where}; the "
        "layout does not match this model: fix it with lsc.load(..., layout=...) or skip "
        "the check with check=False."
    )
