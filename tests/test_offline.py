"""Offline rendering (views/offline.py): export to files, the offline switch, SVG ids."""

import base64
import inspect

import altair as alt
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from _helpers import signed_scores
from test_charts import lens_result

import lenscape as lsc
from lenscape.capture.edges.graph import Graph
from lenscape.views import offline
from lenscape.views.heatmaps import heatmap
from lenscape.views.offline import export


def test_export_writes_png_svg_and_self_contained_html(tmp_path):
    chart = heatmap(signed_scores(), x="head", y="layer")
    assert export(chart, tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = export(chart, tmp_path / "h.svg").read_text()
    assert "<svg" in svg[:200] and f'font-family="{offline.SVG_FONT}"' in svg
    html = export(chart, tmp_path / "h.html").read_text()
    assert "vegaEmbed" in html and "cdn.jsdelivr" not in html and "<script src=" not in html
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.html"):
        export(chart, tmp_path / "h.pdf")


def test_enable_offline_switches_renderer_and_bundles_javascript():
    offline.enable_offline()
    assert alt.renderers.active == offline.RENDERER
    assert alt.JupyterChart._is_offline
    assert offline.SVG_ID_PREFIX in alt.JupyterChart._esm  # each chart widget's ids its own


def _is_png(data: str) -> bool:
    return base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"


def test_displayed_charts_and_widgets_carry_a_picture_of_their_chart():
    """Where no widget can be drawn (GitHub, nbviewer, an untrusted notebook), a saved
    notebook shows the PNG beside each chart widget and each Explorer."""
    offline.enable_offline()
    chart = heatmap(signed_scores(), x="head", y="layer")
    data, metadata = chart._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data and _is_png(data["image/png"])
    assert metadata["image/png"]["width"] > 50
    data, _ = lsc.Explorer(signed_scores())._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data and _is_png(data["image/png"])
    plain, meta = offline.with_image({"text/plain": "x"}, chart.to_dict())
    assert _is_png(plain["image/png"]) and plain["text/plain"] == "x" and "image/png" in meta
    with pytest.raises(TypeError, match="chart must be an Altair chart or its Vega-Lite spec"):
        offline.with_image({}, "chart")


def _edge_scores() -> xr.DataArray:
    graph = Graph(2, 4, 2)
    values = np.random.default_rng(0).normal(size=graph.valid.shape)
    return xr.DataArray(
        np.where(graph.valid, values, np.nan), dims=("sender", "receiver"), coords=graph.coords()
    )


def _curve() -> xr.Dataset:
    return xr.Dataset(
        {
            "faithfulness": (("budget",), [0.2, 1.0]),
            "random_faithfulness": (("seed", "budget"), [[0.0, 1.0]]),
            **dict.fromkeys(("cpr", "cmd", "random_cpr", "random_cmd"), 0.5),
        },
        coords={"budget": [0.1, 1.0], "n_edges": ("budget", [3, 30])},
    )


#: One call per chart function of ``lsc.views`` (``make(actions)``; None: the function has no
#: ``actions`` option and never shows the menu).
CHARTS = {
    "heatmap": lambda **kw: lsc.heatmap(signed_scores(), x="head", y="layer", **kw),
    "bars": lambda **kw: lsc.views.bars(signed_scores().isel(head=0), y="layer", **kw),
    "logit_lens_chart": lambda **kw: lsc.views.logit_lens_chart(lens_result(), **kw),
    "circuit_graph": lambda **kw: lsc.circuit_graph(_edge_scores(), edges=5, **kw),
    "edge_heatmap": lambda **kw: lsc.edge_heatmap(_edge_scores(), **kw),
    "faithfulness_curve": lambda **kw: lsc.faithfulness_curve(_curve(), **kw),
    "reliability_chart": lambda **kw: lsc.reliability_chart(
        lsc.aggregate.reliability(signed_scores().rename(layer="prompt"), n_splits=4), **kw
    ),
}


def _chart_functions() -> set[str]:
    """The functions of ``lsc.views`` that return a chart (by their return annotation)."""
    return {
        name
        for name in lsc.views.__all__
        if inspect.isfunction(getattr(lsc.views, name))
        and "Chart" in str(inspect.signature(getattr(lsc.views, name)).return_annotation)
    }


def test_no_chart_offers_actions_that_leave_the_machine_unless_asked(tiny_llama, factual):
    """Vega's actions menu holds "Open in Vega Editor", a request to an outside site: every
    chart function of lsc.views (and so of lsc) leaves it out unless actions=True."""
    report = lsc.faithfulness(tiny_llama, factual[:2], estimators=("atp",), progress=False)
    makers = {**CHARTS, "agreement_chart": lambda **kw: lsc.agreement_chart(report, **kw)}
    assert set(makers) == _chart_functions()  # a new chart function joins this test
    assert {n for n in lsc.__all__ if n in lsc.views.__all__} & _chart_functions() <= set(makers)
    for name, make in makers.items():
        assert make().to_dict()["usermeta"] == {"embedOptions": {"actions": False}}, name
        takes = inspect.signature(getattr(lsc.views, name)).parameters
        if "actions" in takes or name == "edge_heatmap":  # edge_heatmap passes it to heatmap
            asked = make(actions=True).to_dict()["usermeta"]
            assert asked == {"embedOptions": {"actions": True}}, name


@pytest.mark.parametrize("name", sorted(CHARTS))
def test_the_displayed_widget_draws_the_chart_it_was_given(name):
    """The renderer's widget (``widget_of``) holds the spec with its inline rows moved to
    named datasets: every row is kept and the chart draws the same, pixel for pixel."""
    import vl_convert

    spec = CHARTS[name]().to_dict()
    drawn = offline.widget_of(spec).spec
    assert not [d for d in _data_of(drawn) if "values" in d], name
    inline = [d["values"] for d in _data_of(spec) if "values" in d]
    assert sorted(map(str, drawn.get("datasets", {}).values())) == sorted(
        map(str, [*inline, *spec.get("datasets", {}).values()])
    ), name
    assert vl_convert.vegalite_to_png(drawn) == vl_convert.vegalite_to_png(spec), name


def _data_of(spec) -> list[dict]:
    """Every ``data`` object of a Vega-Lite spec, at any depth."""
    if isinstance(spec, list):
        return [d for item in spec for d in _data_of(item)]
    if not isinstance(spec, dict):
        return []
    found = [spec["data"]] if isinstance(spec.get("data"), dict) else []
    return found + [d for key, value in spec.items() for d in _data_of(value)]


def test_each_chart_widget_numbers_its_svg_definitions_apart():
    alt.JupyterChart.enable_offline()
    script = offline.unique_svg_ids(alt.JupyterChart._esm)
    assert script.startswith(f"const {offline.SVG_ID_PREFIX} = Math.random()")
    assert f'"gradient_"+{offline.SVG_ID_PREFIX}+' in script
    assert f'"clip"+{offline.SVG_ID_PREFIX}+' in script
    assert offline.unique_svg_ids(script) == script  # once only
    with pytest.raises(ValueError, match="differs from the tested one"):
        offline.unique_svg_ids("function render() {}")


def test_agreement_chart_and_exported_html_carry_no_actions_menu(tmp_path, tiny_llama, factual):
    report = lsc.faithfulness(tiny_llama, factual[:2], estimators=("atp",), progress=False)
    assert lsc.agreement_chart(report).to_dict()["usermeta"] == {"embedOptions": {"actions": False}}
    bare = alt.Chart(pd.DataFrame({"a": [1]})).mark_point().encode(x="a")  # no usermeta
    page = export(bare, tmp_path / "bare.html").read_text()
    assert '"actions": false' in page and '"actions": true' not in page
    asked = export(heatmap(signed_scores(), x="head", y="layer", actions=True), tmp_path / "a.html")
    assert '"actions": true' in asked.read_text()
