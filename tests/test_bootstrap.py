"""The percentile bootstrap (``lenscape/bootstrap.py``): one seeded draw, resample counts
for matrix-product means, NaN-aware percentiles, checked options."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lenscape import bootstrap


def test_the_draw_is_seeded_and_counts_sum_every_resample_by_one_product():
    drawn = bootstrap.draw(7, n_resamples=200, seed=3)
    assert drawn.shape == (200, 7) and drawn.min() >= 0 and drawn.max() <= 6
    np.testing.assert_array_equal(drawn, bootstrap.draw(7, n_resamples=200, seed=3))
    assert not np.array_equal(drawn, bootstrap.draw(7, n_resamples=200, seed=4))
    counts = bootstrap.counts(drawn, 7)
    assert counts.shape == (200, 7) and (counts.sum(1) == 7).all()
    values = np.random.default_rng(0).normal(size=(7, 3))
    np.testing.assert_allclose(counts @ values / 7, values[drawn].mean(1))


def test_percentiles_match_numpy_and_skip_nan():
    samples = np.random.default_rng(1).normal(size=(500, 6))
    samples[np.random.default_rng(2).random(samples.shape) < 0.2] = np.nan
    samples[:, 5] = np.nan  # a statistic undefined in every resample
    low, high = bootstrap.percentiles(samples, 0.9)
    np.testing.assert_allclose(low[:5], np.nanquantile(samples[:, :5], 0.05, axis=0))
    np.testing.assert_allclose(high[:5], np.nanquantile(samples[:, :5], 0.95, axis=0))
    assert np.isnan(low[5]) and np.isnan(high[5])


def test_options_are_checked_by_name():
    assert bootstrap.check(0.95, 1000, 0) == (0.95, 1000, 0)
    with pytest.raises(ValueError, match=r"ci must lie in \(0, 1\).*ci=1"):
        bootstrap.check(1, 1000, 0)
    with pytest.raises(ValueError, match=r"ci must be a finite number"):
        bootstrap.check(0, 1000, 0)
    with pytest.raises(
        ValueError,
        match=rf"n_resamples must be an integer from 100 to "
        rf"{bootstrap.MAX_RESAMPLES}",
    ):
        bootstrap.check(0.95, bootstrap.MAX_RESAMPLES + 1, 0)
    with pytest.raises(TypeError, match="n_resamples must be an integer"):
        bootstrap.check(0.95, 1000.0, 0)
    with pytest.raises(ValueError, match="seed must be a whole number from 0"):
        bootstrap.check(0.95, 1000, -1)
    attrs = bootstrap.attrs("prompt", 0.95, 1000, 0)
    assert attrs["interval"].startswith("percentile bootstrap over prompts: 1000 resamples")
    assert bootstrap.percent(0.975) == "97.5%"


def test_row_statistics_match_numpy_and_pandas_over_the_cells_both_computed():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(4, 30)), rng.normal(size=(4, 30))
    b[1] = a[1] * 2 + 0.1 * b[1]
    a[2, :5] = np.nan  # not computed: left out
    for row in range(4):
        keep = np.isfinite(a[row])
        x, y = a[row, keep], b[row, keep]
        assert bootstrap.pearson(a, b)[row] == pytest.approx(np.corrcoef(x, y)[0, 1])
        rho = pd.Series(x).corr(pd.Series(y), method="spearman")
        assert bootstrap.spearman(a, b)[row] == pytest.approx(rho)
        top = lambda v: set(np.argsort(-np.abs(v), kind="stable")[:5])  # noqa: E731
        assert bootstrap.top_overlap(a, b, 5)[row] == len(top(x) & top(y)) / 5
    constant = np.ones((1, 6))
    assert np.isnan(bootstrap.pearson(constant, a[:1, :6]))[0]  # undefined, not 1 or 0
    assert np.isnan(bootstrap.top_overlap(a[:1, :6], b[:1, :6], 6))[0]  # every cell in both
