"""Error estimates of the fast maps (``attribution_patching(..., error=True)``) and exact
measurement only where they leave the answer in doubt (``refine="auto"``), on tiny models
(``capture/patching.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from _helpers import o_proj_module

import lenscape as lsc
from lenscape.capture import patching


@pytest.fixture(scope="module")
def pairs(factual):
    return factual[:4]


def _z_and_gradients(model, prompt, text):
    """One unpadded prompt's run on ``text`` by plain HF hooks: layer -> (pos, n_heads *
    d_head) o_proj input z, and layer -> d logit_diff(last token) / d z (the total
    derivative: later layers respond)."""
    tok = model.tokenizer
    ids = torch.tensor([tok(text)["input_ids"]])
    target = tok(prompt.target, add_special_tokens=False)["input_ids"][0]
    distractor = tok(prompt.distractor, add_special_tokens=False)["input_ids"][0]
    kept: dict[int, torch.Tensor] = {}
    handles = [
        o_proj_module(model, layer).register_forward_pre_hook(
            lambda module, args, layer=layer: kept.__setitem__(layer, args[0])
        )
        for layer in range(model.spec.n_layers)
    ]
    try:
        embeds = model.hf.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model.hf(inputs_embeds=embeds).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    layers = range(model.spec.n_layers)
    grads = torch.autograd.grad(logits[target] - logits[distractor], [kept[i] for i in layers])
    return {i: kept[i].detach()[0] for i in layers}, {i: grads[i][0] for i in layers}


def test_atp_error_is_the_trapezoid_correction_by_hand(tiny_llama, factual):
    """err = |1/2 sum_pos (g_clean - g_corrupt) . (z_clean - z_corrupt)| per head, from two
    gradients taken by plain hooks."""
    model, prompt = tiny_llama, factual[0]
    scores = lsc.attribution_patching(model, [prompt], error=True, progress=False)
    z_clean, g_clean = _z_and_gradients(model, prompt, prompt.text)
    z_corrupt, g_corrupt = _z_and_gradients(model, prompt, prompt.corrupt)
    d_head = model.spec.d_head
    expected = np.zeros((model.spec.n_layers, model.spec.n_heads))
    for layer in range(model.spec.n_layers):
        term = 0.5 * (g_clean[layer] - g_corrupt[layer]) * (z_clean[layer] - z_corrupt[layer])
        per_head = term.view(term.shape[0], model.spec.n_heads, d_head).sum((0, 2))
        expected[layer] = per_head.abs().double().numpy()
    got = scores["error"].values[0]
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-6)
    assert expected.max() > 1e-3  # the check compares something
    assert scores.attrs["error_method"] == "trapezoid"
    assert scores["error"].attrs["units"] == scores.attrs["units"]
    assert "one backward pass" in scores["error"].attrs["extra_passes"]
    # The estimate itself is unchanged by asking for its error.
    plain = lsc.attribution_patching(model, [prompt], progress=False)
    np.testing.assert_array_equal(scores.values, plain.values)
    # estimator="trapezoid" is AtP plus that correction: 1/2 (g_clean + g_corrupt) . delta.
    trapezoid = lsc.attribution_patching(model, [prompt], estimator="trapezoid", progress=False)
    for layer in range(model.spec.n_layers):
        term = 0.5 * (g_clean[layer] + g_corrupt[layer]) * (z_clean[layer] - z_corrupt[layer])
        per_head = term.view(term.shape[0], model.spec.n_heads, d_head).sum((0, 2))
        np.testing.assert_allclose(
            trapezoid.values[0, layer], per_head.double().numpy(), rtol=1e-3, atol=1e-6
        )


@pytest.mark.parametrize("estimator, steps", [("atp", None), ("ig", 3)])
@pytest.mark.parametrize("level", ["head", "block"])
def test_error_is_zero_where_the_metric_is_linear(
    linear_tail_model, pairs, estimator, steps, level
):
    """The last layer of ``linear_tail_model`` enters the metric linearly: there the
    estimates are exact and so their error estimate is 0; before it, they are not."""
    scores = lsc.attribution_patching(
        linear_tail_model,
        pairs,
        level=level,
        estimator=estimator,
        steps=steps,
        error=True,
        progress=False,
    )
    error = scores["error"]
    assert (error.values >= 0).all()
    # Products are float32 (of estimates of size ~30): zero up to float32 rounding.
    np.testing.assert_allclose(error.sel(layer=1).values, 0.0, atol=1e-4)
    assert error.sel(layer=0).values.max() > 1e-2


def test_ig_error_is_the_gap_to_the_coarse_rule(tiny_llama, pairs):
    """The even points of 4 are the 2-point rule: err(ig:4) = |ig:4 - ig:2|, free."""
    four = lsc.attribution_patching(
        tiny_llama, pairs, estimator="ig", steps=4, error=True, progress=False
    )
    two = lsc.attribution_patching(tiny_llama, pairs, estimator="ig", steps=2, progress=False)
    np.testing.assert_allclose(
        four["error"].values, np.abs(four.values - two.values), rtol=1e-4, atol=1e-5
    )
    assert four.attrs["error_method"] == "coarse-rule"
    assert four["error"].attrs["extra_passes"] == "none"


def test_relp_errors(tiny_llama, pairs):
    """Secant rules: the gap to AtP; RelP's rules: the trapezoid under the rules (>= 0,
    not the plain one)."""
    atp = lsc.attribution_patching(tiny_llama, pairs, level="block", error=True, progress=False)
    secant = lsc.attribution_patching(
        tiny_llama,
        pairs,
        level="block",
        estimator="relp",
        rules="secant",
        error=True,
        progress=False,
    )
    np.testing.assert_allclose(
        secant["error"].values, np.abs(secant.values - atp.values), rtol=1e-4, atol=1e-5
    )
    relp = lsc.attribution_patching(
        tiny_llama, pairs, level="block", estimator="relp", error=True, progress=False
    )
    assert relp.attrs["error_method"] == "trapezoid-rules"
    assert (relp["error"].values >= 0).all()
    assert not np.allclose(relp["error"].values, atp["error"].values, atol=1e-6)


# -------------------------------------------------------------------------- refine="auto"


def test_refine_auto_measures_the_cells_the_rule_picks(tiny_llama, factual):
    prompts = factual[:6]
    full = lsc.activation_patching(tiny_llama, prompts, progress=False)
    auto = lsc.activation_patching(tiny_llama, prompts, refine="auto", top=3, progress=False)
    estimate = lsc.attribution_patching(tiny_llama, prompts, error=True, progress=False)
    flat = (len(prompts), -1)
    cells, tol = patching.auto_cells(  # in float64, as the pre-pass keeps them
        estimate.values.reshape(flat).astype(np.float64),
        estimate["error"].values.reshape(flat).astype(np.float64),
        top=3,
    )
    measured = auto["measured"].values
    np.testing.assert_array_equal(measured, cells.reshape(measured.shape))
    assert 0 < measured.sum() < measured.size  # some measured, some not: the check bites
    # Measured cells equal a full exact sweep; the others keep the estimate and its error.
    np.testing.assert_allclose(auto.values[measured], full.values[measured], atol=1e-5)
    np.testing.assert_array_equal(auto.values[~measured], estimate.values[~measured])
    np.testing.assert_array_equal(
        auto["error"].values[~measured], estimate["error"].values[~measured]
    )
    assert (auto["error"].values[measured] == 0).all()
    assert auto.attrs["refine"] == "auto" and auto.attrs["refine_top"] == 3
    assert auto.attrs["refine_measured"] == measured.sum()
    assert auto.attrs["refine_cells"] == measured.size
    assert auto.attrs["refine_tol"] == pytest.approx(tol)
    # The exact top 3 by |prompt-mean| is recovered, with its exact values.
    exact_top = set(np.argsort(-np.abs(full.mean("prompt").values.ravel()))[:3])
    auto_top = set(np.argsort(-np.abs(auto.mean("prompt").values.ravel()))[:3])
    assert auto_top == exact_top
    assert measured.reshape(flat)[:, sorted(exact_top)].all()


def test_refine_auto_with_a_tolerance_of_everything_keeps_only_the_top(tiny_llama, pairs):
    auto = lsc.activation_patching(
        tiny_llama, pairs, refine="auto", tol=1e9, top=1, variants_per_pass=1, progress=False
    )
    measured = auto["measured"].values.reshape(len(pairs), -1)
    components = measured.any(0)
    assert (measured[:, components]).all()  # whole components, for the ranking
    assert 1 <= components.sum() < components.size
    assert auto.attrs["refine_tol"] == 1e9


def test_refine_auto_ablation_equals_the_full_sweep_where_measured(tiny_llama, pairs):
    full = lsc.ablation(tiny_llama, pairs, kind="mean", level="block", progress=False)
    auto = lsc.ablation(
        tiny_llama, pairs, kind="mean", level="block", refine="auto", top=2, progress=False
    )
    measured = auto["measured"].values
    assert measured.any()
    np.testing.assert_allclose(auto.values[measured], full.values[measured], atol=1e-5)
    assert auto.attrs["error_method"] == "trapezoid"
    assert np.isfinite(auto.values).all()


def test_error_and_auto_stream_into_a_store_as_in_memory(tiny_llama, factual, tmp_path):
    prompts = factual[:5]
    for function, options in (
        (lsc.attribution_patching, {"error": True}),
        (lsc.activation_patching, {"refine": "auto", "top": 2}),
    ):
        memory = function(tiny_llama, prompts, batch_size=2, progress=False, **options)
        stored = function(
            tiny_llama,
            prompts,
            batch_size=2,
            store=tmp_path / f"{function.__name__}.zarr",
            progress=False,
            **options,
        ).load()
        np.testing.assert_allclose(stored.values, memory.values, atol=1e-6)
        np.testing.assert_allclose(stored["error"].values, memory["error"].values, atol=1e-6)
        if "refine" in options:
            np.testing.assert_array_equal(stored["measured"].values, memory["measured"].values)
        for suffix in ("zarr", "nc"):  # and a saved result opens as it was
            path = lsc.save(memory, tmp_path / f"saved-{function.__name__}.{suffix}")
            xr.testing.assert_identical(lsc.open(path).load(), memory)
