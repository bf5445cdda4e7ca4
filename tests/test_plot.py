"""heatmap and export, checked through the Vega-Lite spec (``chart.to_dict()``)."""

import json

import altair as alt
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from _helpers import ATTRS

import lenscape as lsc
import lenscape.accessor
from lenscape import plot, schema
from lenscape.plot import export, heatmap


def make(values, dims, n_layers=None, **coords):
    return schema.make(np.asarray(values), dims=dims, coords=coords, attrs=ATTRS, n_layers=n_layers)


def signed(n_layers=4, n_heads=3, seed=0):
    values = np.random.default_rng(seed).normal(size=(n_layers, n_heads))
    values[0, 0], values[1, 1] = -2.0, 1.0  # both signs, |min| > max
    return make(values, ("layer", "head"), n_layers=n_layers)


def rows(spec):
    """The inline cells of a spec (Altair moves them to top-level ``datasets``)."""
    (values,) = spec["datasets"].values()
    return values


def test_signed_scores_get_a_diverging_scale_centred_at_zero():
    spec = heatmap(signed(), x="head", y="layer").to_dict()
    enc = spec["encoding"]
    assert enc["x"] == {"field": "head", "type": "ordinal", "title": "head", "sort": [0, 1, 2]}
    assert enc["y"]["field"] == "layer" and enc["y"]["sort"] == [0, 1, 2, 3]
    assert spec["mark"]["type"] == "rect"
    scale = enc["color"]["scale"]
    assert enc["color"]["type"] == "quantitative"
    assert scale["domainMid"] == 0 and scale["domain"] == [-2.0, 2.0]
    assert scale["scheme"]["name"] == "redblue"
    assert enc["color"]["title"] == "attribution (logit diff)"
    assert spec["title"]["text"] == "attribution"
    assert "method: attribution_patching" in spec["title"]["subtitle"][0]


def test_unsigned_scores_get_a_sequential_scale():
    da = make(np.linspace(0.2, 0.9, 12).reshape(4, 3), ("layer", "head"))
    scale = heatmap(da, x="head", y="layer").to_dict()["encoding"]["color"]["scale"]
    assert scale["domain"] == pytest.approx([0.2, 0.9])
    assert scale["scheme"] == "viridis" and "domainMid" not in scale


def test_center_forces_a_diverging_scale_that_spans_only_the_data():
    da = make(np.linspace(0.11, 0.17, 12).reshape(4, 3), ("layer", "head"))
    scale = heatmap(da, x="head", y="layer", center=1 / 7).to_dict()["encoding"]["color"]["scale"]
    assert scale["domainMid"] == pytest.approx(1 / 7)
    assert scale["domain"] == pytest.approx([0.11, 0.17])
    change = make(np.linspace(0.001, 0.02, 12).reshape(4, 3), ("layer", "head"))
    scale = heatmap(change, x="head", y="layer", center=0.003).to_dict()["encoding"]["color"][
        "scale"
    ]
    assert scale["domain"][0] == pytest.approx(0.001)  # a relative change never goes negative


def _bool_units(values):
    return make(values, ("layer", "head")).assign_attrs(units="bool")


@pytest.mark.parametrize(
    "build",
    [lambda: make(np.eye(4, 3, dtype=bool), ("layer", "head")), lambda: _bool_units(np.eye(4, 3))],
    ids=["bool dtype", "float with units bool"],
)
def test_binary_masks_get_two_named_colours(build):
    spec = heatmap(build(), x="head", y="layer").to_dict()
    color = spec["encoding"]["color"]
    assert color["type"] == "nominal" and color["field"] == "state"
    assert color["scale"]["domain"] == ["kept", "skipped"]
    assert color["scale"]["range"] == [plot.BINARY_COLORS[1], plot.BINARY_COLORS[0]]
    states = {(r["layer"], r["head"]): r["state"] for r in rows(spec)}
    assert states[(0, 0)] == "kept" and states[(0, 1)] == "skipped"


def test_mask_look_follows_the_dtype_never_the_values():
    zero_one = make(np.eye(4, 3), ("layer", "head")).assign_attrs(units="relative (0-1)")
    color = heatmap(zero_one, x="head", y="layer").to_dict()["encoding"]["color"]
    assert color["type"] == "quantitative" and color["scale"]["scheme"] == "viridis"
    assert color["title"] == ["attribution (relative", "(0-1))"]  # wrapped, never cut


def test_binary_can_be_forced_refused_and_relabelled():
    da = make(np.eye(4, 3) * 2, ("layer", "head"))
    assert heatmap(da, x="head", y="layer").to_dict()["encoding"]["color"]["type"] == "quantitative"
    spec = heatmap(da, x="head", y="layer", binary=True, labels=("off", "on")).to_dict()
    assert spec["encoding"]["color"]["scale"]["domain"] == ["on", "off"]
    mask = _bool_units(np.eye(4, 3))
    color = heatmap(mask, x="head", y="layer", binary=False).to_dict()["encoding"]["color"]
    assert color["type"] == "quantitative"


def test_color_option_sets_scheme_or_range():
    scale = heatmap(signed(), x="head", y="layer", color="blueorange").to_dict()
    assert scale["encoding"]["color"]["scale"]["scheme"] == "blueorange"
    mask = make(np.eye(4, 3, dtype=bool), ("layer", "head"))
    scale = heatmap(mask, x="head", y="layer", color=["white", "black"]).to_dict()
    assert scale["encoding"]["color"]["scale"]["range"] == ["black", "white"]


def test_facets_share_one_colour_domain():
    a, b = signed(seed=1), signed(seed=2) * 3
    da = xr.concat([a, b], dim=pd.Index(["small", "large"], name="model"))
    da = da.expand_dims(component=["attn", "mlp"], axis=-1).transpose(
        "model", "layer", "head", "component"
    )
    spec = heatmap(da.isel(head=0), x="component", y="layer", facet_col="model").to_dict()
    assert spec["facet"]["field"] == "model" and spec["columns"] == plot.FACET_COLUMNS
    assert spec["facet"]["sort"] == ["small", "large"]
    assert spec["facet"]["header"]["title"] is None  # headers read "small", not "model = small"
    assert spec["facet"]["header"]["labelExpr"] == "datum.value"
    assert spec["spec"]["encoding"]["x"]["sort"] == ["attn", "mlp"]  # stored order, not a-z
    peak = float(abs(da.isel(head=0)).max())
    assert spec["spec"]["encoding"]["color"]["scale"]["domain"] == pytest.approx([-peak, peak])
    grid = heatmap(da, x="head", y="layer", facet_col="model", facet_row="component").to_dict()
    assert grid["facet"]["row"]["field"] == "component"
    assert grid["facet"]["column"]["header"]["title"] is None
    assert len(rows(grid)) == da.size


def test_many_facets_wrap_into_rows_and_integer_headers_name_their_dim():
    values = np.random.default_rng(0).normal(size=(10, 4, 3))
    da = make(values, ("prompt", "layer", "head"), n_layers=4)
    spec = heatmap(da, x="head", y="layer", facet_col="prompt", columns=3).to_dict()
    assert spec["columns"] == 3 and spec["facet"]["field"] == "prompt"
    assert spec["facet"]["header"]["labelExpr"] == "'prompt ' + datum.value"
    assert heatmap(da, x="head", y="layer", facet_col="prompt").to_dict()["columns"] == 4
    stacked = heatmap(da, x="head", y="layer", facet_row="prompt").to_dict()
    assert stacked["columns"] == 1
    grid = heatmap(
        da, x="head", y="layer", facet_col="prompt", columns=5, independent=True
    ).to_dict()
    assert grid["columns"] == 5 and grid["concat"][0]["title"] == "prompt 0"
    with pytest.raises(ValueError, match="columns must be a positive integer"):
        heatmap(da, x="head", y="layer", facet_col="prompt", columns=0)


def _two_depths():
    a = make(np.arange(12.0).reshape(4, 3) - 5, ("layer", "head"), n_layers=4)
    b = make(np.arange(6.0).reshape(2, 3), ("layer", "head"), n_layers=2)
    return xr.concat([a, b], dim=pd.Index(["deep", "shallow"], name="model"), join="outer")


def test_depth_puts_models_of_different_depth_on_one_axis():
    da = _two_depths()
    assert da["depth"].dims == ("model", "layer")
    spec = heatmap(da, x="head", y="depth", facet_col="model").to_dict()
    enc = spec["spec"]["encoding"]
    assert enc["y"]["field"] == "depth_start" and enc["y"]["type"] == "quantitative"
    assert enc["y2"]["field"] == "depth_end"
    cells = rows(spec)
    assert len(cells) == (4 + 2) * 3  # the shallow model's padded layers are dropped
    shallow = sorted({(r["depth_start"], r["depth_end"]) for r in cells if r["model"] == "shallow"})
    assert shallow == [(-0.5, 0.5), (0.5, 1.5)]
    deep = sorted({(r["depth_start"], r["depth_end"]) for r in cells if r["model"] == "deep"})
    assert [e for _, e in deep[:-1]] == [s for s, _ in deep[1:]]  # contiguous cells


def test_independent_gives_each_panel_its_own_axes():
    da = _two_depths()
    chart = heatmap(da, x="head", y="layer", facet_col="model", independent=True)
    assert isinstance(chart, alt.ConcatChart)
    spec = chart.to_dict()
    panels = spec["concat"]
    assert [p["title"] for p in panels] == ["deep", "shallow"]
    assert [p["encoding"]["y"]["sort"] for p in panels] == [[0, 1, 2, 3], [0, 1]]
    domains = {tuple(p["encoding"]["color"]["scale"]["domain"]) for p in panels}
    assert len(domains) == 1  # colours still compare across panels


def test_tooltips_show_every_coordinate_and_the_value():
    values = np.random.default_rng(0).normal(size=(2, 2, 3, 2))
    da = make(
        values,
        ("seed", "prompt", "layer", "head"),
        n_layers=3,
        text=["The capital of France is", "2 + 2 ="],
        category=["fact", "math"],
    )
    spec = heatmap(da.sel(seed=1).mean("head"), x="prompt", y="layer").to_dict()
    fields = [t["field"] for t in spec["encoding"]["tooltip"]]
    assert fields == ["prompt", "layer", "text", "category", "depth", "seed", "value"]
    assert spec["encoding"]["tooltip"][-1]["title"] == "attribution (logit diff)"
    cell = rows(spec)[0]
    assert cell["text"] == "The capital of France is" and cell["seed"] == 1
    assert (
        heatmap(signed(), x="head", y="layer", tooltip=False).to_dict()["encoding"].get("tooltip")
        is None
    )


def test_nan_is_drawn_grey_never_as_zero():
    da = signed()
    da[2, 1] = np.nan
    spec = heatmap(da, x="head", y="layer").to_dict()
    cell = next(r for r in rows(spec) if (r["layer"], r["head"]) == (2, 1))
    assert cell["value"] is None
    assert spec["mark"]["invalid"] == "show"
    assert spec["config"]["scale"]["invalid"]["color"]["value"] == plot.NAN_COLOR
    assert "grey: not computed" in spec["title"]["subtitle"]
    assert not any(
        "grey" in line
        for line in heatmap(signed(), x="head", y="layer").to_dict()["title"]["subtitle"]
    )
    padded = heatmap(_two_depths(), x="head", y="depth", facet_col="model").to_dict()
    assert not any("grey" in line for line in padded["title"]["subtitle"])  # padding is not drawn
    mask = _bool_units(np.eye(4, 3))
    mask[3, 2] = np.nan
    color = heatmap(mask, x="head", y="layer").to_dict()["encoding"]["color"]
    assert color["scale"]["domain"] == ["kept", "skipped", "not computed"]
    assert color["scale"]["range"][-1] == plot.NAN_COLOR


def test_grids_above_altairs_row_limit_work_without_lifting_it_globally(monkeypatch):
    values = np.random.default_rng(0).normal(size=(2, 16, 36, 32))
    da = make(values, ("model", "cluster", "layer", "head"), n_layers=36, model=["a", "b"])
    spec = heatmap(
        da.isel(cluster=slice(0, 8)), x="head", y="layer", facet_col="model", facet_row="cluster"
    ).to_dict()
    assert len(rows(spec)) == 2 * 8 * 36 * 32 > 5000
    with pytest.raises(alt.MaxRowsError):  # Altair's own guard is untouched
        alt.Chart(pd.DataFrame({"a": range(6000)})).mark_point().to_dict()
    monkeypatch.setattr(plot, "MAX_CELLS", 1000)
    with pytest.raises(ValueError, match="MAX_CELLS=1000"):
        heatmap(da.isel(cluster=0), x="head", y="layer", facet_col="model")


def test_errors_name_the_dims_and_how_to_reduce():
    da = make(np.zeros((5, 4, 3)), ("prompt", "layer", "head"))
    with pytest.raises(ValueError, match=r"da\.mean\('prompt'\) or da\.sel\(prompt=0\)"):
        heatmap(da, x="head", y="layer")
    with pytest.raises(ValueError, match=r"x='pos'.*dims \('prompt', 'layer', 'head'\)"):
        heatmap(da, x="pos", y="layer")
    with pytest.raises(ValueError, match="facet_col='seed' is not a dim"):
        heatmap(da, x="head", y="layer", facet_col="seed")
    with pytest.raises(ValueError, match="must differ"):
        heatmap(da, x="head", y="head")
    with pytest.raises(TypeError, match=r"da must be an xarray.DataArray.*ds\['name'\]"):
        heatmap(da.to_dataset(name="s"), x="head", y="layer")


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"x": ["head"]}, TypeError, r"x must be a string, got \['head'\] \(list\)"),
        ({"title": np.array([1, 2])}, TypeError, "title must be a string or None"),
        ({"color": "virdis"}, ValueError, r"color='virdis' is not a Vega .*'viridis'"),
        ({"color": True}, TypeError, "color must be a list of strings"),
        ({"color": ["red"], "binary": True}, ValueError, "color lists 1 colours for 2 states"),
        ({"domain": (1, 0)}, ValueError, "domain must have low < high"),
        ({"domain": True}, TypeError, r"domain must be a pair \(low, high\)"),
        ({"center": ""}, TypeError, "center must be a number"),
        ({"categories": True}, TypeError, "categories must be a list of strings"),
        ({"categories": ["a"]}, ValueError, "categories names 1 codes"),
        ({"tick_labels": True}, TypeError, "tick_labels must be a dict"),
        ({"tick_labels": {"head": "text"}}, ValueError, "tick_labels maps 'head' to 'text'"),
        ({"labels": ("off",)}, ValueError, "labels must name the 2 states"),
        ({"tooltip": np.array([1, 2])}, TypeError, "tooltip must be True or False"),
    ],
)
def test_bad_options_are_refused_by_name(options, error, message):
    with pytest.raises(error, match=message):
        heatmap(signed().round(), **{"x": "head", "y": "layer", **options})


def test_titles_come_from_attrs_or_the_title_option():
    da = signed()
    assert heatmap(da, x="head", y="layer", title="Heads").to_dict()["title"]["text"] == "Heads"
    bare = xr.DataArray(np.ones((2, 2)), dims=("layer", "head"), name="gate")
    spec = heatmap(bare, x="head", y="layer", binary=False).to_dict()
    assert spec["title"]["text"] == "gate" and spec["encoding"]["color"]["title"] == "gate"


def test_accessor_forwards_to_heatmap():
    da = signed()
    assert (
        da.lsc.heatmap(x="head", y="layer").to_dict() == heatmap(da, x="head", y="layer").to_dict()
    )


def test_export_writes_png_svg_and_self_contained_html(tmp_path):
    chart = heatmap(signed(), x="head", y="layer")
    assert export(chart, tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = export(chart, tmp_path / "h.svg").read_text()
    assert "<svg" in svg[:200] and f'font-family="{plot.SVG_FONT}"' in svg
    html = export(chart, tmp_path / "h.html").read_text()
    assert "vegaEmbed" in html and "cdn.jsdelivr" not in html and "<script src=" not in html
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.html"):
        export(chart, tmp_path / "h.pdf")


def test_enable_offline_switches_renderer_and_bundles_javascript():
    plot.enable_offline()
    assert alt.renderers.active == "jupyter"
    assert alt.JupyterChart._is_offline
    assert plot.SVG_ID_PREFIX in alt.JupyterChart._esm  # each chart widget's ids its own


def test_categories_draw_role_codes_with_named_colours():
    from lenscape import aggregate

    codes = schema.make(
        np.array([[0, 1], [2, 3]]),
        dims=("layer", "head"),
        attrs={
            "long_name": "Head role",
            "units": "role",
            "method": "m",
            "metric": "loss",
            "model": "tiny",
            "backend": "torch",
            "dtype": "float32",
        },
        n_layers=2,
    )
    spec = heatmap(
        codes, x="head", y="layer", categories=aggregate.ROLES, color=list(plot.ROLE_COLORS)
    ).to_dict()
    color = spec["encoding"]["color"]
    assert color["scale"]["domain"] == list(aggregate.ROLES)
    assert color["scale"]["range"] == list(plot.ROLE_COLORS)
    (values,) = spec["datasets"].values()
    states = [row["state"] for row in values]
    assert sorted(states) == sorted(aggregate.ROLES)


def test_infinities_are_marked_distinctly_and_the_spec_stays_json():
    da = signed()
    da[1, 2], da[3, 0], da[0, 1] = np.inf, -np.inf, np.nan
    chart = heatmap(da, x="head", y="layer")
    spec = chart.to_dict()
    json.dumps(spec, allow_nan=False)  # no Infinity / NaN tokens
    assert "Infinity" not in chart.to_json()
    cells = {(r["layer"], r["head"]): r for r in rows(spec)}
    assert cells[(1, 2)]["infinite"] == "+∞" and cells[(3, 0)]["infinite"] == "−∞"
    assert cells[(0, 1)]["infinite"] is None and cells[(0, 1)]["value"] is None
    cell_layer, dark, text = spec["layer"]
    assert dark["mark"]["color"] == plot.INF_COLOR and dark["transform"][0]["filter"]
    assert text["encoding"]["text"]["field"] == "infinite"
    finite = da.values[np.isfinite(da.values)]
    peak = float(np.abs(finite).max())
    assert cell_layer["encoding"]["color"]["scale"]["domain"] == pytest.approx([-peak, peak])
    assert spec["title"]["subtitle"][-1] == "grey: not computed · +∞ / −∞: infinite value"
    only_inf = signed()
    only_inf[0, 0] = np.inf
    lines = heatmap(only_inf, x="head", y="layer").to_dict()["title"]["subtitle"]
    assert lines[-1] == "+∞ / −∞: infinite value"  # "not computed" is for NaN only
    faceted = xr.concat([da, da], dim=pd.Index(["a", "b"], name="model"))
    json.dumps(heatmap(faceted, x="head", y="layer", facet_col="model").to_dict(), allow_nan=False)
    mask = _bool_units(np.eye(4, 3))
    mask[0, 0] = np.inf
    with pytest.raises(ValueError, match=r"\+-inf.*np.isfinite"):
        heatmap(mask, x="head", y="layer")


def test_long_legend_titles_wrap_whole_and_the_subtitle_says_them():
    da = signed().assign_attrs(
        long_name="change in logit difference (target - distractor)", units="logits"
    )
    spec = heatmap(da, x="head", y="layer", title="Heads").to_dict()
    legend = spec["encoding"]["color"]["title"]
    assert " ".join(legend) == "change in logit difference (target - distractor) (logits)"
    assert all(len(line) <= plot.LEGEND_CHARS for line in legend)
    assert spec["title"]["subtitle"][0] == (
        "colour: change in logit difference (target - distractor) (logits)"
    )
    assert spec["encoding"]["tooltip"][-1]["title"].startswith("change in logit difference")
    short = heatmap(signed(), x="head", y="layer").to_dict()
    assert short["encoding"]["color"]["title"] == "attribution (logit diff)"
    assert not short["title"]["subtitle"][0].startswith("colour:")


def test_charts_have_no_actions_menu_unless_asked():
    assert heatmap(signed(), x="head", y="layer").to_dict()["usermeta"] == {
        "embedOptions": {"actions": False}
    }
    spec = heatmap(signed(), x="head", y="layer", actions=True).to_dict()
    assert spec["usermeta"]["embedOptions"]["actions"] is True


def test_token_coords_become_tick_labels():
    pattern = xr.DataArray(
        np.tril(np.ones((3, 3))) / np.arange(1, 4)[:, None],
        dims=("query_pos", "key_pos"),
        coords={
            "query_pos": [0, 1, 2],
            "key_pos": [0, 1, 2],
            "query_token": ("query_pos", ["The", " cat", " sat"]),
            "key_token": ("key_pos", ["The", " cat", " sat"]),
        },
        attrs={"long_name": "attention", "units": "probability"},
    )
    enc = heatmap(pattern, x="key_pos", y="query_pos").to_dict()["encoding"]
    expr = enc["x"]["axis"]["labelExpr"]
    assert expr == '["The", " cat", " sat"][indexof([0, 1, 2], datum.value)]'
    assert enc["y"]["title"] == "query_pos (query_token)"
    relabelled = heatmap(
        pattern, x="key_pos", y="query_pos", tick_labels={"key_pos": "query_token"}
    ).to_dict()["encoding"]
    assert relabelled["x"]["title"] == "key_pos (query_token)"


def test_summary_is_a_few_lines_with_the_strongest_cells():
    values = np.zeros((2, 4, 3))
    values[:, 2, 1] = [5.0, 3.0]
    values[0, 0, 0] = np.nan
    da = make(values, ("prompt", "layer", "head"), n_layers=4)
    text = repr(da.lsc.summary(top=1))
    assert text.splitlines() == [
        "attribution (logit diff): prompt 2 × layer 4 × head 3",
        "method: attribution_patching · metric: logit_diff · model: tiny · backend: nnsight",
        "min 0 · mean 0.3478 · max 5",
        "1 cells not computed (NaN)",
        "strongest (mean over prompt): layer 2, head 1: 4",
    ]
    assert plot.summary(da)._repr_html_().startswith("<div")


def test_agreement_refuses_what_is_not_a_faithfulness_report():
    with pytest.raises(TypeError, match=r"report must be an xarray\.Dataset from lsc"):
        lsc.agreement(None)
    with pytest.raises(ValueError, match=r"report lacks the variable\(s\) \['exact_heads'"):
        lsc.agreement(xr.Dataset({"x": 1}))


def test_agreement_chart(tiny_llama, factual):
    pairs = factual[:4]
    report = lsc.faithfulness(tiny_llama, pairs, estimators=("atp",), progress=False)
    spec = lsc.agreement(report).to_dict()
    panels = spec["hconcat"]
    assert [p["title"]["text"] for p in panels] == ["heads", "attention blocks", "MLP blocks"]
    r_mlp = float(report["pearson_means"].sel(estimator="atp", component_type="mlp"))
    assert panels[2]["title"]["subtitle"] == f"r over prompt means: {r_mlp:.2f} (atp)"
    points = next(layer for layer in panels[0]["layer"] if layer["mark"]["type"] == "circle")
    assert len(points["data"]["values"]) == 12  # 3 layers x 4 heads, one estimator
    first = points["data"]["values"][0]
    assert first["exact"] == pytest.approx(float(report["exact_heads"].mean("prompt")[0, 0]))
    assert points["encoding"]["x"]["title"].startswith("exact patching effect")


def test_each_chart_widget_numbers_its_svg_definitions_apart():
    alt.JupyterChart.enable_offline()
    script = plot.unique_svg_ids(alt.JupyterChart._esm)
    assert script.startswith(f"const {plot.SVG_ID_PREFIX} = Math.random()")
    assert f'"gradient_"+{plot.SVG_ID_PREFIX}+' in script
    assert f'"clip"+{plot.SVG_ID_PREFIX}+' in script
    assert plot.unique_svg_ids(script) == script  # once only
    with pytest.raises(ValueError, match="differs from the tested one"):
        plot.unique_svg_ids("function render() {}")


def test_agreement_and_exported_html_carry_no_actions_menu(tmp_path, tiny_llama, factual):
    report = lsc.faithfulness(tiny_llama, factual[:2], estimators=("atp",), progress=False)
    assert lsc.agreement(report).to_dict()["usermeta"] == {"embedOptions": {"actions": False}}
    bare = alt.Chart(pd.DataFrame({"a": [1]})).mark_point().encode(x="a")  # no usermeta
    page = export(bare, tmp_path / "bare.html").read_text()
    assert '"actions": false' in page and '"actions": true' not in page
    asked = export(heatmap(signed(), x="head", y="layer", actions=True), tmp_path / "a.html")
    assert '"actions": true' in asked.read_text()


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
    spec = plot.logit_lens_chart(da).to_dict()
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
    cell = next(r for r in rows(spec) if r["layer"] == 2 and r["pos"] == 1)
    assert cell["value"] == pytest.approx(float(da.sel(layer=2, pos=1)))
    assert cell["target_rank"] == int(da["target_rank"].sel(layer=2, pos=1))
    assert spec["usermeta"] == {"embedOptions": {"actions": False}}
    with pytest.raises(ValueError, match=r"\(layer, pos\) DataArray.*select one prompt"):
        plot.logit_lens_chart(da.expand_dims(prompt=[0]))
    with pytest.raises(ValueError, match="needs the 'token' coord"):
        plot.logit_lens_chart(da.drop_vars("token"))


def test_bars_colour_the_prompts_the_model_gets_wrong():
    da = make([1.0, -2.0, 0.5], ("prompt",)).assign_coords(
        text=("prompt", ["a", "b", "c"]), correct=("prompt", [True, False, True])
    )
    spec = plot.bars(da, y="prompt").to_dict()
    answers = [r["answer"] for r in rows(spec)]
    assert answers == ["model right", "model wrong", "model right"]
    assert spec["encoding"]["color"]["scale"]["range"] == list(plot.ANSWER_COLORS.values())
    plain = plot.bars(da.drop_vars("correct"), y="prompt").to_dict()
    assert "color" not in plain["encoding"]


def test_the_depth_tooltip_says_what_depth_is():
    da = make(np.ones((4, 3)), ("layer", "head"), n_layers=4)
    tips = heatmap(da, x="head", y="layer").to_dict()["encoding"]["tooltip"]
    assert {t["field"]: t["title"] for t in tips}["depth"].startswith("depth (layer / (layers − 1)")


def test_agreement_chart_counts_not_computed_cells_and_stays_valid_json(tiny_llama, factual):
    """A NaN cell has no place on the axes: it is left out and counted, never written as NaN
    (invalid JSON) or silently dropped; an undefined r reads "undefined" (issue 24)."""
    report = lsc.faithfulness(tiny_llama, factual[:2], estimators=("atp",), progress=False)
    holed = report.copy()
    holed["exact_heads"] = report["exact_heads"].where(report["exact_heads"]["layer"] > 0)
    holed["pearson_means"] = report["pearson_means"].where(report["component_type"] != "head")
    spec = lsc.agreement(holed).to_dict()
    json.dumps(spec, allow_nan=False)
    heads = spec["hconcat"][0]
    points = next(layer for layer in heads["layer"] if layer["mark"]["type"] == "circle")
    n_heads = tiny_llama.spec.n_heads
    assert len(points["data"]["values"]) == (tiny_llama.spec.n_layers - 1) * n_heads
    assert heads["title"]["subtitle"] == (
        f"r over prompt means: undefined (atp); {n_heads} cells not computed (NaN), not drawn"
    )
