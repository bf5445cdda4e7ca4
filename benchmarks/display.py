"""Chart display time: from a chart as a cell's last expression to its output bundle.

With ``lsc.enable_offline()`` (every notebook calls it) a displayed chart goes through the
lenscape renderer: Altair's validated ``to_dict``, an ``alt.JupyterChart`` widget of the spec
(``views.offline.widget_of``) and a PNG of it from vl-convert (``with_image``). The cases are
synthetic arrays of SmolLM2-135M's sizes (30 layers, 9 heads, 3 key/value heads): a head
heatmap (270 cells), the edge heatmap of the 40 busiest senders and 60 busiest receivers,
and the circuit graph of the top 300 of its edges (notebook 05's IOI circuit drew 40 to
637). Each row is the median of ``--repeats`` displays of the same chart in one process (the
first, which imports and bundles, is not counted), with the widget of ``widget_of`` and,
interleaved with it, the one it replaced (``alt.JupyterChart(alt.Chart.from_dict(spec))``,
which walks and validates every inline data row twice).

Run: ``python benchmarks/display.py``; writes the ``display`` section of RESULTS.md (see
_report.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _report
import altair as alt
import numpy as np
import xarray as xr
from redraw import ATTRS

import lenscape as lsc
from lenscape import schema
from lenscape.capture.edges.graph import Graph
from lenscape.views import offline


def _charts() -> dict[str, alt.TopLevelMixin]:
    """The displayed charts, by case label."""
    rng = np.random.default_rng(0)
    heads = schema.make(rng.normal(size=(30, 9)), dims=("layer", "head"), attrs=ATTRS)
    graph = Graph(30, 9, 3)
    edges = xr.DataArray(
        np.where(graph.valid, rng.standard_t(2, size=graph.valid.shape), np.nan),
        dims=("sender", "receiver"),
        coords=graph.coords(),
        attrs=dict(ATTRS, method="edge_attribution"),
    )
    weight = abs(edges).fillna(0)
    busiest = edges.isel(
        sender=weight.sum("receiver").argsort()[-40:].values,
        receiver=weight.sum("sender").argsort()[-60:].values,
    )
    return {
        "head heatmap (30 x 9)": lsc.heatmap(heads, x="head", y="layer"),
        "edge heatmap (40 x 60)": lsc.edge_heatmap(busiest),
        "circuit graph (top 300 edges)": lsc.circuit_graph(edges, edges=300),
    }


def _rebuilt(spec: dict, **options) -> alt.JupyterChart:
    """The widget as the renderer made it before ``widget_of``: of the whole spec, rebuilt."""
    return alt.JupyterChart(alt.Chart.from_dict(spec), **options)


def _seconds(chart: alt.TopLevelMixin, builder) -> float:
    """Seconds of one display of ``chart`` with ``builder`` making the widget."""
    offline.widget_of, kept = builder, offline.widget_of
    try:
        start = time.perf_counter()
        chart._repr_mimebundle_()
        return time.perf_counter() - start
    finally:
        offline.widget_of = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = _report.parse_args(parser, repeats=1)
    lsc.enable_offline()
    builders = {"before": _rebuilt, "now": offline.widget_of}
    rows = []
    for label, chart in _charts().items():
        _seconds(chart, offline.widget_of)  # imports, the first vl-convert call
        times: dict[str, list[float]] = {name: [] for name in builders}
        for _ in range(args.repeats):
            for name, builder in builders.items():
                times[name].append(_seconds(chart, builder))
        before, now = (statistics.median(times[name]) for name in builders)
        print(f"  {label}: {before:.2f} s -> {now:.2f} s ({before / now:.1f}x)", flush=True)
        rows.append([*_report.stamp(), label, f"{before:.2f} s", f"{now:.2f} s"])
    intro = f"""\
`python benchmarks/display.py`: seconds from a chart as a cell's last expression to its
output bundle under `lsc.enable_offline()` (Altair's validated `to_dict`, the
`alt.JupyterChart` widget of the spec, a PNG of it from vl-convert), for synthetic arrays of
SmolLM2-135M's sizes: a head heatmap, the edge heatmap of the 40 busiest senders x 60 busiest
receivers, the circuit graph of the top 300 edges (notebook 05's IOI circuit drew 40 to
637). Median of {args.repeats} displays in one process after a first one; "before": the
widget of `alt.Chart.from_dict` of the whole spec, which walks and validates every inline
data row twice; "now": `views.offline.widget_of` (the rows as named datasets of the widget's
spec), interleaved."""
    _report.emit(
        args,
        _report.section(
            "display",
            "Chart display time",
            intro,
            _report.table(["date", "machine", "chart", "before", "now"], rows),
        ),
    )


if __name__ == "__main__":
    main()
