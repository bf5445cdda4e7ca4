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
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

from lenscape.views.circuit import DRAWN_EDGES

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
WIDGET = "application/vnd.jupyter.widget-view+json"
#: The text of a tqdm progress bar ("scoring: 100%|████| 2/2 [00:01<00:00]"): a widget that
#: is no chart.
PROGRESS = re.compile(r"\d+%\|.*\| *\d+/\d+")
#: Widest picture a notebook may show, in pixels: a notebook output area in JupyterLab is
#: about 1,000 px wide (1,068 px in the issue 61 screenshots, less beside the side bar), and
#: a wider chart hides its right-hand panels and legend.
OUTPUT_WIDTH = 1000


#: Per notebook, the lines its cells print about its figures (a regex) and what each found
#: value must satisfy: the circuit graphs draw at most ``DRAWN_EDGES`` edges (the prose says
#: "its 50 strongest"); the answer-writing heads' attention is printed with the names it
#: goes to; the logit lens prints the layer where the target first leads.
PRINTED_CLAIMS: dict[str, list[tuple[str, Any]]] = {
    "05_circuits": [
        (r"the graph draws (\d+)", lambda n: 0 < int(n) <= DRAWN_EDGES),
        (r"the last token's attention: IO ([\d.]+), S1 ([\d.nan]+), S2 ([\d.]+)", bool),
        (r"so it reads (IO|S1|S2|none of the names)", bool),
    ],
    "01_quickstart": [
        (r"is (?:first the top prediction after layer \d+|never the top prediction)", bool),
    ],
}


def png_width(encoded: str) -> int:
    """The width in pixels of a base64 PNG (its IHDR chunk)."""
    return int.from_bytes(base64.b64decode(encoded)[16:20], "big")


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
    # Every chart fits the output area (the PNG is drawn at the chart's own size, scale 1).
    widths = [png_width(out["data"]["image/png"]) for out in charts]
    print(f"{path.name}: chart widths {widths} px (output area {OUTPUT_WIDTH} px)")
    assert max(widths) <= OUTPUT_WIDTH, f"{path.name}: charts wider than the page: {widths}"
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
    # What the prose says about a figure is printed from the data (issue 61): the check here
    # fails when a notebook stops printing it or the data stops supporting it.
    printed = "".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream"
    )
    for pattern, check in PRINTED_CLAIMS.get(path.stem, []):
        found = re.findall(pattern, printed)
        assert found and all(check(f) for f in found), (path.name, pattern, found)
    # Wall time is printed, not asserted: a shared or slower machine must not fail a
    # correct notebook (README "Run times" states what it takes on a quiet 2-core CPU).
    print(f"{path.name}: {took:.0f} s")
