"""The hooks that give every receiver its own copy of the residual stream.

Each receiver gets its own copy of the residual stream: module hooks on the Hugging Face
model rebuild q, k and v head by head from that copy through the block's q/k/v input norm
and the head's rows of its projection (``models.parts.rebuild``: separate or fused,
interleaved or not, stored (out, in) or (in, out), with a projection-wide QK-norm where the
model has one), and add ``delta_r`` to the input of the MLP's norm (or of the MLP) and of
the final norm (only the receiver sees it; the residual stream itself flows on unchanged).
With ``delta_r = -sum over patched senders s of (current_s - other_s)``, ``r`` reads those
senders' values from another run and every other sender as it is in this one: exact edge
patching of any set of edges in one forward pass.

What each hook does is read from the model's ``Computation`` (``models.layouts``), never
from a family name: the residual topology (under a parallel residual a block's MLP reads
the block's input, so its receiver's patch counts only the senders upstream of the block),
the norms' places, the projection's column order, the post-norms (a head's sender output
is linearised at the run's own scale: ``models.parts.post_norm_shares``, so the senders
sum exactly to the block's output and patching every edge gives the other run).

Edge attribution needs the gradient at each receiver's own input, d(metric)/d(delta_r) at
``delta_r = 0``, without the per-receiver copies: the pass runs unedited, with zero leaf
tensors added to the outputs of the q/k/v projections (or of a projection-wide QK-norm) and
to the inputs of the MLP's norm and of the final norm. A q, k or v receiver's input
gradient is then its head's output gradient taken back through its rows of the projection
and through the block's norm at that block's input (``receiver_gradients``: the norm's
input gradient in closed form per chunk of receivers), the same numbers as the copies
would give, in the memory of one ordinary backward pass.

Supported: every family whose ``Computation`` the layout self-check verified, on the
nnsight backend, whose passes run the Hugging Face module these hooks sit on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from ... import _validate
from ...models import LensModel
from ...models.parts import (
    Projection,
    linear_weight,
    output_columns,
    per_head,
    post_norm_shares,
    projections,
    rebuild,
    receiver_rows,
)
from ...sweep import metrics
from ...sweep.backend import BACKENDS, TokenBatch, get_backend
from ...sweep.inputs import Batch, Inputs
from ...sweep.relevance import norm_input_gradient
from .graph import Graph, SpanGraph

#: Runs that can hook the Hugging Face module the edge hooks sit on.
EDGE_BACKENDS = ("nnsight",)


@dataclass
class SpanPatch:
    """Which edges between (component, span) nodes read the other run in one pass.

    Attributes:
        graph: the edges by span.
        weights: (n_spans, n_senders, n_receivers) of ``graph``: 1 where the edge reads the
            other run, 0 where it reads this one.
        cells: (batch, pos, n_spans) float, 1 where a token of the batch belongs to a span
            (``Batch.cells``).
    """

    graph: SpanGraph
    weights: torch.Tensor
    cells: torch.Tensor
    _by_query: dict = field(default_factory=dict)

    def base_weights(self, span: int, query_span: int | None) -> torch.Tensor:
        """(n_senders, n_base_receivers) the weights of edges at ``span`` with k and v
        receivers read by queries at ``query_span`` (None: k and v read this run)."""
        key = (span, query_span)
        if key not in self._by_query:
            columns = self.graph.columns_by_query[query_span or 0]
            columns = torch.as_tensor(columns, device=self.weights.device)
            weights = self.weights[span][:, columns]
            if query_span is None:
                kinds = np.asarray([kind for kind, _, _ in self.graph.base.receivers])
                keep = torch.as_tensor(~np.isin(kinds, ("k", "v")), device=weights.device)
                weights = weights * keep.to(weights.dtype)
            self._by_query[key] = weights
        return self._by_query[key]

    @functools.cached_property
    def query_spans(self) -> list[tuple[int, ...]]:
        """Per block, the query spans whose k or v receivers there read the other run."""
        graph = self.graph
        return [
            tuple(
                t
                for t in range(graph.n_spans)
                if bool(self.weights[:, :, graph.kv_receivers(layer, t)].any())
            )
            for layer in range(graph.base.n_layers)
        ]


@dataclass
class Pass:
    """What the hooks of one forward pass read and write.

    Attributes:
        graph: the model's edges.
        deltas: zero leaves whose gradients are the receivers' gradients: ("mlp", layer)
            and ("logits", -1) -> (batch, pos, d_model) added to the MLP's and the final
            norm's input; (kind, layer) for each projection's kind ("q", "k", "v", or
            "qkv" when fused: ``models.parts.Projection``) -> (batch, pos, n * d_head)
            added to that projection's receiver values (see ``receiver_gradients``), or
            ("attn", layer) -> (batch, pos, n_heads + 2 n_kv_heads, d_model) added to each
            q, k, v receiver's own copy of its input.
        other: (batch, pos, n_senders, d_model) sender outputs of another run; with
            ``patched``, receivers read the patched senders from it.
        patched: (n_senders, n_receivers) weight of ``other - current`` added to each
            receiver's input (1: the edge reads the other run; 0: this run).
        embed_path: replaces the ``embed`` sender, the residual stream entering block 0
            (integrated gradients' interpolation).
        keep_senders: keep this pass's sender outputs in ``senders``.
        into: (batch, n_senders, pos, d_model): this pass's sender outputs are added to
            it, times ``sign`` (edge attribution's clean - corrupt differences).
        sign: the factor of ``into``.
        keep_resids: keep each block's input in ``resids`` (``receiver_gradients``).
        keep_heads_input: keep each block's o_proj input, in the graph, in
            ``heads_inputs`` (layer -> (batch, pos, n_heads * d_head)): edges by span take
            its gradient back to the k and v leaves one query span at a time.
        span_patch: edges by span that read ``other`` (instead of ``patched``); a block
            whose k or v receivers read it runs its attention once more per query span
            they feed (``query_span`` set), and its output at each query span's positions
            is that run's.
        senders: (batch, pos, n_senders, d_model), filled with this pass's sender outputs.
        resids: layer -> (batch, pos, d_model) the residual stream entering the block.
        differences: with ``patched``, (n_senders, batch, pos, d_model) other - current.
        total: with ``patched``, the sum of ``differences`` recorded so far; ``at_block``
            keeps it as it was when the current block began (a parallel block's MLP reads
            only the senders upstream of the block), with the count of senders then.
    """

    graph: Graph
    deltas: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    other: torch.Tensor | None = None
    patched: torch.Tensor | None = None
    embed_path: Callable[[torch.Tensor], torch.Tensor] | None = None
    keep_senders: bool = True
    into: torch.Tensor | None = None
    sign: float = 1.0
    keep_resids: bool = False
    keep_heads_input: bool = False
    heads_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    span_patch: SpanPatch | None = None
    query_span: int | None = None
    rerunning: bool = False
    senders: torch.Tensor | None = None
    resids: dict[int, torch.Tensor] = field(default_factory=dict)
    resid: torch.Tensor | None = None
    qkv_delta: torch.Tensor | None = None
    qkv_ready: bool = False
    pending: torch.Tensor | None = None
    differences: torch.Tensor | None = None
    total: torch.Tensor | None = None
    at_block: tuple[int, torch.Tensor] | None = None
    recorded: int = 0

    def start(self, embeddings: torch.Tensor) -> None:
        """Allocate the per-pass buffers for ``embeddings`` (batch, pos, d_model)."""
        rows, width, d_model = embeddings.shape
        if self.keep_senders:
            self.senders = embeddings.new_zeros((rows, width, len(self.graph.senders), d_model))
        self.recorded = 0
        if self.patched is not None or self.span_patch is not None:
            # (n_senders, batch, pos, d_model): other - current, sender-major so that a
            # receiver's patch is one matrix product over the senders it treats specially.
            self.differences = embeddings.new_zeros((len(self.graph.senders), rows, width, d_model))
            self.total = embeddings.new_zeros((rows, width, d_model))

    def enter_block(self, layer: int, resid: torch.Tensor) -> None:
        """Block ``layer`` begins with the residual stream ``resid`` (batch, pos, d_model)."""
        self.resid = resid
        self.qkv_delta, self.qkv_ready = None, False
        if self.keep_resids:
            self.resids[layer] = resid.detach()
        if self.total is not None and self.graph.parallel:
            self.at_block = (self.recorded, self.total.clone())

    def record(self, first: int, outputs: torch.Tensor) -> None:
        """Keep senders ``first..`` of this pass: outputs (batch, pos, n, d_model)."""
        assert first == self.recorded
        outputs = outputs.detach()
        count = outputs.shape[2]
        if self.senders is not None:
            self.senders[:, :, first : first + count] = outputs
        if self.into is not None:
            self.into[:, first : first + count].add_(outputs.transpose(1, 2), alpha=self.sign)
        self.recorded += count
        if self.differences is not None and self.total is not None:
            assert self.other is not None
            difference = self.other[:, :, first : first + count] - outputs
            self.differences[first : first + count] = difference.permute(2, 0, 1, 3)
            self.total += difference.sum(2)

    def _total(self, count: int) -> torch.Tensor:
        """The sum of the first ``count`` senders' differences: the running total, or the
        one kept when the block began (a parallel block's MLP)."""
        assert self.total is not None
        if count == self.recorded:
            return self.total
        assert self.at_block is not None and self.at_block[0] == count
        return self.at_block[1]

    def receiver_delta(self, key: tuple[str, int], columns: slice) -> torch.Tensor | None:
        """What receivers ``columns`` add to their input: (batch, pos, n, d_model), or
        (batch, pos, d_model) for a single receiver, or None: the leaf ``deltas[key]``
        plus the patch (``_patch``) of ``patched``, or of ``span_patch`` span by span at
        each span's positions (k and v receivers as read by the queries at ``query_span``).
        """
        delta = self.deltas.get(key)
        patches: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if self.patched is not None:
            patches.append((self.patched[:, columns], None))
        if self.span_patch is not None:
            for span in range(self.span_patch.graph.n_spans):
                at = self.span_patch.cells[..., span]
                if bool(at.any()):
                    weights = self.span_patch.base_weights(span, self.query_span)
                    patches.append((weights[:, columns], at))
        single = columns.stop - columns.start == 1
        for weights, where in patches:
            patch = self._patch(weights, int(self.graph.upstream[columns.start]))
            if patch is None:
                continue
            patch = patch[0] if single else patch.permute(1, 2, 0, 3)
            if where is not None:
                at = where.to(patch.dtype)
                patch = patch * (at[..., None] if single else at[..., None, None])
            delta = patch if delta is None else delta + patch
        return delta

    def _patch(self, weights: torch.Tensor, count: int) -> torch.Tensor | None:
        """(receivers, batch, pos, d_model): sum over the ``count`` upstream senders s of
        weights[s, r] (other_s - current_s), or None where every weight is 0; computed as
        the column's typical weight (its median) times the running total of differences
        plus a product over the few senders whose weight differs from it (the circuit's own
        edges when most edges are patched, the patched ones when few are)."""
        assert self.differences is not None
        weights = weights[:count]  # receivers read a prefix
        if not bool(weights.any()):
            return None
        total = self._total(count)
        weights = weights.to(total.dtype)
        typical = weights.median(0).values  # (receivers,)
        rows = torch.nonzero((weights != typical).any(1)).flatten()
        patch = typical[:, None, None, None] * total
        if len(rows):
            upstream = self.differences[rows]
            n_rows, batch, width, d_model = upstream.shape
            extra = (weights[rows] - typical).T @ upstream.reshape(n_rows, -1)
            patch = patch + extra.view(-1, batch, width, d_model)
        return patch


def _is_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face key/value cache."""
    from transformers import Cache

    return isinstance(value, Cache)


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """A module call's first input (positional, or ``hidden_states``)."""
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's inputs with its first one replaced by ``hidden``."""
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _module(model: LensModel, path: str, layer: int | None, role: str) -> torch.nn.Module:
    """The module at ``path`` (in block ``layer``), or a ValueError naming what is missing.

    Raises:
        ValueError: no module there: the layout's ``role`` field must be described.
    """
    try:
        return model.module(path, layer)
    except AttributeError:
        where = "" if layer is None else f" in block {layer}"
        raise ValueError(
            f"The edge graph of {model.name} ({model.spec.architecture}) needs the module "
            f"'{path}'{where} (the layout's {role}), which this model does not have; "
            f"describe where it is with lsc.ArchLayout(..., {role}=...) (lsc.load(..., "
            "layout=...)), and the self-check verifies it."
        ) from None


def _attention_module(model: LensModel, layer: int) -> torch.nn.Module | None:
    """The module o_proj is part of in block ``layer`` (edges by span re-run it), or None
    where the layout puts o_proj in the block itself."""
    parent = model.spec.layout.o_proj.rpartition(".")[0]
    return _module(model, parent, layer, "o_proj") if parent else None


def _parts(model: LensModel, layer: int) -> dict[str, Any]:
    """The modules of block ``layer`` the hooks use, from the model's ``Computation``.

    Returns:
        "block", "o" (o_proj), "attn" (the attention module o_proj is part of, or None),
        "attn_norm", "post_attn", "mlp_in" (the module whose input the MLP receiver
        reads), "mlp_out" (whose output the MLP sender is) and "projections":
        (Projection, splice module) per q/k/v projection.

    Raises:
        ValueError: a module the description names is missing, or a projection whose rows
            are not its receivers' (its width is not n * d_head): named, with how to
            describe it.
    """
    spec, c = model.spec, model.spec.computation
    optional = {
        "attn_norm": c.attn_norm,
        "post_attn": c.post_attn_norm,
    }
    parts: dict[str, Any] = {
        "block": _module(model, f"{spec.layout.layers}.{layer}", None, "layers"),
        "o": _module(model, spec.layout.o_proj, layer, "o_proj"),
        "attn": _attention_module(model, layer),
        "mlp_in": _module(model, c.mlp_norm or c.mlp, layer, "mlp_norm" if c.mlp_norm else "mlp"),
        "mlp_out": _module(model, spec.layout.mlp_out, layer, "mlp_out"),
    }
    for key, path in optional.items():
        parts[key] = None if path is None else _module(model, path, layer, key)
    found = []
    for projection in projections(spec):
        module = _module(model, projection.path, layer, "qkv")
        rows = tuple(linear_weight(module, c).shape)
        if rows != (projection.count * spec.d_head, spec.d_model):
            raise ValueError(
                f"{projection.path} in block {layer} of {model.name} maps {rows[1]} inputs to "
                f"{rows[0]} outputs, not the {projection.count} heads x {spec.d_head} its "
                f"receivers need from d_model {spec.d_model}; describe its storage and column "
                "order with lsc.ArchLayout(qkv=..., qkv_order=..., transposed=...)."
            )
        splice = (
            module if projection.norm is None else _module(model, projection.norm, layer, "q_norm")
        )
        found.append((projection, splice))
    parts["projections"] = found
    return parts


def _attention_hooks(
    model: LensModel, state: Pass, layer: int, parts: dict[str, Any]
) -> list[RemovableHandle]:
    """Block ``layer``'s q/k/v receivers rebuilt from their own input (or given their
    gradient leaves) and its heads' outputs recorded as senders (through the post-norm,
    linearised at the run's scale, where there is one)."""
    graph, spec, c = state.graph, model.spec, model.spec.computation
    first, attn = graph.head_sender(layer), graph.attn_receivers(layer)
    n_heads, norm = spec.n_heads, parts["attn_norm"]

    def splice(module, args, output, *, projection: Projection):
        if not state.qkv_ready:
            state.qkv_delta = state.receiver_delta(("attn", layer), attn)
            state.qkv_ready = True
        delta = state.qkv_delta
        if delta is not None:
            assert state.resid is not None
            own = state.resid[:, :, None] + delta[:, :, projection.receivers]
            # ``forward``, not a call: no hook of the norm runs for a receiver's copy.
            normed = own if norm is None else norm.forward(own)
            output = rebuild(model, layer, projection, normed, output)
        leaf = state.deltas.get((projection.kind, layer))
        return output if leaf is None else output + leaf

    def record_heads(z: torch.Tensor) -> None:
        with torch.no_grad():  # recorded detached: no graph for it
            heads = per_head(
                z.view(*z.shape[:2], n_heads, spec.d_head), output_columns(model, layer)
            )
        if parts["post_attn"] is None:
            state.record(first, heads)
        else:
            state.pending = heads

    def head_outputs(module, args):
        z = args[0]
        if state.keep_heads_input:
            state.heads_inputs[layer] = z
        if state.span_patch is not None and state.span_patch.query_spans[layer]:
            state.heads_inputs[layer] = z  # recorded once every query span has run
        else:
            record_heads(z)

    def post_norm(module, args, output):
        assert state.pending is not None
        heads, state.pending = state.pending, None
        bias = getattr(parts["o"], "bias", None)
        if bias is not None:
            heads = heads + bias / n_heads
        with torch.no_grad():
            shares = post_norm_shares(heads, args[0].detach(), module, c)
        state.record(first, shares.to(heads.dtype))

    handles = [
        splice_module.register_forward_hook(functools.partial(splice, projection=projection))
        for projection, splice_module in parts["projections"]
    ]
    handles.append(parts["o"].register_forward_pre_hook(head_outputs))
    if state.span_patch is not None:
        handles.append(_by_query_span(model, state, layer, parts["attn"], record_heads))
    if parts["post_attn"] is not None:
        handles.append(parts["post_attn"].register_forward_hook(post_norm))
    return handles


def _by_query_span(
    model: LensModel,
    state: Pass,
    layer: int,
    attention: torch.nn.Module | None,
    record_heads: Callable[[torch.Tensor], None],
) -> RemovableHandle:
    """A forward hook on block ``layer``'s ``attention`` module for ``state.span_patch``:
    run the attention once more per query span its k or v receivers feed, and keep each
    run's output (and heads, recorded with ``record_heads``) at that span's positions.

    Raises:
        ValueError: no attention module (o_proj sits in the block itself).
    """
    if attention is None:
        raise ValueError(
            f"Exact edge patching by span re-runs each block's attention module, but "
            f"{model.name}'s layout puts o_proj ({model.spec.layout.o_proj!r}) in the "
            "block itself; describe the attention module's o_proj path "
            "(lsc.ArchLayout(o_proj='self_attn.o_proj')) or patch without "
            "positions='spans'."
        )

    def by_query_span(module, args, kwargs, output):
        patch = state.span_patch
        if patch is None or state.rerunning or not patch.query_spans[layer]:
            return None
        first_output = output[0] if isinstance(output, tuple) else output
        outputs, zs, masks = [first_output], [state.heads_inputs.pop(layer)], []
        # a re-run must not add its keys and values to the pass's cache
        again = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
        state.rerunning = True
        try:
            for t in patch.query_spans[layer]:
                state.query_span, state.qkv_ready = t, False
                rerun = module(*args, **again)
                outputs.append(rerun[0] if isinstance(rerun, tuple) else rerun)
                zs.append(state.heads_inputs.pop(layer))
                masks.append(patch.cells[..., t, None].to(first_output.dtype))
        finally:
            state.rerunning, state.query_span, state.qkv_ready = False, None, False
        rest = 1 - sum(masks)
        combined = outputs[0] * rest + sum(o * m for o, m in zip(outputs[1:], masks, strict=True))
        record_heads(zs[0] * rest + sum(z * m for z, m in zip(zs[1:], masks, strict=True)))
        return (combined, *output[1:]) if isinstance(output, tuple) else combined

    return attention.register_forward_hook(by_query_span, with_kwargs=True)


def _layer_hooks(model: LensModel, state: Pass, layer: int) -> list[RemovableHandle]:
    """Hooks of block ``layer``: its input kept (block 0: the ``embed`` sender recorded),
    its attention receivers and senders (``_attention_hooks``), its MLP receiver's input
    patched and its MLP's output recorded as a sender."""
    graph, spec = state.graph, model.spec
    parts = _parts(model, layer)
    first = graph.head_sender(layer)

    def block_input(module, args, kwargs):
        hidden = _hidden(args, kwargs)
        changed = None
        if layer == 0:  # the embed sender: the stream entering block 0
            if state.embed_path is not None:
                hidden = changed = state.embed_path(hidden)
            state.start(hidden)
            state.record(0, hidden[:, :, None])
        state.enter_block(layer, hidden)
        return None if changed is None else _with_hidden(args, kwargs, changed)

    def mlp_input(module, args, kwargs):
        receiver = graph.mlp_receiver(layer)
        delta = state.receiver_delta(("mlp", layer), slice(receiver, receiver + 1))
        if delta is None:
            return None
        return _with_hidden(args, kwargs, _hidden(args, kwargs) + delta)

    def mlp_output(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        state.record(first + spec.n_heads, out[:, :, None])

    return [
        parts["block"].register_forward_pre_hook(block_input, with_kwargs=True),
        *_attention_hooks(model, state, layer, parts),
        parts["mlp_in"].register_forward_pre_hook(mlp_input, with_kwargs=True),
        parts["mlp_out"].register_forward_hook(mlp_output),
    ]


def _projection_gradient(
    model: LensModel, layer: int, projection: Projection, normed: torch.Tensor, grad: torch.Tensor
) -> Callable[[slice], torch.Tensor]:
    """For receivers ``heads`` of ``projection``: their gradients at the q/k/v input norm's
    output, (n, batch, pos, d_model), from ``grad`` (batch, pos, width), the gradient at the
    projection's receiver values (the splice module's output), and ``normed`` (batch, pos,
    d_model), the norm's output in this pass."""
    d_head, n = model.spec.d_head, projection.count
    weight, _ = receiver_rows(model, layer, projection)
    if projection.columns is not None:
        grad = grad[..., list(projection.columns)]
    grad = grad.unflatten(-1, (n, d_head))  # (batch, pos, n, d_head)
    if projection.norm is None:
        rows = weight.reshape(n, d_head, -1)
        return lambda heads: torch.einsum("bpnk,nkd->nbpd", grad[:, :, heads], rows[heads])
    # A projection-wide norm: receiver h's gradient is taken back through the norm's
    # Jacobian at the whole projection (every head's rows; under relevance rules, their
    # norm rule's), then through every row.
    module = model.module(projection.path, layer)
    qk_norm = model.module(projection.norm, layer)
    offset = model.spec.computation.norm_offset

    def through_norm(heads: slice) -> torch.Tensor:
        count = heads.stop - heads.start
        own = grad.new_zeros((count, *grad.shape))  # (n', batch, pos, n, d_head)
        index = torch.arange(count)
        own[index, :, :, heads.start + index] = grad[:, :, heads].permute(2, 0, 1, 3)
        projected = module.forward(normed.detach())
        back = norm_input_gradient(qk_norm, projected, own.flatten(-2), offset=offset)
        return back @ weight.to(back.dtype)

    return through_norm


def receiver_gradients(
    model: LensModel,
    state: Pass,
    grads: dict[tuple[str, int], torch.Tensor],
    layer: int,
    kinds: tuple[str, ...] | None = None,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """The input gradients of block ``layer``'s q, k and v receivers, chunk by chunk.

    A receiver's input gradient is its head's gradient at its projection's receiver values
    taken back through the head's rows of the projection (and a projection-wide QK-norm's
    Jacobian) and through the block's q/k/v input norm at the block's input
    (``state.resids``, kept by a pass with ``keep_resids``), in closed form
    (``relevance.norm_input_gradient``, RMSNorm or LayerNorm: under relevance rules, their
    norm rule) per chunk of at most ``receiver_chunk`` receivers.

    Args:
        grads: the gradients of the pass's leaves (``Pass.deltas``) by key; those of each
            projection's (kind, ``layer``) are read.
        kinds: only the projections of these kinds ("q", "k", "v", "qkv"); None: all.

    Returns:
        (columns, gradient) per chunk: the chunk's receivers among the layer's attention
        receivers (``Graph.attn_receivers``: q heads, then k, then v) and their input
        gradients, (n, batch, pos, d_model) in float32 (or the model's dtype if wider).
    """
    parts, c = _parts(model, layer), model.spec.computation
    norm = parts["attn_norm"]
    resid = state.resids[layer]
    rows, width, d_model = resid.shape
    chunk = receiver_chunk(rows * width * d_model * 4)  # the norm works in float32
    # the norm's output: only a projection-wide QK-norm's Jacobian needs it
    wide = any(projection.norm for projection, _ in parts["projections"])
    normed = resid if norm is None or not wide else norm.forward(resid)
    for projection, _ in parts["projections"]:
        if kinds is not None and projection.kind not in kinds:
            continue
        gradient = _projection_gradient(
            model, layer, projection, normed, grads[projection.kind, layer]
        )
        for first in range(0, projection.count, chunk):
            heads = slice(first, min(first + chunk, projection.count))
            outer = gradient(heads)
            if norm is None:
                inner = outer.float() if outer.dtype.itemsize < 4 else outer
            else:
                inner = norm_input_gradient(norm, resid, outer, offset=c.norm_offset)
            start = projection.receivers.start
            yield slice(start + heads.start, start + heads.stop), inner


#: Most bytes of one chunk of receiver input gradients (``receiver_gradients``): its batched
#: norm product holds a few tensors of this size at once.
CHUNK_BYTES = 64 * 2**20


def receiver_chunk(bytes_per_receiver: int) -> int:
    """How many receivers' input gradients (``bytes_per_receiver`` each) one chunk holds:
    as many as ``CHUNK_BYTES`` allows, at least 1."""
    return max(1, CHUNK_BYTES // max(bytes_per_receiver, 1))


@contextlib.contextmanager
def edge_hooks(model: LensModel, state: Pass) -> Iterator[None]:
    """Install the edge hooks on ``model.hf`` for the passes run inside the block."""
    graph, layout = state.graph, model.spec.layout

    def logits_input(module, args):
        last = len(graph.receivers) - 1
        delta = state.receiver_delta(("logits", -1), slice(last, last + 1))
        return None if delta is None else (args[0] + delta, *args[1:])

    handles: list[RemovableHandle] = []
    for layer in range(graph.n_layers):
        handles += _layer_hooks(model, state, layer)
    handles.append(model.module(layout.final_norm).register_forward_pre_hook(logits_input))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_pass(
    model: LensModel,
    backend: str,
    tokens: TokenBatch,
    state: Pass,
    *,
    grad: bool,
    vocab: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pass with the edge hooks: logits at the read positions, (batch, vocab), or of
    the ids ``vocab`` only, (batch, k) (``Backend.run``)."""
    with edge_hooks(model, state):
        return get_backend(model, backend).run(tokens, grad=grad, vocab=vocab).logits


def check_supported(model: LensModel, backend: str) -> None:
    """Refuse a backend, or a model whose description the edge hooks cannot follow,
    before any pass.

    Raises:
        ValueError: backend="transformer_lens", or a module the model's ``Computation``
            names that is missing or not shaped as described (named, with the
            ``lsc.ArchLayout`` field that describes it).
    """
    _validate.choice("backend", backend, BACKENDS)
    if backend not in EDGE_BACKENDS:
        raise ValueError(
            f"backend={backend!r} cannot express edges: each receiver reads its own copy of "
            "the residual stream through module hooks on the Hugging Face model, which the "
            "TransformerLens bridge does not run (it runs its own copy), and TransformerLens "
            "4.3's split q/k/v inputs are per query head, which double-counts key/value heads "
            "shared under grouped-query attention. Use backend='nnsight'."
        )
    for layer in range(model.spec.n_layers):
        _parts(model, layer)


def metric_of(
    inputs: Inputs, logits: torch.Tensor, batch: Batch, read: torch.Tensor | None = None
) -> torch.Tensor:
    """(batch,) the metric of ``logits``: (batch, vocab), or of the ids ``read`` (batch, k)
    when a pass unembedded only those (``metrics.read_ids``)."""
    value = metrics.compute_read(inputs.metric, logits, batch.target, batch.distractor, read)
    return metrics.check_finite(value, batch.index, inputs.metric)


def unedited(inputs: Inputs, tokens: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """An unedited pass: (sender outputs (batch, pos, n_senders, d_model), logits)."""
    state = Pass(Graph.of(inputs.model))
    with torch.no_grad():
        logits = run_pass(inputs.model, inputs.backend, tokens, state, grad=False)
    assert state.senders is not None
    return state.senders, logits
