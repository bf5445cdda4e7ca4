"""``da.lsc``: the plotting functions as DataArray methods, forwarding only.

``scores.mean("prompt").lsc.heatmap(x="head", y="layer")`` is ``lenscape.heatmap(...)`` on the
same array, and ``scores.lsc.mean("prompt", ci=0.95)`` is ``lenscape.aggregate.mean(...)`` (the
mean with a bootstrap interval); nothing here has logic of its own. Each method is wrapped
(``functools.wraps``, as xarray's ``da.plot`` accessor is) with the function it forwards to,
so ``da.lsc.heatmap?`` shows that function's signature (without the array) and docstring.
``import lenscape`` registers the accessor (``lenscape._accessor``: a stand-in that imports
this module, with Altair, on the first ``da.lsc``).
"""

from __future__ import annotations

import functools
from typing import Any

import xarray as xr
from altair.typing import ChartType

from lenscape.aggregate import correct_only, mean, reliability

from .charts import Summary, logit_lens_chart, summary
from .explorer import Explorer
from .heatmaps import heatmap


class LenscapeAccessor:
    """lenscape methods on any DataArray, e.g. ``da.lsc.explore(x="head", y="layer")``."""

    def __init__(self, da: xr.DataArray):
        self._da = da

    @functools.wraps(heatmap)
    def heatmap(self, **kwargs: Any) -> ChartType:
        return heatmap(self._da, **kwargs)

    @functools.wraps(Explorer, assigned=("__doc__",))
    def explore(self, **kwargs: Any) -> Explorer:
        return Explorer(self._da, **kwargs)

    @functools.wraps(summary)
    def summary(self, **kwargs: Any) -> Summary:
        return summary(self._da, **kwargs)

    @functools.wraps(logit_lens_chart)
    def logit_lens_chart(self, **kwargs: Any) -> ChartType:
        return logit_lens_chart(self._da, **kwargs)

    @functools.wraps(correct_only)
    def correct_only(self) -> xr.DataArray:
        return correct_only(self._da)

    @functools.wraps(mean)
    def mean(self, dim: str = "prompt", **kwargs: Any) -> xr.DataArray:
        return mean(self._da, dim, **kwargs)

    @functools.wraps(reliability)
    def reliability(self, dim: str = "prompt", **kwargs: Any) -> xr.Dataset:
        return reliability(self._da, dim, **kwargs)
