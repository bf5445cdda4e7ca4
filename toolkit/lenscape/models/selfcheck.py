"""Self-check of a model's layout: do the hooked parts add up to what the model computes?

Capture code trusts the layout and the computation it describes
(``lenscape.models.layouts``: ``ArchLayout``, ``Computation``) to say where the per-head
outputs, the attention and MLP contributions, the final norm and the unembedding live,
what each q/k/v receiver and each MLP reads, and each norm's formula. A wrong path or a
missed normalisation would give wrong attributions without a word, so on load one forward
pass over a short probe text checks these identities against the model's own
activations:

- ``heads``: per block, the per-head outputs through ``o_proj`` (each head's slice of the
  ``o_proj`` input times its columns of W_O, plus the bias, through the post-attention norm
  linearised at the run's scale where the family has one) sum to the attention output;
- ``residual``: per block, the residual stream entering it plus its attention and MLP
  outputs equals the residual stream leaving it (so the embedding plus every block's
  contributions equals the final residual stream);
- ``logits``: the final norm (its described formula) and the unembedding (with final logit
  soft-capping where the family has it) of the final residual stream equal the model's
  logits (at the last position);
- ``embed``: the token embedding (plus the learned position embedding where the family has
  one) equals the residual stream entering block 0 (the edge graph's ``embed`` sender);
- ``receivers``: per block, every q, k and v head recomputed from the block's input through
  the described q/k/v input norm and that head's rows of its projection (fused or not,
  in the described column order and storage, through a projection-wide QK-norm) equals the
  model's own values (what the edge hooks rebuild per receiver), and a QK-norm spans what
  the description says (d_head per head, or the whole projection);
- ``mlp_input``: per block, the MLP's input (that of its norm) equals the block's input
  (parallel residual) or the block's input plus its attention output (sequential);
- ``norms``: per block, the q/k/v input norm, the MLP's input norm and the MLP's post-norm
  compute the described formula (LayerNorm or RMSNorm, the gain's offset) on their input,
  as the closed-form gradients and the relevance rules assume.

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
from .parts import apply_norm, head_outputs, projections, rebuild

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
    "embed": "the token (and position) embedding equals the residual stream entering block 0",
    "receivers": "every q, k and v head recomputed from the block's input through the "
    "described norm and projection rows equals the model's",
    "mlp_input": "the MLP reads the block's input plus its attention output (sequential) or "
    "the block's input (parallel), as the description says",
    "norms": "the block's norms compute the described formula",
}
#: The identities measured per layer (the others are one number).
PER_LAYER = ("heads", "residual", "receivers", "mlp_input", "norms")
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


#: A probe: (module, "in" or "out", the key its activation is kept under, first of a
#: tuple output).
Probe = tuple[torch.nn.Module, str, tuple[str, int], bool]


def _probes(model: LensModel) -> list[Probe]:
    """Where the check reads the model: every site its identities compare.

    Raises:
        LayoutCheckError: a module the layout names does not exist.
    """
    layout, c = model.spec.layout, model.spec.computation

    def module(path: str, layer: int | None = None) -> torch.nn.Module:
        full = path if layer is None else f"{layout.layers}.{layer}.{path}"
        try:
            return model.hf.get_submodule(full)
        except AttributeError as err:
            raise LayoutCheckError(
                f"The layout of {model.name} names a module that does not exist: '{full}'; "
                "fix the layout (lsc.load(..., layout=...))."
            ) from err

    probes: list[Probe] = [
        (module(layout.embed), "out", ("embed", -1), False),
        (module(layout.final_norm), "in", ("resid_final", -1), False),
    ]
    if c.position_embed:
        probes.append((module(c.position_embed), "out", ("positions", -1), False))
    norms = {"attn_norm": c.attn_norm, "mlp_norm": c.mlp_norm, "post_mlp_norm": c.post_mlp_norm}
    for layer in range(model.spec.n_layers):
        probes += [
            (module(layout.layers)[layer], "in", ("resid_pre", layer), False),  # type: ignore[index]
            (module(layout.o_proj, layer), "in", ("z", layer), False),
            (module(layout.attn_out, layer), "out", ("attn", layer), layout.attn_out_tuple),
            (module(layout.mlp_out, layer), "out", ("mlp", layer), False),
            (module(c.mlp_norm or c.mlp, layer), "in", ("mlp_in", layer), False),
        ]
        for role, path in norms.items():
            if path is not None:
                probes.append((module(path, layer), "in", (f"{role}:in", layer), False))
                probes.append((module(path, layer), "out", (f"{role}:out", layer), False))
        for i, projection in enumerate(_projections(model)):
            probes.append((module(projection.splice, layer), "out", (f"qkv{i}", layer), False))
    return probes


def _projections(model: LensModel) -> tuple[Any, ...]:
    """The q/k/v projections the description gives, or none where it cannot say (the
    ``receivers`` identity then fails)."""
    try:
        return projections(model.spec)
    except ValueError:
        return ()


def _capture(model: LensModel, input_ids: torch.Tensor) -> tuple[Acts, torch.Tensor]:
    """One forward pass keeping the activations ``_probes`` names.

    Returns:
        (acts, logits): acts maps (site, layer) to (pos, ...) tensors of the single probe
        row (sites: "resid_pre", "z", "attn", "mlp", "mlp_in", "qkv<i>", "<norm>:in" and
        ":out" per layer; "embed", "positions", "resid_final" at layer -1); logits (1,
        vocab) at the last position.
    """
    acts: Acts = {}

    def keep_input(key: tuple[str, int]) -> Callable[..., None]:
        def hook(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            acts[key] = (args[0] if args else kwargs["hidden_states"])[0].detach()

        return hook

    def keep_output(key: tuple[str, int], first_of_tuple: bool) -> Callable[..., None]:
        def hook(_: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            acts[key] = (output[0] if first_of_tuple else output)[0].detach()

        return hook

    handles: list[torch.utils.hooks.RemovableHandle] = []
    try:
        for module, side, key, first in _probes(model):
            if side == "in":
                handles.append(module.register_forward_pre_hook(keep_input(key), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(keep_output(key, first)))
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
    if bias is None or spec.computation.post_attn_norm:  # a post-norm's heads carry it
        return total
    return total + bias.float()


def _final_logits(model: LensModel, resid: torch.Tensor) -> torch.Tensor:
    """Final norm, unembedding and soft-capping of resid (pos, d_model) -> (pos, vocab)."""
    layout, c = model.spec.layout, model.spec.computation
    normed = apply_norm(resid, model.hf.get_submodule(layout.final_norm), c)
    unembed = model.hf.get_submodule(layout.unembed)
    # In the weights' own dtype, as the model does: no float32 copy of the (vocab, d_model)
    # matrix per check.
    logits = (normed.to(unembed.weight.dtype) @ unembed.weight.T).float()
    if getattr(unembed, "bias", None) is not None:
        logits = logits + unembed.bias.float()
    cap = c.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _receivers(model: LensModel, layer: int, acts: Acts) -> float:
    """The ``receivers`` mismatch of block ``layer``: every projection's receiver values
    rebuilt from the block's input (each receiver from its own copy) against the model's,
    and a QK-norm of the described span."""
    spec, c = model.spec, model.spec.computation
    found = _projections(model)
    if not found:
        return math.inf
    resid = acts[("resid_pre", layer)][None]
    norm = None if c.attn_norm is None else model.module(c.attn_norm, layer)
    worst = 0.0
    for i, projection in enumerate(found):
        actual = acts[(f"qkv{i}", layer)][None]
        own = resid[:, :, None].expand(-1, -1, projection.count, -1)
        with torch.no_grad():
            normed = own if norm is None else norm.forward(own)
            try:
                computed = rebuild(model, layer, projection, normed, actual)
            except RuntimeError:  # the rows cannot be split as described
                return math.inf
        worst = max(worst, _mismatch(computed, actual))
    if c.qk_norm is not None:
        span = spec.d_head if c.qk_norm == "head" else None
        for path, heads in ((c.q_norm, spec.n_heads), (c.k_norm, spec.n_kv_heads)):
            assert path is not None
            size = getattr(model.module(path, layer), "weight", torch.empty(0)).numel()
            if size != (span or heads * spec.d_head):
                return math.inf
    return worst


class _Stop(Exception):
    """Ends a probe pass once block 0's heads are known."""


def _leak(model: LensModel, input_ids: torch.Tensor) -> float:
    """Whether each q/k/v receiver's columns reach its own head(s) and no other: per
    receiver of block 0, one pass (stopped at block 0's ``o_proj``) with a perturbation
    added to the columns the description gives it, at the splice module's output, against
    one pass the same way with nothing added. (Not against the probe pass's ``o_proj``
    input: that pass, with the check's capture hooks and run first, can round otherwise;
    on an AVX-512 CPU at two threads gemma3-270m's other heads then "moved" by 1e-4 of the
    perturbed head's change in 3 of 35 fresh loads, failing the check of a right layout.
    Passes made the same way agree bit for bit.)

    Returns:
        The largest change of a head the receiver does not feed, relative to the largest
        change of the heads it feeds (0 when the columns are right; inf when they reach
        none of them).
    """
    spec = model.spec
    group, d_head = spec.n_heads // spec.n_kv_heads, spec.d_head
    found, worst = _projections(model), 0.0
    if not found:
        return math.inf
    o_proj = model.module(spec.layout.o_proj, 0)
    z = _perturbed_heads(model, input_ids, model.module(found[0].splice, 0), [], o_proj)
    for projection in found:
        splice = model.module(projection.splice, 0)
        for j in range(projection.count):
            r = projection.receivers.start + j
            own = [r] if r < spec.n_heads else []
            if not own:  # a key/value head feeds its query group
                g = (r - spec.n_heads) % spec.n_kv_heads
                own = list(range(g * group, (g + 1) * group))
            span = range(j * d_head, (j + 1) * d_head)
            columns = [projection.columns[i] for i in span] if projection.columns else list(span)
            changed = _perturbed_heads(model, input_ids, splice, columns, o_proj) - z
            changed = changed.view(changed.shape[0], spec.n_heads, d_head).abs().amax((0, 2))
            inside = float(changed[own].max())
            others = [h for h in range(spec.n_heads) if h not in own]
            outside = float(changed[others].max()) if others else 0.0
            worst = max(worst, outside / inside if inside > 0 else math.inf)
    return worst


def _perturbed_heads(
    model: LensModel,
    input_ids: torch.Tensor,
    splice: torch.nn.Module,
    columns: list[int],
    o_proj: torch.nn.Module,
) -> torch.Tensor:
    """Block 0's ``o_proj`` input, (pos, n_heads * d_head) float32, with a fixed
    perturbation added to ``columns`` of ``splice``'s output."""
    kept: dict[str, torch.Tensor] = {}

    def perturb(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        output = output.clone()
        if columns:
            n = output.shape[1] * len(columns)
            noise = torch.linspace(-1.0, 1.0, n, device=output.device)
            scale = output.abs().amax().clamp_min(1e-3)
            output[..., columns] += (noise.view(1, -1, len(columns)) * scale).to(output.dtype)
        return output

    def stop(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        kept["z"] = args[0][0].detach().float()
        raise _Stop

    handles = [splice.register_forward_hook(perturb), o_proj.register_forward_pre_hook(stop)]
    try:
        with torch.no_grad():
            model.hf(input_ids=input_ids, logits_to_keep=1)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return kept["z"]


def _block_identities(model: LensModel, layer: int, acts: Acts) -> dict[str, float]:
    """The ``mlp_input`` and ``norms`` mismatches of block ``layer``."""
    c = model.spec.computation
    before, attn = acts[("resid_pre", layer)].float(), acts[("attn", layer)].float()
    expected = before if c.parallel else before + attn
    mlp_in = acts[("mlp_in", layer)]
    mlp = _mismatch(expected, mlp_in) if expected.shape == mlp_in.shape else math.inf
    norms = 0.0
    for role, path in (("attn_norm", c.attn_norm), ("mlp_norm", c.mlp_norm)):
        if path is not None:
            x, y = acts[(f"{role}:in", layer)], acts[(f"{role}:out", layer)]
            norms = max(norms, _mismatch(apply_norm(x, model.module(path, layer), c), y))
    if c.post_mlp_norm is not None:
        x, y = acts[("post_mlp_norm:in", layer)], acts[("post_mlp_norm:out", layer)]
        norms = max(norms, _mismatch(apply_norm(x, model.module(c.post_mlp_norm, layer), c), y))
    return {"mlp_input": mlp, "norms": norms}


def _residuals(model: LensModel, acts: Acts, logits: torch.Tensor) -> dict[str, Any]:
    """Every identity's mismatch: per layer (``PER_LAYER``) or one number."""
    spec = model.spec
    values = {name: np.full(spec.n_layers, np.nan) for name in PER_LAYER}
    for layer in range(spec.n_layers):
        z, attn = acts[("z", layer)], acts[("attn", layer)]
        try:
            values["heads"][layer] = _mismatch(_head_sum(model, layer, z), attn)
        except RuntimeError:  # z or W_O cannot be split into (n_heads, d_head)
            values["heads"][layer] = math.inf
        after = (
            acts[("resid_pre", layer + 1)]
            if layer + 1 < spec.n_layers
            else acts[("resid_final", -1)]
        )
        before, mlp = acts[("resid_pre", layer)], acts[("mlp", layer)]
        values["residual"][layer] = (
            _mismatch(before.float() + attn.float() + mlp.float(), after)
            if all(p.shape == after.shape for p in (before, attn, mlp))
            else math.inf
        )
        values["receivers"][layer] = _receivers(model, layer, acts)
        for name, value in _block_identities(model, layer, acts).items():
            values[name][layer] = value
    resid_final = acts[("resid_final", -1)]
    final = (
        _mismatch(_final_logits(model, resid_final[-1:]), logits)
        if resid_final.shape[-1] == spec.d_model
        else math.inf
    )
    embed = acts[("embed", -1)].float()
    if ("positions", -1) in acts:
        embed = embed + acts[("positions", -1)].float()
    first = acts[("resid_pre", 0)]
    embedded = _mismatch(embed, first) if embed.shape == first.shape else math.inf
    return {**values, "logits": final, "embed": embedded}


def _with_leak(model: LensModel, input_ids: torch.Tensor, values: dict) -> None:
    """Add the column check (``_leak``, block 0) to the ``receivers`` identity."""
    if np.all(np.isfinite(values["receivers"])):
        leak = _leak(model, input_ids)
        values["receivers"][0] = max(values["receivers"][0], leak)


def check(model: LensModel, *, strict: bool = True) -> xr.Dataset:
    """Verify the model's layout on a short probe text (runs on load unless check=False).

    Args:
        model: a ``LensModel``.
        strict: raise ``LayoutCheckError`` when an identity fails; with False, only return.

    Returns:
        Dataset of relative mismatches, one variable per identity (``IDENTITIES``): per
        layer (``PER_LAYER``: ``heads``, ``residual``, ``receivers``, ``mlp_input``,
        ``norms``) or one number (``logits``, ``embed``); attrs ``tolerance``, ``dtype``,
        ``passed``, ``probe_tokens``.

    Raises:
        LayoutCheckError: (a ValueError) naming the identity, the first layer where it
            fails and the size of the mismatch.
    """
    strict = _validate.flag("strict", strict)
    input_ids = torch.tensor([model.tokenizer(PROBE_TEXT)["input_ids"]], device=model.device)
    acts, logits = _capture(model, input_ids)
    values = _residuals(model, acts, logits)
    _with_leak(model, input_ids, values)
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
            name: schema.make(values[name], dims=("layer",), attrs=attrs, n_layers=n_layers)
            if name in PER_LAYER
            else xr.DataArray(values[name], attrs=attrs)
            for name in IDENTITIES
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
