"""Run All wall time of the notebooks at their default setting (the 10-minute promise).

Each notebook runs top to bottom in a fresh kernel (nbclient), exactly as a user's Run All
does: the default setting of its parameters cell, the bundled models, the recorded results
shipped in the repository. The target is at most 600 s per notebook on a 2-core CPU; a
notebook with an error cell is reported as failed, not timed. Every row names the CPU kind
(vendor and the vector extension torch runs on: AVX2 and AVX-512 machines differ by about
2x) and the torch thread count of the notebook's kernel: at one thread a 2-core CPU is a
machine about half as fast, which shows what the notebooks' time budgets do there (they
size their live work from a speed probe and stop their fits at a wall-time budget; the
lines they print about it are listed under the table).

Run: ``python benchmarks/notebooks.py [--only 02,03] [--threads default,1] [--save
out/executed]``; writes the ``notebooks`` section of RESULTS.md (see _report.py).
``--threads`` runs every notebook once per thread count ("default": as this process,
torch's own unless OMP_NUM_THREADS says otherwise). ``--quick`` runs the notebooks' CI
setting (``LENSCAPE_CI=1``) at the default thread count and only checks they run: those
times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import _report
import nbformat
import torch
from nbclient import NotebookClient

from lenscape.models.host import describe_machine

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TARGET_S = 600
#: What a notebook prints about its time budget starts with this (see the notebooks'
#: parameters cells); those lines are listed under the table.
BUDGET_LINE = "Budget:"
#: The thread-count variables torch's CPU backends read when the kernel imports torch.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def kernel_threads(threads: int | None) -> Iterator[None]:
    """Kernels started inside run torch on ``threads`` threads (None: as this process, the
    environment untouched); the environment is restored afterwards."""
    saved = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    try:
        for name in THREAD_VARIABLES:
            if threads is not None:
                os.environ[name] = str(threads)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def budget_lines(nb: nbformat.NotebookNode) -> list[str]:
    """The lines an executed notebook printed about its time budget (``BUDGET_LINE``)."""
    return [
        line.strip()
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream"
        for line in out.get("text", "").splitlines()
        if line.strip().startswith(BUDGET_LINE)
    ]


def run_all(path: Path, save: Path | None = None) -> tuple[float, int, list[str]]:
    """Execute one notebook in a fresh kernel; returns (wall seconds, error cells, budget
    lines). With ``save``, the executed notebook (its outputs) is written into that folder."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        NotebookClient(
            nb,
            timeout=3600,
            kernel_name="python3",
            allow_errors=True,
            resources={"metadata": {"path": workdir}},
        ).execute()
        took = time.perf_counter() - start
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, save / path.name)
    errors = sum(
        out.get("output_type") == "error"
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    return took, errors, budget_lines(nb)


def parse_threads(text: str) -> list[int | None]:
    """``--threads``: comma-separated thread counts, "default" (None) for torch's own."""
    counts: list[int | None] = []
    for part in text.split(","):
        if part == "default":
            counts.append(None)
        elif part.isdigit() and int(part) > 0:
            counts.append(int(part))
        else:
            raise SystemExit(f"--threads takes 'default' or positive integers, got {part!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--only", default="01,02,03,04,05,06", help="notebook number prefixes, comma-separated"
    )
    parser.add_argument(
        "--threads",
        default="default,1",
        help="torch thread counts of the kernels, comma-separated ('default': torch's own)",
    )
    parser.add_argument(
        "--save", type=Path, default=None, help="a folder for the executed notebooks"
    )
    args = _report.parse_args(parser, threads="default")
    if args.quick:
        os.environ["LENSCAPE_CI"] = "1"
    prefixes = tuple(args.only.split(","))
    kind = describe_machine().kind
    rows, notes = [], []
    for threads in parse_threads(args.threads):
        shown = str(threads or torch.get_num_threads())
        for path in sorted(NOTEBOOKS.glob("*.ipynb")):
            if not path.name.startswith(prefixes):
                continue
            save = None if args.save is None else args.save / f"threads-{shown}"
            with kernel_threads(threads):
                took, errors, lines = run_all(path, save)
            verdict = "failed" if errors else ("yes" if took <= TARGET_S else "no")
            print(f"{path.name} ({kind}, {shown} threads): {took:.0f} s, {errors} error cell(s)")
            for line in lines:
                print(f"  {line}", flush=True)
            rows.append(
                [*_report.stamp(), kind, shown, path.name, f"{took:.0f} s", str(errors), verdict]
            )
            notes += [f"- {path.stem}, {shown} torch threads: {line}" for line in lines]
    columns = ["date", "machine", "CPU kind", "torch threads", "notebook", "Run All"]
    body = _report.table([*columns, "error cells", f"<= {TARGET_S} s"], rows)
    if notes:
        body += "\n\nWhat the notebooks' time budgets chose (their printed lines):\n\n"
        body += "\n".join(notes)
    intro = __doc__.split("\n\n")[1] if not args.quick else "CI setting: times mean nothing."
    _report.emit(args, _report.section("notebooks", "Notebooks, Run All", intro, body))


if __name__ == "__main__":
    main()
