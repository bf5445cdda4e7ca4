"""A circuit explorer: an edge-budget slider and a receiver-kind filter redraw the graph.

``CircuitExplorer(scores)`` shows ``lsc.circuit_graph`` of a (sender, receiver) result in
one ``alt.JupyterChart`` and swaps its chart in place when a control changes (as
``lsc.Explorer`` does), so the page never rebuilds. The slider sets how many of the edges
with the largest |score| are drawn (the top edges, not pruned to paths: pruning lives with
``lsc.circuit`` on the capture side), in steps spaced evenly on a log scale (1, 2, 3, 5, 7,
10, 15, 20, 30 ...: ``budget_steps``), so the few dozen edges a circuit is read at take most
of its length; the toggles pick the receiver kinds shown and, for scores by span
(``positions="spans"``), the span whose edges are drawn ("all", or one span: the edges its
senders write there, crossing ones included), every span's columns staying in place.
``stability=`` (a ``lsc.circuit_stability`` result) draws each edge as opaque as it is
stable.

The colour scale follows the views' one rule (``views.encoding``): a control that steps
through parts of one result keeps its colours. Every budget and receiver kind is drawn up
to the largest |score| of all edges (``circuit_graph``'s ``limit``), never a fixed one, so
the same colour means the same score whatever is toggled, and the subtitle says so. The
``colour`` toggle switches between the symmetric-log and the linear scale (colour and
width); it starts on ``scale``'s choice, by default ``encoding.pick_scale``'s rule over
every finite score (symmetric-log when they span orders of magnitude).
"""

from __future__ import annotations

import html
from typing import Any

import altair as alt
import ipywidgets as widgets
import numpy as np
import xarray as xr

from .. import _validate
from ..schema import RECEIVER_KINDS
from .circuit import MAX_EDGES, check_edges, circuit_graph
from .encoding import pick_scale
from .offline import enable_offline, with_image

#: The edge slider's width: room for its 20-odd budgets to be told apart by the hand (its
#: default, about 30 px of track beside the toggles, was not).
SLIDER_WIDTH = "440px"
#: The slider's steps within each power of ten (1, 1.5, 2, 3, 5, 7 times it).
STEPS = (1, 1.5, 2, 3, 5, 7)


def budget_steps(most: int, start: int) -> list[int]:
    """The budgets the slider offers: 1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, ... up to
    ``most``, with ``most`` and ``start`` themselves, in increasing order."""
    steps = {1, 2, 3, 5, 7, most, min(start, most)}
    scale = 10
    while scale <= most:
        steps |= {int(step * scale) for step in STEPS if step * scale <= most}
        scale *= 10
    return sorted(steps)


def _span_toggle(scores: xr.DataArray) -> widgets.ToggleButtons | None:
    """The span toggles of scores by span ("all", then each span in prompt order); None for
    position-agnostic scores."""
    if "span" not in scores.dims:
        return None
    spans = [str(span) for span in scores["span"].values]
    return widgets.ToggleButtons(
        options=["all", *spans],
        value="all",
        description="span",
        tooltips=["every span", *["the edges whose sender writes at this span"] * len(spans)],
        style={"button_width": "64px"},
    )


class CircuitExplorer:
    """Edge-budget slider and receiver-kind filter over ``circuit_graph``.

    Attributes:
        scores: the (sender, receiver) or, by span, (span, sender, receiver) edge scores.
        budget, kinds, scale: the controls: the edge budget (a slider), the receiver kinds
            and the colour scale ("symlog" or "linear"; toggles).
        span: by span, the span whose edges are drawn ("all" or a span; toggles); None for
            position-agnostic scores.
        widget: the ipywidgets box (controls above the chart).
    """

    def __init__(self, scores: xr.DataArray, *, edges: int = 30, **options: Any):
        """
        Args:
            scores: (sender, receiver) from ``lsc.edge_attribution``, or (span, sender,
                receiver) from it with ``positions="spans"`` (average a per-prompt result
                over ``prompt`` first).
            edges: edges drawn at first (a step of its own on the slider).
            options: passed to ``circuit_graph`` (``exact``, ``stability``, ``limit``,
                ``width``, ``height``, ``title``); ``limit`` defaults to the largest finite
                |score| of all edges (the one scale of every view). ``scale`` ("auto",
                "symlog" or "linear") sets where the ``colour`` toggle starts; "auto" (the
                default) decides on every finite score (``encoding.pick_scale``).

        Raises:
            TypeError: ``scores`` is not a DataArray or ``edges`` not an integer.
            ValueError: ``scores`` is not an edge result or holds no finite score,
                ``edges`` < 1, or an unknown ``scale``.
        """
        scores = check_edges(scores, "scores")
        edges = _validate.integer("edges", edges, low=1)
        finite = int(np.isfinite(scores.values).sum())
        if not finite:
            raise ValueError(
                "scores holds no finite edge score (every value is NaN or infinite); "
                "pass the result of lsc.edge_attribution."
            )
        largest = float(np.abs(scores.values[np.isfinite(scores.values)]).max())
        start = pick_scale(scores.values, options.pop("scale", "auto"))
        self.scores, self.options = scores, {"limit": largest or None, **options}
        self.scale = widgets.ToggleButtons(
            options=["symlog", "linear"],
            value=start,
            description="colour",
            tooltips=["symmetric log: weak edges show", "linear in the score"],
            style={"button_width": "80px"},
        )
        most = min(finite, MAX_EDGES)
        self.budget = widgets.SelectionSlider(
            options=budget_steps(most, edges),
            value=min(edges, most),
            description="edges",
            continuous_update=False,
            layout={"width": SLIDER_WIDTH, "min_width": SLIDER_WIDTH},
        )
        present = [k for k in RECEIVER_KINDS if (scores["receiver_kind"] == k).any()]
        self.kinds = widgets.ToggleButtons(
            options=["all", *present],
            value="all",
            description="receivers",
            style={"button_width": "64px"},
        )
        self.span = _span_toggle(scores)
        self._message = widgets.HTML()
        enable_offline()
        self._chart = alt.JupyterChart(
            self._build(), embed_options={"renderer": "svg", "actions": False}
        )
        for control in (self.budget, self.kinds, self.scale, self.span):
            if control is not None:
                control.observe(lambda _: self.redraw(), names="value")
        # the slider on a row of its own: beside the toggles, flexbox squeezed it to 30 px
        self.widget = widgets.VBox(
            [
                self.budget,
                widgets.HBox(
                    [self.kinds, self.scale, *([self.span] if self.span is not None else [])],
                    layout={"flex_flow": "row wrap", "align_items": "center"},
                ),
                self._message,
                self._chart,
            ]
        )

    @property
    def chart(self) -> Any:
        """The chart shown now (what ``lsc.export`` writes)."""
        return self._chart.chart

    def _build(self) -> Any:
        kinds = RECEIVER_KINDS if self.kinds.value == "all" else (self.kinds.value,)
        budget, scale = self.budget.value, self.scale.value
        spans = None if self.span is None or self.span.value == "all" else (self.span.value,)
        return circuit_graph(
            self.scores, edges=budget, kinds=kinds, spans=spans, scale=scale, **self.options
        )

    def redraw(self) -> None:
        """Read the controls and swap the new chart into the shown widget."""
        try:
            chart = self._build()
        except ValueError as err:  # keep the last good chart and say why
            self._message.value = f"<span style='color:#b00'>{html.escape(str(err))}</span>"
            return
        self._message.value = ""
        self._chart.chart = chart

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return with_image(self.widget._repr_mimebundle_(**kwargs), self.chart)
