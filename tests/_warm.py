"""Processes of their own without paying the imports: a warm server forks them.

Tests that kill a run mid-way, hold a store's lock from another process or compare two
processes need a process of their own; a fresh interpreter spends ~8-15 s importing torch,
transformers, nnsight and lenscape before it does anything. ``WarmPython`` starts one server
per test session (per pytest-xdist worker) that imports those once and then ``fork``s a child
per request: the child starts from the state a fresh interpreter reaches after the same
imports, having computed nothing. Python's, NumPy's and torch's global random generators are
reseeded from the OS in each child, as a fresh interpreter's are, so a result that depends on
unseeded random state still differs between children as it would between fresh processes.

Not for checks of what an import loads, or of a copy of the package: those need a fresh
interpreter (``_helpers.fresh_python``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

#: The server: imports, then for each request (a JSON line on stdin) forks a child that runs
#: its code with its argv and its stdout and stderr in files, answers "pid N" at once and
#: "exit N CODE" when that child ends; several children may run at once (a store's two
#: writers).
SERVER = textwrap.dedent("""
    import json, os, random, select, sys, traceback
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import torch
    import nnsight  # noqa: F401
    import lenscape as lsc
    for name in lsc.__all__:
        getattr(lsc, name)
    import _helpers  # noqa: F401

    def child(request):
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        random.seed()
        np.random.seed()
        torch.seed()
        os.environ.update(request["env"])
        sys.argv = ["-c", *request["argv"]]
        code = 0
        try:
            exec(compile(request["code"], "<warm child>", "exec"), {"__name__": "__main__"})
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    print("ready", flush=True)
    pending, running, open_ = b"", set(), True
    while open_ or running:
        if open_ and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 65536)
            open_ = bool(chunk)
            pending += chunk
            while b"\\n" in pending:
                line, pending = pending.split(b"\\n", 1)
                pid = os.fork()
                if pid == 0:
                    child(json.loads(line))
                running.add(pid)
                print("pid", pid, flush=True)
        elif not open_:
            select.select([], [], [], 0.02)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)
""")


class WarmChild:
    """One forked child, read like a ``subprocess.Popen``: ``pid``, ``poll``, ``wait``,
    ``kill``, ``communicate`` (its stdout and stderr, as text, once it has ended)."""

    def __init__(self, server: WarmPython, pid: int, stdout: Path, stderr: Path) -> None:
        self.server, self.pid, self.stdout_path, self.stderr_path = server, pid, stdout, stderr

    @property
    def returncode(self) -> int | None:
        return self.server.exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.server.changed:
            while self.returncode is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout)
                assert self.server.alive, f"the warm server ended: {self.server.tail()}"
                self.server.changed.wait(left if left is not None else 1.0)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout_path.read_text(), self.stderr_path.read_text()


class WarmPython:
    """The warm server of one test session (see the module docstring)."""

    def __init__(self, folder: Path, tests: Path) -> None:
        self.folder = folder
        self.log = folder / "server.log"
        self.server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(tests)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
            start_new_session=True,  # its own process group, with the children it forks
        )
        self.exits: dict[int, int] = {}
        self.pids: list[int] = []
        self.alive = True
        self.changed = threading.Condition()
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.ready.wait(600) and self.alive, f"the warm server did not start: {self.tail()}"

    def _read(self) -> None:
        for line in self.server.stdout:
            word, *numbers = line.split()
            with self.changed:
                if word == "ready":
                    self.ready.set()
                elif word == "pid":
                    self.pids.append(int(numbers[0]))
                elif word == "exit":
                    self.exits[int(numbers[0])] = int(numbers[1])
                self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.ready.set()
            self.changed.notify_all()

    def tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.strip().splitlines()[-20:]) or "no output"

    def popen(self, code: str, *argv: str, env: dict[str, str] | None = None) -> WarmChild:
        """Fork a child that runs ``code`` with ``sys.argv[1:] == argv`` (and ``env`` added to
        its ``os.environ``); returns at once."""
        fd, stdout = tempfile.mkstemp(dir=self.folder, suffix=".out")
        os.close(fd)
        stderr = Path(stdout).with_suffix(".err")
        request = dict(code=code, argv=list(argv), env=env or {}, stdout=stdout, stderr=str(stderr))
        with self.changed:
            known = len(self.pids)
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            while len(self.pids) == known:
                assert self.alive, f"the warm server ended: {self.tail()}"
                self.changed.wait(1.0)
            pid = self.pids[known]
        return WarmChild(self, pid, Path(stdout), stderr)

    def run(self, code: str, *argv: str, timeout: float = 600) -> str:
        """Run ``code`` in a forked child to its end; returns its stdout (a failing child fails
        the test with its stderr)."""
        child = self.popen(code, *argv)
        try:
            stdout, stderr = child.communicate(timeout)
        finally:
            child.kill()
        assert child.returncode == 0, stderr[-3000:]
        return stdout

    def close(self) -> None:
        """End the server and any child a test left running (its own process group): nothing
        of it is needed any more, so it is not left to unwind torch at exit."""
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()
