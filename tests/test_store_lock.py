"""One writer per store (issue 15, group 3): a second writer fails at once naming the first,
the first finishes as if alone, and a dead writer's lock does not block resuming."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import xarray as xr
from _helpers import TESTS

import lenscape as lsc
from lenscape import store
from lenscape.store import StoreError

N_PROMPTS, BATCH = 6, 2

#: A capture of the tiny Llama (as the ``tiny_llama`` fixture builds it) into argv[1].
#: argv[2] ("hold:FILE" or "start:FILE"): stop before the second batch until FILE exists,
#: holding the store's lock with one batch written; or start only once FILE exists (so
#: imports overlap with the first writer's run).
WRITER = textwrap.dedent(f"""
    import pathlib, sys, time
    sys.path.insert(0, {TESTS!r})
    import lenscape as lsc
    from lenscape import models
    from lenscape.capture import streaming
    from _helpers import small_tokenizer

    model = models.tiny("llama", n_layers=3, seed=0, tokenizer=small_tokenizer())
    prompts = lsc.data.prompts("factual")[:{N_PROMPTS}]
    mode, _, file = sys.argv[2].partition(":")
    file = pathlib.Path(file)
    while mode == "start" and not file.exists():
        time.sleep(0.05)
    if mode == "hold":
        gate, write_batch = file, streaming.write_batch

        def gated(plan, number, path, step=lambda *_: None):
            while number == 1 and not gate.exists():
                time.sleep(0.05)
            write_batch(plan, number, path, step)
        streaming.write_batch = gated
    started = time.monotonic()
    try:
        lsc.capture_to(sys.argv[1], "ablation", model, prompts, batch_size={BATCH},
                       progress=False)
    except lsc.store.StoreError as err:
        print("REFUSED", round(time.monotonic() - started, 3), err, flush=True)
        sys.exit(3)
""")


def _capture(model, factual, path):
    return lsc.capture_to(
        path, "ablation", model, factual[:N_PROMPTS], batch_size=BATCH, progress=False
    )


def _lock_file(path):
    return path.with_name(path.name + ".lock")


def _wait_until_gated(child, path):
    """Wait until ``child`` holds the lock of ``path`` with its first batch written."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert child.poll() is None, "the first writer exited early"
        try:
            owner = json.loads(_lock_file(path).read_text())
            if owner["pid"] == child.pid and store.progress(path)[1].sum() >= BATCH:
                return owner
        except (OSError, ValueError, KeyError):  # not created or being written yet
            pass
        time.sleep(0.05)
    pytest.fail("the first writer did not get to its second batch in 300 s")


def _start(path, mode, file):
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), f"{mode}:{file}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_second_writer_fails_fast_and_first_finishes(tiny_llama, factual, tmp_path):
    path, gate, start = tmp_path / "r.zarr", tmp_path / "go", tmp_path / "start"
    first, second = _start(path, "hold", gate), _start(path, "start", start)
    try:
        owner = _wait_until_gated(first, path)
        assert owner["host"] == socket.gethostname()
        start.touch()
        stdout, stderr = second.communicate(timeout=300)
        assert second.returncode == 3, stderr[-2000:]
        seconds, message = stdout.split(maxsplit=2)[1:]
        assert float(seconds) < 5, f"the second writer took {seconds} s to fail"
        assert (
            f"'{path}' is being written by another process (pid {first.pid} on host "
            f"{socket.gethostname()}, since " in message
        )
        assert "wait for it to finish, or write to another path" in message
        gate.touch()
        assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    finally:
        for child in (first, second):
            if child.poll() is None:
                child.kill()
    assert not _lock_file(path).exists()
    alone = _capture(tiny_llama, factual, tmp_path / "alone.zarr")
    xr.testing.assert_identical(lsc.open(path), alone.compute())


def test_writer_killed_holding_the_lock_is_resumed(tiny_llama, factual, tmp_path):
    path = tmp_path / "r.zarr"
    first = _start(path, "hold", tmp_path / "never")
    try:
        _wait_until_gated(first, path)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
    assert json.loads(_lock_file(path).read_text())["pid"] == first.pid  # a stale lock file
    assert store.progress(path)[1].sum() == BATCH
    resumed = _capture(tiny_llama, factual, path)
    alone = _capture(tiny_llama, factual, tmp_path / "alone.zarr")
    xr.testing.assert_identical(resumed.compute(), alone.compute())
    assert not _lock_file(path).exists()


def test_lock_held_in_this_process_refuses_other_writers(tiny_llama, factual, tmp_path):
    path = tmp_path / "r.zarr"
    scores = _capture(tiny_llama, factual, path).compute()
    with store.writer_lock(path):
        with pytest.raises(
            StoreError,
            match=rf"'{re.escape(str(path))}' is being written by "
            r"another process "
            rf"\(pid {os.getpid()} on host ",
        ):
            _capture(tiny_llama, factual, path)
        with pytest.raises(StoreError, match="is being written by another process"):
            lsc.save(scores, path)
    lsc.save(scores, path)  # released
    xr.testing.assert_identical(lsc.open(path), scores)


def test_stale_lock_file_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "r.nc"
    _lock_file(path).write_text(
        json.dumps(
            {"pid": dead.pid, "host": socket.gethostname(), "since": "2026-01-01 00:00:00 UTC"}
        )
    )
    scores = xr.DataArray([1.0, 2.0], dims=("layer",), coords={"layer": [0, 1]})
    lsc.save(scores, path)
    xr.testing.assert_identical(lsc.open(path), scores)
    assert not _lock_file(path).exists()


def test_file_system_without_locks_warns(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(store.fcntl, "flock", no_locks)
    scores = xr.DataArray([1.0, 2.0], dims=("layer",), coords={"layer": [0, 1]})
    with pytest.warns(UserWarning, match="does not support locks.*run one writer only"):
        lsc.save(scores, tmp_path / "r.zarr")
    xr.testing.assert_identical(lsc.open(tmp_path / "r.zarr"), scores)
