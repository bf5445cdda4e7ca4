"""Pictures of circuits: the edge graph, the sender x receiver grid, the faithfulness curve.

Inputs are the results of ``lsc.edge_attribution`` (a (sender, receiver) DataArray with
``sender_kind/layer/head`` and ``receiver_kind/layer/head`` coords), ``lsc.circuit`` (the
same coords, boolean), ``lsc.edge_agreement`` (exact single-edge effects, shown where an
edge was measured) and ``lsc.circuit_faithfulness`` (a Dataset over ``budget``). Only
coords are read, so this module never imports torch. Every chart exports with
``lsc.export`` and offers no actions menu (its "Open in Vega Editor" goes online) unless
``actions=True``.

The graph is a grid of named nodes: layers top to bottom (the embeddings above ``L0``, the
logits below the last layer: the model computes downwards, as every heatmap of lenscape
draws layer 0 at the top and the edge grid draws its senders down from the embeddings), a
layer's query heads side by side (``H0`` ...), then its key/value heads (diamonds, columns
``KV0`` ..., each named on the axis and shared by a group of query heads: its tooltip says
which), then its MLP at the right: no node sits on another. The embeddings and the logits
are triangles named beside them. An edge is a line from its sender to the node that reads
it: a q edge ends at its query head, a k or v edge at its key/value head, an MLP edge at
the MLP, a logits edge at the logits. The line style says the receiver kind (solid q,
dashed k, dotted v, long dashes MLP, dash-dot logits), colour and width the score, and
the tooltip names the edge, its score and, where
``lsc.edge_agreement`` measured it, its exact effect. Given a ``lsc.circuit_stability``
result, each line's opacity is the share of bootstrap resamples whose circuit keeps the
edge, and the title says over how many resamples. The title says what is drawn: the
budget, the receiver kinds and the estimator. A circuit of more edges than ``edges``
(``DRAWN_EDGES``, 50, by default) draws its strongest ones and says so, with how to draw
them all: the others stay in the data and in ``CircuitExplorer``. Titles and subtitle lines
wrap at ``LINE_CHARS``, so the chart keeps about its own width.

**Scales.** Edge scores are heavy-tailed (on the indirect-object task one edge, embeddings
-> L0.MLP, scores 11 while most circuit edges score below 1), so when they span orders of
magnitude (``scale="auto"``, the default: ``encoding.pick_scale`` over every finite score of
the result, so every view of it picks the same) colour follows a symmetric-log scale
(linear within ``SYMLOG_SHARE`` of the limit, logarithmic beyond: three powers of ten,
ticked in the legend) and width a square-root one: weak edges show in colour beside the
strong one, which keeps the darkest colour and by far the widest line. The legend and
tooltips give true scores, and ``scale="linear"`` makes both linear (``"symlog"`` forces
the other). **When a scale is shared**: views of one result share
one scale, that of the whole result (``limit``: its largest |score|; ``CircuitExplorer``
passes it to every budget and receiver kind, and the subtitle says it is shared); views of
different results each take their own unless the caller passes one ``limit``. The edge
grid (``edge_heatmap``) takes the same symmetric-log colour scale.

Every input is read by label (``encoding.in_label_order``; a circuit by the labels of its
scores), so a ``sortby``, ``isel`` or ``transpose`` draws the same picture, and its kind
is checked: scores where a circuit is expected, or the reverse, are refused by name. What
cannot be drawn is said: a NaN curve or scores with nothing finite raise a ``ValueError``
with the cause, edges left out at a tie are named in the subtitle, and no spec holds NaN.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import altair as alt
import numpy as np
import xarray as xr
from altair.typing import ChartType

from .. import _validate, mask_rules
from ..schema import RECEIVER_KINDS, edge_exists
from .encoding import SCALES, SYMLOG_SHARE, in_label_order, jsonable, pick_scale, symlog_ticks
from .heatmaps import TITLE_LIMIT, heatmap, label_from_attrs, legend_title, wrap_line

#: Most edges the graph draws (a dense graph of thousands of lines reads as noise).
MAX_EDGES = 2000
#: Edges the graph draws by default, of a circuit or of the top edges: about as many lines
#: as a reader can follow on a 30-layer graph (654 lines of a 1% circuit pile onto the MLP
#: column); the title says how many the circuit holds and how to draw them all.
DRAWN_EDGES = 50
#: Longest title or subtitle line of the graph, in characters (longer ones wrap), so the
#: chart keeps about its own width and fits a notebook's output area.
LINE_CHARS = 115
#: Line style (Vega ``strokeDash``) of each receiver kind, all different in kind, not only
#: in length: solid, short dashes, dots, long dashes, dash-dot.
DASHES: dict[str, list[float]] = {
    "q": [1, 0],
    "k": [5, 4],
    "v": [1.5, 3],
    "mlp": [14, 5],
    "logits": [9, 3, 1.5, 3],
}
#: Opacity of an edge in no resample's circuit and in every one (``stability=``).
OPACITY_RANGE = (0.12, 1.0)
#: The ``method`` attr of ``lsc.circuit_stability``'s results.
STABILITY_METHODS = ("circuit_stability",)
#: What each receiver kind reads into, for the legend and the tooltips.
RECEIVER_NAMES = {
    "q": "q: a query head",
    "k": "k: a key/value head's key",
    "v": "v: a key/value head's value",
    "mlp": "mlp: an MLP",
    "logits": "logits",
}
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
#: Tooltip of an edge ``lsc.edge_agreement`` did not measure.
NOT_MEASURED = "not measured (lsc.edge_agreement)"
#: Coords an edge result carries on its sender and receiver dims (the graph's layout).
EDGE_COORDS = tuple(
    f"{end}_{part}" for end in ("sender", "receiver") for part in ("kind", "layer", "head")
)
#: The ``method`` attr of edge scores (``lsc.edge_attribution``) and of circuits
#: (``lsc.circuit``): the two kinds of edge result the views take.
SCORE_METHODS = ("edge_attribution",)
CIRCUIT_METHODS = ("circuit",)
#: The attrs that say which model a result was computed on (``LensModel.origin``): a
#: circuit drawn over scores must record the same ones.
ORIGIN_ATTRS = ("model", "layout_fingerprint", "weights_fingerprint")
#: Per ``check_edges(circuit=...)``: what makes such a result and the methods accepted.
_EDGE_RESULTS = {
    True: ("lsc.circuit", CIRCUIT_METHODS),
    False: ("lsc.edge_attribution", SCORE_METHODS),
    None: ("lsc.edge_attribution or lsc.circuit", SCORE_METHODS + CIRCUIT_METHODS),
}
#: What a grey cell of the edge grid is: a pair of components with no edge between them.
NO_EDGE = "no such edge (a receiver reads only components before it)"
#: Narrowest cell of the edge grid, in pixels: its rotated receiver labels never overlap.
GRID_STEP = 12
#: Widest edge grid drawn at ``GRID_STEP``; a wider one keeps the heatmap's cells and hides
#: the labels that would overlap.
GRID_WIDTH = 1400


def check_edges(da: Any, name: str, *, circuit: bool | None = False) -> xr.DataArray:
    """Check an edge result passed in (scores, or a circuit) and read it by label: (sender,
    receiver), each in the graph's order (``in_label_order``).

    Args:
        da: the value passed.
        name: the argument's name, for the message.
        circuit: True: a circuit (a mask: bool, or ``units`` "bool") is expected; False:
            scores; None: either.

    Raises:
        TypeError: not a DataArray.
        ValueError: a result of another method, scores where a circuit is expected (or the
            reverse), other dims than (sender, receiver), the layout coords missing, or
            labels that repeat.
    """
    made_by, methods = _EDGE_RESULTS[circuit]
    if not isinstance(da, xr.DataArray):
        raise TypeError(
            f"{name} must be a (sender, receiver) xarray.DataArray from {made_by}, "
            f"got {type(da).__name__}."
        )
    _validate.result(name, da, kind=xr.DataArray, made_by=made_by, methods=methods)
    if circuit is not None and mask_rules.is_mask(da) != circuit:
        got, fix = (
            (
                "scores (a number per edge)",
                "pick a circuit from them: lsc.circuit(scores, edges=50)",
            )
            if circuit
            else ("a circuit (True/False per edge)", "pass its scores, and the circuit as circuit=")
        )
        raise ValueError(f"{name} must be the result of {made_by}; got {got}: {fix}.")
    if set(da.dims) != {"sender", "receiver"}:
        raise ValueError(
            f"{name} must be a (sender, receiver) DataArray from {made_by}, got dims "
            f"{da.dims}; average per-prompt scores first: scores.mean('prompt')."
        )
    missing = [c for c in EDGE_COORDS if c not in da.coords]
    if missing:
        raise ValueError(
            f"{name} lacks the coord(s) {missing} that place its edges; pass the result of "
            f"{made_by} as it is."
        )
    return in_label_order(da, name=name)


@dataclass(frozen=True)
class _Node:
    """A node of the graph: its name ("L3.H2", "L3.KV1", "L3.MLP", "embeddings",
    "logits"), its kind (a key of ``NODE_SHAPES``), what it is, and where it is drawn."""

    name: str
    role: str
    about: str
    x: float
    y: float


@dataclass(frozen=True)
class _Layout:
    """Where the graph draws each node, from the model's sizes (read from the coords)."""

    n_layers: int
    n_heads: int
    n_kv: int

    @classmethod
    def of(cls, scores: xr.DataArray) -> _Layout:
        kinds = scores["sender_kind"].values
        n_layers = int((kinds == "mlp").sum())
        n_heads = int((kinds == "head").sum()) // max(n_layers, 1)
        n_kv = int((scores["receiver_kind"].values == "k").sum()) // max(n_layers, 1)
        return cls(n_layers, n_heads, max(n_kv, 1))

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return max(self.n_heads // self.n_kv, 1)

    def node(self, kind: str, layer: int, head: int) -> _Node:
        """The node a sender of ``kind`` is, or the node a receiver of ``kind`` reads into
        (a q receiver its query head, a k or v receiver its key/value head)."""
        middle = (self.n_heads - 1) / 2
        if kind == "embed":
            return _Node("embeddings", "embeddings, logits", "token embeddings", middle, -1.0)
        if kind == "logits":
            return _Node("logits", "embeddings, logits", "the logits", middle, self.n_layers)
        if kind == "mlp":
            return _Node(f"L{layer}.MLP", "MLP", f"MLP of layer {layer}", self.mlp_x, layer)
        if kind in ("head", "q"):
            return _Node(f"L{layer}.H{head}", "query head", f"query head {head}", head, layer)
        first = head * self.group
        return _Node(
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
        """The MLP's column, the last one, right of the key/value heads."""
        return self.kv_x(self.n_kv - 1) + 1 + KV_GAP

    def columns(self) -> tuple[list[float], list[str]]:
        """Every column's position and name: H0 ..., KV0 ..., MLP."""
        xs = [float(h) for h in range(self.n_heads)] + [self.kv_x(k) for k in range(self.n_kv)]
        names = [f"H{h}" for h in range(self.n_heads)] + [f"KV{k}" for k in range(self.n_kv)]
        return [*xs, self.mlp_x], [*names, "MLP"]

    def nodes(self) -> list[_Node]:
        """Every node: the embeddings, per layer its query heads, key/value heads and MLP,
        the logits."""
        ends = [("embed", -1, -1), ("logits", self.n_layers, -1)]
        for layer in range(self.n_layers):
            ends += [("head", layer, head) for head in range(self.n_heads)]
            ends += [("k", layer, head) for head in range(self.n_kv)]
            ends.append(("mlp", layer, -1))
        return [self.node(*end) for end in ends]

    def axes(self) -> dict[str, alt.X | alt.Y]:
        """The x (query heads, then the MLP) and y (embeddings, layers, logits) encodings,
        every column and row named."""
        top = self.n_layers
        xs, names = self.columns()
        x = alt.X(
            "x:Q",
            title=None,
            scale=alt.Scale(domain=[-0.6, self.mlp_x + 0.6], nice=False, zero=False),
            axis=alt.Axis(
                values=xs,
                labelExpr=f"{json.dumps(names)}[indexof({json.dumps(xs)}, datum.value)]",
                orient="top",
                grid=False,
                ticks=False,
                domain=False,
            ),
        )
        y = alt.Y(
            "y:Q",
            title=None,
            scale=alt.Scale(domain=[-2.1, top + 1.1], nice=False, zero=False, reverse=True),
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
        the embeddings, below the logits: no edge crosses there), not at the axis, each on a
        white outline so that no line end under it hides a letter."""
        embed, logits = self.node("embed", -1, -1), self.node("logits", self.n_layers, -1)

        def name(node: _Node) -> alt.Chart:
            return alt.Chart(alt.Data(values=[{"x": node.x, "y": node.y, "name": node.name}]))

        style: dict[str, Any] = {"fontSize": 12, "fontWeight": "bold"}
        marks = []
        for paint in ({"color": "white", "stroke": "white", "strokeWidth": 4}, {"color": "#222"}):
            marks.append(name(embed).mark_text(baseline="bottom", dy=-9, **style, **paint))
            marks.append(name(logits).mark_text(baseline="top", dy=9, **style, **paint))
        return alt.LayerChart(layer=[mark.encode(**self.axes(), text="name:N") for mark in marks])


def _check_graph_options(
    kinds: Any,
    title: Any,
    width: Any,
    height: Any,
    edges: Any,
    limit: Any,
    scale: Any,
    actions: Any,
) -> tuple[list[str], int, int, int, float | None, str, bool]:
    """``circuit_graph``'s options, checked: (kinds, width, height, edges, limit, scale,
    actions).

    Raises:
        TypeError: an option of the wrong type. ValueError: an unknown receiver kind or
            scale, a count or size out of range.
    """
    kinds = _validate.strings("kinds", kinds, example="('q', 'k')")
    bad = sorted(set(kinds) - set(RECEIVER_KINDS))
    if bad:
        raise ValueError(
            f"kinds holds unknown receiver kind(s) {bad}; choose from {list(RECEIVER_KINDS)}."
        )
    _validate.text("title", title, example="'IOI circuit'", optional=True)
    if limit is not None:
        limit = _validate.number("limit", limit, above=0)
    return (
        kinds,
        _validate.positive_int("width", width),
        _validate.positive_int("height", height),
        _validate.integer("edges", edges, low=1, high=MAX_EDGES),
        limit,
        _validate.choice("scale", scale, SCALES),
        _validate.flag("actions", actions),
    )


def circuit_graph(
    scores: xr.DataArray,
    circuit: xr.DataArray | None = None,
    *,
    edges: int = DRAWN_EDGES,
    kinds: Sequence[str] = RECEIVER_KINDS,
    exact: xr.Dataset | None = None,
    stability: xr.DataArray | None = None,
    limit: float | None = None,
    scale: str = "auto",
    title: str | None = None,
    width: int = 560,
    height: int = 640,
    actions: bool = False,
) -> ChartType:
    """Draw edges as lines between named components, layers top to bottom.

    Args:
        scores: (sender, receiver) edge scores (colour and width of each line), read by
            label.
        circuit: boolean (sender, receiver) from ``lsc.circuit`` or
            ``lsc.consensus_circuit``, read by the labels of ``scores``: draw its kept edges
            (``lenscape.mask_rules.kept``: non-zero and computed, never NaN); None: draw the
            ``edges`` edges with the largest |score| (ties broken in graph order, and the
            subtitle names the edges left out at a tie).
        edges: the most edges drawn (at most ``MAX_EDGES``; default ``DRAWN_EDGES``, as
            many as a reader can follow): the top edges by |score|, or, with a
            ``circuit``, its strongest kept edges; the title says how many the circuit holds
            and how to draw them all (``edges=`` that many, or ``lsc.CircuitExplorer``).
        kinds: receiver kinds to draw (a subset of q, k, v, mlp, logits).
        exact: a report of ``lsc.edge_agreement`` on the same model: the tooltip of each
            edge it measured shows its exact effect (mean over its prompts).
        stability: (sender, receiver) from ``lsc.circuit_stability`` on the same model:
            each line's opacity is the share of resamples whose circuit keeps the edge
            (faint: unstable), the tooltip gives it and the title the number of resamples.
        limit: the |score| drawn at full colour and width (larger ones too), so that views
            of one result share a scale; default the largest |score| drawn.
        scale: "symlog" (colour on a symmetric-log scale, linear within ``SYMLOG_SHARE`` x
            ``limit``, and width on a square-root one, so weak edges show beside a strong
            one), "linear" (both linear), or "auto": symlog when the finite scores of the
            whole result span orders of magnitude (``encoding.pick_scale``), else linear.
        title: chart title; default says what is drawn (budget, receiver kinds, estimator,
            resamples).
        width, height: chart size in pixels.
        actions: show Vega's actions menu (its "Open in Vega Editor" goes online).

    Returns:
        A layered Altair chart: the nodes (every query head, key/value head and MLP, the
        embeddings and the logits, named on the axes, beside them and in their tooltips)
        and the edges with tooltips (edge, receiver kind, score, exact effect where
        measured, share of resamples).

    Raises:
        TypeError: an argument of the wrong type (scores not a DataArray, edges not an
            integer, kinds not a list of strings, exact not a Dataset ...).
        ValueError: inputs that are not edge results or of the wrong kind (a circuit as
            scores, scores as the circuit, exact not from ``lsc.edge_agreement``, stability
            not from ``lsc.circuit_stability``), a circuit, exact effects or stability of
            another model, a circuit of other edges, infinite scores, a kept edge without a
            score, nothing to draw, an unknown kind or scale, too many edges, a limit <= 0.
    """
    scores = check_edges(scores, "scores")
    kinds, width, height, edges, limit, scale, actions = _check_graph_options(
        kinds, title, width, height, edges, limit, scale, actions
    )
    scale = pick_scale(scores.values, scale)
    measured = _exact_effects(exact, scores)
    shares = _stability_shares(stability, scores)
    chosen, tie_note = _chosen_edges(scores, circuit, kinds=kinds, edges=edges)
    cut = _cut_effects(circuit)
    source = "lsc.edge_agreement" if measured is not None else ""
    if cut:
        measured = {**(measured or {}), **cut}
        source = " and ".join(part for part in (source, "lsc.exact_cut") if part)
    layout = _Layout.of(scores)
    rows = _edge_rows(scores, chosen, layout, measured, shares)
    ramp = _Ramp(limit or max(row["magnitude"] for row in rows) or 1.0, scale, limit is not None)
    used = {row["from"] for row in rows} | {row["to"] for row in rows}
    lines = _lines(rows, layout, ramp=ramp, legend=legend_title(f"score ({_units(scores)})"))
    chart = alt.layer(lines, _points(layout, used), layout.end_labels())
    notes = _graph_notes(scores, kinds, layout, source, tie_note)
    if cut:
        notes.insert(-1, f"{len(cut)} edges at the cut measured by exact edge patching")
    notes.insert(1, ramp.note())
    if stability is not None:
        notes.insert(2, _stability_note(stability))
    held = _held_edges(scores, circuit, kinds) if circuit is not None else 0
    if held > len(rows):
        notes.insert(
            0,
            f"drawn: the {len(rows)} strongest of its {held:,} edges by |score| (edges={held} "
            "draws all; lsc.CircuitExplorer steps through them)",
        )
    return chart.properties(
        title=alt.TitleParams(
            wrapped(title or _graph_title(scores, circuit, len(rows), kinds, stability)),
            subtitle=[part for note in notes for part in _wrap(note)],
            anchor="start",
            limit=TITLE_LIMIT,
        ),
        width=width,
        height=height,
        usermeta={"embedOptions": {"actions": actions}},
    ).configure_view(stroke=None)


@dataclass(frozen=True)
class _Ramp:
    """The colour and width scale of the edges: up to ``limit``, symmetric-log or linear;
    ``shared``: the limit was given (one scale for several views), else the largest |score|
    drawn."""

    limit: float
    kind: str
    shared: bool = False

    @property
    def constant(self) -> float:
        """Where the symmetric-log scale turns from linear to logarithmic."""
        return self.limit * SYMLOG_SHARE

    def scale(self, **options: Any) -> alt.Scale:
        """An Altair scale of this kind with ``options`` (domain, range, scheme ...)."""
        if self.kind == "symlog":
            return alt.Scale(type="symlog", constant=self.constant, clamp=True, **options)
        return alt.Scale(type="linear", clamp=True, **options)

    def width(self) -> alt.Scale:
        """The line width's scale, 0.75 to 6 pixels up to the limit: square root beside a
        symmetric-log colour (weak edges visible, a strong edge still the widest by far),
        linear beside a linear one."""
        ends: dict[str, Any] = {"domain": [0, self.limit], "range": [0.75, 6], "clamp": True}
        if self.kind == "symlog":
            return alt.Scale(type="sqrt", **ends)
        return alt.Scale(type="linear", **ends)

    def ticks(self) -> list[float] | None:
        """Legend values of a symmetric-log scale: 0 and the powers of ten from its linear
        part to the limit, both signs (so the legend reads as the log scale it is); None
        (the default ticks) for a linear one."""
        return symlog_ticks(self.limit) if self.kind == "symlog" else None

    def note(self) -> str:
        """The subtitle line that says which scale is drawn, up to what, and how to get the
        other."""
        end = (
            f"±{self.limit:.3g}, shared by every view of these scores"
            if self.shared
            else f"±{self.limit:.3g}, the largest |score| drawn"
        )
        if self.kind == "symlog":
            return (
                f"scales: colour symmetric log up to {end}, linear within "
                f"±{self.constant:.2g}; width square root (scale='linear' for linear ones)"
            )
        return f"scales: linear up to {end} (scale='symlog' shows weak edges)"


def _wrap(line: str) -> list[str]:
    """``line`` as lines of at most ``LINE_CHARS`` characters, broken between words."""
    return wrap_line(line, LINE_CHARS)


def wrapped(title: str) -> str | list[str]:
    """A title kept within ``LINE_CHARS``: itself, or its parts (at " · ") as lines."""
    if len(title) <= LINE_CHARS:
        return title
    parts = title.split(" · ")
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + 3 + len(part) <= LINE_CHARS:
            lines[-1] += " · " + part
        else:
            lines.append(part)
    return [piece for line in lines for piece in _wrap(line)]


def _held_edges(scores: xr.DataArray, circuit: xr.DataArray, kinds: Sequence[str]) -> int:
    """How many edges of ``kinds`` the circuit keeps (``mask_rules.kept``)."""
    of_kinds = np.isin(scores["receiver_kind"].values, list(kinds))[None, :]
    kept = mask_rules.kept(
        circuit.transpose("sender", "receiver").sel(
            sender=scores["sender"], receiver=scores["receiver"]
        )
    )
    return int((kept.values & of_kinds).sum())


def _cut_effects(circuit: Any) -> dict[tuple[str, str], str]:
    """(sender, receiver) -> the exact effect of each edge ``lsc.exact_cut`` measured at a
    circuit's cut (its ``exact_effect`` coord), formatted; empty without one."""
    if circuit is None or "exact_effect" not in circuit.coords:
        return {}
    effect = circuit["exact_effect"].transpose("sender", "receiver")
    values = effect.values.astype(float)
    senders, receivers = effect["sender"].values, effect["receiver"].values
    return {
        (str(senders[s]), str(receivers[r])): f"{values[s, r]:.4g}"
        for s, r in np.argwhere(np.isfinite(values))
    }


def _stability_shares(stability: Any, scores: xr.DataArray) -> np.ndarray | None:
    """(sender, receiver) shares of resamples of a ``lsc.circuit_stability`` result, read
    by the labels of ``scores``; None without one.

    Raises:
        TypeError: not a DataArray. ValueError: a result of another method, a circuit,
            of another model or other edges, or shares outside [0, 1].
    """
    if stability is None:
        return None
    made_by = "lsc.circuit_stability(per_prompt_scores, edges=...)"
    _validate.result(
        "stability", stability, kind=xr.DataArray, made_by=made_by, methods=STABILITY_METHODS
    )
    if mask_rules.is_mask(stability) or set(stability.dims) != {"sender", "receiver"}:
        raise ValueError(
            f"stability must be the (sender, receiver) shares of resamples from {made_by}, "
            f"got {'a circuit' if mask_rules.is_mask(stability) else stability.dims}."
        )
    own = {key: scores.attrs[key] for key in ORIGIN_ATTRS if key in scores.attrs}
    _validate.origin("stability", stability, own, made_by=made_by)
    edges = {"sender": scores["sender"].values, "receiver": scores["receiver"].values}
    shares = _validate.labels("stability", stability, edges, made_by=made_by).values
    shares = shares.astype(float)
    if (np.isfinite(shares) & ((shares < 0) | (shares > 1))).any() or np.isinf(shares).any():
        raise ValueError(f"stability holds values outside [0, 1]; pass the result of {made_by}.")
    return shares


def _stability_note(stability: xr.DataArray) -> str:
    """The subtitle line that says what opacity shows."""
    attrs = stability.attrs
    count = attrs.get("n_resamples", "the")
    prompts = f" of the {attrs['n_prompts']} prompts" if "n_prompts" in attrs else ""
    picked = f" (top {attrs['budget']:,} edges, lsc.circuit)" if "budget" in attrs else ""
    return (
        f"opacity: share of {count} bootstrap resamples{prompts} whose circuit{picked} keeps "
        "the edge; faint lines are unstable"
    )


def _units(scores: xr.DataArray) -> str:
    """The scores' units for the legend ("logits"), or "score" when they have none."""
    return str(scores.attrs.get("units") or "score")


def _exact_effects(exact: Any, scores: xr.DataArray) -> dict[tuple[str, str], str] | None:
    """(sender, receiver) -> the exact effect of the edge, formatted, from a report of
    ``lsc.edge_agreement`` (mean over its prompts); None without a report.

    Raises:
        TypeError: not a Dataset. ValueError: a result of another method, or of another
            model than ``scores``.
    """
    if exact is None:
        return None
    made_by = "lsc.edge_agreement(model, prompts)"
    _validate.result(
        "exact",
        exact,
        kind=xr.Dataset,
        made_by=made_by,
        variables=("exact",),
        dims=("edge",),
        methods=("edge_agreement",),
    )
    own = {key: scores.attrs[key] for key in ORIGIN_ATTRS if key in scores.attrs}
    _validate.origin("exact", exact, own, made_by=made_by)
    effect = exact["exact"]
    effect = effect.mean("prompt") if "prompt" in effect.dims else effect
    ends = zip(effect["sender"].values, effect["receiver"].values, effect.values, strict=True)
    return {(str(s), str(r)): f"{float(v):.4g}" for s, r, v in ends if np.isfinite(v)}


def _edge_rows(
    scores: xr.DataArray,
    chosen: np.ndarray,
    layout: _Layout,
    measured: dict[tuple[str, str], str] | None,
    shares: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """One row per drawn edge: its ends' nodes and positions, labels, kind, score, exact
    effect (when ``measured`` is given) and share of resamples (when ``shares`` is),
    weakest first so strong lines lie on top."""
    values = scores.values.astype(float)
    rows = []
    for s, r in chosen:
        sender, receiver = (
            layout.node(*(scores[f"{end}_{part}"].values[i] for part in ("kind", "layer", "head")))
            for end, i in (("sender", s), ("receiver", r))
        )
        label = (str(scores["sender"].values[s]), str(scores["receiver"].values[r]))
        row = {
            **{"x": sender.x, "y": sender.y, "x2": receiver.x, "y2": receiver.y},
            **{"from": sender.name, "to": receiver.name, "edge": " → ".join(label)},
            **{"sender": label[0], "receiver": label[1]},
            "kind": str(scores["receiver_kind"].values[r]),
            "score": float(values[s, r]),
            "magnitude": abs(float(values[s, r])),
        }
        if measured is not None:
            row["exact"] = measured.get(label, NOT_MEASURED)
        if shares is not None:
            row["stability"] = float(np.nan_to_num(shares[s, r]))
        rows.append(row)
    return sorted(rows, key=lambda row: row["magnitude"])


def _lines(
    rows: list[dict[str, Any]], layout: _Layout, *, ramp: _Ramp, legend: str | list[str]
) -> alt.Chart:
    """The edges: colour and width by score on one ``ramp`` (symmetric-log or linear, up to
    its limit), the line style by receiver kind (every kind in the legend, so styles never
    change between views), and the opacity by share of resamples where rows have one."""
    dash_names = " : ".join(
        f"datum.label == {json.dumps(k)} ? {json.dumps(v)}" for k, v in RECEIVER_NAMES.items()
    )
    tips = [
        alt.Tooltip("edge:N"),
        alt.Tooltip("kind:N", title="receiver kind"),
        alt.Tooltip("score:Q", format=".4g"),
    ]
    if rows and "exact" in rows[0]:
        tips.append(alt.Tooltip("exact:N", title="exact effect (edge patching)"))
    stable: dict[str, Any] = {}
    if rows and "stability" in rows[0]:
        tips.append(alt.Tooltip("stability:Q", title="share of resamples", format=".0%"))
        stable["opacity"] = alt.Opacity(
            "stability:Q",
            title="share of resamples",
            scale=alt.Scale(domain=[0, 1], range=list(OPACITY_RANGE)),
            legend=alt.Legend(format=".0%", values=[0, 0.5, 0.9, 1]),
        )
    limit, ticks = ramp.limit, ramp.ticks()
    return (
        alt.Chart(alt.Data(values=rows))
        .mark_rule()
        .encode(
            **layout.axes(),
            x2="x2:Q",
            y2="y2:Q",
            color=alt.Color(
                "score:Q",
                title=legend,
                scale=ramp.scale(scheme="blueorange", domain=[-limit, limit], domainMid=0),
                legend=alt.Legend(gradientLength=140, format=".3~r", **_values(ticks)),
            ),
            strokeWidth=alt.StrokeWidth("magnitude:Q", title="|score|", scale=ramp.width()),
            strokeDash=alt.StrokeDash(
                "kind:N",
                title="line: receiver kind",
                scale=alt.Scale(
                    domain=list(RECEIVER_KINDS), range=[DASHES[k] for k in RECEIVER_KINDS]
                ),
                legend=alt.Legend(
                    symbolType="stroke",
                    symbolSize=900,
                    symbolStrokeWidth=2,
                    labelExpr=f"{dash_names} : datum.label",
                    labelLimit=260,
                ),
            ),
            tooltip=tips,
            **stable,
        )
    )


def _values(ticks: list[float] | None) -> dict[str, Any]:
    """A legend's ``values`` option where ``ticks`` are given."""
    return {} if ticks is None else {"values": ticks}


def _points(layout: _Layout, used: set[str]) -> alt.Chart:
    """Every node, shaped by kind; the nodes an edge touches dark and larger, the others
    light; the tooltip names the node and says what it is."""
    rows = [
        {
            "x": n.x,
            "y": n.y,
            "node": n.name,
            "role": n.role,
            "about": n.about,
            "used": n.name in used,
        }
        for n in layout.nodes()
    ]
    return (
        alt.Chart(alt.Data(values=rows))
        .mark_point(filled=True, opacity=1)
        .encode(
            **layout.axes(),
            shape=alt.Shape(
                "role:N",
                title="node",
                scale=alt.Scale(domain=list(NODE_SHAPES), range=list(NODE_SHAPES.values())),
            ),
            color=alt.condition("datum.used", alt.value("#222222"), alt.value("#c4c4c4")),
            size=alt.condition("datum.used", alt.value(60), alt.value(22)),
            tooltip=[alt.Tooltip("node:N"), alt.Tooltip("about:N", title="what")],
        )
    )


def _graph_title(
    scores: xr.DataArray,
    circuit: xr.DataArray | None,
    drawn: int,
    kinds: Sequence[str],
    stability: xr.DataArray | None = None,
) -> str:
    """What the graph shows: the budget (a circuit's size and how it was picked, or the top
    edges), the receiver kinds, the estimator and the resamples of ``stability``."""
    if circuit is None:
        shown = f"Top {drawn} edges by |score|"
    else:
        attrs = circuit.attrs
        picked = (
            f" (top {attrs['budget']:,} of {attrs['total_edges']:,} by |score|, on paths "
            "embeddings → logits)"
            if {"budget", "total_edges"} <= set(attrs)
            else ""
        )
        name = "Circuit"
        if "consensus_share" in attrs:
            name = "Consensus circuit"
            top = f" top-{attrs['budget']:,}" if "budget" in attrs else ""
            picked = (
                f" (in ≥ {attrs['consensus_share']:.0%} of {attrs.get('n_resamples', '?')} "
                f"resampled{top} circuits, on paths embeddings → logits)"
            )
        size = attrs.get("n_edges", drawn)
        shown = f"{name} of {size:,} edges{picked}"
        if drawn != size:
            shown = f"{drawn:,} edges of a {name.lower()} of {size:,}{picked}"
    every = set(RECEIVER_KINDS) <= set(kinds)
    receivers = "all receivers" if every else f"receivers {', '.join(kinds)}"
    estimator = str(scores.attrs.get("estimator", "")).upper()
    if estimator.endswith("-IG") and "steps" in scores.attrs:
        estimator += f" ({scores.attrs['steps']} steps)"
    resampled = (
        f"stability over {stability.attrs['n_resamples']} resamples"
        if stability is not None and "n_resamples" in stability.attrs
        else "stability"
        if stability is not None
        else ""
    )
    return " · ".join(part for part in (shown, receivers, estimator, resampled) if part)


def _graph_notes(
    scores: xr.DataArray, kinds: Sequence[str], layout: _Layout, measured: str, tie_note: str
) -> list[str]:
    """The graph's subtitle: what colour and width show, where k and v edges end, what the
    tooltip holds (``measured``: what measured exact effects, or ""), and the edges left
    out at a tie."""
    notes = [f"colour and width: {label_from_attrs(scores, 'score')}"]
    if {"k", "v"} & set(kinds):
        columns = "column KV0" if layout.n_kv == 1 else f"columns KV0 to KV{layout.n_kv - 1}"
        notes.append(
            f"k and v edges end at a key/value head (a diamond, {columns}, each shared by "
            f"{layout.group} query heads: KV0 by H0 to H{layout.group - 1})"
        )
    notes.append(
        "hover a line for the edge and its score"
        + (f", and its exact effect where {measured} measured it" if measured else "")
    )
    return notes + ([tie_note] if tie_note else [])


def _chosen_edges(
    scores: xr.DataArray, circuit: Any, *, kinds: Sequence[str], edges: int
) -> tuple[np.ndarray, str]:
    """The edges ``circuit_graph`` draws: the circuit's kept edges of ``kinds``, or without
    a circuit the ``edges`` of largest |score| (ties broken in graph order).

    Args:
        scores: edge scores read by label (``check_edges``).
        circuit: the ``circuit`` argument, or None.

    Returns:
        (edges, 2) sender and receiver positions in ``scores``, in graph order; a subtitle
        naming the edges left out at a tie of |score| ("" when none).

    Raises:
        ValueError: infinite scores; a circuit that is not one, of another model or other
            edges; a kept edge whose score is NaN (no edge of these scores); nothing to draw.
    """
    values = scores.values.astype(float)
    infinite = int(np.isinf(values).sum())
    if infinite:
        raise ValueError(
            f"scores holds {infinite} infinite score(s), which no colour or width can show; "
            "recompute the scores (lsc.edge_attribution)."
        )
    of_kinds = np.isin(scores["receiver_kind"].values, list(kinds))[None, :]
    which = "" if set(RECEIVER_KINDS) <= set(kinds) else f" to the receiver kinds {list(kinds)}"
    if circuit is not None:
        made_by = "lsc.circuit(scores, ...)"
        mask = check_edges(circuit, "circuit", circuit=True)
        own = {key: scores.attrs[key] for key in ORIGIN_ATTRS if key in scores.attrs}
        _validate.origin("circuit", mask, own, made_by=made_by)
        edges_of_scores = {"sender": scores["sender"].values, "receiver": scores["receiver"].values}
        read = _validate.labels("circuit", mask, edges_of_scores, made_by=made_by)
        kept = mask_rules.kept(read)
        unscored = np.argwhere(kept.values & np.isnan(values))
        if len(unscored):
            s, r = unscored[0]
            raise ValueError(
                f"circuit keeps {len(unscored)} edge(s) that have no score in scores (NaN), "
                f"e.g. {scores['sender'].values[s]} -> {scores['receiver'].values[r]}; pass "
                "the scores the circuit was picked from."
            )
        chosen = np.argwhere(kept.values & of_kinds)
        if not len(chosen):
            raise ValueError(
                f"circuit keeps no edge{which}, so there is nothing to draw; pick a larger "
                "circuit (lsc.circuit(scores, edges=50)) or other kinds."
            )
        if len(chosen) <= edges:
            return chosen, ""
        of_kinds = kept.values & of_kinds  # the circuit's strongest edges, as below
    magnitude = np.where(of_kinds & np.isfinite(values), np.abs(values), -np.inf).ravel()
    count = min(edges, int(np.isfinite(magnitude).sum()))
    if count == 0:
        raise ValueError(
            f"scores holds no finite score on an edge{which} (every one is NaN), so there is "
            "nothing to draw; recompute the scores (lsc.edge_attribution)."
        )
    order = np.argsort(-magnitude, kind="stable")
    cut = magnitude[order[count - 1]]
    tied = int((magnitude[order[count:]] == cut).sum())
    note = (
        f"{tied} more edge(s) tie with the last one drawn (|score| {cut:.4g}) and are left "
        "out: the first in graph order are drawn"
        if tied
        else ""
    )
    top = np.zeros(values.size, dtype=bool)
    top[order[:count]] = True
    return np.argwhere(top.reshape(values.shape)), note


def edge_heatmap(scores: xr.DataArray, *, scale: str = "auto", **options: Any) -> ChartType:
    """The sender x receiver grid of edge scores, or of a circuit (kept and skipped edges),
    with receivers across and senders down (the embeddings at the top, as the graph and
    every heatmap draw layer 0 at the top), each in the graph's order whatever the array's.

    A grey cell is a pair with no edge between them (the receiver comes before the sender),
    and the subtitle says so; a real edge without a score (NaN) is counted there as not
    computed. Scores that span orders of magnitude take a symmetric-log colour scale
    (``scale="auto"``, decided on every finite score, as ``circuit_graph`` decides; linear
    within ``SYMLOG_SHARE`` of the largest |score|: one strong edge no longer turns the
    rest white), and the subtitle says so. Cells are wide enough for the rotated receiver
    labels not to overlap, up to ``GRID_WIDTH`` pixels; a wider grid hides the labels that
    would overlap.

    Args:
        scores: (sender, receiver) from ``lsc.edge_attribution`` or ``lsc.circuit``.
        scale: "auto", "symlog" or "linear": the colour scale of scores (a circuit's two
            states take neither).
        options: passed to ``heatmap``.

    Returns:
        The ``heatmap`` chart.

    Raises:
        TypeError: ``scores`` is not a DataArray.
        ValueError: not an edge result (see ``check_edges``), an unknown scale, or a bad
            option.
    """
    edges = check_edges(scores, "scores", circuit=None)
    scale = pick_scale(edges.values, scale)
    if not mask_rules.is_mask(edges):
        options = {"color": "blueorange", **options}  # the graph's colours
    chart = heatmap(edges, x="receiver", y="sender", scale=scale, **options)
    exists = edge_exists(
        edges["sender_kind"].values[:, None],
        edges["sender_layer"].values[:, None],
        edges["receiver_kind"].values[None, :],
        edges["receiver_layer"].values[None, :],
        parallel=edges.attrs.get("residual") == "parallel",
    )
    missing = np.isnan(edges.values.astype(float))
    unscored = int((missing & exists).sum())
    grey = NO_EDGE + (f"; {unscored} edges {mask_rules.NAN_LABEL}" if unscored else "")
    subtitle = chart.title.subtitle if isinstance(chart.title, alt.TitleParams) else None
    lines = list(subtitle) if isinstance(subtitle, list) else []
    if (missing & ~exists).any():
        lines = [line.replace(f"grey: {mask_rules.NAN_LABEL}", f"grey: {grey}") for line in lines]
    if lines and isinstance(chart.title, alt.TitleParams):
        chart = chart.properties(
            title=alt.TitleParams(**{**chart.title.to_dict(), "subtitle": lines})
        )
    wide = edges.sizes["receiver"] * GRID_STEP <= GRID_WIDTH
    if wide:
        return chart.properties(width=alt.Step(GRID_STEP), height=alt.Step(GRID_STEP))
    return chart.configure_axis(labelOverlap="parity")


def faithfulness_curve(
    result: xr.Dataset, *, title: str | None = None, actions: bool = False
) -> ChartType:
    """Faithfulness against the edge budget (log scale), the circuit beside the mean of
    the random circuits, with a rule at 1 (the full model).

    Args:
        result: a Dataset from ``lsc.circuit_faithfulness``, read by label (budgets in
            increasing order whatever the array's).
        title: chart title; default names CPR and CMD ("undefined" where NaN).
        actions: show Vega's actions menu (its "Open in Vega Editor" goes online).

    Returns:
        A layered Altair chart; a budget whose faithfulness is NaN is left out, and the
        subtitle says how many.

    Raises:
        TypeError: ``result`` is not a Dataset or ``title`` not a string.
        ValueError: ``result`` is of another method, lacks a variable of
            ``lsc.circuit_faithfulness``, or its faithfulness is NaN at every budget (the
            message gives the reason the result records, e.g. corrupt runs equal to the
            clean ones).
    """
    _validate.result(
        "result",
        result,
        kind=xr.Dataset,
        made_by="lsc.circuit_faithfulness(model, prompts, scores)",
        variables=("faithfulness", "cpr", "cmd", "random_cpr", "random_cmd"),
        methods=("circuit_faithfulness",),
    )
    _validate.text("title", title, example="'IOI circuit'", optional=True)
    actions = _validate.flag("actions", actions)
    result = in_label_order(result, name="result")
    if not np.isfinite(result["faithfulness"].values).any():
        why = result.attrs.get("undefined", "no budget holds a number")
        raise ValueError(
            f"result's faithfulness is NaN at every budget ({why}), so there is no curve to "
            "draw; check that the corrupt prompts change the answer (lsc.inspect_prompts) "
            "and run lsc.circuit_faithfulness again."
        )
    curves = {"top edges": result["faithfulness"].values}
    if result.sizes.get("seed", 0):
        curves["random"] = result["random_faithfulness"].mean("seed").values
    one = alt.Chart(alt.Data(values=[{"y": 1.0}])).mark_rule(strokeDash=[4, 4]).encode(y="y:Q")
    summary = ", ".join(
        f"{name.upper()} {_number(result[name])} (random {_number(result[f'random_{name}'])})"
        for name in ("cpr", "cmd")
    )
    return alt.layer(_curve_lines(result, curves), one).properties(
        title=alt.TitleParams(
            title or f"Circuit faithfulness: {summary}",
            subtitle=_curve_notes(result, curves) or alt.Undefined,
            anchor="start",
            limit=TITLE_LIMIT,
        ),
        width=420,
        height=260,
        usermeta={"embedOptions": {"actions": actions}},
    )


def _curve_lines(result: xr.Dataset, curves: dict[str, np.ndarray]) -> alt.Chart:
    """The faithfulness curves against the budget (log scale), NaN points left out."""
    budgets, n_edges = result["budget"].values, result["n_edges"].values
    rows = [
        {"budget": float(b), "edges": int(n), "faithfulness": f, "circuit": name}
        for name, curve in curves.items()
        for b, n, f in zip(budgets, n_edges, jsonable(np.asarray(curve, float)), strict=True)
        if f is not None
    ]
    lines = (
        alt.Chart(alt.Data(values=rows))
        .mark_line(point=True)
        .encode(
            x=alt.X(
                "budget:Q", title="edge budget (share of all edges)", scale=alt.Scale(type="log")
            ),
            y=alt.Y("faithfulness:Q", title="faithfulness (0 corrupt, 1 full model)"),
            color=alt.Color("circuit:N", title="circuit"),
            tooltip=[
                "circuit:N",
                "budget:Q",
                "edges:Q",
                alt.Tooltip("faithfulness:Q", format=".3f"),
            ],
        )
    )
    return lines


def _curve_notes(result: xr.Dataset, curves: dict[str, np.ndarray]) -> list[str]:
    """The faithfulness curve's subtitle: which scores picked the circuits, what the random
    curve averages, and how many points are NaN (not drawn)."""
    missing = sum(int((~np.isfinite(curve)).sum()) for curve in curves.values())
    notes = [
        f"top edges: circuits of the {str(result.attrs['scored_by']).upper()} scores"
        if "scored_by" in result.attrs
        else "",
        f"random: the mean of {result.sizes['seed']} random circuits of each size"
        if "random" in curves
        else "",
        f"{missing} points not computed (NaN), not drawn" if missing else "",
    ]
    return [note for note in notes if note]


def _number(value: xr.DataArray) -> str:
    """A scalar statistic for a title: 3 decimals, or "undefined" where it is NaN."""
    number = float(value)
    return f"{number:.3f}" if np.isfinite(number) else "undefined"
