"""Peak memory of streaming capture as the prompt list grows.

Each run is a fresh process that loads the model and runs ``lsc.capture_to`` (attribution
patching over every head, batches of 8) into a new zarr store; its peak resident set size
(``ru_maxrss``) is read at the end. The prompt lists cycle through the built-in factual
pairs. With streaming, memory holds the model and one batch, never the whole result, so
the peak should not grow with the number of prompts (target: under 10% from 64 to 1,024).
An in-memory run of the largest list is shown for comparison.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

import _report

CHILD = """
import json, resource, sys, time
import lenscape as lsc
n, model_name, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
factual = lsc.data.prompts("factual")
prompts = lsc.data.PromptSet([factual[i % len(factual)] for i in range(n)], name=f"factual-x{n}")
model = (lsc.models.tiny("llama", n_layers=4) if model_name == "tiny" else
         lsc.load(model_name, device="cpu"))
start = time.perf_counter()
if path == "-":
    lsc.attribution_patching(model, prompts, batch_size=8, progress=False)
else:
    lsc.capture_to(path, "attribution_patching", model, prompts, batch_size=8, progress=False)
took = time.perf_counter() - start
print(json.dumps({"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": took}))
"""


def measure(n: int, model: str, streaming: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/r.zarr" if streaming else "-"
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(n), model, path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--small", type=int, default=64)
    parser.add_argument("--large", type=int, default=1024)
    args = _report.parse_args(parser, model="tiny", small=16, large=64)
    runs = [(args.small, True), (args.large, True), (args.large, False)]
    results = {}
    for n, streaming in runs:
        results[n, streaming] = r = measure(n, args.model, streaming)
        print(
            f"{n} prompts, {'streaming' if streaming else 'in memory'}: peak RSS "
            f"{r['rss_mib']:.0f} MiB, capture {r['seconds']:.1f} s"
        )
    small, large = results[args.small, True], results[args.large, True]
    growth = large["rss_mib"] / small["rss_mib"] - 1
    print(f"peak RSS growth {args.small} -> {args.large} prompts (streaming): {growth:+.1%}")
    rows = [
        [
            *_report.stamp(),
            args.model,
            n,
            "zarr store" if streaming else "in memory",
            f"{results[n, streaming]['rss_mib']:.0f} MiB",
            f"{results[n, streaming]['seconds']:.1f} s",
        ]
        for n, streaming in runs
    ]
    body = _report.table(
        ["date", "machine", "model", "prompts", "results go to", "peak RSS", "capture time"], rows
    )
    body += (
        f"\n\nPeak RSS growth from {args.small} to {args.large} prompts with streaming: "
        f"**{growth:+.1%}** (target < +10%)."
    )
    _report.emit(
        args,
        _report.section(
            "streaming", "Streaming capture memory (issue 7)", __doc__.split("\n\n", 1)[1], body
        ),
    )


if __name__ == "__main__":
    main()
