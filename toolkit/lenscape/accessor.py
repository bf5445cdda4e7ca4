"""``da.lsc``: the plotting functions as DataArray methods, forwarding only.

``scores.mean("prompt").lsc.heatmap(x="head", y="layer")`` is ``lenscape.heatmap(...)`` on the
same array; nothing here has logic of its own. Importing this module registers the accessor.
"""

from __future__ import annotations

from typing import Any

import altair as alt
import xarray as xr

from lenscape.aggregate import correct_only
from lenscape.plot import Summary, heatmap, logit_lens_chart, summary
from lenscape.widgets import Explorer


@xr.register_dataarray_accessor("lsc")
class LenscapeAccessor:
    """lenscape methods on any DataArray, e.g. ``da.lsc.explore(x="head", y="layer")``."""

    def __init__(self, da: xr.DataArray):
        self._da = da

    def heatmap(self, **kwargs: Any) -> alt.TopLevelMixin:
        """``lenscape.plot.heatmap`` of this array; see there for the options."""
        return heatmap(self._da, **kwargs)

    def explore(self, **kwargs: Any) -> Explorer:
        """``lenscape.widgets.Explorer`` on this array; see there for the options."""
        return Explorer(self._da, **kwargs)

    def summary(self, **kwargs: Any) -> Summary:
        """``lenscape.plot.summary`` of this array: a few lines instead of all the numbers."""
        return summary(self._da, **kwargs)

    def logit_lens_chart(self, **kwargs: Any) -> alt.TopLevelMixin:
        """``lenscape.plot.logit_lens_chart`` of this (layer, pos) array."""
        return logit_lens_chart(self._da, **kwargs)

    def correct_only(self) -> xr.DataArray:
        """``lenscape.aggregate.correct_only``: the prompts the model answers right."""
        return correct_only(self._da)
