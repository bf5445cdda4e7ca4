"""Run every benchmark script in this folder and print their reports (``make bench``).

Measured numbers are copied by hand into benchmarks/RESULTS.md with date and machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    failed = []
    for script in sorted(HERE.glob("*.py")):
        if script.name == Path(__file__).name:
            continue
        print(f"\n=== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script)]).returncode:
            failed.append(script.name)
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
