"""The numbers docs/architecture.md shows about the code, computed from the code.

``python docs/layout.py`` prints the generated parts of docs/architecture.md; ``--write``
puts them into it between their ``<!-- layout:NAME -->`` markers; ``--check`` exits 1 when
the file differs from what the code gives (``tests/test_docs.py`` runs it). The parts:

- ``tree``: lines per folder of the package and each folder's share (top level included);
- ``long``: functions with more than ``LIMIT`` lines of code (docstrings, comments and
  blank lines aside), each with the reason written above it (a ``# long: ...`` comment);
- ``methods``: the registered per-prompt methods (``lenscape.sweep.registry.listing``).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "toolkit" / "lenscape"
DOC = ROOT / "docs" / "architecture.md"
#: Most lines of code a function may have without a reason given.
LIMIT = 60
MARKER = re.compile(r"(<!-- layout:(\w+) -->\n)(?:.*?\n)?(<!-- /layout:\2 -->)", re.DOTALL)


def code_lines(source: str) -> set[int]:
    """Line numbers of ``source`` that hold code: not blank, not only a comment, not in a
    docstring."""
    lines: set[int] = set()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def long_functions(limit: int = LIMIT) -> list[tuple[str, str, int, str]]:
    """(file, function, lines of code, reason) of every function over ``limit`` lines; the
    reason is a ``# long: ...`` comment on the line above its ``def`` (or decorator), "" if
    none is given."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        code, text = code_lines(source), source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                count = len(code.intersection(span))
                if count > limit:
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    above = text[first - 2].strip() if first >= 2 else ""
                    reason = (
                        above.removeprefix("# long:").strip() if above.startswith("# long:") else ""
                    )
                    found.append((path.relative_to(PACKAGE).as_posix(), node.name, count, reason))
    return found


def tree_table() -> str:
    """Markdown: lines (all, as in ``wc -l``) per folder of the package and their share."""
    counts: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        folder = "top level" if len(parts) == 1 else f"{parts[0]}/"
        counts[folder] = counts.get(folder, 0) + len(path.read_text().splitlines())
    total = sum(counts.values())
    rows = ["| folder | lines | share |", "| --- | --- | --- |"]
    for folder, count in sorted(counts.items(), key=lambda item: -item[1]):
        rows.append(f"| {folder} | {count:,} | {count / total:.0%} |")
    rows.append(f"| all | {total:,} | 100% |")
    return "\n".join(rows)


def long_table() -> str:
    rows = [
        f"Functions over {LIMIT} lines of code: {len(long_functions())}.",
        "",
        "| file | function | lines of code | why |",
        "| --- | --- | --- | --- |",
    ]
    rows += [f"| {f} | `{name}` | {n} | {why or '-'} |" for f, name, n, why in long_functions()]
    return "\n".join(rows)


def methods_table() -> str:
    sys.path.insert(0, str(ROOT / "toolkit"))
    from lenscape.capture import METHODS  # noqa: F401  registers every method
    from lenscape.sweep.registry import listing

    rows = listing()
    keys = list(rows[0])
    return "\n".join(
        [
            "| " + " | ".join(keys) + " |",
            "| " + " | ".join("---" for _ in keys) + " |",
            *("| " + " | ".join(row[k] for k in keys) + " |" for row in rows),
        ]
    )


PARTS = {"tree": tree_table, "long": long_table, "methods": methods_table}


def rendered(text: str) -> str:
    """``text`` (docs/architecture.md) with every marked part regenerated."""
    return MARKER.sub(lambda m: m[1] + PARTS[m[2]]() + "\n" + m[3], text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update docs/architecture.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if it is out of date")
    args = parser.parse_args()
    text = DOC.read_text()
    new = rendered(text)
    if args.write:
        DOC.write_text(new)
    elif args.check:
        if new != text:
            print("docs/architecture.md is out of date: run python docs/layout.py --write")
            return 1
    else:
        for name, part in PARTS.items():
            print(f"## {name}\n{part()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
