"""heatmap (views/heatmaps.py), checked through the Vega-Lite spec (``chart.to_dict()``)."""

import json

import altair as alt
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from _helpers import inline_rows, make_result, signed_scores

from lenscape import aggregate, schema
from lenscape.views import heatmaps
from lenscape.views.heatmaps import heatmap


def test_signed_scores_get_a_diverging_scale_centred_at_zero():
    spec = heatmap(signed_scores(), x="head", y="layer").to_dict()
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
    da = make_result(np.linspace(0.2, 0.9, 12).reshape(4, 3), ("layer", "head"))
    scale = heatmap(da, x="head", y="layer").to_dict()["encoding"]["color"]["scale"]
    assert scale["domain"] == pytest.approx([0.2, 0.9])
    assert scale["scheme"] == "viridis" and "domainMid" not in scale


def test_center_forces_a_diverging_scale_that_spans_only_the_data():
    da = make_result(np.linspace(0.11, 0.17, 12).reshape(4, 3), ("layer", "head"))
    scale = heatmap(da, x="head", y="layer", center=1 / 7).to_dict()["encoding"]["color"]["scale"]
    assert scale["domainMid"] == pytest.approx(1 / 7)
    assert scale["domain"] == pytest.approx([0.11, 0.17])
    change = make_result(np.linspace(0.001, 0.02, 12).reshape(4, 3), ("layer", "head"))
    scale = heatmap(change, x="head", y="layer", center=0.003).to_dict()["encoding"]["color"][
        "scale"
    ]
    assert scale["domain"][0] == pytest.approx(0.001)  # a relative change never goes negative


def _bool_units(values):
    return make_result(values, ("layer", "head")).assign_attrs(units="bool")


@pytest.mark.parametrize(
    "build",
    [
        lambda: make_result(np.eye(4, 3, dtype=bool), ("layer", "head")),
        lambda: _bool_units(np.eye(4, 3)),
    ],
    ids=["bool dtype", "float with units bool"],
)
def test_binary_masks_get_two_named_colours(build):
    spec = heatmap(build(), x="head", y="layer").to_dict()
    color = spec["encoding"]["color"]
    assert color["type"] == "nominal" and color["field"] == "state"
    assert color["scale"]["domain"] == ["kept", "skipped"]
    assert color["scale"]["range"] == [heatmaps.BINARY_COLORS[1], heatmaps.BINARY_COLORS[0]]
    states = {(r["layer"], r["head"]): r["state"] for r in inline_rows(spec)}
    assert states[(0, 0)] == "kept" and states[(0, 1)] == "skipped"


def test_mask_look_follows_the_dtype_never_the_values():
    zero_one = make_result(np.eye(4, 3), ("layer", "head")).assign_attrs(units="relative (0-1)")
    color = heatmap(zero_one, x="head", y="layer").to_dict()["encoding"]["color"]
    assert color["type"] == "quantitative" and color["scale"]["scheme"] == "viridis"
    assert color["title"] == ["attribution (relative", "(0-1))"]  # wrapped, never cut


def test_binary_can_be_forced_refused_and_relabelled():
    da = make_result(np.eye(4, 3) * 2, ("layer", "head"))
    assert heatmap(da, x="head", y="layer").to_dict()["encoding"]["color"]["type"] == "quantitative"
    spec = heatmap(da, x="head", y="layer", binary=True, labels=("off", "on")).to_dict()
    assert spec["encoding"]["color"]["scale"]["domain"] == ["on", "off"]
    mask = _bool_units(np.eye(4, 3))
    color = heatmap(mask, x="head", y="layer", binary=False).to_dict()["encoding"]["color"]
    assert color["type"] == "quantitative"


def test_color_option_sets_scheme_or_range():
    scale = heatmap(signed_scores(), x="head", y="layer", color="blueorange").to_dict()
    assert scale["encoding"]["color"]["scale"]["scheme"] == "blueorange"
    mask = make_result(np.eye(4, 3, dtype=bool), ("layer", "head"))
    scale = heatmap(mask, x="head", y="layer", color=["white", "black"]).to_dict()
    assert scale["encoding"]["color"]["scale"]["range"] == ["black", "white"]


def test_facets_share_one_colour_domain():
    a, b = signed_scores(seed=1), signed_scores(seed=2) * 3
    da = xr.concat([a, b], dim=pd.Index(["small", "large"], name="model"))
    da = da.expand_dims(component=["attn", "mlp"], axis=-1).transpose(
        "model", "layer", "head", "component"
    )
    spec = heatmap(da.isel(head=0), x="component", y="layer", facet_col="model").to_dict()
    assert spec["facet"]["field"] == "model" and spec["columns"] == heatmaps.FACET_COLUMNS
    assert spec["facet"]["sort"] == ["large", "small"]  # label order, not the array's
    assert spec["facet"]["header"]["title"] is None  # headers read "small", not "model = small"
    assert spec["facet"]["header"]["labelExpr"] == "datum.value"
    assert spec["spec"]["encoding"]["x"]["sort"] == ["attn", "mlp"]  # vocabulary order
    peak = float(abs(da.isel(head=0)).max())
    assert spec["spec"]["encoding"]["color"]["scale"]["domain"] == pytest.approx([-peak, peak])
    grid = heatmap(da, x="head", y="layer", facet_col="model", facet_row="component").to_dict()
    assert grid["facet"]["row"]["field"] == "component"
    assert grid["facet"]["column"]["header"]["title"] is None
    assert len(inline_rows(grid)) == da.size


def test_many_facets_wrap_into_rows_and_integer_headers_name_their_dim():
    values = np.random.default_rng(0).normal(size=(10, 4, 3))
    da = make_result(values, ("prompt", "layer", "head"), n_layers=4)
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
    a = make_result(np.arange(12.0).reshape(4, 3) - 5, ("layer", "head"), n_layers=4)
    b = make_result(np.arange(6.0).reshape(2, 3), ("layer", "head"), n_layers=2)
    return xr.concat([a, b], dim=pd.Index(["deep", "shallow"], name="model"), join="outer")


def test_depth_puts_models_of_different_depth_on_one_axis():
    da = _two_depths()
    assert da["depth"].dims == ("model", "layer")
    spec = heatmap(da, x="head", y="depth", facet_col="model").to_dict()
    enc = spec["spec"]["encoding"]
    assert enc["y"]["field"] == "depth_start" and enc["y"]["type"] == "quantitative"
    assert enc["y2"]["field"] == "depth_end"
    cells = inline_rows(spec)
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
    da = make_result(
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
    cell = inline_rows(spec)[0]
    assert cell["text"] == "The capital of France is" and cell["seed"] == 1
    assert (
        heatmap(signed_scores(), x="head", y="layer", tooltip=False)
        .to_dict()["encoding"]
        .get("tooltip")
        is None
    )


def test_nan_is_drawn_grey_never_as_zero():
    da = signed_scores()
    da[2, 1] = np.nan
    spec = heatmap(da, x="head", y="layer").to_dict()
    cell = next(r for r in inline_rows(spec) if (r["layer"], r["head"]) == (2, 1))
    assert cell["value"] is None
    assert spec["mark"]["invalid"] == "show"
    assert spec["config"]["scale"]["invalid"]["color"]["value"] == heatmaps.NAN_COLOR
    assert "grey: not computed" in spec["title"]["subtitle"]
    assert not any(
        "grey" in line
        for line in heatmap(signed_scores(), x="head", y="layer").to_dict()["title"]["subtitle"]
    )
    padded = heatmap(_two_depths(), x="head", y="depth", facet_col="model").to_dict()
    assert not any("grey" in line for line in padded["title"]["subtitle"])  # padding is not drawn
    mask = _bool_units(np.eye(4, 3))
    mask[3, 2] = np.nan
    color = heatmap(mask, x="head", y="layer").to_dict()["encoding"]["color"]
    assert color["scale"]["domain"] == ["kept", "skipped", "not computed"]
    assert color["scale"]["range"][-1] == heatmaps.NAN_COLOR


def test_grids_above_altairs_row_limit_work_without_lifting_it_globally(monkeypatch):
    values = np.random.default_rng(0).normal(size=(2, 16, 36, 32))
    da = make_result(values, ("model", "cluster", "layer", "head"), n_layers=36, model=["a", "b"])
    spec = heatmap(
        da.isel(cluster=slice(0, 8)), x="head", y="layer", facet_col="model", facet_row="cluster"
    ).to_dict()
    assert len(inline_rows(spec)) == 2 * 8 * 36 * 32 > 5000
    with pytest.raises(alt.MaxRowsError):  # Altair's own guard is untouched
        alt.Chart(pd.DataFrame({"a": range(6000)})).mark_point().to_dict()
    monkeypatch.setattr(heatmaps, "MAX_CELLS", 1000)
    with pytest.raises(ValueError, match="MAX_CELLS=1000"):
        heatmap(da.isel(cluster=0), x="head", y="layer", facet_col="model")


def test_errors_name_the_dims_and_how_to_reduce():
    da = make_result(np.zeros((5, 4, 3)), ("prompt", "layer", "head"))
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
        heatmap(signed_scores().round(), **{"x": "head", "y": "layer", **options})


def test_titles_come_from_attrs_or_the_title_option():
    da = signed_scores()
    assert heatmap(da, x="head", y="layer", title="Heads").to_dict()["title"]["text"] == "Heads"
    bare = xr.DataArray(np.ones((2, 2)), dims=("layer", "head"), name="gate")
    spec = heatmap(bare, x="head", y="layer", binary=False).to_dict()
    assert spec["title"]["text"] == "gate" and spec["encoding"]["color"]["title"] == "gate"


def test_accessor_forwards_to_heatmap():
    da = signed_scores()
    assert (
        da.lsc.heatmap(x="head", y="layer").to_dict() == heatmap(da, x="head", y="layer").to_dict()
    )


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
        codes, x="head", y="layer", categories=aggregate.ROLES, color=list(heatmaps.ROLE_COLORS)
    ).to_dict()
    color = spec["encoding"]["color"]
    assert color["scale"]["domain"] == list(aggregate.ROLES)
    assert color["scale"]["range"] == list(heatmaps.ROLE_COLORS)
    (values,) = spec["datasets"].values()
    states = [row["state"] for row in values]
    assert sorted(states) == sorted(aggregate.ROLES)


def test_infinities_are_marked_distinctly_and_the_spec_stays_json():
    da = signed_scores()
    da[1, 2], da[3, 0], da[0, 1] = np.inf, -np.inf, np.nan
    chart = heatmap(da, x="head", y="layer")
    spec = chart.to_dict()
    json.dumps(spec, allow_nan=False)  # no Infinity / NaN tokens
    assert "Infinity" not in chart.to_json()
    cells = {(r["layer"], r["head"]): r for r in inline_rows(spec)}
    assert cells[(1, 2)]["infinite"] == "+∞" and cells[(3, 0)]["infinite"] == "−∞"
    assert cells[(0, 1)]["infinite"] is None and cells[(0, 1)]["value"] is None
    cell_layer, dark, text = spec["layer"]
    assert dark["mark"]["color"] == heatmaps.INF_COLOR and dark["transform"][0]["filter"]
    assert text["encoding"]["text"]["field"] == "infinite"
    finite = da.values[np.isfinite(da.values)]
    peak = float(np.abs(finite).max())
    assert cell_layer["encoding"]["color"]["scale"]["domain"] == pytest.approx([-peak, peak])
    assert spec["title"]["subtitle"][-1] == "grey: not computed · +∞ / −∞: infinite value"
    only_inf = signed_scores()
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
    da = signed_scores().assign_attrs(
        long_name="change in logit difference (target - distractor)", units="logits"
    )
    spec = heatmap(da, x="head", y="layer", title="Heads").to_dict()
    legend = spec["encoding"]["color"]["title"]
    assert " ".join(legend) == "change in logit difference (target - distractor) (logits)"
    assert all(len(line) <= heatmaps.LEGEND_LINE for line in legend)
    assert legend[-1] == "(logits)"  # the units on a line of their own
    assert spec["title"]["subtitle"][0] == (
        "colour: change in logit difference (target - distractor) (logits)"
    )
    assert spec["encoding"]["tooltip"][-1]["title"].startswith("change in logit difference")
    short = heatmap(signed_scores(), x="head", y="layer").to_dict()
    assert short["encoding"]["color"]["title"] == "attribution (logit diff)"
    assert not short["title"]["subtitle"][0].startswith("colour:")


def test_charts_have_no_actions_menu_unless_asked():
    assert heatmap(signed_scores(), x="head", y="layer").to_dict()["usermeta"] == {
        "embedOptions": {"actions": False}
    }
    spec = heatmap(signed_scores(), x="head", y="layer", actions=True).to_dict()
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


def test_the_depth_tooltip_says_what_depth_is():
    da = make_result(np.ones((4, 3)), ("layer", "head"), n_layers=4)
    tips = heatmap(da, x="head", y="layer").to_dict()["encoding"]["tooltip"]
    assert {t["field"]: t["title"] for t in tips}["depth"].startswith("depth (layer / (layers − 1)")


def test_a_heatmap_reads_its_array_by_label():
    """Axes and facets run in label order (numbers ascending, components in the schema's
    vocabulary order), so a sortby, isel or transpose draws the same picture."""
    values = np.random.default_rng(3).normal(size=(2, 4, 3))
    da = make_result(values, ("model", "layer", "head"), n_layers=4, model=["b-9m", "b-10m"])
    da = da.expand_dims(component=list(schema.WEIGHT_COMPONENTS[:3]), axis=-1)
    plain = heatmap(da.isel(head=0), x="component", y="layer", facet_col="model").to_dict()
    moved = da.isel(head=0).sortby("layer", ascending=False).isel(component=[2, 0, 1])
    moved = moved.transpose("component", "layer", "model")
    assert heatmap(moved, x="component", y="layer", facet_col="model").to_dict() == plain
    assert plain["facet"]["sort"] == ["b-9m", "b-10m"]  # digits compare as numbers
    assert plain["spec"]["encoding"]["x"]["sort"] == ["q_proj", "k_proj", "v_proj"]
    assert plain["spec"]["encoding"]["y"]["sort"] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"da's 'layer' labels repeat \(\[1\]\).*drop_duplicates"):
        heatmap(signed_scores().assign_coords(layer=[0, 1, 1, 2]), x="head", y="layer")


def test_an_all_nan_heatmap_says_so_and_stays_valid_json():
    def refuse(name):
        raise AssertionError(f"{name} in a chart spec")

    da = make_result(np.full((2, 3), np.nan), ("layer", "head"))
    chart = heatmap(da, x="head", y="layer")
    spec = json.loads(chart.to_json(), parse_constant=refuse)
    assert "grey: not computed (every cell)" in spec["title"]["subtitle"]
    partly = heatmap(da.where(da["head"] > 0, 1.0), x="head", y="layer").to_dict()
    assert "grey: not computed" in partly["title"]["subtitle"]


def interval_result(n_prompts=30):
    """``aggregate.mean`` of (prompt, layer 3, head 4): head 0 strong in every prompt, head 1
    flips sign, layer 2 head 3 never computed, layer 2 head 2 computed for one prompt."""
    rng = np.random.default_rng(0)
    values = rng.normal(0, 0.3, size=(n_prompts, 3, 4))
    values[:, :, 0] += 2.0
    values[:, :, 1] = rng.choice([-1.0, 1.0], size=(n_prompts, 3))
    values[:, 2, 3] = np.nan
    values[1:, 2, 2] = np.nan
    per_prompt = make_result(values, ("prompt", "layer", "head"), n_layers=3)
    return aggregate.mean(per_prompt, n_resamples=200)


def _layer(spec, mark):
    return next(layer for layer in spec["layer"] if layer["mark"]["type"] == mark)


def test_an_interval_is_drawn_as_its_mean_with_unsure_cells_hatched():
    da = interval_result()
    spec = heatmap(da, x="head", y="layer").to_dict()
    json.loads(json.dumps(spec), parse_constant=pytest.fail)
    json.dumps(spec, allow_nan=False)
    cells = _layer(spec, "rect")
    rows = inline_rows(spec)
    assert len(rows) == 12  # the mean's cells, not one per bound
    cell = next(r for r in rows if r["layer"] == 1 and r["head"] == 0)
    mean = da.sel(layer=1, head=0)
    assert cell["value"] == pytest.approx(float(mean.sel(bound="mean")))
    assert cell["low"] == pytest.approx(float(mean.sel(bound="low"))) and cell["n"] == 30
    unsure = {(r["layer"], r["head"]) for r in rows if r["unsure"]}
    low, high = da.sel(bound="low"), da.sel(bound="high")
    expected = {
        (int(la), int(h))
        for la in da["layer"]
        for h in da["head"]
        if low.sel(layer=la, head=h) <= 0 <= high.sel(layer=la, head=h)
    }
    assert unsure == expected and {(0, 1), (1, 1), (2, 1)} <= unsure
    assert (0, 0) not in unsure and (2, 2) not in unsure  # no interval: not hatched
    hatch = _layer(spec, "point")
    assert hatch["mark"]["shape"] == heatmaps.HATCH and hatch["transform"] == [
        {"filter": "datum.unsure != null"}
    ]
    assert hatch["encoding"]["shape"]["scale"] == {
        "domain": ["95% interval includes 0"],
        "range": [heatmaps.HATCH],
    }
    tips = [(t["field"], t["title"]) for t in cells["encoding"]["tooltip"]]
    assert [f for f, _ in tips][-4:] == ["value", "low", "high", "n"]
    assert tips[-3:] == [
        ("low", "95% interval: low"),
        ("high", "95% interval: high"),
        ("n", "N (prompts computed)"),
    ]
    title = spec["title"]
    assert title["text"] == "attribution: mean over 30 prompts, 95% interval"
    assert title["subtitle"][-2].startswith(
        f"hatched: 95% interval includes 0, the sign is not sure ({len(expected)} of 12 cells); "
        "percentile bootstrap over prompts, 200 resamples"
    )
    assert title["subtitle"][-1] == (
        "2 cells computed for fewer than 2 prompts have no interval (NaN)"
    )


def test_a_mean_of_estimates_hatches_where_interval_or_error_could_flip_the_sign():
    """A pooled mean of fast estimates (``aggregate.mean`` of an ``error=True`` result: a
    ``bound`` dim and an ``error`` coord) hatches the cells whose interval, widened on each
    side by the error estimate, includes 0; the legend and tooltips say so."""
    da = interval_result()
    errors = np.zeros((3, 4))
    errors[1, 0] = 1e3  # an interval clear of 0, an error that could flip the sign
    da = da.assign_coords(error=(("layer", "head"), errors, {"method": "trapezoid: test"}))
    rows = inline_rows(heatmap(da, x="head", y="layer").to_dict())
    plain = inline_rows(heatmap(da.drop_vars("error"), x="head", y="layer").to_dict())
    unsure = {(r["layer"], r["head"]) for r in rows if r["unsure"]}
    before = {(r["layer"], r["head"]) for r in plain if r["unsure"]}
    assert (1, 0) not in before and unsure == before | {(1, 0)}
    cell = next(r for r in rows if r["layer"] == 1 and r["head"] == 0)
    assert cell["low"] == pytest.approx(float(da.sel(layer=1, head=0, bound="low")) - 1e3)
    spec = heatmap(da, x="head", y="layer").to_dict()
    assert _layer(spec, "point")["encoding"]["shape"]["scale"]["domain"] == [
        "95% interval widened by the error estimate includes 0"
    ]
    moved = da.sortby("head", ascending=False).transpose("head", "bound", "layer")
    assert heatmap(moved, x="head", y="layer").to_dict() == spec


def test_an_interval_reads_by_label_and_its_bound_dim_can_be_a_facet():
    da = interval_result()
    moved = da.sortby("head", ascending=False).transpose("bound", "head", "layer")
    assert (
        heatmap(moved, x="head", y="layer").to_dict() == heatmap(da, x="head", y="layer").to_dict()
    )
    panels = heatmap(da, x="head", y="layer", facet_col="bound").to_dict()
    assert panels["facet"]["field"] == "bound" and "unsure" not in inline_rows(panels)[0]
    assert panels["facet"]["sort"] == ["mean", "low", "high"]
    with pytest.raises(ValueError, match=r"'bound' dim with labels \['a', 'b', 'c'\]"):
        heatmap(da.assign_coords(bound=["a", "b", "c"]), x="head", y="layer")
    per_prompt = make_result(np.zeros((2, 3, 4)), ("prompt", "layer", "head"))
    with pytest.raises(ValueError, match=r"da\.lsc\.mean\('prompt'\) gives the mean with its 95%"):
        heatmap(per_prompt, x="head", y="layer")


def test_an_interval_on_a_depth_axis_hatches_each_cell_at_its_middle():
    da = interval_result()
    spec = heatmap(da, x="head", y="depth").to_dict()
    hatch = _layer(spec, "point")
    assert hatch["encoding"]["y"]["field"] == "depth_mid"
    row = next(r for r in inline_rows(spec) if r["layer"] == 1)
    assert row["depth_mid"] == pytest.approx((row["depth_start"] + row["depth_end"]) / 2)


def test_an_estimate_with_its_error_hatches_the_cells_whose_error_could_flip_the_sign():
    """Issue 44, item 5: an ``error`` coord (``attribution_patching(error=True)``) hatches
    exactly the cells with error >= |estimate|, shows the error in the tooltips, says how
    many in the subtitle, and reads by label."""
    values = np.array([[2.0, -0.1, 0.5, 0.0], [-1.0, 0.3, 0.05, 1.5], [0.2, -0.2, 1.0, 0.7]])
    errors = np.array([[0.1, 0.5, 0.6, 0.0], [0.2, 0.1, 0.01, 2.0], [0.0, 0.3, 0.1, 0.1]])
    da = make_result(values, ("layer", "head"), n_layers=3)
    da = da.assign_coords(error=(("layer", "head"), errors, {"method": "trapezoid: test"}))
    spec = heatmap(da, x="head", y="layer").to_dict()
    rows = inline_rows(spec)
    unsure = {(r["layer"], r["head"]) for r in rows if r["unsure"]}
    expected = {(la, h) for la in range(3) for h in range(4) if errors[la, h] >= abs(values[la, h])}
    assert unsure == expected == {(0, 1), (0, 2), (0, 3), (1, 3), (2, 1)}
    cell = next(r for r in rows if r["layer"] == 1 and r["head"] == 3)
    assert cell["error"] == pytest.approx(2.0) and cell["low"] == pytest.approx(-0.5)
    assert _layer(spec, "point")["encoding"]["shape"]["scale"]["domain"] == [
        "error estimate >= |estimate|"
    ]
    said = " ".join(spec["title"]["subtitle"])  # a long line wraps between words
    assert (
        "hatched: error estimate >= |estimate|, the sign is not sure (5 of 12 cells); error "
        "estimate: trapezoid (its formula: the error coord's attrs)"
    ) in said
    moved = da.sortby("head", ascending=False).transpose("head", "layer")
    assert heatmap(moved, x="head", y="layer").to_dict() == spec
    plain = heatmap(da.drop_vars("error"), x="head", y="layer").to_dict()
    assert "unsure" not in inline_rows(plain)[0]
    with pytest.raises(ValueError, match=r"'error' coord is negative somewhere"):
        heatmap(da.assign_coords(error=-da["error"]), x="head", y="layer")


def test_heavy_tailed_scores_take_a_symmetric_log_scale_with_true_values_in_the_legend():
    """One cell 500 times the rest: ``scale="auto"`` draws it symmetric-log (the legend at
    its powers of ten, in true values; the subtitle says so); scores of one size stay linear;
    ``scale="linear"`` is one option away and an unknown scale is refused by name."""
    values = np.random.default_rng(3).uniform(0.5, 1.0, size=(4, 3)) * np.where(
        np.arange(12).reshape(4, 3) % 2, 1, -1
    )
    values[2, 1] = 500.0
    da = make_result(values, ("layer", "head"))
    spec = heatmap(da, x="head", y="layer").to_dict()
    colour = spec["encoding"]["color"]
    assert colour["scale"]["type"] == "symlog"
    assert colour["scale"]["constant"] == pytest.approx(0.5)  # SYMLOG_SHARE of 500
    assert colour["scale"]["domain"] == [-500.0, 500.0] and colour["scale"]["domainMid"] == 0
    # the powers of ten from the linear part up; 1 would sit 16% of the way from 0 to 500,
    # its label on 0's (encoding.TICK_GAP), so it is left out
    ticks = [10.0, 100.0]
    assert colour["legend"]["values"] == [-t for t in ticks[::-1]] + [0.0] + ticks
    assert any(
        line.startswith("colour: symmetric log up to ±500") for line in spec["title"]["subtitle"]
    )
    linear = heatmap(da, x="head", y="layer", scale="linear").to_dict()
    assert "type" not in linear["encoding"]["color"]["scale"]
    assert not any("symmetric log" in line for line in linear["title"].get("subtitle", []))
    plain = heatmap(signed_scores(), x="head", y="layer").to_dict()["encoding"]["color"]
    assert "type" not in plain["scale"] and "legend" not in plain
    forced = heatmap(signed_scores(), x="head", y="layer", scale="symlog").to_dict()
    assert forced["encoding"]["color"]["scale"]["type"] == "symlog"
    unsigned = make_result(np.abs(values), ("layer", "head"))
    seq = heatmap(unsigned, x="head", y="layer").to_dict()["encoding"]["color"]
    assert seq["scale"]["type"] == "symlog" and seq["scale"]["scheme"] == "viridis"
    assert min(seq["legend"]["values"]) >= seq["scale"]["domain"][0]  # no tick outside it
    with pytest.raises(ValueError, match=r"Unknown scale 'log10'; choose one of \['auto'"):
        heatmap(da, x="head", y="layer", scale="log10")


def test_a_mask_ignores_the_scale():
    mask = make_result(np.eye(4, 3, dtype=bool), ("layer", "head"))
    colour = heatmap(mask, x="head", y="layer", scale="symlog").to_dict()["encoding"]["color"]
    assert colour["type"] == "nominal" and "type" not in colour["scale"]


def test_one_layer_orientation_layer_0_at_the_top_in_heatmaps_and_the_circuit_graph():
    """Every view draws layer 0 at the top: a heatmap's y axis lists layers ascending from
    the top (Vega-Lite's band order), the circuit graph's y scale is reversed (y = layer
    grows downwards) with the embeddings above L0 and the logits below the last layer."""
    from lenscape.capture.edges.graph import Graph
    from lenscape.views.circuit import circuit_graph

    y = heatmap(signed_scores(), x="head", y="layer").to_dict()["encoding"]["y"]
    assert y["sort"] == [0, 1, 2, 3] and "scale" not in y  # first label at the top
    shuffled = heatmap(signed_scores().isel(layer=[3, 1, 0, 2]), x="head", y="layer")
    assert shuffled.to_dict()["encoding"]["y"]["sort"] == [0, 1, 2, 3]
    graph = Graph(2, 4, 2)
    edges = xr.DataArray(
        np.where(graph.valid, 1.0, np.nan), dims=("sender", "receiver"), coords=graph.coords()
    )
    spec = circuit_graph(edges, edges=5).to_dict()
    points = next(layer for layer in spec["layer"] if layer["mark"]["type"] == "point")
    assert points["encoding"]["y"]["scale"]["reverse"] is True
    rows = {row["node"]: row["y"] for row in points["data"]["values"]}
    assert rows["embeddings"] < rows["L0.H0"] < rows["L1.H0"] < rows["logits"]
