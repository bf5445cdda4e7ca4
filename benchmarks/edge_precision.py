"""Edge scores of a bfloat16 model: what its bfloat16 contraction costs in agreement.

A bfloat16 model's edge scores are contracted in bfloat16 (``scores.contraction_dtype``:
the clean - corrupt sender outputs and the receivers' input gradients rounded to bfloat16,
products accumulated in float32 inside the matrix kernels, each score rounded to bfloat16).
On SmolLM2-135M with the indirect-object prompts, three sets of per-prompt EAP scores:

- **float32**: the model in float32 (the reference every exactness test checks);
- **bfloat16, float32 contraction**: the model in bfloat16, contracted in float32 (what
  lenscape did before);
- **bfloat16**: the model in bfloat16, contracted in bfloat16 (what it does now).

For each pair: the largest difference over every prompt x edge cell as a share of the
larger set's largest score, the Pearson r over the cells, and the overlap of the top
``--top`` edges of the prompt mean (by absolute score). The contraction's own error (the
last two) is set against the error the bfloat16 model already carries (float32 against
bfloat16 with a float32 contraction). Writes the ``edge_precision`` section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import _report
import numpy as np
import torch

import lenscape as lsc
from lenscape.capture.edges import scores as edge_scores


def compare(a: np.ndarray, b: np.ndarray, top: int) -> tuple[float, float, float]:
    """(largest |a - b| / largest |a|, Pearson r, top-``top`` overlap of the prompt means) of
    two (prompt, sender, receiver) score arrays, NaN off the graph."""
    cells = ~np.isnan(a)
    x, y = a[cells].astype(np.float64), b[cells].astype(np.float64)
    error = float(np.abs(x - y).max() / np.abs(x).max())
    r = float(np.corrcoef(x, y)[0, 1])
    mean_a, mean_b = (np.nan_to_num(np.abs(v.mean(0))).ravel() for v in (a, b))
    best_a, best_b = (set(np.argsort(-v)[:top]) for v in (mean_a, mean_b))
    return error, r, len(best_a & best_b) / top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--top", type=int, default=100, help="top edges compared")
    args = _report.parse_args(parser, prompts=4, batch_size=4)
    prompts = lsc.data.prompts("ioi")[: args.prompts]
    options = dict(per_prompt=True, batch_size=args.batch_size, progress=False)

    runs, took = {}, {}
    for name, dtype, contraction in [
        ("float32", "float32", None),
        ("bfloat16, float32 contraction", "bfloat16", torch.float32),
        ("bfloat16", "bfloat16", None),
    ]:
        model = lsc.load("smollm2-135m", dtype=dtype)
        lsc.edge_attribution(model, prompts[:1], **options)  # warm-up
        patch = (
            mock.patch.object(
                edge_scores, "contraction_dtype", lambda model, dtype=contraction: dtype
            )
            if contraction is not None
            else contextlib.nullcontext()
        )
        with patch:
            start = time.perf_counter()
            runs[name] = lsc.edge_attribution(model, prompts, **options).values
            took[name] = time.perf_counter() - start
        print(f"{name}: {took[name]:.1f} s", flush=True)

    rows = []
    pairs = [
        ("float32", "bfloat16, float32 contraction", "the bfloat16 model's own error"),
        ("float32", "bfloat16", "both together"),
        ("bfloat16, float32 contraction", "bfloat16", "the bfloat16 contraction's error"),
    ]
    for first, second, meaning in pairs:
        error, r, overlap = compare(runs[first], runs[second], args.top)
        rows.append(
            [
                *_report.stamp(),
                f"{first} vs {second}",
                meaning,
                f"{error:.2e}",
                f"{r:.6f}",
                f"{overlap:.0%}",
            ]
        )
        print(rows[-1][2:], flush=True)
    times = [[*_report.stamp(), name, f"{t:.2f} s"] for name, t in took.items()]
    body = "\n\n".join(
        [
            _report.table(
                [
                    "date",
                    "machine",
                    "compared",
                    "what differs",
                    "largest error / scale",
                    "Pearson r",
                    f"top-{args.top} overlap",
                ],
                rows,
            ),
            f"EAP time of the {args.prompts} prompts (batch {args.batch_size}; one run each, "
            "after a warm-up):",
            _report.table(["date", "machine", "scores", "time"], times),
        ]
    )
    intro = (
        f"Per-prompt EAP scores of SmolLM2-135M on {args.prompts} indirect-object prompts in "
        "float32, in bfloat16 contracted in float32 and in bfloat16 contracted in bfloat16 "
        "(float32 accumulation inside the kernels). The bfloat16 contraction is kept only "
        "where its own error is well below the error the bfloat16 model carries anyway."
    )
    _report.emit(args, _report.section("edge_precision", "Edge scores in bfloat16", intro, body))


if __name__ == "__main__":
    main()
