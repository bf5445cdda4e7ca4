"""MkDocs hooks (``hooks:`` in mkdocs.yml): the generated parts of the documentation site.

The hand-written pages live in ``docs/site/``. These hooks add, in memory (nothing is
written into the source tree):

- ``reference/*.md``: one page per documented module, from its export table
  (``docs/reference.py``); a public name without a docstring fails the build;
- ``tutorials/*.md`` and their pictures: one page per notebook (``docs/tutorials.py``);
- ``figures/*.png``: the gallery, ``docs/figures/`` as committed;

and put the generated pages into the navigation, so a new notebook or module page needs no
edit of mkdocs.yml.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS))

import reference  # noqa: E402  (beside this file, found through the path above)
import tutorials  # noqa: E402

log = logging.getLogger("mkdocs.plugins.lenscape")


def _section(nav: list, title: str) -> list:
    for item in nav:
        if isinstance(item, dict) and title in item:
            return item[title]
    raise ValueError(f"mkdocs.yml's nav has no {title!r} section; add '- {title}: [...]'.")


def on_config(config):
    """Add every tutorial and reference page to the navigation."""
    nav = config["nav"]
    tutorial_section = _section(nav, "Tutorials")
    for path in sorted(tutorials.NOTEBOOKS.glob("*.ipynb")):
        entry = f"tutorials/{path.stem}.md"
        if entry not in tutorial_section:
            tutorial_section.append(entry)
    reference_section = _section(nav, "Reference")
    for slug in reference.MODULES.values():
        entry = f"reference/{slug}.md"
        if entry not in reference_section:
            reference_section.append(entry)
    return config


def _add(files: Files, config, uri: str, content: str | bytes) -> None:
    files.append(File.generated(config, uri, content=content))


def on_files(files: Files, config) -> Files:
    """The generated pages and pictures, added to the site's files."""
    for module in reference.MODULES:
        for name in reference.undocumented(module):
            log.warning("%s has no docstring: every public name needs one for its reference", name)
    for uri, text in reference.pages().items():
        _add(files, config, uri, text)
    for uri, page in tutorials.pages().items():
        _add(files, config, uri, page.markdown)
        folder = uri.removesuffix(".md") + "_files"
        for name, data in page.images.items():
            _add(files, config, f"{folder}/{name}", data)
    for png in sorted(tutorials.GALLERY.glob("*.png")):
        _add(files, config, f"figures/{png.name}", png.read_bytes())
    return files
