"""What converting a bundled model's GGUF weights costs (``lenscape install-models`` does it
once; a load that finds no converted cache does it then).

Each conversion runs in a fresh Python process at one torch thread, into an empty
``LENSCAPE_CACHE`` (``lsc.models.bundled_folder(name)``); the wall time is the whole process,
imports included. ``--baseline DIR`` converts with another version of the package too (e.g.
the commit before a change: ``git archive <commit> toolkit | tar -x -C /tmp/before``), the
versions interleaved per model, and checks that both wrote the same files, byte for byte.

Run alone: ``python benchmarks/conversion.py [--baseline DIR]``; writes the ``conversion``
section of RESULTS.md (see _report.py). ``--quick`` converts SmolLM2 only.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _report

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"
CONVERT = (
    "import sys, torch; torch.set_num_threads(1); "
    "from lenscape.models import bundled_folder; bundled_folder(sys.argv[1])"
)


def convert(name: str, toolkit: Path, cache: Path) -> float:
    """Wall seconds of one fresh process converting ``name`` with ``toolkit``'s lenscape.

    Raises:
        RuntimeError: the process failed (its stderr is in the message).
    """
    path = os.pathsep.join(p for p in (str(toolkit), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "LENSCAPE_CACHE": str(cache)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CONVERT, name], env=env, capture_output=True, text=True
    )
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"converting {name} failed:\n{done.stderr}")
    return took


def same_files(first: Path, second: Path) -> bool:
    """Whether two folders hold the same file names with the same bytes."""
    names = sorted(p.name for p in first.iterdir())
    if names != sorted(p.name for p in second.iterdir()):
        return False
    return all(filecmp.cmp(first / n, second / n, shallow=False) for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--baseline", type=Path, default=None, help="another toolkit folder")
    parser.add_argument("--baseline-name", default="before", help="the baseline's column name")
    args = _report.parse_args(parser, models="smollm2-135m")
    trees = {"this tree": TOOLKIT}
    if args.baseline is not None:
        trees = {args.baseline_name: args.baseline.resolve(), **trees}
    rows = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as scratch:
            seconds, folders = {}, {}
            for column, toolkit in trees.items():
                cache = Path(scratch) / column.replace(" ", "_")
                seconds[column] = convert(name, toolkit, cache)
                folders[column] = cache / name
                print(f"{name} [{column}]: {seconds[column]:.1f} s", flush=True)
            compared = len(folders) == 2
            same = "-" if not compared else "yes" if same_files(*folders.values()) else "NO"
        cells = [f"{seconds[column]:.1f} s" for column in trees]
        rows.append([*_report.stamp(), name, *cells, same])
    heads = [*trees, "same files, byte for byte"]
    body = _report.table(["date", "machine", "model", *heads], rows)
    intro = __doc__.split("\n\n")[1]
    _report.emit(args, _report.section("conversion", "Converting bundled weights", intro, body))


if __name__ == "__main__":
    main()
