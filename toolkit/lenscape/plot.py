"""Pictures of result DataArrays: one function maps dims to visual roles, the data picks the scale.

``heatmap(da, x="head", y="layer", facet_col="model")`` turns a DataArray into an Altair chart.
Each dim of ``da`` must get a role (an axis or a facet); anything else is reduced first by the
caller (``da.mean("prompt")``, ``da.sel(seed=0)``), so a picture never silently averages.
The data's declared type decides the colour scale, never its values: a mask
(``lenscape.mask_rules`` says what counts as one and as kept) gets two named colours with a
legend, a signed score a diverging scale centred at 0, anything else a sequential one.
Titles, legend and axis titles come from the metadata (``long_name``, ``units``, dim names);
tooltips show every coordinate of a cell and its value. NaN means "not computed" and is
drawn grey (the subtitle says so only when a drawn cell is NaN); +inf and -inf are drawn as
dark cells marked "+∞" / "−∞", and the spec never holds a non-JSON number.

The cells are written into the spec as inline values when the chart is built. Altair's
5,000-row guard applies only to DataFrames handed to it, so grids above that size work on
purpose; ``MAX_CELLS`` is lenscape's own, larger guard against specs a browser cannot draw.

Rendering is offline: ``export`` uses vl-convert for PNG/SVG and inlines the JavaScript into
HTML. Charts carry no actions menu (its "Open in Vega Editor" link is the one route to the
internet) unless asked for with ``actions=True``. Building a chart changes no global state:
Altair's renderer stays the one you chose. In Jupyter with no internet, call
``enable_offline`` once (an ``Explorer`` does) so charts load their JavaScript locally.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import html
import json
import textwrap
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import altair as alt
import numpy as np
import xarray as xr
from altair.typing import ChartType
from altair.utils.schemapi import debug_mode

from lenscape import _validate
from lenscape.mask_rules import MASK_UNITS, NAN_LABEL, STATES, is_mask
from lenscape.schema import LABEL_COORDS, name_from_attrs

#: Most cells one chart may hold; reduce or select before drawing more.
MAX_CELLS = 200_000
#: Colour of cells whose value is NaN ("not computed").
NAN_COLOR = "#bdbdbd"
#: Colour of cells whose value is +inf or -inf (marked "+∞" / "−∞" in white).
INF_COLOR = "#252525"
#: Default colours for the False/0 and True/1 states of a binary mask.
BINARY_COLORS = ("#fde0c5", "#1d4e89")
#: Colours of ``lenscape.aggregate.ROLES``: neither (black), facilitating, interfering, both.
ROLE_COLORS = ("#000000", "#2ca02c", "#d62728", "#ffbf00")
#: Longest legend title; longer descriptions move to the subtitle.
LEGEND_CHARS = 24
#: Widest title and subtitle line in pixels: Vega-Lite would cut them at the chart's width
#: (a 3-head chart is 66 px wide), hiding what a view shows.
TITLE_LIMIT = 1600
#: Facet panels per row when ``columns`` is not given.
FACET_COLUMNS = 4
#: Font of SVG exports: vl-convert measures text with the first family it has and viewers draw
#: with the first they have, so naming a wide font that exists here keeps them in agreement
#: (with the default "sans-serif", Chromium's DejaVu Sans overflows the space measured for a
#: narrower font and titles are clipped).
SVG_FONT = "DejaVu Sans, Verdana, sans-serif"
#: Label coords drawn as tick labels of their axis by default (tokens of an attention pattern).
TOKEN_COORDS = {"query_pos": "query_token", "key_pos": "key_token", "pos": "token"}

#: Tooltip titles that explain a coord's name.
TIP_TITLES = {"depth": "depth (layer / (layers − 1), 0 first, 1 last)"}
#: Bar colours of prompts the model answers right and wrong (the ``correct`` coord).
ANSWER_COLORS = {"model right": "#4c78a8", "model wrong": "#d62728"}

_VALUE = "value"
_STATE = "state"
_INFINITE = "infinite"

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _unchecked_build(build: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run a chart builder with Altair's per-object schema checks off. In its default debug
    mode Altair validates every encoding, scale and property as it is made, about half the
    time of an Explorer redraw; the finished spec is still validated whole by ``to_dict``
    (when it is displayed, exported or swapped into a ``JupyterChart``)."""

    @functools.wraps(build)
    def built(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with debug_mode(False):
            return build(*args, **kwargs)

    return built


def label_from_attrs(da: xr.DataArray, default: str = _VALUE) -> str:
    """``"long_name (units)"`` from the attrs (the name, or ``default``, without ``long_name``)."""
    name = name_from_attrs(da, default)
    units = da.attrs.get("units")
    return f"{name} ({units})" if units and units != MASK_UNITS else name


@functools.cache
def _scheme_names() -> tuple[str, ...]:
    """Vega's colour scheme names (``viridis``, ``blueorange`` ...), from Altair's schema."""
    parts = alt.ColorScheme.resolve_references()["anyOf"]
    return tuple(n for part in parts for n in alt.ColorScheme.resolve_references(part)["enum"])


def _check_color(color: Any, *, n_states: int | None) -> None:
    """Check ``heatmap``'s ``color``: None, a Vega scheme name, or a list of colours
    (exactly ``n_states`` of them for a mask or categories; None for a continuous scale).

    Raises:
        TypeError: not a string or a list of strings.
        ValueError: an unknown scheme name, or a list of the wrong length.
    """
    if color is None:
        return
    if isinstance(color, str):
        if color not in _scheme_names():
            close = difflib.get_close_matches(color, _scheme_names(), n=3) or [
                "viridis",
                "blueorange",
            ]
            raise ValueError(
                f"color={color!r} is not a Vega colour scheme; pick one such as {close}, "
                "or pass a list of colours."
            )
        return
    colours = _validate.strings("color", color, example="['#fde0c5', '#1d4e89']")
    if n_states is not None and len(colours) != n_states:
        raise ValueError(
            f"color lists {len(colours)} colours for {n_states} states; pass exactly "
            f"{n_states}, one per state in order."
        )


def _check_domain(domain: Any) -> None:
    """Check ``heatmap``'s ``domain``: None or two finite numbers, low < high."""
    if domain is None:
        return
    if not isinstance(domain, (tuple, list, np.ndarray)) or len(domain) != 2:
        raise TypeError(
            f"domain must be a pair (low, high) of numbers such as (0, 1), got {domain!r} "
            f"({type(domain).__name__})."
        )
    low = _validate.number("domain[0]", domain[0])
    high = _validate.number("domain[1]", domain[1])
    if low >= high:
        raise ValueError(f"domain must have low < high, got {domain!r}; pass e.g. (0, 1).")


def _check_tick_labels(da: xr.DataArray, tick_labels: Any) -> None:
    """Check ``heatmap``'s ``tick_labels``: None or {dim: a 1-D label coord with one value
    per coordinate of that dim}."""
    if tick_labels is None:
        return
    if not isinstance(tick_labels, Mapping):
        raise TypeError(
            f"tick_labels must be a dict {{dim: label coord}} such as {{'cluster': 'kind'}}, "
            f"got {tick_labels!r} ({type(tick_labels).__name__})."
        )
    for dim, coord in tick_labels.items():
        if not (
            dim in da.dims
            and coord in da.coords
            and da[coord].ndim == 1
            and da[coord].size == da.sizes[dim]
        ):
            raise ValueError(
                f"tick_labels maps {dim!r} to {coord!r}, but that needs a dim {dim!r} and a "
                f"1-D label coord {coord!r} of the same length; da has dims "
                f"{dict(da.sizes)} and coords {tuple(map(str, da.coords))}."
            )


def _check_codes(values: np.ndarray, categories: tuple[str, ...]) -> None:
    """Refuse category codes that name no category: every finite value must be one of
    0 .. len(categories) - 1."""
    codes = values.astype(float)
    codes = codes[np.isfinite(codes)]
    if codes.size and (
        (codes != np.round(codes)).any() or codes.min() < 0 or codes.max() >= len(categories)
    ):
        raise ValueError(
            f"categories names {len(categories)} codes (0 to {len(categories) - 1}), but the "
            f"array holds values from {codes.min():g} to {codes.max():g}; pass one name per "
            "code, e.g. categories=lsc.aggregate.ROLES for lsc.aggregate.roles."
        )


@_unchecked_build
def heatmap(
    da: xr.DataArray,
    *,
    x: str,
    y: str,
    facet_row: str | None = None,
    facet_col: str | None = None,
    columns: int | None = None,
    color: str | Sequence[str] | None = None,
    binary: bool | None = None,
    center: float | None = None,
    domain: tuple[float, float] | None = None,
    labels: tuple[str, str] = STATES,
    categories: Sequence[str] | None = None,
    title: str | None = None,
    tick_labels: Mapping[str, str] | None = None,
    tooltip: bool = True,
    independent: bool = False,
    actions: bool = False,
) -> ChartType:
    """Draw a DataArray as a grid of coloured cells, optionally faceted into panels.

    Args:
        da: the values; every dim must be the dim of ``x`` or ``y`` or a facet, e.g.
            (model, layer, head) with ``x="head", y="layer", facet_col="model"``.
        x: dim or label coord on the horizontal axis. ``"depth"`` (relative depth, a coord on
            ``layer``) puts models of different depth on one shared [0, 1] axis.
        y: dim or label coord on the vertical axis (first coordinate at the top).
        facet_row: dim whose values become rows of panels (e.g. a condition).
        facet_col: dim whose values become panels side by side (e.g. ``model``); without
            ``facet_row`` they wrap into rows of ``columns`` panels.
        columns: panels per row when only ``facet_col`` is given (default ``FACET_COLUMNS``).
        color: a Vega scheme name (``"viridis"``, ``"blueorange"`` ...) or a list of colours
            for the scale's range; for binary data, two colours for ``labels``.
        binary: ``True`` draws a two-state mask (kept, i.e. non-zero, = ``labels[1]``);
            ``None`` follows the declared type (``lenscape.mask_rules.is_mask``), never the
            values; ``False`` never treats data as a mask.
        center: value at the middle of a diverging scale; giving it forces a diverging scale
            (default: diverging at 0, symmetric, when values have both signs). A centre other
            than 0 gives a scale that spans only the data.
        domain: the ends of a sequential colour scale, e.g. ``(0, 1)`` for probabilities
            (default: the data's finite range).
        labels: legend names of the 0/False and 1/True states of a binary mask.
        categories: draw integer codes 0..K-1 as K named categories (e.g. head roles from
            ``lenscape.aggregate.roles``) with ``color`` as their K colours.
        title: chart title; defaults to ``da.attrs["long_name"]``.
        tick_labels: axis dim -> a label coord along it whose values replace the tick labels,
            e.g. ``{"cluster": "kind"}``; ``TOKEN_COORDS`` present in ``da`` are used by default.
        tooltip: show every coordinate and the value of the cell under the pointer.
        independent: give each panel its own x and y scales (models with different layer
            counts); the colour scale stays shared so panels compare.
        actions: show Vega's actions menu (export, "Open in Vega Editor", which goes online).

    Returns:
        An ``alt.Chart`` (an ``alt.LayerChart`` when some values are infinite); an
        ``alt.FacetChart`` when faceted; a grid of charts (``alt.VConcatChart`` or
        ``alt.ConcatChart``) when faceted with ``independent=True``.

    Raises:
        TypeError: an argument of the wrong type (``da`` not a DataArray, a list for ``x``,
            ``True`` for ``color`` ...); the message names it.
        ValueError: if a role names something ``da`` lacks, a dim of ``da`` has no role (the
            message says how to reduce it), an option is out of range (an unknown colour
            scheme, ``domain`` with low >= high ...), or a mask or category array holds
            infinities.
    """
    _check_options(
        da,
        x=x,
        y=y,
        facet_row=facet_row,
        facet_col=facet_col,
        binary=binary,
        center=center,
        domain=domain,
        labels=labels,
        categories=categories,
        title=title,
        tick_labels=tick_labels,
        flags={"tooltip": tooltip, "independent": independent, "actions": actions},
    )
    columns = _validate.positive_int(
        "columns", columns, none_means=f"{FACET_COLUMNS} panels per row"
    )
    _check_roles(da, x=x, y=y, facet_row=facet_row, facet_col=facet_col)
    cells = _read_cells(da, binary=binary, labels=labels, categories=categories)
    panel = functools.partial(
        _panel,
        x=x,
        y=y,
        enc=_encodings(da, cells, color=color, center=center, domain=domain, tooltip=tooltip),
        labels=cells.states if cells.binary else None,
        ticks={**{d: c for d, c in TOKEN_COORDS.items() if c in da.coords}, **(tick_labels or {})},
        has_inf=cells.has_inf,
        legend=cells.label,
    )
    chart = _arrange(
        da,
        panel,
        facet_row=facet_row,
        facet_col=facet_col,
        columns=columns or FACET_COLUMNS,
        independent=independent,
    )
    return _framed(chart, da, cells, title=title, actions=actions)


def _check_options(
    da: Any,
    *,
    x: Any,
    y: Any,
    facet_row: Any,
    facet_col: Any,
    binary: Any,
    center: Any,
    domain: Any,
    labels: Any,
    categories: Any,
    title: Any,
    tick_labels: Any,
    flags: dict[str, Any],
) -> None:
    """``heatmap``'s first step: every argument of the right type and range (``color``
    and ``columns`` are checked where they are used).

    Raises:
        TypeError: an argument of the wrong type (the message names it).
        ValueError: an argument out of range.
    """
    if not isinstance(da, xr.DataArray):
        raise TypeError(
            f"da must be an xarray.DataArray, got {type(da).__name__}; "
            "pick one variable of a Dataset with ds['name']."
        )
    _validate.text("x", x, example="'head'")
    _validate.text("y", y, example="'layer'")
    _validate.text("facet_row", facet_row, example="'model'", optional=True)
    _validate.text("facet_col", facet_col, example="'model'", optional=True)
    _validate.text("title", title, example="'Head attribution'", optional=True)
    if binary is not None:
        _validate.flag("binary", binary)
    if center is not None:
        _validate.number("center", center)
    _check_domain(domain)
    if len(_validate.strings("labels", labels, example="('skipped', 'kept')")) != 2:
        raise ValueError(f"labels must name the 2 states (off, on), got {labels!r}.")
    if categories is not None:
        _validate.strings("categories", categories, example="lsc.aggregate.ROLES")
    _check_tick_labels(da, tick_labels)
    for name, value in flags.items():
        _validate.flag(name, value)


def _check_roles(
    da: xr.DataArray, *, x: str, y: str, facet_row: str | None, facet_col: str | None
) -> None:
    """``heatmap``'s second step: the roles name distinct dims (or label coords) of ``da``,
    every dim has one, and the grid is small enough to draw.

    Raises:
        ValueError: a role shared or missing from ``da``, a dim without a role (the
            message says how to reduce it), or more than ``MAX_CELLS`` cells.
    """
    roles = [r for r in (x, y, facet_row, facet_col) if r is not None]
    if len(set(roles)) < len(roles):
        raise ValueError(f"x, y, facet_row and facet_col must differ, got {roles}.")
    for role, name in (("facet_row", facet_row), ("facet_col", facet_col)):
        if name is not None and name not in da.dims:
            raise ValueError(f"{role}={name!r} is not a dim; da has dims {tuple(da.dims)}.")
    x_dim, y_dim = _axis_dim(da, x, "x"), _axis_dim(da, y, "y")
    extra = [d for d in da.dims if d not in {x_dim, y_dim, facet_row, facet_col}]
    if extra:
        d = extra[0]
        first = da[d].values[0].item() if d in da.coords else 0
        verb = "is" if len(extra) == 1 else "are"
        raise ValueError(
            f"da has dims {tuple(da.dims)}, and {extra} {verb} not x, y or a facet. "
            f"Reduce first, e.g. da.mean({d!r}) or da.sel({d}={first!r}), "
            f"or facet with facet_row={d!r}."
        )
    if da.size > MAX_CELLS:
        raise ValueError(
            f"{da.size} cells exceed lenscape.plot.MAX_CELLS={MAX_CELLS}; "
            f"select or reduce some of {tuple(da.dims)} first."
        )


@dataclasses.dataclass(frozen=True)
class _Cells:
    """What the drawn cells hold, read once: it picks the colour scale, the legend and the
    subtitle.

    Attributes:
        binary: drawn as named states (a mask, or categories), not on a colour ramp.
        states: legend names of the codes 0, 1 (, 2 ... for categories).
        finite: the finite values of the drawn cells (the scale's default ends).
        has_nan: a drawn cell is NaN (not computed).
        has_inf: a drawn cell is +inf or -inf.
        label: what a cell holds, from the attrs (legend and tooltip).
    """

    binary: bool
    states: tuple[str, ...]
    finite: np.ndarray
    has_nan: bool
    has_inf: bool
    label: str


def _read_cells(
    da: xr.DataArray,
    *,
    binary: bool | None,
    labels: Sequence[str],
    categories: Sequence[str] | None,
) -> _Cells:
    """``heatmap``'s third step: read the values once (only the drawn cells, see ``_inside``)
    and decide between states and a colour ramp (``binary=None`` follows ``is_mask``).

    Raises:
        ValueError: category codes outside ``categories``, or infinities in a mask.
    """
    values = da.values
    is_float = values.dtype.kind == "f"
    infinite = np.isinf(values) if is_float else np.zeros(values.shape, bool)
    states = tuple(labels)
    if categories is not None:
        binary, states = True, tuple(categories)
        _check_codes(values, states)
    elif binary is None:
        binary = is_mask(da)
    if binary and infinite.any():
        raise ValueError(
            f"{int(infinite.sum())} cells are +-inf, which a mask or category "
            "map cannot show; replace them first, e.g. da.where(np.isfinite(da)) "
            "to draw them as not computed."
        )
    inside = _inside(da)
    return _Cells(
        binary=bool(binary),
        states=states,
        finite=values[np.isfinite(values) & inside] if is_float else values[inside],
        has_nan=bool((np.isnan(values) & inside).any()) if is_float else False,
        has_inf=bool((infinite & inside).any()),
        label=label_from_attrs(da, "state" if binary else _VALUE),
    )


def _encodings(
    da: xr.DataArray,
    cells: _Cells,
    *,
    color: Any,
    center: float | None,
    domain: tuple[float, float] | None,
    tooltip: bool,
) -> dict[str, Any]:
    """``heatmap``'s colour (and tooltip) encodings, shared by every panel so they compare.

    Raises:
        TypeError, ValueError: a bad ``color`` (see ``_check_color``).
    """
    _check_color(color, n_states=len(cells.states) if cells.binary else None)
    enc: dict[str, Any] = {
        "color": _color(
            cells.finite,
            binary=cells.binary,
            has_nan=cells.has_nan,
            center=center,
            ends=domain,
            color=color,
            labels=cells.states,
            title=legend_title(cells.label),
        )
    }
    if tooltip:
        enc["tooltip"] = _tooltip(da, cells.binary, cells.label)
    return enc


def _arrange(
    da: xr.DataArray,
    panel: Callable[[xr.DataArray], alt.Chart | alt.LayerChart],
    *,
    facet_row: str | None,
    facet_col: str | None,
    columns: int,
    independent: bool,
) -> ChartType:
    """``heatmap``'s panels: one, a Vega-Lite facet (shared scales), or, with
    ``independent``, a grid of separate panels each with its own axes.

    Args:
        panel: draws one grid of cells from (a part of) ``da``.
        columns: panels per row when only ``facet_col`` is given.
    """
    if not (facet_row or facet_col):
        return panel(da)
    if independent:  # one chart per facet: Vega-Lite's faceted independent scales break sorting
        return _panel_grid(da, panel, facet_row=facet_row, facet_col=facet_col, columns=columns)
    if facet_row and facet_col:
        return panel(da).facet(
            row=alt.Row(
                f"{facet_row}:{_kind(da, facet_row)}",
                sort=_order(da, facet_row),
                header=_header(da, facet_row),
            ),
            column=alt.Column(
                f"{facet_col}:{_kind(da, facet_col)}",
                sort=_order(da, facet_col),
                header=_header(da, facet_col),
            ),
        )
    name = facet_row or facet_col
    assert name  # the first branch took the case of neither facet
    return panel(da).facet(
        facet=alt.Facet(
            f"{name}:{_kind(da, name)}", sort=_order(da, name), header=_header(da, name)
        ),
        columns=1 if facet_row else columns,
    )


def _panel_grid(
    da: xr.DataArray,
    panel: Callable[[xr.DataArray], alt.Chart | alt.LayerChart],
    *,
    facet_row: str | None,
    facet_col: str | None,
    columns: int,
) -> ChartType:
    """Separate panels, one per facet value, each titled by its value ("model a · cluster
    2"): rows of ``facet_row`` values, or ``facet_col`` values wrapped into ``columns``."""

    def part(at: dict[str, Any]) -> alt.Chart | alt.LayerChart:
        heading = " · ".join(_facet_label(da, k, v) for k, v in at.items())
        return panel(da.sel(at)).properties(title=heading)

    if facet_row:
        return alt.vconcat(
            *[
                alt.hconcat(*[part({**r, **c}) for c in _facet_selections(da, facet_col)])
                for r in _facet_selections(da, facet_row)
            ]
        )
    return alt.concat(*[part(c) for c in _facet_selections(da, facet_col)], columns=columns)


def _framed(
    chart: ChartType, da: xr.DataArray, cells: _Cells, *, title: str | None, actions: bool
) -> ChartType:
    """``heatmap``'s last step: the title and subtitle (what the colour shows when the
    title does not say it, provenance, grey and dark cells), the actions menu, grey NaN
    and no frame."""
    heading = title or name_from_attrs(da, "")
    described = heading.startswith(da.attrs.get("long_name") or cells.label)
    subtitle = _subtitle(
        da,
        has_nan=cells.has_nan,
        has_inf=cells.has_inf,
        colour=None if described else cells.label,
    )
    if heading or subtitle:
        chart = chart.properties(
            title=alt.TitleParams(
                heading, subtitle=subtitle or alt.Undefined, anchor="start", limit=TITLE_LIMIT
            )
        )
    chart = chart.properties(usermeta={"embedOptions": {"actions": actions}})
    chart = chart.configure_scale(invalid={"color": {"value": NAN_COLOR}})
    return chart.configure_view(stroke=None)


@_unchecked_build
def bars(da: xr.DataArray, *, y: str, title: str | None = None, actions: bool = False) -> alt.Chart:
    """A 1-D DataArray as horizontal bars, one per coordinate of ``y`` (e.g. a head's score
    per prompt); a string label coord along ``y`` (``text``) gives the tick labels.

    Args:
        da: values with the single dim ``y``, e.g. (prompt,).
        y: the dim, one bar per coordinate, in stored order.
        title: chart title (default: the description from the attrs).
        actions: show Vega's actions menu.

    Returns:
        An ``alt.Chart``; NaN and +-inf bars are left out of the bars but kept in the data.

    Raises:
        ValueError: if ``da`` has another dim than ``y``.
    """
    if da.dims != (y,):
        raise ValueError(
            f"bars takes a 1-D array along {y!r}, got dims {tuple(da.dims)}; "
            "select or reduce the others first."
        )
    full = label_from_attrs(da)
    cols = _columns(da)
    keys = list(cols)
    data = {
        "values": [dict(zip(keys, row, strict=True)) for row in zip(*cols.values(), strict=True)]
    }
    labels = [
        c
        for c, d in LABEL_COORDS.items()
        if d == y and c in da.coords and da[c].dtype.kind in "OUS"
    ]
    ticks = {y: labels[0]} if labels else {}
    colour: dict[str, Any] = {}
    if "correct" in da.coords and da["correct"].dims == (y,):  # flag wrong answers
        answers = list(ANSWER_COLORS)
        for row, right in zip(data["values"], cols["correct"], strict=True):
            row["answer"] = answers[0] if right else answers[1]
        colour["color"] = alt.Color(
            "answer:N",
            scale=alt.Scale(domain=answers, range=list(ANSWER_COLORS.values())),
            title="model's answer",
        )
    chart = (
        alt.Chart(data)
        .mark_bar(color="#4c78a8")
        .encode(
            x=alt.X(f"{_VALUE}:Q", title=legend_title(full)),
            tooltip=_tooltip(da, False, full),
            **_position(da, y, "y", cols, ticks),
            **colour,
        )
        .properties(
            width=220,
            height=alt.Step(14),
            title=alt.TitleParams(title or full, fontSize=12),
            usermeta={"embedOptions": {"actions": actions}},
        )
    )
    return chart


class Summary:
    """A result at a glance, for notebooks: what it measures, its dims, its value range and
    its strongest cells, instead of a screen of numbers. Built by ``summary``.

    Attributes:
        da: the array summarised.
        lines: the summary as text lines.
    """

    def __init__(self, da: xr.DataArray, lines: list[str]) -> None:
        self.da, self.lines = da, lines

    def __repr__(self) -> str:
        return "\n".join(self.lines)

    def _repr_html_(self) -> str:
        head, *rest = (html.escape(line) for line in self.lines)
        return f"<div style='font-size:12px'><b>{head}</b><br>" + "<br>".join(rest) + "</div>"


def summary(da: xr.DataArray, *, top: int = 3) -> Summary:
    """Summarise a result: description, dims and sizes, provenance, value range, how many
    cells are not computed (NaN) or infinite, and the ``top`` cells with the largest
    magnitude after averaging over ``prompt`` and ``seed``.

    Args:
        da: any result DataArray, e.g. (prompt, layer, head).
        top: how many of the strongest cells to list.

    Returns:
        A ``Summary``; it displays as a few lines in a notebook.
    """
    values = np.asarray(da.values, dtype=float)
    finite = values[np.isfinite(values)]
    sizes = " × ".join(f"{d} {n}" for d, n in da.sizes.items())
    lines = [f"{label_from_attrs(da)}: {sizes}"]
    keys = [k for k in ("method", "metric", "model", "backend") if k in da.attrs]
    if keys:
        lines.append(" · ".join(f"{k}: {da.attrs[k]}" for k in keys))
    if finite.size:
        lines.append(f"min {finite.min():.4g} · mean {finite.mean():.4g} · max {finite.max():.4g}")
    counts = [
        (int(np.isnan(values).sum()), "not computed (NaN)"),
        (int(np.isinf(values).sum()), "infinite"),
    ]
    lines += [f"{n} cells {what}" for n, what in counts if n]
    pooled = [d for d in ("seed", "prompt") if d in da.dims]
    mean = da.mean(pooled) if pooled else da
    flat = np.abs(
        np.nan_to_num(np.asarray(mean.values, dtype=float), nan=0, posinf=0, neginf=0)
    ).ravel()
    if mean.ndim and top > 0 and flat.any():
        best = []
        for i in np.argsort(-flat)[:top]:
            at = dict(zip(mean.dims, np.unravel_index(i, mean.shape), strict=True))
            cell = mean.isel(at)
            where = ", ".join(f"{d} {cell[d].item()}" for d in mean.dims)
            best.append(f"{where}: {float(cell):.4g}")
        lines.append(
            ("strongest (mean over " + " and ".join(pooled) + "): " if pooled else "strongest: ")
            + "; ".join(best)
        )
    return Summary(da, lines)


def legend_title(text: str) -> str | list[str]:
    """A legend title that is never cut: ``text`` itself, or its words wrapped into lines
    of at most ``LEGEND_CHARS`` characters (a word longer than that is its own line)."""
    if len(text) <= LEGEND_CHARS:
        return text
    return textwrap.wrap(text, LEGEND_CHARS, break_long_words=False, break_on_hyphens=False)


def _panel(
    da: xr.DataArray,
    *,
    x: str,
    y: str,
    enc: dict[str, Any],
    labels: tuple[str, ...] | None,
    ticks: Mapping[str, str],
    has_inf: bool,
    legend: str,
) -> alt.Chart | alt.LayerChart:
    """One grid of cells with its data inline; ``enc`` holds the shared colour and tooltip.

    Args:
        da: the cells, every dim already an axis or a facet.
        x: coord on the horizontal axis.
        y: coord on the vertical axis.
        enc: colour (and tooltip) encodings, computed from the whole array so panels agree.
        labels: names of the 0 and 1 states for a binary mask (of codes 0..K-1 for
            categories), else None.
        ticks: axis dim -> label coord giving its tick labels.
        has_inf: some cell of the whole array is +-inf: add the layer that marks them.
        legend: the full value description, for the tooltip of infinite cells.
    """
    edges: dict[str, tuple[tuple[Hashable, ...], np.ndarray]] = {}
    for n in (x, y):
        if _kind(da, n) == "Q":
            edges[f"{n}_start"], edges[f"{n}_end"] = _edges(da[n], _axis_dim(da, n, "axis"))
    cols = _columns(da.assign_coords(edges))
    cols = _drop_outside(cols, [n for n in cols if n not in (_VALUE, _INFINITE)])
    if labels:
        state = (lambda v: labels[int(v)]) if len(labels) > 2 else (lambda v: labels[bool(v)])
        cols[_STATE] = [NAN_LABEL if v is None else state(v) for v in cols[_VALUE]]
    keys = list(cols)
    data = {
        "values": [dict(zip(keys, row, strict=True)) for row in zip(*cols.values(), strict=True)]
    }
    base = alt.Chart(data).encode(
        **_position(da, x, "x", cols, ticks), **_position(da, y, "y", cols, ticks)
    )
    cells = base.mark_rect(invalid="show").encode(**enc)
    if has_inf:
        marked = base.transform_filter(f"datum.{_INFINITE} != null")
        tips = [t for t in enc.get("tooltip", []) if t.to_dict()["field"] != _VALUE]
        tips = [*tips, alt.Tooltip(f"{_INFINITE}:N", title=legend)] if "tooltip" in enc else []
        cells = alt.layer(
            cells,
            marked.mark_rect(color=INF_COLOR).encode(**({"tooltip": tips} if tips else {})),
            marked.mark_text(color="white", fontSize=9).encode(text=f"{_INFINITE}:N"),
        )
    return cells.properties(width=_size(da, x), height=_size(da, y))


def _inside(da: xr.DataArray) -> np.ndarray:
    """True for cells that are drawn: every float coord of the cell is finite (``_drop_outside``
    drops the others, e.g. layers past a shallower model's depth); shaped like ``da``."""
    inside = np.ones(da.shape, dtype=bool)
    for name in _coord_names(da):
        coord = da[name]
        if coord.dtype.kind == "f" and not np.isfinite(coord.values).all():
            inside &= np.isfinite(coord).broadcast_like(da).transpose(*da.dims).values
    return inside


def _header(da: xr.DataArray, dim: str) -> alt.Header:
    """Facet headers that read as titles: the value, integers as "cluster 3"."""
    expr = f"'{dim} ' + datum.value" if _kind(da, dim) == "O" else "datum.value"
    return alt.Header(
        title=None, labelExpr=expr, labelFontSize=12, labelFontWeight="bold", labelLimit=400
    )


def _facet_label(da: xr.DataArray, dim: Hashable, value: Any) -> str:
    """Panel title part for one facet value: the value, integers as "cluster 3"."""
    return f"{dim} {value}" if _kind(da, str(dim)) == "O" else str(value)


def _facet_selections(da: xr.DataArray, dim: str | None) -> list[dict[str, Any]]:
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
    raise ValueError(
        f"{role}={name!r} is neither a dim nor a label coord of da; da has "
        f"dims {tuple(da.dims)} and coords {tuple(da.coords)}."
    )


def _coord_names(da: xr.DataArray) -> list[str]:
    """Dims (with or without coords), then label coords, then scalar coords."""
    rest = sorted((c for c in da.coords if c not in da.dims), key=lambda c: da[c].ndim == 0)
    return [str(n) for n in [*da.dims, *rest]]


def _columns(da: xr.DataArray) -> dict[str, list[Any]]:
    """One flat list per coord (see ``_coord_names``) and the values, cell-aligned.

    NaN and +-inf become ``None`` (JSON null) so Vega-Lite sees "missing", never 0, and the
    spec stays valid JSON; when some value is infinite, an ``infinite`` column holds "+∞" or
    "−∞" for those cells (None elsewhere).
    """
    shape = da.shape
    cols: dict[str, list[Any]] = {}
    for name in _coord_names(da):
        coord = da[name]
        own = [d for d in da.dims if d in coord.dims]
        arr = coord.transpose(*own).values.reshape(
            [s if d in own else 1 for d, s in zip(da.dims, shape, strict=True)]
        )
        cols[name] = _jsonable(np.broadcast_to(arr, shape).ravel())
    values = da.values.ravel()
    cols[_VALUE] = _jsonable(values)
    if values.dtype.kind == "f" and np.isinf(values).any():
        marks = np.where(values > 0, "+∞", "−∞").astype(object)
        marks[~np.isinf(values)] = None
        cols[_INFINITE] = marks.tolist()
    return cols


def _jsonable(arr: np.ndarray) -> list[Any]:
    """Plain Python values with NaN and +-inf as None (JSON has no such numbers)."""
    if arr.dtype == bool:
        return arr.astype(int).tolist()
    if arr.dtype.kind == "f":
        finite = np.isfinite(arr)
        if finite.all():
            return arr.tolist()
        values = arr.astype(object)
        values[~finite] = None
        return values.tolist()
    if arr.dtype.kind in "iu":
        return arr.tolist()
    return [str(v) for v in arr.tolist()]


def _drop_outside(cols: dict[str, list[Any]], coord_names: list[str]) -> dict[str, list[Any]]:
    """Drop cells whose coordinates are NaN: positions outside a model, e.g. layers past a
    shallower model's depth after ``xr.concat`` along ``model``."""
    bad = [n for n in coord_names if None in cols[n]]
    if not bad:
        return cols
    keep = [all(cols[n][i] is not None for n in bad) for i in range(len(cols[_VALUE]))]
    return {k: [v for v, ok in zip(col, keep, strict=True) if ok] for k, col in cols.items()}


def _edges(
    coord: xr.DataArray, dim: Hashable
) -> tuple[tuple[tuple[Hashable, ...], np.ndarray], tuple[tuple[Hashable, ...], np.ndarray]]:
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


def _order(da: xr.DataArray, name: str) -> list[Any]:
    """Coordinate values in array order, for sorting axes and facets as stored."""
    return list(dict.fromkeys(_jsonable(da[name].values.ravel())))


def _position(
    da: xr.DataArray,
    name: str,
    channel: str,
    cols: dict[str, list[Any]],
    ticks: Mapping[str, str],
) -> dict[str, Any]:
    """Encoding for one axis: banded for discrete coords, start and end for continuous ones.

    A discrete axis named in ``ticks`` shows that label coord's values as its tick labels
    (e.g. the tokens at each position), looked up from the coordinate in the label expression.
    """
    cls, cls2 = (alt.X, alt.X2) if channel == "x" else (alt.Y, alt.Y2)
    if _kind(da, name) != "Q":
        present = set(cols[name])
        sort = [v for v in _order(da, name) if v in present]
        axis: dict[str, Any] = {}
        if name in ticks and name in da.dims:
            keys = json.dumps(_jsonable(da[name].values))
            texts = json.dumps([str(t) for t in da[ticks[name]].values.tolist()])
            axis = {
                "axis": alt.Axis(
                    labelExpr=f"{texts}[indexof({keys}, datum.value)]",
                    labelAngle=-45 if channel == "x" else 0,
                    labelLimit=120,
                ),
                "title": f"{name} ({ticks[name]})",
            }
        return {channel: cls(f"{name}:{_kind(da, name)}", sort=sort, **{"title": name, **axis})}
    lo, hi = min(cols[f"{name}_start"], default=0), max(cols[f"{name}_end"], default=1)
    scale = alt.Scale(domain=[lo, hi], nice=False, zero=False, reverse=channel == "y")
    return {
        channel: cls(f"{name}_start:Q", title=name, scale=scale),
        f"{channel}2": cls2(field=f"{name}_end"),
    }


def _size(da: xr.DataArray, name: str) -> alt.Step | int:
    """Panel width/height: a fixed span for continuous axes, else a step per cell small enough
    that a 36 x 32 grid fits a notebook column."""
    if _kind(da, name) == "Q":
        return 320
    return alt.Step(int(np.clip(480 // max(len(_order(da, name)), 1), 6, 22)))


def _color(
    finite: np.ndarray,
    *,
    binary: bool,
    has_nan: bool,
    center: float | None,
    ends: tuple[float, float] | None = None,
    color: str | Sequence[str] | None,
    labels: tuple[str, ...],
    title: str | list[str],
) -> alt.Color:
    """Colour encoding chosen from the data: binary, diverging or sequential."""
    # A scheme is the caller's str; Altair's stubs type ``scheme=`` as a Literal of Vega's
    # names (hence the two ``type: ignore[arg-type]``), and ``to_dict`` checks it against the
    # schema when the spec is built.
    scheme = color if isinstance(color, str) else None
    custom = None if color is None or scheme else list(color)
    if binary:
        nan = [NAN_LABEL] if has_nan else []
        if len(labels) > 2:  # categories: legend in code order
            domain = list(labels) + nan
            scale = (
                alt.Scale(domain=domain, range=custom + [NAN_COLOR] * len(nan))
                if custom
                else alt.Scale(domain=domain, scheme=scheme or "category10")  # type: ignore[arg-type]
            )
            return alt.Color(f"{_STATE}:N", scale=scale, title=title)
        domain = [labels[1], labels[0], *nan]
        if scheme:
            scale = alt.Scale(domain=domain, scheme=scheme)  # type: ignore[arg-type]
        else:
            off, on = custom or BINARY_COLORS
            scale = alt.Scale(domain=domain, range=[on, off, NAN_COLOR][: len(domain)])
        return alt.Color(f"{_STATE}:N", scale=scale, title=title)
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if ends is not None:
        lo, hi = float(ends[0]), float(ends[1])
    hi = hi if hi > lo else lo + 1.0  # constant data: any non-empty domain
    if center is not None or lo < 0 < hi:
        mid = 0.0 if center is None else float(center)
        if mid == 0:  # signed scores: equal magnitudes get equal colours
            half = max(abs(lo), abs(hi)) or 1.0
            lo, hi = -half, half
        kw: dict[str, Any] = {"domain": [min(lo, mid), max(hi, mid)], "domainMid": mid}
        default: Any = {"name": "redblue", "extent": [1, 0]}  # blue below, red above
    else:
        kw, default = {"domain": [lo, hi]}, "viridis"
    if custom:
        kw["range"] = custom
    else:
        kw["scheme"] = scheme or default
    return alt.Color(f"{_VALUE}:Q", scale=alt.Scale(**kw), title=title)


def _tooltip(da: xr.DataArray, binary: bool, legend: str) -> list[alt.Tooltip]:
    """Every coordinate of a cell (dims, then label coords, then scalar coords), then its value."""
    tips = []
    for name in _coord_names(da):
        kind = _kind(da, name)
        fmt: dict[str, Any] = {"format": ".3f"} if kind == "Q" else {}
        tips.append(alt.Tooltip(f"{name}:{kind}", title=TIP_TITLES.get(name, name), **fmt))
    if binary:
        tips.append(alt.Tooltip(f"{_STATE}:N", title="state"))
    tips.append(alt.Tooltip(f"{_VALUE}:Q", title=legend, format=".4g"))
    return tips


def _subtitle(da: xr.DataArray, *, has_nan: bool, has_inf: bool, colour: str | None) -> list[str]:
    """Subtitle lines: what the colour shows (when the legend title is short or the title is
    not the description), provenance (model, method, metric), a ``note`` attr, and what
    grey and dark marked cells mean, each only when such a cell is drawn."""
    keys = [
        k
        for k in ("model", "method", "metric")
        if k in da.attrs
        and k not in da.dims
        and k not in da.coords
        and da.attrs[k] not in ("", "none")
    ]  # a coord says more
    lines = [f"colour: {colour}"] if colour else []
    if keys:
        lines.append(" · ".join(f"{k}: {da.attrs[k]}" for k in keys))
    if da.attrs.get("note"):
        lines.append(str(da.attrs["note"]))
    marks = ([f"grey: {NAN_LABEL}"] if has_nan else []) + (
        ["+∞ / −∞: infinite value"] if has_inf else []
    )
    if marks:
        lines.append(" · ".join(marks))
    return lines


def logit_lens_chart(
    da: xr.DataArray, *, title: str | None = None, actions: bool = False
) -> ChartType:
    """Draw a logit lens: the target's probability per layer (rows) and input token (columns).

    Read a column upwards from layer 0: the layer where its colour turns bright is where the
    residual stream first predicts the target; hover a cell for the top tokens there and
    the target's rank.

    Args:
        da: ``lsc.logit_lens``'s ``target_prob`` (layer, pos) with coords ``token`` (pos),
            ``target_rank``, ``top_token`` and ``top_tokens`` (layer, pos).
        title: chart title (default: "Logit lens: " and the description from the attrs).
        actions: show Vega's actions menu (its "Open in Vega Editor" link goes online).

    Returns:
        A heatmap with the input tokens in order on the x axis, layer on the y axis and
        the probability on a fixed 0-1 colour scale.

    Raises:
        ValueError: if ``da`` is not (layer, pos) or lacks the ``token`` coord.
    """
    if not isinstance(da, xr.DataArray) or set(da.dims) != {"layer", "pos"}:
        got = tuple(da.dims) if isinstance(da, xr.DataArray) else type(da).__name__
        raise ValueError(
            f"logit_lens_chart takes lsc.logit_lens(...)'s (layer, pos) DataArray, got {got}; "
            "select one prompt first."
        )
    if "token" not in da.coords:
        raise ValueError(
            "logit_lens_chart needs the 'token' coord on pos (the input tokens) for the x "
            f"axis; da has coords {tuple(map(str, da.coords))}."
        )
    _validate.text("title", title, example="'Logit lens'", optional=True)
    how = "each row: the residual stream after that layer read as the output; hover: top tokens"
    return heatmap(
        da.assign_attrs(note=how),
        x="pos",
        y="layer",
        domain=(0.0, 1.0),
        title=title or f"Logit lens: {name_from_attrs(da)}",
        actions=actions,
    )


def enable_offline() -> None:
    """Make Jupyter charts load Vega from vl-convert instead of a CDN (works with no internet).

    Switches Altair to its ``"jupyter"`` renderer (charts display as ``alt.JupyterChart``
    widgets) and bundles the JavaScript once. Bundling takes about 1.5 s (switching the
    renderer, microseconds), so lenscape calls this when the first ``Explorer`` is built,
    not at import.
    """
    alt.renderers.enable("jupyter", offline=True)
    alt.JupyterChart.enable_offline()
    alt.JupyterChart._esm = unique_svg_ids(alt.JupyterChart._esm)


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


def agreement(report: xr.Dataset, *, width: int = 220, height: int = 220) -> alt.HConcatChart:
    """Scatter of estimated vs exact prompt-mean effects, one panel per component type.

    Args:
        report: ``lsc.faithfulness(...)``'s Dataset (``exact_heads``, ``estimate_heads``,
            ``exact_blocks``, ``estimate_blocks``, ``pearson_means``).
        width, height: of each panel, in pixels.

    Returns:
        Panels for heads, attention blocks and MLP blocks side by side; x = exact activation
        patching, y = estimate, one colour per estimator, the line y = x for reference, and
        each estimator's Pearson r over prompt means in the panel title (named so: the
        report's ``pearson_cells`` is another statistic, r over single cells). No actions
        menu: its "Open in Vega Editor" link sends the chart to an outside site.

    Raises:
        TypeError: ``report`` is not a Dataset, or a size is not a positive integer.
        ValueError: ``report`` lacks a variable of ``lsc.faithfulness``'s report.
    """
    _validate.result(
        "report",
        report,
        kind=xr.Dataset,
        made_by="lsc.faithfulness",
        variables=(
            "exact_heads",
            "estimate_heads",
            "exact_blocks",
            "estimate_blocks",
            "pearson_means",
        ),
    )
    width = _validate.positive_int("width", width)
    height = _validate.positive_int("height", height)
    units = report["exact_heads"].attrs.get("units", "")
    panels = [
        _agreement_panel(report, ctype, units=units, width=width, height=height)
        for ctype in report["component_type"].values.tolist()
    ]
    attrs = report.attrs
    return (
        alt.hconcat(*panels)
        .properties(
            title=alt.Title(
                "Can I trust the fast map? Estimate vs exact activation patching (prompt means)",
                subtitle=f"{attrs.get('model', '')}, {attrs.get('n_prompts', '?')} prompts of "
                f"{attrs.get('prompt_set', '?')}, metric {attrs.get('metric', '?')}",
            ),
            usermeta={"embedOptions": {"actions": False}},
        )
        .configure_view(stroke=None)
    )


#: Panel titles of ``agreement`` per component type.
_COMPONENT_TYPES = {"head": "heads", "attn": "attention blocks", "mlp": "MLP blocks"}


def _agreement_panel(
    report: xr.Dataset, ctype: str, *, units: str, width: int, height: int
) -> alt.LayerChart:
    """One ``agreement`` panel: the prompt-mean effects of one component type, estimate
    against exact, with the line y = x and each estimator's r in the subtitle."""
    if ctype == "head":
        exact, estimate = report["exact_heads"], report["estimate_heads"]
    else:
        exact = report["exact_blocks"].sel(component=ctype)
        estimate = report["estimate_blocks"].sel(component=ctype)
    exact, estimate = exact.mean("prompt"), estimate.mean("prompt")
    rows, not_computed = _agreement_rows(exact, estimate)
    values = [row[key] for row in rows for key in ("exact", "estimate")]
    low, high = (min(values), max(values)) if values else (0.0, 1.0)
    r_means = report["pearson_means"].sel(component_type=ctype)
    r_text = "r over prompt means: " + ", ".join(
        f"{float(r):.2f} ({label})" if np.isfinite(r) else f"undefined ({label})"
        for label, r in zip(r_means["estimator"].values.tolist(), r_means.values, strict=True)
    )
    if not_computed:
        r_text += f"; {not_computed} cells {NAN_LABEL} (NaN), not drawn"
    diagonal = (
        alt.Chart(
            alt.Data(values=[{"exact": low, "estimate": low}, {"exact": high, "estimate": high}])
        )
        .mark_line(color="#999999", strokeDash=[4, 4])
        .encode(x="exact:Q", y="estimate:Q")
    )
    tooltip = [alt.Tooltip(f"{dim}:O") for dim in exact.dims] + [
        alt.Tooltip("estimator:N"),
        alt.Tooltip("exact:Q", format=".3f"),
        alt.Tooltip("estimate:Q", format=".3f"),
    ]
    points = (
        alt.Chart(alt.Data(values=rows))
        .mark_circle(size=28, opacity=0.7)
        .encode(
            x=alt.X(
                "exact:Q",
                title=f"exact patching effect ({units})",
                scale=alt.Scale(domain=[low, high]),
            ),
            y=alt.Y("estimate:Q", title=f"estimate ({units})", scale=alt.Scale(domain=[low, high])),
            color=alt.Color("estimator:N", title="estimator"),
            tooltip=tooltip,
        )
    )
    return alt.layer(diagonal, points).properties(
        width=width,
        height=height,
        title=alt.Title(_COMPONENT_TYPES.get(ctype, ctype), subtitle=r_text),
    )


def _agreement_rows(
    exact: xr.DataArray, estimate: xr.DataArray
) -> tuple[list[dict[Hashable, Any]], int]:
    """One point per cell and estimator where both values are finite.

    Args:
        exact: prompt-mean exact effects, e.g. (layer, head).
        estimate: the same with an ``estimator`` dim first.

    Returns:
        The points (the cell's coordinates, ``estimator``, ``exact``, ``estimate``) and how
        many (cell, estimator) pairs have no place on the axes (NaN or infinite).
    """
    rows, not_computed = [], 0
    for label in estimate["estimator"].values.tolist():
        est = estimate.sel(estimator=label)
        for index in np.ndindex(exact.shape):
            if not (np.isfinite(exact.values[index]) and np.isfinite(est.values[index])):
                not_computed += 1
                continue
            cell = {
                dim: int(exact[dim].values[i]) for dim, i in zip(exact.dims, index, strict=True)
            }
            rows.append(
                {
                    **cell,
                    "estimator": label,
                    "exact": float(exact.values[index]),
                    "estimate": float(est.values[index]),
                }
            )
    return rows, not_computed
