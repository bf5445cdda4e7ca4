"""Record the reference-protocol results that ship with lenscape (``lsc.recorded``).

    python benchmarks/record.py head_roles                     # F4: 10 seeds x math, syntax
    python benchmarks/record.py head_roles_check               # F4's check of the seeds so far
    python benchmarks/record.py --markdown FILE                # the `record` section of RESULTS.md
    python benchmarks/record.py block_masks --model gemma3-270m  # F1: K=8 masks of one model

Without a name (as ``make bench`` runs it) it fits nothing: it summarises what is recorded.
Each finished unit (one seed of one task; one model's masks) is written at once into
``toolkit/lenscape/fits/recorded_data``; a restarted run skips what exists, so an interrupted
recording resumes from the last finished unit. Run it alone on the machine (one torch
thread by default, so a second core stays free), then commit the new files. Every file
carries the command, commit, date, machine, torch threads and wall time of its run.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

import _report
import torch

import lenscape as lsc
from lenscape import aggregate
from lenscape.fits import recordings


def commit() -> str:
    """The checked-out commit, marked ``+dirty`` when the library has uncommitted changes."""
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "toolkit/lenscape/capture", "toolkit/lenscape"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    changed = [line for line in dirty.splitlines() if "recorded_data/" not in line]
    return head + ("+dirty" if changed else "")


def _loaded(name: str, **where) -> object | None:
    try:
        return lsc.recorded(name, **where)
    except ValueError:
        return None


def summary(args: argparse.Namespace) -> None:
    """The ``record`` section of RESULTS.md, read from the recorded files."""
    rows, checks, masks, per_cluster = [], [], [], []
    for task in recordings.HEAD_ROLES_TASKS:
        ds = _loaded("head_roles", model=args.model, task=task)
        if ds is None:
            continue
        steps = " / ".join(
            f"{int(ds[f'steps_{s}'].median())} ({int(ds[f'steps_{s}'].max())})"
            for s in ("stage0", "plus", "minus")
        )
        shares = [
            f"{float(aggregate.always(ds[role]).mean()):.1%} / "
            f"{float(aggregate.any_(ds[role]).mean()):.1%}"
            for role in ("facilitation", "interference")
        ]
        whole = ds["wall_time"].where(ds["resumed"] == 0)  # a resumed seed's time is partial
        rows.append(
            [
                task,
                f"{ds.sizes['seed']} of {recordings.HEAD_ROLES_SEEDS}",
                steps,
                "yes" if ds.attrs["converged"] else "no",
                *shares,
                f"{float(whole.median()) / 60:.0f} min (median of {int(whole.count())} "
                f"uninterrupted runs, {int(ds['torch_threads'][0])} thread)",
                ds.attrs["precision"],
                ", ".join(sorted({str(c)[:10] for c in ds["commit"].values})),
            ]
        )
        check = _loaded("head_roles_check", model=args.model, task=task)
        for role in check["role"].values if check is not None else []:
            row = check.sel(role=role)
            checks.append(
                [
                    task,
                    role,
                    int(check.attrs["n_seeds"]),
                    int(row["set_size"]),
                    f"{float(check['loss_intact']):.3f}",
                    f"{float(row['loss_off']):.3f}",
                    f"{float(row['random_p5']):.3f} / {float(row['random_p50']):.3f} / "
                    f"{float(row['random_p95']):.3f}",
                    f"{float(row['percentile']):.0f}",
                    "pass" if bool(row["passes"]) else f"FAIL {row['reason'].values}".strip(),
                ]
            )
    for model in ("smollm2-135m", "gemma3-270m"):
        ds = _loaded("block_masks", model=model)
        if ds is None:
            continue
        ratio = ds["ppl_ratio"].isel(target_sparsity=0)
        wins = aggregate.routing_wins(ds).isel(target_sparsity=0)
        masks.append(
            [
                model,
                ds.attrs["k"],
                ds.attrs["steps"],
                "yes" if ds.attrs["converged"] else "no",
                *[f"{float(ratio.sel(strategy=s)):.2f}" for s in ("routed", "global", "random")],
                f"{int(wins.sum())} of {wins.sizes['cluster']}",
                f"{ds.attrs['wall_time'] / 60:.0f} min ({ds.attrs['torch_threads']} threads"
                + (", resumed)" if ds.attrs.get("resumed") else ")"),
                str(ds.attrs["commit"])[:10],
            ]
        )
        losses = ds[["loss_routed", "loss_global", "n_held_out"]].isel(target_sparsity=0)
        for c in wins["cluster"].values:
            one = losses.sel(cluster=c)
            per_cluster.append(
                [
                    model,
                    int(c),
                    int(one["n_held_out"]),
                    f"{float(one['loss_routed']):.3f}",
                    f"{float(one['loss_global']):.3f}",
                    "yes" if bool(wins.sel(cluster=c)) else "no",
                ]
            )
    parts = [
        _report.table(
            [
                "task",
                "seeds",
                "updates median (max): stage 0 / G+ / G-",
                "every stage converged",
                "facilitating Always / Any",
                "interfering Always / Any",
                "fit time per seed",
                "precision",
                "commit",
            ],
            rows,
        )
        if rows
        else f"No head roles recorded for {args.model} yet.",
        _report.table(
            [
                "task",
                "role",
                "seeds judged",
                "heads in set",
                "intact",
                "set off",
                "random p5 / p50 / p95",
                "percentile",
                "check",
            ],
            checks,
        )
        if checks
        else "No recorded causal check yet (`python benchmarks/record.py head_roles_check`).",
        _report.table(
            [
                "model",
                "K",
                "updates",
                "converged",
                "routed",
                "global",
                "random",
                "clusters where routed beats global",
                "fit time",
                "commit",
            ],
            masks,
        )
        if masks
        else "No block masks recorded yet (`python benchmarks/record.py block_masks`).",
    ]
    if per_cluster:
        parts.append(
            _report.table(
                [
                    "model",
                    "cluster",
                    "held-out texts",
                    "loss routed (nats)",
                    "loss global (nats)",
                    "routed beats global",
                ],
                per_cluster,
            )
        )
    intro = """\
The reference-protocol results shipped in `toolkit/lenscape/fits/recorded_data` (`lsc.recorded`),
read from the files (each file carries its command, commit, date, machine, torch threads and
wall time). Head roles (F4): `lsc.head_gating` at its defaults (the reference protocol), one
seed at a time, training split, validation split held out. Causal check: each role's whole set
(score >= 0.5 in every recorded seed) off vs 200 random sets of the same size drawn from the
other heads, on the validation split; percentile = share of random sets that cost less. Block
masks (F1): `lsc.mask_comparison` at K clusters and sparsity 0.3, held-out perplexity relative
to the unmasked model (routed: each held-out text with its nearest cluster's mask; global: one
mask fitted on all training texts; random: 20 masks of the same size); a cluster counts as a
win where its routed texts have a lower mean loss under the routed mask than under the global
one (last table: per cluster, the mean held-out NLL of the texts routed to it; the random
masks are scored over all held-out texts only). Fit time per seed is the median over the seeds
fitted in one uninterrupted run (a resumed seed carries only its last run's time), on whichever
machines made them. A file's `command` names the tasks its run recorded: from math seed 3 on,
`--tasks math` and `--tasks syntax` ran side by side, one torch thread each on its own core
(measured on the Intel machine: 2.4 s per stage-0 update in each, the same as one run alone)."""
    _report.emit(
        args, _report.section("record", "Recorded results (issue 22)", intro, "\n\n".join(parts))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "name", nargs="?", choices=[*recordings.NAMES, "summary"], default="summary"
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default=",".join(recordings.HEAD_ROLES_TASKS))
    parser.add_argument("--seeds", type=int, default=recordings.HEAD_ROLES_SEEDS)
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--root", type=Path, default=recordings.RECORDED_DIR)
    args = _report.parse_args(parser)
    if args.name == "summary":
        summary(args)
        return
    torch.set_num_threads(args.num_threads)
    provenance = {
        "command": "python benchmarks/record.py " + " ".join(sys.argv[1:]),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _report.machine_info()["machine"],
    }
    model = lsc.load(args.model, device="cpu")
    written = []
    if args.name == "head_roles":
        written = recordings.record_head_roles(
            model,
            args.tasks.split(","),
            seeds=range(args.seeds),
            precision=args.precision,
            provenance=provenance,
            root=args.root,
            on_unit=lambda path: print(f"recorded {path}", flush=True),
        )
    if args.name in ("head_roles", "head_roles_check"):
        written += [
            recordings.record_head_roles_check(model, task, provenance=provenance, root=args.root)
            for task in args.tasks.split(",")
        ]
    if args.name == "block_masks":
        written = [
            recordings.record_block_masks(
                model, precision=args.precision, provenance=provenance, root=args.root
            )
        ]
    print(f"{len(written)} new file(s); commit them with `git add {args.root}`.")


if __name__ == "__main__":
    main()
