"""The edge graph of a model: senders, receivers, which edges exist, and their labels.

Senders in order: ``embed``, then per layer its heads and its MLP. Receivers: per layer its
q heads, k heads (key/value heads), v heads and MLP, then ``logits``. An edge ``s -> r``
exists when ``s`` is upstream of ``r``: an earlier layer, or the same layer's heads for an
MLP in a sequential block (under a parallel residual, GPT-NeoX's, a block's MLP reads the
block's input, so no edge runs from a layer's heads to its own MLP; the labels are the
same). Edge results say which in their ``residual`` attr. Results over edges are
labelled: ``sender`` ("embed", "L3.H2", "L3.MLP") and ``receiver`` ("L3.H2.q", "L3.KV1.k",
"L3.MLP", "logits"). Everything that reads an edge result back reads it by these labels
(``aligned``), never by position, so a ``sortby``, ``isel`` or ``transpose`` of the input
never changes an answer.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from ... import _validate
from ...data.spans import OTHER
from ...models import LensModel
from ...schema import EDGE_DIMS, edge_exists

SENDER_KINDS = ("embed", "head", "mlp")


@dataclass(frozen=True)
class Graph:
    """Senders, receivers and which edges exist, for one model's sizes and residual
    topology (``parallel``: a block's MLP does not read its own heads)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel: bool = False

    @classmethod
    def of(cls, model: LensModel) -> Graph:
        spec = model.spec
        return cls(spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.computation.parallel)

    @property
    def residual(self) -> str:
        """ "parallel" or "sequential" (an edge result's ``residual`` attr)."""
        return "parallel" if self.parallel else "sequential"

    @property
    def per_layer(self) -> int:
        """Receivers per layer: q, k, v heads and the MLP."""
        return self.n_heads + 2 * self.n_kv_heads + 1

    @property
    def shape(self) -> tuple[int, int]:
        """(n_senders, n_receivers)."""
        return len(self.senders), len(self.receivers)

    @property
    def dims(self) -> tuple[str, ...]:
        """A result's dims in canonical order, ``shape``'s."""
        return EDGE_DIMS

    def head_sender(self, layer: int) -> int:
        """Index of layer ``layer``'s head 0 among the senders (its MLP follows its heads)."""
        return 1 + layer * (self.n_heads + 1)

    def attn_receivers(self, layer: int) -> slice:
        """Layer ``layer``'s q, k and v receivers (q heads, then k, then v)."""
        start = layer * self.per_layer
        return slice(start, start + self.per_layer - 1)

    def mlp_receiver(self, layer: int) -> int:
        return (layer + 1) * self.per_layer - 1

    @functools.cached_property
    def senders(self) -> list[tuple[str, int, int]]:
        """(kind, layer, head); -1 where a sender has no layer (embed) or head."""
        out = [("embed", -1, -1)]
        for layer in range(self.n_layers):
            out += [("head", layer, head) for head in range(self.n_heads)]
            out.append(("mlp", layer, -1))
        return out

    @functools.cached_property
    def receivers(self) -> list[tuple[str, int, int]]:
        """(kind, layer, head); k and v heads count key/value heads; -1: no head."""
        out = []
        for layer in range(self.n_layers):
            out += [("q", layer, head) for head in range(self.n_heads)]
            out += [("k", layer, head) for head in range(self.n_kv_heads)]
            out += [("v", layer, head) for head in range(self.n_kv_heads)]
            out.append(("mlp", layer, -1))
        out.append(("logits", self.n_layers, -1))
        return out

    @functools.cached_property
    def upstream(self) -> np.ndarray:
        """(n_receivers,) how many senders (a prefix of ``senders``) each receiver reads."""
        counts = []
        for kind, layer, _ in self.receivers:
            if kind == "logits":
                counts.append(len(self.senders))
            elif kind == "mlp":
                counts.append(self.head_sender(layer) + (0 if self.parallel else self.n_heads))
            else:
                counts.append(self.head_sender(layer))
        return np.asarray(counts)

    @functools.cached_property
    def valid(self) -> np.ndarray:
        """(n_senders, n_receivers) bool: the edge exists (sender upstream of receiver,
        ``schema.edge_exists``); each receiver reads a prefix of the senders (``upstream``)."""
        s_kind, s_layer, _ = zip(*self.senders, strict=True)
        r_kind, r_layer, _ = zip(*self.receivers, strict=True)
        return edge_exists(
            np.asarray(s_kind)[:, None],
            np.asarray(s_layer)[:, None],
            np.asarray(r_kind)[None, :],
            np.asarray(r_layer)[None, :],
            parallel=self.parallel,
        )

    @functools.cached_property
    def feeds(self) -> np.ndarray:
        """(n_receivers, n_senders + 1) bool: receiver -> the component(s) it is an input
        of (a sender, or the logits, last). A key/value head feeds its whole query group."""
        out = np.zeros((len(self.receivers), len(self.senders) + 1), dtype=bool)
        group = self.n_heads // self.n_kv_heads
        for r, (kind, layer, head) in enumerate(self.receivers):
            if kind == "logits":
                out[r, -1] = True
            elif kind == "mlp":
                out[r, self.head_sender(layer) + self.n_heads] = True
            elif kind == "q":
                out[r, self.head_sender(layer) + head] = True
            else:
                start = self.head_sender(layer) + head * group
                out[r, start : start + group] = True
        return out

    @functools.cached_property
    def sender_labels(self) -> list[str]:
        return [
            "embed"
            if kind == "embed"
            else f"L{layer}.H{head}"
            if kind == "head"
            else f"L{layer}.MLP"
            for kind, layer, head in self.senders
        ]

    @functools.cached_property
    def receiver_labels(self) -> list[str]:
        labels = []
        for kind, layer, head in self.receivers:
            if kind == "logits":
                labels.append("logits")
            elif kind == "mlp":
                labels.append(f"L{layer}.MLP")
            elif kind == "q":
                labels.append(f"L{layer}.H{head}.q")
            else:
                labels.append(f"L{layer}.KV{head}.{kind}")
        return labels

    def coords(self) -> dict[str, Any]:
        """Dim and label coords of a (sender, receiver) result."""
        senders, receivers = np.asarray(self.senders, dtype=object), self.receivers
        return {
            "sender": self.sender_labels,
            "receiver": self.receiver_labels,
            "sender_kind": ("sender", [kind for kind, _, _ in self.senders]),
            "sender_layer": ("sender", senders[:, 1].astype(np.int64)),
            "sender_head": ("sender", senders[:, 2].astype(np.int64)),
            "receiver_kind": ("receiver", [kind for kind, _, _ in receivers]),
            "receiver_layer": ("receiver", np.asarray([r[1] for r in receivers], np.int64)),
            "receiver_head": ("receiver", np.asarray([r[2] for r in receivers], np.int64)),
        }

    def describe(self) -> str:
        """ "30 layers x 9 heads (3 key/value): 301 senders x 481 receivers"."""
        return (
            f"{self.n_layers} layers x {self.n_heads} heads ({self.n_kv_heads} key/value), "
            f"{self.residual} residual: {self.shape[0]} senders x {self.shape[1]} receivers"
        )

    @classmethod
    def of_result(cls, result: xr.DataArray) -> Graph:
        """The graph a (sender, receiver) result was measured on, from its labels.

        Raises:
            ValueError: labels that are not those of any model's graph.
        """
        kinds = result["sender_kind"].values if "sender_kind" in result.coords else None
        if kinds is None or "receiver_kind" not in result.coords:
            raise ValueError(
                "The edge result has no sender_kind / receiver_kind coords; pass a result of "
                "lsc.edge_attribution or lsc.circuit as it came."
            )
        n_layers = int((kinds == "mlp").sum())
        layers = max(n_layers, 1)
        graph = cls(
            n_layers,
            int((kinds == "head").sum()) // layers,
            int((result["receiver_kind"].values == "k").sum()) // layers,
            _parallel(result),
        )
        return _same_labels(graph, result, "lsc.edge_attribution")


@dataclass(frozen=True)
class SpanGraph:
    """The edges between (component, span) nodes of ``base``'s model, for prompts whose
    named spans come in the order ``spans`` (``OTHER``, the tokens in no named span, last).

    The residual stream is per position, so a sender at span s is read at span s: an edge
    result has a ``span`` dim (before ``sender`` and ``receiver``, the canonical order),
    where its sender writes and its receiver reads. A q, MLP or
    logits receiver acts at that span. Only attention moves information across positions: a
    key/value head's k or v input at span s feeds its query group's outputs at every span t
    its keys can reach (t after s, or s itself; ``OTHER``'s tokens lie anywhere), so k and v
    receivers are one per query span t, labelled "L3.KV1.k@END" (coord ``query_span``; "" for
    the others). Summed over ``span`` and over each k and v receiver's query spans, the
    scores are ``base``'s.

    Receivers per layer: q heads, then per query span its k heads and its v heads, then the
    MLP; then the logits.
    """

    base: Graph
    spans: tuple[str, ...]

    @property
    def n_spans(self) -> int:
        return len(self.spans)

    @property
    def residual(self) -> str:
        return self.base.residual

    @property
    def per_layer(self) -> int:
        base = self.base
        return base.n_heads + 2 * base.n_kv_heads * self.n_spans + 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n_spans, n_senders, n_receivers): a result's dims in canonical order."""
        return self.n_spans, len(self.base.senders), len(self.receivers)

    @property
    def dims(self) -> tuple[str, ...]:
        """("span", "sender", "receiver"): a result's dims in canonical order, ``shape``'s."""
        return ("span", *EDGE_DIMS)

    def attn_receivers(self, layer: int) -> slice:
        """Layer ``layer``'s q receivers, then its k and v receivers query span by span."""
        start = layer * self.per_layer
        return slice(start, start + self.per_layer - 1)

    def kv_receivers(self, layer: int, query_span: int) -> slice:
        """Layer ``layer``'s k heads then v heads feeding queries at span ``query_span``."""
        n_kv = self.base.n_kv_heads
        start = self.attn_receivers(layer).start + self.base.n_heads + 2 * n_kv * query_span
        return slice(start, start + 2 * n_kv)

    def mlp_receiver(self, layer: int) -> int:
        return (layer + 1) * self.per_layer - 1

    @functools.cached_property
    def receivers(self) -> list[tuple[str, int, int, str]]:
        """(kind, layer, head, query span: "" for q, MLP and logits receivers)."""
        base, out = self.base, []
        for layer in range(base.n_layers):
            out += [("q", layer, head, "") for head in range(base.n_heads)]
            for span in self.spans:
                out += [("k", layer, head, span) for head in range(base.n_kv_heads)]
                out += [("v", layer, head, span) for head in range(base.n_kv_heads)]
            out.append(("mlp", layer, -1, ""))
        out.append(("logits", base.n_layers, -1, ""))
        return out

    @functools.cached_property
    def base_receiver(self) -> np.ndarray:
        """(n_receivers,) each receiver's index among ``base.receivers`` (its query span
        dropped)."""
        index = {label: k for k, label in enumerate(self.base.receivers)}
        return np.asarray([index[kind, layer, head] for kind, layer, head, _ in self.receivers])

    @functools.cached_property
    def upstream(self) -> np.ndarray:
        """(n_receivers,) how many senders (a prefix) each receiver reads."""
        return self.base.upstream[self.base_receiver]

    def reaches(self, span: str, query_span: str) -> bool:
        """Whether keys and values at ``span`` can feed queries at ``query_span``: the same
        span, a later one, or either is ``OTHER`` (whose tokens lie anywhere)."""
        order = self.spans.index
        return OTHER in (span, query_span) or order(span) <= order(query_span)

    @functools.cached_property
    def valid(self) -> np.ndarray:
        """(n_spans, n_senders, n_receivers) bool: the edge exists: its sender is upstream
        of its receiver (``Graph.valid``) and, through a key or value, its span reaches the
        receiver's query span (``reaches``)."""
        upstream = self.base.valid[:, self.base_receiver]
        reach = np.asarray(
            [
                [not query or self.reaches(span, query) for _, _, _, query in self.receivers]
                for span in self.spans
            ]
        )
        return upstream[None] & reach[:, None]

    @functools.cached_property
    def receiver_labels(self) -> list[str]:
        labels = [self.base.receiver_labels[k] for k in self.base_receiver]
        return [
            f"{label}@{query}" if query else label
            for label, (_, _, _, query) in zip(labels, self.receivers, strict=True)
        ]

    @property
    def sender_labels(self) -> list[str]:
        return self.base.sender_labels

    def coords(self) -> dict[str, Any]:
        """Dim and label coords of a (span, sender, receiver) result."""
        coords = self.base.coords()
        receivers = self.receivers
        coords.update(
            receiver=self.receiver_labels,
            receiver_kind=("receiver", [kind for kind, _, _, _ in receivers]),
            receiver_layer=("receiver", np.asarray([r[1] for r in receivers], np.int64)),
            receiver_head=("receiver", np.asarray([r[2] for r in receivers], np.int64)),
            query_span=("receiver", [query for _, _, _, query in receivers]),
            span=list(self.spans),
        )
        return coords

    @functools.cached_property
    def feeds(self) -> np.ndarray:
        """(n_receivers, n_senders + 1) bool: receiver -> the component(s) it is an input
        of (``Graph.feeds``), at the span ``target_span`` says."""
        return self.base.feeds[self.base_receiver]

    @functools.cached_property
    def query_index(self) -> np.ndarray:
        """(n_receivers,) int: each k or v receiver's query span (an index of ``spans``);
        -1 for q, MLP and logits receivers."""
        return np.asarray([self.spans.index(q) if q else -1 for *_, q in self.receivers])

    @functools.cached_property
    def target_span(self) -> np.ndarray:
        """(n_spans, n_receivers) int: the span of the node an edge at span c into each
        receiver reaches: a k or v receiver's query span, else c."""
        query = self.query_index[None]
        return np.where(query >= 0, query, np.arange(self.n_spans)[:, None])

    @functools.cached_property
    def columns_by_query(self) -> np.ndarray:
        """(n_spans, n_base_receivers): the receiver each position-agnostic receiver is
        when its queries are at span t (t only matters for k and v)."""
        base = self.base
        out = np.zeros((self.n_spans, len(base.receivers)), dtype=np.int64)
        for j, (kind, layer, head) in enumerate(base.receivers):
            for t in range(self.n_spans):
                if kind == "logits":
                    out[t, j] = self.shape[2] - 1
                elif kind == "mlp":
                    out[t, j] = self.mlp_receiver(layer)
                elif kind == "q":
                    out[t, j] = self.attn_receivers(layer).start + head
                else:
                    offset = head if kind == "k" else base.n_kv_heads + head
                    out[t, j] = self.kv_receivers(layer, t).start + offset
        return out

    @classmethod
    def of_result(cls, result: xr.DataArray) -> SpanGraph:
        """The graph a (span, sender, receiver) result was measured on, from its labels
        (spans in the ``span_order`` attr's order, else the coord's).

        Raises:
            ValueError: labels that are not those of any model's graph by span.
        """
        names = [str(name) for name in result["span"].values]
        order = json.loads(result.attrs.get("span_order", "[]")) or names
        spans = tuple(name for name in order if name in names)
        kinds = result["sender_kind"].values if "sender_kind" in result.coords else None
        if kinds is None or "receiver_kind" not in result.coords or len(spans) != len(names):
            raise ValueError(
                "The edge result by span has no sender_kind / receiver_kind coords or "
                "repeats a span; pass a result of lsc.edge_attribution(..., "
                "positions='spans') or lsc.circuit as it came."
            )
        layers = max(int((kinds == "mlp").sum()), 1)
        k = int((result["receiver_kind"].values == "k").sum())
        base = Graph(
            int((kinds == "mlp").sum()),
            int((kinds == "head").sum()) // layers,
            k // (layers * len(spans)),
            _parallel(result),
        )
        return _same_labels(cls(base, spans), result, "lsc.edge_attribution(positions='spans')")

    def describe(self) -> str:
        n_spans, n_senders, n_receivers = self.shape
        return (
            f"{self.base.describe()}; by span ({', '.join(self.spans)}): {n_senders} senders "
            f"x {n_receivers} receivers x {n_spans} spans, {int(self.valid.sum())} edges"
        )


@functools.lru_cache(maxsize=16)
def span_graph_of(base: Graph, spans: tuple[str, ...]) -> SpanGraph:
    """The ``SpanGraph`` of ``base`` over ``spans``, one per pair: its tables (``valid``,
    ``receivers``, ...) are built once per call, not once per batch or variant."""
    return SpanGraph(base, spans)


def _same_labels(graph: Any, result: xr.DataArray, made_by: str) -> Any:
    """``graph``, checked to have exactly ``result``'s sender and receiver labels.

    Raises:
        ValueError: labels dropped, renamed or repeated.
    """
    if sorted(graph.sender_labels) != sorted(map(str, result["sender"].values)) or sorted(
        graph.receiver_labels
    ) != sorted(map(str, result["receiver"].values)):
        raise ValueError(
            "The edge result's sender and receiver labels are not those of a whole model "
            "graph (some were dropped, renamed or repeated); pass every edge, as "
            f"{made_by} returned them."
        )
    return graph


def refuse_by_span(name: str, result: Any) -> None:
    """Refuse edges by span where a result of position-agnostic edges is read.

    Raises:
        ValueError: ``result`` has a ``span`` dim, with what to pass instead.
    """
    if isinstance(result, xr.DataArray) and "span" in result.dims:
        raise ValueError(
            f"{name} holds edges by span (edge_attribution(..., positions='spans')), and "
            "position-agnostic edges were expected here: the other inputs are position-"
            "agnostic. Compute every input by span (positions='spans') or none of them (the "
            "by-span scores summed over spans and query spans are the position-agnostic ones)."
        )


def refuse_agnostic(name: str, result: Any) -> None:
    """Refuse position-agnostic edges where edges by span are read.

    Raises:
        ValueError: ``result`` is a DataArray without a ``span`` dim, with what to pass.
    """
    if isinstance(result, xr.DataArray) and "span" not in result.dims:
        raise ValueError(
            f"{name} holds position-agnostic edges, and edges by span were expected here: "
            "the other inputs are by span. Compute every input by span "
            "(edge_attribution(..., positions='spans')) or none of them."
        )


def _parallel(result: xr.DataArray) -> bool:
    """Whether an edge result was measured on a parallel-residual model: its ``residual``
    attr, or (attrs dropped) scores NaN on every edge from a layer's heads to its own MLP."""
    if "residual" in result.attrs:
        return result.attrs["residual"] == "parallel"
    if result.dtype == bool or "sender_layer" not in result.coords:
        return False
    same = (result["sender_kind"] == "head") & (result["receiver_kind"] == "mlp")
    same = same & (result["sender_layer"] == result["receiver_layer"])
    cells = result.where(same)
    return bool(same.any()) and bool(cells.isnull().sum() == result.size)


def aligned(
    name: str, result: Any, graph: Graph | SpanGraph, *, made_by: str, dims=EDGE_DIMS
) -> xr.DataArray:
    """``result`` reindexed by label onto ``graph``'s senders and receivers (its own order
    and any transpose undone), with ``dims`` in that order.

    Args:
        name: the argument's name, for messages.
        made_by: the function whose results are expected there (for messages).
        dims: the dims ``result`` must have, in the order returned (on a ``SpanGraph``,
            with ``span`` before ``sender``).

    Raises:
        TypeError: not a DataArray.
        ValueError: other dims, or senders / receivers missing, extra or repeated: named.
    """
    if isinstance(graph, SpanGraph):
        refuse_agnostic(name, result)
        dims = dims if "span" in dims else (*dims[:-2], "span", *dims[-2:])
    else:
        refuse_by_span(name, result)
    _validate.result(name, result, kind=xr.DataArray, made_by=made_by, dims=dims)
    if set(result.dims) != set(dims):
        extra = sorted(set(map(str, result.dims)) - set(dims))
        fix = (
            " average per-prompt scores first: scores.mean('prompt');" if "prompt" in extra else ""
        )
        raise ValueError(
            f"{name} must have the dims {list(dims)} (from {made_by}), got "
            f"{list(result.dims)};{fix} pass the result as {made_by} returned it."
        )
    expected = {"sender": graph.sender_labels, "receiver": graph.receiver_labels}
    if isinstance(graph, SpanGraph):
        expected = {"span": list(graph.spans), **expected}
    by_label = _validate.labels(name, result, expected, made_by=made_by)
    return by_label.transpose(*dims)
