"""Which estimator to use for MLP blocks, and what it costs next to AtP, timed fairly.

On SmolLM2-135M's factual pairs (the pairs its tokenizer aligns, all of them by default):
exact activation patching at block level once, then ``lsc.attribution_patching(level="block")``
with AtP and with each other estimator, in interleaved rounds (AtP, the others, AtP, ...: a
slow spell of the machine hits every estimator alike), without error estimates. Per
estimator: Pearson r over (prompt x layer) cells against exact patching for MLP and for
attention blocks, the median wall time over the rounds and its ratio to AtP's median.

Run alone (nothing else on the CPU): ``python benchmarks/mlp_estimator.py``; ``--quick``
runs a tiny random Llama in seconds (numbers mean nothing). Writes the ``mlp_estimator``
section of RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _report
import numpy as np
import torch
from faithfulness import aligned_pairs

import lenscape as lsc
from lenscape.capture import patching


def _run(model, prompts, label: str):
    """(block map, wall seconds) of ``attribution_patching`` with the estimator ``label``."""
    name, steps, rules = patching.parse_estimator(
        label,
        estimators=patching.ESTIMATORS,
        paths=patching.PATH_ESTIMATORS,
        default=patching.DEFAULT_IG_STEPS,
    )
    start = time.perf_counter()
    result = lsc.attribution_patching(
        model, prompts, level="block", estimator=name, steps=steps, rules=rules, progress=False
    )
    return result, time.perf_counter() - start


def _pearson(exact, estimate, component: str) -> float:
    a = exact.sel(component=component).values.ravel()
    b = estimate.sel(component=component).values.ravel()
    return float(np.corrcoef(a, b)[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m", help='a bundled model, or "tiny"')
    parser.add_argument("--family", default="factual")
    parser.add_argument("--prompts", type=int, default=0, help="pairs used (0: all aligned)")
    parser.add_argument("--estimators", default="relp:secant,relp:secant-0.9,ig:2")
    parser.add_argument("--rounds", type=int, default=5)
    args = _report.parse_args(parser, model="tiny", prompts=4, rounds=2)
    model = (
        lsc.models.tiny("llama", n_layers=3)
        if args.model == "tiny"
        else lsc.load(args.model, device="cpu")
    )
    pairs = aligned_pairs(model, lsc.data.prompts(args.family))
    prompts = pairs[: args.prompts] if args.prompts else pairs
    exact = lsc.activation_patching(model, prompts, level="block", progress=False)
    labels = ["atp", *args.estimators.split(",")]
    _run(model, prompts[:2], "relp:secant")  # warm: first-call imports and hook set-up
    seconds: dict[str, list[float]] = {label: [] for label in labels}
    maps = {}
    for round_ in range(args.rounds):
        for label in labels:
            maps[label], took = _run(model, prompts, label)
            seconds[label].append(took)
            print(f"round {round_}: {label} {took:.2f} s", flush=True)
    atp = statistics.median(seconds["atp"])
    rows = []
    for label in labels:
        median = statistics.median(seconds[label])
        row = [
            *_report.stamp(),
            model.name,
            f"{args.family} ({len(prompts)} pairs)",
            label,
            f"{_pearson(exact, maps[label], 'mlp'):.3f}",
            f"{_pearson(exact, maps[label], 'attn'):.3f}",
            f"{median:.2f} s",
            f"{min(seconds[label]):.2f}-{max(seconds[label]):.2f} s",
            f"{median / atp:.2f}",
        ]
        print(" | ".join(str(cell) for cell in row), flush=True)
        rows.append(row)
    columns = ["date", "machine", "model", "prompts", "estimator", "r MLP blocks"]
    columns += ["r attention blocks", "median time", "range", "time / AtP"]
    intro = (
        "`python benchmarks/mlp_estimator.py`, alone on the machine: block-level "
        "`lsc.attribution_patching` with each estimator against exact activation patching "
        "(Pearson r over prompt x layer cells), no error estimates, logit difference, batch 8, "
        f"CPU float32, {torch.get_num_threads()} threads. Times: median of {args.rounds} "
        "interleaved rounds (AtP, then each estimator, repeated), so a slow spell of the "
        "machine hits every estimator alike; goal for the recommended MLP estimator: r >= "
        "0.95 at <= 1.3x AtP (issue 44)."
    )
    body = _report.table(columns, rows)
    _report.emit(
        args,
        _report.section("mlp_estimator", "MLP-block estimator: agreement and cost", intro, body),
    )


if __name__ == "__main__":
    main()
