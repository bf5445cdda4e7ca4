"""Arithmetic of a model's parts, as its ``Computation`` describes them.

Direct logit attribution, the edge hooks and the layout self-check all compute pieces of
the model outside its own forward: each head's output in residual space (through the
output projection, and the post-attention norm linearised at the run's scale where the
family has one), a norm's scale and gain (its input gradient, and under relevance rules
its rule's: ``sweep.relevance.norm_input_gradient``), and each q/k/v receiver's rows of
a (possibly fused, possibly transposed) projection. One home keeps the self-check
checking exactly the arithmetic that capture uses, and none of it names a family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from .layouts import Computation, ModelSpec
from .lens_model import LensModel


def rms_scale(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """1 / RMS(x) over the last dim with ``norm``'s epsilon: (..., d) -> (..., 1), float32."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm_eps(norm))


def norm_eps(norm: torch.nn.Module) -> float:
    """A norm's epsilon (``variance_epsilon`` or ``eps``)."""
    return float(getattr(norm, "variance_epsilon", 0.0) or getattr(norm, "eps", 1e-6))


def norm_weight(norm: torch.nn.Module, offset: float) -> torch.Tensor:
    """The norm's effective gain: weight + ``offset`` (1 for Gemma's ``1 + w``), float32."""
    return cast(torch.Tensor, norm.weight).float() + offset


def norm_scale(x: torch.Tensor, norm: torch.nn.Module, computation: Computation) -> torch.Tensor:
    """The norm's per-position scale of x (..., d) -> (..., 1), float32: 1 / RMS(x) for an
    RMSNorm, 1 / std(x) (biased, as LayerNorm) for a LayerNorm."""
    if computation.norm == "layer":
        x = x.float()
        return torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + norm_eps(norm))
    return rms_scale(x, norm)


def norm_gain(norm: torch.nn.Module, computation: Computation) -> torch.Tensor:
    """The norm's gain, (d,) float32: weight (+ the RMSNorm offset), ones without a weight."""
    if getattr(norm, "weight", None) is None:
        return torch.ones(())
    return norm_weight(norm, 0.0 if computation.norm == "layer" else computation.norm_offset)


def apply_norm(x: torch.Tensor, norm: torch.nn.Module, computation: Computation) -> torch.Tensor:
    """The described formula of ``norm`` on x (..., d), float32 (the self-check compares it
    with the module's own output)."""
    x = x.float()
    if computation.norm == "layer":
        x = x - x.mean(-1, keepdim=True)
    out = x * norm_scale(x, norm, computation) * norm_gain(norm, computation)
    bias = getattr(norm, "bias", None)
    return out if bias is None else out + bias.float()


def linear_weight(module: torch.nn.Module, computation: Computation) -> torch.Tensor:
    """A projection's weight as (out, in), whatever its storage (``transposed``: GPT-2's
    ``Conv1D`` keeps (in, out)); a view, never a copy."""
    weight = cast(torch.Tensor, module.weight)
    return weight.T if computation.transposed else weight


def per_head(z: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Each head's output through its own columns of the output projection: z (..., n_heads,
    d_head) and w_o (d_model, n_heads, d_head) -> (..., n_heads, d_model).

    One matrix product per head on strided views: an einsum would copy the whole weight into
    head-major order on every call (Llama-3-8B's o_proj in bfloat16, 4 prompts of 14 tokens,
    one CPU thread: 135 ms of the einsum's 148 ms, against 17 ms this way).
    """
    return torch.stack([z[..., h, :] @ w_o[:, h].T for h in range(w_o.shape[1])], dim=-2)


def output_columns(model: LensModel, layer: int) -> torch.Tensor:
    """W_O of block ``layer`` as (d_model, n_heads, d_head), in the model's dtype."""
    spec = model.spec
    weight = linear_weight(model.module(spec.layout.o_proj, layer), spec.computation)
    return weight.reshape(spec.d_model, spec.n_heads, spec.d_head)


def post_norm_shares(
    heads: torch.Tensor, total: torch.Tensor, norm: torch.nn.Module, computation: Computation
) -> torch.Tensor:
    """The post-norm's output split among its parts, linearised at the run's own scale.

    Each part (a head's output) is multiplied by the norm's per-position scale and gain
    computed from ``total``, the norm's whole input (after centring each part for a
    LayerNorm), so the parts sum to the norm's output (less a LayerNorm's bias).

    Args:
        heads: (..., n, d) the parts, summing to ``total``.
        total: (..., d) the norm's input.

    Returns:
        (..., n, d) float32.
    """
    heads = heads.float()
    if computation.norm == "layer":
        heads = heads - heads.mean(-1, keepdim=True)
    scale = norm_scale(total, norm, computation)[..., None, :]
    return heads * scale * norm_gain(norm, computation)


def head_outputs(model: LensModel, layer: int, z: torch.Tensor) -> torch.Tensor:
    """Per-head outputs in residual space: z (batch, n_heads, d_head) -> (batch, n_heads,
    d_model), float32. Without a post-norm: without the output projection's bias (a
    constant). With one: linearised at the run's scale (``post_norm_shares``), the bias's
    share split equally among the heads, so the heads sum to the block's output."""
    spec, computation = model.spec, model.spec.computation
    out = per_head(z.float(), output_columns(model, layer).float())
    if computation.post_attn_norm:
        norm = model.module(computation.post_attn_norm, layer)
        bias = getattr(model.module(spec.layout.o_proj, layer), "bias", None)
        if bias is not None:
            out = out + bias.float() / spec.n_heads
        out = post_norm_shares(out, out.sum(-2), norm, computation)
    return out


# --------------------------------------------------------------------- q/k/v receivers


@dataclass(frozen=True)
class Projection:
    """One q/k/v projection of a block and the receivers it computes.

    Attributes:
        path: the (possibly fused) linear module, within a block.
        receivers: its receivers among the block's attention receivers (q heads, then k
            heads, then v heads: ``Graph.attn_receivers``).
        columns: its output columns in receiver order, (n * d_head,), or None when they
            are already in that order.
        norm: the projection-wide QK-norm applied to its output (the receivers' values are
            read there), or None.
        kind: "q", "k", "v" or "qkv" (fused), for messages and gradient leaves.
    """

    path: str
    receivers: slice
    columns: tuple[int, ...] | None
    norm: str | None
    kind: str

    @property
    def splice(self) -> str:
        """The module whose output holds this projection's receivers' values."""
        return self.norm or self.path

    @property
    def count(self) -> int:
        return self.receivers.stop - self.receivers.start


def projections(spec: ModelSpec) -> tuple[Projection, ...]:
    """A block's q/k/v projections, as ``spec.computation`` describes them.

    Raises:
        ValueError: a per-head fused projection with fewer key/value heads than query heads
            (its columns would not say which query group a key/value head serves).
    """
    c, n_q, n_kv, d = spec.computation, spec.n_heads, spec.n_kv_heads, spec.d_head
    kinds = (
        ("q", slice(0, n_q)),
        ("k", slice(n_q, n_q + n_kv)),
        ("v", slice(n_q + n_kv, n_q + 2 * n_kv)),
    )
    if not c.fused:
        norms = {"q": c.q_norm, "k": c.k_norm} if c.qk_norm == "projection" else {}
        return tuple(
            Projection(path, rows, None, norms.get(kind), kind)
            for path, (kind, rows) in zip(c.qkv, kinds, strict=True)
        )
    columns = None
    if c.qkv_order == "per_head":
        if n_kv != n_q:
            raise ValueError(
                f"A fused q/k/v projection interleaved per head ({c.qkv[0]}) needs as many "
                f"key/value heads as query heads, not {n_kv} and {n_q}; describe its column "
                "order with lsc.ArchLayout(qkv_order=...)."
            )
        columns = tuple(
            head * 3 * d + part * d + i
            for part in range(3)
            for head in range(n_q)
            for i in range(d)
        )
    return (Projection(c.qkv[0], slice(0, n_q + 2 * n_kv), columns, None, "qkv"),)


def receiver_rows(
    model: LensModel, layer: int, projection: Projection
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The projection's weight rows and bias in receiver order: (n * d_head, d_model) and
    (n * d_head,) or None (views where the order is the stored one)."""
    module = model.module(projection.path, layer)
    weight = linear_weight(module, model.spec.computation)
    bias = getattr(module, "bias", None)
    if projection.columns is not None:
        index = torch.as_tensor(projection.columns, device=weight.device)
        weight = weight.index_select(0, index)
        bias = None if bias is None else bias.index_select(0, index)
    return weight, bias


def rebuild(
    model: LensModel,
    layer: int,
    projection: Projection,
    normed: torch.Tensor,
    like: torch.Tensor,
) -> torch.Tensor:
    """The projection's output with each receiver's values computed from its own input.

    Args:
        normed: (batch, pos, n, d_model) each receiver's input after the block's q/k/v
            input norm, in receiver order.
        like: the projection's own output (batch, pos, width), for its layout.

    Returns:
        (batch, pos, width): what the splice module (``Projection.splice``) would output,
        receiver r's columns computed from ``normed[:, :, r]``.
    """
    d_head, n = model.spec.d_head, projection.count
    if projection.norm is not None:  # every receiver's whole projection through the norm
        module = model.module(projection.path, layer)
        full = model.module(projection.norm, layer).forward(module.forward(normed))
        own = full.unflatten(-1, (n, d_head)).diagonal(dim1=2, dim2=3)  # (b, p, d_head, n)
        return own.transpose(-1, -2).flatten(2)
    weight, bias = receiver_rows(model, layer, projection)
    out = torch.einsum("bpnd,nkd->bpnk", normed, weight.reshape(n, d_head, -1))
    if bias is not None:
        out = out + bias.view(n, d_head)
    out = out.flatten(2)
    if projection.columns is None:
        return out
    placed = torch.empty_like(like)
    placed[..., list(projection.columns)] = out
    return placed
