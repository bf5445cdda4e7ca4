"""Every picture and widget of a result, built from DataArrays alone (never torch).

``heatmaps`` draws a result as a grid of cells, ``charts`` the other pictures (bars,
summary, logit lens, agreement, reliability), ``circuit`` the edge graph and faithfulness
curve (``circuit_layout`` places the graph's nodes, by span in span columns), ``offline``
renders them with no internet; ``explorer``, ``circuit_explorer`` and ``prompt_form`` are
the widgets, and ``accessor`` puts the views on ``da.lsc``. Imports flow one way: accessor,
prompt form -> explorers -> circuit, charts -> circuit_layout -> heatmaps -> encoding,
offline (``[tool.importlinter]`` in pyproject.toml).
"""

from .charts import Summary, agreement_chart, bars, logit_lens_chart, reliability_chart, summary
from .circuit import circuit_graph, edge_heatmap, faithfulness_curve
from .circuit_explorer import CircuitExplorer
from .explorer import Explorer
from .heatmaps import ROLE_COLORS, heatmap
from .offline import enable_offline, export
from .prompt_form import PromptForm

__all__ = [
    "ROLE_COLORS",
    "CircuitExplorer",
    "Explorer",
    "PromptForm",
    "Summary",
    "agreement_chart",
    "bars",
    "circuit_graph",
    "edge_heatmap",
    "enable_offline",
    "export",
    "faithfulness_curve",
    "heatmap",
    "logit_lens_chart",
    "reliability_chart",
    "summary",
]
