"""``da.lsc``: every method gives what the plain function gives on the same array, with the
same options (the accessor forwards only)."""

from __future__ import annotations

import numpy as np
from _helpers import ATTRS

import lenscape as lsc
import lenscape.accessor  # registers da.lsc
from lenscape import plot, schema


def scores():
    values = np.random.default_rng(0).normal(size=(2, 4, 3))  # (seed, layer, head)
    values[0, 2, 1] = 9.0  # one cell stands out
    return schema.make(values, dims=("seed", "layer", "head"), attrs=ATTRS, n_layers=4)


def test_the_accessor_offers_only_forwarding_methods():
    methods = {
        name for name in vars(lenscape.accessor.LenscapeAccessor) if not name.startswith("_")
    }
    assert methods == {"heatmap", "explore", "summary", "logit_lens_chart", "correct_only"}


def test_heatmap_forwards_with_its_options():
    da = scores().mean("seed")
    options = dict(x="head", y="layer", title="Mine")
    assert da.lsc.heatmap(**options).to_dict() == lsc.heatmap(da, **options).to_dict()
    assert da.lsc.heatmap(**options).to_dict()["title"]["text"] == "Mine"


def test_summary_forwards_with_its_options():
    da = scores()
    assert repr(da.lsc.summary(top=1)) == repr(plot.summary(da, top=1))
    assert repr(da.lsc.summary(top=1)) != repr(plot.summary(da, top=3))


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
        plot.logit_lens_chart(da, **options).to_dict()
    )
    flagged = scores().rename(seed="prompt").assign_coords(correct=("prompt", [False, True]))
    assert flagged.lsc.correct_only().identical(lsc.aggregate.correct_only(flagged))
    assert flagged.lsc.correct_only()["prompt"].values.tolist() == [1]
