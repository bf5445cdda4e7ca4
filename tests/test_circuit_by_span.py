"""The circuit graph by span (views/circuit.py, views/circuit_layout.py): span columns in
prompt order, edges inside their span, crossing edges curved to the query span's columns,
read by label, and a by-span input beside a position-agnostic one refused both ways."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape.capture import edges
from lenscape.capture.edges.graph import Graph, SpanGraph
from lenscape.views.circuit import MAX_EDGES, NOT_MEASURED, circuit_graph, edge_heatmap
from lenscape.views.circuit_explorer import CircuitExplorer
from lenscape.views.circuit_layout import Layout

SPANS = ("S1", "S2", "END", "other")


def _by_span(seed: int = 0) -> xr.DataArray:
    graph = SpanGraph(Graph(2, 4, 2), SPANS)
    values = np.random.default_rng(seed).normal(size=graph.shape)
    values[~graph.valid] = np.nan
    return xr.DataArray(
        values,
        dims=graph.dims,
        coords=graph.coords(),
        attrs={"long_name": "EAP", "span_order": json.dumps(list(SPANS))},
    )


def _layers(spec: dict) -> list[dict]:
    return [
        leaf
        for layer in spec["layer"]
        for leaf in (_layers(layer) if "layer" in layer else [layer])
    ]


def _rows(spec: dict) -> tuple[list[dict], list[dict]]:
    """(straight edges, points of the crossing edges' curves)."""
    leaves = _layers(spec)
    straight = next(
        leaf for leaf in leaves if leaf["mark"]["type"] == "rule" and "x2" in leaf["encoding"]
    )
    curves = [leaf for leaf in leaves if leaf["mark"]["type"] == "line"]
    return straight["data"]["values"], (curves[0]["data"]["values"] if curves else [])


def _span_of_x(layout: Layout, x: float) -> str:
    """The span whose columns hold ``x``."""
    return next(
        span
        for span in SPANS
        if layout.offset(span) - 0.01 <= x <= layout.offset(span) + layout.mlp_x + 0.01
    )


def test_spans_are_columns_in_prompt_order_with_their_names_above():
    scores = _by_span()
    layout = Layout.of(scores)
    assert layout.spans == SPANS and (layout.n_heads, layout.n_kv) == (4, 2)
    spec = circuit_graph(scores).to_dict()
    points = next(leaf for leaf in _layers(spec) if leaf["mark"]["type"] == "point")["data"][
        "values"
    ]
    per_span = 2 + 2 * (4 + 2 + 1)
    assert len(points) == per_span * len(SPANS)
    for span in SPANS:
        mine = [p for p in points if p["node"].endswith(f"@{span}")]
        assert len(mine) == per_span and {_span_of_x(layout, p["x"]) for p in mine} == {span}
    names = [
        row
        for leaf in _layers(spec)
        if leaf["mark"]["type"] == "text"
        for row in leaf["data"]["values"]
        if row["at"] == "span"
    ]
    by_x = [row["name"] for row in sorted(names, key=lambda row: row["x"])]
    assert list(dict.fromkeys(by_x)) == list(SPANS)  # left to right in prompt order
    assert spec["width"] > 560 and "by span (S1, S2, END, other)" in json.dumps(spec["title"])
    labels = spec["layer"][1]["encoding"]["x"]["axis"]["labelExpr"]
    assert labels.count('"MLP"') == len(SPANS)


def test_edges_stay_in_their_span_and_crossing_edges_curve_to_the_query_span():
    scores = _by_span()
    layout = Layout.of(scores)
    straight, curves = _rows(circuit_graph(scores, edges=MAX_EDGES).to_dict())
    assert straight and curves
    for row in straight:
        assert not row["crossing"] and row["query_span"] == row["span"]
        assert _span_of_x(layout, row["x"]) == _span_of_x(layout, row["x2"]) == row["span"]
    ids = {point["id"] for point in curves}
    for k in ids:
        path = sorted((p for p in curves if p["id"] == k), key=lambda p: p["order"])
        first, last = path[0], path[-1]
        assert len(path) == 3 and first["crossing"] and first["kind"] in ("k", "v")
        assert _span_of_x(layout, first["x"]) == first["span"] != first["query_span"]
        assert _span_of_x(layout, last["x"]) == first["query_span"]
        assert first["receiver"].endswith(f"@{first['query_span']}")
    finite = np.isfinite(scores.values)
    assert len(straight) + len(ids) == min(int(finite.sum()), MAX_EDGES)
    # crossing edges are exactly the k and v edges whose query span is another span
    other = scores["query_span"].values[None, None, :] != scores["span"].values[:, None, None]
    crossing = finite & other & (scores["query_span"].values != "")[None, None, :]
    assert len(ids) == int(crossing.sum())


def test_the_graph_by_span_reads_by_label():
    scores = _by_span()
    picture = json.dumps(circuit_graph(scores, edges=40).to_dict(), sort_keys=True)
    for moved in (
        scores.sortby("span"),
        scores.transpose("receiver", "span", "sender"),
        scores.isel(span=[3, 1, 0, 2], sender=slice(None, None, -1)),
    ):
        assert json.dumps(circuit_graph(moved, edges=40).to_dict(), sort_keys=True) == picture


def test_spans_picks_the_edges_drawn_and_bad_spans_are_refused():
    scores = _by_span()
    straight, curves = _rows(circuit_graph(scores, edges=MAX_EDGES, spans=["S2"]).to_dict())
    assert {row["span"] for row in straight + curves} == {"S2"}
    assert {p["query_span"] for p in curves} <= {"END", "other"}
    expected = int(np.isfinite(scores.sel(span="S2").values).sum())
    assert len(straight) + len({p["id"] for p in curves}) == expected
    title = json.dumps(circuit_graph(scores, spans=["S2"]).to_dict()["title"])
    assert "edges at span S2 of S1, S2, END, other" in title
    with pytest.raises(ValueError, match=r"spans holds span\(s\) \['IO'\] the scores lack"):
        circuit_graph(scores, spans=["IO"])
    with pytest.raises(ValueError, match="one span of a result by span"):
        circuit_graph(scores.sel(span="END"))


def test_by_span_beside_position_agnostic_is_refused_both_ways():
    scores = _by_span()
    circuit = lsc.circuit(scores, edges=300)
    base = Graph(2, 4, 2)
    flat_values = np.random.default_rng(3).normal(size=base.valid.shape)
    flat_values[~base.valid] = np.nan
    flat = xr.DataArray(flat_values, dims=base.dims, coords=base.coords())
    flat_circuit = lsc.circuit(flat, edges=60)
    with pytest.raises(ValueError, match=r"circuit is position-agnostic but scores are by span"):
        circuit_graph(scores, flat_circuit)
    with pytest.raises(
        ValueError,
        match=r"circuit is by span \(positions='spans'\) but scores are position-agnostic",
    ):
        circuit_graph(flat, circuit)
    with pytest.raises(
        ValueError, match=r"is by span .* draw one span's: scores.sel\(span='END'\)"
    ):
        edge_heatmap(scores)
    grid = edge_heatmap(scores.sel(span="END")).to_dict()
    assert grid["mark"]["type"] == "rect" or "layer" in grid
    with pytest.raises(ValueError, match=r"spans= picks the spans of scores by span"):
        circuit_graph(flat, spans=["END"])
    with pytest.raises(ValueError, match=r"average per-prompt scores first"):
        circuit_graph(scores.expand_dims(prompt=2))
    with pytest.raises(ValueError, match=r"lacks the coord\(s\) \['query_span'\]"):
        circuit_graph(scores.drop_vars("query_span"))
    with pytest.raises(ValueError, match="attr 'span_order' must be a JSON list"):
        circuit_graph(scores.assign_attrs(span_order="IO, S1"))
    with pytest.raises(ValueError, match=r"spans must|spans is empty"):
        circuit_graph(scores, spans=[])


def test_a_circuit_by_span_of_a_real_model_with_its_stability_and_cut(tiny_llama):
    prompts = lsc.data.prompts("ioi")[:4]
    per_prompt = edges.edge_attribution(
        tiny_llama, prompts, positions="spans", per_prompt=True, progress=False
    )
    scores = per_prompt.mean("prompt").assign_attrs(per_prompt.attrs)
    circuit = lsc.circuit(scores, edges=25)
    stability = edges.circuit_stability(per_prompt, edges=25, n_resamples=6, seed=0)
    spec = circuit_graph(scores, circuit, stability=stability, edges=MAX_EDGES).to_dict()
    straight, curves = _rows(spec)
    drawn = {(row["span"], row["sender"], row["receiver"]) for row in straight + curves}
    kept = {
        tuple(str(circuit[dim].values[i]) for dim, i in zip(circuit.dims, index, strict=True))
        for index in np.argwhere(lsc.mask_rules.kept(circuit).values)
    }
    assert drawn == kept and len(kept) == circuit.attrs["n_edges"]
    assert all(0 <= row["stability"] <= 1 for row in straight + curves)
    cut = edges.exact_cut(tiny_llama, prompts[:2], circuit, scores, edges=3, progress=False)
    straight, curves = _rows(circuit_graph(scores, cut, edges=MAX_EDGES).to_dict())
    measured = [row for row in straight + curves if row["exact"] != NOT_MEASURED]
    effects = cut["exact_effect"]
    assert len(measured) == int(
        (np.isfinite(effects.values) & lsc.mask_rules.kept(cut).values).sum()
    )
    for row in measured:
        value = float(effects.sel(span=row["span"], sender=row["sender"], receiver=row["receiver"]))
        assert row["exact"] == f"{value:.4g}"
    flat = lsc.edge_attribution(tiny_llama, prompts, progress=False)
    with pytest.raises(ValueError, match=r"stability is by span \(positions='spans'\) but scores"):
        circuit_graph(flat, stability=stability)


def test_the_circuit_explorer_steps_through_spans():
    explorer = CircuitExplorer(_by_span(), edges=30)
    assert explorer.span is not None and explorer.span.options == ("all", *SPANS)
    shown = explorer._chart
    explorer.span.value = "END"
    straight, curves = _rows(explorer.chart.to_dict())
    assert explorer._chart is shown and {row["span"] for row in straight + curves} == {"END"}
    explorer.span.value = "all"
    assert len({row["span"] for row in _rows(explorer.chart.to_dict())[0]}) > 1


def test_exact_effects_by_span_show_on_their_edges_and_the_other_kind_is_refused(tiny_llama):
    prompts = lsc.data.prompts("ioi")[:2]
    scores = edges.edge_attribution(tiny_llama, prompts, positions="spans", progress=False)
    report = edges.edge_agreement(
        tiny_llama, prompts, estimators=["eap"], n_top=6, n_random=0, positions="spans"
    )
    effect = report["exact"].mean("prompt")
    straight, curves = _rows(circuit_graph(scores, exact=report, edges=MAX_EDGES).to_dict())
    shown = {
        (row["span"], row["sender"], row["receiver"]): row["exact"]
        for row in straight + curves
        if row["exact"] != NOT_MEASURED
    }
    expected = {
        (str(c), str(s), str(r)): f"{float(v):.4g}"
        for c, s, r, v in zip(
            effect["span"].values,
            effect["sender"].values,
            effect["receiver"].values,
            effect.values,
            strict=True,
        )
    }
    assert shown == expected and len(shown) == report.sizes["edge"]
    flat = edges.edge_attribution(tiny_llama, prompts, progress=False)
    with pytest.raises(ValueError, match=r"exact is by span \(positions='spans'\) but scores"):
        circuit_graph(flat, exact=report)
