"""Explorer: the pure View -> (array, chart) core, and controls redrawing one chart in place."""

import altair as alt
import ipywidgets as widgets
import numpy as np
import pytest
import xarray as xr

import lenscape.accessor  # noqa: F401  (registers da.lsc)
from lenscape import schema
from lenscape.plot import export
from lenscape.widgets import Explorer, View, reduce, render

ATTRS = dict(long_name="attribution", units="logit diff", method="attribution_patching",
             metric="logit_diff", model="tiny", backend="nnsight", dtype="float32")


@pytest.fixture
def scores():
    """(model 2, cluster 3, layer 5, head 4), signed."""
    values = np.random.default_rng(0).normal(size=(2, 3, 5, 4))
    return schema.make(values, dims=("model", "cluster", "layer", "head"), attrs=ATTRS,
                       coords={"model": ["small", "large"]}, n_layers=5)


def spec(explorer):
    return explorer.chart.to_dict()


def cells(spec_dict):
    (values,) = spec_dict["datasets"].values()
    return values


def test_render_selects_and_reduces(scores):
    view = View(x="head", y="layer", pick={"model": "large", "cluster": "max"})
    array, chart = render(scores, view)
    assert array.dims == ("layer", "head")
    xr.testing.assert_allclose(array, scores.sel(model="large").max("cluster"))
    assert array.attrs["reduction"] == "model = large, max over cluster"
    assert chart.to_dict()["title"]["text"] == "attribution · model = large, max over cluster"


def test_threshold_binarizes_before_reducing_like_always_and_any():
    gates = np.array([[0.9, 0.9, 0.1], [0.9, 0.2, 0.1], [0.9, 0.8, np.nan]])  # (seed, head)
    da = schema.make(gates[:, None, :], dims=("seed", "layer", "head"), attrs=ATTRS)
    always = reduce(da, View(x="head", y="layer", pick={"seed": "all"}, threshold=0.5))
    anywhere = reduce(da, View(x="head", y="layer", pick={"seed": "any"}, threshold=0.5))
    assert always.values.tolist() == [[1.0, 0.0, 0.0]]
    assert anywhere.values.tolist() == [[1.0, 1.0, 0.0]]
    assert "units" not in always.attrs
    nothing = da.where(da["head"] != 2)  # head 2 never computed: stays NaN, never 0
    for how in ("mean", "max", "any", "all"):
        out = reduce(nothing, View(x="head", y="layer", pick={"seed": how}))
        assert np.isnan(out.values[0, 2]) and not np.isnan(out.values[0, 0])


def test_controls_cover_every_other_dim(scores):
    e = Explorer(scores)
    assert set(e.controls) == {"model", "cluster", "facet", "binarize", "threshold", "swap"}
    assert e.controls["model"].value == "small" and e.controls["cluster"].value == "mean"
    assert e.array.dims == ("layer", "head")
    enc = spec(e)["encoding"]
    assert (enc["x"]["field"], enc["y"]["field"]) == ("head", "layer")


def test_each_control_changes_the_spec(scores):
    e = Explorer(scores)
    c = e.controls
    c["cluster"].value = 2
    assert "cluster = 2" in spec(e)["title"]["text"]
    got = {(r["layer"], r["head"]): r["value"] for r in cells(spec(e))}
    assert got[(1, 3)] == pytest.approx(float(scores.sel(model="small", cluster=2)[1, 3]))
    c["model"].value = "max"
    assert "max over model" in spec(e)["title"]["text"]
    c["swap"].value = True
    enc = spec(e)["encoding"]
    assert (enc["x"]["field"], enc["y"]["field"]) == ("layer", "head")
    c["facet"].value = "model"
    assert spec(e)["facet"]["column"]["field"] == "model"
    assert c["model"].disabled and not c["cluster"].disabled
    assert e.array.dims == ("model", "layer", "head")
    c["binarize"].value = True
    color = spec(e)["spec"]["encoding"]["color"]
    t = f"{c['threshold'].value:.3g}"
    assert color["type"] == "nominal" and color["scale"]["domain"] == [f">= {t}", f"< {t}"]
    c["threshold"].value = 0.25
    assert spec(e)["spec"]["encoding"]["color"]["scale"]["domain"] == [">= 0.25", "< 0.25"]
    c["binarize"].value = False
    assert spec(e)["spec"]["encoding"]["color"]["type"] == "quantitative"


def test_dataset_variable_selector_updates_chart_and_threshold_range(scores):
    ds = xr.Dataset({"attr": scores, "gate": (scores * 0 + 7).assign_attrs(long_name="gate")})
    ds["gate"][0, 0, 0, 0] = 9.0
    e = Explorer(ds, variable="attr")
    assert spec(e)["title"]["text"].startswith("attribution")
    e.controls["variable"].value = "gate"
    assert spec(e)["title"]["text"].startswith("gate")
    s = e.controls["threshold"]
    assert (s.min, s.max, s.value) == (7.0, 9.0, 8.0)


def test_one_chart_widget_is_updated_in_place_and_displayed_once(scores, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: shown.append(a))
    e = Explorer(scores)
    e._ipython_display_()
    charts = [w for w in _walk(e.widget) if isinstance(w, alt.JupyterChart)]
    assert len(charts) == 1 and not any(isinstance(w, widgets.Output) for w in _walk(e.widget))
    before = charts[0].spec
    for name, value in [("cluster", 1), ("model", "large"), ("swap", True), ("facet", "cluster"),
                        ("binarize", True)]:
        e.controls[name].value = value
    assert [w for w in _walk(e.widget) if isinstance(w, alt.JupyterChart)] == charts
    assert charts[0].spec != before and charts[0].chart is e.chart
    assert shown == [(e.widget,)]
    bundle = e._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == e.widget.model_id


def _walk(w):
    yield w
    for child in getattr(w, "children", ()):
        yield from _walk(child)


def test_errors_are_shown_not_raised_and_keep_the_last_chart(scores):
    ds = xr.Dataset({"attr": scores, "per_layer": scores.mean("head")})
    e = Explorer(ds)
    before = e.chart
    e.controls["variable"].value = "per_layer"
    assert e.chart is before and "head" in e._message.value
    e.controls["variable"].value = "attr"
    assert e._message.value == "" and e.chart is not before


def test_bad_axes_and_facets_are_refused(scores):
    with pytest.raises(ValueError, match="x='pos'"):
        Explorer(scores, x="pos")
    with pytest.raises(ValueError, match="facet='layer'"):
        Explorer(scores, facet="layer")


def test_explore_accessor_and_export_of_an_explorer(scores, tmp_path):
    e = scores.lsc.explore(x="head", y="depth", facet="model")
    assert spec(e)["spec"]["encoding"]["y"]["field"] == "depth_start"
    assert export(e, tmp_path / "e.svg").read_text().lstrip().startswith("<svg")
