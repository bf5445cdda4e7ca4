"""Explorer: browse every dim of a result with controls that redraw one chart in place.

Two axes (``x``, ``y``) are drawn; every other dim gets a dropdown that picks one coordinate
or, for dims whose values are samples or positions (``REDUCIBLE_DIMS``), reduces the dim.
A threshold can binarize scores, one remaining dim can become facets, and the axes can be
swapped. Clicking a cell shows that cell's value along the sample dim (per prompt, with the
prompt texts) beside the chart, plus whatever a ``detail`` callback draws for it (e.g. the
head's attention pattern). A fast estimate's cell also gives its error estimate (an
``error`` coord: ``attribution_patching(error=True)``), the interval estimate ± error, and
whether ``refine="auto"`` measured it exactly (a ``measured`` coord: then the value is the
exact effect); see ``uncertainty_lines``.

The controls cannot mislead:

- Scores reduce with mean, max or min; masks (``lenscape.mask_rules.is_mask``, or scores after
  *binarize*) with any, all or share, by the rules of ``lenscape.mask_rules`` (only computed
  cells count). A mask averaged is labelled as the share it is ("share of prompts with
  attribution >= 0.5") on a sequential 0-1 scale, never "kept".
- Binarizing names its rule (``|value| >=``, ``value >=`` or ``value <=``,
  ``mask_rules.SIDES``) in the title with the share of values that pass; the box starts at the
  90% quantile of |value| and keeps exactly what it shows (switching the variable never
  moves it). A visible note says when the slice drawn is one colour or a one-sign rule
  hides strong values of the other sign.
- Titles say what was pooled ("mean over 16 prompts, 95% interval") and show a picked
  prompt's text; a mean over prompts carries its bootstrap interval (``ci``,
  ``lenscape.aggregate.mean``): the heatmap hatches the cells whose interval includes 0,
  tooltips and the click details give mean, low, high and N;
  prompts the model answers wrong (a ``correct`` coord) are marked, and one switch pools
  only the prompts it gets right.
- Click details follow the selection: changing a control redraws them for the new view.
- Results by position (a ``pos`` dim with a ``token`` coord, or a ``span`` dim with a
  ``span_text`` coord) get a prompt inspector: the tokens (or spans) of the prompt shown,
  ◀ ▶ to step through the prompts, the clicked cell's token or span highlighted; pooling
  prompts keeps one token label per position (``aggregate.pooled_tokens``).
- Only the sample dims (``prompt``, ``seed``) open averaged; every other dim (model,
  component, a method setting such as ``target_sparsity``, ``kind``) opens on its first
  value in label order, so different quantities are never averaged together by default.
- The data is read by label (``encoding.in_label_order``): dropdowns list the labels in
  their natural order and the chart draws them so, so a ``sortby`` or ``transpose`` of a
  result shows the same Explorer.

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
from altair.typing import ChartType, is_chart_type
from altair.utils.schemapi import debug_mode

from lenscape import _validate, aggregate, bootstrap, mask_rules
from lenscape.aggregate import correct_only
from lenscape.mask_rules import SIDES, check_side, is_mask
from lenscape.schema import name_from_attrs

from .charts import bars, interval_line
from .encoding import in_label_order, pick_scale
from .heatmaps import ERROR, heatmap, label_from_attrs
from .offline import display_with_image, enable_offline, with_image

Data = xr.DataArray | xr.Dataset
#: ``detail(cell) -> chart or widget`` for a clicked cell, e.g. ``{"layer": 3, "head": 5,
#: "prompt": 0, "text": "The capital of ..."}``: the axes' coordinates, the coordinate picked
#: for every other dim (the first prompt while prompts are pooled) and the prompt's text.
DetailFn = Callable[[dict[Hashable, Any]], Any]


# A dim name is any Hashable; xarray's reductions take one dim as a str or a collection of
# names, so the reducers reduce over ``[dim]`` (the same as ``dim`` for a str name).

#: Reductions of scores; NaN ("not computed") is skipped, a cell with nothing computed
#: along the dim stays NaN.
SCORE_REDUCERS: dict[str, Callable[[xr.DataArray, Hashable], xr.DataArray]] = {
    "mean": lambda da, dim: da.mean([dim]),
    "max": lambda da, dim: da.max([dim]),
    "min": lambda da, dim: da.min([dim]),
}
#: Every reducer: of scores, and of masks (``lenscape.mask_rules.REDUCERS``: any, all, share).
REDUCERS = {**SCORE_REDUCERS, **mask_rules.REDUCERS}
#: The mask reducer that matches a score reducer (a mask's mean is its share, max is any).
MASK_OF = dict(zip(SCORE_REDUCERS, mask_rules.REDUCERS, strict=True))
#: Dims whose values can be pooled: samples, groups of samples, positions in the model.
REDUCIBLE_DIMS = ("seed", "prompt", "cluster", "layer", "head", "pos")
#: Dims the Explorer opens reduced (mean or share); every other dim opens on its first value.
SAMPLE_DIMS = ("seed", "prompt")


#: Labels of the binarize rules (``lenscape.mask_rules.SIDES``) in the Explorer's dropdown.
SIDE_LABELS = {"abs": "|value| >=", "above": "value >=", "below": "value <="}
#: Quantile of |value| (of value, for data of one sign) where the threshold box starts.
DEFAULT_QUANTILE = 0.9
#: Longest prompt text shown in a title or a dropdown label.
PROMPT_CHARS = 48
#: View name of a layered heatmap's cells, where its click selection lives.
CELLS = "cells"
#: The coord of cells ``refine="auto"`` measured exactly (bool; the value is then exact).
MEASURED = "measured"


@dataclasses.dataclass(frozen=True)
class View:
    """What the Explorer shows; each field is one control.

    Attributes:
        x: dim (or label coord such as ``depth``) on the horizontal axis.
        y: dim on the vertical axis.
        pick: per other dim, a coordinate value to select or a ``REDUCERS`` name.
        variable: the Dataset variable to show (None for a DataArray).
        facet: a remaining dim drawn as side-by-side panels, or None.
        threshold: binarize each score by ``side`` at this value before reducing, or None.
        side: the binarize rule (``mask_rules.SIDES``): ``"abs"`` |value| >= threshold, ``"above"``
            value >= threshold, ``"below"`` value <= threshold.
        correct_only: draw only the prompts the model answers right (the ``correct`` coord).
        swap: exchange the x and y axes.
        ci: give a mean over prompts its bootstrap interval of this share (e.g. 0.95), when
            it is the last reduction (``aggregate.mean``); None: the plain mean.
        scale: the colour scale of scores, "linear" or "symlog" (``heatmap``'s ``scale``).
        shared_scale: one colour domain across every coordinate the picked dims offer
            (``shared_domain``), so that switching prompts never rescales; False: the
            domain of the slice drawn.
    """

    x: str
    y: str
    pick: Mapping[Hashable, Any] = dataclasses.field(default_factory=dict)
    variable: Hashable | None = None
    facet: str | None = None
    threshold: float | None = None
    side: str = "above"
    correct_only: bool = False
    swap: bool = False
    ci: float | None = None
    scale: str = "linear"
    shared_scale: bool = True


def _range(da: xr.DataArray) -> tuple[float, float]:
    """Finite min and max of ``da`` ((0, 1) when nothing is finite)."""
    values = np.asarray(da.values, dtype=float)
    finite = values[np.isfinite(values)]
    return (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)


def default_threshold(da: xr.DataArray) -> tuple[str, float]:
    """A binarize rule and threshold with a meaning: ``DEFAULT_QUANTILE`` of |value| for
    signed data (``"abs"``), of the values for data of one sign (``"above"``)."""
    values = np.asarray(da.values, dtype=float)
    finite = values[np.isfinite(values)]
    if not finite.size:
        return "above", 0.5
    side = "abs" if finite.min() < 0 < finite.max() else "above"
    return side, float(
        f"{np.quantile(np.abs(finite) if side == 'abs' else finite, DEFAULT_QUANTILE):.3g}"
    )


def threshold_note(da: xr.DataArray, threshold: float, side: str = "above") -> str | None:
    """A sentence when binarizing ``da`` by ``side`` at ``threshold`` paints every cell one
    colour (the threshold lies outside the values) or hides strong values of the other
    sign, else None. ``da`` is the slice drawn, not the whole array."""
    values = np.asarray(da.values, dtype=float)
    finite = values[np.isfinite(values)]
    if not finite.size:
        return None
    t = f"{threshold:g}"
    if side == "abs":
        magnitude = np.abs(finite)
        lo, hi, what = float(magnitude.min()), float(magnitude.max()), "|value|"
    else:
        lo, hi, what = float(finite.min()), float(finite.max()), "value"
    if side == "below":
        if threshold < lo:
            return f"threshold {t} is below every value (min {lo:.3g}): every cell is above it"
        if threshold >= hi:
            return (
                f"threshold {t} is at or above every value (max {hi:.3g}): "
                "every cell is at or below it"
            )
    else:
        if threshold > hi:
            return f"threshold {t} is above every {what} (max {hi:.3g}): every cell is below it"
        if threshold <= lo:
            return (
                f"threshold {t} is at or below every {what} (min {lo:.3g}): "
                "every cell is at or above it"
            )
    if side != "abs" and threshold != 0:
        other = finite <= -abs(threshold) if side == "above" else finite >= abs(threshold)
        if other.any():
            sign = "negative" if side == "above" else "positive"
            return (
                f"{int(other.sum())} strong {sign} values (|value| >= {abs(threshold):g}) "
                "are drawn as off: binarize on |value| to see them"
            )
    return None


def shorten(text: str, limit: int = PROMPT_CHARS) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _prompt_label(data: Data, value: Any) -> str:
    """A prompt's index with its (shortened) text, marked when the model answers it wrong."""
    label = str(value)
    if "correct" in data.coords and not bool(data["correct"].sel(prompt=value)):
        label += " ✗ wrong answer"
    if "text" in data.coords:
        label += f": {shorten(str(data['text'].sel(prompt=value).values))}"
    return label


def _uniform_note(da: xr.DataArray) -> str | None:
    """A sentence when every drawn cell of ``da`` (more than one; the mean of an interval)
    has the same value."""
    if "bound" in da.dims:
        da = da.sel(bound="mean")
    values = np.asarray(da.values, dtype=float)
    finite = values[np.isfinite(values)]
    if finite.size < 2 or finite.min() != finite.max():
        return None
    return f"every cell is {finite[0]:.4g}: this view leaves the map one colour"


def reduce(data: Data, view: View, *, keep: tuple[Hashable, ...] = ()) -> xr.DataArray:
    """Apply a view's variable, prompt filter, selections, threshold and reductions.

    Selections come first, then binarizing (so its note is about the slice drawn, and
    ``all`` over ``seed`` answers "past the threshold in every seed"), then any/all, then
    share (a mask stops being a mask there), in that order whatever the order of
    ``view.pick``.

    Args:
        data: a DataArray, or a Dataset with ``view.variable``.
        view: the state to apply.
        keep: picked dims left whole instead of selected (``shared_domain`` reads the
            range of every coordinate they offer).

    Returns:
        The DataArray with only the axis dims and the facet dim left (and ``keep``). Its
        attrs say what it now is: a binarized array is a mask (``units="bool"``,
        ``long_name`` such as "|x| >= t"), a share has ``units`` "share of prompts" and
        ``long_name`` "share of prompts with |x| >= t"; ``reduction`` lists the filter,
        selections and reductions ("mean over 16 prompts", "prompt 3 'The Eiffel…'");
        ``note`` warns when the threshold or the filter leaves the map one colour or hides
        values of the other sign.

    Raises:
        ValueError: a mask reducer on scores, a score reducer on a mask, binarizing a mask,
            an unknown ``side``, or ``correct_only`` without a ``correct`` coord (each
            message names the fix).
    """
    step = _Reduction.start(data, view)
    step.keep_correct(view)
    pooled, shared = step.select(view, keep=keep)
    step.binarize(view)
    step.pool(pooled, ci=view.ci if not shared else None)
    step.share(shared, binarized=view.threshold is not None)
    return step.result()


@dataclasses.dataclass
class _Reduction:
    """``reduce`` step by step: the array so far, and what the result will say about it.

    Attributes:
        da: the array so far.
        attrs: the result's attrs (the input's, updated by the steps).
        name: what a cell holds now, e.g. "attribution" or "|attribution| >= 0.5".
        mask: whether it holds a mask (so only mask reducers apply).
        steps: what was done, for the ``reduction`` attr ("mean over 16 prompts" ...).
        notes: warnings for the ``note`` attr (a threshold outside the data ...).
    """

    da: xr.DataArray
    attrs: dict[Hashable, Any]
    name: str
    mask: bool
    steps: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, data: Data, view: View) -> _Reduction:
        """The view's variable (the DataArray itself when ``data`` is one)."""
        da = data[view.variable] if isinstance(data, xr.Dataset) else data
        return cls(da=da, attrs=dict(da.attrs), name=name_from_attrs(da), mask=is_mask(da))

    def keep_correct(self, view: View) -> None:
        """Keep only the prompts the model gets right, where prompts are pooled or
        faceted (one picked prompt is shown as it is)."""
        one_prompt = "prompt" in view.pick and view.pick["prompt"] not in REDUCERS
        if view.correct_only and "prompt" in self.da.dims and not one_prompt:
            self.da = correct_only(self.da)
            self.steps.append(f"only the {self.da.attrs['correct_only']}")

    def select(
        self, view: View, *, keep: tuple[Hashable, ...] = ()
    ) -> tuple[list[tuple[Hashable, str]], list[Hashable]]:
        """Select the picked coordinates, and sort the reduced dims into the reductions
        done one by one (mean, max, min, any, all) and the dims shared together last.

        Returns:
            ``(pooled, shared)``: (dim, reducer name) pairs in ``view.pick`` order, and
            the dims whose share is taken.

        Raises:
            ValueError: a mask reducer on scores or a score reducer on a mask.
        """
        pooled: list[tuple[Hashable, str]] = []
        shared: list[Hashable] = []
        for dim, how in view.pick.items():
            if dim not in self.da.dims or dim == view.facet:
                continue
            if not (isinstance(how, str) and how in REDUCERS):
                if dim in keep:
                    continue
                self.steps.append(
                    f"prompt {_prompt_label(self.da, how)}" if dim == "prompt" else f"{dim} = {how}"
                )
                self.da = self.da.sel({dim: how})
                continue
            self._check_reducer(dim, how, binarized=view.threshold is not None)
            if how == "share":
                shared.append(dim)
            else:
                pooled.append((dim, how))
        return pooled, shared

    def _check_reducer(self, dim: Hashable, how: str, *, binarized: bool) -> None:
        allowed = mask_rules.REDUCERS if self.mask or binarized else SCORE_REDUCERS
        if how not in allowed:
            fix = (
                "turn on binarize to make a mask first"
                if not (binarized or self.mask)
                else "a mask reduces with share (its mean), any or all"
            )
            raise ValueError(
                f"{how!r} over {dim} does not apply to {self.name!r}; {fix}, or pick "
                f"one of {list(allowed)}."
            )

    def binarize(self, view: View) -> None:
        """Binarize by the view's rule (after selecting, so the note and the share that
        passes are about the slice drawn, and before any/all).

        Raises:
            ValueError: binarizing a mask, or an unknown ``side``.
        """
        if view.threshold is None:
            return
        if self.mask:
            raise ValueError(f"{self.name!r} is already a mask; turn binarize off to show it.")
        note = threshold_note(self.da, view.threshold, check_side(view.side))
        if note:
            self.notes.append(note)
        self.da = mask_rules.binarize(self.da, view.threshold, view.side)
        passed = float(mask_rules.share(self.da, list(self.da.dims)))
        self.steps.insert(
            0, f"{passed:.0%} of values pass" if passed == passed else "none computed"
        )
        self.name = self.da.attrs["long_name"]
        self.attrs.update(long_name=self.name, units=mask_rules.MASK_UNITS)
        self.mask = True

    def pool(self, pooled: list[tuple[Hashable, str]], *, ci: float | None) -> None:
        """Reduce each (dim, reducer) in turn; a mean over prompts done last gets its
        bootstrap interval when ``ci`` is given (``aggregate.mean``: a ``bound`` dim, and
        the attrs that say how it was made)."""
        for i, (dim, how) in enumerate(pooled):
            self.steps.append(f"{how} over {self.da.sizes[dim]} {dim}s")
            last = i == len(pooled) - 1
            if ci is None or not last or dim != "prompt" or how != "mean" or self.mask:
                self.da = aggregate.pooled_tokens(REDUCERS[how](self.da, dim), self.da, str(dim))
                continue
            self.da = aggregate.mean(self.da, "prompt", ci=ci)
            self.steps[-1] += f", {bootstrap.percent(ci)} interval"
            made = ("interval", "ci", "n_resamples", "interval_seed", "interval_note")
            self.attrs.update({k: self.da.attrs[k] for k in made if k in self.da.attrs})

    def share(self, dims: list[Hashable], *, binarized: bool) -> None:
        """Take the share over ``dims`` together, last: a mask stops being a mask here."""
        if not dims:
            return
        over = " and ".join(f"{self.da.sizes[d]} {d}s" for d in dims)
        before, self.da = self.da, mask_rules.share(self.da, dims)
        for dim in dims:
            self.da = aggregate.pooled_tokens(self.da, before, str(dim))
        self.attrs.update(
            long_name=f"share of {over} with {self.name}"
            if binarized
            else f"share of {over} where {self.name}",
            units=mask_rules.share_units(dims),
        )

    def result(self) -> xr.DataArray:
        """The array with its attrs: the steps as ``reduction``, the notes (or, without
        one, a note that the map is one colour) added to any ``note`` it had."""
        uniform = _uniform_note(self.da)
        notes = self.notes or ([uniform] if uniform else [])
        attrs = dict(self.attrs)
        if self.steps:
            attrs["reduction"] = ", ".join(self.steps)
        if notes:
            attrs["note"] = "; ".join([*filter(None, [attrs.get("note")]), *notes])
        out = self.da.copy(deep=False)
        out.attrs = attrs
        return out


def _picked_dims(data: Data, view: View) -> tuple[Hashable, ...]:
    """The dims of the view's variable on which a dropdown picks one coordinate (not a
    reducer, not the facet): the dims whose coordinates a colour scale is shared across."""
    dims = _variable(data, view.variable).dims
    return tuple(
        dim
        for dim, how in view.pick.items()
        if dim in dims and dim != view.facet and not (isinstance(how, str) and how in REDUCERS)
    )


def shared_domain(data: Data, view: View) -> tuple[float, float] | None:
    """The colour domain every coordinate of the picked dims shares: the finite range of
    the view's values over all of them (every prompt, seed, cluster, model ... a dropdown
    offers), reduced as the view reduces the other dims. The views' one rule
    (``encoding``): a control that steps through parts of one quantity keeps its colours,
    so a colour means the same value whichever prompt is picked; a reduction (mean, max,
    share) is another quantity and takes its own range.

    Returns:
        (low, high), or None where nothing is picked, the view binarizes or shows a mask
        (two named colours), or the range is empty or one value.
    """
    picked = _picked_dims(data, view)
    if not picked or view.threshold is not None or is_mask(_variable(data, view.variable)):
        return None
    wide = reduce(data, dataclasses.replace(view, ci=None), keep=picked)
    values = np.asarray(wide.values, dtype=float)
    if is_mask(wide) or not np.isfinite(values).any():
        return None
    low, high = _range(wide)
    return (low, high) if low < high else None


def _shared_note(data: Data, view: View) -> str:
    """The subtitle line that says across what the colour scale is shared."""
    picked = [str(d) for d in _picked_dims(data, view)]
    return (
        f"colour scale shared by every {' and '.join(picked)} "
        "(Explorer(shared_scale=False): each its own)"
    )


def _with_subtitle(chart: ChartType, line: str) -> ChartType:
    """``chart`` with ``line`` added to its title's subtitle."""
    title = chart.title if "title" in chart._kwds else alt.Undefined
    if not isinstance(title, alt.TitleParams):
        return chart
    made = title.to_dict()
    lines = made.get("subtitle", [])
    lines = [lines] if isinstance(lines, str) else list(lines)
    return chart.properties(title=alt.TitleParams(**{**made, "subtitle": [*lines, line]}))


def render(data: Data, view: View, **options: Any) -> tuple[xr.DataArray, ChartType]:
    """The pure core of the Explorer: state in, reduced DataArray and chart out.

    Args:
        data: a DataArray, or a Dataset with ``view.variable``.
        view: what to show.
        **options: passed to ``heatmap`` (``color``, ``center``, ``independent`` ...); a
            ``domain`` given here replaces the shared one.

    Returns:
        ``(array, chart)``: the reduced values (dims: the axes' dims and the facet) and
        their heatmap on ``view.scale``, with the domain all picked coordinates share
        (``shared_domain``, when ``view.shared_scale``, and the subtitle says so); an
        unfaceted chart carries a click selection named ``cell``.
    """
    da = reduce(data, view)
    x, y = (view.y, view.x) if view.swap else (view.x, view.y)
    if view.threshold is not None and is_mask(da):
        states = tuple(s.format(t=f"{view.threshold:g}") for s in SIDES[view.side].states)
        options = {"labels": states, **options}
    shared = None
    if not is_mask(da):
        options = {"scale": view.scale, **options}
        shared = shared_domain(data, view) if view.shared_scale else None
        if shared is not None and "domain" not in options:
            options["domain"] = shared
        else:
            shared = None
    facet = view.facet if view.facet in da.dims else None
    name = name_from_attrs(da)
    title = f"{name} · {da.attrs['reduction']}" if "reduction" in da.attrs else name
    chart = heatmap(da, x=x, y=y, facet_col=facet, **{"title": title, **options})
    if shared is not None:
        with debug_mode(False):
            chart = _with_subtitle(chart, _shared_note(data, view))
    if isinstance(chart, alt.Chart | alt.LayerChart):  # unfaceted: a click selects a cell
        with debug_mode(False):  # checked whole by to_dict, as in heatmap
            chart = _clickable(chart, [str(d) for d in da.dims if d != "bound"])
    return da, chart


def _clickable(chart: alt.Chart | alt.LayerChart, fields: list[str]) -> ChartType:
    """``chart`` with a click selection named ``cell`` on ``fields`` that outlines the
    clicked cell. A layered heatmap (hatch or infinity marks on top of the cells) declares
    the selection at its top, on the cells' view: ``alt.JupyterChart`` reports only the
    selections of the chart's own ``params``."""
    cell = alt.selection_point(name="cell", fields=fields, on="click", clear="dblclick")
    outline = (  # channel objects: no dict conversion
        alt.StrokeValue(None, condition={"param": "cell", "value": "#000000", "empty": False}),
        alt.StrokeWidthValue(2),
    )
    if isinstance(chart, alt.Chart):
        return chart.add_params(cell).encode(*outline)
    chart = chart.copy(deep=False)
    chart.layer = [chart.layer[0].encode(*outline).properties(name=CELLS), *chart.layer[1:]]
    assert isinstance(cell.param, alt.SelectionParameter)  # selection_point made it
    chart.params = [
        alt.TopLevelSelectionParameter(name="cell", select=cell.param.select, views=[CELLS])
    ]
    return chart


def _dims(data: Data) -> list[Hashable]:
    if isinstance(data, xr.DataArray):
        return list(data.dims)
    return list(dict.fromkeys(d for v in data.data_vars.values() for d in v.dims))


def _label(data: Data, dim: Hashable, value: Any) -> str:
    """Dropdown label for a coordinate; a prompt's has its text and its wrong-answer mark."""
    return _prompt_label(data, value) if dim == "prompt" else str(value)


def _variable(data: Data, name: Hashable | None) -> xr.DataArray:
    """The Dataset variable ``name`` (the first when None); a DataArray is returned as is."""
    if isinstance(data, xr.DataArray):
        return data
    return data[name if name is not None else next(iter(data.data_vars))]


def _check_variables(data: Data) -> None:
    """Refuse a Dataset whose variables have different dims: one set of controls (the
    axes, a dropdown per other dim, the facet) serves every variable.

    Raises:
        ValueError: naming the variables of each set of dims, and the fix.
    """
    if not isinstance(data, xr.Dataset):
        return
    groups: dict[frozenset[Hashable], list[str]] = {}
    for name, variable in data.data_vars.items():
        groups.setdefault(frozenset(variable.dims), []).append(str(name))
    if len(groups) < 2:
        return
    listed = "; ".join(
        f"{', '.join(names)} {tuple(str(d) for d in data[names[0]].dims)}"
        for names in groups.values()
    )
    first = next(iter(groups.values()))
    raise ValueError(
        f"data's variables have different dims ({listed}), and an Explorer shows every "
        "variable with the same axes and dropdowns; pass the variables that share dims, "
        f"e.g. data[{first!r}], or one variable, e.g. data[{first[0]!r}]."
    )


def _check_sizes(data: Data) -> None:
    """Raise when a dim of ``data`` has no coordinates: nothing could be drawn or picked."""
    empty = [str(d) for d, n in data.sizes.items() if n == 0]
    if empty:
        raise ValueError(
            f"The data has no values along {empty} (sizes {dict(data.sizes)}); an Explorer "
            "needs at least one coordinate per dim: check the selection or the prompts "
            "that produced it."
        )


def _check_explorer(
    data: Any,
    *,
    x: Any,
    y: Any,
    facet: Any,
    variable: Any,
    threshold: Any,
    side: Any,
    correct_only: Any,
) -> tuple[Data, list[Hashable]]:
    """Check an ``Explorer``'s arguments (each message names the argument and the fix).

    Returns:
        The data in label order (``in_label_order``), and its dims that are not on an axis
        (each gets a control), in the schema's order.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: see ``Explorer``.
    """
    _validate.result("data", data, kind=(xr.DataArray, xr.Dataset), made_by="a lenscape method")
    _check_variables(data)
    _check_sizes(data)
    data = in_label_order(data, name="data")
    _validate.text("x", x, example="'head'")
    _validate.text("y", y, example="'layer'")
    _validate.text("facet", facet, example="'model'", optional=True)
    if side is not None:
        check_side(side)
    if threshold is not None:
        _validate.number("threshold", threshold)
    if variable is not None and (
        not isinstance(data, xr.Dataset)
        or not isinstance(variable, Hashable)
        or variable not in data.data_vars
    ):
        choices = list(data.data_vars) if isinstance(data, xr.Dataset) else []
        raise ValueError(
            f"variable={variable!r} is not a variable of the data; "
            + (f"pick one of {choices}." if choices else "a DataArray takes no variable=.")
        )
    if _validate.flag("correct_only", correct_only) and "correct" not in data.coords:
        why = data.attrs.get("correct_note")
        raise ValueError(
            "correct_only=True needs a 'correct' coord on prompt (capture results of "
            "prompts with targets carry one); this data has none"
            + (f" ({why})" if why else "")
            + ", so draw all prompts (correct_only=False)."
        )
    dims = _dims(data)
    for role, name in (("x", x), ("y", y)):
        if name not in dims and name not in data.coords:
            raise ValueError(
                f"Explorer({role}={name!r}) but the data has dims {tuple(dims)};"
                f" pass {role}= one of them."
            )
    axis_dims = {n if n in dims else data[n].dims[-1] for n in (x, y)}
    others = [d for d in dims if d not in axis_dims]
    if facet is not None and facet not in others:
        raise ValueError(f"facet={facet!r} must be one of the other dims {others}.")
    return data, others


#: Keyword arguments that give a control's description the room it needs.
_WIDE = {"style": {"description_width": "initial"}}


def _pick_controls(
    data: Data, others: list[Hashable], *, variable: Hashable | None, facet: str | None
) -> dict[str, widgets.Widget]:
    """What is drawn: the variable (for a Dataset), a dropdown per other dim (its options
    are set by ``Explorer._set_dim_options``) and the facet."""
    controls: dict[str, widgets.Widget] = {}
    if isinstance(data, xr.Dataset):
        names = list(data.data_vars)
        controls["variable"] = widgets.Dropdown(
            options=names, value=variable or names[0], description="variable", **_WIDE
        )
    for dim in others:
        controls[str(dim)] = widgets.Dropdown(
            description=str(dim),
            **_WIDE,
            layout={"width": "460px" if dim == "prompt" else "auto"},
        )
    controls["facet"] = widgets.Dropdown(
        options=["none"] + [str(d) for d in others],
        value=facet or "none",
        description="facet",
        **_WIDE,
    )
    return controls


def _binarize_controls(
    current: xr.DataArray, *, threshold: float | None, side: str | None
) -> dict[str, widgets.Widget]:
    """The binarize checkbox, its rule and its threshold; without a threshold the box
    starts at ``default_threshold`` of the variable shown first."""
    start_side, start = default_threshold(current)
    return {
        "binarize": widgets.Checkbox(
            value=threshold is not None,
            description="binarize at",
            indent=False,
            layout={"width": "auto"},
        ),
        "side": widgets.Dropdown(
            options=[(label, key) for key, label in SIDE_LABELS.items()],
            value=side or start_side,
            layout={"width": "110px"},
            tooltip="binarize on |value| (either sign) or on one sign",
        ),
        "threshold": widgets.FloatText(
            value=start if threshold is None else threshold,
            layout={"width": "90px"},
            tooltip=f"starts at the {DEFAULT_QUANTILE:.0%} quantile of |value|",
        ),
    }


def _switches(data: Data, *, correct_only: bool, scale: str) -> dict[str, widgets.Widget]:
    """Only the prompts the model gets right (with a ``correct`` coord), swap axes, and the
    colour scale (starting on ``scale``)."""
    controls: dict[str, widgets.Widget] = {}
    if "correct" in data.coords:
        controls["correct"] = widgets.Checkbox(
            value=correct_only,
            description="only prompts the model gets right",
            indent=False,
            layout={"width": "auto"},
        )
    controls["swap"] = widgets.ToggleButton(
        value=False,
        description="swap axes",
        icon="exchange",
        tooltip="exchange the x and y axes",
    )
    controls["scale"] = widgets.ToggleButtons(
        options=["linear", "symlog"],
        value=scale,
        description="colour",
        tooltips=["linear in the value", "symmetric log: weak values show beside strong ones"],
        style={"button_width": "80px"},
    )
    return controls


def _error_method(values: xr.DataArray, attrs: Mapping[Hashable, Any]) -> str:
    """The error estimate's method: the result's ``error_method`` attr, else the short name
    before the description in the ``error`` coord's ``method`` attr; "" when neither."""
    method = attrs.get("error_method")
    if not method and ERROR in values.coords:
        method = str(values[ERROR].attrs.get("method", "")).split(":")[0]
    return str(method or "")


def uncertainty_lines(values: xr.DataArray, attrs: Mapping[Hashable, Any]) -> list[str]:
    """What a clicked cell's details say about a fast estimate's uncertainty.

    A fast estimate carries its per-cell error estimate as an ``error`` coord
    (``lsc.attribution_patching(..., error=True)``, its method in the ``error_method``
    attr), and ``refine="auto"`` (``lsc.activation_patching``, ``lsc.ablation``) marks in a
    bool ``measured`` coord the cells it measured exactly, where the value IS the exact
    effect (error 0). One cell gives the estimate, its error estimate and method, the
    interval estimate ± error (and whether it includes 0: the sign is not sure), and
    whether it was measured; a cell pooled over prompts (``values`` along them) gives the
    mean, the mean error estimate (the mean's error is at most that: the triangle
    inequality), the largest one, its interval, and on how many prompts the value was
    measured exactly.

    Args:
        values: the cell's values (a scalar, or along the dims still pooled) with the
            result's coords.
        attrs: the result's attrs (``error_method``, ``units``).

    Returns:
        The lines, or [] when ``values`` has neither coord.
    """
    has_error, has_measured = ERROR in values.coords, MEASURED in values.coords
    if not (has_error or has_measured):
        return []
    estimate = np.asarray(values.values, dtype=float)
    finite = np.isfinite(estimate)
    units = f" {attrs['units']}" if attrs.get("units") not in (None, "") else ""
    one = estimate.size == 1
    over = f"{values.dims[0]}s" if values.ndim == 1 else "values"
    if not one and not finite.any():
        return [f"not computed (NaN) on every one of the {over}"]
    value = float(estimate.ravel()[0]) if one else float(estimate[finite].mean())
    lines = [
        f"estimate: {value:.4g}{units}"
        if one
        else f"estimate: {value:.4g}{units} (mean of {int(finite.sum())} {over})"
    ]
    measured = (
        np.broadcast_to(np.asarray(values[MEASURED].values, dtype=bool), estimate.shape)
        if has_measured
        else None
    )
    exact = one and measured is not None and bool(measured.ravel()[0])
    if has_error and not exact:
        error = np.broadcast_to(np.asarray(values[ERROR].values, dtype=float), estimate.shape)
        method = _error_method(values, attrs)
        size = float(error.ravel()[0]) if one else float(error[finite].mean())
        said = (
            f"error estimate: ±{size:.3g}{units}"
            if one
            else f"error estimate: ±{size:.3g}{units} at most (the mean of the per-prompt "
            f"ones; largest ±{float(error[finite].max()):.3g})"
        )
        lines.append(said + (f" ({method})" if method else ""))
        low, high = value - size, value + size
        unsure = "includes 0: the sign is not sure" if low <= 0 <= high else "excludes 0"
        lines.append(f"interval: {low:.4g} to {high:.4g} (estimate ± error; {unsure})")
    if measured is not None:
        if one:
            lines.append(
                "measured exactly (refine='auto'): this value IS the exact effect, error 0"
                if exact
                else "not measured exactly (refine='auto' left the fast estimate here)"
            )
        else:
            count = int(measured[finite].sum())
            lines.append(
                f"measured exactly on {count} of {int(finite.sum())} {over} "
                "(refine='auto'): their values are exact, error 0"
            )
    return lines


#: Background of the token or span of the clicked cell in the prompt inspector.
MARK_COLOR = "#ffd54f"


def _token_box(text: str, about: str, marked: bool) -> str:
    """One token (or span) of the prompt inspector as an HTML box, its spaces kept."""
    style = (
        "display:inline-block;margin:1px;padding:0 3px;border:1px solid #bbb;"
        "border-radius:3px;font-family:monospace;white-space:pre;"
        + (f"background:{MARK_COLOR};font-weight:bold;border-color:#b58900;" if marked else "")
    )
    mark = ' data-marked="1"' if marked else ""
    return f'<span title="{html.escape(about)}" style="{style}"{mark}>{html.escape(text)}</span>'


def prompt_tokens(da: xr.DataArray, prompt: Any, mark: Mapping[Hashable, Any]) -> str:
    """The prompt inspector's HTML: the tokens (``pos``, a ``token`` coord) or spans
    (``span``, a ``span_text`` coord) of one prompt, the one at the clicked cell (``mark``:
    its ``pos`` or ``span``) highlighted; "" when ``da`` has neither.

    Args:
        da: the variable shown.
        prompt: the prompt picked, or None while prompts are pooled (then the tokens all
            prompts share, "pos 7 (tokens differ)" where they differ).
        mark: the clicked cell's coordinates (may be empty).
    """
    pooled = prompt is None and "prompt" in da.dims
    at = {"prompt": prompt} if prompt is not None and "prompt" in da.dims else {}
    if "pos" in da.dims and aggregate.TOKEN in da.coords:
        token = da[aggregate.TOKEN]
        if pooled and "prompt" in token.dims:
            texts = aggregate.token_labels(da, "prompt").values
        else:
            mine = at if at and "prompt" in token.dims else {}
            texts = token.sel(mine).values.astype(str)
        cells = [
            _token_box(str(t), f"pos {p}", mark.get("pos") == p)
            for p, t in zip(da["pos"].values.tolist(), np.ravel(texts).tolist(), strict=True)
            if str(t) != ""
        ]
    elif "span" in da.dims and "span_text" in da.coords:
        text = da["span_text"]
        if pooled and "prompt" in text.dims:
            text = text.isel(prompt=0)
        elif at and "prompt" in text.dims:
            text = text.sel(at)
        cells = [
            _token_box(
                f"{name}: {t}" if t else f"{name}: (none)", f"span {name}", mark.get("span") == name
            )
            for name, t in zip(
                da["span"].values.tolist(), text.values.astype(str).tolist(), strict=True
            )
        ]
    else:
        return ""
    n = da.sizes.get("prompt", 1)
    if pooled:
        heading = (
            f"spans, with the first of {n} prompts' texts"
            if "span" in da.dims
            else f"tokens shared by the {n} prompts pooled ('{aggregate.TOKENS_DIFFER}' where not)"
        ) + "; step with ◀ ▶ to read one prompt"
    else:
        heading = f"prompt {prompt}" if prompt is not None else "the prompt"
        if prompt is not None and "text" in da.coords and "prompt" in da["text"].dims:
            heading += f": {shorten(str(da['text'].sel(prompt=prompt).values), 80)}"
    return f"<small>{html.escape(heading)}</small><br>" + "".join(cells)


class _Details:
    """The pane beside an Explorer's chart: a clicked cell's values along the sample dim
    (one bar per prompt; the mean's interval, where the chart has one, as a band and in
    words) and ``detail``'s view of it. Its chart widgets are made on the first click and
    their charts swapped in place afterwards.

    Attributes:
        detail: the Explorer's ``detail`` callback, or None.
        box: the pane's widget.
        text: the line that shows a cell's value when there are no bars.
        uncertainty: the lines that give a fast estimate's error estimate and whether the
            cell was measured exactly (``uncertainty_lines``), shown when it has either.
    """

    def __init__(self, detail: DetailFn | None) -> None:
        self.detail = detail
        # the details wrap under the chart when the row is full, never clipped beside it
        self.box = widgets.VBox(layout={"min_width": "260px", "overflow": "visible"})
        self._charts: dict[str, alt.JupyterChart] = {}
        self.text, self._error = widgets.HTML(), widgets.HTML()
        self.uncertainty = widgets.HTML()

    def show(
        self,
        da: xr.DataArray,
        values: xr.DataArray,
        *,
        at: Mapping[Hashable, Any],
        picks: Mapping[Hashable, Any],
        interval: xr.DataArray | None = None,
    ) -> None:
        """Show a clicked cell.

        Args:
            da: the variable shown (prompts filtered as the view filters them).
            values: its values at the cell, along the dims still pooled.
            at: the cell's coordinates on the chart's dims.
            picks: the coordinates picked for the other dims.
            interval: the chart's mean and interval at the cell (dim ``bound``, coord
                ``n``; see ``aggregate.mean``), or None where the chart has none.
        """
        along = next((d for d in values.dims if d in SAMPLE_DIMS), None)
        parts = [self._values(da, values, along, at=at, picks=picks, interval=interval)]
        lines = uncertainty_lines(values, da.attrs)
        if lines:
            self.uncertainty.value = "<br>".join(html.escape(line) for line in lines)
            parts.append(self.uncertainty)
        if self.detail is not None:
            parts.append(self._detail(da, values, along, {**at, **picks}))
        self.box.children = tuple(parts)

    def clear(self) -> None:
        """Empty the pane (the clicked cell is gone from the chart, or the data changed)."""
        self.box.children = ()

    def _values(
        self,
        da: xr.DataArray,
        values: xr.DataArray,
        along: Hashable | None,
        *,
        at: Mapping[Hashable, Any],
        picks: Mapping[Hashable, Any],
        interval: xr.DataArray | None,
    ) -> widgets.Widget:
        """The clicked cell's values: bars along the sample dim ``along`` (one bar per
        prompt, the interval as a band), or its (mean) value as a line of text (with the
        interval in words)."""
        where = ", ".join(f"{d} {v}" for d, v in at.items())
        picked = ", ".join(
            f"prompt {_prompt_label(da, v)}" if d == "prompt" else f"{d} {v}"
            for d, v in picks.items()
        )
        if along is not None and values.ndim == 1:
            title = f"{where}: per {along}" + (f" ({picked})" if picked else "")
            ci = interval.attrs["ci"] if interval is not None and along == "prompt" else None
            return self._chart("bars", bars(values, y=str(along), title=title, ci=ci))
        value = np.asarray(values.mean().values).item()
        said = interval_line(interval) if interval is not None else f"{value:.4g}"
        text = html.escape(
            f"{label_from_attrs(da)} at {where}: {said}" + (f" ({picked})" if picked else "")
        )
        self.text.value = f"<b>{text}</b>"
        return self.text

    def _detail(
        self,
        da: xr.DataArray,
        values: xr.DataArray,
        along: Hashable | None,
        cell: Mapping[Hashable, Any],
    ) -> widgets.Widget:
        """``detail``'s view of the clicked cell (see ``DetailFn``: the first prompt while
        prompts are pooled, with its text), or the ValueError it raised."""
        cell = dict(cell)
        if along == "prompt" and "prompt" not in cell:
            cell["prompt"] = values["prompt"].values[0].item()
        if "prompt" in cell and "text" in da.coords:
            cell["text"] = str(da["text"].sel(prompt=cell["prompt"]).values)
        assert self.detail is not None  # show asks for this part only with a detail
        try:
            shown = self.detail(cell)
        except ValueError as err:
            self._error.value = f"<span style='color:#b00'>{html.escape(str(err))}</span>"
            return self._error
        if is_chart_type(shown):  # any Altair chart (the subclasses of alt.TopLevelMixin)
            return self._chart("detail", shown)
        return shown

    def _chart(self, slot: str, chart: ChartType) -> alt.JupyterChart:
        """The details' chart widget for ``slot`` ("bars" or "detail"): created on the first
        click, its chart swapped in place afterwards (a new widget costs the browser far more)."""
        widget = self._charts.get(slot)
        if widget is None:
            widget = self._charts[slot] = alt.JupyterChart(
                chart, embed_options={"renderer": "svg", "actions": False}
            )
        else:
            widget.chart = chart
        return widget


class Explorer:
    """Controls for every dim of a result, redrawing one chart in place.

    A notebook cell ending in ``lsc.Explorer(scores)`` shows the controls above the chart;
    click a cell for its values per prompt (and ``detail``'s view) beside it.

    Args:
        data: a DataArray, e.g. (prompt, layer, head), or a Dataset of such variables, all
            with the same dims (e.g. ``gating[["facilitation", "interference"]]``); kept in
            label order (``in_label_order``) as ``data``.
        x: dim (or label coord, e.g. ``depth``) on the horizontal axis.
        y: dim on the vertical axis.
        facet: a dim to draw as side-by-side panels from the start.
        variable: the Dataset variable shown first (default: the first).
        threshold: start with binarizing at this value (default: off; the box starts at
            ``DEFAULT_QUANTILE`` of |value|, see ``default_threshold``).
        side: the binarize rule (``SIDES``; default: ``"abs"`` for signed data, else
            ``"above"``).
        correct_only: start with only the prompts the model answers right (needs a
            ``correct`` coord; the ``correct`` checkbox toggles it).
        ci: a mean over prompts (when it is the last reduction) carries its bootstrap
            interval of this share (``lsc.aggregate.mean``): hatched cells where it
            includes 0, low, high and N in tooltips and click details; None: plain means.
        detail: called with a clicked cell's coordinates (see ``DetailFn``); what it returns
            (an Altair chart or a widget) is shown under the per-prompt values.
        scale: where the ``colour`` toggle starts: "linear", "symlog", or "auto" (the
            default: symlog when the variable shown first spans orders of magnitude,
            ``encoding.pick_scale`` over all its values, so the choice does not change with
            the prompt).
        shared_scale: keep one colour domain across every coordinate a dropdown picks
            (every prompt, seed, cluster, model ...: ``shared_domain``), so a colour means
            the same value whichever is shown, as in ``CircuitExplorer``; a reduction (mean,
            max, share) takes its own. False: each view its own domain.
        **options: passed to ``heatmap`` on every redraw (``color``, ``center``, ...).

    Attributes:
        controls: widget per name: one per other dim (named by the dim), ``variable`` for
            Datasets, ``facet`` (``"none"`` or a dim), ``binarize`` (checkbox), ``side`` (the
            rule), ``threshold`` (number box), ``correct`` (checkbox, only with a ``correct``
            coord), ``swap`` (toggle), ``scale`` (the colour scale: linear or symlog).
        widget: the ipywidgets container holding the controls, the chart and the details.
        tokens: the prompt inspector (results with a ``pos`` or ``span`` dim): the shown
            prompt's tokens or spans (``prompt_tokens``), the clicked cell's highlighted;
            ◀ ▶ beside it step through the prompts (``step_prompt``).
        view: the current ``View``.
        array: the reduced DataArray behind the current chart.
        cell: the coordinates of the clicked cell, or None.

    Raises:
        ValueError: if ``x`` or ``y`` is missing from the data, ``facet`` is not another dim,
            a dim has no coordinates or repeats a label, ``side`` is not in ``SIDES``,
            ``correct_only`` is asked of data without a ``correct`` coord, or a Dataset's
            variables have different dims (one set of controls serves them all: pass the
            variables that share dims), or ``scale`` is not one of ``encoding.SCALES``.
    """

    def __init__(
        self,
        data: Data,
        *,
        x: str = "head",
        y: str = "layer",
        facet: str | None = None,
        variable: Hashable | None = None,
        threshold: float | None = None,
        side: str | None = None,
        correct_only: bool = False,
        ci: float | None = 0.95,
        detail: DetailFn | None = None,
        scale: str = "auto",
        shared_scale: bool = True,
        **options: Any,
    ) -> None:
        data, self._others = _check_explorer(
            data,
            x=x,
            y=y,
            facet=facet,
            variable=variable,
            threshold=threshold,
            side=side,
            correct_only=correct_only,
        )
        self.ci = None if ci is None else bootstrap.check_ci(ci)
        self.shared_scale = _validate.flag("shared_scale", shared_scale)
        first = _variable(data, variable)
        start = pick_scale(first.values if not is_mask(first) else [], scale)
        self.data, self.x, self.y, self.options = data, x, y, options
        self.cell: dict[Hashable, Any] | None = None
        self._clicked: dict[Hashable, Any] | None = None  # the axis coordinates clicked
        self._busy = True  # no redraws while the controls are built
        self.controls: dict[str, widgets.Widget] = {
            **_pick_controls(data, self._others, variable=variable, facet=facet),
            **_binarize_controls(_variable(data, variable), threshold=threshold, side=side),
            **_switches(data, correct_only=correct_only, scale=start),
        }
        self._data_range = widgets.HTML()
        self._set_dim_options(first=True)

        enable_offline()
        self._message = widgets.HTML()
        self.view = self._read()
        self.array, chart = render(data, self.view, **options)
        self._note(self.array)
        self._chart = alt.JupyterChart(chart, embed_options={"renderer": "svg", "actions": False})
        self._details = _Details(detail)
        self.tokens = widgets.HTML()
        self._steps = self._step_buttons()
        self._show_tokens()
        self.widget = self._layout()
        self._sync()
        self._watch_selection()
        self._busy = False
        for control in self.controls.values():
            control.observe(self._on_change, names="value")

    def _layout(self) -> widgets.VBox:
        """The page: the variable, facet, swap, correct and binarize controls in one row,
        the dim dropdowns in the next, the message, then the chart with the details."""
        c = self.controls
        top = [c[k] for k in ("variable", "facet", "swap", "correct", "scale") if k in c]
        return widgets.VBox(
            [
                widgets.HBox(
                    [*top, c["binarize"], c["side"], c["threshold"], self._data_range],
                    layout={"flex_flow": "row wrap", "align_items": "center"},
                ),
                widgets.HBox([c[str(d)] for d in self._others], layout={"flex_flow": "row wrap"}),
                self._inspector(),
                self._message,
                widgets.HBox(
                    [self._chart, self._details.box],
                    layout={"align_items": "flex-start", "flex_flow": "row wrap"},
                ),
            ]
        )

    def _inspector(self) -> widgets.Widget:
        """The prompt inspector's row: the prompt steps (with a ``prompt`` dim) and the
        tokens or spans; an empty box for results with neither ``pos`` nor ``span``."""
        if not {"pos", "span"} & set(_dims(self.data)):
            return widgets.HBox()
        steps = self._steps if "prompt" in self._others else []
        return widgets.HBox([*steps, self.tokens], layout={"align_items": "center"})

    def _step_buttons(self) -> list[widgets.Button]:
        """◀ and ▶: the previous and the next prompt (``step_prompt``)."""
        buttons = []
        for label, tip, step in (("◀", "previous prompt", -1), ("▶", "next prompt", 1)):
            button = widgets.Button(description=label, tooltip=tip, layout={"width": "44px"})
            button.on_click(lambda _, step=step: self.step_prompt(step))
            buttons.append(button)
        return buttons

    def step_prompt(self, step: int) -> None:
        """Pick the next (``step`` 1) or previous (-1) prompt in the prompt dropdown; from a
        pooled view, the first (or last) prompt."""
        control = self.controls.get("prompt")
        if control is None:
            return
        values = self.data["prompt"].values.tolist()
        now = control.value
        if now in values:
            control.value = values[(values.index(now) + step) % len(values)]
        else:
            control.value = values[0 if step > 0 else -1]

    def _show_tokens(self) -> None:
        """Redraw the prompt inspector for the prompt shown, marking the clicked cell's
        token or span."""
        picked = self.view.pick.get("prompt")
        prompt = None if picked is None or picked in REDUCERS else picked
        mark = self._clicked or {}
        self.tokens.value = prompt_tokens(self._current(), prompt, mark)

    @property
    def chart(self) -> ChartType:
        """The Altair chart now shown (export it with ``lenscape.export``)."""
        chart = self._chart.chart
        assert is_chart_type(chart)  # the widget holds only charts from render (never None)
        return chart

    def _current(self) -> xr.DataArray:
        """The array the variable control picks (the data itself for a DataArray)."""
        control = self.controls.get("variable")
        return _variable(self.data, None if control is None else control.value)

    def _masked(self) -> bool:
        """Whether the shown values are a mask (the variable is one, or binarize is on)."""
        return is_mask(self._current()) or self.controls["binarize"].value

    def _set_dim_options(self, first: bool = False) -> None:
        """Offer the reducers that fit the data (scores or masks) on reducible dims; keep each
        dropdown's choice, translated between matching reducers (mean <-> share ...)."""
        masked = self._masked()
        reducers = list(mask_rules.REDUCERS if masked else SCORE_REDUCERS)
        for dim in self._others:
            control = self.controls[str(dim)]
            values = self.data[dim].values.tolist()
            offered = reducers if dim in REDUCIBLE_DIMS and len(values) > 1 else []
            old = control.value
            if first:
                old = reducers[0] if dim in SAMPLE_DIMS and offered else values[0]
            elif isinstance(old, str) and old in REDUCERS:
                old = (
                    MASK_OF.get(old, old)
                    if masked
                    else {v: k for k, v in MASK_OF.items()}.get(old, old)
                )
            options = [(r, r) for r in offered] + [(_label(self.data, dim, v), v) for v in values]
            if control.options != tuple(options):
                control.options = options
            control.value = old if old in [v for _, v in options] else values[0]

    def _read(self) -> View:
        """The View the controls describe."""
        c = self.controls
        return View(
            x=self.x,
            y=self.y,
            pick={d: c[str(d)].value for d in self._others},
            variable=c["variable"].value if "variable" in c else None,
            facet=None if c["facet"].value == "none" else c["facet"].value,
            threshold=c["threshold"].value if c["binarize"].value else None,
            side=c["side"].value,
            correct_only="correct" in c and c["correct"].value,
            swap=c["swap"].value,
            ci=self.ci,
            scale=c["scale"].value,
            shared_scale=self.shared_scale,
        )

    def _sync(self) -> None:
        """Grey out controls that do not apply; show the data range beside the threshold and
        the full prompt text in the prompt control's tooltip."""
        current = self._current()
        c = self.controls
        for d in self._others:
            c[str(d)].disabled = d == c["facet"].value or d not in current.dims
        mask = is_mask(current)
        c["binarize"].disabled = mask
        c["scale"].disabled = mask or c["binarize"].value
        c["threshold"].disabled = c["side"].disabled = mask or not c["binarize"].value
        lo, hi = _range(current)
        self._data_range.value = "" if mask else f"<small>data {lo:.3g} to {hi:.3g}</small>"
        if "prompt" in c and c["prompt"].value not in REDUCERS:
            c["prompt"].tooltip = str(c["prompt"].label)

    def _on_change(self, change: dict[str, Any]) -> None:
        if self._busy:
            return
        self._busy = True
        try:
            if change["owner"] is self.controls.get("variable") and is_mask(self._current()):
                self.controls["binarize"].value = False  # a mask is shown as it is
            if change["owner"] in (self.controls.get("variable"), self.controls["binarize"]):
                self._set_dim_options()
            self._sync()
        finally:
            self._busy = False
        self.redraw()

    def redraw(self) -> None:
        """Read the controls and swap the new chart into the shown widget."""
        view = self._read()
        try:
            array, chart = render(self.data, view, **self.options)
        except ValueError as err:  # keep the last good chart and say why
            self._message.value = f"<span style='color:#b00'>{html.escape(str(err))}</span>"
            return
        self._note(array)
        self.view, self.array = view, array
        self._chart.chart = chart
        self._watch_selection()
        self._redo_details()
        self._show_tokens()

    def _redo_details(self) -> None:
        """Redraw the details of the clicked cell for the current selection (prompt -> mean
        shows the mean's details, not the old prompt's), or clear them when the cell is
        not on the new chart."""
        if self._clicked is None:
            return
        shown = all(
            d in self.array.dims and v in self.array[d].values.tolist()
            for d, v in self._clicked.items()
        )
        if shown:
            self.show_cell(self._clicked)
        else:
            self.cell = self._clicked = None
            self._details.clear()

    def _note(self, array: xr.DataArray) -> None:
        """Show the array's ``note`` (a threshold outside the data) above the chart, or clear."""
        note = array.attrs.get("note")
        self._message.value = (
            f"<span style='color:#8a5a00'>{html.escape(note)}</span>" if note else ""
        )

    def update(self, data: Data) -> None:
        """Show new data (same dims, e.g. scores of other prompts) with the current settings:
        the dim controls get the new coordinates (in label order) and the chart is swapped
        in place.

        Raises:
            ValueError: a dim without coordinates, or with a repeated label.
        """
        _check_sizes(data)
        self.data = in_label_order(data, name="data")
        self._busy = True
        try:
            self._set_dim_options()
            self._sync()
        finally:
            self._busy = False
        self.cell = self._clicked = None
        self._details.clear()
        self.redraw()

    def _watch_selection(self) -> None:
        """Follow clicks on the chart now shown (each chart swap brings new selections)."""
        if "cell" in self._chart.selections.trait_names():
            self._chart.selections.observe(self._on_select, names=["cell"])

    def _on_select(self, change: dict[str, Any]) -> None:
        points = change["new"].value
        if points:
            self.show_cell(points[0])

    def show_cell(self, cell: Mapping[Hashable, Any]) -> None:
        """Show, beside the chart, the clicked cell's values along the first reduced sample
        dim (per prompt, with texts) and ``detail``'s view of it.

        Args:
            cell: the cell's coordinates on the chart's dims, e.g. ``{"layer": 3, "head": 5}``.
        """
        da = self._current()
        pooled = self.view.pick.get("prompt") in REDUCERS
        if self.view.correct_only and "prompt" in da.dims and pooled:
            da = correct_only(da)
        at = {d: v for d, v in cell.items() if d in da.dims}
        self._clicked = {d: v for d, v in at.items() if d in self.array.dims}
        picks = {
            d: v
            for d, v in self.view.pick.items()
            if d in da.dims and d not in at and not (isinstance(v, str) and v in REDUCERS)
        }
        self.cell = {**at, **picks}
        interval = self.array.sel(self._clicked) if "bound" in self.array.dims else None
        if interval is not None and interval.dims != ("bound",):  # a facet's cell: no one mean
            interval = None
        self._details.show(da, da.sel(self.cell), at=at, picks=picks, interval=interval)
        self._show_tokens()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return with_image(self.widget._repr_mimebundle_(**kwargs), self.chart)

    def _ipython_display_(self) -> None:
        display_with_image(self.widget, self.chart)
