"""Pictures of circuits: the edge graph, the sender x receiver grid, the faithfulness curve.

Inputs are the results of ``lsc.edge_attribution`` (a (sender, receiver) DataArray with
``sender_kind/layer/head`` and ``receiver_kind/layer/head`` coords), ``lsc.circuit`` (the
same coords, boolean), ``lsc.edge_agreement`` (exact single-edge effects, shown where an
edge was measured) and ``lsc.circuit_faithfulness`` (a Dataset over ``budget``). Only
coords are read, so this module never imports torch. Every chart exports with
``lsc.export`` and offers no actions menu (its "Open in Vega Editor" goes online) unless
``actions=True``.

**By span** (``lsc.edge_attribution(..., positions="spans")``: a (span, sender, receiver)
result, and the circuits, stability and exact effects made from it) the graph draws one
group of columns per span, left to right in prompt order, each named above it
(``circuit_layout``): an edge runs inside its span's columns, and a crossing edge (a key or
value at span s read by queries at a later span t) is a curve from s to the key/value head
in t's columns, the tooltip naming both spans. ``spans=`` draws the edges at some spans
only (``CircuitExplorer`` steps through them), every span's columns staying in place. A
result by span beside a position-agnostic one (a circuit, stability or exact effects of the
other kind) is refused naming the fix, both ways; the edge grid draws one span at a time.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import altair as alt
import numpy as np
import xarray as xr
from altair.typing import ChartType

from .. import _validate, mask_rules
from ..data.spans import OTHER
from ..schema import EDGE_DIMS, RECEIVER_KINDS, edge_exists
from .circuit_layout import NODE_SHAPES, Layout
from .encoding import SCALES, SYMLOG_SHARE, in_label_order, jsonable, pick_scale, symlog_ticks
from .heatmaps import TITLE_LIMIT, heatmap, label_from_attrs, legend_title, wrap_line

#: Pixels per column of a graph by span, when no width is given (about 13 columns a span
#: on SmolLM2: 9 query heads, 3 key/value heads and the MLP).
SPAN_COLUMN = 20
#: The faithfulness compared curves are read at (the legend says where each first reaches it).
FAITHFUL = 0.9
#: How far a crossing edge's curve bows above the straight line between its ends, in rows.
BOW = 1.5
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


def check_edges(
    da: Any, name: str, *, circuit: bool | None = False, by_span: bool = True
) -> xr.DataArray:
    """Check an edge result passed in (scores, or a circuit) and read it by label: (sender,
    receiver), or by span (span, sender, receiver), each in the graph's order
    (``in_label_order``: spans in prompt order).

    Args:
        da: the value passed.
        name: the argument's name, for the message.
        circuit: True: a circuit (a mask: bool, or ``units`` "bool") is expected; False:
            scores; None: either.
        by_span: whether a result by span (``positions="spans"``) is taken whole; False:
            only one span of it (``scores.sel(span="END")``).

    Raises:
        TypeError: not a DataArray.
        ValueError: a result of another method, scores where a circuit is expected (or the
            reverse), other dims, a result by span where it is not taken (or one span of it
            where the whole is), the layout coords missing, or labels that repeat.
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
    _check_edge_dims(da, name, made_by, by_span)
    needed = EDGE_COORDS + (("query_span",) if "span" in da.dims else ())
    missing = [c for c in needed if c not in da.coords]
    if missing:
        raise ValueError(
            f"{name} lacks the coord(s) {missing} that place its edges; pass the result of "
            f"{made_by} as it is."
        )
    return in_label_order(da, name=name)


def _check_edge_dims(da: xr.DataArray, name: str, made_by: str, by_span: bool) -> None:
    """Refuse an edge result of other dims than (sender, receiver) or, where ``by_span``,
    (span, sender, receiver), naming the fix."""
    dims = set(da.dims)
    if dims == {"span", *EDGE_DIMS} and not by_span:
        raise ValueError(
            f"{name} is by span (dims {da.dims}), one grid per span; draw one span's: "
            f"{name}.sel(span='END'), or every span at once with lsc.circuit_graph({name})."
        )
    if dims == set(EDGE_DIMS) and by_span and "query_span" in da.coords:
        raise ValueError(
            f"{name} is one span of a result by span (its span dim was selected away), whose "
            f"key/value edges feed other spans; pass the whole result, or keep the dim: "
            f"{name}.isel(span=[0])."
        )
    if dims not in ({"span", *EDGE_DIMS}, set(EDGE_DIMS)):
        fix = (
            f"average per-prompt scores first: {name}.mean('prompt')"
            if "prompt" in dims
            else f"pass the result of {made_by} as it is"
        )
        raise ValueError(
            f"{name} must be a (sender, receiver) DataArray, or by span a (span, sender, "
            f"receiver) one, from {made_by}; got dims {da.dims}: {fix}."
        )


def _check_positions(name: str, by_span: bool, scores: xr.DataArray, made_by: str) -> None:
    """Refuse ``name`` (a circuit, stability or exact effects: ``by_span`` whether it is by
    span) beside ``scores`` of the other kind, naming the fix."""
    ours = "span" in scores.dims
    if by_span != ours:
        kind = {True: "by span (positions='spans')", False: "position-agnostic"}
        raise ValueError(
            f"{name} is {kind[by_span]} but scores are {kind[ours]}; pass the {made_by} "
            f"of the scores drawn (both from lsc.edge_attribution with the same positions=)."
        )


def _labels_of(scores: xr.DataArray) -> dict[str, Any]:
    """Each dim of an edge result (span, sender, receiver) -> its labels, in its order."""
    return {str(dim): scores[dim].values for dim in scores.dims}


def _edge_label(scores: xr.DataArray, index: Sequence[int] | np.ndarray) -> tuple[str, ...]:
    """The labels of the edge at ``index`` (one position per dim of ``scores``)."""
    return tuple(str(scores[dim].values[i]) for dim, i in zip(scores.dims, index, strict=True))


def _edge_name(label: tuple[str, ...]) -> str:
    """An edge's labels as text: "L0.H1 → L1.MLP"; by span "L0.H1 → L1.MLP at S2", or
    through a key or value "L0.H1@S2 → L1.KV0.k@END" (read at S2 by queries at END)."""
    *span, sender, receiver = label
    if not span:
        return f"{sender} → {receiver}"
    return (
        f"{sender}@{span[0]} → {receiver}"
        if "@" in receiver
        else f"{sender} → {receiver} at {span[0]}"
    )


def _check_graph_options(
    kinds: Any,
    title: Any,
    width: Any,
    height: Any,
    edges: Any,
    limit: Any,
    scale: Any,
    actions: Any,
) -> tuple[list[str], int | None, int, int, float | None, str, bool]:
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
        None if width is None else _validate.positive_int("width", width),
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
    spans: Sequence[str] | None = None,
    exact: xr.Dataset | None = None,
    stability: xr.DataArray | None = None,
    limit: float | None = None,
    scale: str = "auto",
    title: str | None = None,
    width: int | None = None,
    height: int = 640,
    actions: bool = False,
) -> ChartType:
    """Draw edges as lines between named components, layers top to bottom; by span, one
    group of columns per span, left to right in prompt order.

    Args:
        scores: (sender, receiver) edge scores (colour and width of each line), read by
            label; or (span, sender, receiver) from ``lsc.edge_attribution(...,
            positions="spans")``: each span's nodes in columns of their own
            (``circuit_layout``), an edge inside its span's columns, and a crossing edge (a
            key or value at one span read by queries at another) curved from the sender's
            span to the key/value head in the query span's columns.
        circuit: boolean, of the same dims, from ``lsc.circuit`` or
            ``lsc.consensus_circuit``, read by the labels of ``scores``: draw its kept edges
            (``lenscape.mask_rules.kept``: non-zero and computed, never NaN); None: draw the
            ``edges`` edges with the largest |score| (ties broken in graph order, and the
            subtitle names the edges left out at a tie).
        edges: the most edges drawn (at most ``MAX_EDGES``; default ``DRAWN_EDGES``, as
            many as a reader can follow): the top edges by |score|, or, with a
            ``circuit``, its strongest kept edges; the title says how many the circuit holds
            and how to draw them all (``edges=`` that many, or ``lsc.CircuitExplorer``).
        kinds: receiver kinds to draw (a subset of q, k, v, mlp, logits).
        spans: by span, the spans whose edges (by the span their sender writes at) are
            drawn; default every span. Every span's columns are drawn either way.
        exact: a report of ``lsc.edge_agreement`` on the same model and positions: the
            tooltip of each edge it measured shows its exact effect (mean over its prompts).
        stability: from ``lsc.circuit_stability`` on the same model and positions: each
            line's opacity is the share of resamples whose circuit keeps the edge (faint:
            unstable), the tooltip gives it and the title the number of resamples.
        limit: the |score| drawn at full colour and width (larger ones too), so that views
            of one result share a scale; default the largest |score| drawn.
        scale: "symlog" (colour on a symmetric-log scale, linear within ``SYMLOG_SHARE`` x
            ``limit``, and width on a square-root one, so weak edges show beside a strong
            one), "linear" (both linear), or "auto": symlog when the finite scores of the
            whole result span orders of magnitude (``encoding.pick_scale``), else linear.
        title: chart title; default says what is drawn (budget, receiver kinds, estimator,
            spans, resamples).
        width, height: chart size in pixels; width default 560, by span ``SPAN_COLUMN``
            pixels a column (the chart grows with the spans).
        actions: show Vega's actions menu (its "Open in Vega Editor" goes online).

    Returns:
        A layered Altair chart: the nodes (every query head, key/value head and MLP, the
        embeddings and the logits, named on the axes, beside them and in their tooltips)
        and the edges with tooltips (edge, receiver kind, score, span and query span by
        span, exact effect where measured, share of resamples).

    Raises:
        TypeError: an argument of the wrong type (scores not a DataArray, edges not an
            integer, kinds not a list of strings, exact not a Dataset ...).
        ValueError: inputs that are not edge results or of the wrong kind (a circuit as
            scores, scores as the circuit, exact not from ``lsc.edge_agreement``, stability
            not from ``lsc.circuit_stability``), a circuit, exact effects or stability of
            another model or of the other positions (by span beside position-agnostic
            scores, or the reverse), a circuit of other edges, infinite scores, a kept edge
            without a score, nothing to draw, an unknown kind, span or scale, too many
            edges, a limit <= 0.
    """
    scores = check_edges(scores, "scores")
    kinds, width, height, edges, limit, scale, actions = _check_graph_options(
        kinds, title, width, height, edges, limit, scale, actions
    )
    scale = pick_scale(scores.values, scale)
    measured = _exact_effects(exact, scores)
    shares = _stability_shares(stability, scores)
    of_spans = _sender_spans(scores, spans)
    chosen, tie_note = _chosen_edges(scores, circuit, kinds=kinds, edges=edges, spans=of_spans)
    cut = _cut_effects(circuit)
    source = "lsc.edge_agreement" if measured is not None else ""
    if cut:
        measured = {**(measured or {}), **cut}
        source = " and ".join(part for part in (source, "lsc.exact_cut") if part)
    layout = Layout.of(scores)
    rows = _edge_rows(scores, chosen, layout, measured, shares)
    ramp = _Ramp(limit or max(row["magnitude"] for row in rows) or 1.0, scale, limit is not None)
    notes = _graph_notes(scores, kinds, layout, source, tie_note)
    if cut:
        notes.insert(-1, f"{len(cut)} edges at the cut measured by exact edge patching")
    notes.insert(1, ramp.note())
    if stability is not None:
        notes.insert(2, _stability_note(stability))
    held = _held_edges(scores, circuit, kinds, of_spans) if circuit is not None else 0
    if held > len(rows):
        notes.insert(0, _drawn_note(len(rows), held, spans is not None))
    shown = of_spans if spans is not None else None
    return (
        _graph_chart(rows, layout, ramp, _units(scores))
        .properties(
            title=alt.TitleParams(
                wrapped(title or _graph_title(scores, circuit, len(rows), kinds, stability, shown)),
                subtitle=[part for note in notes for part in _wrap(note)],
                anchor="start",
                limit=TITLE_LIMIT,
            ),
            width=width or _default_width(layout),
            height=height,
            usermeta={"embedOptions": {"actions": actions}},
        )
        .configure_view(stroke=None)
    )


def _drawn_note(drawn: int, held: int, picked: bool = False) -> str:
    """The subtitle line of a circuit drawn in part: how many of its edges (``picked``: at
    the spans picked), and how to see them all."""
    at = " at these spans" if picked else ""
    return (
        f"drawn: the {drawn} strongest of its {held:,} edges{at} by |score| (edges={held} "
        "draws all; lsc.CircuitExplorer steps through them)"
    )


def _graph_chart(rows: list[dict[str, Any]], layout: Layout, ramp: _Ramp, units: str) -> Any:
    """The graph's layers: span separators (by span), straight edges, crossing edges
    (curves, by span), the nodes and the names of the ends and spans."""
    used = {row["from"] for row in rows} | {row["to"] for row in rows}
    legend = legend_title(f"score ({units})")
    straight = [row for row in rows if not row.get("crossing")]
    crossing = [row for row in rows if row.get("crossing")]
    layers: list[Any] = [_lines(straight, layout, ramp=ramp, legend=legend)]
    if crossing:
        layers.append(_curves(crossing, layout, ramp=ramp, legend=legend))
    if layout.spans:
        layers.insert(0, layout.separators())
    return alt.layer(*layers, _points(layout, used), layout.end_labels())


def _default_width(layout: Layout) -> int:
    """560 pixels, or by span ``SPAN_COLUMN`` pixels a column (gaps counted)."""
    if not layout.spans:
        return 560
    return max(560, round((layout.right + 1.2) * SPAN_COLUMN))


def _sender_spans(scores: xr.DataArray, spans: Any) -> np.ndarray | None:
    """(n_spans,) bool: the spans ``spans`` names (all when None); None for scores that are
    not by span.

    Raises:
        TypeError: not a list of strings. ValueError: spans of position-agnostic scores,
            or a span the scores do not hold.
    """
    if "span" not in scores.dims:
        if spans is not None:
            raise ValueError(
                "spans= picks the spans of scores by span, but these scores are "
                "position-agnostic; compute them with lsc.edge_attribution(..., "
                "positions='spans'), or leave spans out."
            )
        return None
    held = [str(span) for span in scores["span"].values]
    if spans is None:
        return np.ones(len(held), dtype=bool)
    wanted = _validate.strings("spans", spans, example="('S2', 'END')")
    unknown = sorted(set(wanted) - set(held))
    if unknown:
        raise ValueError(f"spans holds span(s) {unknown} the scores lack; choose from {held}.")
    return np.isin(held, wanted)


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


def _held_edges(
    scores: xr.DataArray,
    circuit: xr.DataArray,
    kinds: Sequence[str],
    spans: np.ndarray | None = None,
) -> int:
    """How many edges of ``kinds`` (and, by span, at the ``spans`` marked) the circuit
    keeps (``mask_rules.kept``)."""
    of_kinds = np.isin(scores["receiver_kind"].values, list(kinds))[None, :]
    if spans is not None:
        of_kinds = of_kinds & spans[:, None, None]
    labels = _labels_of(scores)
    kept = mask_rules.kept(circuit.transpose(*labels).sel(labels))
    return int((kept.values & of_kinds).sum())


def _cut_effects(circuit: Any) -> dict[tuple[str, ...], str]:
    """Edge labels ((span,) sender, receiver) -> the exact effect of each edge
    ``lsc.exact_cut`` measured at a circuit's cut (its ``exact_effect`` coord), formatted;
    empty without one."""
    if circuit is None or "exact_effect" not in circuit.coords:
        return {}
    effect = circuit["exact_effect"]
    effect = effect.transpose(*[dim for dim in ("span", *EDGE_DIMS) if dim in effect.dims])
    values = effect.values.astype(float)
    return {
        _edge_label(effect, index): f"{values[tuple(index)]:.4g}"
        for index in np.argwhere(np.isfinite(values))
    }


def _stability_shares(stability: Any, scores: xr.DataArray) -> np.ndarray | None:
    """((span,) sender, receiver) shares of resamples of a ``lsc.circuit_stability`` result, read
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
    edge_dims = set(stability.dims) in ({"span", *EDGE_DIMS}, set(EDGE_DIMS))
    if mask_rules.is_mask(stability) or not edge_dims:
        raise ValueError(
            f"stability must be the (sender, receiver) shares of resamples from {made_by}, "
            f"got {'a circuit' if mask_rules.is_mask(stability) else stability.dims}."
        )
    _check_positions("stability", "span" in stability.dims, scores, made_by)
    own = {key: scores.attrs[key] for key in ORIGIN_ATTRS if key in scores.attrs}
    _validate.origin("stability", stability, own, made_by=made_by)
    shares = _validate.labels("stability", stability, _labels_of(scores), made_by=made_by).values
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


def _exact_effects(exact: Any, scores: xr.DataArray) -> dict[tuple[str, ...], str] | None:
    """Edge labels ((span,) sender, receiver) -> the exact effect of the edge, formatted,
    from a report of ``lsc.edge_agreement`` (mean over its prompts); None without a report.

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
    _check_positions("exact", "span" in exact.coords, scores, made_by)
    effect = exact["exact"]
    effect = effect.mean("prompt") if "prompt" in effect.dims else effect
    parts = [effect[name].values for name in ("span", *EDGE_DIMS) if name in effect.coords]
    return {
        tuple(str(part[k]) for part in parts): f"{float(value):.4g}"
        for k, value in enumerate(effect.values)
        if np.isfinite(value)
    }


def _edge_rows(
    scores: xr.DataArray,
    chosen: np.ndarray,
    layout: Layout,
    measured: dict[tuple[str, ...], str] | None,
    shares: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """One row per drawn edge: its ends' nodes and positions, labels, kind, score, exact
    effect (when ``measured`` is given) and share of resamples (when ``shares`` is),
    weakest first so strong lines lie on top. By span, also its span, its query span and
    whether it crosses spans (a key or value read by queries at another span)."""
    values = scores.values.astype(float)
    query_spans = scores["query_span"].values if layout.spans else None
    rows = []
    for index in chosen:
        *span, s, r = (int(i) for i in index)
        at = str(scores["span"].values[span[0]]) if span else None
        query = str(query_spans[r]) if query_spans is not None and query_spans[r] else at
        sender, receiver = (
            layout.node(
                str(scores[f"{end}_kind"].values[i]),
                int(scores[f"{end}_layer"].values[i]),
                int(scores[f"{end}_head"].values[i]),
                span=where,
            )
            for end, i, where in (("sender", s, at), ("receiver", r, query))
        )
        label = _edge_label(scores, index)
        value = float(values[tuple(index)])
        row = {
            **{"x": sender.x, "y": sender.y, "x2": receiver.x, "y2": receiver.y},
            **{"from": sender.name, "to": receiver.name, "edge": _edge_name(label)},
            **{"sender": label[-2], "receiver": label[-1]},
            "kind": str(scores["receiver_kind"].values[r]),
            "score": value,
            "magnitude": abs(value),
        }
        if span:
            row.update(span=at, query_span=query, crossing=query != at)
        if measured is not None:
            row["exact"] = measured.get(label, NOT_MEASURED)
        if shares is not None:
            row["stability"] = float(np.nan_to_num(shares[tuple(index)]))
        rows.append(row)
    return sorted(rows, key=lambda row: row["magnitude"])


def _line_encodings(
    rows: list[dict[str, Any]], layout: Layout, *, ramp: _Ramp, legend: str | list[str]
) -> dict[str, Any]:
    """The encodings every edge takes: colour and width by score on one ``ramp``
    (symmetric-log or linear, up to its limit), the line style by receiver kind (every kind
    in the legend, so styles never change between views), the tooltip, and the opacity by
    share of resamples where rows have one."""
    dash_names = " : ".join(
        f"datum.label == {json.dumps(k)} ? {json.dumps(v)}" for k, v in RECEIVER_NAMES.items()
    )
    tips = [
        alt.Tooltip("edge:N"),
        alt.Tooltip("kind:N", title="receiver kind"),
        alt.Tooltip("score:Q", format=".4g"),
    ]
    if layout.spans:
        tips += [
            alt.Tooltip("span:N", title="span (sender writes, key/value read)"),
            alt.Tooltip("query_span:N", title="query span (receiver acts)"),
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
    return {
        **layout.axes(),
        "color": alt.Color(
            "score:Q",
            title=legend,
            scale=ramp.scale(scheme="blueorange", domain=[-limit, limit], domainMid=0),
            legend=alt.Legend(gradientLength=140, format=".3~r", **_values(ticks)),
        ),
        "strokeWidth": alt.StrokeWidth("magnitude:Q", title="|score|", scale=ramp.width()),
        "strokeDash": alt.StrokeDash(
            "kind:N",
            title="line: receiver kind",
            scale=alt.Scale(domain=list(RECEIVER_KINDS), range=[DASHES[k] for k in RECEIVER_KINDS]),
            legend=alt.Legend(
                symbolType="stroke",
                symbolSize=900,
                symbolStrokeWidth=2,
                labelExpr=f"{dash_names} : datum.label",
                labelLimit=260,
            ),
        ),
        "tooltip": tips,
        **stable,
    }


def _lines(
    rows: list[dict[str, Any]], layout: Layout, *, ramp: _Ramp, legend: str | list[str]
) -> alt.Chart:
    """The straight edges (every edge of a position-agnostic graph; by span those inside
    one span): a rule from sender to receiver (``_line_encodings``)."""
    encodings = _line_encodings(rows, layout, ramp=ramp, legend=legend)
    return alt.Chart(alt.Data(values=rows)).mark_rule().encode(x2="x2:Q", y2="y2:Q", **encodings)


def _curves(
    rows: list[dict[str, Any]], layout: Layout, *, ramp: _Ramp, legend: str | list[str]
) -> alt.Chart:
    """The crossing edges of a graph by span: each a curve from its sender's span to the
    key/value head in its query span's columns, bowed above the straight line (``BOW``
    rows) so that it never hides an edge inside a span, with the encodings of ``_lines``."""
    points = [
        {**row, "x": x, "y": y, "order": step, "id": k}
        for k, row in enumerate(rows)
        for step, (x, y) in enumerate(
            (
                (row["x"], row["y"]),
                ((row["x"] + row["x2"]) / 2, (row["y"] + row["y2"]) / 2 - BOW),
                (row["x2"], row["y2"]),
            )
        )
    ]
    encodings = _line_encodings(rows, layout, ramp=ramp, legend=legend)
    return (
        alt.Chart(alt.Data(values=points))
        .mark_line(interpolate="basis")
        .encode(order="order:Q", detail="id:N", **encodings)
    )


def _values(ticks: list[float] | None) -> dict[str, Any]:
    """A legend's ``values`` option where ``ticks`` are given."""
    return {} if ticks is None else {"values": ticks}


def _points(layout: Layout, used: set[str]) -> alt.Chart:
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
    spans: np.ndarray | None = None,
) -> str:
    """What the graph shows: the budget (a circuit's size and how it was picked, or the top
    edges), the receiver kinds, the estimator, by span the spans (``spans``: those whose
    edges are drawn, when picked) and the resamples of ``stability``."""
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
    by_span = ""
    if "span" in scores.dims:
        names = [str(span) for span in scores["span"].values]
        drawn_at = names if spans is None else [n for n, on in zip(names, spans, strict=True) if on]
        by_span = f"by span ({', '.join(names)})"
        if drawn_at != names:
            by_span = f"edges at span {', '.join(drawn_at)} of {', '.join(names)}"
    parts = (shown, receivers, by_span, estimator, resampled)
    return " · ".join(part for part in parts if part)


def _graph_notes(
    scores: xr.DataArray, kinds: Sequence[str], layout: Layout, measured: str, tie_note: str
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
    if layout.spans:
        notes.append(
            "columns: one group per span, in prompt order; an edge runs inside its span's "
            "columns, except a crossing edge (curved): a key or value at one span read by "
            "queries at another, drawn to the key/value head in the query span's columns"
            + (f" ({OTHER}: tokens in no named span, anywhere)" if OTHER in layout.spans else "")
        )
    notes.append(
        "hover a line for the edge and its score"
        + (f", and its exact effect where {measured} measured it" if measured else "")
    )
    return notes + ([tie_note] if tie_note else [])


def _chosen_edges(
    scores: xr.DataArray,
    circuit: Any,
    *,
    kinds: Sequence[str],
    edges: int,
    spans: np.ndarray | None = None,
) -> tuple[np.ndarray, str]:
    """The edges ``circuit_graph`` draws: the circuit's kept edges of ``kinds`` (and, by
    span, at the ``spans`` marked), or without a circuit the ``edges`` of largest |score|
    (ties broken in graph order).

    Args:
        scores: edge scores read by label (``check_edges``).
        circuit: the ``circuit`` argument, or None.
        spans: by span, (n_spans,) bool: the sender spans drawn (``_sender_spans``).

    Returns:
        (edges, n_dims) positions in ``scores`` (span, sender, receiver; or sender,
        receiver), in graph order; a subtitle naming the edges left out at a tie of |score|
        ("" when none).

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
    if spans is not None:
        of_kinds = of_kinds & spans[:, None, None]
        if not spans.all():
            which += f" at the spans {list(scores['span'].values[spans])}"
    if circuit is not None:
        kept = _kept_edges(scores, circuit)
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


def _kept_edges(scores: xr.DataArray, circuit: Any) -> xr.DataArray:
    """The edges ``circuit`` keeps (``mask_rules.kept``), read by the labels of ``scores``.

    Raises:
        ValueError: not a circuit, of the other positions (by span or not), of another
            model or other edges, or keeping an edge whose score is NaN.
    """
    made_by = "lsc.circuit(scores, ...)"
    mask = check_edges(circuit, "circuit", circuit=True)
    _check_positions("circuit", "span" in mask.dims, scores, made_by)
    own = {key: scores.attrs[key] for key in ORIGIN_ATTRS if key in scores.attrs}
    _validate.origin("circuit", mask, own, made_by=made_by)
    kept = mask_rules.kept(_validate.labels("circuit", mask, _labels_of(scores), made_by=made_by))
    unscored = np.argwhere(kept.values & np.isnan(scores.values.astype(float)))
    if len(unscored):
        raise ValueError(
            f"circuit keeps {len(unscored)} edge(s) that have no score in scores (NaN), "
            f"e.g. {_edge_name(_edge_label(scores, unscored[0]))}; pass "
            "the scores the circuit was picked from."
        )
    return kept


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
        scores: (sender, receiver) from ``lsc.edge_attribution`` or ``lsc.circuit``; of a
            result by span, one span's grid (``scores.sel(span="END")``).
        scale: "auto", "symlog" or "linear": the colour scale of scores (a circuit's two
            states take neither).
        options: passed to ``heatmap``.

    Returns:
        The ``heatmap`` chart.

    Raises:
        TypeError: ``scores`` is not a DataArray.
        ValueError: not an edge result (see ``check_edges``), a whole result by span (one
            grid per span: the message says how to pick one), an unknown scale, or a bad
            option.
    """
    edges = check_edges(scores, "scores", circuit=None, by_span=False)
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
    result: xr.Dataset | Mapping[str, xr.Dataset],
    *,
    title: str | None = None,
    actions: bool = False,
) -> ChartType:
    """Faithfulness against the edge budget (log scale), the circuit beside the mean of
    the random circuits, with a rule at 1 (the full model); given several results by name,
    their curves against the edges each circuit keeps (``_compared_curves``).

    Args:
        result: a Dataset from ``lsc.circuit_faithfulness``, read by label (budgets in
            increasing order whatever the array's); or a mapping of names to such results
            of one model (e.g. ``{"by span": a, "position-agnostic": b}``).
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
            clean ones); for several, an empty mapping or results of different models.
    """
    if not isinstance(result, xr.Dataset) and isinstance(result, Mapping):  # a Dataset is one
        return _compared_curves(
            cast(Mapping[str, xr.Dataset], result), title=title, actions=actions
        )
    result = _checked_curve("result", result)
    _validate.text("title", title, example="'IOI circuit'", optional=True)
    actions = _validate.flag("actions", actions)
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


def _checked_curve(name: str, result: Any) -> xr.Dataset:
    """A ``lsc.circuit_faithfulness`` result passed in, checked and read by label."""
    _validate.result(
        name,
        result,
        kind=xr.Dataset,
        made_by="lsc.circuit_faithfulness(model, prompts, scores)",
        variables=("faithfulness", "cpr", "cmd", "random_cpr", "random_cmd"),
        methods=("circuit_faithfulness",),
    )
    return in_label_order(result, name=name)


def _compared_curves(
    results: Mapping[str, xr.Dataset], *, title: str | None = None, actions: bool = False
) -> ChartType:
    """Faithfulness of several circuits' curves (``lsc.circuit_faithfulness`` results of
    one model, by name) against the edges each circuit keeps, on a log scale: budgets are
    shares of each graph, and graphs differ in size (by span about ten times the edges), so
    only kept edges compare. The legend says where each curve first reaches
    ``FAITHFUL`` faithfulness; a rule marks 1 (the full model).

    Raises:
        TypeError: not a mapping of names to Datasets. ValueError: an empty mapping, a
            result of another method or of another model than the first, or a curve NaN
            at every budget.
    """
    if not results or not all(isinstance(name, str) for name in results):
        raise ValueError(
            "results must map names to lsc.circuit_faithfulness results, e.g. "
            "{'by span': curve_a, 'position-agnostic': curve_b}; got "
            f"{'an empty mapping' if not results else list(results)}."
        )
    _validate.text("title", title, example="'IOI circuits'", optional=True)
    actions = _validate.flag("actions", actions)
    checked = {name: _checked_curve(f"results[{name!r}]", ds) for name, ds in results.items()}
    rows, names = _compared_rows(checked)
    lines = (
        alt.Chart(alt.Data(values=rows))
        .mark_line(point=True)
        .encode(
            x=alt.X("edges:Q", title="edges kept (log scale)", scale=alt.Scale(type="log")),
            y=alt.Y("faithfulness:Q", title="faithfulness (0 corrupt, 1 full model)"),
            color=alt.Color(
                "circuit:N",
                title="circuit",
                sort=names,
                legend=alt.Legend(labelLimit=400),
            ),
            tooltip=["circuit:N", "edges:Q", alt.Tooltip("faithfulness:Q", format=".3f")],
        )
    )
    one = alt.Chart(alt.Data(values=[{"y": 1.0}])).mark_rule(strokeDash=[4, 4]).encode(y="y:Q")
    notes = [
        "x: the edges each circuit keeps after pruning to paths (budgets are shares of each "
        "graph, and graphs differ in size); circuits with no edge or NaN faithfulness are not "
        "drawn"
    ]
    return alt.layer(lines, one).properties(
        title=alt.TitleParams(
            title or "Circuit faithfulness by edge count: " + ", ".join(checked),
            subtitle=[part for note in notes for part in _wrap(note)],
            anchor="start",
            limit=TITLE_LIMIT,
        ),
        width=480,
        height=280,
        usermeta={"embedOptions": {"actions": actions}},
    )


def _compared_rows(checked: dict[str, xr.Dataset]) -> tuple[list[dict[str, Any]], list[str]]:
    """The points of ``_compared_curves`` (circuit, edges kept, faithfulness; empty circuits
    and NaN left out) and each curve's legend name, saying where it first reaches
    ``FAITHFUL``.

    Raises:
        ValueError: a result of another model than the first, or with no point to draw.
    """
    first = next(iter(checked.values()))
    own = {key: first.attrs[key] for key in ORIGIN_ATTRS if key in first.attrs}
    rows, names = [], {}
    for name, ds in checked.items():
        _validate.origin(f"results[{name!r}]", ds, own, made_by="lsc.circuit_faithfulness")
        kept, values = ds["n_edges"].values, ds["faithfulness"].values.astype(float)
        drawn = np.isfinite(values) & (kept > 0)
        if not drawn.any():
            raise ValueError(
                f"results[{name!r}] has no finite faithfulness at a non-empty circuit, so "
                "there is no curve to draw; run lsc.circuit_faithfulness again with larger "
                "budgets."
            )
        reached = kept[drawn & (values >= FAITHFUL)]
        names[name] = (
            f"{name}: f ≥ {FAITHFUL} first at {int(reached[0]):,} edges"
            if len(reached)
            else f"{name}: f < {FAITHFUL} at every budget"
        )
        rows += [
            {"circuit": names[name], "edges": int(n), "faithfulness": float(f)}
            for n, f in zip(kept[drawn], values[drawn], strict=True)
        ]
    return rows, list(names.values())


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
