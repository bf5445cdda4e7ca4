"""Run All wall time of the notebooks at their default setting (the 10-minute promise).

Each notebook runs top to bottom in a fresh kernel (nbclient), exactly as a user's Run All
does: the default setting of its parameters cell, the bundled models, the recorded results
shipped in the repository. The target is at most 600 s per notebook on a 2-core CPU; a
notebook with an error cell is reported as failed, not timed.

Run: ``python benchmarks/notebooks.py [--only 02,03] [--save out/executed]``; writes the
``notebooks`` section of RESULTS.md (see _report.py). ``--quick`` runs the notebooks' CI
setting (``LENSCAPE_CI=1``) and only checks they run: those times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import _report
import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TARGET_S = 600


def run_all(path: Path, save: Path | None = None) -> tuple[float, int]:
    """Execute one notebook in a fresh kernel; returns (wall seconds, error cells). With
    ``save``, the executed notebook (its outputs) is written into that folder."""
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
    return took, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--only", default="01,02,03,04,05", help="notebook number prefixes, comma-separated"
    )
    parser.add_argument(
        "--save", type=Path, default=None, help="a folder for the executed notebooks"
    )
    args = _report.parse_args(parser)
    if args.quick:
        os.environ["LENSCAPE_CI"] = "1"
    prefixes = tuple(args.only.split(","))
    rows = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        if not path.name.startswith(prefixes):
            continue
        took, errors = run_all(path, args.save)
        verdict = "failed" if errors else ("yes" if took <= TARGET_S else "no")
        print(f"{path.name}: {took:.0f} s, {errors} error cell(s)", flush=True)
        rows.append([*_report.stamp(), path.name, f"{took:.0f} s", str(errors), verdict])
    body = _report.table(
        ["date", "machine", "notebook", "Run All", "error cells", f"<= {TARGET_S} s"], rows
    )
    intro = __doc__.split("\n\n")[1] if not args.quick else "CI setting: times mean nothing."
    _report.emit(args, _report.section("notebooks", "Notebooks, Run All", intro, body))


if __name__ == "__main__":
    main()
