"""Circuit pictures (views/circuit.py), checked through ``chart.to_dict()`` on synthetic
edge results laid out like ``lsc.edge_attribution``'s (2 layers, 4 heads, 2 KV heads)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape.capture.edges.graph import Graph
from lenscape.views.circuit import circuit_graph, edge_heatmap, faithfulness_curve


@pytest.fixture
def scores() -> xr.DataArray:
    graph = Graph(2, 4, 2)
    values = np.random.default_rng(0).normal(size=graph.valid.shape)
    values[~graph.valid] = np.nan
    return xr.DataArray(
        values, dims=("sender", "receiver"), coords=graph.coords(), attrs={"long_name": "EAP"}
    )


def _layer(spec: dict, mark: str) -> dict:
    return next(layer for layer in spec["layer"] if layer["mark"]["type"] == mark)


def test_graph_draws_the_top_edges_with_score_tooltips(scores):
    spec = circuit_graph(scores, edges=7).to_dict()
    lines = _layer(spec, "rule")
    rows = lines["data"]["values"]
    assert len(rows) == 7
    magnitude = np.sort(np.abs(np.nan_to_num(scores.values)).ravel())[::-1]
    np.testing.assert_allclose(sorted(r["magnitude"] for r in rows)[::-1], magnitude[:7])
    tips = {t["field"] for t in lines["encoding"]["tooltip"]}
    assert {"sender", "receiver", "score"} <= tips
    assert lines["encoding"]["color"]["scale"]["domainMid"] == 0
    # Layers run bottom to top: the embeddings at -1, the logits above the last layer.
    nodes = _layer(spec, "circle")["data"]["values"]
    assert {"node": "logits", "x": 2.0, "y": 2.0} in nodes
    assert {"node": "embed", "x": 2.0, "y": -1.0} in nodes
    assert len(nodes) == 1 + 2 * 5 + 1


def test_graph_of_a_circuit_with_a_kind_filter(scores):
    graph = Graph(2, 4, 2)
    kept = np.zeros(graph.valid.shape, dtype=bool)
    labels = graph.receiver_labels
    kept[0, labels.index("L1.KV1.k")] = True  # embed -> key head 1 of layer 1
    kept[0, labels.index("logits")] = True
    circuit = xr.zeros_like(scores, dtype=bool).copy(data=kept)
    rows = _layer(circuit_graph(scores, circuit).to_dict(), "rule")["data"]["values"]
    assert {r["receiver"] for r in rows} == {"L1.KV1.k", "logits"}
    k_edge = next(r for r in rows if r["kind"] == "k")
    assert (k_edge["x2"], k_edge["y2"]) == (2.5, 1.0)  # the middle of query heads 2 and 3
    only_k = circuit_graph(scores, circuit, kinds=["k"]).to_dict()
    assert [r["receiver"] for r in _layer(only_k, "rule")["data"]["values"]] == ["L1.KV1.k"]
    with pytest.raises(ValueError, match="receiver kind"):
        circuit_graph(scores, kinds=["z"])
    with pytest.raises(ValueError, match="mean"):
        circuit_graph(scores.expand_dims(prompt=[0]))


def test_a_circuit_is_a_mask_whose_not_computed_edges_are_never_drawn(scores):
    """Only the circuit's kept edges are drawn (``mask_rules.kept``: computed and non-zero);
    a NaN edge ("not computed") is not kept."""
    graph = Graph(2, 4, 2)
    labels = graph.receiver_labels
    mask = np.zeros(graph.valid.shape)
    mask[0, labels.index("logits")] = 1.0
    mask[0, labels.index("L1.KV1.k")] = np.nan
    circuit = xr.zeros_like(scores).copy(data=mask).assign_attrs(units="bool")
    rows = _layer(circuit_graph(scores, circuit).to_dict(), "rule")["data"]["values"]
    assert [r["receiver"] for r in rows] == ["logits"]


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"edges": None}, TypeError, "edges must be an integer from 1 to 2000, got None"),
        ({"edges": 1.5}, TypeError, "edges must be an integer"),
        ({"edges": 0}, ValueError, "edges must be an integer from 1"),
        ({"kinds": None}, TypeError, "kinds must be a list of strings"),
        ({"kinds": "q"}, TypeError, r"wrap it in a list: \['q'\]"),
        ({"title": np.array([1, 2])}, TypeError, "title must be a string or None"),
        ({"width": None}, TypeError, "width must be a positive integer"),
        ({"scores": {}}, TypeError, r"scores must be a \(sender, receiver\) xarray.DataArray"),
    ],
)
def test_graph_refuses_bad_options_by_name(scores, options, error, message):
    with pytest.raises(error, match=message):
        circuit_graph(**{"scores": scores, **options})


def test_edge_results_without_their_layout_coords_are_refused(scores):
    bare = xr.DataArray(scores.values, dims=("sender", "receiver"))
    with pytest.raises(ValueError, match=r"scores lacks the coord\(s\) \['sender_kind'"):
        edge_heatmap(bare)


def test_heatmap_puts_receivers_across_and_senders_down(scores):
    spec = edge_heatmap(scores).to_dict()
    assert spec["encoding"]["x"]["field"] == "receiver"
    assert spec["encoding"]["y"]["field"] == "sender"


def test_faithfulness_curve_shows_both_series_and_the_areas(tmp_path):
    result = xr.Dataset(
        {
            "faithfulness": (("budget",), [0.2, 0.7, 1.0]),
            "random_faithfulness": (("seed", "budget"), [[0.0, 0.1, 1.0], [0.1, 0.3, 1.0]]),
            "cpr": 0.7,
            "cmd": 0.3,
            "random_cpr": 0.3,
            "random_cmd": 0.7,
        },
        coords={"budget": [0.01, 0.1, 1.0], "n_edges": ("budget", [3, 30, 300])},
    )
    chart = faithfulness_curve(result)
    spec = chart.to_dict()
    rows = spec["layer"][0]["data"]["values"]
    random = [r["faithfulness"] for r in rows if r["circuit"] == "random"]
    np.testing.assert_allclose(random, [0.05, 0.2, 1.0])
    assert spec["layer"][0]["encoding"]["x"]["scale"]["type"] == "log"
    assert "CPR 0.700 (random 0.300)" in str(spec["title"])
    path = lsc.export(chart, tmp_path / "curve.html")
    assert path.stat().st_size > 1000
    with pytest.raises(TypeError, match="title must be a string or None"):
        faithfulness_curve(result, title=np.array([1, 2]))
    with pytest.raises(ValueError, match=r"result lacks the variable\(s\) \['faithfulness'\]"):
        faithfulness_curve(result.drop_vars("faithfulness"))


def _refuse(name):
    raise AssertionError(f"{name} in a chart spec")


def test_edge_views_read_by_label(scores):
    """A sortby or transpose of the scores, or of the circuit on its own, draws the same
    chart: the views read edges by their labels, never by position."""
    moved = scores.sortby("receiver").sortby("sender", ascending=False).transpose()
    assert circuit_graph(moved, edges=9).to_dict() == circuit_graph(scores, edges=9).to_dict()
    assert edge_heatmap(moved).to_dict() == edge_heatmap(scores).to_dict()
    graph = Graph(2, 4, 2)
    kept = np.zeros(graph.valid.shape, dtype=bool)
    kept[0, graph.receiver_labels.index("logits")] = True
    kept[graph.sender_labels.index("L0.MLP"), graph.receiver_labels.index("L1.H3.q")] = True
    circuit = xr.zeros_like(scores, dtype=bool).copy(data=kept)
    drawn = circuit_graph(scores, circuit).to_dict()
    assert circuit_graph(moved, circuit.sortby("receiver").T).to_dict() == drawn
    rows = _layer(drawn, "rule")["data"]["values"]
    assert {(r["sender"], r["receiver"]) for r in rows} == {
        ("embed", "logits"),
        ("L0.MLP", "L1.H3.q"),
    }
    assert drawn["title"]["text"].startswith("circuit (2 edges)")
    with pytest.raises(ValueError, match=r"circuit's 'receiver' labels do not match .*logits"):
        circuit_graph(scores, circuit.drop_sel(receiver="logits"))


def test_edge_views_check_the_kind_and_origin_of_what_they_draw(scores):
    graph = Graph(2, 4, 2)
    circuit = xr.zeros_like(scores, dtype=bool).copy(data=graph.valid)
    with pytest.raises(
        ValueError, match=r"scores must be the result of lsc.edge_attribution; got a"
    ):
        circuit_graph(circuit)
    with pytest.raises(ValueError, match=r"circuit must be the result of lsc.circuit; got scores"):
        circuit_graph(scores, scores)
    with pytest.raises(ValueError, match=r"scores is a result of 'circuit_faithfulness', not of"):
        edge_heatmap(scores.assign_attrs(method="circuit_faithfulness"))
    edge_heatmap(circuit)  # a circuit's grid: kept and skipped edges
    theirs = circuit.assign_attrs(model="other-model")
    with pytest.raises(ValueError, match=r"model 'other-model' \(the result\) vs 'tiny'"):
        circuit_graph(scores.assign_attrs(model="tiny"), theirs)
    with pytest.raises(ValueError, match=r"circuit keeps \d+ edge\(s\) that have no score"):
        circuit_graph(scores, xr.ones_like(circuit))  # edges that do not exist
    with pytest.raises(ValueError, match=r"circuit keeps no edge, so there is nothing to draw"):
        circuit_graph(scores, xr.zeros_like(circuit))
    infinite = scores.copy()
    infinite[0, 0] = np.inf
    with pytest.raises(ValueError, match=r"scores holds 1 infinite score"):
        circuit_graph(infinite)
    with pytest.raises(ValueError, match=r"scores holds no finite score .* nothing to draw"):
        circuit_graph(scores * np.nan)


def test_edges_left_out_at_a_tie_are_said_and_specs_are_valid_json(scores):
    tied = xr.ones_like(scores).where(Graph(2, 4, 2).valid)  # corrupt == clean: all alike
    chart = circuit_graph(tied, edges=3)
    spec = json.loads(chart.to_json(), parse_constant=_refuse)
    assert len(_layer(spec, "rule")["data"]["values"]) == 3
    assert spec["title"]["subtitle"].startswith(f"{int(Graph(2, 4, 2).valid.sum()) - 3} more")
    json.loads(edge_heatmap(scores * np.nan).to_json(), parse_constant=_refuse)


def _curve(faithfulness, random, **attrs):
    return xr.Dataset(
        {
            "faithfulness": (("budget",), faithfulness),
            "random_faithfulness": (("seed", "budget"), random),
            "cpr": float(np.mean(faithfulness)),
            "cmd": 0.3,
            "random_cpr": float(np.mean(random)),
            "random_cmd": 0.7,
        },
        coords={"budget": [0.01, 0.1, 1.0], "n_edges": ("budget", [3, 30, 300])},
        attrs={"method": "circuit_faithfulness", **attrs},
    )


def test_a_nan_faithfulness_curve_is_said_never_drawn_as_a_number():
    undefined = "the clean and corrupt runs give the same mean metric"
    flat = _curve([np.nan] * 3, [[np.nan] * 3], undefined=undefined)
    with pytest.raises(ValueError, match=rf"NaN at every budget \({undefined}\).*inspect_prompts"):
        faithfulness_curve(flat)
    holed = _curve([0.2, np.nan, 1.0], [[0.0, 0.1, np.inf]])
    spec = json.loads(faithfulness_curve(holed).to_json(), parse_constant=_refuse)
    rows = spec["layer"][0]["data"]["values"]
    assert len(rows) == 4 and all(np.isfinite(r["faithfulness"]) for r in rows)
    assert spec["title"]["subtitle"] == "2 points not computed (NaN), not drawn"
    assert "CPR undefined (random undefined)" in spec["title"]["text"]
    shuffled = holed.isel(budget=[2, 0, 1])
    assert faithfulness_curve(shuffled).to_dict() == faithfulness_curve(holed).to_dict()
    with pytest.raises(ValueError, match=r"result is a result of 'faithfulness', not of"):
        faithfulness_curve(holed.assign_attrs(method="faithfulness"))
