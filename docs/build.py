"""Build the documentation site offline, in strict mode (``make docs``).

    python docs/build.py [--out site]

Runs ``mkdocs build --strict`` on mkdocs.yml: a warning (a broken link or anchor, a page
missing, a public name without a docstring) fails the build. Without the docs extra it
says what to install instead of failing on an import. Prints the build time and the pages
built. ``tests/test_site.py`` builds the site the same way (``build``) in ``make test``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The import names the build needs, and the packages (pyproject's ``docs`` extra) they
#: come from.
NEEDED = {
    "mkdocs": "mkdocs",
    "material": "mkdocs-material",
    "mkdocstrings": "mkdocstrings",
    "mkdocstrings_handlers.python": "mkdocstrings-python",
}


def missing() -> list[str]:
    """The docs packages this Python lacks."""
    absent = []
    for module, package in NEEDED.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package of a dotted name is absent
            found = False
        if not found:
            absent.append(package)
    return absent


def install_hint(absent: list[str]) -> str:
    """One sentence saying what to install for the docs build."""
    return (
        f"the documentation build needs {', '.join(absent)} (the docs extra), which this "
        f"Python ({sys.executable}) lacks; install it with `make install` (it installs the "
        "docs extra), or `pip install -c constraints.txt -e '.[docs]'`."
    )


def build(out: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` into ``out``; the completed process (output captured).

    Raises:
        RuntimeError: the docs packages are not installed (the message says what to install).
    """
    absent = missing()
    if absent:
        raise RuntimeError(install_hint(absent))
    # The Material theme prints a notice about its successor on every build; said once in
    # docs/architecture.md ("Documentation site") instead.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    return subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def main(argv: list[str] | None = None) -> int:
    """Build the site; exit 1 on a failed build, 2 without the docs packages."""
    cli = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cli.add_argument("--out", type=Path, default=ROOT / "site", help="output folder")
    args = cli.parse_args(argv)
    start = time.perf_counter()
    try:
        done = build(args.out.resolve())
    except RuntimeError as err:
        print(f"make docs: {err}", file=sys.stderr)
        return 2
    took = time.perf_counter() - start
    sys.stderr.write(done.stdout + done.stderr)
    if done.returncode != 0:
        print(f"make docs: the strict build failed after {took:.0f} s (above).", file=sys.stderr)
        return 1
    pages = sorted(p.relative_to(args.out).as_posix() for p in args.out.rglob("*.html"))
    print(f"built {len(pages)} pages into {args.out} in {took:.1f} s: open index.html there.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
