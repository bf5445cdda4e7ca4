"""Where the circuit graph draws each node: layers top to bottom, a layer's query heads,
then its key/value heads, then its MLP; by span, one such group of columns per span.

A position-agnostic graph is one group of columns: the embeddings above ``L0``, the logits
below the last layer (the model computes downwards, as every heatmap of lenscape draws
layer 0 at the top), a layer's query heads side by side (``H0`` ...), then its key/value
heads (columns ``KV0`` ..., each shared by a group of query heads), then its MLP: no node
sits on another.

A graph by span (``lsc.edge_attribution(..., positions="spans")``) repeats the group once
per span, left to right in prompt order (the ``span_order`` attr), each with its own
embeddings and logits and its name above it: a node is a component at a span ("L3.H2@S2").
The residual stream is per position, so an edge at span s runs inside s's columns, except
a crossing edge: a key or value read at s by queries at a later span t ends at the
key/value head in t's columns (the receiver "L3.KV1.k@t" is that node), so the line runs
from s to t, as information does. Only coords are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import altair as alt
import xarray as xr

from .encoding import span_order

#: Node kinds of the graph and their shapes.
NODE_SHAPES = {
    "query head": "circle",
    "key/value head": "diamond",
    "MLP": "square",
    "embeddings, logits": "triangle-up",
}
#: The gap between a layer's query heads and its key/value heads' columns (``KV0`` ...),
#: in columns: key/value heads never sit on a query head.
KV_GAP = 0.5
#: The gap between two spans' groups of columns, in columns.
SPAN_GAP = 1.5
#: Where the span names stand, above the embeddings (rows; layer 0 is row 0).
SPAN_ROW = -3.0


@dataclass(frozen=True)
class Node:
    """A node of the graph: its name ("L3.H2", "L3.KV1", "L3.MLP", "embeddings",
    "logits", by span with "@S2"), its kind (a key of ``NODE_SHAPES``), what it is, and
    where it is drawn."""

    name: str
    role: str
    about: str
    x: float
    y: float


@dataclass(frozen=True)
class Layout:
    """Where the graph draws each node, from the model's sizes (read from the coords) and,
    by span, the spans' columns in prompt order (``spans``; empty: position-agnostic)."""

    n_layers: int
    n_heads: int
    n_kv: int
    spans: tuple[str, ...] = ()

    @classmethod
    def of(cls, scores: xr.DataArray) -> Layout:
        """The layout of an edge result (read by label): its spans are those of its
        ``span`` dim and its receivers' query spans, in prompt order."""
        kinds = scores["sender_kind"].values
        n_layers = int((kinds == "mlp").sum())
        spans: tuple[str, ...] = ()
        queries = (
            {str(q) for q in scores["query_span"].values if q} if "span" in scores.dims else set()
        )
        if "span" in scores.dims:
            held = {str(s) for s in scores["span"].values} | queries
            order = span_order(scores) or [str(s) for s in scores["span"].values]
            spans = tuple([s for s in order if s in held] + sorted(held - set(order)))
        per_span = max(len(queries), 1)
        n_heads = int((kinds == "head").sum()) // max(n_layers, 1)
        n_k = int((scores["receiver_kind"].values == "k").sum())
        return cls(n_layers, n_heads, max(n_k // max(n_layers * per_span, 1), 1), spans)

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return max(self.n_heads // self.n_kv, 1)

    @property
    def span_width(self) -> float:
        """One span's group of columns and the gap after it, in columns."""
        return self.mlp_x + 1 + SPAN_GAP

    def offset(self, span: str | None) -> float:
        """Where ``span``'s columns start (0 for a position-agnostic graph)."""
        return self.spans.index(span) * self.span_width if span else 0.0

    def node(self, kind: str, layer: int, head: int, span: str | None = None) -> Node:
        """The node a sender of ``kind`` is, or the node a receiver of ``kind`` reads into
        (a q receiver its query head, a k or v receiver its key/value head), at ``span``."""
        node = self._node(kind, layer, head)
        if not span:
            return node
        return Node(
            f"{node.name}@{span}",
            node.role,
            f"{node.about} at span {span}",
            node.x + self.offset(span),
            node.y,
        )

    def _node(self, kind: str, layer: int, head: int) -> Node:
        middle = (self.n_heads - 1) / 2
        if kind == "embed":
            return Node("embeddings", "embeddings, logits", "token embeddings", middle, -1.0)
        if kind == "logits":
            return Node("logits", "embeddings, logits", "the logits", middle, self.n_layers)
        if kind == "mlp":
            return Node(f"L{layer}.MLP", "MLP", f"MLP of layer {layer}", self.mlp_x, layer)
        if kind in ("head", "q"):
            return Node(f"L{layer}.H{head}", "query head", f"query head {head}", head, layer)
        first = head * self.group
        return Node(
            f"L{layer}.KV{head}",
            "key/value head",
            f"key/value head of L{layer}.H{first}-H{first + self.group - 1}",
            self.kv_x(head),
            layer,
        )

    def kv_x(self, kv: int) -> float:
        """The column of key/value head ``kv``: right of the query heads, after a gap."""
        return self.n_heads - 1 + KV_GAP + 0.5 + kv

    @property
    def mlp_x(self) -> float:
        """The MLP's column, the last one of a group, right of the key/value heads."""
        return self.kv_x(self.n_kv - 1) + 1 + KV_GAP

    @property
    def right(self) -> float:
        """The last column's position."""
        return self.offset(self.spans[-1]) + self.mlp_x if self.spans else self.mlp_x

    def columns(self) -> tuple[list[float], list[str]]:
        """Every column's position and name: H0 ..., KV0 ..., MLP (per span)."""
        xs = [float(h) for h in range(self.n_heads)] + [self.kv_x(k) for k in range(self.n_kv)]
        names = [f"H{h}" for h in range(self.n_heads)] + [f"KV{k}" for k in range(self.n_kv)]
        xs, names = [*xs, self.mlp_x], [*names, "MLP"]
        return (
            [x + self.offset(span) for span in self.spans or [None] for x in xs],
            names * max(len(self.spans), 1),
        )

    def nodes(self) -> list[Node]:
        """Every node: per span, the embeddings, per layer its query heads, key/value heads
        and MLP, the logits."""
        ends = [("embed", -1, -1), ("logits", self.n_layers, -1)]
        for layer in range(self.n_layers):
            ends += [("head", layer, head) for head in range(self.n_heads)]
            ends += [("k", layer, head) for head in range(self.n_kv)]
            ends.append(("mlp", layer, -1))
        return [self.node(*end, span=span) for span in self.spans or [None] for end in ends]

    def axes(self) -> dict[str, Any]:
        """The x (query heads, key/value heads, the MLP) and y (embeddings, layers,
        logits) encodings, every column and row named."""
        top = self.n_layers
        xs, names = self.columns()
        x = alt.X(
            "x:Q",
            title=None,
            scale=alt.Scale(domain=[-0.6, self.right + 0.6], nice=False, zero=False),
            axis=alt.Axis(
                values=xs,
                labelExpr=f"{json.dumps(names)}[indexof({json.dumps(xs)}, datum.value)]",
                orient="top",
                grid=False,
                ticks=False,
                domain=False,
            ),
        )
        first = SPAN_ROW - 0.6 if self.spans else -2.1
        y = alt.Y(
            "y:Q",
            title=None,
            scale=alt.Scale(domain=[first, top + 1.1], nice=False, zero=False, reverse=True),
            axis=alt.Axis(
                values=list(range(top)),
                labelExpr="'L' + datum.value",
                grid=False,
                ticks=False,
                domain=False,
            ),
        )
        return {"x": x, "y": y}

    def end_labels(self) -> alt.LayerChart:
        """The names of the embeddings and the logits, on their triangles' outer side (above
        the embeddings, below the logits: no edge crosses there), and by span each span's
        name above its columns, each on a white outline so that no line end under it hides
        a letter."""
        rows = [
            {"x": node.x, "y": node.y, "name": name, "at": at}
            for span in self.spans or [None]
            for node, name, at in (
                (self.node("embed", -1, -1, span), "embeddings", "top"),
                (self.node("logits", self.n_layers, -1, span), "logits", "bottom"),
            )
        ]
        rows += [
            {"x": self.offset(span) + self.mlp_x / 2, "y": SPAN_ROW, "name": span, "at": "span"}
            for span in self.spans
        ]
        places: dict[str, dict[str, Any]] = {
            "top": {"baseline": "bottom", "dy": -9, "fontSize": 12},
            "bottom": {"baseline": "top", "dy": 9, "fontSize": 12},
            "span": {"baseline": "middle", "fontSize": 14},
        }
        marks = [
            _text(rows, at, **place, **paint)
            for paint in (
                {"color": "white", "stroke": "white", "strokeWidth": 4},
                {"color": "#222"},
            )
            for at, place in places.items()
            if at != "span" or self.spans
        ]
        return alt.LayerChart(layer=[mark.encode(**self.axes(), text="name:N") for mark in marks])

    def separators(self) -> alt.Chart:
        """Light vertical rules between the spans' groups of columns."""
        rows = [{"x": self.offset(span) - SPAN_GAP / 2 - 0.5} for span in self.spans[1:]]
        return (
            alt.Chart(alt.Data(values=rows))
            .mark_rule(color="#dddddd", strokeWidth=1)
            .encode(x=self.axes()["x"])
        )


def _text(rows: list[dict[str, Any]], at: str, **style: Any) -> alt.Chart:
    """The rows of ``rows`` placed at ``at`` as bold text."""
    return alt.Chart(alt.Data(values=[row for row in rows if row["at"] == at])).mark_text(
        fontWeight="bold", **style
    )
