"""The warm server's children (``_warm.WarmPython``) stand in for fresh interpreters: the
tests that use them rely on that."""

from __future__ import annotations

import subprocess

import pytest

RANDOM_STATE = (
    "import random, numpy, torch; print(random.random(), numpy.random.rand(), torch.rand(1).item())"
)


def test_children_start_with_fresh_random_state_as_fresh_interpreters_do(warm_python):
    # each fresh interpreter seeds every global generator from the OS (torch's too, at the
    # locked version: torch.initial_seed() differs between processes); so does each child
    first, second = (warm_python.run(RANDOM_STATE).split() for _ in range(2))
    assert all(a != b for a, b in zip(first, second, strict=True)), (first, second)


def test_children_report_exit_codes_and_can_be_killed(warm_python):
    assert warm_python.popen("import sys; sys.exit(3)").wait(timeout=60) == 3
    failing = warm_python.popen("raise ValueError('named')")
    assert failing.wait(timeout=60) == 1 and "ValueError: named" in failing.communicate()[1]
    sleeping = warm_python.popen("import time; time.sleep(600)")
    with pytest.raises(subprocess.TimeoutExpired):
        sleeping.wait(timeout=0.2)
    sleeping.kill()
    assert sleeping.wait(timeout=60) == -9
    assert warm_python.run("import sys; print(sys.argv[1:])", "a", "b").strip() == "['a', 'b']"
