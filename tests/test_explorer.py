"""Explorer: the pure View -> (array, chart) core, and controls redrawing one chart in place."""

import altair as alt
import ipywidgets as widgets
import numpy as np
import pytest
import xarray as xr
from _helpers import ATTRS, inline_rows

from lenscape import aggregate, schema
from lenscape.views.explorer import Explorer, View, reduce, render, shared_domain
from lenscape.views.heatmaps import heatmap
from lenscape.views.offline import export


@pytest.fixture
def scores():
    """(model 2, cluster 3, layer 5, head 4), signed."""
    values = np.random.default_rng(0).normal(size=(2, 3, 5, 4))
    return schema.make(
        values,
        dims=("model", "cluster", "layer", "head"),
        attrs=ATTRS,
        coords={"model": ["small", "large"]},
        n_layers=5,
    )


def spec(explorer):
    return explorer.chart.to_dict()


def test_render_selects_and_reduces(scores):
    view = View(x="head", y="layer", pick={"model": "large", "cluster": "max"})
    array, chart = render(scores, view)
    assert array.dims == ("layer", "head")
    xr.testing.assert_allclose(array, scores.sel(model="large").max("cluster"))
    assert array.attrs["reduction"] == "model = large, max over 3 clusters"
    assert chart.to_dict()["title"]["text"] == "attribution · model = large, max over 3 clusters"


def test_threshold_binarizes_before_reducing_like_always_and_any():
    gates = np.array([[0.9, 0.9, 0.1], [0.9, 0.2, 0.1], [0.9, 0.8, np.nan]])  # (seed, head)
    da = schema.make(gates[:, None, :], dims=("seed", "layer", "head"), attrs=ATTRS)
    always = reduce(da, View(x="head", y="layer", pick={"seed": "all"}, threshold=0.5))
    anywhere = reduce(da, View(x="head", y="layer", pick={"seed": "any"}, threshold=0.5))
    assert always.values.tolist() == [[1.0, 0.0, 0.0]]
    assert anywhere.values.tolist() == [[1.0, 1.0, 0.0]]
    assert always.attrs["units"] == "bool" and always.attrs["long_name"] == "attribution >= 0.5"
    nothing = da.where(da["head"] != 2)  # head 2 never computed: stays NaN, never 0
    for how, threshold in [
        ("mean", None),
        ("max", None),
        ("any", 0.5),
        ("all", 0.5),
        ("share", 0.5),
    ]:
        out = reduce(nothing, View(x="head", y="layer", pick={"seed": how}, threshold=threshold))
        assert np.isnan(out.values[0, 2]) and not np.isnan(out.values[0, 0])


def test_controls_cover_every_other_dim(scores):
    e = Explorer(scores)
    assert set(e.controls) == {
        *("model", "cluster", "facet", "binarize", "side", "threshold", "swap", "scale")
    }
    # Each opens on its first label in label order ("large" < "small"), not the array's first.
    assert e.controls["model"].value == "large" and e.controls["cluster"].value == 0
    assert [v for _, v in e.controls["model"].options] == ["large", "small"]
    assert e.array.dims == ("layer", "head")
    enc = spec(e)["encoding"]
    assert (enc["x"]["field"], enc["y"]["field"]) == ("head", "layer")


def test_each_control_changes_the_spec(scores):
    e = Explorer(scores)
    c = e.controls
    c["cluster"].value = "mean"
    assert "mean over 3 clusters" in spec(e)["title"]["text"]
    c["cluster"].value = 2
    assert "cluster = 2" in spec(e)["title"]["text"]
    got = {(r["layer"], r["head"]): r["value"] for r in inline_rows(spec(e))}
    assert got[(1, 3)] == pytest.approx(float(scores.sel(model="large", cluster=2)[1, 3]))
    c["model"].value = "small"
    assert "model = small" in spec(e)["title"]["text"]
    c["swap"].value = True
    enc = spec(e)["encoding"]
    assert (enc["x"]["field"], enc["y"]["field"]) == ("layer", "head")
    c["facet"].value = "model"
    assert spec(e)["facet"]["field"] == "model"
    assert c["model"].disabled and not c["cluster"].disabled
    assert e.array.dims == ("model", "layer", "head")
    c["binarize"].value = True
    color = spec(e)["spec"]["encoding"]["color"]
    t = f"{c['threshold'].value:g}"
    assert color["type"] == "nominal"  # signed scores binarize on |value| by default
    assert color["scale"]["domain"] == [f"|value| >= {t}", f"|value| < {t}"]
    c["threshold"].value = 0.25
    c["side"].value = "above"
    assert spec(e)["spec"]["encoding"]["color"]["scale"]["domain"] == [">= 0.25", "< 0.25"]
    c["binarize"].value = False
    assert spec(e)["spec"]["encoding"]["color"]["type"] == "quantitative"


def test_dataset_variable_selector_updates_chart_and_threshold_range(scores):
    ds = xr.Dataset({"attr": scores, "gate": (scores * 0 + 7).assign_attrs(long_name="gate")})
    ds["gate"][0, 0, 0, 0] = 9.0
    e = Explorer(ds, variable="attr")
    assert spec(e)["title"]["text"].startswith("attribution")
    e.controls["binarize"].value = True
    before = e.controls["threshold"].value
    e.controls["variable"].value = "gate"
    assert spec(e)["title"]["text"].startswith("|gate| >= ")
    assert e.controls["threshold"].value == before  # never moved behind the user's back
    assert "data 7 to 9" in e._data_range.value
    assert "at or below every |value| (min 7)" in e._message.value  # visible, not clamped


def test_one_chart_widget_is_updated_in_place_and_displayed_once(scores, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: shown.append(a))
    e = Explorer(scores)
    e._ipython_display_()
    charts = [w for w in _walk(e.widget) if isinstance(w, alt.JupyterChart)]
    assert len(charts) == 1 and not any(isinstance(w, widgets.Output) for w in _walk(e.widget))
    before = charts[0].spec
    for name, value in [
        ("cluster", 1),
        ("model", "large"),
        ("swap", True),
        ("facet", "cluster"),
        ("binarize", True),
        ("cluster", "share"),
    ]:
        e.controls[name].value = value
    assert [w for w in _walk(e.widget) if isinstance(w, alt.JupyterChart)] == charts
    assert charts[0].spec != before and charts[0].chart is e.chart
    ((data,),) = shown  # the widget, with a PNG of its chart for where it cannot be drawn
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == e.widget.model_id
    assert data["image/png"]
    bundle = e._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == e.widget.model_id


def _walk(w):
    yield w
    for child in getattr(w, "children", ()):
        yield from _walk(child)


def test_errors_are_shown_not_raised_and_keep_the_last_chart(scores):
    broken = (scores * np.inf).fillna(0).assign_attrs(long_name="broken", units="bool")
    ds = xr.Dataset({"attr": scores, "broken": broken})  # a mask cannot show infinities
    e = Explorer(ds)
    before = e.chart
    e.controls["variable"].value = "broken"
    assert e.chart is before and "cells are +-inf" in e._message.value
    e.controls["variable"].value = "attr"
    assert e._message.value == "" and e.chart is not before


def test_a_dataset_whose_variables_have_different_dims_is_refused_up_front(scores):
    """Issue 43: one set of controls serves every variable, so variables of other dims are
    refused naming each with its dims and the fix, before any control is built."""
    ds = xr.Dataset(
        {"attr": scores, "gate": scores * 2, "per_layer": scores.mean("head"), "loss": 1.0}
    )
    message = (
        r"data's variables have different dims \(attr, gate \('model', 'cluster', 'layer', "
        r"'head'\); per_layer \('model', 'cluster', 'layer'\); loss \(\)\).*pass the "
        r"variables that share dims, e\.g\. data\[\['attr', 'gate'\]\]"
    )
    with pytest.raises(ValueError, match=message):
        Explorer(ds)
    assert Explorer(ds[["attr", "gate"]]).controls["variable"].options == ("attr", "gate")


def test_bad_axes_and_facets_are_refused(scores):
    with pytest.raises(ValueError, match="x='pos'"):
        Explorer(scores, x="pos")
    with pytest.raises(ValueError, match="facet='layer'"):
        Explorer(scores, facet="layer")


def test_explore_accessor_and_export_of_an_explorer(scores, tmp_path):
    e = scores.lsc.explore(x="head", y="depth", facet="model")
    assert spec(e)["spec"]["encoding"]["y"]["field"] == "depth_start"
    assert export(e, tmp_path / "e.svg").read_text().lstrip().startswith("<svg")


PROMPTS = [
    "The capital of France is the city of",
    "In Spain, most people speak",
    "The Colosseum is located in the city of",
]


def per_prompt(values, **attrs):
    """(prompt 3, layer 2, head 2) with prompt texts."""
    return schema.make(
        np.asarray(values),
        dims=("prompt", "layer", "head"),
        coords={"text": PROMPTS},
        attrs={**ATTRS, **attrs},
        n_layers=2,
    )


SIGNED = np.random.default_rng(1).normal(size=(3, 2, 2))
ZERO_ONE = (SIGNED > 0).astype(float)


@pytest.mark.parametrize(
    "data, view, title, legend, kind, domain",
    [
        (
            per_prompt(SIGNED),
            View("head", "layer", {"prompt": "mean"}),
            "attribution · mean over 3 prompts",
            "attribution (logit diff)",
            "quantitative",
            None,
        ),
        (
            per_prompt(SIGNED),
            View("head", "layer", {"prompt": "any"}, threshold=0.5),
            "attribution >= 0.5 · 33% of values pass, any over 3 prompts",
            "attribution >= 0.5",
            "nominal",
            [">= 0.5", "< 0.5"],
        ),
        (
            per_prompt(SIGNED),
            View("head", "layer", {"prompt": "share"}, threshold=0.5),
            "share of 3 prompts with attribution >= 0.5 · 33% of values pass",
            ["share of 3 prompts with", "attribution >= 0.5", "(share of prompts)"],
            "quantitative",
            None,
        ),
        (
            per_prompt(SIGNED > 0).assign_attrs(long_name="kept", units="bool"),
            View("head", "layer", {"prompt": "all"}),
            "kept · all over 3 prompts",
            "kept",
            "nominal",
            ["kept", "skipped"],
        ),
        (
            per_prompt(SIGNED > 0).assign_attrs(long_name="kept", units="bool"),
            View("head", "layer", {"prompt": "share"}),
            "share of 3 prompts where kept",
            ["share of 3 prompts where kept", "(share of prompts)"],  # units on a line of their own
            "quantitative",
            None,
        ),
        (
            per_prompt(ZERO_ONE, units="relative"),
            View("head", "layer", {"prompt": 0}),
            "attribution · prompt 0: The capital of France is the city of",
            "attribution (relative)",
            "quantitative",
            None,
        ),
    ],
    ids=[
        "scores mean",
        "binarize any",
        "binarize share",
        "mask all",
        "mask share",
        "0-1 floats stay scores",
    ],
)
def test_each_combination_is_labelled_for_what_it_is(data, view, title, legend, kind, domain):
    array, chart = render(data, view)
    enc = chart.to_dict()["encoding"]
    assert chart.to_dict()["title"]["text"] == title
    assert enc["color"]["title"] == legend and enc["color"]["type"] == kind
    if domain:
        assert enc["color"]["scale"]["domain"] == domain
    else:
        assert enc["color"]["scale"]["scheme"] in ("viridis", {"name": "redblue", "extent": [1, 0]})
    if "share" in title:
        assert enc["color"]["scale"]["scheme"] == "viridis"  # a share is never "kept/skipped"
        assert array.min() >= 0 and array.max() <= 1


def test_reducers_that_do_not_fit_the_data_are_refused_with_the_fix():
    scores = per_prompt(SIGNED)
    with pytest.raises(ValueError, match=r"'any' over prompt.*turn on binarize"):
        reduce(scores, View("head", "layer", {"prompt": "any"}))
    mask = per_prompt(SIGNED > 0).assign_attrs(units="bool")
    with pytest.raises(ValueError, match=r"'mean' over prompt.*share"):
        reduce(mask, View("head", "layer", {"prompt": "mean"}))
    with pytest.raises(ValueError, match="already a mask; turn binarize off"):
        reduce(mask, View("head", "layer", {"prompt": "any"}, threshold=0.5))


def test_a_threshold_outside_the_data_gets_a_visible_note():
    scores = per_prompt(SIGNED)
    array, chart = render(scores, View("head", "layer", {"prompt": "any"}, threshold=50))
    assert "threshold 50 is above every value" in array.attrs["note"]
    assert any("threshold 50" in line for line in chart.to_dict()["title"]["subtitle"])
    e = Explorer(scores, threshold=50)
    assert e.controls["threshold"].value == 50  # kept exactly, never clamped to the data
    assert "above every |value|" in e._message.value


def test_defaults_never_average_dims_that_must_not_be_averaged():
    values = np.random.default_rng(0).random((2, 3, 4, 2, 3)) > 0.5
    masks = xr.DataArray(
        values,
        dims=("target_sparsity", "prompt", "cluster", "layer", "component"),
        coords={
            "target_sparsity": [0.3, 0.5],
            "prompt": [0, 1, 2],
            "cluster": [0, 1, 2, 3],
            "layer": [0, 1],
            "component": ["attn", "mlp", "q_proj"],
        },
        attrs={"long_name": "Block kept", "units": "bool"},
    )
    e = Explorer(masks, x="layer", y="cluster")
    c = e.controls
    assert c["target_sparsity"].value == 0.3 and c["component"].value == "attn"
    assert c["prompt"].value == "share"  # samples open pooled, as the share they are
    assert [o for o in c["target_sparsity"].options if isinstance(o[1], str)] == []
    assert [v for _, v in c["prompt"].options][:3] == ["share", "any", "all"]
    assert c["binarize"].disabled
    assert spec(e)["title"]["text"] == (
        "share of 3 prompts where Block kept · component = attn, target_sparsity = 0.3"
    )
    c["prompt"].value = "all"
    assert spec(e)["encoding"]["color"]["scale"]["domain"][:2] == ["kept", "skipped"]


def test_binarize_swaps_the_offered_reducers_and_keeps_the_choice():
    e = Explorer(per_prompt(SIGNED))
    c = e.controls
    assert c["prompt"].value == "mean" and c["prompt"].options[0] == ("mean", "mean")
    c["binarize"].value = True
    assert c["prompt"].value == "share"
    assert [v for _, v in c["prompt"].options][:3] == ["share", "any", "all"]
    assert spec(e)["title"]["text"].startswith("share of 3 prompts with |attribution| >= ")
    c["prompt"].value = "any"
    c["binarize"].value = False
    assert c["prompt"].value == "max" and e._message.value == ""


def test_prompt_control_shows_full_texts():
    e = Explorer(per_prompt(SIGNED))
    labels = [label for label, v in e.controls["prompt"].options if not isinstance(v, str)]
    assert labels == [f"{i}: {t}" for i, t in enumerate(PROMPTS)]
    e.controls["prompt"].value = 2
    assert e.controls["prompt"].tooltip == f"2: {PROMPTS[2]}"
    assert e.controls["swap"].tooltip == "exchange the x and y axes"


def click(explorer, **cell):
    """What a click does in the browser: Vega sets the ``cell`` selection's signal."""
    explorer._chart._vl_selections = {"cell": {"value": {"vlPoint": {"or": [cell]}}, "store": []}}


def test_clicking_a_cell_shows_its_values_per_prompt_and_the_detail_view():
    scores = per_prompt(SIGNED)
    asked = []

    def detail(cell):
        asked.append(cell)
        return alt.Chart({"values": [{"a": 1}]}).mark_point()

    e = Explorer(scores, detail=detail)
    assert spec(e)["params"][0]["select"] == {
        "type": "point",
        "fields": ["layer", "head"],
        "on": "click",
        "clear": "dblclick",
    }
    cells = spec(e)["layer"][0]  # the cells; the hatch of unsure means lies on top
    stroke = cells["encoding"]["stroke"]  # the clicked cell is outlined, no other
    assert stroke["condition"] == {"param": "cell", "value": "#000000", "empty": False}
    click(e, layer=1, head=0)
    assert e.cell == {"layer": 1, "head": 0}
    assert asked == [{"layer": 1, "head": 0, "prompt": 0, "text": PROMPTS[0]}]
    per_prompt_chart, shown = e._details.box.children
    bars = per_prompt_chart.chart.to_dict()
    rows = next(rows for rows in bars["datasets"].values() if "text" in rows[0])
    assert [r["value"] for r in rows] == pytest.approx(SIGNED[:, 1, 0].tolist())
    assert [r["text"] for r in rows] == PROMPTS
    # each prompt's text shortened in the middle (the full text is in the rows, for the tooltip)
    assert bars["layer"][-1]["encoding"]["y"]["axis"]["labelExpr"].startswith(
        '["The capital of F\\u2026ce is the city of"'
    )
    # the mean's interval beside the bars: the numbers of the heatmap's tooltip
    cell = next(r for r in inline_rows(spec(e)) if r["layer"] == 1 and r["head"] == 0)
    said = bars["title"]["subtitle"][0]
    assert said == (
        f"mean {cell['value']:.4g}, 95% interval {cell['low']:.4g} to {cell['high']:.4g} (N = 3)"
    )
    assert isinstance(shown, alt.JupyterChart)
    e.controls["prompt"].value = 2  # a picked prompt: the detail view follows it
    assert asked[-1] == {"layer": 1, "head": 0, "prompt": 2, "text": PROMPTS[2]}
    text, again = e._details.box.children
    assert "at layer 1, head 0: " in text.value and again is shown  # swapped in place


def test_update_swaps_new_data_into_the_same_chart():
    e = Explorer(per_prompt(SIGNED))
    chart_widget = e._chart
    e.update(per_prompt(SIGNED * 10))
    assert e._chart is chart_widget
    got = {(r["layer"], r["head"]): r["value"] for r in inline_rows(spec(e))}
    assert got[(0, 0)] == pytest.approx(float(SIGNED[:, 0, 0].mean() * 10))


def test_switching_to_a_mask_variable_turns_binarize_off():
    scores = per_prompt(SIGNED)
    ds = xr.Dataset(
        {"score": scores, "kept": (scores > 0).assign_attrs(long_name="kept", units="bool")}
    )
    e = Explorer(ds)
    e.controls["binarize"].value = True
    assert e.controls["prompt"].value == "share"
    e.controls["variable"].value = "kept"
    assert not e.controls["binarize"].value and e.controls["binarize"].disabled
    assert e._message.value == "" and spec(e)["title"]["text"] == "share of 3 prompts where kept"
    e.controls["variable"].value = "score"
    assert e.controls["prompt"].value == "mean" and not e.controls["binarize"].disabled


def flagged(values=SIGNED):
    """``per_prompt`` with the model's answer on prompt 1 wrong."""
    return per_prompt(values).assign_coords(correct=("prompt", [True, False, True]))


def test_wrong_answers_are_flagged_and_can_be_left_out():
    da = flagged()
    e = Explorer(da)
    labels = [label for label, _ in e.controls["prompt"].options]
    assert labels[4].startswith("1 ✗ wrong answer: ") and "✗" not in labels[3] + labels[5]
    assert not e.controls["correct"].value
    mean = e.array.sel(bound="mean", drop=True).drop_vars("n")
    xr.testing.assert_allclose(mean, da.mean("prompt"), check_dim_order=False)
    e.controls["correct"].value = True
    mean = e.array.sel(bound="mean", drop=True).drop_vars("n")
    xr.testing.assert_allclose(mean, da.sel(prompt=[0, 2]).mean("prompt"))
    title = spec(e)["title"]["text"]
    assert (
        "mean over 2 prompts" in title and "only the 2 of 3 prompts the model gets right" in title
    )
    e.controls["prompt"].value = 1  # one prompt is shown as it is, its wrong answer named
    assert "prompt 1 ✗ wrong answer" in spec(e)["title"]["text"]
    assert "correct" not in Explorer(per_prompt(SIGNED)).controls  # no coord, no switch
    with pytest.raises(ValueError, match=r"correct_only=True needs a 'correct' coord"):
        Explorer(per_prompt(SIGNED), correct_only=True)
    started = Explorer(da, correct_only=True, ci=None)
    xr.testing.assert_allclose(started.array, da.sel(prompt=[0, 2]).mean("prompt"))
    with pytest.raises(ValueError, match=r"side='up' is not a binarize rule"):
        Explorer(da, side="up")


def test_the_details_follow_the_selection_from_a_prompt_to_the_mean():
    e = Explorer(flagged())
    e.controls["prompt"].value = 2
    e.show_cell({"layer": 1, "head": 0})
    assert e.cell == {"layer": 1, "head": 0, "prompt": 2}
    assert "prompt 2: " in e._details.text.value
    e.controls["prompt"].value = "mean"
    assert e.cell == {"layer": 1, "head": 0}  # the old prompt's detail is gone
    (bars_widget,) = e._details.box.children
    rows = inline_rows(bars_widget.chart.to_dict())
    assert [r["prompt"] for r in rows] == [0, 1, 2]
    assert [r["answer"] for r in rows] == ["model right", "model wrong", "model right"]
    assert [r["value"] for r in rows] == pytest.approx(SIGNED[:, 1, 0].tolist())
    e.controls["facet"].value = "prompt"  # the clicked cell is still drawn: details kept
    assert e._details.box.children


def test_binarize_offers_magnitude_or_one_sign_and_says_which():
    values = np.array([[[-3.0, 0.1], [0.2, 2.0]]] * 3)  # strong negative and positive heads
    da = per_prompt(values)
    on_magnitude = reduce(da, View("head", "layer", {"prompt": "any"}, threshold=1, side="abs"))
    assert on_magnitude.values.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert on_magnitude.attrs["long_name"] == "|attribution| >= 1"
    above = reduce(da, View("head", "layer", {"prompt": "any"}, threshold=1, side="above"))
    assert above.values.tolist() == [[0.0, 0.0], [0.0, 1.0]]
    assert "3 strong negative values" in above.attrs["note"]  # hidden ones are named
    assert "binarize on |value|" in above.attrs["note"]
    below = reduce(da, View("head", "layer", {"prompt": "any"}, threshold=-1, side="below"))
    assert below.values.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert below.attrs["long_name"] == "attribution <= -1"
    with pytest.raises(ValueError, match=r"side='up' is not a binarize rule.*'abs'"):
        reduce(da, View("head", "layer", {"prompt": "any"}, threshold=1, side="up"))


def test_the_default_threshold_is_a_quantile_of_the_magnitude():
    e = Explorer(per_prompt(SIGNED))
    assert e.controls["side"].value == "abs"
    expected = np.quantile(np.abs(SIGNED), 0.9)
    assert e.controls["threshold"].value == pytest.approx(expected, rel=1e-2)
    e.controls["binarize"].value = True
    e.controls["prompt"].value = "share"
    share = (np.abs(SIGNED) >= e.controls["threshold"].value).mean()
    assert 0 < share <= 0.2 and f"{share:.0%} of values pass" in spec(e)["title"]["text"]
    positive = Explorer(per_prompt(np.abs(SIGNED)))
    assert positive.controls["side"].value == "above"  # one sign: no |value| needed


def test_a_uniform_slice_gets_a_note_even_when_the_whole_array_is_not():
    values = SIGNED.copy()
    values[0] = 5.0  # prompt 0 is far above a threshold that splits the other prompts
    e = Explorer(per_prompt(values), threshold=1.0, side="above")
    e.controls["binarize"].value = True
    e.controls["prompt"].value = 0
    assert "at or below every value (min 5)" in e._message.value
    flat = per_prompt(np.ones((3, 2, 2)))
    array, chart = render(flat, View("head", "layer", {"prompt": "mean"}))
    assert array.attrs["note"] == "every cell is 1: this view leaves the map one colour"
    assert array.attrs["note"] in chart.to_dict()["title"]["subtitle"]


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"data": None}, TypeError, "data must be an xarray.DataArray or Dataset"),
        ({"x": ["head"]}, TypeError, r"x must be a string, got \['head'\]"),
        ({"facet": np.array([1, 2])}, TypeError, "facet must be a string or None"),
        ({"side": ["abs"]}, ValueError, r"side=\['abs'\] is not a binarize rule"),
        ({"threshold": "0.5"}, TypeError, "threshold must be a number"),
        ({"correct_only": np.array([1, 2])}, TypeError, "correct_only must be True or False"),
        ({"variable": "gate"}, ValueError, "a DataArray takes no variable="),
    ],
)
def test_bad_options_are_refused_by_name(options, error, message):
    with pytest.raises(error, match=message):
        Explorer(**{"data": per_prompt(SIGNED), **options})
    with pytest.raises(ValueError, match=r"variable='gate' .*pick one of \['s'\]"):
        Explorer(per_prompt(SIGNED).to_dataset(name="s"), variable="gate")


def test_the_explorer_reads_its_data_by_label(scores):
    """A sortby or transpose of the data shows the same controls and the same chart."""
    moved = scores.sortby("model").sortby("layer", ascending=False)
    moved = moved.transpose("head", "model", "layer", "cluster")
    plain, shown = Explorer(scores), Explorer(moved)
    assert spec(shown) == spec(plain)
    for name in ("model", "cluster"):
        assert shown.controls[name].options == plain.controls[name].options
    plain.controls["cluster"].value = shown.controls["cluster"].value = "max"
    assert spec(shown) == spec(plain)
    plain.update(scores * 2)
    shown.update(moved.isel(cluster=[2, 0, 1]) * 2)
    assert spec(shown) == spec(plain)
    with pytest.raises(ValueError, match=r"data's 'cluster' labels repeat"):
        Explorer(scores.assign_coords(cluster=[0, 0, 1]))


def test_a_dim_of_length_zero_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match=r"no values along \['prompt'\].*at least one"):
        Explorer(per_prompt(SIGNED).isel(prompt=[]))
    e = Explorer(per_prompt(SIGNED))
    with pytest.raises(ValueError, match=r"no values along \['head'\]"):
        e.update(per_prompt(SIGNED).isel(head=[]))


def test_a_mean_over_prompts_carries_its_interval_in_the_chart_and_the_details():
    values = SIGNED.copy()
    values[:, 0, 0] = [2.0, 2.1, 1.9]  # sure: the interval excludes 0
    values[:, 0, 1] = [-1.0, 1.0, 0.1]  # unsure
    e = Explorer(per_prompt(values))
    assert e.array.dims == ("layer", "head", "bound")
    xr.testing.assert_allclose(e.array, aggregate.mean(per_prompt(values)))  # its numbers
    chart = spec(e)
    assert chart["title"]["text"] == "attribution · mean over 3 prompts, 95% interval"
    assert any(
        line.startswith("hatched: 95% interval includes 0") for line in chart["title"]["subtitle"]
    )
    rows = {(r["layer"], r["head"]): r for r in inline_rows(chart)}
    assert rows[(0, 0)]["unsure"] is None and rows[(0, 1)]["unsure"] == "95% interval includes 0"
    e.controls["prompt"].value = 0  # one prompt: no interval, no hatch
    assert "bound" not in e.array.dims and "layer" not in spec(e)
    e.controls["prompt"].value = "max"  # not a mean: no interval
    assert "bound" not in e.array.dims
    e.controls["prompt"].value = "mean"
    e.controls["binarize"].value = True  # a share of prompts: no interval
    assert "bound" not in e.array.dims
    plain = Explorer(per_prompt(values), ci=None)
    assert "bound" not in plain.array.dims
    assert spec(plain)["title"]["text"] == "attribution · mean over 3 prompts"
    with pytest.raises(ValueError, match=r"ci must lie in \(0, 1\)"):
        Explorer(per_prompt(values), ci=1)


def test_pooled_seeds_then_prompts_show_the_interval_in_words():
    seeds = xr.concat([per_prompt(SIGNED), per_prompt(SIGNED * 2)], dim="seed")
    e = Explorer(seeds.assign_coords(seed=[0, 1]).transpose("seed", ...))
    assert e.view.pick == {"seed": "mean", "prompt": "mean"}
    e.show_cell({"layer": 0, "head": 1})
    (text,) = e._details.box.children
    interval = e.array.sel(layer=0, head=1)
    assert f"{float(interval.sel(bound='low')):.4g} to " in text.value and "(N = 3)" in text.value


def _with_error(values, error, measured=None):
    """``per_prompt(values)`` as a fast estimate: an ``error`` coord (and ``measured``)."""
    da = per_prompt(values, error_method="coarse-rule")
    da = da.assign_coords(
        error=(da.dims, np.asarray(error, float), {"long_name": "error estimate", "method": "x"})
    )
    if measured is not None:
        da = da.assign_coords(measured=(da.dims, np.asarray(measured, bool)))
    return da


def test_the_details_give_a_fast_estimate_its_error_interval_and_exactness():
    values = np.full((3, 2, 2), 0.5)
    values[0, 0, 0] = 2.0
    error = np.full((3, 2, 2), 0.1)
    error[0, 0, 1] = 0.8  # interval includes 0
    measured = np.zeros((3, 2, 2), bool)
    measured[0, 1, 1] = True
    error[0, 1, 1] = 0.0
    e = Explorer(_with_error(values, error, measured))
    e.controls["prompt"].value = 0
    e.show_cell({"layer": 0, "head": 0})
    _, text = e._details.box.children
    assert "estimate: 2 logit diff" in text.value
    assert "error estimate: ±0.1 logit diff (coarse-rule)" in text.value
    assert "interval: 1.9 to 2.1 (estimate ± error; excludes 0)" in text.value
    assert "not measured exactly" in text.value
    e.show_cell({"layer": 0, "head": 1})
    assert "-0.3 to 1.3" in text.value and "includes 0: the sign is not sure" in text.value
    e.show_cell({"layer": 1, "head": 1})  # measured: the value is the exact effect
    assert "IS the exact effect" in text.value and "error estimate" not in text.value
    e.controls["prompt"].value = "mean"  # pooled: the mean error, at most, and the count
    e.show_cell({"layer": 1, "head": 1})
    _, text = e._details.box.children
    assert "mean of 3 prompts" in text.value
    assert "±0.0667 logit diff at most" in text.value and "largest ±0.1" in text.value
    assert "measured exactly on 1 of 3 prompts" in text.value


def test_the_details_of_an_estimate_without_error_say_nothing_of_it():
    e = Explorer(per_prompt(SIGNED))
    e.show_cell({"layer": 0, "head": 0})
    assert len(e._details.box.children) == 1
    e = Explorer(
        _with_error(SIGNED, np.abs(SIGNED))
        .drop_vars("error")
        .assign_coords(measured=(("prompt", "layer", "head"), np.ones((3, 2, 2), bool)))
    )
    e.controls["prompt"].value = 1
    e.show_cell({"layer": 0, "head": 0})
    _, text = e._details.box.children
    assert "IS the exact effect" in text.value and "error estimate" not in text.value


def _domain(explorer):
    return spec(explorer)["encoding"]["color"]["scale"]["domain"]


def test_one_colour_domain_across_the_prompts_a_control_picks():
    """Switching prompts keeps the colours (the domain spans every prompt, the subtitle
    says so), as CircuitExplorer keeps one scale across its controls; the mean is another
    quantity with its own domain; shared_scale=False gives each prompt its own."""
    values = SIGNED.copy()
    values[2] *= 10  # one prompt with far larger scores
    data = per_prompt(values)
    largest = float(np.abs(values).max())
    e = Explorer(data, ci=None)
    alone = heatmap(data.mean("prompt"), x="head", y="layer").to_dict()
    assert _domain(e) == alone["encoding"]["color"]["scale"]["domain"]  # pooled: its own
    e.controls["prompt"].value = 0
    assert _domain(e) == pytest.approx([-largest, largest])
    assert any(
        "colour scale shared by every prompt" in line for line in spec(e)["title"]["subtitle"]
    )
    e.controls["prompt"].value = 2
    assert _domain(e) == pytest.approx([-largest, largest])
    own = Explorer(data, ci=None, shared_scale=False)
    own.controls["prompt"].value = 0
    first = float(np.abs(values[0]).max())
    assert _domain(own) == pytest.approx([-first, first])
    assert not any("shared" in line for line in spec(own)["title"].get("subtitle", []))
    _, chart = render(data, View("head", "layer", {"prompt": 1}, shared_scale=True))
    assert chart.to_dict()["encoding"]["color"]["scale"]["domain"] == pytest.approx(
        [-largest, largest]
    )
    nothing = View("head", "layer", {"prompt": 1})
    assert shared_domain(per_prompt(values * np.nan), nothing) is None  # nothing to span
    e.controls["binarize"].value = True  # a mask: two named colours, no domain to share
    assert spec(e)["encoding"]["color"]["type"] == "nominal"
    assert e.controls["scale"].disabled


def test_the_colour_toggle_starts_on_the_rule_and_switches_the_scale():
    """``scale="auto"`` reads every value of the variable: scores of one size start linear,
    one cell 1000 times the rest starts symmetric-log; the toggle switches in place; an
    unknown scale is refused by name."""
    e = Explorer(per_prompt(SIGNED), ci=None)
    assert e.controls["scale"].value == "linear"
    assert "type" not in spec(e)["encoding"]["color"]["scale"]
    shown = e._chart
    e.controls["scale"].value = "symlog"
    assert e._chart is shown and spec(e)["encoding"]["color"]["scale"]["type"] == "symlog"
    heavy = SIGNED.copy()
    heavy[0, 0, 0] = 1000.0
    assert Explorer(per_prompt(heavy)).controls["scale"].value == "symlog"
    assert Explorer(per_prompt(heavy), scale="linear").controls["scale"].value == "linear"
    with pytest.raises(ValueError, match=r"Unknown scale 'log10'; choose one of \['auto'"):
        Explorer(per_prompt(SIGNED), scale="log10")
    with pytest.raises(TypeError, match="shared_scale"):
        Explorer(per_prompt(SIGNED), shared_scale="yes")
