"""Run every benchmark and write benchmarks/RESULTS.md from their sections (``make bench``).

A benchmark is every ``*.py`` beside this file whose name does not start with ``_`` (except
this one); it follows the protocol of ``_report.py`` (``--quick``, ``--markdown PATH``). Each
runs in its own process with ``--markdown`` into a temporary file while its output streams
here. RESULTS.md is then rewritten: a header with the date, machine and versions of this run,
and the sections in script-name order. Nothing in it is edited by hand; text outside the
``<!-- bench:NAME -->`` markers is not kept.

- ``--only a,b``: run those scripts; the other sections already in RESULTS.md are kept.
- ``--quick``: tiny sizes for a smoke check; prints only, RESULTS.md is left alone.
- ``--conditions TEXT``: what else ran on the machine; written at the end of every section
  this run writes (a timing means something only beside what ran with it).
- A failing script is reported and keeps its old section; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import _report

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
SECTION = re.compile(
    r"^<!-- bench:(?P<name>[\w.-]+) -->$.*?^<!-- /bench:(?P=name) -->$", re.MULTILINE | re.DOTALL
)


def scripts() -> dict[str, Path]:
    """Benchmark scripts beside this file, by stem, in name order."""
    return {
        path.stem: path
        for path in sorted(HERE.glob("*.py"))
        if not path.name.startswith("_") and path.name != Path(__file__).name
    }


def parse_sections(text: str) -> dict[str, str]:
    """The ``<!-- bench:NAME -->`` blocks of a RESULTS.md text, by NAME, markers included."""
    return {match["name"]: match[0] + "\n" for match in SECTION.finditer(text)}


def merge_sections(old_text: str, new_sections: dict[str, str]) -> dict[str, str]:
    """Old sections of ``old_text`` replaced or joined by ``new_sections``, in name order.

    Args:
        old_text: the current RESULTS.md ("" if none).
        new_sections: NAME -> section text from this run.

    Returns:
        NAME -> section text, sorted by NAME.
    """
    merged = {**parse_sections(old_text), **new_sections}
    return dict(sorted(merged.items()))


def header(info: dict) -> str:
    """Title and provenance of RESULTS.md, from ``_report.machine_info()``."""
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    return (
        "# Benchmark results\n\n"
        "Written by `make bench` (benchmarks/run_all.py); do not edit by hand. Each script\n"
        "beside this file writes its own section, and every table row carries the date and\n"
        "machine it was measured on; `python benchmarks/run_all.py --only NAME` reruns one\n"
        "script and keeps the other sections.\n\n"
        "Last written:\n\n"
        f"- date: {info['date']}\n"
        f"- machine: {info['machine']}\n"
        f"- versions: {versions}\n"
    )


def render(info: dict, sections: dict[str, str]) -> str:
    """The whole RESULTS.md: header, then the sections in the given order."""
    return "\n".join([header(info), *sections.values()])


def with_conditions(name: str, section: str, conditions: str) -> str:
    """``section`` with a closing line saying what else ran on the machine."""
    end = f"<!-- /bench:{name} -->"
    return section.replace(end, f"\nConditions of this run: {conditions}\n{end}")


def run(script: Path, quick: bool) -> str | None:
    """Run one script, streaming its output; its section, or None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{script.stem}.md"
        command = [sys.executable, str(script), "--markdown", str(out)]
        status = subprocess.run(command + (["--quick"] if quick else [])).returncode
        if status:
            print(f"{script.name} exited with status {status}", flush=True)
            return None
        found = parse_sections(out.read_text()) if out.exists() else {}
    if script.stem not in found:
        print(f"{script.name} wrote no <!-- bench:{script.stem} --> section", flush=True)
        return None
    return found[script.stem]


def main(argv: list[str] | None = None) -> int:
    available = scripts()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", default=None, help=f"comma-separated script names, of: {', '.join(available)}"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, smoke check only; RESULTS.md is not written",
    )
    parser.add_argument(
        "--conditions",
        default="not stated (make bench)",
        help="what else ran on the machine during this run, for every section it writes",
    )
    args = parser.parse_args(argv)
    names = list(available) if args.only is None else args.only.split(",")
    unknown = sorted(set(names) - set(available))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {list(available)}")
    new, failed = {}, []
    for name in names:
        print(f"\n=== {name}", flush=True)
        text = run(available[name], args.quick)
        if text is None:
            failed.append(name)
        else:
            new[name] = with_conditions(name, text, args.conditions)
    if failed:
        print(f"\nfailed (old sections kept): {', '.join(failed)}", flush=True)
    if args.quick:
        print("\n--quick: RESULTS.md not written", flush=True)
    else:
        old = RESULTS.read_text() if RESULTS.exists() else ""
        merged = merge_sections(old, new)
        kept = {name: text for name, text in merged.items() if name in available}
        RESULTS.write_text(render(_report.machine_info(), kept))
        print(f"\nwrote {RESULTS.relative_to(HERE.parent)}: {', '.join(kept)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
