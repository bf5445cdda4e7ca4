"""Explorer: browse every dim of a result with controls that redraw one chart in place.

Two axes (``x``, ``y``) are drawn; every other dim gets a dropdown that either picks one
coordinate or reduces the dim (mean, max, min, any, all). A threshold can binarize the
values, one remaining dim can become facets, and the axes can be swapped.

The work is split in two so it can be tested without a browser:

- ``View`` is the state of the controls and ``render(data, view)`` turns it into the reduced
  DataArray and its chart; both are plain values and functions.
- ``Explorer`` wires ipywidgets to a ``View`` and shows ONE ``alt.JupyterChart``; a control
  change replaces that widget's ``.chart``, so nothing is re-displayed and outputs never stack.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import altair as alt
import ipywidgets as widgets
import numpy as np
import xarray as xr

from lenscape.plot import enable_offline, heatmap

Data = xr.DataArray | xr.Dataset


def _any(da: xr.DataArray, dim: str) -> xr.DataArray:
    valid = da.notnull()
    return ((da != 0) & valid).any(dim).where(valid.any(dim))


def _all(da: xr.DataArray, dim: str) -> xr.DataArray:
    valid = da.notnull()
    return ((da != 0) | ~valid).all(dim).where(valid.any(dim))


#: How a dim can be reduced. NaN ("not computed") is skipped; a cell with nothing computed
#: along the dim stays NaN. ``any``/``all`` treat non-zero as true.
REDUCERS: dict[str, Callable[[xr.DataArray, str], xr.DataArray]] = {
    "mean": lambda da, dim: da.mean(dim),
    "max": lambda da, dim: da.max(dim),
    "min": lambda da, dim: da.min(dim),
    "any": _any,
    "all": _all,
}


@dataclasses.dataclass(frozen=True)
class View:
    """What the Explorer shows; each field is one control.

    Attributes:
        x: dim (or label coord such as ``depth``) on the horizontal axis.
        y: dim on the vertical axis.
        pick: per other dim, a coordinate value to select or a ``REDUCERS`` name.
        variable: the Dataset variable to show (None for a DataArray).
        facet: a remaining dim drawn as side-by-side panels, or None.
        threshold: binarize each value to ``value >= threshold`` before reducing, or None.
        swap: exchange the x and y axes.
    """

    x: str
    y: str
    pick: Mapping[Hashable, Any] = dataclasses.field(default_factory=dict)
    variable: Hashable | None = None
    facet: str | None = None
    threshold: float | None = None
    swap: bool = False


def reduce(data: Data, view: View) -> xr.DataArray:
    """Apply a view's variable, threshold, selections and reductions.

    Binarizing comes first, so ``all`` over ``seed`` answers "above threshold in every seed"
    and ``mean`` gives the fraction of items above it.

    Args:
        data: a DataArray, or a Dataset with ``view.variable``.
        view: the state to apply.

    Returns:
        The DataArray with only the axis dims and the facet dim left; attrs kept, plus
        ``reduction`` saying what was done (``units`` dropped when binarized).
    """
    da = data[view.variable] if isinstance(data, xr.Dataset) else data
    attrs = dict(da.attrs)
    steps = []
    if view.threshold is not None:
        da = (da >= view.threshold).where(da.notnull())
        attrs.pop("units", None)
        steps.append(f">= {view.threshold:.3g}")
    for dim, how in view.pick.items():
        if dim not in da.dims or dim == view.facet:
            continue
        if isinstance(how, str) and how in REDUCERS:
            da = REDUCERS[how](da, dim)
            steps.append(f"{how} over {dim}")
        else:
            da = da.sel({dim: how})
            steps.append(f"{dim} = {how}")
    if steps:
        attrs["reduction"] = ", ".join(steps)
    out = da.copy(deep=False)
    out.attrs = attrs
    return out


def render(data: Data, view: View, **options: Any) -> tuple[xr.DataArray, alt.TopLevelMixin]:
    """The pure core of the Explorer: state in, reduced DataArray and chart out.

    Args:
        data: a DataArray, or a Dataset with ``view.variable``.
        view: what to show.
        **options: passed to ``heatmap`` (``color``, ``center``, ``independent`` ...).

    Returns:
        ``(array, chart)``: the reduced values (dims: the axes' dims and the facet) and
        their heatmap.
    """
    da = reduce(data, view)
    x, y = (view.y, view.x) if view.swap else (view.x, view.y)
    if view.threshold is not None:
        t = f"{view.threshold:.3g}"
        options = {"labels": (f"< {t}", f">= {t}"), **options}
    facet = view.facet if view.facet in da.dims else None
    name = da.attrs.get("long_name") or (str(da.name) if da.name is not None else "value")
    title = f"{name} · {da.attrs['reduction']}" if "reduction" in da.attrs else name
    return da, heatmap(da, x=x, y=y, facet_col=facet, **{"title": title, **options})


def _dims(data: Data) -> list[Hashable]:
    if isinstance(data, xr.DataArray):
        return list(data.dims)
    return list(dict.fromkeys(d for v in data.data_vars.values() for d in v.dims))


def _range(da: xr.DataArray) -> tuple[float, float]:
    """Finite min and max of ``da``, widened to a non-empty interval."""
    values = np.asarray(da.values, dtype=float)
    finite = values[np.isfinite(values)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    return lo, hi if hi > lo else lo + 1.0


def _label(data: Data, dim: Hashable, value: Any) -> str:
    """Dropdown label for a coordinate, with the prompt text when there is one."""
    if dim == "prompt" and "text" in data.coords:
        text = str(data["text"].sel(prompt=value).values)
        return f"{value}: {text[:40]}"
    return str(value)


class Explorer:
    """Controls for every dim of a result, redrawing one chart in place.

    A notebook cell ending in ``lsc.Explorer(scores)`` shows the controls above the chart.

    Args:
        data: a DataArray, e.g. (prompt, layer, head), or a Dataset of such variables.
        x: dim (or label coord, e.g. ``depth``) on the horizontal axis.
        y: dim on the vertical axis.
        facet: a dim to draw as side-by-side panels from the start.
        variable: the Dataset variable shown first (default: the first).
        threshold: start with binarizing at this value (default: off, slider mid-range).
        **options: passed to ``heatmap`` on every redraw (``color``, ``center``, ...).

    Attributes:
        controls: widget per name: one per other dim (named by the dim), ``variable`` for
            Datasets, ``facet`` (``"none"`` or a dim), ``binarize`` (checkbox), ``threshold``
            (slider), ``swap`` (toggle).
        widget: the ipywidgets container holding the controls and the chart.
        view: the current ``View``.
        array: the reduced DataArray behind the current chart.

    Raises:
        ValueError: if ``x`` or ``y`` is missing from the data, or ``facet`` is not another dim.
    """

    def __init__(self, data: Data, *, x: str = "head", y: str = "layer",
                 facet: str | None = None, variable: Hashable | None = None,
                 threshold: float | None = None, **options: Any):
        dims = _dims(data)
        for role, name in (("x", x), ("y", y)):
            if name not in dims and name not in data.coords:
                raise ValueError(f"Explorer({role}={name!r}) but the data has dims {tuple(dims)};"
                                 f" pass {role}= one of them.")
        self.data, self.x, self.y, self.options = data, x, y, options
        axis_dims = {n if n in dims else data[n].dims[-1] for n in (x, y)}
        self._others = [d for d in dims if d not in axis_dims]
        if facet is not None and facet not in self._others:
            raise ValueError(f"facet={facet!r} must be one of the other dims {self._others}.")

        self.controls: dict[str, widgets.Widget] = {}
        c = self.controls
        wide = {"style": {"description_width": "initial"}}
        if isinstance(data, xr.Dataset):
            names = list(data.data_vars)
            c["variable"] = widgets.Dropdown(options=names, value=variable or names[0],
                                             description="variable", **wide)
        for dim in self._others:
            values = data[dim].values.tolist()
            default = values[0] if dim == "model" or len(values) == 1 else "mean"
            c[str(dim)] = widgets.Dropdown(
                options=[(r, r) for r in REDUCERS] + [(_label(data, dim, v), v) for v in values],
                value=default, description=str(dim), **wide)
        c["facet"] = widgets.Dropdown(options=["none"] + [str(d) for d in self._others],
                                      value=facet or "none", description="facet", **wide)
        lo, hi = _range(self._current())
        c["binarize"] = widgets.Checkbox(value=threshold is not None, description="binarize at",
                                         indent=False, layout={"width": "auto"})
        c["threshold"] = widgets.FloatSlider(
            value=(lo + hi) / 2 if threshold is None else threshold, min=lo, max=hi,
            step=(hi - lo) / 200, readout_format=".3g", continuous_update=False)
        c["swap"] = widgets.ToggleButton(value=False, description="swap axes", icon="exchange")

        enable_offline()
        self.view = self._read()
        self.array, chart = render(data, self.view, **options)
        self._chart = alt.JupyterChart(chart, embed_options={"renderer": "svg"})
        self._message = widgets.HTML()
        dim_row = [c[str(d)] for d in self._others]
        top = [c[k] for k in ("variable", "facet", "swap") if k in c]
        self.widget = widgets.VBox([
            widgets.HBox(top + [c["binarize"], c["threshold"]]),
            widgets.HBox(dim_row, layout={"flex_flow": "row wrap"}),
            self._message, self._chart])
        self._sync_enabled()
        self._busy = False
        for control in c.values():
            control.observe(self._on_change, names="value")

    @property
    def chart(self) -> alt.TopLevelMixin:
        """The Altair chart now shown (export it with ``lenscape.export``)."""
        return self._chart.chart

    def _current(self) -> xr.DataArray:
        if isinstance(self.data, xr.DataArray):
            return self.data
        var = self.controls["variable"].value if "variable" in self.controls else None
        return self.data[var or next(iter(self.data.data_vars))]

    def _read(self) -> View:
        """The View the controls describe."""
        c = self.controls
        return View(
            x=self.x, y=self.y,
            pick={d: c[str(d)].value for d in self._others},
            variable=c["variable"].value if "variable" in c else None,
            facet=None if c["facet"].value == "none" else c["facet"].value,
            threshold=c["threshold"].value if c["binarize"].value else None,
            swap=c["swap"].value)

    def _sync_enabled(self) -> None:
        """Grey out dim controls that do not apply (faceted, or absent from the variable)."""
        dims = self._current().dims
        for d in self._others:
            self.controls[str(d)].disabled = d == self.controls["facet"].value or d not in dims
        self.controls["threshold"].disabled = not self.controls["binarize"].value

    def _on_change(self, change: dict) -> None:
        if self._busy:
            return
        if change["owner"] is self.controls.get("variable"):
            lo, hi = _range(self._current())
            s = self.controls["threshold"]
            self._busy = True
            try:  # widen first so min <= value <= max holds at every step
                s.min, s.max = min(lo, s.min), max(hi, s.max)
                s.value, s.step = (lo + hi) / 2, (hi - lo) / 200
                s.min, s.max = lo, hi
            finally:
                self._busy = False
        self._sync_enabled()
        self.redraw()

    def redraw(self) -> None:
        """Read the controls and swap the new chart into the shown widget."""
        view = self._read()
        try:
            array, chart = render(self.data, view, **self.options)
        except ValueError as err:  # keep the last good chart and say why
            self._message.value = f"<span style='color:#b00'>{html.escape(str(err))}</span>"
            return
        self._message.value = ""
        self.view, self.array = view, array
        self._chart.chart = chart

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
