"""A circuit explorer: an edge-budget slider and a receiver-kind filter redraw the graph.

``CircuitExplorer(scores)`` shows ``lsc.circuit_graph`` of a (sender, receiver) result in
one ``alt.JupyterChart`` and swaps its chart in place when a control changes (as
``lsc.Explorer`` does), so the page never rebuilds. The slider sets how many of the edges
with the largest |score| are drawn (the top edges, not pruned to paths: pruning lives with
``lsc.circuit`` on the capture side), in steps spaced evenly on a log scale (1, 2, 3, 5, 7,
10, 15, 20, 30 ...: ``budget_steps``), so the few dozen edges a circuit is read at take most
of its length; the toggles pick the receiver kinds shown. ``stability=`` (a
``lsc.circuit_stability`` result) draws each edge as opaque as it is stable.

The colour scale follows the views' one rule (``views.circuit``): views of one result share
the scale of the whole result. Every budget and receiver kind is drawn on the symmetric-log
scale up to the largest |score| of all edges (``circuit_graph``'s ``limit``), so the same
colour means the same score whatever is toggled, and the subtitle says so.
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
from .offline import enable_offline, with_image

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


class CircuitExplorer:
    """Edge-budget slider and receiver-kind filter over ``circuit_graph``.

    Attributes:
        scores: the (sender, receiver) edge scores drawn.
        widget: the ipywidgets box (controls above the chart).
    """

    def __init__(self, scores: xr.DataArray, *, edges: int = 30, **options: Any):
        """
        Args:
            scores: (sender, receiver) from ``lsc.edge_attribution`` (average a per-prompt
                result over ``prompt`` first).
            edges: edges drawn at first (a step of its own on the slider).
            options: passed to ``circuit_graph`` (``exact``, ``stability``, ``limit``,
                ``scale``, ``width``, ``height``, ``title``); ``limit`` defaults to the
                largest finite |score| of all edges (the one scale of every view).

        Raises:
            TypeError: ``scores`` is not a DataArray or ``edges`` not an integer.
            ValueError: ``scores`` is not an edge result or holds no finite score, or
                ``edges`` < 1.
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
        self.scores, self.options = scores, {"limit": largest or None, **options}
        most = min(finite, MAX_EDGES)
        self.budget = widgets.SelectionSlider(
            options=budget_steps(most, edges),
            value=min(edges, most),
            description="edges",
            continuous_update=False,
        )
        present = [k for k in RECEIVER_KINDS if (scores["receiver_kind"] == k).any()]
        self.kinds = widgets.ToggleButtons(
            options=["all", *present], value="all", description="receivers"
        )
        self._message = widgets.HTML()
        enable_offline()
        self._chart = alt.JupyterChart(
            self._build(), embed_options={"renderer": "svg", "actions": False}
        )
        for control in (self.budget, self.kinds):
            control.observe(lambda _: self.redraw(), names="value")
        self.widget = widgets.VBox(
            [widgets.HBox([self.budget, self.kinds]), self._message, self._chart]
        )

    @property
    def chart(self) -> Any:
        """The chart shown now (what ``lsc.export`` writes)."""
        return self._chart.chart

    def _build(self) -> Any:
        kinds = RECEIVER_KINDS if self.kinds.value == "all" else (self.kinds.value,)
        return circuit_graph(self.scores, edges=self.budget.value, kinds=kinds, **self.options)

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
