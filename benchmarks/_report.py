"""The benchmark report protocol: every script writes its own section of RESULTS.md.

A benchmark script measures, prints, and renders one markdown *section*: a block between
``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` (NAME = the script's stem) holding a
``## title`` heading, prose saying what is measured and how to read it, and tables whose rows
start with ``date`` and ``machine`` so a row stays meaningful wherever it is copied.
``run_all.py`` runs each script with ``--markdown FILE`` and assembles RESULTS.md from the
sections, so nothing in it is edited by hand. A script looks like::

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    args = _report.parse_args(parser, prompts=2)   # --quick replaces these defaults
    ...                                            # measure and print
    rows = [[*_report.stamp(), f"{took:.1f} s"]]
    body = _report.table(["date", "machine", "time"], rows)
    _report.emit(args, _report.section("my_script", "Title", "What and how.", body))

The machine is described by ``lenscape.models.host.describe_machine``, as in every provenance
lenscape writes.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import platform
from datetime import date
from pathlib import Path

from lenscape.models.host import describe_machine

PACKAGES = (
    "torch",
    "transformers",
    "nnsight",
    "transformer-lens",
    "xarray",
    "zarr",
    "dask",
    "distributed",
    "altair",
    "lenscape",
)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.cache
def machine_info() -> dict:
    """Date, machine and package versions of this run.

    Returns:
        ``{"date": ISO date, "machine": one-line description (CPU model, cores, vector
        extension, RAM, GPU: ``str(lenscape.models.host.describe_machine())``), "short": the
        short form for a table's ``machine`` column (e.g. "2-core CPU (AVX2), 24 GiB"),
        "versions": {"python": ..., package: version or "absent"}}``.
    """
    machine = describe_machine()
    versions = {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}}
    return {
        "date": date.today().isoformat(),
        "machine": str(machine),
        "short": machine.short,
        "versions": versions,
    }


def stamp() -> list[str]:
    """The first two cells of every table row: ``[date, short machine]``."""
    info = machine_info()
    return [info["date"], info["short"]]


def table(columns: list[str], rows: list[list]) -> str:
    """A markdown table; cells are written with ``str``, so format numbers before.

    Args:
        columns: header cells.
        rows: one list per row, as long as ``columns``.

    Returns:
        The table, one line per row, without a trailing newline.

    Raises:
        ValueError: a row with a different number of cells than ``columns``.
    """
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {row} has {len(row)} cells for {len(columns)} columns")
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def section(name: str, title: str, intro: str, body: str) -> str:
    """One script's block of RESULTS.md, between ``<!-- bench:NAME -->`` markers.

    Args:
        name: the script's stem (``capture_overhead``); run_all matches sections by it.
        title: the ``##`` heading.
        intro: prose: what is measured, settings, target, how to read the numbers.
        body: tables and notes of this run.

    Returns:
        The block, ending with a newline.
    """
    parts = [f"## {title}", intro.strip(), body.strip()]
    inner = "\n\n".join(part for part in parts if part)
    return f"<!-- bench:{name} -->\n{inner}\n<!-- /bench:{name} -->\n"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--quick`` (tiny sizes, a smoke check) and ``--markdown PATH`` (write the section)."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes: checks the script runs, numbers mean nothing",
    )
    parser.add_argument(
        "--markdown",
        metavar="PATH",
        default=None,
        help="also write this script's RESULTS.md section to PATH",
    )


def parse_args(parser: argparse.ArgumentParser, **quick) -> argparse.Namespace:
    """Add the common options and parse; with ``--quick``, ``quick`` replaces the defaults.

    Options given on the command line still win over the quick defaults.

    Args:
        parser: the script's parser with its own options.
        **quick: option name -> value used when ``--quick`` is given.
    """
    add_common_args(parser)
    args = parser.parse_args()
    if args.quick and quick:
        parser.set_defaults(**quick)
        args = parser.parse_args()
    return args


def emit(args: argparse.Namespace, text: str) -> None:
    """Print the section and, with ``--markdown PATH``, write it there."""
    print("\n" + text, end="", flush=True)
    if args.markdown:
        Path(args.markdown).write_text(text)
