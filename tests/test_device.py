"""Every method on the ``device`` fixture's device (CUDA when available) against the CPU.

Marked ``device``: ``benchmarks/gpu_check.py`` runs these on a GPU; without one they run
on the CPU, where both sides are the same device (they then check that a model moved with
``from_hf(..., device=...)`` runs every method and gives the same numbers). Tolerance:
1e-4 of the largest value (float32 runs on two devices differ in reduction order).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

import lenscape as lsc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _shapes
import scale_ladder

pytestmark = pytest.mark.device

#: method -> (function, options) run on both devices
CALLS = {
    "atp_heads": ("attribution_patching", dict(level="head")),
    "atp_blocks": ("attribution_patching", dict(level="block")),
    "ablation_refine": ("ablation", dict(level="head", refine=4)),
    "eap": ("edge_attribution", dict(per_prompt=True)),
    "logit_lens": ("logit_lens", dict()),
    "dla": ("direct_logit_attribution", dict()),
    "weight_importance": ("weight_importance", dict()),
    "head_gating": ("head_gating", dict(seeds=1, max_steps=3, window=3, batch_size=4)),
}


@pytest.fixture(scope="module")
def on_device(tiny_llama, device):
    """``tiny_llama``'s weights, copied to ``device``."""
    hf = copy.deepcopy(tiny_llama.hf)
    return lsc.from_hf(hf, tiny_llama.tokenizer, name=tiny_llama.name, device=device)


def _values(result) -> np.ndarray:
    """Every number of a result (a Dataset's variables one after the other)."""
    if isinstance(result, xr.Dataset):
        return np.concatenate([_values(result[name]) for name in sorted(result.data_vars)])
    return np.asarray(result.values, dtype=np.float64).ravel()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_device_gives_the_cpus_numbers(tiny_llama, on_device, factual, name):
    function, options = CALLS[name]
    progress = {} if function == "logit_lens" else {"progress": False}
    prompts = factual[:4]
    cpu = getattr(lsc, function)(tiny_llama, prompts, **options, **progress)
    there = getattr(lsc, function)(on_device, prompts, **options, **progress)
    expected, got = _values(cpu), _values(there)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(finite, np.isfinite(got))
    scale = np.abs(expected[finite]).max()
    np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=1e-4 * scale)


def test_block_masks_give_the_cpus_numbers(tiny_llama, on_device, mixed, clusters):
    options = dict(clusters=clusters, max_steps=3, window=3, progress=False)
    cpu = lsc.block_masks(tiny_llama, mixed, **options)
    there = lsc.block_masks(on_device, mixed, **options)
    np.testing.assert_allclose(there["keep_prob"], cpu["keep_prob"], rtol=0, atol=1e-4)


def test_the_estimate_is_near_the_peak_allocated_on_a_gpu(device):
    """On a GPU, ``torch.cuda.max_memory_allocated`` over each ladder method on a small
    Llama shape (8 prompts of 64 tokens) is within 25% of the estimate plus 16 MiB."""
    if device.type != "cuda":
        pytest.skip("a GPU measurement; on CPU tests/test_memory.py measures fresh processes")
    model = _shapes.build("llama-tiny", device=str(device))
    weights = torch.cuda.memory_allocated(device)
    for method in scale_ladder.METHODS:
        if method in scale_ladder.FLOOR:
            continue
        spec = dict(sweep="test", rung="llama-tiny", method=method, device=str(device))
        spec |= dict(prompts=8, length=64, batch=8, refine=4, threads=1, repeats=1)
        row = scale_ladder.measure_on(model, weights, spec)
        assert "error" not in row, row
        predicted = row["predicted_activations"] + row["predicted_buffers"]
        predicted += row["predicted_optimizer"]
        assert abs(row["needed"] - predicted) <= 0.25 * predicted + 16 * 2**20, row
