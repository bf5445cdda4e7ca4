"""The demo's job time: ``lenscape demo`` after the install, as a newcomer waits for it.

Runs ``lenscape demo`` (the console script's entry point, ``lenscape.cli:main``) in a fresh
Python process on the bundled model and the CPU, with the weights already converted (``make
install`` did that), and reports the wall time of the whole process (interpreter start,
imports and model load included) and the job time the demo prints ("done in N s": load,
exact patching, the estimators, the files). Target: at most 90 s on a 2-core CPU.

``--baseline DIR`` also runs another version of the package (``git archive <commit> toolkit |
tar -x -C /tmp/before``, then ``--baseline /tmp/before/toolkit``) first, with its own default
prompts, so the two rows are taken on the same machine one after the other.

Run: ``python benchmarks/demo.py [--baseline DIR]``; writes the ``demo`` section of
RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _report

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"
ENTRY_POINT = (
    "import sys; from lenscape.cli import main; sys.argv[0] = 'lenscape'; sys.exit(main())"
)


def run_demo(toolkit: Path, extra: list[str]) -> tuple[float, float, str]:
    """(wall seconds, the job's own "done in" seconds, its prompts line) of one demo run."""
    env = {**os.environ, "PYTHONPATH": str(toolkit)}
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-c", ENTRY_POINT, "demo", "--out", out, "--device", "cpu"]
        start = time.perf_counter()
        done = subprocess.run(
            [*command, *extra], env=env, capture_output=True, text=True, timeout=1800
        )
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"lenscape demo failed:\n{done.stderr[-2000:]}")
    job = float(re.search(r"done in (\d+) s", done.stdout)[1])
    prompts = next(line for line in done.stdout.splitlines() if "factual prompts" in line)
    return wall, job, prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", type=Path, default=None, help="another version's toolkit/")
    parser.add_argument("--baseline-name", default="before", help="its label in the table")
    args = _report.parse_args(parser)
    extra = ["--prompts", "2"] if args.quick else []
    runs = [(args.baseline_name, args.baseline)] if args.baseline else []
    runs.append(("this tree", TOOLKIT))
    rows = []
    for name, toolkit in runs:
        wall, job, prompts = run_demo(toolkit, extra)
        print(f"{name}: {prompts.strip()}; job {job:.0f} s, process {wall:.0f} s", flush=True)
        rows.append(
            [*_report.stamp(), name, prompts.split(":")[0].strip(), f"{job:.0f} s", f"{wall:.0f} s"]
        )
    body = _report.table(
        ["date", "machine", "version", "prompts", "job (demo's own 'done in')", "process"], rows
    )
    _report.emit(
        args,
        _report.section(
            "demo",
            "make demo's job time (issue 64)",
            __doc__.split("\n\n")[1],
            body,
        ),
    )


if __name__ == "__main__":
    main()
