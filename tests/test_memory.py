"""Batch sizes and stacked variants chosen from free memory (``capture/memory.py``)."""

from __future__ import annotations

import numpy as np
import pytest

import lenscape as lsc
from lenscape.sweep import memory


def test_auto_batch_size_follows_free_memory(tiny_llama, monkeypatch):
    per_prompt = memory.bytes_per_sequence(tiny_llama, width=16, grad=True)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 0)
    assert memory.auto_batch_size(tiny_llama, width=16, grad=True) == 1
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(per_prompt * 5 / 0.25))
    assert memory.auto_batch_size(tiny_llama, width=16, grad=True) == 5
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**50)
    assert memory.auto_batch_size(tiny_llama, width=16, grad=True) == memory.MAX_BATCH["cpu"]
    # a pass that keeps a graph for backward needs more memory than one that does not
    assert per_prompt > memory.bytes_per_sequence(tiny_llama, width=16, grad=False)


def test_auto_sizes_give_the_same_numbers(tiny_llama, factual, monkeypatch):
    prompts = factual[:5]
    expected = lsc.ablation(tiny_llama, prompts, batch_size=5, progress=False)
    auto = lsc.ablation(tiny_llama, prompts, batch_size=None, progress=False)
    assert auto.attrs["batch_size"] == memory.auto_batch_size(tiny_llama, width=10, grad=False)
    np.testing.assert_allclose(auto.values, expected.values, atol=1e-5)
    # almost no memory: one prompt and one variant per pass, still the same numbers
    monkeypatch.setattr(memory, "free_bytes", lambda device: 0)
    tight = lsc.ablation(tiny_llama, prompts, batch_size=None, progress=False)
    assert tight.attrs["batch_size"] == 1
    np.testing.assert_allclose(tight.values, expected.values, atol=1e-5)


def test_bad_batch_size(tiny_llama, factual):
    # Out of range -> ValueError; not an integer at all -> TypeError (lenscape._validate).
    for bad, error in ((0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="batch_size must be a positive integer"):
            lsc.ablation(tiny_llama, factual[:2], batch_size=bad, progress=False)
