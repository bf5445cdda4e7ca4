"""What every chart of a DataArray shares: its labels in one order, its cells as rows of
inline data, and the axis and tooltip encodings that read them.

``in_label_order`` puts a result's labels in their natural order before anything is drawn
(numbers ascending, components in the schema's vocabulary order, edges in the graph's
order, other labels in natural text order) and its dims in the schema's order, so a
``sortby``, ``isel`` or ``transpose`` of a result draws the same picture: every view reads
by label, never by position.
``cell_columns`` flattens a DataArray into one column per coord (dims, then label coords,
then scalar coords) and its values, cell-aligned and JSON-safe: NaN and +-inf become null,
so Vega-Lite sees "missing", never 0. ``vega_type`` reads a coord's Vega-Lite type from its
dtype (ints ordinal, floats quantitative, labels nominal), ``coord_order`` keeps the array's
order (the label order, after ``in_label_order``), ``axis_encoding`` and ``cell_tooltip``
build the encodings from them. Builders wrap themselves in ``unchecked_build`` so Altair
checks the finished spec once, not each part. ``heatmaps.heatmap`` and ``charts.bars`` are
built on these.

Three agreements every view of lenscape keeps, so a picture reads the same in each:

**One layer orientation: layer 0 at the top, the model computing downwards.** A heatmap
draws its ``y`` labels in label order from the top (layer 0 first), the edge grid its
senders down from the embeddings, and the circuit graph the embeddings above ``L0`` and
the logits below the last layer (``circuit._Layout``). A heatmap is a table, read as text
is, top to bottom (as TransformerLens' and most papers' layer x head grids are), so the
graph follows the heatmaps rather than the other way round: the same layer sits at the
same height in the graph, the edge grid and the head heatmap beside it.

**Colour scales that show the weak without lying about the strong** (``SCALES``,
``pick_scale``). Scores are often heavy-tailed (one edge of the IOI circuit scores 11, most
below 1), and a linear scale then paints most cells white. ``scale="auto"`` (the default of
the heatmap, the edge grid and the circuit graph) picks a symmetric-log scale when the
largest |value| is at least ``SYMLOG_RATIO`` times the median |value| (more than half the
cells would sit within 1% of the top of a linear scale, indistinguishable from 0), else a
linear one. The symmetric-log scale is linear within ``SYMLOG_SHARE`` of its limit and
logarithmic beyond, so it spans three powers of ten; its legend is ticked at the powers of
ten in true values, and the subtitle says the scale is symmetric-log and how to get a
linear one (``scale="linear"``, a toggle in ``Explorer`` and ``CircuitExplorer``).

**One rule for when a colour scale is shared: a control that steps through parts of one
quantity keeps its colours.** In ``Explorer`` the colour domain spans every coordinate a
dropdown can pick (every prompt, seed, cluster, model ...), so switching prompts never
rescales (``shared_scale=False``: each view its own domain); a reduction (mean, max, share)
is another quantity and takes its own. In ``CircuitExplorer`` the edge budget and the
receiver kinds pick parts of one result, so every view takes the whole result's largest
|score| as its limit, never a fixed one. Facet panels of one heatmap always share one
colour scale. Views of different results each take their own unless the caller passes one
(``domain=`` of ``heatmap``, ``limit=`` of ``circuit_graph``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ParamSpec, TypeVar

import altair as alt
import numpy as np
import xarray as xr
from altair.utils.schemapi import debug_mode

from lenscape import _validate
from lenscape.aggregate import BOUNDS
from lenscape.schema import COMPONENTS, DIMS

#: Tooltip titles that explain a coord's name.
TIP_TITLES = {"depth": "depth (layer / (layers − 1), 0 first, 1 last)"}
#: Coords a tooltip shows after the cell's value, in this order, titled by their
#: ``long_name`` attr: an interval's bounds and how many prompts it rests on
#: (``heatmaps`` makes ``low`` and ``high`` of ``lenscape.aggregate.mean``'s ``bound`` dim).
AFTER_VALUE = ("low", "high", "n")
#: Field names in the inline data: a cell's value, its state (the legend name of a mask's or a
#: category's code) and its "+∞" / "−∞" mark.
VALUE = "value"
STATE = "state"
INFINITE = "infinite"
#: Sender and receiver kinds of an edge result in the graph's order within a layer: the
#: embeddings first, then a layer's heads (its q, k, v receivers), its MLP, the logits last.
EDGE_KINDS = ("embed", "head", "q", "k", "v", "mlp", "logits")
#: The attr of a ``positions="spans"`` result that lists its spans in prompt order (a JSON
#: list), so that a ``sortby`` or ``isel`` of the ``span`` dim draws them in that order.
SPAN_ORDER = "span_order"
#: Longest tick label of a labelled axis (prompt texts, tokens) in characters, and in
#: pixels (Vega cuts a label there with "…": cut labels of one length read alike).
LABEL_CHARS = 34
LABEL_LIMIT = 220
#: The suffix of a label coord that holds a shortened copy of another (``distinct_labels``);
#: the axis title names the coord it shortens.
SHORT = "_short"
#: Colour scales of continuous values: "auto" picks one of the others by ``pick_scale``.
SCALES = ("auto", "symlog", "linear")
#: ``scale="auto"`` is symmetric-log when the largest |value| is at least this many times
#: the median |value|: more than half the cells would then sit within 1% of the top of a
#: linear scale, which no eye tells from 0.
SYMLOG_RATIO = 100.0
#: ``scale="auto"`` is also symmetric-log when the largest |value| is at least
#: ``OUTLIER_RATIO`` times the ``OUTLIER_QUANTILE`` of |value|: nine cells in ten would sit
#: in the lightest tenth of a linear scale (one head at +8.7 and the rest near white).
OUTLIER_RATIO = 10.0
OUTLIER_QUANTILE = 0.9
#: ... and when the largest |value| is at least ``ALONE_RATIO`` times every other: one cell
#: would take the darkest colour and the rest at most 40% of the range (notebook 01's exact
#: map of 10 heads: L23.H4 at 8.7, the next at 3.0 and most near 1, all near white).
ALONE_RATIO = 2.5
#: A symmetric-log scale is linear within this share of its limit (Vega's ``constant``), so
#: it spans three powers of ten: a value at 1% of the limit takes a third of the colour
#: range, at 10% two thirds (a linear scale: 1% and 10%).
SYMLOG_SHARE = 0.001
#: Least distance of a symmetric-log legend tick from 0 (and so from its neighbour of the
#: other sign), as a share of the scale from 0 to its limit: closer labels collide.
TICK_GAP = 0.25
_P = ParamSpec("_P")
_R = TypeVar("_R")
_Data = TypeVar("_Data", bound=xr.DataArray | xr.Dataset)


def _natural(label: Any) -> tuple[Any, ...]:
    """Sort key of a text label with its digit runs as numbers ("L2.H0" before "L10.H0")."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(label)))


def span_order(data: xr.DataArray | xr.Dataset) -> list[str] | None:
    """The spans of a ``positions="spans"`` result in prompt order, from its ``SPAN_ORDER``
    attr (a JSON list, e.g. '["S1", "IO", "S2", "END", "other"]'; a Dataset's own attrs or
    its first variable's that has it), or None without one."""
    holders = [data.attrs] + (
        [v.attrs for v in data.data_vars.values()] if isinstance(data, xr.Dataset) else []
    )
    for attrs in holders:
        if SPAN_ORDER in attrs:
            try:
                order = json.loads(str(attrs[SPAN_ORDER]))
            except json.JSONDecodeError:
                order = None
            if not isinstance(order, list):
                raise ValueError(
                    f"attr {SPAN_ORDER!r} must be a JSON list of span names in prompt order, "
                    f'such as \'["S1", "IO", "other"]\', got {attrs[SPAN_ORDER]!r}.'
                )
            return [str(name) for name in order]
    return None


def _label_keys(data: xr.DataArray | xr.Dataset, dim: Hashable) -> list[Any]:
    """One sort key per label of ``dim`` (see ``in_label_order``)."""
    labels = data[dim].values
    if dim == "span":  # an ordered label dim: prompt order, never the alphabet
        order = span_order(data)
        if order is None:
            return list(range(len(labels)))
        known = {name: i for i, name in enumerate(order)}
        rest = [(len(order), i) for i in range(len(labels))]
        return [(known[s], 0) if s in known else rest[i] for i, s in enumerate(labels.tolist())]
    parts = [f"{dim}_{part}" for part in ("layer", "kind", "head")]
    if all(p in data.coords and data[p].dims == (dim,) for p in parts):  # edges: graph order
        layer, kind, head = (data[p].values.tolist() for p in parts)
        rank = [EDGE_KINDS.index(k) if k in EDGE_KINDS else len(EDGE_KINDS) for k in kind]
        return list(zip(layer, rank, head, map(_natural, labels.tolist()), strict=True))
    for vocabulary, name in ((COMPONENTS, "component"), (BOUNDS, "bound")):
        if dim == name:
            return [
                (vocabulary.index(c), ()) if c in vocabulary else (len(vocabulary), _natural(c))
                for c in labels.tolist()
            ]
    if labels.dtype.kind in "biuf":
        return labels.tolist()
    return [_natural(label) for label in labels.tolist()]


def in_label_order(data: _Data, *, name: str = "da") -> _Data:
    """``data`` read by label: every dim with labels in their natural order and the dims in
    the schema's order (``schema.DIMS``, then any others by name), so that a ``sortby``,
    ``isel`` or ``transpose`` of a result gives the same picture.

    The natural order: numbers ascending; ``component`` in the schema's vocabulary order
    (attn, mlp; q_proj, k_proj ...); ``bound`` as mean, low, high (``aggregate.BOUNDS``);
    ``span`` in prompt order (S1, IO, S2, END, other: the ``span_order`` attr, see
    ``span_order``; without it the coord's own order, never the alphabet);
    edges (``sender``/``receiver`` with their ``_layer``, ``_kind`` and ``_head`` coords) in
    the graph's order, layer by layer; other labels as text, with digit runs compared as
    numbers.

    Args:
        data: a DataArray or Dataset.
        name: the argument's name, for the message.

    Returns:
        ``data`` reordered (itself when already in order).

    Raises:
        ValueError: a dim whose labels repeat: two cells would be drawn in one place.
    """
    order: dict[Hashable, list[int]] = {}
    for dim in data.dims:
        if dim not in data.indexes:
            continue
        _validate.unique_labels(name, data, dim, because="two cells would be drawn in one place")
        keys = _label_keys(data, dim)
        positions = sorted(range(len(keys)), key=keys.__getitem__)
        if positions != list(range(len(keys))):
            order[dim] = positions
    dims = sorted(
        data.dims, key=lambda d: (DIMS.index(d), "") if d in DIMS else (len(DIMS), str(d))
    )
    out = data.isel(order) if order else data
    return out if list(out.dims) == dims else out.transpose(*dims)


def distinct_labels(labels: list[str], keys: list[Any], chars: int = LABEL_CHARS) -> list[str]:
    """Tick labels that tell their items apart: each label shortened in the middle to at
    most ``chars`` characters ("The chemical … of gold is"), and where two would still read
    the same, each of those prefixed with its key ("3: The chemical …"); the full text
    belongs in the tooltip."""

    def middle(text: str) -> str:
        if len(text) <= chars:
            return text
        head = (chars - 1) // 2
        return text[:head].rstrip() + "…" + text[len(text) - (chars - 1 - head) :].lstrip()

    short = [middle(str(label)) for label in labels]
    seen: dict[str, int] = {}
    for text in short:
        seen[text] = seen.get(text, 0) + 1
    return [
        f"{key}: {middle(str(label))[: chars - len(str(key)) - 2]}" if seen[text] > 1 else text
        for key, label, text in zip(keys, labels, short, strict=True)
    ]


def unchecked_build(build: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run a chart builder with Altair's per-object schema checks off. In its default debug
    mode Altair validates every encoding, scale and property as it is made, about half the
    time of an Explorer redraw; the finished spec is still validated whole by ``to_dict``
    (when it is displayed, exported or swapped into a ``JupyterChart``)."""

    @functools.wraps(build)
    def built(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with debug_mode(False):
            return build(*args, **kwargs)

    return built


def coord_names(da: xr.DataArray) -> list[str]:
    """Dims (with or without coords), then label coords, then scalar coords."""
    rest = sorted((c for c in da.coords if c not in da.dims), key=lambda c: da[c].ndim == 0)
    return [str(n) for n in [*da.dims, *rest]]


def cell_columns(da: xr.DataArray) -> dict[str, list[Any]]:
    """One flat list per coord (see ``coord_names``) and the values, cell-aligned.

    NaN and +-inf become ``None`` (JSON null) so Vega-Lite sees "missing", never 0, and the
    spec stays valid JSON; when some value is infinite, an ``infinite`` column holds "+∞" or
    "−∞" for those cells (None elsewhere).
    """
    shape = da.shape
    cols: dict[str, list[Any]] = {}
    for name in coord_names(da):
        coord = da[name]
        own = [d for d in da.dims if d in coord.dims]
        arr = coord.transpose(*own).values.reshape(
            [s if d in own else 1 for d, s in zip(da.dims, shape, strict=True)]
        )
        cols[name] = jsonable(np.broadcast_to(arr, shape).ravel())
    values = da.values.ravel()
    cols[VALUE] = jsonable(values)
    if values.dtype.kind == "f" and np.isinf(values).any():
        marks = np.where(values > 0, "+∞", "−∞").astype(object)
        marks[~np.isinf(values)] = None
        cols[INFINITE] = marks.tolist()
    return cols


def jsonable(arr: np.ndarray) -> list[Any]:
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


def vega_type(da: xr.DataArray, name: str) -> str:
    """Vega-Lite type letter for a coord: ints ordinal, floats quantitative, labels nominal."""
    kind = da[name].dtype.kind
    return "O" if kind in "iub" else "Q" if kind == "f" else "N"


def coord_order(da: xr.DataArray, name: str) -> list[Any]:
    """Coordinate values in array order, for sorting axes and facets as the array holds them
    (in label order once the array went through ``in_label_order``)."""
    return list(dict.fromkeys(jsonable(da[name].values.ravel())))


def axis_encoding(
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
    if vega_type(da, name) != "Q":
        present = set(cols[name])
        sort = [v for v in coord_order(da, name) if v in present]
        axis: dict[str, Any] = {}
        if name in ticks and name in da.dims:
            keys = json.dumps(jsonable(da[name].values))
            texts = json.dumps([str(t) for t in da[ticks[name]].values.tolist()])
            axis = {
                "axis": alt.Axis(
                    labelExpr=f"{texts}[indexof({keys}, datum.value)]",
                    labelAngle=-90 if channel == "x" else 0,  # upright boxes never overlap
                    labelLimit=LABEL_LIMIT,
                ),
                "title": f"{name} ({ticks[name].removesuffix(SHORT)})",
            }
        return {channel: cls(f"{name}:{vega_type(da, name)}", sort=sort, **{"title": name, **axis})}
    lo, hi = min(cols[f"{name}_start"], default=0), max(cols[f"{name}_end"], default=1)
    scale = alt.Scale(domain=[lo, hi], nice=False, zero=False, reverse=channel == "y")
    return {
        channel: cls(f"{name}_start:Q", title=name, scale=scale),
        f"{channel}2": cls2(field=f"{name}_end"),
    }


def cell_tooltip(da: xr.DataArray, binary: bool, legend: str) -> list[alt.Tooltip]:
    """Every coordinate of a cell (dims, then label coords, then scalar coords), then its
    value, then the ``AFTER_VALUE`` coords it has (an interval: low, high, N)."""
    names = coord_names(da)
    tips = []
    for name in names:
        if name in AFTER_VALUE or name.endswith(SHORT):  # a shortened copy: the full one shows
            continue
        kind = vega_type(da, name)
        fmt: dict[str, Any] = {"format": ".3f"} if kind == "Q" else {}
        tips.append(alt.Tooltip(f"{name}:{kind}", title=TIP_TITLES.get(name, name), **fmt))
    if binary:
        tips.append(alt.Tooltip(f"{STATE}:N", title="state"))
    tips.append(alt.Tooltip(f"{VALUE}:Q", title=legend, format=".4g"))
    for name in (n for n in AFTER_VALUE if n in names):
        kind = vega_type(da, name)
        fmt = {"format": ".4g"} if kind == "Q" else {}
        title = str(da[name].attrs.get("long_name", name))
        tips.append(alt.Tooltip(f"{name}:{kind}", title=title, **fmt))
    return tips


def pick_scale(values: Any, scale: Any, *, name: str = "scale") -> str:
    """The colour scale of ``values``: ``scale`` itself when it is "symlog" or "linear";
    for "auto", symmetric-log when the largest finite |value| is at least ``SYMLOG_RATIO``
    times the median one (the values span orders of magnitude) or at least
    ``OUTLIER_RATIO`` times their ``OUTLIER_QUANTILE`` or ``ALONE_RATIO`` times the next
    largest (a few outliers, or one, would wash the rest of a linear map out to white),
    else linear.

    Args:
        values: the values the scale serves (for a shared scale, all of them).
        scale: one of ``SCALES``.
        name: the argument's name, for the message.

    Raises:
        ValueError: ``scale`` is not one of ``SCALES`` (the message lists them).
    """
    choice = _validate.choice(name, scale, SCALES)
    if choice != "auto":
        return choice
    arr = np.asarray(values, dtype=float)
    magnitude = np.abs(arr[np.isfinite(arr)])
    if magnitude.size < 2 or not magnitude.max() > 0:
        return "linear"
    top = magnitude.max()
    spread = top >= SYMLOG_RATIO * np.median(magnitude)
    outlier = top >= OUTLIER_RATIO * np.quantile(magnitude, OUTLIER_QUANTILE)
    alone = top >= ALONE_RATIO * np.sort(magnitude)[-2]
    return "symlog" if spread or outlier or alone else "linear"


def symlog_ticks(limit: float, *, signed: bool = True) -> list[float]:
    """Legend values of a symmetric-log scale up to ``limit`` (linear within
    ``SYMLOG_SHARE`` x ``limit``): 0 and the powers of ten from its linear part to the
    limit, of both signs when ``signed``, so the legend reads as the log scale it is. A
    power that would sit within ``TICK_GAP`` of the scale's half-length from 0 is left out:
    its label would collide with 0's (0.01 / 0 / -0.01 on a scale up to ±8.7)."""
    if not limit > 0:
        return [0.0]
    constant = limit * SYMLOG_SHARE
    low = int(np.ceil(np.log10(constant)))
    powers = [10.0**k for k in range(low, int(np.floor(np.log10(limit))) + 1)]
    full = np.log1p(limit / constant)
    powers = [p for p in powers if np.log1p(p / constant) / full >= TICK_GAP]
    return ([-p for p in powers[::-1]] if signed else []) + [0.0] + powers
