"""Edges by span on the bundled model: agreement, sums, cost and cancellation.

``lsc.edge_attribution(..., positions="spans")`` on SmolLM2-135M (30 layers, 9 query heads
on 3 key/value heads) with IOI pairs, whose spans are IO, S1, S2, END and "other":

- **Agreement**: EAP and EAP-IG by span against ``tests/_helpers.reference_edge_scores_by_span``
  (per receiver: the gradient at a zero leaf on its own copy of the residual stream, plain
  hooks; a k or v receiver once per query span, its attention output kept off the gradient
  outside that span), on the receivers of a few layers and the logits, one prompt: the
  largest difference relative to the largest score, and the edges compared.
- **Sums**: by-span scores summed over spans and query spans against position-agnostic EAP
  on the same prompts, on both bundled models.
- **Cost, alone**: time and peak resident memory above the loaded model of position-agnostic
  EAP and of EAP by span, each in a fresh process (the first call's peak, then a second call
  timed), beside the memory plan's estimate of what the call needs.
- **Cancellation** (PEAP, Haklay et al. 2025, arXiv 2502.04577): with each position-agnostic
  edge's prompt-mean score A = |sum over cells of its by-span terms| and B = the sum of the
  terms' magnitudes (cells: spans, and query spans for k and v), the share of the top k% of
  edges by A that are not in the top k% by B (the two sets are as large, so it is also the
  share of B's top edges A misses), at k = 1, 5, 10. PEAP's GPT-2 small IOI figures are
  17.1%, 13.4% and 12.1%, against 3.9% in their control. Our control is a split half: the
  same share between the top k% by A on two disjoint halves of the prompts (how much the
  ranking moves with the prompts alone). On SmolLM2 and on Gemma-3-270M (18 layers, 4
  query heads on 1 key/value head).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import _report
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _helpers import position_agnostic, reference_edge_scores_by_span

import lenscape as lsc
from lenscape.capture import edges

SHARES = (1, 5, 10)
PEAP = {1: "17.1%", 5: "13.4%", 10: "12.1%"}


def top(values: np.ndarray, share: float, among: np.ndarray) -> set[int]:
    """Indices of the top ``share`` of ``values`` by size among the flat indices
    ``among`` (the edges that exist)."""
    flat = np.abs(values.ravel())[among]
    k = max(1, round(share * len(among)))
    return set(among[np.argsort(-flat, kind="stable")[:k]].tolist())


def moved(a: np.ndarray, b: np.ndarray, share: float) -> float:
    """The share of the top ``share`` of the edges by |a| (those where ``a`` is finite:
    the edges that exist) not in the top ``share`` of the same edges by |b|."""
    among = np.flatnonzero(np.isfinite(a.ravel()))
    first, second = top(a, share, among), top(b, share, among)
    return len(first - second) / len(first)


def agreement(model, prompt, layers: list[int]) -> list[list[str]]:
    spec = model.spec
    receivers = {"logits"}
    for layer in layers:
        receivers |= {f"L{layer}.H{h}.q" for h in range(spec.n_heads)}
        receivers |= {f"L{layer}.KV{h}.{k}" for h in range(spec.n_kv_heads) for k in "kv"}
        receivers.add(f"L{layer}.MLP")
    rows = []
    for estimator, steps in (("eap", 1), ("eap-ig", 2)):
        t0 = time.perf_counter()
        ours = edges.edge_attribution(
            model,
            [prompt],
            estimator=estimator,
            steps=None if steps == 1 else steps,
            positions="spans",
            per_prompt=True,
            progress=False,
        ).isel(prompt=0)
        reference = reference_edge_scores_by_span(model, prompt, steps=steps, receivers=receivers)
        took = time.perf_counter() - t0
        got = np.array([float(ours.sel(span=c, sender=s, receiver=r)) for c, s, r in reference])
        expected = np.array(list(reference.values()))
        defined = np.isfinite(got)
        scale = float(np.abs(expected).max())
        error = float(np.abs(got[defined] - expected[defined]).max()) / scale
        outside = float(np.abs(expected[~defined]).max(initial=0)) / scale
        print(
            f"{estimator}: {int(defined.sum())} edges, largest difference {error:.1e} of "
            f"{scale:.3g}; edges the graph has not: at most {outside:.1e} ({took:.0f} s)"
        )
        rows.append(
            [
                *_report.stamp(),
                estimator if steps == 1 else f"{estimator} ({steps} steps)",
                f"layers {', '.join(map(str, layers))} + logits",
                f"{int(defined.sum()):,}",
                f"{error:.1e}",
                f"{scale:.3g}",
                f"{outside:.1e}",
            ]
        )
    return rows


def child(positions: str, n_prompts: int, batch_size: int) -> None:
    """Measure one call in this fresh process; print JSON."""
    model = lsc.load()
    prompts = lsc.data.prompts("ioi")[:n_prompts]
    options = dict(positions=positions, batch_size=batch_size, progress=False)
    estimate = lsc.estimate(model, "edge_attribution", prompts, **options)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    start = _status("VmRSS")
    edges.edge_attribution(model, prompts, **options)  # the first call holds the peak
    peak = _status("VmHWM") - start
    t0 = time.perf_counter()
    edges.edge_attribution(model, prompts, **options)
    took = time.perf_counter() - t0
    planned = estimate.needed / 2**20
    print(json.dumps({"seconds": took, "peak_mib": peak / 2**20, "planned_mib": planned}))


def _status(field_name: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: resident now; VmHWM: its peak)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field_name}:\s+(\d+)", text)[1]) * 1024


def cost(n_prompts: int, batch_size: int) -> tuple[list[list[str]], dict]:
    found = {}
    for positions in ("all", "spans"):
        done = subprocess.run(
            [
                sys.executable,
                *(__file__, "--child", positions),
                *("--prompts", str(n_prompts), "--batch-size", str(batch_size)),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        found[positions] = json.loads(done.stdout.strip().splitlines()[-1])
        print(positions, found[positions])
    rows = []
    for positions, label in (("all", "EAP"), ("spans", "EAP by span")):
        f = found[positions]
        rows.append(
            [
                *_report.stamp(),
                label,
                f"{n_prompts} x batch {batch_size}",
                f"{f['seconds']:.1f} s",
                f"{f['seconds'] / found['all']['seconds']:.2f}x",
                f"{f['peak_mib']:.0f} MiB",
                f"{f['planned_mib']:.0f} MiB",
            ]
        )
    return rows, found


def cancellation(model, n_prompts: int) -> tuple[dict[int, tuple[int, float, float]], float]:
    """On one model's IOI prompts: per top share k, (edges in the top k%, the share of them
    that moves, the split-half control); and the by-span sums' largest difference from EAP,
    relative to its largest score."""
    prompts = lsc.data.prompts("ioi")[:n_prompts]
    options = dict(per_prompt=True, batch_size=8, progress=True)
    agnostic = edges.edge_attribution(model, prompts, **options)
    by_span = edges.edge_attribution(model, prompts, positions="spans", **options)
    summed = position_agnostic(by_span, agnostic).mean("prompt")
    scale = float(np.nanmax(np.abs(agnostic.values)))
    sums = float(np.nanmax(np.abs(summed.values - np.nan_to_num(agnostic.mean("prompt").values))))
    print(f"by span summed against EAP: {sums:.1e} of {scale:.3g}")
    mean = by_span.mean("prompt")
    magnitude = position_agnostic(abs(mean), agnostic.mean("prompt")).values
    a = agnostic.mean("prompt").values
    half = n_prompts // 2
    first, second = agnostic.isel(prompt=slice(0, half)), agnostic.isel(prompt=slice(half, None))
    shares = {
        k: (
            round(k / 100 * np.isfinite(a).sum()),
            moved(a, magnitude, k / 100),
            moved(first.mean("prompt").values, second.mean("prompt").values, k / 100),
        )
        for k in SHARES
    }
    print(shares)
    return shares, sums / scale


def cancellation_rows(by_model: dict[str, dict[int, tuple[int, float, float]]]) -> list[list]:
    """One row per top share: each model's edges, share moved and control, then PEAP's."""
    return [
        [
            *_report.stamp(),
            f"top {k}%",
            *[
                f"{shares[k][1]:.1%} of {shares[k][0]:,} (control {shares[k][2]:.1%})"
                for shares in by_model.values()
            ],
            PEAP[k],
        ]
        for k in SHARES
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--cancel-prompts", type=int, default=60)
    parser.add_argument("--child", choices=("all", "spans"))
    parser.add_argument("--layers", default="0,15,29")
    parser.add_argument("--cancel-models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    args = _report.parse_args(parser, prompts=4, cancel_prompts=8)
    if args.child:
        child(args.child, args.prompts, args.batch_size)
        return
    model = lsc.load()
    layers = [int(x) for x in args.layers.split(",")]
    agree_rows = agreement(model, lsc.data.prompts("ioi")[0], layers)
    by_model, sums = {}, {}
    for name in args.cancel_models:
        by_model[name], sums[name] = cancellation(lsc.load(name), args.cancel_prompts)
    cancel_rows = cancellation_rows(by_model)
    cost_rows, _ = cost(args.prompts, args.batch_size)
    intro = (__doc__ or "").split("\n\n", 1)[1].strip()
    body = "\n\n".join(
        [
            "Agreement with the per-receiver reference (SmolLM2, IOI prompt 0; float32):",
            _report.table(
                [
                    "date",
                    "machine",
                    "estimator",
                    "receivers",
                    "edges",
                    "largest difference / largest score",
                    "largest score",
                    "reference where no edge (relative)",
                ],
                agree_rows,
            ),
            f"Sums: over {args.cancel_prompts} IOI prompts, the by-span prompt means summed "
            "over spans and query spans differ from EAP's by at most "
            + ", ".join(f"{error:.1e} ({name})" for name, error in sums.items())
            + " of its largest score.",
            f"Cancellation ({args.cancel_prompts} IOI prompts; the share of the top edges by "
            "position-agnostic |score| not among the top by the sum of the by-span terms' "
            "magnitudes, of how many edges, beside the split-half control; PEAP's GPT-2 "
            "small figure last):",
            _report.table(
                ["date", "machine", "top", *args.cancel_models, "PEAP (GPT-2 small)"],
                cancel_rows,
            ),
            "Cost, alone (fresh process each; peak resident memory of the first call above the "
            "loaded model, VmHWM after a reset; the memory plan's ``needed`` beside it):",
            _report.table(
                [
                    "date",
                    "machine",
                    "method",
                    "prompts",
                    "time",
                    "vs EAP",
                    "peak memory",
                    "memory plan",
                ],
                cost_rows,
            ),
        ]
    )
    _report.emit(
        args, _report.section("edges_by_span", "Edges by span (SmolLM2, Gemma-3-270M)", intro, body)
    )


if __name__ == "__main__":
    main()
