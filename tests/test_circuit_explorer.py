"""CircuitExplorer (views/circuit_explorer.py): the controls swap the graph in place."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import xarray as xr

from lenscape.capture.edges.graph import Graph
from lenscape.views.circuit_explorer import CircuitExplorer, budget_steps


def _scores() -> xr.DataArray:
    graph = Graph(2, 4, 2)
    values = np.random.default_rng(1).normal(size=graph.valid.shape)
    values[~graph.valid] = np.nan
    return xr.DataArray(values, dims=("sender", "receiver"), coords=graph.coords())


def _edges(explorer: CircuitExplorer) -> list[dict]:
    spec = explorer.chart.to_dict()
    return next(layer for layer in spec["layer"] if layer["mark"]["type"] == "rule")["data"][
        "values"
    ]


def test_slider_and_kind_filter_redraw_the_same_chart_widget():
    explorer = CircuitExplorer(_scores(), edges=5)
    shown = explorer._chart
    assert len(_edges(explorer)) == 5
    explorer.budget.value = 15
    assert explorer._chart is shown and len(_edges(explorer)) == 15
    explorer.kinds.value = "v"
    rows = _edges(explorer)
    assert rows and {row["kind"] for row in rows} == {"v"}
    assert explorer.budget.options[-1] == int(Graph(2, 4, 2).valid.sum())
    assert "q" in explorer.kinds.options and "logits" in explorer.kinds.options


def test_bad_scores_and_budgets_are_refused_by_name():
    with pytest.raises(TypeError, match=r"scores must be a \(sender, receiver\) xarray"):
        CircuitExplorer({})
    with pytest.raises(ValueError, match="scores holds no finite edge score"):
        CircuitExplorer(_scores() * np.nan)
    with pytest.raises(TypeError, match="edges must be an integer >= 1, got None"):
        CircuitExplorer(_scores(), edges=None)


def _colour_domain(explorer: CircuitExplorer) -> list[float]:
    spec = explorer.chart.to_dict()
    lines = next(layer for layer in spec["layer"] if layer["mark"]["type"] == "rule")
    return lines["encoding"]["color"]["scale"]["domain"]


def test_one_colour_scale_across_views_and_a_title_that_follows_the_controls():
    """Choosing a budget or a receiver kind keeps the colour scale (the same colour means the
    same score in every view) and the title names what is drawn."""
    scores = _scores()
    largest = float(np.nanmax(np.abs(scores.values)))
    explorer = CircuitExplorer(scores, edges=5)
    assert _colour_domain(explorer) == [-largest, largest]
    assert explorer.chart.to_dict()["title"]["text"].startswith("Top 5 edges by |score| · all")
    explorer.kinds.value = "v"
    assert _colour_domain(explorer) == [-largest, largest]
    assert explorer.chart.to_dict()["title"]["text"].endswith("· receivers v")
    explorer.budget.value = 2
    assert _colour_domain(explorer) == [-largest, largest]
    assert CircuitExplorer(scores, limit=1.0).options["limit"] == 1.0
    notes = explorer.chart.to_dict()["title"]["subtitle"]
    assert any("shared by every view of these scores" in note for note in notes)


def _colour_scale(explorer: CircuitExplorer) -> dict:
    spec = explorer.chart.to_dict()
    return next(layer for layer in spec["layer"] if layer["mark"]["type"] == "rule")["encoding"]


def test_the_colour_toggle_starts_on_the_rule_and_switches_scales_in_place():
    """Normal scores (no heavy tail) start linear, a result with one edge 100 times the rest
    starts symmetric-log (``pick_scale`` over every score); the toggle switches both colour
    and width, the domain staying the whole result's."""
    scores = _scores()
    explorer = CircuitExplorer(scores, edges=5)
    shown = explorer._chart
    assert explorer.scale.value == "linear"
    assert _colour_scale(explorer)["color"]["scale"]["type"] == "linear"
    explorer.scale.value = "symlog"
    enc = _colour_scale(explorer)
    assert explorer._chart is shown
    assert enc["color"]["scale"]["type"] == "symlog"
    assert enc["strokeWidth"]["scale"]["type"] == "sqrt"
    assert _colour_domain(explorer) == _colour_domain(CircuitExplorer(scores, scale="linear"))
    heavy = scores.copy()
    heavy[0, -1] = 1000.0
    assert CircuitExplorer(heavy).scale.value == "symlog"
    assert CircuitExplorer(heavy, scale="linear").scale.value == "linear"
    unknown = r"Unknown scale 'log10'; choose one of \['auto', 'symlog'"
    with pytest.raises(ValueError, match=unknown):
        CircuitExplorer(scores, scale="log10")


def test_the_slider_steps_evenly_on_a_log_scale():
    """Half of the slider's length lies below 30 edges, where a circuit is read, not at its
    far left; the first budget asked for and the largest are steps of their own."""
    steps = budget_steps(2000, 40)
    assert steps[:12] == [1, 2, 3, 5, 7, 10, 15, 20, 30, 40, 50, 70]
    assert steps[-1] == 2000 and steps == sorted(set(steps))
    ratios = np.diff(np.log10(steps))
    assert ratios.max() <= np.log10(2)  # no step more than doubles the budget
    below_30 = sum(step <= 30 for step in steps) / len(steps)
    assert below_30 > 0.4
    explorer = CircuitExplorer(_scores(), edges=4)
    assert 4 in explorer.budget.options and explorer.budget.value == 4


def test_the_explorer_displays_with_a_picture_of_its_graph():
    """A notebook saved with its outputs shows the graph where no widget can be drawn."""
    data, metadata = CircuitExplorer(_scores(), edges=5)._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert base64.b64decode(data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    assert metadata["image/png"]["width"] > 100


def test_the_edge_slider_has_a_row_of_its_own_and_a_usable_length():
    """Issue 61: beside the two toggle rows, flexbox squeezed the slider to about 30 px. It
    is the first row of the widget, SLIDER_WIDTH wide and never narrower; the toggles wrap
    in the row below."""
    from lenscape.views.circuit_explorer import SLIDER_WIDTH

    explorer = CircuitExplorer(_scores(), edges=5)
    assert explorer.widget.children[0] is explorer.budget
    assert explorer.budget.layout.width == explorer.budget.layout.min_width == SLIDER_WIDTH
    assert int(SLIDER_WIDTH.removesuffix("px")) >= 400
    toggles = explorer.widget.children[1]
    assert list(toggles.children) == [explorer.kinds, explorer.scale]
    assert toggles.layout.flex_flow == "row wrap"
