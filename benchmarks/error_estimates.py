"""Do the fast maps know where they are wrong? Error estimates against exact patching, and
``refine="auto"``.

On held-out prompts (``lsc.data.prompts(family).sample(n, seed=...)``, pairs the model's
tokenizer aligns) of each prompt family, at head and block level: exact activation patching,
then each estimator with ``error=True``. Per estimator and component type: the rank
(Spearman) correlation between the predicted error (the ``error`` coord) and the actual one
(|estimate - exact|) over every (prompt x component) cell, and the share of cells whose
actual error exceeds the predicted one (and exceeds twice it, the margin ``refine="auto"``
allows). Then ``activation_patching(refine="auto")``: the share of cells it measured, the
share of cells within 5% of the largest exact |effect|, how many of the exact top 10 (by
|prompt-mean|) it recovers, and its time as a share of the full exact sweep's. Writes the
``error_estimates`` section of RESULTS.md (see _report.py); ``--quick`` runs on a tiny random
Llama in seconds (its numbers mean nothing).

``--edges`` adds the same measure for edges: per family, ``lsc.edge_agreement``'s sample (the
top ``--edge-top`` edges by |prompt-mean score| and ``--edge-random`` random ones, each patched
alone, exactly) against each edge estimator run with ``lsc.edge_attribution(error=True)``, per
receiver kind.
"""

from __future__ import annotations

import argparse
import time

import _report
import numpy as np
import pandas as pd
import xarray as xr
from faithfulness import aligned_pairs

import lenscape as lsc
from lenscape.capture import patching
from lenscape.capture.edges import agreement as edges_agreement
from lenscape.schema import RECEIVER_KINDS

INTRO = """\
`python benchmarks/error_estimates.py`: {model}, {n} held-out pairs of each family
(`lsc.data.prompts(family).sample({n}, seed={seed})` of the pairs its tokenizer aligns), logit
difference, CPU float32. Exact activation patching against each estimator run with
`error=True` (`lsc.attribution_patching`): the error estimate is the trapezoid correction
|1/2 (g_clean - g_corrupt) . delta| for `atp` (one backward pass more), the gap to the
coarser rule on the even points for `ig:N` (free), the trapezoid correction under the rules
for `relp`, |secant - atp| for `relp:secant`, and for `trapezoid` (AtP plus that correction,
one backward pass more than AtP) the size of its correction (capture/patching.py,
ERROR_METHODS). r: Pearson correlation of the estimate with exact patching over cells.
Spearman: rank correlation between predicted and actual |estimate - exact| over every
(prompt x component) cell; "actual > predicted": the share of cells whose actual error
exceeds the estimate (> 2x: beyond the margin `refine="auto"` allows). refine="auto"
(`activation_patching` with the estimator named, tol 5% of the largest |estimate|, top 10,
margin 2, raised per component to the largest actual / estimated error among its cells
measured first): the share of cells it measured exactly (and of them, those measured because
their error could exceed tol, under either margin; the others for the top 10's boundary), the
share of all cells within 5% of the largest exact |effect| (goal >= 99%), the exact top 10 by
|prompt-mean| recovered, and its wall time (estimate, error estimate and both stages of
measurement) as a share of the full exact sweep's (goal <= 25%): the median of {rounds}
rounds, each timing the full sweep and then refine="auto" (the range in brackets); default
batch_size 8."""

ERROR_COLUMNS = [
    "date",
    "machine",
    "model",
    "family",
    "components",
    "estimator",
    "r (estimate vs exact)",
    "Spearman (predicted vs actual error)",
    "actual > predicted",
    "actual > 2x predicted",
    "time / exact",
]
EDGE_INTRO = """\
Edges (`--edges`): on the same pairs, `lsc.edge_agreement` samples the top {top} edges by
|prompt-mean score| and {random} random ones (seed {seed}) and patches each alone, exactly;
each edge estimator runs with `error=True` (`lsc.edge_attribution`: the trapezoid correction
|1/2 (g_r(clean) - g_r(corrupt)) . (clean_s - corrupt_s)| for `eap`, the gap to the coarser
rule for `eap-ig`, the trapezoid under the rules for `relp`, |secant - eap| for
`relp:secant`). Spearman, "actual > predicted" and "> 2x" as above, over the sampled
(prompt x edge) cells of each receiver kind."""
EDGE_COLUMNS = [
    "date",
    "machine",
    "model",
    "family",
    "receiver kind",
    "estimator",
    "sampled edges",
    "Spearman (predicted vs actual error)",
    "actual > predicted",
    "actual > 2x predicted",
]
AUTO_COLUMNS = [
    "date",
    "machine",
    "model",
    "family",
    "level",
    "estimator",
    "cells measured",
    "of them for tol",
    "cells within 5% of the largest exact effect",
    "exact top 10 recovered",
    "time / full exact (median, range)",
]


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's correlation of two 1-D arrays (average ranks for ties)."""
    ranks = [pd.Series(x).rank().to_numpy() for x in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def component_types(result) -> dict[str, object]:
    """Component type -> the part of a (prompt, layer, head | component) result."""
    if "head" in result.dims:
        return {"heads": result}
    return {name: result.sel(component=name) for name in result["component"].values}


def timed(function, *args, **kwargs):
    """(function's result, its wall seconds)."""
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - start


def estimator_options(label: str) -> dict:
    """The ``estimator``, ``steps`` and ``rules`` options a label ("atp", "ig:8",
    "relp:secant") names."""
    name, steps, rules = patching.parse_estimator(
        label,
        estimators=patching.ESTIMATORS,
        paths=patching.PATH_ESTIMATORS,
        default=patching.DEFAULT_IG_STEPS,
    )
    return {"estimator": name, "steps": steps, "rules": rules}


def error_rows(model, family, prompts, level, exact, t_exact, labels) -> list[list]:
    """Per estimator and component type: how well the error estimate predicts the error."""
    rows = []
    for label in labels:
        estimate, took = timed(
            lsc.attribution_patching,
            model,
            prompts,
            level=level,
            **estimator_options(label),
            error=True,
            progress=False,
        )
        actual = np.abs(estimate - exact)
        predicted = estimate["error"].reset_coords(drop=True)
        for ctype, part in component_types(actual).items():
            a = part.values.ravel()
            p = component_types(predicted)[ctype].values.ravel()
            r = np.corrcoef(
                component_types(estimate)[ctype].values.ravel(),
                component_types(exact)[ctype].values.ravel(),
            )[0, 1]
            row = [
                f"{r:.3f}",
                f"{rank_correlation(p, a):.3f}",
                f"{np.mean(a > p):.1%}",
                f"{np.mean(a > 2 * p):.1%}",
                f"{took / t_exact:.2f}",
            ]
            print(f"{model.name} {family} {ctype} {label}: " + " ".join(row), flush=True)
            rows.append([*_report.stamp(), model.name, family, ctype, label, *row])
    return rows


def auto_rows(model, family, prompts, level, exact, labels, rounds) -> list[list]:
    """refine="auto" with each estimator of ``labels`` against the full exact sweep
    ``exact``; each one's time as a share of the full sweep's: the median over ``rounds``
    rounds, each timing the full sweep and then refine="auto" with every estimator
    (interleaved, so a slow spell of the machine hits them alike)."""
    ratios: dict[str, list[float]] = {label: [] for label in labels}
    results = {}
    for _ in range(rounds):
        _, t_exact = timed(lsc.activation_patching, model, prompts, level=level, progress=False)
        for label in labels:
            results[label], took = timed(
                lsc.activation_patching,
                model,
                prompts,
                level=level,
                refine="auto",
                **estimator_options(label),
                progress=False,
            )
            ratios[label].append(took / t_exact)
    largest = float(np.abs(exact).max())
    k = min(10, exact[0].size)

    def top(result) -> set[int]:
        return set(np.argsort(-np.abs(result.mean("prompt").values.ravel()))[:k].tolist())

    rows = []
    for label in labels:
        auto, ratio = results[label], ratios[label]
        within = float((np.abs(auto - exact) <= 0.05 * largest).mean())
        cells = auto.attrs["refine_cells"]
        row = [
            f"{auto.attrs['refine_measured'] / cells:.1%}",
            f"{auto.attrs['refine_measured_for_tol'] / cells:.1%}",
            f"{within:.1%}",
            f"{len(top(auto) & top(exact))}/{k}",
            f"{np.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})",
        ]
        print(f"{model.name} {family} {level} refine='auto' {label}: " + " ".join(row), flush=True)
        rows.append([*_report.stamp(), model.name, family, level, label, *row])
    return rows


def edge_rows(model, family, prompts, labels, n_top, n_random, seed) -> list[list]:
    """Per edge estimator and receiver kind: how well its error estimate predicts its error
    against exact single-edge patching on ``lsc.edge_agreement``'s sample of edges."""
    report = lsc.edge_agreement(
        model,
        prompts,
        estimators=labels,
        n_top=n_top,
        n_random=n_random,
        seed=seed,
        progress=False,
    )
    exact = report["exact"]
    at = {name: xr.DataArray(exact[name].values, dims="edge") for name in ("sender", "receiver")}
    parts = edges_agreement._parts(labels, edges_agreement.DEFAULT_IG_STEPS)
    rows = []
    for label, (name, steps, rules) in parts.items():
        scores = lsc.edge_attribution(
            model,
            prompts,
            estimator=name,
            steps=steps,
            rules=rules,
            error=True,
            per_prompt=True,
            progress=False,
        )
        picked = scores.sel(prompt=exact["prompt"], **at)
        actual = np.abs(picked.values - exact.values)
        predicted = picked["error"].values
        kinds = picked["receiver_kind"].values  # (edge,): the report's is its own dim
        for kind in [kind for kind in RECEIVER_KINDS if (kinds == kind).any()]:
            cells = np.broadcast_to(kinds == kind, actual.shape)
            a, p = actual[cells], predicted[cells]
            row = [
                str(int(cells[0].sum())),
                f"{rank_correlation(p, a):.3f}",
                f"{np.mean(a > p):.1%}",
                f"{np.mean(a > 2 * p):.1%}",
            ]
            print(f"{model.name} {family} edges {kind} {label}: " + " ".join(row), flush=True)
            rows.append([*_report.stamp(), model.name, family, kind, label, *row])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models",
        default="smollm2-135m,gemma3-270m",
        help='comma-separated bundled models, or "tiny"',
    )
    parser.add_argument("--families", default="factual,ioi")
    parser.add_argument("--prompts", type=int, default=24, help="held-out pairs per family")
    parser.add_argument("--seed", type=int, default=44, help="seeds the held-out draw")
    parser.add_argument("--levels", default="head,block")
    parser.add_argument("--estimators", default="atp,trapezoid,ig:2,ig:8,relp,relp:secant")
    parser.add_argument(
        "--auto-estimators", default="atp,relp:secant", help="estimators refine='auto' runs with"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved timings of refine='auto' (median)"
    )
    parser.add_argument("--edges", action="store_true", help="also measure edge estimators")
    parser.add_argument("--edge-estimators", default="eap", help='e.g. "eap,eap-ig,relp:secant"')
    parser.add_argument("--edge-top", type=int, default=50, help="top edges sampled")
    parser.add_argument("--edge-random", type=int, default=200, help="random edges sampled")
    args = _report.parse_args(
        parser,
        models="tiny",
        families="factual",
        prompts=4,
        estimators="atp,trapezoid,ig:2,relp:secant",
        edge_top=10,
        edge_random=30,
        rounds=1,
    )
    labels = args.estimators.split(",")
    error_table, auto_table, edge_table = [], [], []
    for name in args.models.split(","):
        model = (
            lsc.models.tiny("llama", n_layers=3) if name == "tiny" else lsc.load(name, device="cpu")
        )
        for family in args.families.split(","):
            pairs = aligned_pairs(model, lsc.data.prompts(family))
            prompts = pairs.sample(min(args.prompts, len(pairs)), seed=args.seed)
            for level in args.levels.split(","):
                exact, t_exact = timed(
                    lsc.activation_patching, model, prompts, level=level, progress=False
                )
                print(f"\n{model.name} {family} {level}: exact sweep {t_exact:.1f} s", flush=True)
                error_table += error_rows(model, family, prompts, level, exact, t_exact, labels)
                auto_table += auto_rows(
                    model,
                    family,
                    prompts,
                    level,
                    exact,
                    args.auto_estimators.split(","),
                    args.rounds,
                )
            if args.edges:
                edge_labels = args.edge_estimators.split(",")
                edge_table += edge_rows(
                    model, family, prompts, edge_labels, args.edge_top, args.edge_random, args.seed
                )
    parts = [
        _report.table(ERROR_COLUMNS, error_table),
        '### refine="auto" (activation patching)',
        _report.table(AUTO_COLUMNS, auto_table),
    ]
    if args.edges:
        parts += ["### Edges", _report.table(EDGE_COLUMNS, edge_table)]
    body = "\n\n".join(parts)
    intro = INTRO.format(
        model=", ".join(args.models.split(",")), n=args.prompts, seed=args.seed, rounds=args.rounds
    )
    if args.edges:
        intro += "\n\n" + EDGE_INTRO.format(
            top=args.edge_top, random=args.edge_random, seed=args.seed
        )
    title = "Error estimates of the fast maps, and refine='auto' (issue 44)"
    _report.emit(args, _report.section("error_estimates", title, intro, body))


if __name__ == "__main__":
    main()
