"""Start-up time: ``import lenscape``, ``lenscape --version`` and ``--help``, beside torch.

Each command runs in a fresh Python process (the wall time of the whole process, interpreter
start included, as a person waits for it); a row is the fastest of ``--repeats`` runs
(default 3), the runs of all rows interleaved. ``lenscape --version`` and ``--help`` run the
console script's entry point (``lenscape.cli:main``, pyproject's ``[project.scripts]``) on the
lenscape of this repository (``toolkit/`` first on ``PYTHONPATH``). The first-use rows time
``import lenscape`` followed by one use that imports a part lazily: ``lsc.load`` (torch and
transformers), ``lsc.heatmap`` (the views and Altair), ``dir(lsc)`` (tab completion: the
capture methods, to list them). ``import torch, transformers`` imports the classes
``lsc.load`` uses. Target: ``--version`` and ``--help`` well under a second, and
``import lenscape`` no more than ``import torch, transformers``.

``--baseline DIR`` also times another version of the package, e.g. the commit before a change
(``git archive <commit> toolkit | tar -x -C /tmp/before``, then ``--baseline
/tmp/before/toolkit``), interleaved with this one, so both columns share the machine's load.

Run: ``python benchmarks/startup.py [--baseline DIR]``; writes the ``startup`` section of
RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _report

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"
#: What the console script does (pip writes the same two lines into ``bin/lenscape``).
ENTRY_POINT = (
    "import sys; from lenscape.cli import main; sys.argv[0] = 'lenscape'; sys.exit(main())"
)
#: Row label -> the arguments after ``python``.
COMMANDS: dict[str, list[str]] = {
    "import torch": ["-c", "import torch"],
    "import torch, transformers": [
        "-c",
        "import torch, transformers; from transformers import AutoModelForCausalLM, AutoTokenizer",
    ],
    "import lenscape": ["-c", "import lenscape"],
    "lenscape --version": ["-c", ENTRY_POINT, "--version"],
    "lenscape --help": ["-c", ENTRY_POINT, "--help"],
    "import lenscape; lsc.load (first use)": ["-c", "import lenscape as lsc; lsc.load"],
    "import lenscape; lsc.heatmap (first use)": ["-c", "import lenscape as lsc; lsc.heatmap"],
    "import lenscape; dir(lsc) (tab completion)": ["-c", "import lenscape as lsc; dir(lsc)"],
}
#: Rows timed once per run, the same for every version of the package: the ratios' base.
REFERENCE = ("import torch", "import torch, transformers")
TARGET_S = 1.0


def run_once(arguments: list[str], toolkit: Path, cwd: str) -> float:
    """Wall seconds of one fresh ``python`` process with ``toolkit`` first on the path.

    Raises:
        RuntimeError: the process failed (its stderr is in the message).
    """
    path = os.pathsep.join(p for p in (str(toolkit), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *arguments], cwd=cwd, env=env, capture_output=True, text=True
    )
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"python {' '.join(arguments)} failed:\n{done.stderr}")
    return took


def measure(trees: dict[str, Path], repeats: int) -> dict[tuple[str, str], float]:
    """The fastest of ``repeats`` runs of every command on every tree, rounds interleaved.

    Args:
        trees: column name -> toolkit folder whose ``lenscape`` is imported.
        repeats: runs per (command, tree).

    Returns:
        ``(command label, column name) -> seconds``; the reference rows under the first
        column only.
    """
    best: dict[tuple[str, str], float] = {}
    first = next(iter(trees))
    with tempfile.TemporaryDirectory() as cwd:  # no stray module in the working folder
        for round_ in range(repeats):
            for label, arguments in COMMANDS.items():
                for column, toolkit in trees.items():
                    if label in REFERENCE and column != first:
                        continue
                    took = run_once(arguments, toolkit, cwd)
                    key = (label, column)
                    best[key] = min(best.get(key, took), took)
                    print(f"round {round_ + 1}: {label} [{column}]: {took:.2f} s", flush=True)
    return best


def rows(best: dict[tuple[str, str], float], columns: list[str]) -> list[list[str]]:
    """Table rows: date, machine, command, then per column the time and its ratio to torch."""
    torch_s = best[("import torch", columns[0])]
    out = []
    for label in COMMANDS:
        cells = []
        for column in columns:
            took = best.get((label, column), best.get((label, columns[0])))
            cells.append("-" if took is None else f"{took:.2f} s ({took / torch_s:.2f}x)")
        out.append([*_report.stamp(), f"`{label}`", *cells])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per command")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a toolkit folder holding another version of lenscape, timed beside this one",
    )
    parser.add_argument(
        "--baseline-name", default="before", help="the baseline's column name (e.g. a commit)"
    )
    args = _report.parse_args(parser, repeats=1)
    trees = {"this tree": TOOLKIT}
    if args.baseline is not None:
        trees = {args.baseline_name: args.baseline.resolve(), **trees}
    best = measure(trees, args.repeats)
    columns = list(trees)
    heads = [f"{column}: fastest of {args.repeats} (x import torch)" for column in columns]
    body = _report.table(["date", "machine", "command", *heads], rows(best, columns))
    mine = [best[(label, "this tree")] for label in ("lenscape --version", "lenscape --help")]
    verdict = "yes" if max(mine) < TARGET_S else "no"
    body += f"\n\n`--version` and `--help` under {TARGET_S:.0f} s here: {verdict}."
    intro = __doc__.split("\n\n")[1] if not args.quick else "--quick: one run each, rough."
    _report.emit(args, _report.section("startup", "Start-up time", intro, body))


if __name__ == "__main__":
    main()
