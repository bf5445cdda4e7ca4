"""bars, summary, logit_lens_chart and agreement_chart (views/charts.py), checked through the
Vega-Lite spec (``chart.to_dict()``)."""

import json

import numpy as np
import pytest
import xarray as xr
from _helpers import ATTRS, inline_rows, make_result

import lenscape as lsc
from lenscape import schema
from lenscape.views import charts


def test_summary_is_a_few_lines_with_the_strongest_cells():
    values = np.zeros((2, 4, 3))
    values[:, 2, 1] = [5.0, 3.0]
    values[0, 0, 0] = np.nan
    da = make_result(values, ("prompt", "layer", "head"), n_layers=4)
    text = repr(da.lsc.summary(top=1))
    assert text.splitlines() == [
        "attribution (logit diff): prompt 2 × layer 4 × head 3",
        "method: attribution_patching · metric: logit_diff · model: tiny · backend: nnsight",
        "min 0 · mean 0.3478 · max 5",
        "1 cells not computed (NaN)",
        "strongest (mean over prompt): layer 2, head 1: 4",
    ]
    assert charts.summary(da)._repr_html_().startswith("<div")


def test_agreement_chart_refuses_what_is_not_a_faithfulness_report():
    with pytest.raises(TypeError, match=r"report must be an xarray\.Dataset from lsc"):
        lsc.agreement_chart(None)
    with pytest.raises(ValueError, match=r"report lacks the variable\(s\) \['exact_heads'"):
        lsc.agreement_chart(xr.Dataset({"x": 1}))


def test_agreement_chart(tiny_llama, factual):
    pairs = factual[:4]
    report = lsc.faithfulness(tiny_llama, pairs, estimators=("atp",), progress=False)
    spec = lsc.agreement_chart(report).to_dict()
    scatter, statistics = spec["vconcat"][0]["concat"], spec["vconcat"][1]["hconcat"]
    panels = scatter
    assert [p["title"]["text"] for p in panels] == ["heads", "attention blocks", "MLP blocks"]
    at = dict(estimator="atp", component_type="mlp")
    r_mlp = float(report["pearson_means"].sel(at))
    low, high = report["pearson_means_interval"].sel(at).values
    assert panels[2]["title"]["subtitle"] == [  # one line per estimator: no overlap
        "r over prompt means:",
        f"atp: {r_mlp:.2f} [{low:.2f}, {high:.2f}]",
    ]
    # the second row: each statistic with its interval as an error bar
    assert [p["title"]["text"] for p in statistics] == [
        "r over prompt means",
        "r over cells",
        "top-10 overlap",
    ]
    bars, _points = statistics[0]["layer"]
    assert bars["mark"]["type"] == "rule" and bars["encoding"]["x2"]["field"] == "high"
    rows = statistics[0]["data"]["values"]  # shared by the bars and the points
    row = next(r for r in rows if r["component type"] == "MLP blocks")
    assert row == {
        "component type": "MLP blocks",
        "estimator": "atp",
        "value": pytest.approx(r_mlp),
        "low": pytest.approx(low),
        "high": pytest.approx(high),
    }
    assert statistics[2]["title"]["subtitle"] == [
        "undefined, not drawn:",
        "attention blocks (atp),",
        "MLP blocks (atp)",
    ]  # 3 blocks of each kind: a top-10 overlap is undefined
    old = report.drop_vars([v for v in report.data_vars if str(v).endswith("_interval")])
    assert "concat" in lsc.agreement_chart(old).to_dict()  # a report saved before intervals
    points = next(layer for layer in panels[0]["layer"] if layer["mark"]["type"] == "circle")
    assert len(points["data"]["values"]) == 12  # 3 layers x 4 heads, one estimator
    first = points["data"]["values"][0]
    assert first["exact"] == pytest.approx(float(report["exact_heads"].mean("prompt")[0, 0]))
    assert points["encoding"]["x"]["title"].startswith("exact patching effect")


def test_agreement_chart_reads_the_report_by_label(tiny_llama, factual):
    """A sortby or transpose of the report draws the same panels in the same order (heads,
    attention, MLP); a report of another method is refused by name."""
    report = lsc.faithfulness(tiny_llama, factual[:2], estimators=("atp",), progress=False)
    moved = report.sortby("head", ascending=False).sortby("component_type")
    moved = moved.transpose("head", "prompt", "component", "layer", ...)
    assert lsc.agreement_chart(moved).to_dict() == lsc.agreement_chart(report).to_dict()
    with pytest.raises(ValueError, match=r"report is a result of 'edge_agreement', not of lsc"):
        lsc.agreement_chart(report.assign_attrs(method="edge_agreement"))


def test_summary_and_bars_read_by_label():
    values = np.zeros((2, 4, 3))
    values[:, 2, 1] = values[:, 1, 2] = 4.0  # a tie: listed in label order
    da = make_result(values, ("prompt", "layer", "head"), n_layers=4)
    moved = da.sortby("layer", ascending=False).transpose("head", "layer", "prompt")
    assert repr(charts.summary(moved, top=2)) == repr(charts.summary(da, top=2))
    assert "layer 1, head 2: 4; layer 2, head 1: 4" in repr(charts.summary(da, top=2))
    bars = make_result([1.0, -2.0, 0.5], ("prompt",))
    reversed_bars = bars.sortby("prompt", ascending=False)
    assert (
        charts.bars(reversed_bars, y="prompt").to_dict() == charts.bars(bars, y="prompt").to_dict()
    )
    with pytest.raises(ValueError, match=r"top must be an integer >= 0, got -1"):
        charts.summary(da, top=-1)


def lens_result(n_layers=3, tokens=("The", " capital", " of")):
    shape = (n_layers, len(tokens))
    probs = np.linspace(0, 0.9, np.prod(shape)).reshape(shape)
    return schema.make(
        probs,
        dims=("layer", "pos"),
        coords={
            "token": ("pos", list(tokens)),
            "target_rank": (("layer", "pos"), np.arange(np.prod(shape)).reshape(shape)[::-1]),
            "top_token": (("layer", "pos"), np.full(shape, " Paris")),
            "top_tokens": (("layer", "pos"), np.full(shape, "' Paris' 0.41 | ' Rome' 0.12")),
        },
        attrs={**ATTRS, "long_name": "p(' Paris')", "units": "probability"},
        n_layers=n_layers,
    ).rename("target_prob")


def test_logit_lens_chart_puts_tokens_in_order_on_x_and_top_tokens_in_the_tooltip():
    da = lens_result()
    spec = charts.logit_lens_chart(da).to_dict()
    enc = spec["encoding"]
    assert enc["x"]["field"] == "pos" and enc["y"]["field"] == "layer"
    expr = enc["x"]["axis"]["labelExpr"]
    assert expr == '["The", " capital", " of"][indexof([0, 1, 2], datum.value)]'
    assert enc["x"]["sort"] == [0, 1, 2]
    assert enc["color"]["scale"]["domain"] == [0.0, 1.0]  # probability: a fixed 0-1 scale
    tips = [t["field"] for t in enc["tooltip"]]
    assert {"token", "target_rank", "top_token", "top_tokens"} <= set(tips)
    assert spec["title"]["text"] == "Logit lens: p(' Paris')"
    assert any("residual stream" in line for line in spec["title"]["subtitle"])
    cell = next(r for r in inline_rows(spec) if r["layer"] == 2 and r["pos"] == 1)
    assert cell["value"] == pytest.approx(float(da.sel(layer=2, pos=1)))
    assert cell["target_rank"] == int(da["target_rank"].sel(layer=2, pos=1))
    assert spec["usermeta"] == {"embedOptions": {"actions": False}}
    with pytest.raises(ValueError, match=r"\(layer, pos\) DataArray.*select one prompt"):
        charts.logit_lens_chart(da.expand_dims(prompt=[0]))
    with pytest.raises(ValueError, match="needs the 'token' coord"):
        charts.logit_lens_chart(da.drop_vars("token"))


def test_bars_colour_the_prompts_the_model_gets_wrong():
    da = make_result([1.0, -2.0, 0.5], ("prompt",)).assign_coords(
        text=("prompt", ["a", "b", "c"]), correct=("prompt", [True, False, True])
    )
    spec = charts.bars(da, y="prompt").to_dict()
    answers = [r["answer"] for r in inline_rows(spec)]
    assert answers == ["model right", "model wrong", "model right"]
    assert spec["encoding"]["color"]["scale"]["range"] == list(charts.ANSWER_COLORS.values())
    plain = charts.bars(da.drop_vars("correct"), y="prompt").to_dict()
    assert "color" not in plain["encoding"]


def test_agreement_chart_counts_not_computed_cells_and_stays_valid_json(tiny_llama, factual):
    """A NaN cell has no place on the axes: it is left out and counted, never written as NaN
    (invalid JSON) or silently dropped; an undefined r reads "undefined" (issue 24)."""
    report = lsc.faithfulness(tiny_llama, factual[:2], estimators=("atp",), progress=False)
    holed = report.copy()
    holed["exact_heads"] = report["exact_heads"].where(report["exact_heads"]["layer"] > 0)
    holed["pearson_means"] = report["pearson_means"].where(report["component_type"] != "head")
    spec = lsc.agreement_chart(holed).to_dict()
    json.dumps(spec, allow_nan=False)
    heads = spec["vconcat"][0]["concat"][0]
    points = next(layer for layer in heads["layer"] if layer["mark"]["type"] == "circle")
    n_heads = tiny_llama.spec.n_heads
    assert len(points["data"]["values"]) == (tiny_llama.spec.n_layers - 1) * n_heads
    assert heads["title"]["subtitle"] == [
        "r over prompt means:",
        "atp: undefined",
        f"{n_heads} cells not computed (NaN), not drawn",
    ]


def test_bars_draw_the_mean_and_its_interval_when_asked():
    values = np.array([1.0, 1.4, 0.6, 1.2, 0.8])
    da = make_result(values, ("prompt",))
    spec = charts.bars(da, y="prompt", ci=0.9).to_dict()
    band, rule, _ = spec["layer"]
    assert band["mark"]["type"] == "rect" and rule["mark"]["type"] == "rule"
    interval = lsc.aggregate.mean(da, ci=0.9)
    low, high = (float(interval.sel(bound=b)) for b in ("low", "high"))
    assert band["data"]["values"] == [{"low": low, "high": high}]
    assert rule["data"]["values"] == [{"mean": 1.0}]
    assert spec["title"]["subtitle"][0] == f"mean 1, 90% interval {low:.4g} to {high:.4g} (N = 5)"
    one = charts.bars(da[:1], y="prompt", ci=0.95).to_dict()  # no interval: only the mean's line
    json.dumps(one, allow_nan=False)
    assert [layer["mark"]["type"] for layer in one["layer"]] == ["rule", "bar"]
    assert one["title"]["subtitle"][0] == (
        "mean 1, no interval (N = 1): fewer than 2 prompts, or an infinite value"
    )
    with pytest.raises(ValueError, match=r"ci must lie in \(0, 1\)"):
        charts.bars(da, y="prompt", ci=1.0)


def test_reliability_chart_draws_each_statistic_with_its_band_of_splits():
    rng = np.random.default_rng(0)
    values = rng.normal(0, 1, size=(30, 4, 3)) + np.arange(12).reshape(4, 3) / 3
    da = make_result(values, ("prompt", "layer", "head"), n_layers=4)
    rel = da.lsc.reliability(sizes=[1, 3, 15], n_splits=20, top_k=3)
    spec = lsc.reliability_chart(rel).to_dict()
    json.dumps(spec, allow_nan=False)
    r_panel, overlap_panel = spec["hconcat"]
    assert [r_panel["title"], overlap_panel["title"]] == [
        "r between the halves' maps",
        "top-3 overlap",
    ]
    band, line = r_panel["layer"]
    assert band["mark"]["type"] == "area" and line["mark"]["type"] == "line"
    assert line["encoding"]["x"]["scale"]["type"] == "log"
    rows = r_panel["data"]["values"]
    assert [r["size"] for r in rows] == [1, 3, 15]
    assert rows[2]["mean"] == pytest.approx(float(rel["correlation"].sel(size=15, bound="mean")))
    assert rows[2]["low"] == pytest.approx(float(rel["correlation"].sel(size=15, bound="low")))
    subtitle = spec["title"]["subtitle"]
    assert subtitle[0] == "map: attribution"
    assert subtitle[1].startswith("two disjoint halves of n prompts each, 20 random splits per n")
    r15 = float(rel["correlation"].sel(size=15, bound="mean"))
    o15 = float(rel["top_overlap"].sel(size=15, bound="mean"))
    assert subtitle[2] == (
        f"at 15 prompts per half: r between the halves' maps {r15:.2f}, top-3 overlap {o15:.2f}"
    )
    assert spec["usermeta"] == {"embedOptions": {"actions": False}}
    moved = rel.sortby("size", ascending=False).transpose("bound", "size")
    assert lsc.reliability_chart(moved).to_dict() == spec  # read by label
    undefined = (da * np.nan).lsc.reliability(sizes=[1, 3], n_splits=4, top_k=3)
    said = lsc.reliability_chart(undefined).to_dict()["title"]["subtitle"]
    assert said[-1].startswith("undefined (NaN), not drawn: r between the halves' maps at 1")
    with pytest.raises(ValueError, match=r"reliability is a result of 'faithfulness'"):
        lsc.reliability_chart(rel.assign_attrs(method="faithfulness"))
