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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import altair as alt
import numpy as np
import xarray as xr
from altair.typing import ChartType

from .. import _validate, mask_rules
from ..schema import RECEIVER_KINDS
from .heatmaps import heatmap, label_from_attrs

#: Most edges the graph draws (a dense graph of thousands of lines reads as noise).
MAX_EDGES = 2000
_DASHES = {"q": [1, 0], "k": [6, 3], "v": [2, 2], "mlp": [1, 0], "logits": [1, 0]}
#: Coords an edge result carries on its sender and receiver dims (the graph's layout).
EDGE_COORDS = tuple(
    f"{end}_{part}" for end in ("sender", "receiver") for part in ("kind", "layer", "head")
)


def check_edges(da: Any, name: str) -> xr.DataArray:
    """Check an edge result passed in (scores or a circuit) and put it in (sender, receiver)
    order.

    Args:
        da: the value passed.
        name: the argument's name, for the message.

    Raises:
        TypeError: not a DataArray.
        ValueError: other dims than (sender, receiver), or the layout coords missing.
    """
    made_by = "lsc.edge_attribution or lsc.circuit"
    if not isinstance(da, xr.DataArray):
        raise TypeError(
            f"{name} must be a (sender, receiver) xarray.DataArray from {made_by}, "
            f"got {type(da).__name__}."
        )
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
    return da.transpose("sender", "receiver")


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
        scores: (sender, receiver) edge scores (colour and width of each line).
        circuit: boolean (sender, receiver) from ``lsc.circuit``: draw its kept edges
            (``lenscape.mask_rules.kept``: non-zero and computed, never NaN); None: draw the
            ``edges`` edges with the largest |score|.
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
        ValueError: inputs that are not edge results, an unknown kind, too many edges.
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
    wanted = np.isin(scores["receiver_kind"].values, list(kinds))[None, :] & np.isfinite(values)
    if circuit is not None:
        mask = check_edges(circuit, "circuit")
        if mask.shape != scores.shape:
            raise ValueError(
                f"circuit has {mask.shape} edges and scores {scores.shape}; pick the circuit "
                "from these scores: lsc.circuit(scores, fraction=0.05)."
            )
        chosen = np.argwhere(mask_rules.kept(mask).values & wanted)
    else:
        magnitude = np.where(wanted, np.abs(values), -np.inf).ravel()
        top = np.argsort(-magnitude, kind="stable")[: min(edges, int(wanted.sum()))]
        chosen = np.argwhere(np.isin(np.arange(values.size), top).reshape(values.shape))
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
    shown = "circuit" if circuit is not None else f"top {len(rows)} edges"
    return alt.layer(lines, points).properties(
        title=title or f"{shown}: {name}", width=width, height=height
    )


def edge_heatmap(scores: xr.DataArray, **options: Any) -> ChartType:
    """The sender x receiver grid of edge scores (``lsc.heatmap`` with receivers across,
    senders down; NaN cells, where no edge exists, are grey). ``options`` go to
    ``heatmap``."""
    return heatmap(check_edges(scores, "scores"), x="receiver", y="sender", **options)


def faithfulness_curve(result: xr.Dataset, *, title: str | None = None) -> ChartType:
    """Faithfulness against the edge budget (log scale), the circuit beside the mean of
    the random circuits, with a rule at 1 (the full model).

    Args:
        result: a Dataset from ``lsc.circuit_faithfulness``.
        title: chart title; default names CPR and CMD.

    Raises:
        TypeError: ``result`` is not a Dataset or ``title`` not a string.
        ValueError: ``result`` lacks a variable of ``lsc.circuit_faithfulness``.
    """
    _validate.result(
        "result",
        result,
        kind=xr.Dataset,
        made_by="lsc.circuit_faithfulness(model, prompts, scores)",
        variables=("faithfulness", "cpr", "cmd", "random_cpr", "random_cmd"),
    )
    _validate.text("title", title, example="'IOI circuit'", optional=True)
    budgets = result["budget"].values
    rows = [
        {"budget": float(b), "edges": int(n), "faithfulness": float(f), "circuit": "top edges"}
        for b, n, f in zip(
            budgets, result["n_edges"].values, result["faithfulness"].values, strict=True
        )
    ]
    if result.sizes.get("seed", 0):
        mean = result["random_faithfulness"].mean("seed").values
        rows += [
            {"budget": float(b), "edges": int(n), "faithfulness": float(f), "circuit": "random"}
            for b, n, f in zip(budgets, result["n_edges"].values, mean, strict=True)
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
    one = alt.Chart(alt.Data(values=[{"y": 1.0}])).mark_rule(strokeDash=[4, 4]).encode(y="y:Q")
    summary = (
        f"CPR {float(result['cpr']):.3f} (random {float(result['random_cpr']):.3f}), "
        f"CMD {float(result['cmd']):.3f} (random {float(result['random_cmd']):.3f})"
    )
    return alt.layer(lines, one).properties(
        title=title or f"Circuit faithfulness: {summary}", width=420, height=260
    )
