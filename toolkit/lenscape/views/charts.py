"""The charts beside the heatmap: bars of one dim, a result's summary, the logit lens, the
agreement of a fast estimate with exact patching, and how many prompts a map needs.

``bars`` draws a 1-D result (a head's score per prompt, marking the prompts the model gets
wrong; with ``ci``, the mean and its bootstrap interval as a line and a band), ``summary``
says in a few lines what a result holds, ``logit_lens_chart`` is a heatmap of
``lsc.logit_lens`` with the input tokens in order, ``agreement_chart`` scatters the
estimates of ``lsc.faithfulness`` against the exact effects, and ``reliability_chart`` draws
``lsc.aggregate.reliability``: how well maps from two disjoint halves of n prompts agree, for
growing n. Like ``heatmap`` they read
titles and labels from the attrs, read their input by label (``encoding.in_label_order``: a
``sortby`` or ``transpose`` draws the same chart) and never draw NaN ("not computed") as a
number: a spec holds no NaN or infinity.
"""

from __future__ import annotations

import html
from collections.abc import Hashable
from typing import Any

import altair as alt
import numpy as np
import xarray as xr
from altair.typing import ChartType

from lenscape import _validate, aggregate, bootstrap
from lenscape.mask_rules import NAN_LABEL
from lenscape.schema import LABEL_COORDS, name_from_attrs

from .encoding import (
    SHORT,
    VALUE,
    axis_encoding,
    cell_columns,
    cell_tooltip,
    distinct_labels,
    in_label_order,
    unchecked_build,
)
from .heatmaps import TITLE_LIMIT, heatmap, label_from_attrs, legend_title

#: Bar colours of prompts the model answers right and wrong (the ``correct`` coord).
ANSWER_COLORS = {"model right": "#4c78a8", "model wrong": "#d62728"}


def interval_line(interval: xr.DataArray) -> str:
    """A mean and its interval in words: "mean 0.12, 95% interval 0.05 to 0.2 (N = 85)", or
    why there is no interval.

    Args:
        interval: one cell of ``lsc.aggregate.mean``'s result: dim ``bound`` (mean, low,
            high), coord ``n`` and attrs ``ci`` (and ``interval_note``).
    """
    mean, low, high = (float(interval.sel(bound=b)) for b in aggregate.BOUNDS)
    n = int(interval["n"]) if "n" in interval.coords else None
    count = f" (N = {n})" if n is not None else ""
    if not (np.isfinite(low) and np.isfinite(high)):
        return f"mean {mean:.4g}, no interval{count}: fewer than 2 prompts, or an infinite value"
    share = bootstrap.percent(float(interval.attrs.get("ci", 0.95)))
    return f"mean {mean:.4g}, {share} interval {low:.4g} to {high:.4g}{count}"


@unchecked_build
def bars(
    da: xr.DataArray,
    *,
    y: str,
    title: str | None = None,
    ci: float | None = None,
    actions: bool = False,
) -> alt.Chart | alt.LayerChart:
    """A 1-D DataArray as horizontal bars, one per coordinate of ``y`` (e.g. a head's score
    per prompt); a string label coord along ``y`` (``text``) gives the tick labels.

    Args:
        da: values with the single dim ``y``, e.g. (prompt,).
        y: the dim, one bar per coordinate, in label order (``in_label_order``).
        title: chart title (default: the description from the attrs).
        ci: also draw the mean over ``y`` (a line) and its bootstrap interval of this share
            (a band; ``lsc.aggregate.mean`` with its defaults), said in the subtitle.
        actions: show Vega's actions menu.

    Returns:
        An ``alt.Chart`` (an ``alt.LayerChart`` with ``ci``); NaN and +-inf bars are left
        out of the bars but kept in the data.

    Raises:
        TypeError: ``da`` is not a DataArray, or ``ci`` not a number.
        ValueError: if ``da`` has another dim than ``y``, its labels repeat, or ``ci`` is
            outside (0, 1).
    """
    _validate.result("da", da, kind=xr.DataArray, made_by="a lenscape method")
    if ci is not None:
        bootstrap.check_ci(ci)
    if da.dims != (y,):
        raise ValueError(
            f"bars takes a 1-D array along {y!r}, got dims {tuple(da.dims)}; "
            "select or reduce the others first."
        )
    da = in_label_order(da)
    full = label_from_attrs(da)
    cols = cell_columns(da)
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
    if labels:  # labels that tell the bars apart; the full text stays in the tooltip
        short = distinct_labels(da[labels[0]].values.tolist(), da[y].values.tolist())
        da = da.assign_coords({f"{labels[0]}{SHORT}": (y, short)})
        ticks = {y: f"{labels[0]}{SHORT}"}
    colour = _answer_colours(da, y, data["values"], cols)
    chart = (
        alt.Chart(data)
        .mark_bar(color="#4c78a8")
        .encode(
            x=alt.X(f"{VALUE}:Q", title=legend_title(full)),
            tooltip=cell_tooltip(da, False, full),
            **axis_encoding(da, y, "y", cols, ticks),
            **colour,
        )
    )
    heading = alt.TitleParams(title or full, fontSize=12)
    if ci is not None:
        interval = aggregate.mean(da, y, ci=ci)
        chart = alt.layer(*_interval_marks(interval, legend_title(full)), chart)
        heading = alt.TitleParams(
            title or full,
            fontSize=12,
            subtitle=[interval_line(interval), "line: mean · band: interval (bootstrap)"],
        )
    return chart.properties(
        width=220,
        height=alt.Step(14),
        title=heading,
        usermeta={"embedOptions": {"actions": actions}},
    )


def _answer_colours(
    da: xr.DataArray, y: str, rows: list[dict[str, Any]], cols: dict[str, list[Any]]
) -> dict[str, Any]:
    """The bars' colour encoding flagging wrong answers (each row gains its ``answer``) when
    ``da`` has a ``correct`` coord along ``y``; none otherwise."""
    if "correct" not in da.coords or da["correct"].dims != (y,):
        return {}
    answers = list(ANSWER_COLORS)
    for row, right in zip(rows, cols["correct"], strict=True):
        row["answer"] = answers[0] if right else answers[1]
    return {
        "color": alt.Color(
            "answer:N",
            scale=alt.Scale(domain=answers, range=list(ANSWER_COLORS.values())),
            title="model's answer",
        )
    }


def _interval_marks(interval: xr.DataArray, axis_title: str | list[str]) -> list[alt.Chart]:
    """A band from low to high and a line at the mean across a bar chart's whole height
    (whichever of them is a number: the spec holds no NaN)."""
    mean, low, high = (float(interval.sel(bound=b)) for b in aggregate.BOUNDS)
    marks = []
    if np.isfinite(low) and np.isfinite(high):
        band = alt.Data(values=[{"low": low, "high": high}])
        marks.append(
            alt.Chart(band)
            .mark_rect(color="#9e9e9e", opacity=0.3)
            .encode(x=alt.X("low:Q", title=axis_title), x2="high:Q")
        )
    if np.isfinite(mean):
        line = alt.Data(values=[{"mean": mean}])
        marks.append(
            alt.Chart(line)
            .mark_rule(color="#303030", strokeDash=[4, 2])
            .encode(x=alt.X("mean:Q", title=axis_title))
        )
    return marks


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
        da: any result DataArray, e.g. (prompt, layer, head); read by label (dims in the
            schema's order, ties among the strongest cells listed in label order).
        top: how many of the strongest cells to list.

    Returns:
        A ``Summary``; it displays as a few lines in a notebook.

    Raises:
        TypeError: ``da`` is not a DataArray, ``top`` not an integer.
        ValueError: ``top`` < 0, or labels that repeat along a dim.
    """
    _validate.result("da", da, kind=xr.DataArray, made_by="a lenscape method")
    top = _validate.integer("top", top, low=0)
    da = in_label_order(da)
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
        for i in np.argsort(-flat, kind="stable")[:top]:
            at = dict(zip(mean.dims, np.unravel_index(i, mean.shape), strict=True))
            cell = mean.isel(at)
            where = ", ".join(f"{d} {cell[d].item()}" for d in mean.dims)
            best.append(f"{where}: {float(cell):.4g}")
        lines.append(
            ("strongest (mean over " + " and ".join(pooled) + "): " if pooled else "strongest: ")
            + "; ".join(best)
        )
    return Summary(da, lines)


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


def agreement_chart(report: xr.Dataset, *, width: int = 210, height: int = 200) -> ChartType:
    """Scatter of estimated vs exact prompt-mean effects, one panel per component type, and
    the agreement statistics with their intervals.

    Args:
        report: ``lsc.faithfulness(...)``'s Dataset (``exact_heads``, ``estimate_heads``,
            ``exact_blocks``, ``estimate_blocks``, ``pearson_means``).
        width, height: of each panel, in pixels. The defaults fit a notebook's output area
            of about 1,000 px: three panels with their axes and the legend, every subtitle
            line within its panel (one line per estimator).

    Returns:
        A first row of panels for heads, attention blocks and MLP blocks side by side
        (wrapped ``AGREEMENT_COLUMNS`` to a row); x =
        exact activation patching, y = estimate, one colour per estimator, the line y = x
        for reference, and each estimator's Pearson r over prompt means in the panel title
        (named so: the report's ``pearson_cells`` is another statistic, r over single
        cells) with its interval in brackets. Where the report carries intervals
        (``<statistic>_interval``), a second row draws r over prompt means, r over cells
        and the top-k overlap per component type and estimator as points with error bars
        (the percentile-bootstrap interval over prompts). No actions menu: its "Open in
        Vega Editor" link sends the chart to an outside site.

    Panels follow the component types' order (heads, attention, MLP) and the report is
    read by label, so a ``sortby`` or ``transpose`` of it draws the same chart. A statistic
    that is NaN (undefined: a constant map) is written "undefined", and cells whose effect
    is NaN are counted in the panel's subtitle, never drawn.

    Raises:
        TypeError: ``report`` is not a Dataset, or a size is not a positive integer.
        ValueError: ``report`` is the result of another method or lacks a variable of
            ``lsc.faithfulness``'s report, or its labels repeat.
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
        methods=("faithfulness",),
    )
    width = _validate.positive_int("width", width)
    height = _validate.positive_int("height", height)
    report = in_label_order(report, name="report")
    units = report["exact_heads"].attrs.get("units", "")
    types = report["component_type"].values.tolist()
    types = [t for t in _COMPONENT_TYPES if t in types] + [
        t for t in types if t not in _COMPONENT_TYPES
    ]
    panels = [
        _agreement_panel(report, ctype, units=units, width=width, height=height) for ctype in types
    ]
    rows: list[ChartType] = [alt.concat(*panels, columns=AGREEMENT_COLUMNS)]
    if all(f"{stat}_interval" in report.data_vars for stat in _INTERVAL_PANELS):
        rows.append(_interval_row(report, types, width=width))
    attrs = report.attrs
    return (
        (alt.vconcat(*rows) if len(rows) > 1 else rows[0])
        .properties(
            title=alt.Title(
                [
                    "Can I trust the fast map?",
                    "Estimate vs exact activation patching (prompt means)",
                ],
                subtitle=f"{attrs.get('model', '')}, {attrs.get('n_prompts', '?')} prompts of "
                f"{attrs.get('prompt_set', '?')}, metric {attrs.get('metric', '?')}",
                anchor="start",
            ),
            usermeta={"embedOptions": {"actions": False}},
        )
        .configure_view(stroke=None)
    )


#: Panels per row of ``agreement_chart`` (more component types wrap to the next row).
AGREEMENT_COLUMNS = 3
#: How far beyond the data a scatter's axes reach (a share of the data's range), so points
#: at the limits (r = 1, the largest effect) sit inside the frame, not on its edge.
AXIS_PAD = 0.06
#: Panel titles of ``agreement_chart`` per component type.
_COMPONENT_TYPES = {"head": "heads", "attn": "attention blocks", "mlp": "MLP blocks"}
#: The statistics ``agreement_chart`` draws with their intervals, and their axis titles.
_INTERVAL_PANELS = {
    "pearson_means": "r over prompt means",
    "pearson_cells": "r over cells",
    "top_overlap": "top-{k} overlap",
}


def _with_interval(report: xr.Dataset, stat: str, **at: Any) -> str:
    """A statistic for a subtitle: "0.93 [0.90, 0.95]" (its interval in brackets, where the
    report carries one and it is a number), or "undefined" where the statistic is NaN."""
    value = float(report[stat].sel(at))
    if not np.isfinite(value):
        return "undefined"
    name = f"{stat}_interval"
    if name not in report.data_vars:
        return f"{value:.2f}"
    low, high = (float(report[name].sel({**at, "bound": b})) for b in ("low", "high"))
    return (
        f"{value:.2f} [{low:.2f}, {high:.2f}]" if np.isfinite([low, high]).all() else f"{value:.2f}"
    )


def _interval_row(report: xr.Dataset, types: list[str], *, width: int) -> alt.HConcatChart:
    """``agreement_chart``'s second row: one panel per statistic of ``_INTERVAL_PANELS``."""
    share = bootstrap.percent(float(report["pearson_means_interval"].attrs.get("ci", 0.95)))
    panels = [
        _interval_panel(
            report, stat, title.format(k=report.attrs.get("top_k", "k")), types, labels=i == 0
        ).properties(width=width - 30 if i == 0 else width)
        for i, (stat, title) in enumerate(_INTERVAL_PANELS.items())
    ]
    return alt.hconcat(*panels).properties(
        title=alt.Title(
            f"Agreement with {share} intervals",
            subtitle=[
                "points: the statistic",
                f"bars: its {share} interval ({bootstrap.METHOD} over prompts)",
            ],
            anchor="start",
        )
    )


def _interval_panel(
    report: xr.Dataset, stat: str, title: str, types: list[str], *, labels: bool = True
) -> alt.LayerChart:
    """A point per (component type, estimator) at ``stat`` with its interval as an error
    bar; undefined (NaN) statistics are left out and named in the subtitle, an undefined
    interval leaves the point without a bar. ``labels``: name the component types on the
    y axis (the first panel of a row; the others share its rows)."""
    rows, undefined = [], []
    for ctype in types:
        kind = _COMPONENT_TYPES.get(ctype, ctype)
        for label in report["estimator"].values.tolist():
            at = {"estimator": label, "component_type": ctype}
            value = float(report[stat].sel(at))
            if not np.isfinite(value):
                undefined.append(f"{kind} ({label})")
                continue
            bounds = [
                float(report[f"{stat}_interval"].sel({**at, "bound": b})) for b in ("low", "high")
            ]
            ends = (
                dict(zip(("low", "high"), bounds, strict=True)) if np.isfinite(bounds).all() else {}
            )
            rows.append({"component type": kind, "estimator": label, "value": value, **ends})
    base = alt.Chart(alt.Data(values=rows)).encode(
        y=alt.Y(
            "component type:N",
            sort=[_COMPONENT_TYPES.get(t, t) for t in types],
            title=None,
            axis=alt.Axis() if labels else alt.Axis(labels=False, ticks=False),
        ),
        yOffset="estimator:N",
        color=alt.Color("estimator:N", title="estimator"),
    )
    low = -1.0 if stat.startswith("pearson") else 0.0
    pad = AXIS_PAD * (1.0 - low)
    domain = [low - pad, 1.0 + pad]  # points at r = 1 inside the frame
    bars = (
        base.transform_filter("isValid(datum.low)")
        .mark_rule(strokeWidth=2)
        .encode(
            x=alt.X("low:Q", title=title, scale=alt.Scale(domain=domain, nice=False)), x2="high:Q"
        )
    )
    points = base.mark_point(filled=True, size=40).encode(
        x=alt.X("value:Q", title=title, scale=alt.Scale(domain=domain, nice=False)),
        tooltip=[
            alt.Tooltip("component type:N"),
            alt.Tooltip("estimator:N"),
            alt.Tooltip("value:Q", title=title, format=".3f"),
            alt.Tooltip("low:Q", title="interval: low", format=".3f"),
            alt.Tooltip("high:Q", title="interval: high", format=".3f"),
        ],
    )
    subtitle = (
        ["undefined, not drawn:", *[f"{u}," for u in undefined[:-1]], undefined[-1]]
        if undefined
        else alt.Undefined
    )
    return alt.layer(bars, points).properties(title=alt.Title(title, subtitle=subtitle))


def _agreement_panel(
    report: xr.Dataset, ctype: str, *, units: str, width: int, height: int
) -> alt.LayerChart:
    """One ``agreement_chart`` panel: the prompt-mean effects of one component type, estimate
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
    pad = AXIS_PAD * ((high - low) or 1.0)
    low, high = low - pad, high + pad  # the extreme points inside the frame
    r_text = ["r over prompt means:"] + [
        f"{label}: {_with_interval(report, 'pearson_means', estimator=label, component_type=ctype)}"
        for label in report["estimator"].values.tolist()
    ]
    if not_computed:
        r_text.append(f"{not_computed} cells {NAN_LABEL} (NaN), not drawn")
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
                scale=alt.Scale(domain=[low, high], nice=False),
            ),
            y=alt.Y(
                "estimate:Q",
                title=f"estimate ({units})",
                scale=alt.Scale(domain=[low, high], nice=False),
            ),
            color=alt.Color("estimator:N", title="estimator"),
            tooltip=tooltip,
        )
    )
    return alt.layer(diagonal, points).properties(
        width=width,
        height=height,
        title=alt.Title(
            _COMPONENT_TYPES.get(ctype, ctype), subtitle=r_text, anchor="start", subtitleFontSize=11
        ),
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
        est = estimate.sel(estimator=label).transpose(*exact.dims)
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


#: Colours of ``reliability_chart``'s two statistics.
RELIABILITY_COLORS = ("#1f77b4", "#d95f02")


@unchecked_build
def reliability_chart(
    reliability: xr.Dataset, *, width: int = 300, height: int = 220, actions: bool = False
) -> alt.HConcatChart:
    """How many prompts do I need? Split-half reliability against prompts per half.

    Args:
        reliability: ``lsc.aggregate.reliability(da)``'s Dataset (``correlation``,
            ``top_overlap``: (size, bound)), e.g. ``scores.lsc.reliability()``.
        width, height: of each panel, in pixels.
        actions: show Vega's actions menu (its "Open in Vega Editor" link goes online).

    Returns:
        Two panels over the prompts per half (a log axis at the sizes measured): r between
        the two halves' maps and the overlap of their top-k cells, each the mean over the
        random splits (a line with points) in a band holding the middle of the splits
        (the ``ci`` of ``reliability``). The subtitle says how the halves were drawn and
        the values at the largest size; sizes where a statistic is undefined (NaN) are left
        out and said.

    Raises:
        TypeError: ``reliability`` is not a Dataset, or a size is not a positive integer.
        ValueError: it is the result of another method, or lacks a variable.
    """
    _validate.result(
        "reliability",
        reliability,
        kind=xr.Dataset,
        made_by="lsc.aggregate.reliability",
        variables=("correlation", "top_overlap"),
        dims=("size", "bound"),
        methods=("reliability",),
    )
    width = _validate.positive_int("width", width)
    height = _validate.positive_int("height", height)
    actions = _validate.flag("actions", actions)
    rel = in_label_order(reliability, name="reliability")
    k = rel.attrs.get("top_k", "k")
    names = {"correlation": "r between the halves' maps", "top_overlap": f"top-{k} overlap"}
    rows, said = _reliability_rows(rel, names)
    sizes = [int(n) for n in rel["size"].values]
    x = alt.X(
        "size:Q",
        scale=alt.Scale(type="log", domain=[sizes[0], sizes[-1]], nice=False),
        axis=alt.Axis(values=sizes, format="d"),
        title=f"prompts per half ({rel.attrs.get('n_prompts', '?')} prompts in all)",
    )
    lows = [r["low"] for r in rows if "low" in r] + [r["mean"] for r in rows]
    y_scale = alt.Scale(domain=[min([0.0, *lows]), 1.0])
    panels = []
    for name, colour in zip(names.values(), RELIABILITY_COLORS, strict=True):
        base = alt.Chart(alt.Data(values=[r for r in rows if r["statistic"] == name])).encode(x=x)
        band = (
            base.transform_filter("isValid(datum.low)")
            .mark_area(opacity=0.25, color=colour)
            .encode(y=alt.Y("low:Q", scale=y_scale, title=name), y2="high:Q")
        )
        line = base.mark_line(point=alt.OverlayMarkDef(color=colour), color=colour).encode(
            y=alt.Y("mean:Q", scale=y_scale, title=name),
            tooltip=[
                alt.Tooltip("size:Q", title="prompts per half"),
                alt.Tooltip("mean:Q", title=f"{name}: mean over splits", format=".3f"),
                alt.Tooltip("low:Q", title="splits: low", format=".3f"),
                alt.Tooltip("high:Q", title="splits: high", format=".3f"),
            ],
        )
        panels.append(alt.layer(band, line).properties(width=width, height=height, title=name))
    return alt.hconcat(*panels).properties(
        title=alt.Title(
            "How many prompts do I need? Split-half reliability",
            subtitle=said,
            anchor="start",
            limit=TITLE_LIMIT,
        ),
        usermeta={"embedOptions": {"actions": actions}},
    )


def _reliability_rows(
    rel: xr.Dataset, names: dict[str, str]
) -> tuple[list[dict[str, Any]], list[str]]:
    """``reliability_chart``'s points (size, statistic, mean and, where numbers, low and
    high) and its subtitle lines: how the halves were drawn, the values at the largest
    size, and what is undefined."""
    rows, undefined = [], []
    for var, name in names.items():
        for size in rel["size"].values.tolist():
            mean, low, high = (float(rel[var].sel(size=size, bound=b)) for b in aggregate.BOUNDS)
            if not np.isfinite(mean):
                undefined.append(f"{name} at {size}")
                continue
            ends = {"low": low, "high": high} if np.isfinite([low, high]).all() else {}
            rows.append({"size": size, "statistic": name, "mean": mean, **ends})
    share = bootstrap.percent(float(rel.attrs.get("ci", 0.95)))
    splits = rel.attrs.get("n_splits", "?")
    lines = [
        f"map: {rel.attrs.get('map', '?')}",
        f"two disjoint halves of n prompts each, {splits} random splits per n; line: the mean "
        f"over splits, band: the middle {share} of the splits",
    ]
    last = rel["size"].values[-1]
    at_last = [float(rel[var].sel(size=last, bound="mean")) for var in names]
    values = [
        f"{name} {v:.2f}" if np.isfinite(v) else f"{name} undefined"
        for name, v in zip(names.values(), at_last, strict=True)
    ]
    lines.append(f"at {last} prompts per half: " + ", ".join(values))
    keys = [k for k in ("model", "map_method", "metric") if k in rel.attrs]
    if keys:
        lines.append(" · ".join(f"{k.removeprefix('map_')}: {rel.attrs[k]}" for k in keys))
    if undefined:
        lines.append(f"undefined (NaN), not drawn: {', '.join(undefined)}")
    return rows, lines
