"""Causal head gating on tiny models: shapes, determinism, the causal check, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lenscape as lsc


@pytest.fixture(scope="module")
def small_task():
    return lsc.data.task("syntax")[:24]


@pytest.fixture(scope="module")
def fitted(tiny_llama, small_task):
    return lsc.head_gating(tiny_llama, small_task, seeds=2, steps=4, batch_size=3, progress=False)


def test_dataset_layout_and_scores(fitted, tiny_llama):
    spec = tiny_llama.spec
    assert fitted["facilitation"].dims == ("seed", "layer", "head")
    assert fitted["facilitation"].shape == (2, spec.n_layers, spec.n_heads)
    np.testing.assert_allclose(fitted["facilitation"], fitted["gate_minus"])
    np.testing.assert_allclose(fitted["interference"], 1 - fitted["gate_plus"])
    np.testing.assert_allclose(fitted["irrelevance"],
                               fitted["gate_plus"] * (1 - fitted["gate_minus"]), atol=1e-6)
    assert ((fitted["gate"] >= 0) & (fitted["gate"] <= 1)).all()
    assert fitted.attrs["n_seeds"] == 2 and fitted.attrs["lambda_"] == 0.1
    for name in ("facilitation", "interference"):
        lsc.schema.validate(fitted[name])


def test_same_seed_same_gates(fitted, tiny_llama, small_task):
    again = lsc.head_gating(tiny_llama, small_task, seeds=2, steps=4, batch_size=3,
                            progress=False)
    np.testing.assert_array_equal(fitted["gate"].values, again["gate"].values)
    other = lsc.head_gating(tiny_llama, small_task, seeds=[5, 6], steps=4, batch_size=3,
                            progress=False)
    assert not np.allclose(fitted["gate"].values, other["gate"].values)


def test_validation_loss_matches_task_loss(fitted, tiny_llama, small_task):
    gates = torch.as_tensor(fitted["gate_plus"].values)
    losses = lsc.task_loss(tiny_llama, small_task, gates)
    np.testing.assert_allclose(losses.numpy(), fitted["val_loss_plus"].values, rtol=1e-5)
    ungated = lsc.task_loss(tiny_llama, small_task)
    assert float(ungated[0]) == pytest.approx(fitted.attrs["val_loss_ungated"], rel=1e-5)


def test_zero_gate_equals_zeroed_head(tiny_llama, small_task):
    """A gate of 0 removes exactly the head's output: same loss as zeroing its o_proj input."""
    spec = tiny_llama.spec
    gates = torch.ones(1, spec.n_layers, spec.n_heads)
    gates[0, 1, 2] = 0
    gated = float(lsc.task_loss(tiny_llama, small_task[:4], gates)[0])
    o_proj = tiny_llama.hf.model.layers[1].self_attn.o_proj

    def zero(module, args):
        z = args[0].clone()
        z[..., 2 * spec.d_head:3 * spec.d_head] = 0
        return (z,)
    handle = o_proj.register_forward_pre_hook(zero)
    try:
        zeroed = float(lsc.task_loss(tiny_llama, small_task[:4])[0])
    finally:
        handle.remove()
    assert gated == pytest.approx(zeroed, rel=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"seeds": 0}, "seeds must be at least 1"),
    ({"seeds": []}, "seeds must be at least 1"),
    ({"lambda_": -0.1}, "lambda_ must be >= 0"),
])
def test_bad_settings(tiny_llama, small_task, kwargs, message):
    with pytest.raises(ValueError, match=message):
        lsc.head_gating(tiny_llama, small_task, progress=False, **kwargs)


def test_empty_targets_and_task(tiny_llama):
    with pytest.raises(ValueError, match="empty target"):
        lsc.head_gating(tiny_llama, [{"text": "2 + 2 =", "target": " "}], progress=False)
    with pytest.raises(ValueError, match="no prompts"):
        lsc.head_gating(tiny_llama, [], progress=False)


def test_bad_gate_shape(tiny_llama, small_task):
    with pytest.raises(ValueError, match="gates must have shape"):
        lsc.task_loss(tiny_llama, small_task, torch.ones(1, 2, 2))
