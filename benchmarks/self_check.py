"""Cost of the layout self-check that ``lsc.load`` runs (``lsc.check``).

The check is one forward pass over a short probe text with hooks at every layout site,
then the three identities recomputed in float32 (per-head outputs through o_proj, the
residual stream block by block, final norm and unembedding). It is timed on the bundled
model against a plain forward pass over the same probe and against the rest of ``load``.

Run: ``python benchmarks/self_check.py``; writes the ``self_check`` section of RESULTS.md
(see _report.py).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import _report
import torch

import lenscape as lsc
from lenscape.models.selfcheck import PROBE_TEXT


def _median_ms(fn, repeats: int) -> float:
    """Median wall-clock milliseconds per call, after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _forward(model: lsc.LensModel, ids: torch.Tensor) -> None:
    """A plain forward pass of the probe, without the self-check's hooks."""
    with torch.no_grad():
        model.hf(input_ids=ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default="smollm2-135m")
    args = _report.parse_args(parser, repeats=2)
    rows = []
    for dtype in ("float32", "bfloat16"):
        start = time.perf_counter()
        model = lsc.load(args.model, device="cpu", dtype=dtype, check=False)
        load_ms = (time.perf_counter() - start) * 1e3
        ids = torch.tensor([model.tokenizer(PROBE_TEXT)["input_ids"]])
        check = functools.partial(lsc.check, model)
        forward = functools.partial(_forward, model, ids)
        # Interleaved rounds, so both see the same load from other processes.
        check_ms, forward_ms = map(
            statistics.median,
            zip(
                *((_median_ms(check, 3), _median_ms(forward, 3)) for _ in range(args.repeats)),
                strict=True,
            ),
        )
        busy = os.getloadavg()[0]
        worst = lsc.check(model)
        mismatch = max(float(worst[name].max()) for name in ("heads", "residual", "logits"))
        print(
            f"{args.model} {dtype}: check {check_ms:.0f} ms, plain forward {forward_ms:.0f} ms "
            f"(medians of {args.repeats} rounds), load without check {load_ms:.0f} ms, "
            f"load average {busy:.1f}; "
            f"largest mismatch {mismatch:.1e} (tolerance {worst.attrs['tolerance']:g})"
        )
        rows.append(
            [
                *_report.stamp(),
                args.model,
                dtype,
                ids.shape[1],
                f"{check_ms:.0f} ms",
                f"{forward_ms:.0f} ms",
                f"{check_ms / forward_ms:.2f}x",
                f"{busy:.1f}",
                f"{load_ms:.0f} ms",
                f"{mismatch:.1e} / {worst.attrs['tolerance']:g}",
            ]
        )
    intro = f"""\
`python benchmarks/self_check.py`: what the layout self-check adds to `lsc.load` (it runs
on every load unless `check=False`). `check`: `lsc.check(model)`, one hooked forward pass
over a {rows[0][4]}-token probe (logits at its last position), then the per-head, residual
and logit identities recomputed in float32; `forward`: a plain forward pass over the same
probe (logits at every position, as `model.hf(ids)` gives); both wall-clock, medians over
{args.repeats} interleaved rounds of 3 calls. `load`: `lsc.load(..., check=False)` from the
converted cache, once. `load avg`: the machine's 1-minute load average (2 cores) during the
run: other processes slow both timings alike, so the ratio is the stabler number.
`mismatch`: the largest relative mismatch of the three identities against the dtype's
tolerance."""
    _report.emit(
        args,
        _report.section(
            "self_check",
            "Layout self-check on load",
            intro,
            _report.table(
                [
                    "date",
                    "machine",
                    "model",
                    "dtype",
                    "probe tokens",
                    "check",
                    "forward",
                    "check / forward",
                    "load avg",
                    "load",
                    "mismatch / tolerance",
                ],
                rows,
            ),
        ),
    )


if __name__ == "__main__":
    main()
