"""Heatmaps of result DataArrays: one function maps dims to visual roles, the data picks the scale.

``heatmap(da, x="head", y="layer", facet_col="model")`` turns a DataArray into an Altair chart.
Each dim of ``da`` must get a role (an axis or a facet); anything else is reduced first by the
caller (``da.mean("prompt")``, ``da.sel(seed=0)``), so a picture never silently averages.
The data's declared type decides the colour scale, never its values: a mask
(``lenscape.mask_rules`` says what counts as one and as kept) gets two named colours with a
legend, a signed score a diverging scale centred at 0, anything else a sequential one.
Scores that span orders of magnitude take a symmetric-log scale (``scale="auto"``: the
views' rule, ``encoding.pick_scale``), its legend in true values and a subtitle line that
says so; ``scale="linear"`` or ``"symlog"`` picks one.
Titles, legend and axis titles come from the metadata (``long_name``, ``units``, dim names);
tooltips show every coordinate of a cell and its value. NaN means "not computed" and is
drawn grey (the subtitle says so only when a drawn cell is NaN, and says when every cell
is); +inf and -inf are drawn as dark cells marked "+∞" / "−∞", and the spec never holds a
non-JSON number.

A mean with its interval (``lenscape.aggregate.mean``: a ``bound`` dim holding mean, low
and high) is drawn as its mean, with the cells whose interval includes 0 hatched (their
sign is not sure; a legend entry says so), the bounds and the prompt count N in every
tooltip and a subtitle that counts the hatched cells and says how the interval was made.
A fast estimate with its per-cell error estimate (an ``error`` coord on every drawn dim:
``attribution_patching(error=True)``, ``activation_patching(refine="auto")``) is hatched
the same way where the error estimate is at least the estimate's size (estimate -/+ error
includes 0), with the error in every tooltip; a mean of such estimates with its interval
(``aggregate.mean`` keeps the error) is hatched where the interval, widened on each side by
the error estimate, includes 0.

A heatmap reads its array by label: axes and facets run in label order
(``encoding.in_label_order``: layers, heads and other numbers ascending, components in the
schema's vocabulary order, edges in the graph's order), never in the array's order, so a
``sortby``, ``isel`` or ``transpose`` of the same result draws the same picture.

The cells are written into the spec as inline values when the chart is built. Altair's
5,000-row guard applies only to DataFrames handed to it, so grids above that size work on
purpose; ``MAX_CELLS`` is lenscape's own, larger guard against specs a browser cannot draw.
Charts carry no actions menu (its "Open in Vega Editor" link is the one route to the
internet) unless asked for with ``actions=True``; ``lenscape.views.offline`` renders them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import textwrap
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import altair as alt
import numpy as np
import xarray as xr
from altair.typing import ChartType

from lenscape import _validate
from lenscape.aggregate import BOUNDS, TOKEN, TOKENS_DIFFER, token_labels
from lenscape.bootstrap import percent
from lenscape.mask_rules import MASK_UNITS, NAN_LABEL, STATES, is_mask
from lenscape.schema import LABEL_COORDS, name_from_attrs

from .encoding import (
    AFTER_VALUE,
    INFINITE,
    SCALES,
    STATE,
    SYMLOG_SHARE,
    VALUE,
    axis_encoding,
    cell_columns,
    cell_tooltip,
    coord_names,
    coord_order,
    in_label_order,
    pick_scale,
    symlog_ticks,
    unchecked_build,
    vega_type,
)

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
#: Longest legend title on one line; longer ones put their units on a line of their own.
LEGEND_CHARS = 24
#: Longest line of a legend title (its quantity; Vega cuts a title at ``LEGEND_LIMIT`` px).
LEGEND_LINE = 30
#: Widest legend title and label in pixels (Vega's default, 180, cut longer quantities).
LEGEND_LIMIT = 220
#: Widest title and subtitle line in pixels: Vega-Lite would cut them at the chart's width
#: (a 3-head chart is 66 px wide), hiding what a view shows.
TITLE_LIMIT = 1600
#: Longest subtitle line in characters (about 900 px at the subtitle's 12 px): longer ones wrap.
LINE_CHARS = 140
#: The widest a row of independent panels draws its cells (``_panel_grid``), leaving room
#: for tick labels and the legend in a notebook output area of about 1,000 px.
ROW_PX = 720
#: Facet panels per row when ``columns`` is not given.
FACET_COLUMNS = 4
#: Label coords drawn as tick labels of their axis by default (tokens of an attention pattern).
TOKEN_COORDS = {"query_pos": "query_token", "key_pos": "key_token", "pos": "token"}
#: The dim of an interval result (``lenscape.aggregate.mean``) that holds mean, low, high.
BOUND = "bound"
#: The coord of a fast estimate's per-cell error estimate (``attribution_patching(error=True)``).
ERROR = "error"
#: The hatch over a cell whose interval includes 0: three strokes in the [-1, 1] box of a
#: Vega symbol, which Vega scales to the mark's size (the cell's).
HATCH = "M-1,0L0,-1M-1,1L1,-1M0,1L1,0"
#: Colour of the hatch strokes.
HATCH_COLOR = "#303030"
#: Field of the inline data naming a hatched cell's state (the legend entry), else null.
UNSURE = "unsure"


def label_from_attrs(da: xr.DataArray, default: str = VALUE) -> str:
    """``"long_name (units)"`` from the attrs (the name, or ``default``, without ``long_name``)."""
    name = name_from_attrs(da, default)
    units = da.attrs.get("units")
    return f"{name} ({units})" if units and units != MASK_UNITS else name


def legend_title(text: str) -> str | list[str]:
    """A legend title that is never cut and keeps the quantity on one line and the units on
    the next: "attribution (logit diff)" -> ["attribution", "(logit diff)"]; ``text``
    itself when it fits ``LEGEND_CHARS``; a quantity longer than ``LEGEND_LINE`` wraps
    between words (a word longer than that is its own line)."""
    if len(text) <= LEGEND_CHARS:
        return text
    name, units = text, ""
    if text.endswith(")") and " (" in text:
        cut = text.rindex(" (")
        name, units = text[:cut], text[cut + 1 :]
    lines = (
        [name]
        if len(name) <= LEGEND_LINE
        else textwrap.wrap(name, LEGEND_LINE, break_long_words=False, break_on_hyphens=False)
    )
    return [*lines, units] if units else lines


def wrap_line(line: str, chars: int | None = None) -> list[str]:
    """A title or subtitle line as lines of at most ``chars`` (``LINE_CHARS``) characters,
    broken between words, so that a long sentence never widens a chart past a notebook's
    output area."""
    return textwrap.wrap(line, chars or LINE_CHARS, break_long_words=False) or [line]


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


# long: eighteen keyword options (the signature is half its lines), checked in one call
@unchecked_build
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
    scale: str = "auto",
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
            (model, layer, head) with ``x="head", y="layer", facet_col="model"``. A mean
            with its interval (``lsc.aggregate.mean`` or ``da.lsc.mean("prompt")``: a
            ``bound`` dim of mean, low, high that no role names) draws the mean, hatches
            the cells whose interval includes 0 and shows low, high and N in the tooltips.
            An estimate with an ``error`` coord on every dim (``attribution_patching(...,
            error=True)`` of one prompt, or ``scores.mean("prompt").assign_coords(error=
            scores["error"].mean("prompt"))``: a mean's error is at most the mean error)
            hatches the cells whose error estimate is at least their |value|.
        x: dim or label coord on the horizontal axis. ``"depth"`` (relative depth, a coord on
            ``layer``) puts models of different depth on one shared [0, 1] axis.
        y: dim or label coord on the vertical axis (first label at the top).
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
            (default: the data's finite range); on signed scores, a diverging scale
            symmetric about 0 that covers it (views of several slices share one this way).
        scale: the colour scale of continuous values: "linear", "symlog" (linear within
            ``SYMLOG_SHARE`` of the largest |value|, logarithmic beyond, the legend ticked
            at its powers of ten in true values and the subtitle saying so), or "auto"
            (symlog when the values span orders of magnitude: ``encoding.pick_scale``).
            Masks and categories take neither.
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
            message says how to reduce it), a dim's labels repeat, an option is out of
            range (an unknown colour scheme, ``domain`` with low >= high ...), a mask or
            category array holds infinities, or a ``bound`` dim holds other labels than
            mean, low and high.
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
        scale=scale,
        labels=labels,
        categories=categories,
        title=title,
        tick_labels=tick_labels,
        flags={"tooltip": tooltip, "independent": independent, "actions": actions},
    )
    da, interval = _split_interval(da, roles={x, y, facet_row, facet_col})
    da = in_label_order(da)
    columns = _validate.positive_int(
        "columns", columns, none_means=f"{FACET_COLUMNS} panels per row"
    )
    _check_roles(da, x=x, y=y, facet_row=facet_row, facet_col=facet_col)
    cells = _read_cells(da, binary=binary, labels=labels, categories=categories)
    cells = dataclasses.replace(cells, interval=interval)
    da, ticks, position_notes = _position_labels(da, x=x, y=y)
    kind = "linear" if cells.binary else pick_scale(cells.finite, scale)
    enc, scale_note = _encodings(
        da, cells, color=color, center=center, domain=domain, scale=kind, tooltip=tooltip
    )
    panel = functools.partial(
        _panel,
        x=x,
        y=y,
        enc=enc,
        labels=cells.states if cells.binary else None,
        ticks={**ticks, **(tick_labels or {})},
        has_inf=cells.has_inf,
        legend=cells.label,
        unsure=interval.label if interval else None,
    )
    chart = _arrange(
        da,
        panel,
        x=x,
        facet_row=facet_row,
        facet_col=facet_col,
        columns=columns or FACET_COLUMNS,
        independent=independent,
    )
    notes = [scale_note, *position_notes]
    return _framed(chart, da, cells, title=title, actions=actions, notes=notes)


def _position_labels(
    da: xr.DataArray, *, x: str, y: str
) -> tuple[xr.DataArray, dict[str, str], list[str]]:
    """The tick labels of token axes (``TOKEN_COORDS``) and what the subtitle says of them.

    A ``pos`` axis is labelled with the tokens: those of the one prompt shown (a ``token``
    coord on pos), or those every prompt shares at each position (a (prompt, pos) coord,
    ``aggregate.token_labels``): a position whose tokens differ is labelled so ("pos 7
    (tokens differ)") and the subtitle warns that a mean over prompts there mixes words. A
    pos axis without tokens says in the subtitle that they are lost (xarray's
    ``da.mean("prompt")`` drops the coord; ``lsc.aggregate.mean`` keeps it).

    Returns:
        ``da`` (with a 1-D ``shared_token`` coord where the tokens were per prompt), the
        axis dim -> label coord of the tick labels, and the subtitle lines.
    """
    ticks = {d: c for d, c in TOKEN_COORDS.items() if c in da.coords and da[c].dims == (d,)}
    if "pos" not in (x, y):
        return da, ticks, []
    token = da.coords.get(TOKEN)
    if token is None or "pos" not in token.dims or token.ndim > 2:
        lost = "the token labels are lost" if da.attrs.get("positions") == "each" else "no tokens"
        return (
            da,
            ticks,
            [
                f"pos: numbered only, {lost} (xarray's da.mean('prompt') drops the (prompt, "
                "pos) token coord; lsc.aggregate.mean(da, 'prompt') keeps one per position)"
            ],
        )
    if token.dims == ("pos",):
        labels = token.values.astype(str)
        name = TOKEN
    else:
        (pooled,) = (d for d in token.dims if d != "pos")
        labels = token_labels(da, str(pooled)).values
        name = "shared_token"
    positions = da["pos"].values.tolist()
    labels = np.array(
        [str(t) if str(t) else f"pos {p}" for p, t in zip(positions, labels, strict=True)],
        dtype=object,
    )
    da = da.assign_coords({name: ("pos", labels)})
    mixed = sum(TOKENS_DIFFER in str(t) for t in labels)
    notes = []
    if mixed:
        where = (
            "the axis names the position only"
            if "prompt" in da.dims
            else "a mean over prompts there mixes words"
        )
        notes.append(
            f"tokens differ between the prompts at {mixed} of {len(labels)} positions "
            f"(labelled '{TOKENS_DIFFER}'): {where}"
        )
    return da, {**ticks, "pos": name}, notes


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
    scale: Any,
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
    _validate.choice("scale", scale, SCALES)
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
        interval = "; da.lsc.mean('prompt') gives the mean with its 95% interval"
        raise ValueError(
            f"da has dims {tuple(da.dims)}, and {extra} {verb} not x, y or a facet. "
            f"Reduce first, e.g. da.mean({d!r}) or da.sel({d}={first!r}), "
            f"or facet with facet_row={d!r}{interval if d == 'prompt' else ''}."
        )
    if da.size > MAX_CELLS:
        raise ValueError(
            f"{da.size} cells exceed lenscape.views.heatmaps.MAX_CELLS={MAX_CELLS}; "
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
        interval: the mean's interval, where ``da`` was one (see ``_split_interval``).
    """

    binary: bool
    states: tuple[str, ...]
    finite: np.ndarray
    has_nan: bool
    has_inf: bool
    label: str
    interval: _Interval | None = None


@dataclasses.dataclass(frozen=True)
class _Interval:
    """What an interval result adds to a heatmap.

    Attributes:
        label: the legend entry of a hatched cell ("95% interval includes 0").
        lines: subtitle lines: how many cells are hatched and how the interval was made,
            and why some cells have none.
    """

    label: str
    lines: list[str]


def _split_interval(
    da: xr.DataArray, *, roles: set[str | None]
) -> tuple[xr.DataArray, _Interval | None]:
    """An interval result (a ``bound`` dim no role names) as its mean with ``low`` and
    ``high`` coords (tooltips show them, ``_panel`` hatches from them); anything else as it is.

    Raises:
        ValueError: a ``bound`` dim whose labels are not mean, low and high.
    """
    if BOUND not in da.dims or BOUND in roles:
        return _split_error(da)
    labels = da[BOUND].values.tolist() if BOUND in da.coords else []
    if sorted(map(str, labels)) != sorted(BOUNDS):
        raise ValueError(
            f"da has a {BOUND!r} dim with labels {labels}, not {list(BOUNDS)} as "
            "lsc.aggregate.mean gives; pick one with da.sel(bound=...) or draw each as a "
            "panel with facet_col='bound'."
        )
    ci = da.attrs.get("ci")
    share = percent(ci) if isinstance(ci, float) else "the"
    low, high = (da.sel({BOUND: b}, drop=True) for b in ("low", "high"))
    what = f"{share} interval"
    # A mean of fast estimates (aggregate.mean of an error=True result) is uncertain twice:
    # over prompts (the interval) and by the estimator's own error, so both widen it.
    error = da.coords.get(ERROR)
    if error is not None and BOUND not in error.dims and set(error.dims) == set(low.dims):
        error = error.transpose(*low.dims)
        low, high = low - error, high + error
        what += " widened by the error estimate"
    shown = da.sel({BOUND: "mean"}, drop=True).assign_coords(
        low=(low.dims, low.values, {"long_name": f"{what}: low"}),
        high=(high.dims, high.values, {"long_name": f"{what}: high"}),
    )
    unsure = int(((low <= 0) & (high >= 0)).sum())
    label = f"{what} includes 0"
    lines = [
        f"hatched: {label}, the sign is not sure ({unsure} of {shown.size} cells)"
        + (f"; {str(da.attrs['interval']).split(':')[0]}" if "interval" in da.attrs else "")
        + (f", {da.attrs['n_resamples']} resamples" if "n_resamples" in da.attrs else "")
    ]
    if da.attrs.get("interval_note"):
        lines.append(str(da.attrs["interval_note"]))
    return shown, _Interval(label=label, lines=lines)


def _split_error(da: xr.DataArray) -> tuple[xr.DataArray, _Interval | None]:
    """A fast estimate with its per-cell error estimate (an ``error`` coord on every dim of
    ``da``, as ``attribution_patching(error=True)`` gives it) as the estimate with ``low`` and
    ``high`` = estimate -/+ error, so the cells whose error could flip the sign are hatched
    as an interval's are; anything else as it is.

    Raises:
        ValueError: an ``error`` coord that is negative somewhere (not an error estimate).
    """
    if ERROR not in da.coords or set(da[ERROR].dims) != set(da.dims) or not da.dims:
        return da, None
    error = da[ERROR].transpose(*da.dims)
    if bool((error < 0).any()):
        raise ValueError(
            "da's 'error' coord is negative somewhere; an error estimate is a size (>= 0), "
            "as attribution_patching(error=True) gives it. Drop it (da.drop_vars('error')) "
            "or pass its absolute value."
        )
    low, high = da - error, da + error
    shown = da.assign_coords(
        low=(da.dims, low.values, {"long_name": "estimate - error estimate"}),
        high=(da.dims, high.values, {"long_name": "estimate + error estimate"}),
    )
    unsure = int(((low <= 0) & (high >= 0)).sum())
    label = "error estimate >= |estimate|"
    # the method's name only ("trapezoid"): its formula, a line of its own, is in the
    # coord's attrs and the tooltips' reach, not in a subtitle
    method = da.attrs.get("error_method") or str(error.attrs.get("method", "")).split(":")[0]
    lines = [
        f"hatched: {label}, the sign is not sure ({unsure} of {da.size} cells)"
        + (f"; error estimate: {method} (its formula: the error coord's attrs)" if method else "")
    ]
    if "measured" in da.coords:
        lines.append(f"{int(da['measured'].sum())} of {da.size} cells measured exactly (error 0)")
    return shown, _Interval(label=label, lines=lines)


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
        label=label_from_attrs(da, "state" if binary else VALUE),
    )


def _encodings(
    da: xr.DataArray,
    cells: _Cells,
    *,
    color: Any,
    center: float | None,
    domain: tuple[float, float] | None,
    scale: str,
    tooltip: bool,
) -> tuple[dict[str, Any], str | None]:
    """``heatmap``'s colour (and tooltip) encodings, shared by every panel so they compare,
    and the subtitle line that names a symmetric-log scale (None for a linear one).

    Raises:
        TypeError, ValueError: a bad ``color`` (see ``_check_color``).
    """
    _check_color(color, n_states=len(cells.states) if cells.binary else None)
    colour, note = _color(
        cells.finite,
        binary=cells.binary,
        has_nan=cells.has_nan,
        center=center,
        ends=domain,
        scale=scale,
        color=color,
        labels=cells.states,
        title=legend_title(cells.label),
    )
    enc: dict[str, Any] = {"color": colour}
    if tooltip:
        enc["tooltip"] = cell_tooltip(da, cells.binary, cells.label)
    return enc, note


def _arrange(
    da: xr.DataArray,
    panel: Callable[[xr.DataArray], alt.Chart | alt.LayerChart],
    *,
    x: str,
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
    across = len(coord_order(da, facet_col)) if facet_col else 1
    panel = _fitted(panel, across if facet_row else min(across, columns), x)
    if facet_row and facet_col:
        return panel(da).facet(
            row=alt.Row(
                f"{facet_row}:{vega_type(da, facet_row)}",
                sort=coord_order(da, facet_row),
                header=_header(da, facet_row),
            ),
            column=alt.Column(
                f"{facet_col}:{vega_type(da, facet_col)}",
                sort=coord_order(da, facet_col),
                header=_header(da, facet_col),
            ),
        )
    name = facet_row or facet_col
    assert name  # the first branch took the case of neither facet
    return panel(da).facet(
        facet=alt.Facet(
            f"{name}:{vega_type(da, name)}", sort=coord_order(da, name), header=_header(da, name)
        ),
        columns=1 if facet_row else columns,
    )


def _fitted(
    panel: Callable[[xr.DataArray], alt.Chart | alt.LayerChart], across: int, x: str
) -> Callable[[xr.DataArray], alt.Chart | alt.LayerChart]:
    """``panel`` with its cells (along ``x``) narrowed so that ``across`` panels side by
    side (a shared-scale facet row) span at most ROW_PX: a row of nine-head panels of a
    4-wide facet was 1,068 px, wider than a notebook's output area."""

    def fitted(part: xr.DataArray) -> alt.Chart | alt.LayerChart:
        chart = panel(part)
        step = chart.width.step if isinstance(chart.width, alt.Step) else None
        if step is None:
            return chart
        cells = len(coord_order(part, x))
        # Vega-Lite puts 20 px between facet panels
        shrink = min(1.0, (ROW_PX - 20 * (across - 1)) / (step * cells * across))
        return chart.properties(width=alt.Step(max(6, int(step * shrink)))) if shrink < 1 else chart

    return fitted


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

    across = len(_facet_selections(da, facet_col)) if facet_col else 1
    across = across if facet_row else min(across, columns)
    # A row of panels shares one notebook column: each panel's cells narrow so the row
    # spans at most ROW_PX (a panel alone spans up to 480 px, ``_size``).
    shrink = min(1.0, ROW_PX / (480 * across))

    def part(at: dict[str, Any]) -> alt.Chart | alt.LayerChart:
        heading = " · ".join(_facet_label(da, k, v) for k, v in at.items())
        chart = panel(da.sel(at)).properties(title=heading)
        if isinstance(chart.width, alt.Step) and shrink < 1:
            chart = chart.properties(width=alt.Step(max(6, int(chart.width.step * shrink))))
        return chart

    if facet_row:
        return alt.vconcat(
            *[
                alt.hconcat(*[part({**r, **c}) for c in _facet_selections(da, facet_col)])
                for r in _facet_selections(da, facet_row)
            ]
        )
    return alt.concat(*[part(c) for c in _facet_selections(da, facet_col)], columns=columns)


def _framed(
    chart: ChartType,
    da: xr.DataArray,
    cells: _Cells,
    *,
    title: str | None,
    actions: bool,
    notes: Sequence[str | None] = (),
) -> ChartType:
    """``heatmap``'s last step: the title and subtitle (what the colour shows when the
    title does not say it, provenance, grey and dark cells, then ``notes``: the colour
    scale), the actions menu, grey NaN and no frame."""
    heading = title or name_from_attrs(da, "")
    described = heading.startswith(da.attrs.get("long_name") or cells.label)
    subtitle = _subtitle(
        da,
        has_nan=cells.has_nan,
        every_nan=cells.has_nan and not cells.finite.size and not cells.has_inf,
        has_inf=cells.has_inf,
        colour=None if described else cells.label,
    ) + (cells.interval.lines if cells.interval else [])
    subtitle += [note for note in notes if note]
    subtitle = [part for line in subtitle for part in wrap_line(line)]
    titles = (
        alt.TitleParams(
            heading, subtitle=subtitle or alt.Undefined, anchor="start", limit=TITLE_LIMIT
        )
        if heading or subtitle
        else alt.Undefined
    )
    # one call each: every Altair call copies the chart (a layered one with its layers)
    chart = chart.properties(title=titles, usermeta={"embedOptions": {"actions": actions}})
    return chart.configure(
        scale=alt.ScaleConfig(invalid={"color": {"value": NAN_COLOR}}),
        view=alt.ViewConfig(stroke=None),
        legend=alt.LegendConfig(titleLimit=LEGEND_LIMIT),
    )


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
    unsure: str | None = None,
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
        unsure: for an interval result (``low`` and ``high`` coords), the legend entry of
            the cells whose interval includes 0, which a hatch layer marks.
    """
    edges: dict[str, tuple[tuple[Hashable, ...], np.ndarray]] = {}
    for n in (x, y):
        if vega_type(da, n) == "Q":
            edges[f"{n}_start"], edges[f"{n}_end"] = _edges(da[n], _axis_dim(da, n, "axis"))
    cols = cell_columns(da.assign_coords(edges))
    cols = _drop_outside(cols, [n for n in cols if n not in (VALUE, INFINITE, *AFTER_VALUE)])
    if labels:
        state = (lambda v: labels[int(v)]) if len(labels) > 2 else (lambda v: labels[bool(v)])
        cols[STATE] = [NAN_LABEL if v is None else state(v) for v in cols[VALUE]]
    if unsure:
        cols[UNSURE] = [
            unsure if lo is not None and hi is not None and lo <= 0 <= hi else None
            for lo, hi in zip(cols["low"], cols["high"], strict=True)
        ]
        for n in (x, y):  # a point sits at a continuous cell's middle
            if vega_type(da, n) == "Q":
                ends = zip(cols[f"{n}_start"], cols[f"{n}_end"], strict=True)
                cols[f"{n}_mid"] = [None if a is None else (a + b) / 2 for a, b in ends]
    keys = list(cols)
    data = {
        "values": [dict(zip(keys, row, strict=True)) for row in zip(*cols.values(), strict=True)]
    }
    # the layers carry no data of their own: their copies (every Altair method copies its
    # chart, layering copies each layer) stay cheap; the cells join the finished panel once
    base = alt.Chart().encode(
        **axis_encoding(da, x, "x", cols, ticks), **axis_encoding(da, y, "y", cols, ticks)
    )
    layers = [base.mark_rect(invalid="show").encode(**enc)]
    if has_inf:
        marked = base.transform_filter(f"datum.{INFINITE} != null")
        tips = [t for t in enc.get("tooltip", []) if t.to_dict()["field"] != VALUE]
        tips = [*tips, alt.Tooltip(f"{INFINITE}:N", title=legend)] if "tooltip" in enc else []
        layers += [
            marked.mark_rect(color=INF_COLOR).encode(**({"tooltip": tips} if tips else {})),
            marked.mark_text(color="white", fontSize=9).encode(text=f"{INFINITE}:N"),
        ]
    if unsure:
        layers.append(_hatch(da, x=x, y=y, cols=cols, ticks=ticks, label=unsure, enc=enc))
    width, height = _size(da, x), _size(da, y)
    if len(layers) == 1:
        return layers[0].properties(data=data, width=width, height=height)
    return alt.LayerChart(layer=layers, data=data, width=width, height=height)


def _hatch(
    da: xr.DataArray,
    *,
    x: str,
    y: str,
    cols: dict[str, list[Any]],
    ticks: Mapping[str, str],
    label: str,
    enc: dict[str, Any],
) -> alt.Chart:
    """The layer that hatches the cells whose interval includes 0 (``UNSURE`` set): one
    ``HATCH`` symbol the size of a cell at its middle, with a legend entry ``label``; it
    shows the cell's tooltip and is left out of the accessible description (``aria``: the
    cell under it names the cell)."""
    axes: dict[str, Any] = {}
    for name, channel in ((x, "x"), (y, "y")):
        axis = axis_encoding(da, name, channel, cols, ticks)
        if vega_type(da, name) == "Q":  # the cell's middle, on the cells' scale
            cls = alt.X if channel == "x" else alt.Y
            axis = {channel: cls(**{**axis[channel].to_dict(), "field": f"{name}_mid"})}
        axes.update(axis)
    side = min(_pixels(da, x), _pixels(da, y))
    return (
        alt.Chart()
        .transform_filter(f"datum.{UNSURE} != null")
        .mark_point(
            shape=HATCH, filled=False, stroke=HATCH_COLOR, strokeWidth=1, opacity=0.8, aria=False
        )
        .encode(
            shape=alt.Shape(
                f"{UNSURE}:N",
                scale=alt.Scale(domain=[label], range=[HATCH]),
                legend=alt.Legend(title="interval", symbolStrokeColor=HATCH_COLOR),
            ),
            size=alt.SizeValue(side * side),
            **axes,
            **({"tooltip": enc["tooltip"]} if "tooltip" in enc else {}),
        )
    )


def _pixels(da: xr.DataArray, name: str) -> float:
    """A cell's extent in pixels along the axis of ``name`` (see ``_size``)."""
    size = _size(da, name)
    return size.step if isinstance(size, alt.Step) else size / max(len(coord_order(da, name)), 1)


def _inside(da: xr.DataArray) -> np.ndarray:
    """True for cells that are drawn: every float coord of the cell is finite (``_drop_outside``
    drops the others, e.g. layers past a shallower model's depth; an interval's bounds, NaN
    where there is none, do not place a cell); shaped like ``da``."""
    inside = np.ones(da.shape, dtype=bool)
    for name in (n for n in coord_names(da) if n not in AFTER_VALUE):
        coord = da[name]
        if coord.dtype.kind == "f" and not np.isfinite(coord.values).all():
            inside &= np.isfinite(coord).broadcast_like(da).transpose(*da.dims).values
    return inside


def _header(da: xr.DataArray, dim: str) -> alt.Header:
    """Facet headers that read as titles: the value, integers as "cluster 3"."""
    expr = f"'{dim} ' + datum.value" if vega_type(da, dim) == "O" else "datum.value"
    return alt.Header(
        title=None, labelExpr=expr, labelFontSize=12, labelFontWeight="bold", labelLimit=400
    )


def _facet_label(da: xr.DataArray, dim: Hashable, value: Any) -> str:
    """Panel title part for one facet value: the value, integers as "cluster 3"."""
    return f"{dim} {value}" if vega_type(da, str(dim)) == "O" else str(value)


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


def _drop_outside(cols: dict[str, list[Any]], coord_names: list[str]) -> dict[str, list[Any]]:
    """Drop cells whose coordinates are NaN: positions outside a model, e.g. layers past a
    shallower model's depth after ``xr.concat`` along ``model``."""
    bad = [n for n in coord_names if None in cols[n]]
    if not bad:
        return cols
    keep = [all(cols[n][i] is not None for n in bad) for i in range(len(cols[VALUE]))]
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


def _size(da: xr.DataArray, name: str) -> alt.Step | int:
    """Panel width/height: a fixed span for continuous axes, else a step per cell small enough
    that a 36 x 32 grid fits a notebook column."""
    if vega_type(da, name) == "Q":
        return 320
    return alt.Step(int(np.clip(480 // max(len(coord_order(da, name)), 1), 6, 22)))


def _color(
    finite: np.ndarray,
    *,
    binary: bool,
    has_nan: bool,
    center: float | None,
    ends: tuple[float, float] | None = None,
    scale: str = "linear",
    color: str | Sequence[str] | None,
    labels: tuple[str, ...],
    title: str | list[str],
) -> tuple[alt.Color, str | None]:
    """Colour encoding chosen from the data: binary, diverging or sequential, on a linear
    or a symmetric-log ``scale``; and the subtitle line naming a symmetric-log scale."""
    # A scheme is the caller's str; Altair's stubs type ``scheme=`` as a Literal of Vega's
    # names (hence the two ``type: ignore[arg-type]``), and ``to_dict`` checks it against the
    # schema when the spec is built.
    scheme = color if isinstance(color, str) else None
    custom = None if color is None or scheme else list(color)
    if binary:
        nan = [NAN_LABEL] if has_nan else []
        if len(labels) > 2:  # categories: legend in code order
            domain = list(labels) + nan
            states = (
                alt.Scale(domain=domain, range=custom + [NAN_COLOR] * len(nan))
                if custom
                else alt.Scale(domain=domain, scheme=scheme or "category10")  # type: ignore[arg-type]
            )
            return alt.Color(f"{STATE}:N", scale=states, title=title), None
        domain = [labels[1], labels[0], *nan]
        if scheme:
            states = alt.Scale(domain=domain, scheme=scheme)  # type: ignore[arg-type]
        else:
            off, on = custom or BINARY_COLORS
            states = alt.Scale(domain=domain, range=[on, off, NAN_COLOR][: len(domain)])
        return alt.Color(f"{STATE}:N", scale=states, title=title), None
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
    note = _scale_note(kw["domain"], signed="domainMid" in kw, symlog=scale == "symlog")
    if scale != "symlog":
        return alt.Color(f"{VALUE}:Q", scale=alt.Scale(**kw), title=title), note
    low, high = kw["domain"]
    limit = max(abs(low), abs(high))
    kw.update(type="symlog", constant=limit * SYMLOG_SHARE)
    ticks = [t for t in symlog_ticks(limit) if low <= t <= high]
    legend = alt.Legend(values=ticks, format=".3~r")
    return alt.Color(f"{VALUE}:Q", scale=alt.Scale(**kw), title=title, legend=legend), note


def _scale_note(domain: Sequence[float], *, signed: bool, symlog: bool) -> str | None:
    """The subtitle line naming a continuous colour scale: a symmetric-log one up to its
    limit; one of a single sign (probabilities, shares) as the sequential scale it is, with
    its true range (never "±1" for values that are never negative); None for a linear
    diverging one (its legend says it all)."""
    low, high = domain
    limit = max(abs(low), abs(high))
    other = "(scale='linear' for a linear one)"
    if symlog and signed:
        return (
            f"colour: symmetric log up to ±{limit:.3g}, linear within "
            f"±{limit * SYMLOG_SHARE:.2g} {other}"
        )
    if symlog:
        return (
            f"colour: sequential on a log-like (symmetric log) scale, {low:.3g} to {high:.3g}, "
            f"linear below {limit * SYMLOG_SHARE:.2g} {other}"
        )
    return None if signed else f"colour: sequential, {low:.3g} to {high:.3g}"


def _subtitle(
    da: xr.DataArray, *, has_nan: bool, every_nan: bool, has_inf: bool, colour: str | None
) -> list[str]:
    """Subtitle lines: what the colour shows (when the legend title is short or the title is
    not the description), provenance (model, method, metric), a ``note`` attr, and what
    grey and dark marked cells mean, each only when such a cell is drawn (``every_nan``:
    no drawn cell holds a number)."""
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
    grey = f"grey: {NAN_LABEL}" + (" (every cell)" if every_nan else "")
    marks = ([grey] if has_nan else []) + (["+∞ / −∞: infinite value"] if has_inf else [])
    if marks:
        lines.append(" · ".join(marks))
    return lines
