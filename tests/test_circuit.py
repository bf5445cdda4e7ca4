"""Circuit pictures (views/circuit.py), checked through ``chart.to_dict()`` on synthetic
edge results laid out like ``lsc.edge_attribution``'s (2 layers, 4 heads, 2 KV heads)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape.capture.edges.graph import Graph
from lenscape.schema import RECEIVER_KINDS
from lenscape.views.circuit import (
    DASHES,
    GRID_STEP,
    NO_EDGE,
    NOT_MEASURED,
    OPACITY_RANGE,
    SYMLOG_SHARE,
    circuit_graph,
    edge_heatmap,
    faithfulness_curve,
)
from lenscape.views.circuit_layout import KV_GAP, NODE_SHAPES
from lenscape.views.encoding import SYMLOG_RATIO
from lenscape.views.heatmaps import LEGEND_CHARS


@pytest.fixture
def scores() -> xr.DataArray:
    graph = Graph(2, 4, 2)
    values = np.random.default_rng(0).normal(size=graph.valid.shape)
    values[~graph.valid] = np.nan
    return xr.DataArray(
        values, dims=("sender", "receiver"), coords=graph.coords(), attrs={"long_name": "EAP"}
    )


def _layers(spec: dict) -> list[dict]:
    """Every single-mark layer of a layered spec, nested layers opened."""
    return [
        leaf
        for layer in spec["layer"]
        for leaf in (_layers(layer) if "layer" in layer else [layer])
    ]


def _layer(spec: dict, mark: str) -> dict:
    return next(layer for layer in _layers(spec) if layer["mark"]["type"] == mark)


def test_graph_draws_the_top_edges_with_score_tooltips(scores):
    spec = circuit_graph(scores, edges=7).to_dict()
    lines = _layer(spec, "rule")
    rows = lines["data"]["values"]
    assert len(rows) == 7
    magnitude = np.sort(np.abs(np.nan_to_num(scores.values)).ravel())[::-1]
    np.testing.assert_allclose(sorted(r["magnitude"] for r in rows)[::-1], magnitude[:7])
    assert [r["magnitude"] for r in rows] == sorted(r["magnitude"] for r in rows)  # strong on top
    tips = {t["field"] for t in lines["encoding"]["tooltip"]}
    assert tips == {"edge", "kind", "score"}  # no exact effects given: none promised
    assert all(r["edge"] == f"{r['sender']} → {r['receiver']}" for r in rows)
    assert lines["encoding"]["color"]["scale"]["domainMid"] == 0
    assert spec["usermeta"] == {"embedOptions": {"actions": False}}
    assert circuit_graph(scores, actions=True).to_dict()["usermeta"]["embedOptions"]["actions"]


def test_every_node_is_named_and_layers_run_down_as_in_every_heatmap(scores):
    """Columns H0.. and MLP, rows L0.. from the top (layer 0 at the top, as heatmaps and the
    edge grid draw it); a node per query head, key/value head and MLP, each named in its
    tooltip; the embeddings above layer 0 and the logits below the last layer, each named
    beside its triangle on a white outline; the key/value heads in columns of their own
    (KV0 ...) between the query heads and the MLP, so no diamond sits on a head's dot."""
    spec = circuit_graph(scores, edges=7).to_dict()
    points = _layer(spec, "point")
    nodes = {n["node"]: n for n in points["data"]["values"]}
    assert len(nodes) == 2 + 2 * (4 + 2 + 1)
    assert (nodes["embeddings"]["x"], nodes["embeddings"]["y"]) == (1.5, -1.0)
    assert (nodes["logits"]["x"], nodes["logits"]["y"]) == (1.5, 2.0)
    assert (nodes["L1.H3"]["x"], nodes["L1.H3"]["y"]) == (3.0, 1.0)
    kv = nodes["L1.KV1"]
    assert (kv["x"], kv["y"]) == (3 + KV_GAP + 1.5, 1.0) and kv["role"] == "key/value head"
    assert kv["about"] == "key/value head of L1.H2-H3"
    assert nodes["L1.KV0"]["x"] == kv["x"] - 1
    assert (nodes["L0.MLP"]["x"], nodes["L0.MLP"]["y"]) == (kv["x"] + 1 + KV_GAP, 0.0)
    places = [(n["x"], n["y"]) for n in nodes.values()]
    assert len(set(places)) == len(places)  # no node on another
    assert {t["field"] for t in points["encoding"]["tooltip"]} == {"node", "about"}
    shapes = points["encoding"]["shape"]["scale"]
    assert shapes["domain"] == list(NODE_SHAPES) and len(set(shapes["range"])) == len(NODE_SHAPES)
    x_axis, y_axis = points["encoding"]["x"]["axis"], points["encoding"]["y"]["axis"]
    assert x_axis["values"] == [0, 1, 2, 3, kv["x"] - 1, kv["x"], nodes["L0.MLP"]["x"]]
    labels = json.loads(x_axis["labelExpr"].split("[indexof(")[0])
    assert labels == ["H0", "H1", "H2", "H3", "KV0", "KV1", "MLP"]  # every column named
    assert y_axis["values"] == [0, 1] and points["encoding"]["y"]["scale"]["reverse"] is True
    names = [layer for layer in _layers(spec) if layer["mark"]["type"] == "text"]
    assert [
        (n["data"]["values"][0]["name"], n["data"]["values"][0]["x"], n["mark"]["dy"])
        for n in names
    ] == [("embeddings", 1.5, -9), ("logits", 1.5, 9)] * 2  # outline, then the name
    assert names[0]["mark"]["stroke"] == "white" and "stroke" not in names[2]["mark"]
    used = {r["sender"] for r in _layer(spec, "rule")["data"]["values"]}
    assert all(nodes[s if s != "embed" else "embeddings"]["used"] for s in used)


def test_line_styles_legends_and_title_say_what_is_drawn(scores):
    eap_ig = scores.assign_attrs(
        estimator="eap-ig", steps=5, units="logits", long_name="EAP-IG (5 steps) edge score " * 3
    )
    spec = circuit_graph(eap_ig, edges=7, kinds=["k", "v"]).to_dict()
    assert spec["title"]["text"] == "Top 7 edges by |score| · receivers k, v · EAP-IG (5 steps)"
    lines = _layer(spec, "rule")["encoding"]
    dashes = lines["strokeDash"]["scale"]
    assert dashes["domain"] == list(RECEIVER_KINDS)
    assert len({tuple(d) for d in dashes["range"]}) == len(RECEIVER_KINDS)  # all different
    for channel in ("color", "strokeDash", "strokeWidth"):  # legend titles that fit
        legend_title = lines[channel]["title"]
        parts = [legend_title] if isinstance(legend_title, str) else legend_title
        assert all(len(part) <= LEGEND_CHARS for part in parts), legend_title
    assert lines["color"]["title"] == "score (logits)"
    notes = spec["title"]["subtitle"]
    assert notes[0].startswith("colour and width: EAP-IG (5 steps) edge score")
    assert any("key/value head" in note for note in notes)
    everything = circuit_graph(eap_ig, edges=7).to_dict()["title"]["text"]
    assert everything == "Top 7 edges by |score| · all receivers · EAP-IG (5 steps)"


def test_one_colour_scale_when_a_limit_is_given(scores):
    domains = [
        _layer(circuit_graph(scores, edges=n, kinds=kinds, limit=2.5).to_dict(), "rule")[
            "encoding"
        ]["color"]["scale"]["domain"]
        for n, kinds in ((3, ["q"]), (30, ["logits", "mlp"]))
    ]
    assert domains == [[-2.5, 2.5], [-2.5, 2.5]]
    with pytest.raises(ValueError, match="limit must be"):
        circuit_graph(scores, limit=0)


def _agreement(scores, edges, effects, **attrs):
    """A report of ``lsc.edge_agreement`` measuring ``edges`` ((sender, receiver) labels)."""
    return xr.Dataset(
        {"exact": (("prompt", "edge"), np.asarray(effects, dtype=float))},
        coords={
            "sender": ("edge", [s for s, _ in edges]),
            "receiver": ("edge", [r for _, r in edges]),
        },
        attrs={"method": "edge_agreement", **attrs},
    )


def test_hover_shows_the_exact_effect_where_edge_agreement_measured_it(scores):
    graph = Graph(2, 4, 2)
    kept = np.zeros(graph.valid.shape, dtype=bool)
    kept[0, graph.receiver_labels.index("logits")] = True
    kept[0, graph.receiver_labels.index("L1.KV1.k")] = True
    circuit = xr.zeros_like(scores, dtype=bool).copy(data=kept)
    report = _agreement(scores, [("embed", "logits")], [[0.5], [1.5]])
    spec = circuit_graph(scores, circuit, exact=report).to_dict()
    lines = _layer(spec, "rule")
    exact = {r["receiver"]: r["exact"] for r in lines["data"]["values"]}
    assert exact == {"logits": "1", "L1.KV1.k": NOT_MEASURED}  # mean over its 2 prompts
    assert "exact" in {t["field"] for t in lines["encoding"]["tooltip"]}
    assert any("exact effect" in note for note in spec["title"]["subtitle"])
    with pytest.raises(TypeError, match=r"exact must be an xarray.Dataset"):
        circuit_graph(scores, exact=report["exact"])
    with pytest.raises(ValueError, match=r"exact is a result of 'circuit', not of"):
        circuit_graph(scores, exact=report.assign_attrs(method="circuit"))
    theirs = report.assign_attrs(model="other-model")
    with pytest.raises(ValueError, match=r"model 'other-model' \(the result\) vs 'tiny'"):
        circuit_graph(scores.assign_attrs(model="tiny"), exact=theirs)


def test_graph_of_a_circuit_with_a_kind_filter(scores):
    graph = Graph(2, 4, 2)
    kept = np.zeros(graph.valid.shape, dtype=bool)
    labels = graph.receiver_labels
    kept[0, labels.index("L1.KV1.k")] = True  # embed -> key head 1 of layer 1
    kept[0, labels.index("logits")] = True
    circuit = xr.zeros_like(scores, dtype=bool).copy(data=kept)
    circuit.attrs.update(budget=3, n_edges=2, total_edges=int(graph.valid.sum()))
    spec = circuit_graph(scores, circuit).to_dict()
    rows = _layer(spec, "rule")["data"]["values"]
    assert {r["receiver"] for r in rows} == {"L1.KV1.k", "logits"}
    k_edge = next(r for r in rows if r["kind"] == "k")
    assert (k_edge["x2"], k_edge["y2"]) == (3 + KV_GAP + 1.5, 1.0)  # the key/value head's node
    assert k_edge["to"] == "L1.KV1"
    total = int(graph.valid.sum())
    assert spec["title"]["text"] == (
        f"Circuit of 2 edges (top 3 of {total} by |score|, on paths embeddings → logits)"
        " · all receivers"
    )
    only_k = circuit_graph(scores, circuit, kinds=["k"]).to_dict()
    assert [r["receiver"] for r in _layer(only_k, "rule")["data"]["values"]] == ["L1.KV1.k"]
    assert only_k["title"]["text"].startswith("1 edges of a circuit of 2")
    assert only_k["title"]["text"].endswith("· receivers k")
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
        ({"width": "wide"}, TypeError, "width must be a positive integer"),
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
    # Cells wide enough that rotated receiver labels never overlap.
    assert spec["width"] == {"step": GRID_STEP} and spec["height"] == {"step": GRID_STEP}


def test_grey_in_the_edge_grid_means_no_such_edge(scores):
    """Grey cells are pairs with no edge (the receiver lies below the sender): the subtitle
    says so, as the notebook does, and counts real edges without a score apart."""
    subtitle = edge_heatmap(scores).to_dict()["title"]["subtitle"]
    assert f"grey: {NO_EDGE}" in subtitle and not any("not computed" in s for s in subtitle)
    holed = scores.copy()
    holed.loc[{"sender": "embed", "receiver": "logits"}] = np.nan  # a real edge, unscored
    subtitle = edge_heatmap(holed).to_dict()["title"]["subtitle"]
    assert f"grey: {NO_EDGE}; 1 edges not computed" in subtitle
    every = xr.ones_like(scores).where(Graph(2, 4, 2).valid)
    assert not any(
        "grey" in line
        for line in edge_heatmap(every.fillna(0)).to_dict()["title"].get("subtitle", [])
    )


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
    assert spec["usermeta"] == {"embedOptions": {"actions": False}}
    asked = faithfulness_curve(result, actions=True).to_dict()
    assert asked["usermeta"] == {"embedOptions": {"actions": True}}
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
    assert drawn["title"]["text"] == "Circuit of 2 edges · all receivers"
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
    assert spec["title"]["subtitle"][-1].startswith(f"{int(Graph(2, 4, 2).valid.sum()) - 3} more")
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
    assert spec["title"]["subtitle"] == [
        "random: the mean of 1 random circuits of each size",
        "2 points not computed (NaN), not drawn",
    ]
    assert "CPR undefined (random undefined)" in spec["title"]["text"]
    shuffled = holed.isel(budget=[2, 0, 1])
    assert faithfulness_curve(shuffled).to_dict() == faithfulness_curve(holed).to_dict()
    with pytest.raises(ValueError, match=r"result is a result of 'faithfulness', not of"):
        faithfulness_curve(holed.assign_attrs(method="faithfulness"))


def test_weak_edges_show_on_a_symmetric_log_scale_with_the_linear_one_an_option_away(scores):
    """By default colour is symmetric-log (linear within SYMLOG_SHARE of the limit, the
    legend ticked at its powers of ten) and width square root, and the subtitle says so;
    ``scale="linear"`` makes both linear. The edge grid takes the same colour scale."""
    heavy = scores.copy()
    heavy.loc[{"sender": "embed", "receiver": "logits"}] = 100.0  # one edge dwarfs the rest
    spec = circuit_graph(heavy, edges=7).to_dict()
    lines = _layer(spec, "rule")["encoding"]
    colour = lines["color"]["scale"]
    assert colour["type"] == "symlog" and colour["constant"] == pytest.approx(100 * SYMLOG_SHARE)
    assert colour["domain"] == [-100.0, 100.0] and colour["domainMid"] == 0
    # the powers of ten from the linear part to the limit, but 0.1: 10% of the way from 0,
    # its label would sit on 0's (encoding.TICK_GAP)
    ticks = [1.0, 10.0, 100.0]
    assert lines["color"]["legend"]["values"] == [-t for t in ticks[::-1]] + [0.0] + ticks
    assert lines["strokeWidth"]["scale"]["type"] == "sqrt"
    assert any(
        note.startswith("scales: colour symmetric log") for note in spec["title"]["subtitle"]
    )
    linear = _layer(circuit_graph(heavy, edges=7, scale="linear").to_dict(), "rule")["encoding"]
    assert linear["color"]["scale"]["type"] == "linear"
    assert linear["strokeWidth"]["scale"]["type"] == "linear"
    assert "values" not in linear["color"]["legend"]
    grid = edge_heatmap(heavy).to_dict()
    assert grid["encoding"]["color"]["scale"]["type"] == "symlog"
    assert grid["encoding"]["color"]["scale"]["scheme"] == "blueorange"  # the graph's colours
    assert any(line.startswith("colour: symmetric log") for line in grid["title"]["subtitle"])
    flat = edge_heatmap(heavy, scale="linear").to_dict()["encoding"]["color"]["scale"]
    assert "type" not in flat
    unknown = r"Unknown scale 'log'; choose one of \['auto', 'symlog', 'linear'\]"
    with pytest.raises(ValueError, match=unknown):
        circuit_graph(heavy, scale="log")
    with pytest.raises(ValueError, match=unknown):
        edge_heatmap(heavy, scale="log")


def test_auto_picks_symlog_only_when_the_scores_span_orders_of_magnitude(scores):
    """``scale="auto"`` (the default) reads every finite score of the result: scores of one
    size are drawn linear, one edge SYMLOG_RATIO times the median turns both the graph and
    the edge grid symmetric-log, whatever budget or kinds are drawn (one rule, one result,
    one choice)."""
    ratio = float(np.nanmax(np.abs(scores.values)) / np.nanmedian(np.abs(scores.values)))
    assert ratio < SYMLOG_RATIO
    plain = _layer(circuit_graph(scores, edges=7).to_dict(), "rule")["encoding"]
    assert plain["color"]["scale"]["type"] == "linear"
    assert "type" not in edge_heatmap(scores).to_dict()["encoding"]["color"]["scale"]
    heavy = scores.copy()
    top = float(np.nanmedian(np.abs(scores.values))) * SYMLOG_RATIO * 1.5
    heavy.loc[{"sender": "embed", "receiver": "logits"}] = top
    for kinds in (RECEIVER_KINDS, ("q",)):  # the tail edge is a logits edge: not drawn for q
        spec = circuit_graph(heavy, edges=3, kinds=kinds).to_dict()
        assert _layer(spec, "rule")["encoding"]["color"]["scale"]["type"] == "symlog"
    assert edge_heatmap(heavy).to_dict()["encoding"]["color"]["scale"]["type"] == "symlog"
    forced = _layer(circuit_graph(scores, edges=7, scale="symlog").to_dict(), "rule")
    assert forced["encoding"]["color"]["scale"]["type"] == "symlog"


def test_line_styles_differ_in_kind_not_only_in_length():
    """MLP and logits edges were dash-dot patterns of different lengths, hard to tell apart:
    each kind now has its own pattern (solid, dashes, dots, long dashes, dash-dot)."""
    patterns = {kind: tuple(DASHES[kind]) for kind in RECEIVER_KINDS}
    assert len(set(patterns.values())) == len(patterns)
    segments = {kind: len(dash) for kind, dash in patterns.items()}
    assert segments["mlp"] != segments["logits"]  # a dash against a dash-dot
    assert max(DASHES["mlp"]) >= 2 * max(DASHES["k"])  # long dashes against short ones


def _stability(scores, shares, **attrs):
    stable = xr.zeros_like(scores).where(Graph(2, 4, 2).valid)
    for (sender, receiver), share in shares.items():
        stable.loc[{"sender": sender, "receiver": receiver}] = share
    base = {"method": "circuit_stability", "n_resamples": 200, "n_prompts": 16, "budget": 3}
    return stable.assign_attrs({**base, **attrs})


def test_stability_is_drawn_as_opacity_and_named_in_the_title(scores):
    graph = Graph(2, 4, 2)
    kept = np.zeros(graph.valid.shape, dtype=bool)
    kept[0, graph.receiver_labels.index("logits")] = True
    kept[0, graph.receiver_labels.index("L1.KV1.k")] = True
    circuit = xr.zeros_like(scores, dtype=bool).copy(data=kept)
    stable = _stability(scores, {("embed", "logits"): 1.0, ("embed", "L1.KV1.k"): 0.35})
    spec = circuit_graph(scores, circuit, stability=stable).to_dict()
    lines = _layer(spec, "rule")
    shares = {r["receiver"]: r["stability"] for r in lines["data"]["values"]}
    assert shares == {"logits": 1.0, "L1.KV1.k": 0.35}
    opacity = lines["encoding"]["opacity"]
    assert opacity["field"] == "stability" and opacity["scale"]["domain"] == [0, 1]
    assert opacity["scale"]["range"] == list(OPACITY_RANGE)
    assert "stability" in {t["field"] for t in lines["encoding"]["tooltip"]}
    assert spec["title"]["text"].endswith("· stability over 200 resamples")
    assert any(
        "share of 200 bootstrap resamples of the 16 prompts" in n for n in spec["title"]["subtitle"]
    )
    moved = circuit_graph(scores, circuit, stability=stable.sortby("receiver").T).to_dict()
    assert moved == spec  # read by label
    plain = _layer(circuit_graph(scores, circuit).to_dict(), "rule")
    assert "opacity" not in plain["encoding"] and "stability" not in plain["data"]["values"][0]
    with pytest.raises(ValueError, match="stability is a result of 'circuit', not of"):
        circuit_graph(scores, stability=circuit.assign_attrs(method="circuit"))
    with pytest.raises(ValueError, match="stability must be the"):
        circuit_graph(scores, stability=circuit)
    with pytest.raises(ValueError, match="outside"):
        circuit_graph(scores, stability=stable * 2)
    with pytest.raises(TypeError, match=r"stability must be an xarray\.DataArray"):
        circuit_graph(scores, stability=stable.values)
    with pytest.raises(ValueError, match=r"model 'other' \(the result\) vs 'tiny'"):
        circuit_graph(
            scores.assign_attrs(model="tiny"), stability=stable.assign_attrs(model="other")
        )


def test_a_consensus_circuit_says_so_in_the_title(scores):
    graph = Graph(2, 4, 2)
    kept = np.zeros(graph.valid.shape, dtype=bool)
    kept[0, graph.receiver_labels.index("logits")] = True
    circuit = xr.zeros_like(scores, dtype=bool).copy(data=kept)
    circuit.attrs.update(
        method="circuit", consensus_share=0.5, n_resamples=200, budget=3, n_edges=1
    )
    title = circuit_graph(scores, circuit).to_dict()["title"]["text"]
    title = " ".join(title) if isinstance(title, list) else title  # long titles wrap
    assert title.startswith(
        "Consensus circuit of 1 edges (in ≥ 50% of 200 resampled top-3 circuits, on paths"
    )


def test_several_faithfulness_curves_compare_by_the_edges_each_circuit_keeps():
    flat = _curve([0.3, 0.92, 1.0], [[0.0, 0.1, 1.0]], model="m")
    by_span = _curve([0.5, 0.6, 0.95], [[0.0, 0.1, 1.0]], model="m").assign_coords(
        n_edges=("budget", [30, 300, 3000])
    )
    spec = faithfulness_curve({"position-agnostic": flat, "by span": by_span}).to_dict()
    rows = _layer(spec, "line")["data"]["values"]
    assert {r["circuit"] for r in rows} == {
        "position-agnostic: f ≥ 0.9 first at 30 edges",
        "by span: f ≥ 0.9 first at 3,000 edges",
    }
    assert sorted(r["edges"] for r in rows) == [3, 30, 30, 300, 300, 3000]
    assert _layer(spec, "line")["encoding"]["x"]["field"] == "edges"
    # read by label: a reversed budget order draws the same; one Dataset is one curve
    again = faithfulness_curve(
        {"position-agnostic": flat.isel(budget=[2, 1, 0]), "by span": by_span}
    )
    assert json.dumps(again.to_dict(), sort_keys=True) == json.dumps(spec, sort_keys=True)
    assert "CPR" in str(faithfulness_curve(flat).to_dict()["title"])
    never = _curve([0.1, 0.2, 0.3], [[0.0, 0.1, 1.0]], model="m")
    rows = _layer(faithfulness_curve({"weak": never}).to_dict(), "line")["data"]["values"]
    assert rows[0]["circuit"] == "weak: f < 0.9 at every budget"
    with pytest.raises(ValueError, match="results must map names"):
        faithfulness_curve({})
    with pytest.raises(TypeError, match=r"results\['a'\] must be"):
        faithfulness_curve({"a": flat["faithfulness"]})
    with pytest.raises(ValueError, match=r"results\['other'\]"):
        faithfulness_curve({"mine": flat, "other": flat.assign_attrs(model="n")})
