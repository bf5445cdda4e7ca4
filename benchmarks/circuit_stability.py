"""How stable is a circuit? Edge inclusion over bootstrap resamples, and the consensus circuit.

On SmolLM2-135M with indirect-object prompts (``lsc.data.prompts("ioi").sample(n, seed=0)``)
and EAP-IG per-prompt edge scores: ``lsc.circuit_stability`` redraws the prompts with
replacement (200 resamples, seed 0) and counts how often each edge enters the circuit
``lsc.circuit`` picks from a resample's mean scores. For each budget, how many edges of the
single-draw circuit (``lsc.circuit`` of the mean over all the prompts) are in at least 90%
and at least 50% of the resamples' circuits, and the size of the consensus circuit (edges in
>= 50% of them, pruned to paths). Then both kinds of circuit judged by exact edge patching
over the same edge budgets: ``lsc.circuit_faithfulness`` (single draw) beside
``lsc.consensus_faithfulness`` (consensus at share 0.5), CPR (higher is better) and CMD
(lower is better), each with random circuits of its own sizes. Writes the
``circuit_stability`` section of RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import time

import _report
import numpy as np

import lenscape as lsc

INTRO = """\
`python benchmarks/circuit_stability.py`: SmolLM2-135M, {n} indirect-object prompts
(`lsc.data.prompts("ioi").sample({n}, seed=0)`), logit difference, EAP-IG ({steps} steps) edge
scores per prompt, CPU float32. `lsc.circuit_stability` draws the prompts with replacement
{resamples} times (seed 0) and picks each resample's circuit as `lsc.circuit` does (top edges
by |mean score|, pruned to paths embeddings -> logits); an edge's inclusion frequency is the
share of those circuits that keep it. The single-draw circuit is `lsc.circuit` of the mean
over all {n} prompts; the consensus circuit keeps the edges in at least half of the
resamples' circuits (`lsc.consensus_circuit`, share 0.5), pruned to paths again. Faithfulness
is exact edge patching (the clean run with every edge outside the circuit reading the corrupt
run) over the budgets below, as a share of the clean - corrupt logit difference; CPR is the
area under that curve over the budget span (higher is better), CMD the area of its distance
from 1 (lower is better); random: the mean of {n_random} random circuit(s) of each circuit's
own sizes ("-": none drawn; `benchmarks/edges.py` shows random circuits near 0 on these
prompts). Times are wall time, with the CPU time of the process beside it (on a shared
machine the wall time includes time the process was paused)."""


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds now: on a shared machine whose scheduler pauses processes, the
    CPU time (this process, every thread) says what the work cost, the wall time what it
    took here."""
    return time.perf_counter(), time.process_time()


def took(start: tuple[float, float]) -> str:
    """Wall and CPU seconds since ``start``, e.g. "12.0 s (CPU 20.1 s)"."""
    wall, cpu = (now - then for now, then in zip(clock(), start, strict=True))
    return f"{wall:.1f} s (CPU {cpu:.1f} s)"


COLUMNS = [
    "date",
    "machine",
    "budget (edges per resample)",
    "single-draw circuit (edges)",
    "in >= 90% of resamples",
    "in >= 50%",
    "resample circuit (mean edges)",
    "consensus circuit (>= 50%)",
    "time",
]
CURVE_COLUMNS = ["date", "machine", "circuit", "CPR", "CMD", "random CPR", "random CMD", "time"]


def stability_rows(per_prompt, scores, budgets, resamples: int) -> list[list[str]]:
    """Per budget: the single-draw circuit's edges and how many are in >= 90% / >= 50% of
    the resamples' circuits, the resamples' mean circuit size, the consensus circuit's."""
    rows = []
    for edges in budgets:
        start = clock()
        stable = lsc.circuit_stability(per_prompt, edges=edges, n_resamples=resamples, seed=0)
        spent = took(start)
        single = lsc.circuit(scores, edges=edges)
        shares = stable.where(single).values
        consensus = lsc.consensus_circuit(stable, share=0.5)
        n_single = int(single.sum())
        counts = [int((shares >= share).sum()) for share in (0.9, 0.5)]
        print(
            f"budget {edges}: single draw {n_single} edges, {counts[0]} in >= 90%, "
            f"{counts[1]} in >= 50%; consensus {consensus.attrs['n_edges']} ({spent})"
        )
        rows.append(
            [
                *_report.stamp(),
                f"{edges:,}",
                n_single,
                f"{counts[0]} ({counts[0] / n_single:.0%})",
                f"{counts[1]} ({counts[1] / n_single:.0%})",
                f"{stable.attrs['mean_edges']:.1f}",
                consensus.attrs["n_edges"],
                spent,
            ]
        )
    return rows


def curve_rows(model, prompts, per_prompt, scores, args) -> tuple[list[list[str]], list[str]]:
    """CPR and CMD of the single-draw and consensus circuits (exact edge patching), and a
    table of each one's faithfulness and size per budget."""
    fractions = tuple(args.fractions)
    runs = {}
    start = clock()
    runs["single draw"] = lsc.circuit_faithfulness(
        model, prompts, scores, fractions=fractions, n_random=args.n_random, progress=False
    )
    times = {"single draw": took(start)}
    start = clock()
    runs["consensus (>= 50% of resamples)"] = lsc.consensus_faithfulness(
        model,
        prompts,
        per_prompt,
        fractions=fractions,
        share=0.5,
        n_resamples=args.resamples,
        n_random=args.n_random,
        progress=False,
    )
    times["consensus (>= 50% of resamples)"] = took(start)
    rows: list[list[str]] = []
    detail = [
        "| circuit | " + " | ".join(f"{f:g}" for f in fractions) + " |",
        "| --- |" + " --- |" * len(fractions),
    ]
    for name, result in runs.items():
        numbers = [float(result[key]) for key in ("cpr", "cmd", "random_cpr", "random_cmd")]
        print(f"{name}: CPR {numbers[0]:.3f} CMD {numbers[1]:.3f} ({times[name]})", flush=True)
        shown = [f"{x:.3f}" if np.isfinite(x) else "-" for x in numbers]
        rows.append([*_report.stamp(), name, *shown, times[name]])
        cells = [
            f"{f:.2f} ({n:,})"
            for f, n in zip(result["faithfulness"].values, result["n_edges"].values, strict=True)
        ]
        detail.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows, detail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--steps", type=int, default=5, help="EAP-IG integration points")
    parser.add_argument("--resamples", type=int, default=200)
    parser.add_argument("--budgets", type=int, nargs="+", default=[60, 707])
    parser.add_argument(
        "--fractions", type=float, nargs="+", default=[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1]
    )
    parser.add_argument(
        "--n-random", type=int, default=0, help="random circuits per budget (0: none)"
    )
    args = _report.parse_args(
        parser, prompts=4, steps=1, resamples=10, budgets=[20], fractions=[0.01, 0.1]
    )
    model = lsc.load("smollm2-135m")
    prompts = lsc.data.prompts("ioi").sample(args.prompts, seed=0)
    start = clock()
    per_prompt = lsc.edge_attribution(
        model, prompts, estimator="eap-ig", steps=args.steps, per_prompt=True, progress=False
    ).load()
    print(f"EAP-IG scores of {args.prompts} prompts: {took(start)}", flush=True)
    scores = per_prompt.astype(np.float64).mean("prompt", skipna=False, keep_attrs=True)
    rows = stability_rows(per_prompt, scores, args.budgets, args.resamples)
    curves, detail = curve_rows(model, prompts, per_prompt, scores, args)
    body = "\n\n".join(
        [
            _report.table(COLUMNS, rows),
            "Faithfulness over edge budgets (exact edge patching), single draw beside consensus:",
            _report.table(CURVE_COLUMNS, curves),
            "Faithfulness at each budget (share of all 70,651 edges), with the circuit's edges:",
            "\n".join(detail),
        ]
    )
    intro = INTRO.format(
        n=args.prompts, steps=args.steps, resamples=args.resamples, n_random=args.n_random
    )
    title = "Circuit stability: bootstrap inclusion and consensus circuits (issue 44)"
    _report.emit(args, _report.section("circuit_stability", title, intro, body))


if __name__ == "__main__":
    main()
