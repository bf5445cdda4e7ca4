"""Offline rendering (views/offline.py): export to files, the offline switch, SVG ids."""

import altair as alt
import pandas as pd
import pytest
from _helpers import signed_scores

import lenscape as lsc
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
    assert alt.renderers.active == "jupyter"
    assert alt.JupyterChart._is_offline
    assert offline.SVG_ID_PREFIX in alt.JupyterChart._esm  # each chart widget's ids its own


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
