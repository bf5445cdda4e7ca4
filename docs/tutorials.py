"""The tutorials of the documentation site: the notebooks as pages, with their figures.

A notebook is committed without outputs, and the site never runs one (five notebooks take
up to 10 minutes each on a 2-core CPU). A tutorial page shows

- the outputs of a cached execution, when ``out/docs-notebooks/<name>.ipynb`` holds one
  made from the notebook as it is now (``python docs/tutorials.py --execute``, or ``make
  docs-notebooks``, writes them; each records the SHA-256 of the source it ran, and a
  stale copy is not used); every chart's saved PNG is the picture on the page;
- otherwise the notebook's cells without outputs, after the gallery figures the notebook
  draws (``FIGURES``: the committed PNGs of ``docs/figures/``, drawn from the same data by
  ``make figures``).

Pages are Markdown (``notebook_page``): markdown cells as written, code cells as Python
blocks, text outputs as text blocks, pictures as PNG files beside the page, HTML tables as
they are. Widget views are left out (they need a kernel, and their JavaScript would be
fetched from a CDN); each chart widget's PNG stands in for it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CACHE = ROOT / "out" / "docs-notebooks"
GALLERY = ROOT / "docs" / "figures"
#: The gallery figures (docs/figures/<key>.png) each notebook draws, shown on its page when
#: no cached execution exists. A notebook missing here simply has none.
FIGURES = {
    "01_quickstart": ("agreement", "error_map"),
    "02_cluster_masks": ("f1_block_masks",),
    "03_head_roles": ("f4_head_roles",),
    "04_weight_maps": ("f2_weight_importance", "f3_weight_change"),
    "05_circuits": ("circuit",),
    "06_where_in_the_prompt": ("ioi_by_span", "causal_trace"),
}
WIDGET = "application/vnd.jupyter.widget-view+json"
#: Longest text output shown on a page, in lines (the rest is cut, and the cut is said).
MAX_TEXT_LINES = 40
#: The metadata key of a cached execution: the SHA-256 of the source notebook it ran.
SOURCE_KEY = "lenscape_source_sha256"


@dataclass
class Page:
    """A tutorial page: its Markdown and the pictures it links to.

    Attributes:
        markdown: the page's text.
        images: file name (beside the page, under ``<stem>_files/``) -> PNG bytes.
        executed: whether the outputs come from a cached execution.
    """

    markdown: str
    images: dict[str, bytes] = field(default_factory=dict)
    executed: bool = False


def source_sha256(path: Path) -> str:
    """The SHA-256 of a notebook's file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cached(path: Path) -> dict | None:
    """The cached execution of the notebook at ``path``, if one was made from it as it is."""
    copy = CACHE / path.name
    if not copy.is_file():
        return None
    nb = json.loads(copy.read_text())
    return nb if nb.get("metadata", {}).get(SOURCE_KEY) == source_sha256(path) else None


def _text(source: str | list[str]) -> str:
    return "".join(source) if isinstance(source, list) else source


def _fence(text: str, language: str) -> str:
    lines = text.rstrip("\n").splitlines()
    if len(lines) > MAX_TEXT_LINES:
        cut = len(lines) - MAX_TEXT_LINES
        lines = [*lines[:MAX_TEXT_LINES], f"... ({cut} more lines)"]
    ticks = "````" if any(line.startswith("```") for line in lines) else "```"
    return "\n".join([f"{ticks}{language}", *lines, ticks, ""])


def _output(out: dict, stem: str, name: str, page: Page) -> str:
    """One output of a code cell as Markdown ("" when nothing of it can be shown)."""
    kind = out.get("output_type")
    if kind == "stream":
        return _fence(_text(out.get("text", "")), "text")
    if kind == "error":
        return _fence("\n".join(out.get("traceback", [])), "text")
    data = {k: v for k, v in out.get("data", {}).items() if k != WIDGET}
    if "image/png" in data:
        page.images[name] = base64.b64decode(_text(data["image/png"]))
        return f"![output of the cell above]({stem}_files/{name})\n"
    html = _text(data.get("text/html", ""))
    if "<table" in html and "<script" not in html:
        return f'<div class="output-table" markdown="0">\n{html}\n</div>\n'
    if "text/plain" in data and WIDGET not in out.get("data", {}):
        return _fence(_text(data["text/plain"]), "text")
    return ""


def _figures(stem: str) -> str:
    keys = FIGURES.get(stem, ())
    if not keys:
        return ""
    images = " ".join(f"![{key}](../figures/{key}.png)" for key in keys)
    return (
        '!!! note "Figures"\n'
        "    This page shows the notebook without its outputs (no cached execution is at\n"
        "    hand: `make docs-notebooks` makes one). The figures it draws, from the gallery\n"
        "    (`make figures`, from the same data):\n\n"
        f"    {images}\n"
    )


def notebook_page(path: Path) -> Page:
    """The tutorial page of the notebook at ``path``."""
    stem = path.stem
    executed = cached(path)
    nb = executed or json.loads(path.read_text())
    page = Page("", executed=executed is not None)
    parts: list[str] = []
    for index, cell in enumerate(nb["cells"]):
        source = _text(cell.get("source", ""))
        if cell["cell_type"] == "markdown":
            parts.append(source.rstrip() + "\n")
            if index == 0 and executed is None:
                parts.append(_figures(stem))
        elif cell["cell_type"] == "code" and source.strip():
            parts.append(_fence(source, "python"))
            for number, out in enumerate(cell.get("outputs", [])):
                parts.append(_output(out, stem, f"cell{index}_{number}.png", page))
    how = (
        "Run from a cached execution of this notebook."
        if page.executed
        else "The notebook's cells; run it in JupyterLab (`make lab`) to see every output."
    )
    source_note = f"*Source: `notebooks/{path.name}`. {how}*\n"
    page.markdown = "\n".join(p for p in [*parts, source_note] if p)
    return page


def pages() -> dict[str, Page]:
    """Every notebook's page: path under the site's sources -> ``Page``."""
    return {f"tutorials/{p.stem}.md": notebook_page(p) for p in sorted(NOTEBOOKS.glob("*.ipynb"))}


def execute(names: list[str]) -> None:
    """Run the named notebooks (all when empty) and keep each, with its outputs, in
    ``CACHE``; ``LENSCAPE_CI=1`` in the environment picks their reduced settings."""
    import nbformat
    from nbclient import NotebookClient

    CACHE.mkdir(parents=True, exist_ok=True)
    folder = ROOT / "out" / "docs-notebooks-run" / "notebooks"
    folder.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if not names or p.stem in names]
    for path in chosen:
        nb = nbformat.read(path, as_version=4)
        print(f"executing {path.name} ...", flush=True)
        NotebookClient(
            nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
        ).execute()
        nb.metadata[SOURCE_KEY] = source_sha256(path)
        nb.metadata.pop("widgets", None)
        nbformat.write(nb, CACHE / path.name)


def main(argv: list[str] | None = None) -> int:
    """``--execute [NAME ...]`` fills the cache; without it, print which pages are cached."""
    cli = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cli.add_argument("--execute", nargs="*", metavar="NAME", help="notebook stems (all: none)")
    args = cli.parse_args(argv)
    if args.execute is not None:
        known = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
        unknown = sorted(set(args.execute) - known)
        if unknown:
            cli.error(f"unknown notebooks {unknown}; choose from {sorted(known)}.")
        execute(args.execute)
    for name, page in pages().items():
        print(f"{name}: {'cached execution' if page.executed else 'source only'}")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
