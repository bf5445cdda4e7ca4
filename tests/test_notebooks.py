"""Every notebook runs headless, top to bottom, on the bundled models (CI settings), and what
it saves can be read without a kernel.

Notebooks read ``LENSCAPE_CI=1`` to use their reduced settings (fewer steps/seeds); each
notebook says which in its parameters cell. A notebook runs in a ``notebooks`` folder of its
own, as it does in the repository, so its files must land in the ``out`` folder beside it
(``../out``, ignored by git) and nowhere else.
"""

from __future__ import annotations

import base64
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
WIDGET = "application/vnd.jupyter.widget-view+json"
#: The text of a tqdm progress bar ("scoring: 100%|████| 2/2 [00:01<00:00]"): a widget that
#: is no chart.
PROGRESS = re.compile(r"\d+%\|.*\| *\d+/\d+")


def chart_outputs(nb: nbformat.NotebookNode) -> list[dict]:
    """The saved outputs of the notebook's charts and chart widgets (every widget view but
    progress bars)."""
    return [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if WIDGET in out.get("data", {}) and not PROGRESS.search(out["data"].get("text/plain", ""))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("LENSCAPE_CI", "1")
    nb = nbformat.read(path, as_version=4)
    folder = tmp_path / "notebooks"
    folder.mkdir()
    start = time.perf_counter()
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
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
    # Readable without a kernel (GitHub, nbviewer, a saved copy): every chart's saved output
    # holds a picture of it beside the widget view.
    charts = chart_outputs(nb)
    assert charts, f"{path.name} shows no chart"
    for out in charts:
        assert base64.b64decode(out["data"]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    # Files go to ../out (ignored by git), never beside the notebook.
    assert not list(folder.iterdir()), f"{path.name} wrote {list(folder.iterdir())}"
    assert {p.parent for p in tmp_path.rglob("*") if p.is_file()} <= {tmp_path / "out"}
    # A notebook with a time budget (RUN_ALL_S in its parameters cell) says what it chose.
    if "RUN_ALL_S" in nb.cells[1].source:
        printed = [
            out.get("text", "")
            for cell in nb.cells
            if cell.cell_type == "code"
            for out in cell.get("outputs", [])
            if out.get("output_type") == "stream"
        ]
        budget = [line for text in printed for line in text.splitlines() if "Budget:" in line]
        assert any("s per probe pass" in line for line in budget), budget
        assert any("budget" in line.split("Budget:", 1)[1] for line in budget), budget
    # Wall time is printed, not asserted: a shared or slower machine must not fail a
    # correct notebook (README "Run times" states what it takes on a quiet 2-core CPU).
    print(f"{path.name}: {took:.0f} s")
