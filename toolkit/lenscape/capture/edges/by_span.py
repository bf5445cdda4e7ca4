"""Edge scores by span: the gradients and the contraction of ``edge_attribution(...,
positions="spans")`` (the graph: ``graph.SpanGraph``).

A within-span score is the position-agnostic one with its sum over positions cut by span:
``score(s@c -> r@c) = sum over positions p of span c of (clean_s - corrupt_s)[p] . g_r[p]``,
g_r the metric's gradient at receiver r's input. A key or value receiver also needs the
query span t it feeds: the gradient at its k or v projection's output reaches the metric
only through its block's attention output z (the o_proj input), so its part through the
queries at span t is the backward of z alone with z's gradient kept at t's positions
(``gradients_by_query_span``: one backward of one attention block per layer and span, on
the graph the pass kept). These parts add up to the whole gradient, so a receiver's scores
summed over spans and query spans are its position-agnostic ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...models import LensModel
from .graph import SpanGraph
from .hooks import Pass, receiver_chunk, receiver_gradients

#: The projection kinds whose outputs hold keys or values (``models.parts.Projection``).
KV_KINDS = ("k", "v", "qkv")


@dataclass(frozen=True)
class SpanCells:
    """A padded batch's tokens grouped by span.

    Attributes:
        graph: the edges by span.
        mask: (batch, seq, n_spans) float, 1 where a token belongs to a span
            (``Batch.cells``).
        order: (batch, seq) each row's positions sorted by span (padding last).
        bounds: per row, (span, first, stop) of each span the row holds, over ``order``.
    """

    graph: SpanGraph
    mask: torch.Tensor
    order: torch.Tensor
    bounds: list[list[tuple[int, int, int]]]

    @classmethod
    def of(cls, graph: SpanGraph, cells: torch.Tensor) -> SpanCells:
        """The grouping of ``cells`` (batch, seq, n_spans), a batch's ``Batch.cells``."""
        owner = torch.where(cells.bool().any(-1), cells.argmax(-1), graph.n_spans)
        order = torch.argsort(owner, dim=1, stable=True)
        bounds = []
        for row in owner:
            counts = torch.bincount(row, minlength=graph.n_spans + 1)[: graph.n_spans].tolist()
            stops = torch.tensor(counts).cumsum(0).tolist()
            bounds.append(
                [
                    (c, stop - n, stop)
                    for c, (n, stop) in enumerate(zip(counts, stops, strict=True))
                    if n
                ]
            )
        return cls(graph, cells, order, bounds)


def gradients_by_query_span(
    metric: torch.Tensor, state: Pass, cells: torch.Tensor
) -> dict[tuple, torch.Tensor]:
    """The gradients of ``metric`` at the pass's leaves (``state.deltas``, by key) and, for
    each key or value leaf (kind in ``KV_KINDS``, layer), its part through the queries at
    span t, under the key (kind, layer, t).

    The pass must have kept its attention outputs (``Pass.keep_heads_input``); they are
    released here.

    Args:
        metric: a scalar of the pass.
        cells: (batch, seq, n_spans) float, the batch's tokens by span (``Batch.cells``).
    """
    keys, layers = list(state.deltas), sorted(state.heads_inputs)
    outputs = [state.heads_inputs[layer] for layer in layers]
    found = torch.autograd.grad(
        metric, [state.deltas[key] for key in keys] + outputs, retain_graph=True
    )
    grads: dict[tuple, torch.Tensor] = dict(zip(keys, found[: len(keys)], strict=True))
    for layer, output, gradient in zip(layers, outputs, found[len(keys) :], strict=True):
        kv = [key for key in keys if key[1] == layer and key[0] in KV_KINDS]
        leaves = [state.deltas[key] for key in kv]
        for t in range(cells.shape[-1]):
            at = cells[..., t, None].to(gradient.dtype)
            if not bool(at.any()):  # no query there: no part through it
                parts: tuple = tuple(torch.zeros_like(leaf) for leaf in leaves)
            else:
                parts = torch.autograd.grad(
                    output, leaves, grad_outputs=gradient * at, retain_graph=True
                )
            grads.update({(*key, t): part for key, part in zip(kv, parts, strict=True)})
    state.heads_inputs.clear()
    return grads


def _span_receiver_gradients(
    model: LensModel, state: Pass, grads: dict, graph: SpanGraph
) -> Iterator[tuple[int, torch.Tensor]]:
    """Every receiver's input gradient of ``graph`` in receiver order, a chunk at a time:
    (first receiver, (n, batch, pos, d_model)); a k or v receiver's through its query span
    only (``gradients_by_query_span``'s keys)."""
    base = graph.base
    n_heads = base.n_heads
    for layer in range(base.n_layers):
        first = graph.attn_receivers(layer).start
        for columns, gradient in receiver_gradients(model, state, grads, layer, ("q", "qkv")):
            stop = min(columns.stop, n_heads)  # a fused projection's k and v come later
            if columns.start < stop:
                yield first + columns.start, gradient[: stop - columns.start]
        for t in range(graph.n_spans):
            through_t = {
                **grads,
                **{
                    (kind, layer): grads[kind, layer, t]
                    for kind in KV_KINDS
                    if (kind, layer, t) in grads
                },
            }
            kv = graph.kv_receivers(layer, t).start - n_heads
            for columns, gradient in receiver_gradients(model, state, through_t, layer, KV_KINDS):
                start = max(columns.start, n_heads)
                if start < columns.stop:
                    yield kv + start, gradient[start - columns.start :]
        yield graph.mlp_receiver(layer), grads["mlp", layer][None]
    yield graph.shape[2] - 1, grads["logits", -1][None]


def span_step_scores(
    model: LensModel, state: Pass, grads: dict, differences: torch.Tensor, spans: SpanCells
) -> torch.Tensor:
    """(batch, n_spans, n_senders, n_receivers) float32 scores of one gradient pass: per
    span, the sum over its positions of the senders' clean - corrupt ``differences``
    (batch, n_senders, pos, d_model; 0 at padding) times each receiver's input gradient;
    0 off the graph.

    Both are sorted by span once (``SpanCells.order``), so a span's positions are one
    column range: receiver chunks as ``scores._step_scores``', and one matrix product per
    prompt, chunk and span, over that range alone (the products of all spans cost one
    position-agnostic product).
    """
    graph = spans.graph
    rows, _, width, d_model = differences.shape
    scores = differences.new_zeros((rows, *graph.shape), dtype=torch.float32)
    order = spans.order[:, :, None]
    senders = torch.take_along_dim(differences, order[:, None], dim=2).flatten(2)
    capacity = receiver_chunk(rows * width * d_model * differences.element_size())
    chunk = differences.new_empty((rows, min(capacity, graph.shape[2]), width * d_model))
    filled, start = 0, 0

    def contract() -> None:
        upstream = int(graph.upstream[start + filled - 1])
        for row in range(rows):
            for cell, first, stop in spans.bounds[row]:
                columns = slice(first * d_model, stop * d_model)
                block = torch.mm(chunk[row, :filled, columns], senders[row, :upstream, columns].T)
                scores[row, cell, :upstream, start : start + filled] = block.T

    for first, gradient in _span_receiver_gradients(model, state, grads, graph):
        n = gradient.shape[0]
        if filled + n > chunk.shape[1]:
            contract()
            filled, start = 0, first
        by_span = torch.take_along_dim(gradient.transpose(0, 1), order[:, None], dim=2)
        chunk[:, filled : filled + n] = by_span.flatten(2)  # (batch, n, pos * d_model)
        filled += n
    contract()
    return scores * torch.from_numpy(graph.valid).to(scores.device)
