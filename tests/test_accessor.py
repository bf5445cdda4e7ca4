"""``da.lsc``: every method gives what the plain function gives on the same array, with the
same options (the accessor forwards only); it is there from ``import lenscape`` on, whichever
of lenscape and xarray is imported first (``lenscape._accessor``)."""

from __future__ import annotations

import inspect
import json
import textwrap

import numpy as np
import pytest
from _helpers import ATTRS, fresh_python

import lenscape as lsc
from lenscape import aggregate, schema
from lenscape.views import accessor, charts


def scores():
    values = np.random.default_rng(0).normal(size=(2, 4, 3))  # (seed, layer, head)
    values[0, 2, 1] = 9.0  # one cell stands out
    return schema.make(values, dims=("seed", "layer", "head"), attrs=ATTRS, n_layers=4)


PLAIN_IMPORT = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("error")  # xarray warns when an accessor is registered twice
    {imports}
    before = sorted(name for name in ("altair", "lenscape.views") if name in sys.modules)
    da = xr.DataArray(np.arange(6.0).reshape(2, 3), dims=("layer", "head"),
                      coords={{"layer": [0, 1], "head": [0, 1, 2]}})
    chart = da.lsc.heatmap(x="head", y="layer").to_dict()
    print(json.dumps({{"views_before_use": before, "accessor": type(da.lsc).__name__,
                      "mark": chart["mark"]["type"], "registered": xr.DataArray.lsc.__name__}}))
""")


@pytest.mark.parametrize(
    "imports",
    [
        "import lenscape; assert 'xarray' not in sys.modules; import numpy as np, xarray as xr",
        "import numpy as np, xarray as xr; import lenscape",
    ],
    ids=["lenscape-first", "xarray-first"],
)
def test_da_lsc_works_after_a_plain_import_lenscape(imports):
    """``import lenscape`` registers ``da.lsc`` (once, at once or when xarray is imported)
    without importing the views; the first ``da.lsc`` imports them."""
    found = json.loads(fresh_python(PLAIN_IMPORT.format(imports=imports)))
    assert found == {
        "views_before_use": [],
        "accessor": "LenscapeAccessor",
        "mark": "rect",
        "registered": "lazy_accessor",
    }


def test_the_accessor_offers_only_forwarding_methods():
    methods = {name for name in vars(accessor.LenscapeAccessor) if not name.startswith("_")}
    assert methods == {
        "heatmap",
        "explore",
        "summary",
        "logit_lens_chart",
        "correct_only",
        "mean",
        "reliability",
    }


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("heatmap", lsc.heatmap),
        ("explore", lsc.Explorer),
        ("summary", charts.summary),
        ("logit_lens_chart", charts.logit_lens_chart),
        ("correct_only", aggregate.correct_only),
        ("mean", aggregate.mean),
        ("reliability", aggregate.reliability),
    ],
)
def test_each_method_shows_the_signature_and_docstring_it_forwards_to(method, target):
    """``da.lsc.heatmap?`` shows heatmap's options (without the array) and its docstring."""
    bound = getattr(scores().lsc, method)
    params = list(inspect.signature(target).parameters.values())[1:]  # all but the array
    assert list(inspect.signature(bound).parameters.values()) == params
    assert bound.__doc__ == target.__doc__ and bound.__doc__


def test_heatmap_forwards_with_its_options():
    da = scores().mean("seed")
    options = dict(x="head", y="layer", title="Mine")
    assert da.lsc.heatmap(**options).to_dict() == lsc.heatmap(da, **options).to_dict()
    assert da.lsc.heatmap(**options).to_dict()["title"]["text"] == "Mine"


def test_summary_forwards_with_its_options():
    da = scores()
    assert repr(da.lsc.summary(top=1)) == repr(charts.summary(da, top=1))
    assert repr(da.lsc.summary(top=1)) != repr(charts.summary(da, top=3))


def test_explore_forwards_with_its_options():
    da = scores()
    mine = da.lsc.explore(x="head", y="layer")
    plain = lsc.Explorer(da, x="head", y="layer")
    assert type(mine) is lsc.Explorer
    assert mine.chart.to_dict() == plain.chart.to_dict()
    swapped = da.lsc.explore(x="layer", y="head").chart.to_dict()
    assert swapped["encoding"]["x"]["field"] == "layer"


def test_logit_lens_chart_and_correct_only_forward():
    da = schema.make(
        np.linspace(0, 1, 6).reshape(2, 3),
        dims=("layer", "pos"),
        coords={"token": ("pos", ["a", " b", " c"])},
        attrs=ATTRS,
        n_layers=2,
    )
    options = dict(title="Lens")
    assert da.lsc.logit_lens_chart(**options).to_dict() == (
        charts.logit_lens_chart(da, **options).to_dict()
    )
    flagged = scores().rename(seed="prompt").assign_coords(correct=("prompt", [False, True]))
    assert flagged.lsc.correct_only().identical(lsc.aggregate.correct_only(flagged))
    assert flagged.lsc.correct_only()["prompt"].values.tolist() == [1]


def test_mean_and_reliability_forward_with_their_options():
    da = scores().rename(seed="prompt")
    mine = da.lsc.mean("prompt", ci=0.9, n_resamples=200)
    assert mine.identical(aggregate.mean(da, "prompt", ci=0.9, n_resamples=200))
    assert mine.attrs["ci"] == 0.9
    assert da.lsc.reliability(n_splits=5, top_k=2).identical(
        aggregate.reliability(da, n_splits=5, top_k=2)
    )
