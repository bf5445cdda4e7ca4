"""Causal head gating on the bundled model at the reference protocol: cost, convergence,
sparsity of Always vs Any, the causal check, and agreement across thread counts.

For each task (math, syntax): fit ``--seeds`` seeds with ``lsc.head_gating`` at its defaults
(the reference implementation's protocol: uniform start, Adam lr 1.0, batch 32, clipping 1.0,
lambda 0.1, each stage until the gates stop moving, at most ``--max-steps`` updates), report
the wall time, the updates per stage, the share of heads that are Always / Any facilitating
and interfering (threshold 0.5), and ``lsc.gating_check`` on the held-out split (top-k
facilitating off, top-k interfering off, 20 random k-head sets). With ``--threads``, the
first task is fitted again with 1 torch thread and the share of heads whose role (threshold
0.5, per seed) is the same is reported. The cost of the full setting (10 seeds x 2 tasks) on
this machine is projected from the measured time per update and the updates a seed took to
converge. ``--save DIR`` keeps every fit as netCDF. Writes the ``head_gating`` section of
RESULTS.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _report
import numpy as np
import torch

import lenscape as lsc
from lenscape import aggregate


def role_codes(ds) -> np.ndarray:
    """Per seed and head: 0 neither, 1 facilitating, 2 interfering, 3 both (threshold 0.5)."""
    return ((ds["facilitation"] >= 0.5).astype(int) + 2 * (ds["interference"] >= 0.5)).values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--val", type=int, default=None, help="first N held-out items")
    parser.add_argument("--train", type=int, default=None, help="first N training items")
    parser.add_argument("--tasks", default="math,syntax")
    parser.add_argument(
        "--note",
        default="",
        help="a sentence about this run (e.g. machine shared, settings reduced)",
    )
    parser.add_argument(
        "--threads",
        action="store_true",
        help="also refit the first task with 1 thread and compare roles",
    )
    parser.add_argument("--save", type=Path, default=None, help="write each fit to DIR as netCDF")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads for the fits")
    args = _report.parse_args(parser, seeds=2, max_steps=2, batch_size=2, val=4, train=8)
    torch.set_num_threads(args.num_threads)
    model = lsc.load("smollm2-135m", device="cpu")
    total, rows, checks, notes, per_update, per_seed = 0.0, [], [], [], [], []
    settings = dict(
        seeds=args.seeds, max_steps=args.max_steps, batch_size=args.batch_size, progress=False
    )
    for name in args.tasks.split(","):
        train = lsc.data.task(name)[: args.train]
        val = lsc.data.task(name, split="validation")[: args.val]
        start = time.perf_counter()
        ds = lsc.head_gating(model, train, validation=val, **settings)
        took = time.perf_counter() - start
        total += took
        updates = sum(int(ds[f"steps_{s}"].sum()) for s in ("stage0", "plus", "minus"))
        per_update.append(took / updates)
        per_seed.append(updates / args.seeds)
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            ds.to_netcdf(args.save / f"{name}_threads{args.num_threads}.nc")
        steps = " / ".join(
            f"{int(ds[f'steps_{s}'].median())} ({int(ds[f'steps_{s}'].max())})"
            for s in ("stage0", "plus", "minus")
        )
        shares = [
            f"{float(aggregate.always(ds[role]).mean()) * 100:.1f}% / "
            f"{float(aggregate.any_(ds[role]).mean()) * 100:.1f}%"
            for role in ("facilitation", "interference")
        ]
        print(
            f"\n{name}: {args.seeds} seeds, {took:.0f} s, {took / updates:.1f} s per update "
            f"per gate set; updates median (max) stage 0 / + / -: {steps}; converged "
            f"{ds.attrs['converged']}; facilitating Always/Any {shares[0]}, interfering "
            f"{shares[1]}"
        )
        rows.append(
            [
                *_report.stamp(),
                name,
                f"{took:.0f} s",
                f"{took / updates:.1f} s",
                steps,
                "yes" if ds.attrs["converged"] else "no",
                *shares,
            ]
        )
        check = lsc.gating_check(model, ds, val, k=args.k, n_random=20)
        verdict = lambda ok: "pass" if bool(ok) else "FAIL"  # noqa: E731
        checks.append(
            [
                *_report.stamp(),
                name,
                f"{float(check['loss_intact']):.3f}",
                f"{float(check['loss_facilitating_off']):.3f}",
                f"{float(check['loss_interfering_off']):.3f}",
                f"{float(check['random_p5']):.3f}",
                f"{float(check['random_p95']):.3f}",
                verdict(check["facilitating_passes"]),
                verdict(check["interfering_passes"]),
            ]
        )
        print("  check:", " | ".join(checks[-1][2:]))
        if args.threads and not notes:
            torch.set_num_threads(1)
            single = lsc.head_gating(model, train, validation=val, **settings)
            torch.set_num_threads(args.num_threads)
            if args.save:
                single.to_netcdf(args.save / f"{name}_threads1.nc")
            same = float((role_codes(single) == role_codes(ds)).mean())
            notes.append(
                f"Roles (threshold 0.5, every seed and head) that agree between 1 and "
                f"{args.num_threads} torch threads on {name}: {same:.1%} (target >= 95%)."
            )
            print(notes[-1])
    seconds = float(np.mean(per_update))
    projected = 10 * 2 * float(np.mean(per_seed)) * seconds / 3600
    capped = 10 * 2 * 3 * args.max_steps * seconds / 3600
    notes.append(
        f"Cost of the full setting on this machine: at {seconds:.1f} s per update per gate "
        f"set (fit time over all updates of all gate sets, validation included) and "
        f"{np.mean(per_seed):.0f} updates per seed over the three stages (as measured here), "
        f"10 seeds x 2 tasks take about {projected:.1f} h; if every stage ran to the "
        f"{args.max_steps}-update cap, {capped:.1f} h."
    )
    a = ds.attrs
    intro = f"""\
`python benchmarks/head_gating.py`: {model.name}, {args.seeds} seeds at the reference protocol
(gates uniform in (0, 1), Adam lr {a["lr"]}, batch {a["batch_size"]}, gradient clipping
{a["grad_clip"]}, lambda {a["lambda_"]} on logits clamped to +-{a["clip"]:.0f}); a stage ends for a
seed when its gates move less than {a["tol"]} (mean absolute change) over {a["window"]} updates,
at most {a["max_steps"]} updates. Held-out items: the validation split
({"all" if args.val is None else args.val}). Threshold 0.5. Causal check: gate 0 for {args.k} heads;
random = 20 random {args.k}-head sets; it passes when facilitating-off > random p95 and
interfering-off < random p5 and <= intact."""
    body = "\n\n".join(
        [
            _report.table(
                [
                    "date",
                    "machine",
                    "task",
                    "time",
                    "per update per gate set",
                    "updates median (max): stage 0 / G+ / G-",
                    "converged",
                    "facilitating Always / Any",
                    "interfering Always / Any",
                ],
                rows,
            ),
            _report.table(
                [
                    "date",
                    "machine",
                    "task",
                    "intact",
                    f"top-{args.k} facilitating off",
                    f"top-{args.k} interfering off",
                    "random p5",
                    "random p95",
                    "facilitating check",
                    "interfering check",
                ],
                checks,
            ),
            f"Total for {args.seeds} seeds x {len(rows)} tasks: {total:.0f} s "
            f"({total / 60:.1f} min; budget 20 min).",
            *notes,
            *([args.note] if args.note else []),
        ]
    )
    _report.emit(args, _report.section("head_gating", "Head gating (issues 5, 11)", intro, body))


if __name__ == "__main__":
    main()
