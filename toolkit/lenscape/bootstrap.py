"""The percentile bootstrap over prompts: one seeded draw, intervals from its percentiles,
and the statistics two maps are compared by, on every resample at once.

Every interval lenscape reports (``aggregate.mean``, the faithfulness report, edge
agreement) comes from here, so they all mean the same thing: draw ``n_resamples`` samples
of the ``n`` prompts with replacement (one ``(n_resamples, n)`` index draw from ``seed``),
compute the statistic on each resample, and take the ``(1 - ci) / 2`` and
``(1 + ci) / 2`` percentiles of those values (the percentile bootstrap, Efron & Tibshirani
1993, ch. 13). The draw depends only on ``n``, ``n_resamples`` and ``seed``, so callers put
the prompts in label order first and the same prompts always give the same interval.

Nothing here loops over resamples: callers gather the drawn rows (``draw``) or weight the
prompts by how often each was drawn (``counts``, a matrix product gives every resample's
mean at once), and ``percentiles`` reads the bounds of every column at once. ``pearson``,
``spearman`` and ``top_overlap`` compare two maps row by row (one row per resample, or per
random split of ``aggregate.reliability``), over the cells both have computed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from . import _validate

#: Resamples when none is given (enough for stable 95% percentile bounds).
DEFAULT_RESAMPLES = 1000
#: Fewest resamples: below this the tails of a 95% interval hold a handful of values.
MIN_RESAMPLES = 100
#: Most resamples one call may ask for (each is a pass over every cell).
MAX_RESAMPLES = 100_000
#: How the intervals are made, for the attrs of every result that carries one.
METHOD = "percentile bootstrap"
#: Most numbers one block of resampled values holds: resamples (or cells) are taken in
#: blocks this size, so memory stays bounded whatever the map's size.
BLOCK_VALUES = 4_000_000


def check(ci: Any, n_resamples: Any, seed: Any) -> tuple[float, int, int]:
    """Check a bootstrap's options.

    Args:
        ci: the share of resamples between the bounds, in (0, 1), e.g. 0.95.
        n_resamples: resamples drawn, ``MIN_RESAMPLES`` to ``MAX_RESAMPLES``.
        seed: seeds the draw, >= 0.

    Returns:
        ``(ci, n_resamples, seed)`` as float, int, int.

    Raises:
        TypeError: a value of the wrong type (a string, a float count ...).
        ValueError: a value out of range (the message names it and the range).
    """
    n_resamples = _validate.integer(
        "n_resamples", n_resamples, low=MIN_RESAMPLES, high=MAX_RESAMPLES
    )
    return check_ci(ci), n_resamples, _validate.seed("seed", seed)


def check_ci(ci: Any) -> float:
    """Check a share of values between two bounds: a number in (0, 1), e.g. 0.95.

    Raises:
        TypeError: not a number.
        ValueError: outside (0, 1).
    """
    ci = _validate.number("ci", ci, above=0, high=1)
    if ci == 1:
        raise ValueError(
            "ci must lie in (0, 1): ci=1 would span every value (min to max); pass e.g. ci=0.95."
        )
    return ci


def draw(n: int, *, n_resamples: int, seed: int) -> np.ndarray:
    """The resamples: row r lists the ``n`` items (prompts) drawn with replacement.

    Args:
        n: how many items there are (prompts, in label order).
        n_resamples: how many resamples.
        seed: seeds the draw.

    Returns:
        int64 (n_resamples, n): indices in ``0 .. n - 1``.
    """
    return np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))


def counts(drawn: np.ndarray, n: int) -> np.ndarray:
    """How often each item was drawn in each resample, so ``counts(drawn, n) @ values``
    sums every resample at once (values: (n, cells)).

    Args:
        drawn: int (n_resamples, k) indices from ``draw``.
        n: how many items there are.

    Returns:
        float64 (n_resamples, n).
    """
    rows = np.arange(drawn.shape[0])[:, None] * n
    flat = np.bincount((rows + drawn).ravel(), minlength=drawn.shape[0] * n)
    return flat.reshape(drawn.shape[0], n).astype(np.float64)


def percentiles(samples: np.ndarray, ci: float) -> tuple[np.ndarray, np.ndarray]:
    """The bounds of the middle ``ci`` of each column, skipping NaN (a resample where the
    statistic is undefined); NaN where a column holds no number.

    Args:
        samples: (n_resamples, ...) the statistic on each resample.
        ci: the share between the bounds, in (0, 1).

    Returns:
        ``(low, high)``, each shaped ``samples.shape[1:]``: the ``(1 - ci) / 2`` and
        ``(1 + ci) / 2`` quantiles of the numbers in each column, linearly interpolated
        (numpy's default method).
    """
    ordered = np.sort(np.moveaxis(samples, 0, -1), axis=-1)  # contiguous rows; NaN last
    valid = (~np.isnan(ordered)).sum(axis=-1)
    bounds = []
    for q in ((1 - ci) / 2, (1 + ci) / 2):
        position = q * np.maximum(valid - 1, 0)
        below = np.floor(position).astype(int)
        above = np.minimum(below + 1, np.maximum(valid - 1, 0))
        low = np.take_along_axis(ordered, below[..., None], axis=-1)[..., 0]
        high = np.take_along_axis(ordered, above[..., None], axis=-1)[..., 0]
        bounds.append(np.where(valid > 0, low + (position - below) * (high - low), np.nan))
    return bounds[0], bounds[1]


def attrs(dim: str, ci: float, n_resamples: int, seed: int) -> dict[str, Any]:
    """The attrs that say how an interval was made (scalars, so they survive a save).

    Returns:
        ``interval`` (a sentence: method, what was resampled, how often, the seed), ``ci``,
        ``n_resamples`` and ``interval_seed``.
    """
    return {
        "interval": f"{METHOD} over {dim}s: {n_resamples} resamples of the {dim}s with "
        f"replacement (seed {seed}); bounds are the {percent(ci)} middle of the resampled "
        "statistic",
        "ci": ci,
        "n_resamples": n_resamples,
        "interval_seed": seed,
    }


def percent(ci: float) -> str:
    """``0.95`` -> ``"95%"``, ``0.975`` -> ``"97.5%"``."""
    return f"{ci * 100:g}%"


def _both(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``a`` and ``b`` with NaN where either is not finite, and where both are."""
    both = np.isfinite(a) & np.isfinite(b)
    return np.where(both, a, np.nan), np.where(both, b, np.nan), both


def pearson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson r of ``a`` and ``b`` along the last axis, over the cells where both are
    finite (NaN: not computed).

    Args:
        a, b: (..., cells), the same shape.

    Returns:
        (...): r per row; NaN where fewer than 2 cells are compared or either is constant
        there (r is undefined, never a perfect score).
    """
    a, b, both = _both(a, b)
    k = both.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        da = np.where(both, a - np.nansum(a, -1, keepdims=True) / k, 0.0)
        db = np.where(both, b - np.nansum(b, -1, keepdims=True) / k, 0.0)
        r = (da * db).sum(-1) / np.sqrt((da**2).sum(-1) * (db**2).sum(-1))
    return np.where((k[..., 0] >= 2) & np.isfinite(r), r, np.nan)


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rank correlation along the last axis: ``pearson`` of the average ranks
    (ties share their mean rank) of the cells where both are finite."""
    a, b, _ = _both(a, b)
    shape = a.shape

    def ranks(x: np.ndarray) -> np.ndarray:
        flat = pd.DataFrame(x.reshape(-1, shape[-1])).rank(axis=1)  # NaN stays NaN
        return flat.to_numpy().reshape(shape)

    return pearson(ranks(a), ranks(b))


def top_overlap(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """The share of ``a``'s top ``k`` cells by magnitude that are also in ``b``'s, along
    the last axis, over the cells where both are finite (ties: the earlier cell first).

    Returns:
        (...): the overlap per row, in [0, 1]; NaN where at most ``k`` cells are compared
        (both top sets would hold every cell, so the overlap would be 1 whatever the maps).
    """
    a, b, both = _both(a, b)
    sets = []
    for x in (a, b):
        order = np.argsort(np.where(both, -np.abs(x), np.inf), axis=-1, kind="stable")
        chosen = np.zeros(x.shape, dtype=bool)
        np.put_along_axis(chosen, order[..., :k], True, axis=-1)
        sets.append(chosen)
    overlap = (sets[0] & sets[1]).sum(-1) / k
    return np.where(both.sum(-1) > k, overlap, np.nan)
