"""Pictures of circuits: the edge graph, the sender x receiver grid, the faithfulness curve.

Inputs are the results of ``lsc.edge_attribution`` (a (sender, receiver) DataArray with
``sender_kind/layer/head`` and ``receiver_kind/layer/head`` coords), ``lsc.circuit`` (the
same coords, boolean) and ``lsc.circuit_faithfulness`` (a Dataset over ``budget``). Only
coords are read, so this module never imports torch. Every chart exports with
``lsc.export``.

The graph puts layers bottom to top (the embeddings below layer 0, the logits above the
last layer), a layer's heads side by side with its MLP at the right. An edge is a line from
its sender to the component its receiver feeds (a key/value receiver feeds its whole query
group: the line ends at the group's middle); colour and width encode the score, the dash
the receiver kind (q, k, v, mlp, logits), and the tooltip names sender, receiver and score.

Every input is read by label (``encoding.in_label_order``; a circuit by the labels of its
scores), so a ``sortby``, ``isel`` or ``transpose`` draws the same picture, and its kind
is checked: scores where a circuit is expected, or the reverse, are refused by name. What
cannot be drawn is said: a NaN curve or scores with nothing finite raise a ``ValueError``
with the cause, edges left out at a tie are named in the subtitle, and no spec holds NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import altair as alt
import numpy as np
import xarray as xr
from altair.typing import ChartType

from .. import _validate, mask_rules
from ..schema import RECEIVER_KINDS
from .encoding import in_label_order, jsonable
from .heatmaps import heatmap, label_from_attrs

#: Most edges the graph draws (a dense graph of thousands of lines reads as noise).
MAX_EDGES = 2000
_DASHES = {"q": [1, 0], "k": [6, 3], "v": [2, 2], "mlp": [1, 0], "logits": [1, 0]}
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


def _sizes(scores: xr.DataArray) -> tuple[int, int, int]:
    """(n_layers, n_heads, n_kv_heads) from the coords."""
    kinds = scores["sender_kind"].values
    n_layers = int((kinds == "mlp").sum())
    n_heads = int((kinds == "head").sum()) // max(n_layers, 1)
    n_kv = int((scores["receiver_kind"].values == "k").sum()) // max(n_layers, 1)
    return n_layers, n_heads, max(n_kv, 1)


def _sender_xy(
    kind: str, layer: int, head: int, sizes: tuple[int, int, int]
) -> tuple[float, float]:
    n_heads = sizes[1]
    if kind == "embed":
        return n_heads / 2, -1.0
    return (float(head) if kind == "head" else float(n_heads)), float(layer)


def _receiver_xy(
    kind: str, layer: int, head: int, sizes: tuple[int, int, int]
) -> tuple[float, float]:
    n_layers, n_heads, n_kv = sizes
    if kind == "logits":
        return n_heads / 2, float(n_layers)
    if kind == "mlp":
        return float(n_heads), float(layer)
    if kind == "q":
        return float(head), float(layer)
    group = n_heads // n_kv
    return head * group + (group - 1) / 2, float(layer)


def circuit_graph(
    scores: xr.DataArray,
    circuit: xr.DataArray | None = None,
    *,
    edges: int = 50,
    kinds: Sequence[str] = RECEIVER_KINDS,
    title: str | None = None,
    width: int = 520,
    height: int = 520,
) -> ChartType:
    """Draw edges as lines between components, layers bottom to top.

    Args:
        scores: (sender, receiver) edge scores (colour and width of each line), read by
            label.
        circuit: boolean (sender, receiver) from ``lsc.circuit``, read by the labels of
            ``scores``: draw its kept edges (``lenscape.mask_rules.kept``: non-zero and
            computed, never NaN); None: draw the ``edges`` edges with the largest |score|
            (ties broken in graph order, and the subtitle names the edges left out at a
            tie).
        edges: how many top edges to draw without a circuit (at most ``MAX_EDGES``).
        kinds: receiver kinds to draw (a subset of q, k, v, mlp, logits).
        title: chart title; default from the scores' attrs.
        width, height: chart size in pixels.

    Returns:
        A layered Altair chart: nodes (every head, MLP, the embeddings and the logits) and
        edges with tooltips (sender, receiver, receiver kind, score).

    Raises:
        TypeError: an argument of the wrong type (scores not a DataArray, edges not an
            integer, kinds not a list of strings ...).
        ValueError: inputs that are not edge results or of the wrong kind (a circuit as
            scores, scores as the circuit), a circuit of other edges or of another model,
            infinite scores, a kept edge without a score, nothing to draw, an unknown kind,
            too many edges.
    """
    scores = check_edges(scores, "scores")
    kinds = _validate.strings("kinds", kinds, example="('q', 'k')")
    bad = sorted(set(kinds) - set(RECEIVER_KINDS))
    if bad:
        raise ValueError(
            f"kinds holds unknown receiver kind(s) {bad}; choose from {list(RECEIVER_KINDS)}."
        )
    _validate.text("title", title, example="'IOI circuit'", optional=True)
    width = _validate.positive_int("width", width)
    height = _validate.positive_int("height", height)
    edges = _validate.integer("edges", edges, low=1, high=MAX_EDGES)
    values = scores.values.astype(float)
    chosen, tie_note = _chosen_edges(scores, circuit, kinds=kinds, edges=edges)
    if len(chosen) > MAX_EDGES:
        raise ValueError(
            f"The circuit has {len(chosen)} edges to draw, more than {MAX_EDGES}; choose a "
            "smaller budget or fewer receiver kinds."
        )
    sizes = _sizes(scores)
    senders: list[tuple[str, int, int]] = list(
        zip(
            scores["sender_kind"].values,
            scores["sender_layer"].values,
            scores["sender_head"].values,
            strict=True,
        )
    )
    receivers: list[tuple[str, int, int]] = list(
        zip(
            scores["receiver_kind"].values,
            scores["receiver_layer"].values,
            scores["receiver_head"].values,
            strict=True,
        )
    )
    rows: list[dict[str, Any]] = []
    for s, r in chosen:
        x, y = _sender_xy(*senders[int(s)], sizes)
        x2, y2 = _receiver_xy(*receivers[int(r)], sizes)
        rows.append(
            {
                "x": x,
                "y": y,
                "x2": x2,
                "y2": y2,
                "sender": str(scores["sender"].values[s]),
                "receiver": str(scores["receiver"].values[r]),
                "kind": str(receivers[r][0]),
                "score": float(values[s, r]),
                "magnitude": abs(float(values[s, r])),
            }
        )
    nodes = [
        {"x": x, "y": y, "node": str(label)}
        for label, sender in zip(scores["sender"].values, senders, strict=True)
        for x, y in [_sender_xy(*sender, sizes)]
    ] + [{"x": sizes[1] / 2, "y": float(sizes[0]), "node": "logits"}]
    limit = max((row["magnitude"] for row in rows), default=1.0) or 1.0
    name = label_from_attrs(scores, "score")
    x_axis = alt.X("x:Q", axis=None, scale=alt.Scale(domain=[-0.5, sizes[1] + 0.5]))
    y_axis = alt.Y(
        "y:Q",
        title="layer (embeddings below, logits above)",
        scale=alt.Scale(domain=[-1.5, sizes[0] + 0.5]),
        axis=alt.Axis(values=list(range(sizes[0])), format="d"),
    )
    lines = (
        alt.Chart(alt.Data(values=rows))
        .mark_rule()
        .encode(
            x=x_axis,
            y=y_axis,
            x2="x2:Q",
            y2="y2:Q",
            color=alt.Color(
                "score:Q",
                title=name,
                scale=alt.Scale(scheme="blueorange", domain=[-limit, limit], domainMid=0),
            ),
            strokeWidth=alt.StrokeWidth(
                "magnitude:Q", title="|score|", scale=alt.Scale(domain=[0, limit], range=[0.5, 6])
            ),
            strokeDash=alt.StrokeDash(
                "kind:N",
                title="receiver",
                scale=alt.Scale(
                    domain=list(RECEIVER_KINDS), range=[_DASHES[k] for k in RECEIVER_KINDS]
                ),
            ),
            tooltip=[
                alt.Tooltip("sender:N"),
                alt.Tooltip("receiver:N"),
                alt.Tooltip("kind:N", title="receiver kind"),
                alt.Tooltip("score:Q", format=".4g"),
            ],
        )
    )
    points = (
        alt.Chart(alt.Data(values=nodes))
        .mark_circle(size=60, color="#555555")
        .encode(x=x_axis, y=y_axis, tooltip=[alt.Tooltip("node:N")])
    )
    shown = f"circuit ({len(rows)} edges)" if circuit is not None else f"top {len(rows)} edges"
    return alt.layer(lines, points).properties(
        title=alt.TitleParams(title or f"{shown}: {name}", subtitle=tie_note or alt.Undefined),
        width=width,
        height=height,
    )


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
        kept = mask_rules.kept(cast(xr.DataArray, read))
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
        return chosen, ""
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


def edge_heatmap(scores: xr.DataArray, **options: Any) -> ChartType:
    """The sender x receiver grid of edge scores, or of a circuit (kept and skipped edges),
    with receivers across and senders down, each in the graph's order whatever the array's
    (NaN cells, where no edge exists, are grey).

    Args:
        scores: (sender, receiver) from ``lsc.edge_attribution`` or ``lsc.circuit``.
        options: passed to ``heatmap``.

    Returns:
        The ``heatmap`` chart.

    Raises:
        TypeError: ``scores`` is not a DataArray.
        ValueError: not an edge result (see ``check_edges``), or a bad option.
    """
    edges = check_edges(scores, "scores", circuit=None)
    return heatmap(edges, x="receiver", y="sender", **options)


def faithfulness_curve(result: xr.Dataset, *, title: str | None = None) -> ChartType:
    """Faithfulness against the edge budget (log scale), the circuit beside the mean of
    the random circuits, with a rule at 1 (the full model).

    Args:
        result: a Dataset from ``lsc.circuit_faithfulness``, read by label (budgets in
            increasing order whatever the array's).
        title: chart title; default names CPR and CMD ("undefined" where NaN).

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
    budgets, n_edges = result["budget"].values, result["n_edges"].values
    rows = [
        {"budget": float(b), "edges": int(n), "faithfulness": f, "circuit": name}
        for name, curve in curves.items()
        for b, n, f in zip(budgets, n_edges, jsonable(np.asarray(curve, float)), strict=True)
        if f is not None
    ]
    missing = sum(int((~np.isfinite(curve)).sum()) for curve in curves.values())
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
    one = alt.Chart(alt.Data(values=[{"y": 1.0}])).mark_rule(strokeDash=[4, 4]).encode(y="y:Q")
    summary = ", ".join(
        f"{name.upper()} {_number(result[name])} (random {_number(result[f'random_{name}'])})"
        for name in ("cpr", "cmd")
    )
    note = f"{missing} points not computed (NaN), not drawn" if missing else alt.Undefined
    return alt.layer(lines, one).properties(
        title=alt.TitleParams(title or f"Circuit faithfulness: {summary}", subtitle=note),
        width=420,
        height=260,
    )


def _number(value: xr.DataArray) -> str:
    """A scalar statistic for a title: 3 decimals, or "undefined" where it is NaN."""
    number = float(value)
    return f"{number:.3f}" if np.isfinite(number) else "undefined"
