"""refine="auto"'s choice of cells, replayed offline against variants of its rule.

For held-out draws the error_estimates benchmark never uses (24 aligned pairs of each family,
seeds 7 and 8), exact activation patching of every head and AtP with its error estimate
(``lsc.attribution_patching(error=True)``) are computed once and cached as .npy. Then the
rule of ``activation_patching(refine="auto")`` is replayed in NumPy with the same functions
(``auto_cells``, ``calibrated_margins``, ``ranking_cells`` of capture/patching.py), as
shipped and with variants: a smaller margin; a two-part first stage (first the cells that
could be off by twice tol, then tol raised to 5% of the largest exact value they show); one
round of the ranking stage that measures, per component in doubt, only the cells holding
half its uncertainty before the rest. Per variant: the share of cells measured, the share of
block-rows measured (a head of block l runs blocks l..L-1: what its exact pass costs), the
share of cells within 5% of the largest exact |effect| (goal >= 99%) and the exact top 10
recovered. Every extra stage is one more sweep over the batches, whose fixed cost the
replay does not count. The replay as shipped picks the very cells of
``activation_patching(refine="auto")`` (its ``measured`` coord; checked on gemma3-270m IOI,
seed 7: the same 310 of 1728 cells).

``python benchmarks/refine_rules.py`` (the exact sweeps take minutes; the cache in
``out/refine_rules`` makes a rerun instant; it is keyed by model, family, seed and size only, so
delete it after changing an estimator); ``--quick``: a tiny random Llama. Writes the
``refine_rules`` section of RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import _report
import numpy as np
from faithfulness import aligned_pairs

import lenscape as lsc
from lenscape.capture import patching

COLUMNS = [
    "date",
    "machine",
    "model",
    "family",
    "seed",
    "rule",
    "cells measured",
    "block-rows measured",
    "cells within 5%",
    "exact top 10",
]
#: name -> replay options.
RULES: dict[str, dict[str, Any]] = {
    "as shipped (margin 2)": {},
    "margin 1.5": {"margin": 1.5},
    "two-part first stage": {"two_part": True},
    "halving ranking round": {"halving": True},
    "two-part + halving": {"two_part": True, "halving": True},
}


def draw(model, family: str, seed: int, n: int, cache: Path) -> tuple[np.ndarray, ...]:
    """(exact, AtP estimate, AtP error estimate), each (prompt, layer * head), of ``n``
    aligned pairs of ``family`` drawn with ``seed``; from ``cache`` when there."""
    path = cache / f"{model.name}_{family}_{seed}_{n}.npy"
    if path.exists():
        return tuple(np.load(path))
    prompts = aligned_pairs(model, lsc.data.prompts(family)).sample(n, seed=seed)
    exact = lsc.activation_patching(model, prompts, level="head", progress=False)
    estimate = lsc.attribution_patching(model, prompts, level="head", error=True, progress=False)
    arrays = np.stack(
        [a.reshape(n, -1) for a in (exact.values, estimate.values, estimate["error"].values)]
    )
    cache.mkdir(parents=True, exist_ok=True)
    np.save(path, arrays)
    return tuple(arrays)


def _halves(doubt: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Per component in doubt, its cells in ``doubt`` with the largest bounds that hold half
    the sum of its bounds there."""
    picked = np.zeros_like(doubt)
    weights = np.where(doubt, bounds, 0.0)
    for component in np.flatnonzero(doubt.any(0)):
        order = np.argsort(-weights[:, component])
        cumulative = np.cumsum(weights[order, component])
        picked[order[: np.searchsorted(cumulative, cumulative[-1] / 2) + 1], component] = True
    return picked


def replay(exact, estimates, errors, *, margin=patching.AUTO_MARGIN, two_part=False, halving=False):
    """The (prompt, component) bool cells refine="auto" measures under the variant given (as
    shipped: ``patching.refine._auto_refinement``, its ranking stage decided before the cells
    beyond tol under the calibrated margins are measured, as there)."""
    first, tol = patching.auto_cells(estimates, errors, margin=margin)
    if two_part:
        bounds = patching.error_bounds(errors, margin)
        early = bounds > 2 * tol
        if early.any():
            tol = max(tol, patching.AUTO_TOL * float(np.abs(exact[early]).max()))
        first = early | (bounds > tol)
    margins = patching.calibrated_margins(
        estimates, errors, np.where(first, exact, np.nan), first, margin
    )
    bounds = patching.error_bounds(errors, margins)
    measured = first | (bounds > tol)
    doubt = patching.ranking_cells(np.where(first, exact, estimates), bounds, first)
    if not halving:
        return measured | doubt
    measured |= _halves(doubt, bounds)
    return measured | patching.ranking_cells(np.where(measured, exact, estimates), bounds, measured)


def scores(exact, estimates, measured, n_layers: int) -> list[str]:
    """The row's cells: shares of cells and of block-rows measured, cells within 5% of the
    largest exact |effect|, exact top 10 by |prompt-mean| recovered."""
    blocks = np.repeat(n_layers - np.arange(n_layers), exact.shape[1] // n_layers)
    values = np.where(measured, exact, estimates)
    within = np.abs(values - exact) <= 0.05 * np.abs(exact).max()
    k = min(10, exact.shape[1])
    top = np.argsort(-np.abs(exact.mean(0)))[:k]
    found = np.argsort(-np.abs(values.mean(0)))[:k]
    return [
        f"{measured.mean():.1%}",
        f"{(measured * blocks).sum() / (blocks.sum() * len(exact)):.1%}",
        f"{within.mean():.2%}",
        f"{len(set(top) & set(found))}/{k}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--families", default="factual,ioi")
    parser.add_argument("--seeds", default="7,8", help="held-out draws (error_estimates: 44)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--cache", type=Path, default=Path("out/refine_rules"))
    args = _report.parse_args(parser, models="tiny", families="factual", seeds="7", prompts=4)
    rows = []
    for name in args.models.split(","):
        if name == "tiny":
            model = lsc.models.tiny("llama", n_layers=3)
        else:
            model = lsc.load(name, device="cpu")
        for family in args.families.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                exact, estimates, errors = draw(model, family, seed, args.prompts, args.cache)
                for rule, options in RULES.items():
                    measured = replay(exact, estimates, errors, **options)
                    row = scores(exact, estimates, measured, model.spec.n_layers)
                    print(f"{model.name} {family} {seed} {rule}: " + " ".join(row), flush=True)
                    rows.append([*_report.stamp(), model.name, family, seed, rule, *row])
    intro = __doc__.split("\n\n")[1].replace("\n", " ")
    intro += f" Models {args.models}; {args.prompts} pairs a draw; no timing."
    title = 'refine="auto"\'s rule and its variants, replayed offline (issue 44)'
    _report.emit(args, _report.section("refine_rules", title, intro, _report.table(COLUMNS, rows)))


if __name__ == "__main__":
    main()
