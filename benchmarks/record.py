"""Record the reference-protocol results that ship with lenscape (``lsc.recorded``).

    python benchmarks/record.py head_roles                     # F4: 10 seeds x math, syntax
    python benchmarks/record.py head_roles_check               # F4's check of the seeds so far
    python benchmarks/record.py block_masks --model gemma3-270m  # F1: K=8 masks of one model

Each finished unit (one seed of one task; one model's masks) is written at once into
``toolkit/lenscape/recorded_data``; a restarted run skips what exists, so an interrupted
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
from lenscape import recordings


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", choices=recordings.NAMES)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default=",".join(recordings.HEAD_ROLES_TASKS))
    parser.add_argument("--seeds", type=int, default=recordings.HEAD_ROLES_SEEDS)
    parser.add_argument("--precision", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--root", type=Path, default=recordings.RECORDED_DIR)
    args = parser.parse_args()
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
