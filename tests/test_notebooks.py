"""Every notebook runs headless, top to bottom, on the bundled models (CI settings).

Notebooks read ``LENSCAPE_CI=1`` to use their reduced settings (fewer steps/seeds); each
notebook says which in its parameters cell.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("LENSCAPE_CI", "1")
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    took = time.perf_counter() - start
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
    # Wall time is printed, not asserted: a shared or slower machine must not fail a
    # correct notebook (README "Run times" states what it takes on a quiet 2-core CPU).
    print(f"{path.name}: {took:.0f} s")
