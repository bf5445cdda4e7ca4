"""Rendering with no internet: charts to files, and chart widgets that load no CDN.

``export`` uses vl-convert for PNG/SVG and inlines the JavaScript into HTML; an HTML file
carries no actions menu (its "Open in Vega Editor" link is the one route to the internet)
unless the chart asked for one. Building a chart changes no global state: Altair's renderer
stays the one you chose. In Jupyter with no internet, call ``enable_offline`` once (an
``Explorer`` does) so charts load their JavaScript locally; ``unique_svg_ids`` keeps two
chart widgets on one page from sharing SVG definitions.

A chart widget is drawn only where a kernel and the widget manager run. So that a notebook
saved with its outputs still shows its figures elsewhere (the repository page, nbviewer, an
untrusted copy), every chart and widget that ``enable_offline`` displays carries a PNG of
its chart beside the widget view (``with_image``): a front end that can draw the widget
does, any other shows the picture.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import altair as alt
from altair.utils.mimebundle import spec_to_mimebundle

#: Font of SVG exports: vl-convert measures text with the first family it has and viewers draw
#: with the first they have, so naming a wide font that exists here keeps them in agreement
#: (with the default "sans-serif", Chromium's DejaVu Sans overflows the space measured for a
#: narrower font and titles are clipped).
SVG_FONT = "DejaVu Sans, Verdana, sans-serif"


#: The Altair renderer ``enable_offline`` switches to: the chart as an ``alt.JupyterChart``
#: widget, with a PNG of it beside the widget view (``with_image``).
RENDERER = "lenscape"
#: Pixel density of the PNG a displayed chart carries (1: the chart's own size).
IMAGE_SCALE = 1.0


def enable_offline() -> None:
    """Make Jupyter charts load Vega from vl-convert instead of a CDN (works with no internet).

    Switches Altair to the ``RENDERER`` renderer (charts display as ``alt.JupyterChart``
    widgets, each with a PNG of itself for front ends that cannot draw widgets) and bundles
    the JavaScript once. Bundling takes about 1.5 s (switching the renderer, microseconds),
    so lenscape calls this when the first ``Explorer`` is built, not at import.
    """
    alt.renderers.register(RENDERER, _widget_and_image)
    alt.renderers.enable(RENDERER)
    alt.JupyterChart.enable_offline()
    alt.JupyterChart._esm = unique_svg_ids(alt.JupyterChart._esm)


def _widget_and_image(spec: dict[str, Any], **metadata: Any) -> tuple[dict, dict]:
    """The ``RENDERER``: an ``alt.JupyterChart`` widget of ``spec`` and a PNG of it."""
    widget = widget_of(spec, embed_options=metadata.get("embed_options"))
    return with_image(widget._repr_mimebundle_(), spec)


def widget_of(spec: dict[str, Any], **options: Any) -> alt.JupyterChart:
    """An ``alt.JupyterChart`` widget drawing ``spec``, a Vega-Lite spec Altair has validated
    (the renderer gets it from a chart's ``to_dict``).

    The widget takes an Altair chart, which ``alt.Chart.from_dict`` rebuilds from a spec by
    walking every inline data row (to pick the schema classes of the objects it builds,
    validated or not), and whose ``to_dict`` validates every row again. The chart is built
    here from the spec without its rows, which are named datasets of the widget's spec
    (``{"name": ...}`` data and a top-level ``datasets``, as Altair's own ``to_dict``
    consolidates data): it draws the same, and a 300-edge circuit graph displays in 1.9 s
    instead of 4.2 s (benchmarks/display.py).

    Args:
        options: ``alt.JupyterChart``'s (e.g. ``embed_options``).
    """
    datasets = dict(spec.get("datasets", {}))

    def by_name(node: Any) -> Any:
        if isinstance(node, list):
            return [by_name(item) for item in node]
        if not isinstance(node, dict):
            return node
        named = {}
        for key, value in node.items():
            if key == "data" and isinstance(value, dict) and isinstance(value.get("values"), list):
                name = f"lenscape-inline-{len(datasets)}"
                while name in datasets:
                    name += "-"
                datasets[name] = value["values"]
                value = {"name": name, **{k: v for k, v in value.items() if k != "values"}}
            named[key] = by_name(value)
        return named

    skeleton = by_name({k: v for k, v in spec.items() if k != "datasets"})
    widget = alt.JupyterChart(alt.Chart.from_dict(skeleton), **options)
    if datasets:
        widget.spec = {**widget.spec, "datasets": datasets}
    return widget


def with_image(bundle: Any, chart: Any) -> tuple[dict, dict]:
    """A widget's display bundle with a PNG of ``chart`` beside its widget view.

    Front ends that draw widgets (JupyterLab, Voila, VS Code with a kernel) show the widget;
    the others (GitHub, nbviewer, a notebook opened untrusted or without its kernel) show
    the PNG, which is rendered here by vl-convert, with no internet.

    Args:
        bundle: the widget's ``_repr_mimebundle_()``: a dict of mimetype -> data, or a
            (data, metadata) pair.
        chart: the chart the widget shows: an Altair chart or its Vega-Lite spec (a dict).

    Returns:
        (data, metadata): ``bundle``'s data with an ``image/png`` entry added, and its
        metadata with the PNG's size in pixels.

    Raises:
        TypeError: ``chart`` is neither an Altair chart nor a dict.
    """
    if isinstance(chart, alt.TopLevelMixin):
        chart = chart.to_dict()
    if not isinstance(chart, dict):
        raise TypeError(
            f"chart must be an Altair chart or its Vega-Lite spec (a dict), got "
            f"{type(chart).__name__}."
        )
    data, meta = bundle if isinstance(bundle, tuple) else (bundle, {})
    png, png_meta = spec_to_mimebundle(
        chart,
        format="png",
        mode="vega-lite",
        vegalite_version=alt.VEGALITE_VERSION,
        scale=IMAGE_SCALE,
    )
    encoded = base64.b64encode(png["image/png"]).decode("ascii")  # as notebooks store it
    return {**data, "image/png": encoded}, {**(meta or {}), **png_meta}


#: Marks a chart-widget script whose SVG definition ids are made unique (``unique_svg_ids``).
SVG_ID_PREFIX = "__lenscapeSvgIds"
#: The id stems Vega's SVG renderer numbers from 0 in each copy of its script.
_SVG_ID_STEMS = ('"gradient_"', '"clip"+')


def unique_svg_ids(script: str) -> str:
    """Give the SVG definitions of each chart widget ids of its own.

    Every ``alt.JupyterChart`` widget loads its own copy of Vega, and each copy numbers legend
    gradients and clip paths from 0 (``gradient_0``, ``clip1``); with two charts on one page
    ``url(#gradient_0)`` then resolves to the first chart's gradient and a legend shows
    another chart's colours. This prefixes the ids with a random stem drawn when the copy
    loads, so they differ between charts.

    Args:
        script: the widget's offline JavaScript (``alt.JupyterChart._esm``).

    Returns:
        The script with prefixed ids (unchanged when already prefixed).

    Raises:
        ValueError: if the script does not name the ids as this Vega version does (a new
            Vega: the patch must be updated, never silently skipped).
    """
    if SVG_ID_PREFIX in script:
        return script
    missing = [stem for stem in _SVG_ID_STEMS if script.count(stem) != 1]
    if missing:
        raise ValueError(
            f"The chart script does not hold {missing} exactly once, so lenscape cannot make "
            "its SVG ids unique; this Vega version differs from the tested one (see "
            "constraints.txt for the tested altair and vl-convert-python)."
        )
    for stem in _SVG_ID_STEMS:
        head = stem.removesuffix("+")
        script = script.replace(
            stem, f"{head}+{SVG_ID_PREFIX}" + ("+" if stem.endswith("+") else "")
        )
    return f"const {SVG_ID_PREFIX} = Math.random().toString(36).slice(2, 10) + '_';\n" + script


def display_with_image(widget: Any, chart: Any) -> None:
    """Display an ipywidgets widget with a PNG of ``chart`` beside it (``with_image``): the
    ``_ipython_display_`` of lenscape's widgets.

    Args:
        widget: the widget to show (an ``Explorer``'s box of controls and chart).
        chart: the chart it shows now.
    """
    from IPython.display import display

    data, metadata = with_image(widget._repr_mimebundle_(), chart)
    display(data, metadata=metadata, raw=True)


def export(chart: Any, path: str | Path, *, scale: float = 2.0) -> Path:
    """Write a chart (or an ``Explorer``'s current chart) to PNG, SVG or self-contained HTML.

    Args:
        chart: an Altair chart, or anything with a ``.chart`` attribute holding one.
        path: output file; the suffix picks the format: ``.png``, ``.svg`` or ``.html``.
        scale: pixel density of PNGs (2 = sharp on high-DPI screens and slides).

    Returns:
        The path written.

    Raises:
        ValueError: for any other suffix.
    """
    if not isinstance(chart, alt.TopLevelMixin):
        chart = chart.chart
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".png":
        chart.save(path, format="png", scale_factor=scale)
    elif suffix == ".svg":
        chart.configure(font=SVG_FONT).save(path, format="svg")
    elif suffix == ".html":  # no actions menu (its Vega Editor link goes online) unless asked
        meta = chart.to_dict().get("usermeta", {}).get("embedOptions", {})
        chart.save(
            path, format="html", inline=True, embed_options={"actions": meta.get("actions", False)}
        )
    else:
        raise ValueError(f"Cannot export to {path.name!r}; use a .png, .svg or .html suffix.")
    return path
