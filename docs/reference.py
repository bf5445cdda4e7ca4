"""The API reference of the documentation site, generated from the export tables.

Every public name of the documented modules gets an entry, so a name another engineer adds
to ``lenscape.__all__`` (or defines in ``lenscape.aggregate`` ...) appears in the reference
without anyone editing a page. The public names of a module:

- its ``__all__`` when it has one (``lenscape``: the registered methods, then ``_EXPORTS``);
- otherwise every name its own source binds at the top level (``def``, ``class`` or an
  assignment), not starting with ``_``: names it imports from elsewhere belong to the
  module that defines them.

Each entry is a mkdocstrings directive on the object's home (``lsc.open`` is
``lenscape.store.open_result``), headed by the name a user types. mkdocstrings renders the
signature and the Google-style docstring (the ``@method`` decorator's completed ``Args:``
included: the handler inspects the imported objects). A public name without a docstring is
an error (``undocumented``), which fails the strict build.

``python docs/reference.py`` prints the pages; ``tests/test_docs.py`` checks that every
public name has an entry.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import types
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The modules the reference documents, each on its own page (``reference/<page>.md``).
MODULES = {
    "lenscape": "lenscape",
    "lenscape.aggregate": "aggregate",
    "lenscape.data": "data",
    "lenscape.cluster": "cluster",
    "lenscape.schema": "schema",
}
#: How the top-level names are grouped on the ``lenscape`` page: by the package that
#: defines them (first match), in this order.
GROUPS = (
    ("lenscape.capture", "Per-prompt methods", "Each returns a validated DataArray or Dataset."),
    ("lenscape.models", "Models", "Load a model, describe a family, check a layout."),
    ("lenscape.fits", "Learned fits", "Head gating and block masks, with the model frozen."),
    ("lenscape.weights", "Weight maps", "Per weight matrix, from gradients or checkpoints."),
    ("lenscape.views", "Charts and widgets", "DataArray in, Altair chart or widget out."),
    ("lenscape", "Results and planning", "Save, open, estimate; and the documented modules."),
)


@dataclass(frozen=True)
class Entry:
    """One public name of a documented module.

    Attributes:
        module: the documented module (``"lenscape"``).
        name: the public name (``"open"``).
        target: the object's home, as mkdocstrings finds it (``"lenscape.store.open_result"``);
            for a documented submodule, the page it has (``"reference/data.md"``).
        kind: ``"function"``, ``"class"``, ``"module"`` or ``"constant"``.
        summary: the docstring's first line ("" when it has none).
    """

    module: str
    name: str
    target: str
    kind: str
    summary: str

    @property
    def shown(self) -> str:
        """The name as a user types it (``lsc.open``, ``lsc.aggregate.mean``)."""
        if self.module == "lenscape":
            return f"lsc.{self.name}"
        prefix = self.module.removeprefix("lenscape.")
        return f"lsc.{prefix}.{self.name}" if prefix != self.module else f"{prefix}.{self.name}"


def defined_names(module: types.ModuleType) -> list[str]:
    """The public names ``module``'s own source binds at its top level, in source order."""
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found = [node.name]
        elif isinstance(node, ast.Assign):
            found = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found = [node.target.id]
        else:
            found = []
        names += [n for n in found if not n.startswith("_") and n not in names]
    return names


def public_names(module_name: str) -> list[str]:
    """The public names of a documented module: ``__all__``, else what its source defines."""
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    return list(exported) if exported is not None else defined_names(module)


def _home(module_name: str, name: str, value: object) -> str:
    """Where mkdocstrings finds ``value``: its defining module and qualified name (a
    function or class), the module itself, or the documented module's attribute."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if (inspect.isclass(value) or inspect.isfunction(value)) and module and qualname:
        return f"{module}.{qualname}"
    return f"{module_name}.{name}"


def _kind(value: object) -> str:
    if isinstance(value, types.ModuleType):
        return "module"
    if inspect.isclass(value):
        return "class"
    if callable(value):
        return "function"
    return "constant"


def entries(module_name: str) -> list[Entry]:
    """One ``Entry`` per public name of ``module_name``, in its export order."""
    module = importlib.import_module(module_name)
    found = []
    for name in public_names(module_name):
        value = getattr(module, name)
        kind = _kind(value)
        doc = inspect.getdoc(value) if kind != "constant" else comment_above(module_name, name)
        target = _home(module_name, name, value)
        if kind == "module":
            target = f"reference/{MODULES[target]}.md" if target in MODULES else target
        found.append(Entry(module_name, name, target, kind, (doc or "").split("\n")[0]))
    return found


def undocumented(module_name: str) -> list[str]:
    """The public functions, classes and modules of ``module_name`` without a docstring."""
    return [e.shown for e in entries(module_name) if e.kind != "constant" and not e.summary]


def _group(entry: Entry) -> int:
    home = entry.target.replace("/", ".")
    for index, (package, _, _) in enumerate(GROUPS):
        if home.startswith(package + ".") or package == "lenscape":
            return index
    raise AssertionError("the last group takes every name")


def anchor(entry: Entry) -> str:
    """The id of an entry's heading on its page (mkdocstrings: the object's full path)."""
    return entry.name if entry.kind in ("constant", "module") else entry.target


def _directive(entry: Entry, level: int) -> str:
    """The mkdocstrings block that renders one entry under its user-facing name."""
    return "\n".join(
        [
            f"::: {entry.target}",
            "    options:",
            f'      heading: "{entry.shown}"',
            f'      toc_label: "{entry.name}"',
            f"      heading_level: {level}",
            "",
        ]
    )


def comment_above(module_name: str, name: str) -> str:
    """The ``#:`` comment lines right above ``name``'s top-level assignment, joined ("" if
    none): how lenscape documents a constant."""
    lines = Path(inspect.getfile(importlib.import_module(module_name))).read_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith((f"{name} =", f"{name}: ")):
            above = []
            for previous in reversed(lines[:index]):
                if not previous.startswith("#:"):
                    break
                above.insert(0, previous.removeprefix("#:").strip())
            return " ".join(above)
    return ""


def _constant(entry: Entry, level: int) -> str:
    value = getattr(importlib.import_module(entry.module), entry.name)
    doc = comment_above(entry.module, entry.name)
    text = repr(value)
    shown = text if len(text) <= 300 else text[:300] + " …"
    heading = "#" * level
    code = f"```python\n{entry.name} = {shown}\n```"
    return f"{heading} `{entry.shown}` {{ #{entry.name} }}\n\n{doc}\n\n{code}\n"


def _module_link(entry: Entry, level: int) -> str:
    """A documented submodule named in ``lenscape.__all__``: a pointer to its own page."""
    link = Path(entry.target).relative_to("reference").as_posix()
    heading = "#" * level
    return (
        f"{heading} `{entry.shown}` {{ #{entry.name} }}\n\n{entry.summary} "
        f"See [{entry.shown}]({link}).\n"
    )


def _entry_text(entry: Entry, level: int) -> str:
    if entry.kind == "constant":
        return _constant(entry, level)
    if entry.kind == "module" and entry.target.startswith("reference/"):
        return _module_link(entry, level)
    return _directive(entry, level)


def page(module_name: str) -> str:
    """The Markdown of the reference page of ``module_name``."""
    module = importlib.import_module(module_name)
    found = entries(module_name)
    intro = (inspect.getdoc(module) or "").strip()
    lines = [f"# `{module_name}`", "", intro, ""]
    lines += _summary_table(found)
    if module_name == "lenscape":
        for index, (_, title, blurb) in enumerate(GROUPS):
            members = [e for e in found if _group(e) == index]
            if members:
                lines += [f"## {title}", "", blurb, ""]
                lines += [_entry_text(e, 3) for e in members]
    else:
        lines += [_entry_text(e, 2) for e in found]
    return "\n".join(lines) + "\n"


def _summary_table(found: list[Entry]) -> list[str]:
    rows = ["| name | what it is |", "| --- | --- |"]
    for e in found:
        summary = (e.summary or "constant").replace("|", "\\|")
        rows.append(f"| [`{e.shown}`](#{anchor(e)}) | {summary} |")
    return [*rows, ""]


def pages() -> dict[str, str]:
    """Every reference page: its path under the site's sources -> its Markdown."""
    return {f"reference/{slug}.md": page(name) for name, slug in MODULES.items()}


if __name__ == "__main__":
    sys.stdout.write("\n\n".join(pages().values()))
