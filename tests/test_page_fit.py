"""Every chart function's default fits a notebook's output area (issue 61): drawn by Vega
itself (vl-convert's scenegraph, the layout a browser gets), at the sizes the notebooks draw
(SmolLM2's 30 layers x 9 heads, a 1% circuit of its 70,000-edge graph, four estimators'
agreement panels, 16 prompts' bars), each picture is at most ``OUTPUT_WIDTH`` px wide, and
the circuit graph draws no more than ``DRAWN_EDGES`` edges by default."""

import json

import numpy as np
import pytest
import vl_convert
import xarray as xr
from _helpers import make_result
from test_notebooks import OUTPUT_WIDTH

import lenscape as lsc
from lenscape.capture.edges.graph import Graph
from lenscape.views.charts import bars
from lenscape.views.circuit import DRAWN_EDGES, circuit_graph

LONG = "EAP-IG (5 steps) edge score (clean -> corrupt) of logit difference (target - distractor)"


def width(chart) -> float:
    """The picture's width in pixels, as Vega lays it out."""
    return vl_convert.vegalite_to_scenegraph(chart.to_dict())["width"]


def heavy_heads(seed=0):
    values = np.random.default_rng(seed).standard_t(2, size=(30, 9)) * 0.1
    values[23, 4] = 8.7  # one outlier, as L23.H4 in notebook 01
    return make_result(values, ("layer", "head"), n_layers=30).assign_attrs(
        long_name="attribution patching (clean -> corrupt) of logit difference", units="logit diff"
    )


def edge_scores(n_layers, n_heads, n_kv, seed=0):
    graph = Graph(n_layers, n_heads, n_kv)
    values = np.random.default_rng(seed).standard_t(2, size=graph.valid.shape)
    return xr.DataArray(
        np.where(graph.valid, values, np.nan),
        dims=("sender", "receiver"),
        coords=graph.coords(),
        attrs={
            "long_name": LONG,
            "units": "logits",
            "method": "edge_attribution",
            "estimator": "eap-ig",
            "steps": 5,
            "model": "synthetic",
        },
    )


def test_a_head_map_with_one_outlier_fits_and_is_not_washed_out():
    chart = lsc.heatmap(heavy_heads(), x="head", y="layer", title="Attribution patching, mean")
    assert width(chart) <= OUTPUT_WIDTH
    assert chart.to_dict()["encoding"]["color"]["scale"]["type"] == "symlog"


def test_side_by_side_head_maps_fit():
    both = xr.concat([heavy_heads(0), heavy_heads(1)], dim="prompts").assign_coords(
        prompts=["all 16 prompts", "the 12 prompts the model answers right"]
    )
    assert width(lsc.heatmap(both, x="head", y="layer", facet_col="prompts")) <= OUTPUT_WIDTH


@pytest.mark.parametrize("columns", [None, 5])
def test_head_maps_by_span_fit(columns):
    """Heads at each of IOI's five spans, shared scale (notebook 06): four (the default
    wrap) or five panels across."""
    spans = ["IO", "S1", "S2", "END", "other"]
    by_span = xr.concat([heavy_heads(i) for i in range(5)], dim="span").assign_coords(span=spans)
    chart = lsc.heatmap(by_span, x="head", y="layer", facet_col="span", columns=columns)
    assert width(chart) <= OUTPUT_WIDTH


@pytest.mark.parametrize(
    ("shape", "fraction"), [((30, 9, 3), 0.01), ((18, 4, 1), 0.1)], ids=["smollm2", "gemma3"]
)
def test_a_circuit_graph_draws_a_readable_number_of_edges_and_fits(shape, fraction):
    scores = edge_scores(*shape)
    circuit = lsc.circuit(scores, fraction=fraction)
    assert int(circuit.sum()) > DRAWN_EDGES  # a circuit of hundreds of edges
    chart = circuit_graph(scores, circuit)
    spec = chart.to_dict()
    lines = next(layer for layer in spec["layer"] if layer["mark"]["type"] == "rule")
    assert len(lines["data"]["values"]) == DRAWN_EDGES
    held = int(circuit.sum())
    said = " ".join(spec["title"]["subtitle"])
    assert f"the {DRAWN_EDGES} strongest of its {held:,} edges" in said
    assert f"edges={held} draws all" in said
    assert width(chart) <= OUTPUT_WIDTH
    full = circuit_graph(scores, circuit, edges=held).to_dict()
    lines = next(layer for layer in full["layer"] if layer["mark"]["type"] == "rule")
    assert len(lines["data"]["values"]) == held  # the others stay in the data
    # the strongest are drawn: no drawn edge is weaker than one left out
    kept = np.abs(scores.values[circuit.values])
    drawn = sorted(
        abs(r["score"]) for r in json.loads(json.dumps(spec))["layer"][0]["data"]["values"]
    )
    assert drawn[0] >= np.sort(kept)[-DRAWN_EDGES]


def test_prompt_bars_tell_their_prompts_apart_and_fit():
    texts = [
        f"The chemical symbol of element number {i} in the periodic table is" for i in range(3)
    ]
    texts += [f"The currency used in the country called number {i} is the" for i in range(2)]
    texts += [f"Prompt {i}" for i in range(11)]
    values = np.random.default_rng(0).normal(size=16)
    da = make_result(values, ("prompt",), text=texts)
    chart = bars(da, y="prompt", title="layer 23, head 4: per prompt")
    spec = chart.to_dict()
    expr = spec["encoding"]["y"]["axis"]["labelExpr"]
    labels = json.loads(expr[: expr.index("][indexof(") + 1])
    assert len(set(labels)) == len(labels) == 16
    assert all(len(label) <= 34 for label in labels)
    assert spec["encoding"]["y"]["title"] == "prompt (text)"
    tips = [t["field"] for t in spec["encoding"]["tooltip"]]
    assert "text" in tips and "text_short" not in tips  # the full text on hover
    assert width(chart) <= OUTPUT_WIDTH


def test_agreement_chart_fits_with_four_estimators(tiny_llama, factual):
    report = lsc.faithfulness(
        tiny_llama,
        factual[:4],
        estimators=("atp", "ig:2", "relp:relp", "relp:secant-0.9"),
        progress=False,
    )
    chart = lsc.agreement_chart(report)
    assert width(chart) <= OUTPUT_WIDTH
    spec = chart.to_dict()
    scatter = spec["vconcat"][0]["concat"]
    for panel in scatter:  # one subtitle line per estimator, none wider than its panel
        lines = panel["title"]["subtitle"]
        size = panel["title"]["subtitleFontSize"]
        assert len(lines) >= 5 and all(len(line) * size * 0.56 <= panel["width"] for line in lines)
        # points at the data's limits sit inside the frame
        points = next(layer for layer in panel["layer"] if layer["mark"]["type"] == "circle")
        low, high = points["encoding"]["x"]["scale"]["domain"]
        exact = [row["exact"] for row in points["data"]["values"]]
        assert low < min(exact) and max(exact) < high
