"""Pictures of result DataArrays: one function maps dims to visual roles, the data picks the scale.

``heatmap(da, x="head", y="layer", facet_col="model")`` turns a DataArray into an Altair chart.
Each dim of ``da`` must get a role (an axis or a facet); anything else is reduced first by the
caller (``da.mean("prompt")``, ``da.sel(seed=0)``), so a picture never silently averages.
The values decide the colour scale: a binary mask gets two named colours with a legend, a
signed score a diverging scale centred at 0, anything else a sequential one. Titles, legend
and axis titles come from the metadata (``long_name``, ``units``, dim names); tooltips show
every coordinate of a cell and its value. NaN means "not computed" and is drawn grey.

The cells are written into the spec as inline values when the chart is built. Altair's
5,000-row guard applies only to DataFrames handed to it, so grids above that size work on
purpose; ``MAX_CELLS`` is lenscape's own, larger guard against specs a browser cannot draw.

Rendering is offline: ``export`` uses vl-convert for PNG/SVG and inlines the JavaScript into
HTML. In Jupyter, the first ``heatmap`` switches Altair from its default renderer (whose
Vega-Lite 6 mimetype JupyterLab 4 does not draw) to the offline widget renderer, unless you
picked a renderer; ``enable_offline`` does the same and bundles the JavaScript up front.
"""

from __future__ import annotations

import textwrap
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import altair as alt
import numpy as np
import xarray as xr

from lenscape.schema import LABEL_COORDS

#: Most cells one chart may hold; reduce or select before drawing more.
MAX_CELLS = 200_000
#: Colour of cells whose value is NaN ("not computed").
NAN_COLOR = "#bdbdbd"
#: Default colours for the False/0 and True/1 states of a binary mask.
BINARY_COLORS = ("#fde0c5", "#1d4e89")
#: Colours of ``lenscape.aggregate.ROLES``: neither (black), facilitating, interfering, both.
ROLE_COLORS = ("#000000", "#2ca02c", "#d62728", "#ffbf00")
#: Label of NaN cells in a binary legend.
NAN_LABEL = "not computed"

_VALUE = "value"
_STATE = "state"


def heatmap(
    da: xr.DataArray,
    *,
    x: str,
    y: str,
    facet_row: str | None = None,
    facet_col: str | None = None,
    color: str | Sequence[str] | None = None,
    binary: bool | None = None,
    center: float | None = None,
    labels: tuple[str, str] = ("skipped", "kept"),
    categories: Sequence[str] | None = None,
    title: str | None = None,
    tooltip: bool = True,
    independent: bool = False,
) -> alt.Chart | alt.FacetChart | alt.VConcatChart:
    """Draw a DataArray as a grid of coloured cells, optionally faceted into panels.

    Args:
        da: the values; every dim must be the dim of ``x`` or ``y`` or a facet, e.g.
            (model, layer, head) with ``x="head", y="layer", facet_col="model"``.
        x: dim or label coord on the horizontal axis. ``"depth"`` (relative depth, a coord on
            ``layer``) puts models of different depth on one shared [0, 1] axis.
        y: dim or label coord on the vertical axis (first coordinate at the top).
        facet_row: dim whose values become rows of panels (e.g. a condition).
        facet_col: dim whose values become columns of panels (e.g. ``model``).
        color: a Vega scheme name (``"viridis"``, ``"blueorange"`` ...) or a list of colours
            for the scale's range; for binary data, two colours for ``labels``.
        binary: ``True`` draws a two-state mask (non-zero = ``labels[1]``); ``None`` detects
            masks (bool dtype, or every value 0 or 1); ``False`` never treats data as a mask.
        center: value at the middle of a diverging scale; giving it forces a diverging scale
            (default: diverging at 0 when values have both signs).
        labels: legend names of the 0/False and 1/True states of a binary mask.
        categories: draw integer codes 0..K-1 as K named categories (e.g. head roles from
            ``lenscape.aggregate.roles``) with ``color`` as their K colours.
        title: chart title; defaults to ``da.attrs["long_name"]``.
        tooltip: show every coordinate and the value of the cell under the pointer.
        independent: give each panel its own x and y scales (models with different layer
            counts); the colour scale stays shared so panels compare.

    Returns:
        An ``alt.Chart``; an ``alt.FacetChart`` when faceted; a grid of charts
        (``alt.VConcatChart``) when faceted with ``independent=True``.

    Raises:
        ValueError: if a role names something ``da`` lacks, or a dim of ``da`` has no role
            (the message says how to reduce it).
    """
    _offline_renderer()
    if not isinstance(da, xr.DataArray):
        raise ValueError(f"heatmap takes an xarray.DataArray, got {type(da).__name__}; "
                         "pick one variable of a Dataset with ds['name'].")
    facets = {"row": facet_row, "column": facet_col}
    roles = [r for r in (x, y, facet_row, facet_col) if r is not None]
    if len(set(roles)) < len(roles):
        raise ValueError(f"x, y, facet_row and facet_col must differ, got {roles}.")
    for role, name in facets.items():
        if name is not None and name not in da.dims:
            raise ValueError(f"facet_{'col' if role == 'column' else role}={name!r} is not a dim; "
                             f"the array has dims {tuple(da.dims)}.")
    x_dim, y_dim = _axis_dim(da, x, "x"), _axis_dim(da, y, "y")
    extra = [d for d in da.dims if d not in {x_dim, y_dim, facet_row, facet_col}]
    if extra:
        d = extra[0]
        first = da[d].values[0].item() if d in da.coords else 0
        verb = "is" if len(extra) == 1 else "are"
        raise ValueError(
            f"The array has dims {tuple(da.dims)}, and {extra} {verb} not x, y or a facet. "
            f"Reduce first, e.g. da.mean({d!r}) or da.sel({d}={first!r}), "
            f"or facet with facet_row={d!r}.")
    if da.size > MAX_CELLS:
        raise ValueError(f"{da.size} cells exceed lenscape.plot.MAX_CELLS={MAX_CELLS}; "
                         f"select or reduce some of {tuple(da.dims)} first.")

    values = da.values
    finite = values[np.isfinite(values)] if values.dtype.kind == "f" else values.ravel()
    if categories is not None:
        binary, labels = True, tuple(categories)
    elif binary is None:
        binary = values.dtype == bool or bool(finite.size and np.isin(finite, (0, 1)).all())
    has_nan = finite.size < values.size
    long_name = da.attrs.get("long_name") or (str(da.name) if da.name is not None else None)
    units = da.attrs.get("units")
    legend = (long_name or ("state" if binary else _VALUE)) + (f" ({units})" if units else "")
    lines = textwrap.wrap(legend, 26)  # long names wrap instead of being cut off
    enc: dict[str, Any] = {"color": _color(finite, binary=binary, has_nan=has_nan, center=center,
                                           color=color, labels=labels,
                                           title=lines if len(lines) > 1 else legend)}
    if tooltip:
        enc["tooltip"] = _tooltip(da, binary, legend)
    panel = {"x": x, "y": y, "enc": enc, "labels": labels if binary else None}
    chart: alt.TopLevelMixin
    if not (facet_row or facet_col):
        chart = _panel(da, **panel)
    elif independent:  # one chart per facet: Vega-Lite's faceted independent scales break sorting
        chart = alt.vconcat(*[alt.hconcat(*[
            _panel(da.sel(at), **panel).properties(
                title=", ".join(f"{k} = {v}" for k, v in at.items()))
            for at in ({**r, **c} for c in _cells(da, facet_col))]) for r in _cells(da, facet_row)])
    else:
        chart = _panel(da, **panel).facet(**{
            role: (alt.Row if role == "row" else alt.Column)(
                f"{name}:{_kind(da, name)}", sort=_order(da, name), header=alt.Header(title=name))
            for role, name in facets.items() if name is not None})
    heading = title or long_name
    if heading:
        chart = chart.properties(title=alt.TitleParams(heading, subtitle=_subtitle(da, has_nan)))
    chart = chart.configure_scale(invalid={"color": {"value": NAN_COLOR}})
    return chart.configure_view(stroke=None)


def _panel(da: xr.DataArray, *, x: str, y: str, enc: dict[str, Any],
           labels: tuple[str, str] | None) -> alt.Chart:
    """One grid of cells with its data inline; ``enc`` holds the shared colour and tooltip.

    Args:
        da: the cells, every dim already an axis or a facet.
        x: coord on the horizontal axis.
        y: coord on the vertical axis.
        enc: colour (and tooltip) encodings, computed from the whole array so panels agree.
        labels: names of the 0 and 1 states for a binary mask, else None.
    """
    edges = {}
    for n in (x, y):
        if _kind(da, n) == "Q":
            edges[f"{n}_start"], edges[f"{n}_end"] = _edges(da[n], _axis_dim(da, n, "axis"))
    cols = _columns(da.assign_coords(edges))
    cols = _drop_outside(cols, [n for n in cols if n != _VALUE])
    if labels:
        state = (lambda v: labels[int(v)]) if len(labels) > 2 else (lambda v: labels[bool(v)])
        cols[_STATE] = [NAN_LABEL if v is None else state(v) for v in cols[_VALUE]]
    keys = list(cols)
    data = {"values": [dict(zip(keys, row)) for row in zip(*cols.values())]}
    return alt.Chart(data).mark_rect(invalid="show").encode(
        **_position(da, x, "x", cols), **_position(da, y, "y", cols), **enc,
    ).properties(width=_size(da, x), height=_size(da, y))


def _cells(da: xr.DataArray, dim: str | None) -> list[dict]:
    """Selections ``{dim: value}`` for each coordinate of a facet dim (``[{}]`` when None)."""
    return [{dim: v} for v in da[dim].values.tolist()] if dim else [{}]


def _axis_dim(da: xr.DataArray, name: str, role: str) -> Hashable:
    """The dim an axis runs along: the dim itself, or the dim a label coord (``depth``) hangs on."""
    if name in da.dims:
        return name
    if name in da.coords:
        dim = LABEL_COORDS.get(name, da[name].dims[-1] if da[name].ndim else None)
        if dim in da.dims:
            return dim
    raise ValueError(f"{role}={name!r} is neither a dim nor a label coord of the array; it has "
                     f"dims {tuple(da.dims)} and coords {tuple(da.coords)}.")


def _coord_names(da: xr.DataArray) -> list[str]:
    """Dims (with or without coords), then label coords, then scalar coords."""
    rest = sorted((c for c in da.coords if c not in da.dims), key=lambda c: da[c].ndim == 0)
    return [str(n) for n in [*da.dims, *rest]]


def _columns(da: xr.DataArray) -> dict[str, list]:
    """One flat list per coord (see ``_coord_names``) and the values, cell-aligned.

    NaN becomes ``None`` (JSON null) so Vega-Lite sees "missing", never 0.
    """
    shape = da.shape
    cols: dict[str, list] = {}
    for name in _coord_names(da):
        coord = da[name]
        own = [d for d in da.dims if d in coord.dims]
        arr = coord.transpose(*own).values.reshape([s if d in own else 1 for d, s in
                                                    zip(da.dims, shape)])
        cols[name] = _jsonable(np.broadcast_to(arr, shape).ravel())
    cols[_VALUE] = _jsonable(da.values.ravel())
    return cols


def _jsonable(arr: np.ndarray) -> list:
    """Plain Python values with NaN as None."""
    if arr.dtype == bool:
        return arr.astype(int).tolist()
    if arr.dtype.kind == "f":
        return [None if v != v else v for v in arr.tolist()]
    if arr.dtype.kind in "iu":
        return arr.tolist()
    return [str(v) for v in arr.tolist()]


def _drop_outside(cols: dict[str, list], coord_names: list[str]) -> dict[str, list]:
    """Drop cells whose coordinates are NaN: positions outside a model, e.g. layers past a
    shallower model's depth after ``xr.concat`` along ``model``."""
    bad = [n for n in coord_names if None in cols[n]]
    if not bad:
        return cols
    keep = [all(cols[n][i] is not None for n in bad) for i in range(len(cols[_VALUE]))]
    return {k: [v for v, ok in zip(col, keep) if ok] for k, col in cols.items()}


def _edges(coord: xr.DataArray, dim: Hashable) -> tuple[tuple, tuple]:
    """Start and end of each cell along a continuous axis: midpoints between neighbours.

    Args:
        coord: a coord increasing along ``dim``, e.g. ``depth`` (layer,) or (model, layer);
            NaN marks positions a model does not have.
        dim: the dim the axis runs along.

    Returns:
        Two ``(dims, values)`` pairs shaped like ``coord``, ready for ``assign_coords``.
    """
    c = coord.transpose(..., dim)
    flat = c.values.reshape(-1, c.sizes[dim]).astype(float)
    lo, hi = np.full(flat.shape, np.nan), np.full(flat.shape, np.nan)
    for r, row in enumerate(flat):
        ok = np.isfinite(row)
        if not ok.any():
            continue
        v = row[ok]
        half = np.diff(v) / 2 if v.size > 1 else np.array([0.5])
        lo[r, ok] = np.concatenate([[v[0] - half[0]], v[1:] - half])
        hi[r, ok] = np.concatenate([v[:-1] + half, [v[-1] + half[-1]]])
    return (c.dims, lo.reshape(c.shape)), (c.dims, hi.reshape(c.shape))


def _kind(da: xr.DataArray, name: str) -> str:
    """Vega-Lite type letter for a coord: ints ordinal, floats quantitative, labels nominal."""
    kind = da[name].dtype.kind
    return "O" if kind in "iub" else "Q" if kind == "f" else "N"


def _order(da: xr.DataArray, name: str) -> list:
    """Coordinate values in array order, for sorting axes and facets as stored."""
    return list(dict.fromkeys(_jsonable(da[name].values.ravel())))


def _position(da: xr.DataArray, name: str, channel: str, cols: dict[str, list]) -> dict:
    """Encoding for one axis: banded for discrete coords, start and end for continuous ones."""
    cls, cls2 = (alt.X, alt.X2) if channel == "x" else (alt.Y, alt.Y2)
    if _kind(da, name) != "Q":
        present = set(cols[name])
        sort = [v for v in _order(da, name) if v in present]
        return {channel: cls(f"{name}:{_kind(da, name)}", title=name, sort=sort)}
    lo, hi = min(cols[f"{name}_start"], default=0), max(cols[f"{name}_end"], default=1)
    scale = alt.Scale(domain=[lo, hi], nice=False, zero=False, reverse=channel == "y")
    return {channel: cls(f"{name}_start:Q", title=name, scale=scale),
            f"{channel}2": cls2(field=f"{name}_end")}


def _size(da: xr.DataArray, name: str) -> alt.Step | int:
    """Panel width/height: a fixed span for continuous axes, else a step per cell small enough
    that a 36 x 32 grid fits a notebook column."""
    if _kind(da, name) == "Q":
        return 320
    return alt.Step(int(np.clip(480 // max(len(_order(da, name)), 1), 6, 22)))


def _color(finite: np.ndarray, *, binary: bool, has_nan: bool, center: float | None,
           color: str | Sequence[str] | None, labels: tuple[str, str],
           title: str | list[str]) -> alt.Color:
    """Colour encoding chosen from the data: binary, diverging or sequential."""
    scheme = color if isinstance(color, str) else None
    custom = None if color is None or scheme else list(color)
    if binary:
        nan = [NAN_LABEL] if has_nan else []
        if len(labels) > 2:  # categories: legend in code order
            domain = list(labels) + nan
            scale = alt.Scale(domain=domain, range=custom + [NAN_COLOR] * len(nan)) if custom \
                else alt.Scale(domain=domain, scheme=scheme or "category10")
            return alt.Color(f"{_STATE}:N", scale=scale, title=title)
        domain = [labels[1], labels[0]] + nan
        if scheme:
            scale = alt.Scale(domain=domain, scheme=scheme)
        else:
            off, on = custom or BINARY_COLORS
            scale = alt.Scale(domain=domain, range=[on, off, NAN_COLOR][:len(domain)])
        return alt.Color(f"{_STATE}:N", scale=scale, title=title)
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0  # constant data: any non-empty domain
    if center is not None or lo < 0 < hi:
        mid = 0.0 if center is None else float(center)
        half = max(abs(lo - mid), abs(hi - mid)) or 1.0
        kw: dict[str, Any] = {"domain": [mid - half, mid + half], "domainMid": mid}
        default: Any = {"name": "redblue", "extent": [1, 0]}  # blue below, red above
    else:
        kw, default = {"domain": [lo, hi]}, "viridis"
    if custom:
        kw["range"] = custom
    else:
        kw["scheme"] = scheme or default
    return alt.Color(f"{_VALUE}:Q", scale=alt.Scale(**kw), title=title)


def _tooltip(da: xr.DataArray, binary: bool, legend: str) -> list:
    """Every coordinate of a cell (dims, then label coords, then scalar coords), then its value."""
    tips = []
    for name in _coord_names(da):
        kind = _kind(da, name)
        tips.append(alt.Tooltip(f"{name}:{kind}", title=str(name),
                                **({"format": ".3f"} if kind == "Q" else {})))
    if binary:
        tips.append(alt.Tooltip(f"{_STATE}:N", title="state"))
    tips.append(alt.Tooltip(f"{_VALUE}:Q", title=legend, format=".4g"))
    return tips


def _subtitle(da: xr.DataArray, has_nan: bool) -> list[str] | alt.UndefinedType:
    """Provenance line (model, method, metric) and a note on grey cells."""
    keys = [k for k in ("model", "method", "metric")
            if k in da.attrs and k not in da.dims and k not in da.coords]  # a coord says more
    lines = [" · ".join(f"{k}: {da.attrs[k]}" for k in keys)] if keys else []
    if has_nan:
        lines.append(f"grey: {NAN_LABEL}")
    return lines or alt.Undefined


def _offline_renderer() -> None:
    """Replace Altair's default renderer, whose Vega-Lite 6 mimetype JupyterLab 4 cannot draw,
    with the offline Jupyter widget; a renderer the user chose is left alone. Cheap: Altair
    bundles the JavaScript on the first display."""
    if alt.renderers.active == "default":
        alt.renderers.enable("jupyter", offline=True)


def enable_offline() -> None:
    """Make Jupyter charts load Vega from vl-convert instead of a CDN (works with no internet).

    Switches Altair to its ``"jupyter"`` renderer (charts display as ``alt.JupyterChart``
    widgets) and bundles the JavaScript once. Bundling takes about 1.5 s (switching the
    renderer, microseconds), so lenscape calls this when the first ``Explorer`` is built,
    not at import.
    """
    alt.renderers.enable("jupyter", offline=True)
    alt.JupyterChart.enable_offline()


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
        chart.save(path, format="svg")
    elif suffix == ".html":
        chart.save(path, format="html", inline=True)
    else:
        raise ValueError(f"Cannot export to {path.name!r}; use a .png, .svg or .html suffix.")
    return path
