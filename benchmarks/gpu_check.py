"""The prepared GPU check (``make gpu-check``): one script, at most 8 minutes on one GPU.

1. The test suite's device-marked tests (``pytest -m device``: every method on the GPU
   against the CPU on a tiny model, and the memory estimate against
   ``torch.cuda.max_memory_allocated``), with ``LENSCAPE_TEST_DEVICE`` set to the device.
2. The scale ladder's Llama-3.2-1B rung (float32) on the device, and the Llama-3-8B rung
   (bfloat16) where the device's free memory holds its weights with room to spare: per
   method the peak memory allocated, the peak ``lsc.estimate`` predicted and its error, the
   wall time (``scale_ladder.measure_on``: one process, one model per rung).
3. CPU and device agree on SmolLM2-135M (float32, real weights) for each method: the
   largest difference relative to the largest value, which must stay within 1e-4.

Steps stop early when the time budget (``--budget``, 450 s) is spent, and say so. Without a
GPU (``--device cuda`` and none available) the section says that no GPU figure exists; a
dry run on CPU (``--device cpu --quick``: SmolLM2 in place of the 1B rung, two prompts)
checks the script itself (its numbers compare the CPU with itself). Writes the
``gpu_check`` section of RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import _report
import _shapes
import scale_ladder

HERE = Path(__file__).resolve().parent
#: Largest difference between CPU and device, relative to the largest value.
TOLERANCE = 1e-4
#: Free device memory an 8B rung needs beyond its weights to be tried.
HEADROOM = 8 * 2**30


def device_tests(device: str, timeout: float) -> list[str]:
    """Run ``pytest -m device`` on ``device``; its summary as a table row."""
    env = {**os.environ, "LENSCAPE_TEST_DEVICE": device}
    command = [sys.executable, "-m", "pytest", "-q", "-m", "device", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=timeout
        )
        lines = done.stdout.strip().splitlines()
        summary = lines[-1] if lines else f"no output (exit {done.returncode})"
    except subprocess.TimeoutExpired:
        summary = f"timed out after {timeout:.0f} s"
    return [*_report.stamp(), device, summary.strip("= "), f"{time.perf_counter() - start:.0f} s"]


def _rungs(device: str, quick: bool) -> list[str]:
    """The ladder rungs to run on ``device``: the 1B rung (SmolLM2 with ``quick``), and the
    8B rung when the device's free memory holds its weights and ``HEADROOM``."""
    import torch

    if quick:
        return [_shapes.REAL]
    rungs = ["llama-3.2-1b"]
    if device.startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(device))[0]
        if free > _shapes.parameters("llama-3-8b") * 2 + HEADROOM:
            rungs.append("llama-3-8b")
    return rungs


def ladder(device: str, args: argparse.Namespace, deadline: float) -> list[list]:
    """The ladder's rungs on ``device``, every method in one process per rung."""
    import torch

    rows = []
    for rung in _rungs(device, args.quick):
        model, weights = scale_ladder.built(rung, device)
        for method in args.methods:
            if time.perf_counter() > deadline:
                rows.append([*_report.stamp(), rung, method, "-", "-", "-", "-", "budget spent"])
                continue
            spec = dict(sweep="gpu", rung=rung, method=method, device=device, threads=1)
            spec |= dict(prompts=args.prompts, length=0, batch=None, refine=8, repeats=1)
            row = scale_ladder.measure_on(model, weights, spec)
            rows.append(_ladder_row(row))
            print(" | ".join(map(str, rows[-1])), flush=True)
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def _ladder_row(row: dict) -> list:
    gib = scale_ladder.GIB
    if "error" in row:
        return [*_report.stamp(), row["rung"], row["method"], "-", "-", "-", "-", row["error"]]
    predicted = scale_ladder.predicted(row)
    error = "-" if predicted is None else f"{(predicted - row['peak']) / row['peak']:+.0%}"
    return [
        *_report.stamp(),
        row["rung"],
        row["method"],
        f"{row['peak'] / gib:.2f}",
        "-" if predicted is None else f"{predicted / gib:.2f}",
        error,
        f"{row['time_s']:.2f} s",
    ]


def agreement(device: str, args: argparse.Namespace, deadline: float) -> list[list]:
    """Each method on SmolLM2 on the CPU and on ``device``: the largest difference relative
    to the largest value."""
    import numpy as np
    import xarray as xr

    import lenscape as lsc

    def values(result) -> np.ndarray:
        if isinstance(result, xr.Dataset):
            return np.concatenate([values(result[name]) for name in sorted(result.data_vars)])
        return np.asarray(result.values, dtype=np.float64).ravel()

    cpu_model = _shapes.build(_shapes.REAL, device="cpu")
    there = _shapes.build(_shapes.REAL, device=device)
    prompts = scale_ladder.prompts_of(args.prompts, 0, cpu_model.tokenizer)
    rows = []
    for method in args.methods:
        if method in scale_ladder.FLOOR:
            continue
        if time.perf_counter() > deadline:
            rows.append([*_report.stamp(), method, "-", "budget spent"])
            continue
        spec = dict(method=method, batch=None, refine=8)
        function, options = scale_ladder.call_of(spec, prompts)
        expected = values(getattr(lsc, function)(cpu_model, prompts, **options))
        got = values(getattr(lsc, function)(there, prompts, **options))
        finite = np.isfinite(expected) & np.isfinite(got)
        same_nan = bool((np.isfinite(expected) == np.isfinite(got)).all())
        scale = float(np.abs(expected[finite]).max()) or 1.0
        difference = float(np.abs(got[finite] - expected[finite]).max()) / scale
        verdict = "agree" if same_nan and difference <= TOLERANCE else "DIFFER"
        rows.append([*_report.stamp(), method, f"{difference:.1e}", verdict])
        print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--methods", default=",".join(scale_ladder.METHODS))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole check")
    parser.add_argument("--test-timeout", type=float, default=150)
    args = _report.parse_args(parser, prompts=2, methods="forward,atp_heads,eap,logit_lens")
    args.methods = args.methods.split(",")
    import torch

    intro = (
        "The prepared check for a lent GPU (`make gpu-check`, benchmarks/gpu_check.py): the "
        "device-marked tests, the scale ladder's 1B rung (and the 8B rung in bfloat16 where "
        "memory allows) on the GPU with peak memory (torch.cuda.max_memory_allocated) "
        "against lsc.estimate, and CPU vs GPU agreement on SmolLM2-135M (float32) per "
        f"method within {TOLERANCE:g} of the largest value."
    )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        body = (
            "No GPU figure exists yet: no GPU has been lent to this project, so the check has "
            "not run on one. Its dry run on CPU, `python benchmarks/gpu_check.py --device cpu "
            "--quick`, checks the script itself."
        )
        _report.emit(args, _report.section("gpu_check", "GPU check", intro, body))
        return
    deadline = time.perf_counter() + args.budget
    tests = [device_tests(args.device, args.test_timeout)]
    print(" | ".join(tests[0]), flush=True)
    rungs = ladder(args.device, args, deadline)
    agree = agreement(args.device, args, deadline)
    note = (
        f"Device: {args.device}"
        + (
            " (a dry run: the 'GPU' is the CPU, so agreement is trivially exact and "
            "in-process CPU peaks mean nothing)"
            if args.device == "cpu"
            else ""
        )
        + f"; {args.prompts} IOI pairs; batch_size=None."
    )
    body = "\n\n".join(
        [
            note,
            _report.table(["date", "machine", "device", "device tests", "time"], tests),
            _report.table(
                [
                    "date",
                    "machine",
                    "model",
                    "method",
                    "peak GiB",
                    "predicted GiB",
                    "error",
                    "time",
                ],
                rungs,
            ),
            _report.table(
                ["date", "machine", "method", "largest difference / largest value", "verdict"],
                agree,
            ),
        ]
    )
    _report.emit(args, _report.section("gpu_check", "GPU check", intro, body))


if __name__ == "__main__":
    main()
