"""Time per update of the learned fits (head gating, block masks) before and after the
speed-ups, and whether the faster fits keep the answer.

Head gating: one seed of the math task at the reference protocol (batch 32), ``--updates``
updates per stage, timed three ways: *before* (the fit's passes as they were: the model's
own attention kernel, float32), *float32* (eager attention on the CPU, ``fit_passes``) and
*bfloat16* (eager attention, bfloat16 autocast with the linear weights cast once). The
per-update time is the fit's wall time over all gate-set updates of the three stages (the
G+ and G- sets share passes, as in a real fit), validation excluded.

Block masks: ``block_masks`` on the mixed corpus with K clusters at one sparsity, float32 vs
bfloat16, ``--mask-updates`` updates; the masks of the two fits are compared cell by cell.

Role agreement: a bfloat16 recording of math seed 0 (``--bf16-roles DIR``; by default
``fit_speed_data/``, made at commit 9dc1f61 by ``python benchmarks/record.py head_roles
--tasks math --seeds 1 --precision bfloat16 --root DIR``) is compared head by head with the
shipped float32 recording of the same seed (role at threshold 0.5: neither, facilitating,
interfering, both).

bfloat16 is fast only on a CPU with bfloat16 units (AVX512-BF16 or AMX); elsewhere torch
emulates it, and it is slower than float32: the table names the CPU's vector extensions.
Writes the ``fit_speed`` section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from unittest import mock

import _report
import numpy as np
import torch

import lenscape as lsc
from lenscape import cluster
from lenscape.fits import gating


def gating_per_update(model, task, val, updates: int, how: str) -> float:
    """Seconds per gate-set update of a ``head_gating`` fit, validation excluded."""
    passes = (
        mock.patch.object(gating, "fit_passes", lambda hf, precision: contextlib.nullcontext())
        if how == "before"
        else contextlib.nullcontext()
    )
    precision = "bfloat16" if how == "bfloat16" else "float32"
    validation_time = []
    validation = gating._validation_loss

    def timed_validation(*args, **kwargs):
        start = time.perf_counter()
        out = validation(*args, **kwargs)
        validation_time.append(time.perf_counter() - start)
        return out

    with passes, mock.patch.object(gating, "_validation_loss", timed_validation):
        start = time.perf_counter()
        ds = lsc.head_gating(
            model,
            task,
            seeds=[0],
            max_steps=updates,
            window=updates + 1,
            validation=val,
            precision=precision,
            progress=False,
        )
        took = time.perf_counter() - start - sum(validation_time)
    set_updates = sum(int(ds[f"steps_{s}"].sum()) for s in ("stage0", "plus", "minus"))
    return took / set_updates


def roles(ds) -> np.ndarray:
    return ((ds["facilitation"] >= 0.5).astype(int) + 2 * (ds["interference"] >= 0.5)).values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--mask-updates", type=int, default=10)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--bf16-roles", type=Path, default=Path(__file__).parent / "fit_speed_data")
    parser.add_argument("--note", default="", help="what else ran on the machine")
    args = _report.parse_args(parser, updates=2, mask_updates=2, k=2)
    torch.set_num_threads(args.num_threads)
    model = lsc.load("smollm2-135m", device="cpu")
    task = lsc.data.task("math")
    val = lsc.data.task("math", split="validation")[:8]
    rows, times = [], {}
    for how in ("before", "float32", "bfloat16"):
        times[how] = gating_per_update(model, task, val, args.updates, how)
        print(f"head gating, {how}: {times[how]:.2f} s per update")
        rows.append(
            [
                *_report.stamp(),
                "head gating (math, batch 32)",
                how,
                f"{times[how]:.2f} s",
                f"{times['before'] / times[how]:.2f}x",
            ]
        )
    texts = lsc.data.prompts("mixed")
    train, _ = cluster.split(texts, held_out=0.25, seed=0)
    clusters = cluster.kmeans(cluster.embed(train), args.k, prompts=train)
    masks, mask_times = {}, {}
    for precision in ("float32", "bfloat16"):
        start = time.perf_counter()
        masks[precision] = lsc.block_masks(
            model,
            train,
            clusters=clusters,
            max_steps=args.mask_updates,
            window=args.mask_updates + 1,
            precision=precision,
            progress=False,
        )
        mask_times[precision] = (time.perf_counter() - start) / args.mask_updates
        print(f"block masks, {precision}: {mask_times[precision]:.2f} s per update")
        rows.append(
            [
                *_report.stamp(),
                f"block masks (K={args.k}, all sets stacked)",
                precision,
                f"{mask_times[precision]:.2f} s",
                f"{mask_times['float32'] / mask_times[precision]:.2f}x",
            ]
        )
    same_masks = float((masks["float32"]["mask"] == masks["bfloat16"]["mask"]).mean())
    notes = [
        f"Block masks after {args.mask_updates} updates: float32 and bfloat16 agree on "
        f"{same_masks:.1%} of (cluster, block) cells."
    ]
    if args.bf16_roles is not None:
        f32 = lsc.recorded("head_roles", model=model.name, task="math").sel(seed=[0])
        bf16 = lsc.recorded("head_roles", model=model.name, task="math", root=args.bf16_roles)
        agree = float((roles(f32) == roles(bf16.sel(seed=[0]))).mean())
        notes.append(
            f"Head roles of math seed 0 at the reference protocol, converged in both: float32 "
            f"vs bfloat16 agree for {agree:.1%} of heads (adoption needs >= 98%); updates per "
            f"stage float32 {[int(f32[f'steps_{s}'][0]) for s in ('stage0', 'plus', 'minus')]}"
            f", bfloat16 {[int(bf16[f'steps_{s}'][0]) for s in ('stage0', 'plus', 'minus')]}."
        )
    for note in notes:
        print(note)
    intro = f"""\
`python benchmarks/fit_speed.py`: {model.name}, {args.num_threads} torch threads. Head gating:
math, one seed, batch 32, {args.updates} updates per stage; per update = fit time without
validation over the gate-set updates of the three stages. *before*: the fit's passes as they
were (the model's SDPA attention, float32); *float32*: eager attention on the CPU (SDPA's CPU
backward is slow at a fit's short sequences); *bfloat16*: eager attention and bfloat16
autocast with the linear weights cast once (bit-identical to plain autocast). Block masks:
K={args.k} clusters of the mixed corpus, one sparsity, {args.mask_updates} updates."""
    body = "\n\n".join(
        [
            _report.table(["date", "machine", "fit", "passes", "per update", "speed-up"], rows),
            *notes,
            *([args.note] if args.note else []),
        ]
    )
    _report.emit(args, _report.section("fit_speed", "Fit speed (issue 22)", intro, body))


if __name__ == "__main__":
    main()
