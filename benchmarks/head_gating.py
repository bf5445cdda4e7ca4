"""Causal head gating on the bundled model: time, sparsity of Always vs Any, causal check.

For each task (math, syntax): fit 5 seeds, report the wall time, the share of heads that
are Always / Any facilitating and interfering (threshold 0.5), and the validation loss when
ablating (gate 0) the top-k facilitating heads, the top-k interfering heads, or k random
heads (mean of 5 draws). Target: 5 seeds x 2 tasks <= 15 minutes on 2 CPU cores. Writes the
``head_gating`` section of RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import _report
import lenscape as lsc
from lenscape import aggregate


def top_k(scores, k: int) -> list[tuple[int, int]]:
    """(layer, head) of the k highest cells of a (layer, head) DataArray."""
    flat = np.argsort(-scores.values, axis=None)[:k]
    return [tuple(int(i) for i in np.unravel_index(j, scores.shape)) for j in flat]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--val", type=int, default=48)
    parser.add_argument("--train", type=int, default=None, help="first N training items")
    args = _report.parse_args(parser, seeds=1, steps=1, val=4, train=8)
    model = lsc.load("smollm2-135m", device="cpu")
    spec = model.spec
    total, rows, sizes = 0.0, [], []
    for name in ("math", "syntax"):
        train = lsc.data.task(name)[:args.train]
        val = lsc.data.task(name, split="validation")[:args.val]
        start = time.perf_counter()
        ds = lsc.head_gating(model, train, seeds=args.seeds, steps=args.steps,
                             validation=val, progress=False)
        took = time.perf_counter() - start
        total += took
        sizes.append(f"{len(train)} {name}")
        print(f"\n{name}: {args.seeds} seeds x {args.steps} steps/stage: {took:.0f} s; val loss "
              f"ungated {ds.attrs['val_loss_ungated']:.3f}, stage-0 gates "
              f"{float(ds['val_loss'].mean()):.3f}")
        shares = []
        for role in ("facilitation", "interference"):
            always = float(aggregate.always(ds[role]).mean()) * 100
            any_ = float(aggregate.any_(ds[role]).mean()) * 100
            print(f"  {role}: Always {always:.1f}% of heads, Any {any_:.1f}%")
            shares.append(f"{always:.1f}% / {any_:.1f}%")
        rng = np.random.default_rng(0)
        sets = {"none ablated": []}
        sets[f"top-{args.k} facilitating"] = top_k(ds["facilitation"].mean("seed"), args.k)
        sets[f"top-{args.k} interfering"] = top_k(ds["interference"].mean("seed"), args.k)
        for draw in range(5):
            cells = rng.choice(spec.n_layers * spec.n_heads, args.k, replace=False)
            sets[f"random {draw}"] = [divmod(int(c), spec.n_heads) for c in cells]
        gates = torch.ones(len(sets), spec.n_layers, spec.n_heads)
        for i, cells in enumerate(sets.values()):
            for layer, head in cells:
                gates[i, layer, head] = 0
        losses = dict(zip(sets, lsc.task_loss(model, val, gates).tolist()))
        base = losses["none ablated"]
        facilitating = losses[f"top-{args.k} facilitating"]
        interfering = losses[f"top-{args.k} interfering"]
        random_mean = np.mean([v for k, v in losses.items() if k.startswith("random")])
        print(f"  validation loss: none ablated {base:.3f}; "
              f"top-{args.k} facilitating ablated {facilitating:.3f}; "
              f"top-{args.k} interfering ablated {interfering:.3f}; "
              f"{args.k} random ablated (mean of 5) {random_mean:.3f}")
        rows.append([*_report.stamp(), name, f"{took:.0f} s", *shares, f"{base:.3f}",
                     f"{facilitating:.3f}", f"{interfering:.3f}", f"{random_mean:.3f}"])
    print(f"\ntotal gating time, 2 tasks: {total:.0f} s ({total / 60:.1f} min)")
    a = ds.attrs
    intro = f"""\
`python benchmarks/head_gating.py`: {model.name}, {args.seeds} seeds x {args.steps} Adam steps
per stage (lambda {a['lambda_']}, lr {a['lr']}, {a['batch_size']} prompts per seed per step),
training split of each task ({' / '.join(sizes)} items), {len(val)} validation items.
Threshold 0.5. Ablation = gate 0 for {args.k} heads.

The causal check passes when removing the top facilitating heads raises the validation loss
far more than removing random heads, and removing the top interfering heads lowers it below
the intact model's (both held on 2026-11-22)."""
    columns = ["date", "machine", "task", "time", "facilitating Always / Any",
               "interfering Always / Any", "val loss: intact", f"top-{args.k} facilitating off",
               f"top-{args.k} interfering off", f"{args.k} random off (mean of 5)"]
    body = (_report.table(columns, rows) + f"\n\nTotal for {args.seeds} seeds x 2 tasks: "
            f"{total:.0f} s ({total / 60:.1f} min; target <= 15 min).")
    _report.emit(args, _report.section("head_gating", "Head gating (issue 5)", intro, body))


if __name__ == "__main__":
    main()
