"""Causal tracing (``capture/tracing.py``): ROME's invariants, a hand computation of one
cell, the checks before any pass, and what batching, padding and the seed never change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers import _hidden_of, _replace_hidden

import lenscape as lsc
from lenscape.capture.tracing import window_layers
from lenscape.data import Prompt


@pytest.fixture(scope="module")
def facts(factual):
    return factual[:3]


def test_restoring_the_embeddings_of_every_subject_token_gives_the_clean_run(tiny_llama, facts):
    trace = lsc.causal_trace(tiny_llama, facts, positions="spans", samples=3, progress=False)
    restored_all = trace.sel(layer=0, span="subject")
    np.testing.assert_allclose(restored_all.values, trace["total_effect"].values, atol=1e-6)
    assert (trace["total_effect"] != 0).all()  # the noise does change the answer's p


def test_with_no_noise_every_effect_is_zero(tiny_llama, facts):
    for kind in ("resid", "mlp", "attn"):
        trace = lsc.causal_trace(tiny_llama, facts, kind=kind, noise=0, samples=2, progress=False)
        finite = trace.values[np.isfinite(trace.values)]
        assert finite.size and np.abs(finite).max() < 1e-6
        assert np.abs(trace["total_effect"].values).max() < 1e-6


def test_one_cell_equals_a_hand_computation(tiny_llama, facts):
    """Noise drawn as the method draws it, added to the subject's embeddings by a plain
    pre-hook on block 0, the clean MLP outputs of a window put back at one token by forward
    hooks: p(target) averaged over the copies, minus the noised runs' mean."""
    samples, seed, layer, pos = 3, 5, 1, 2
    trace = lsc.causal_trace(
        tiny_llama, facts, kind="mlp", window=2, samples=samples, seed=seed, progress=False
    )
    hf, tok, p = tiny_llama.hf, tiny_llama.tokenizer, facts[0]
    ids = torch.tensor([tok(p.text)["input_ids"]])
    target = tok(p.target, add_special_tokens=False)["input_ids"][0]
    subject = [
        i
        for i, (a, b) in enumerate(tok(p.text, return_offsets_mapping=True)["offset_mapping"])
        if b > a and a < p.spans["subject"][1] and p.spans["subject"][0] < b
    ]
    blocks = hf.model.layers
    with torch.no_grad():
        clean_mlp = {}
        handles = [
            blocks[i].mlp.register_forward_hook(
                lambda m, a, out, i=i: clean_mlp.__setitem__(i, out.clone())
            )
            for i in range(len(blocks))
        ]
        hf(ids)
        for handle in handles:
            handle.remove()
        embedded = hf.model.embed_tokens(ids)
    std = trace.attrs["embedding_std"]
    state = np.random.SeedSequence([seed, 0]).generate_state(1)[0]
    draw = torch.randn(
        (samples, len(subject), embedded.shape[-1]),
        generator=torch.Generator().manual_seed(int(state)),
        dtype=torch.float64,
    )

    def p_target(copy, restore):
        noise = torch.zeros_like(embedded[0], dtype=torch.float64)
        noise[subject] = 3.0 * std * draw[copy]
        handles = [
            blocks[0].register_forward_pre_hook(
                lambda m, a, k: _replace_hidden(a, k, _hidden_of(a, k) + noise.to(embedded.dtype)),
                with_kwargs=True,
            )
        ]
        for i in window_layers("mlp", layer, 2, len(blocks)) if restore else []:

            def put_back(m, a, out, i=i):
                out = out.clone()
                out[0, pos] = clean_mlp[i][0, pos]
                return out

            handles.append(blocks[i].mlp.register_forward_hook(put_back))
        try:
            with torch.no_grad():
                logits = hf(ids).logits[0, -1]
        finally:
            for handle in handles:
                handle.remove()
        return float(torch.softmax(logits.float(), -1)[target])

    noised = np.mean([p_target(c, False) for c in range(samples)])
    restored = np.mean([p_target(c, True) for c in range(samples)])
    assert trace["noised_prob"].values[0] == pytest.approx(noised, abs=1e-6)
    assert trace.isel(prompt=0).sel(layer=layer, pos=pos).item() == pytest.approx(
        restored - noised, abs=1e-6
    )


def test_seed_batching_and_padding_change_nothing_but_the_seed(tiny_llama, facts):
    first = lsc.causal_trace(tiny_llama, facts, samples=2, seed=1, progress=False)
    again = lsc.causal_trace(
        tiny_llama, facts, samples=2, seed=1, batch_size=1, padding_side="left", progress=False
    )
    np.testing.assert_allclose(first.values, again.values, atol=1e-6)
    other = lsc.causal_trace(tiny_llama, facts, samples=2, seed=2, progress=False)
    assert not np.allclose(first["noised_prob"].values, other["noised_prob"].values)
    assert first.attrs["seed"] == 1 and first.attrs["samples"] == 2


def test_window_follows_rome():
    assert window_layers("mlp", 0, 10, 30) == list(range(0, 5))
    assert window_layers("mlp", 15, 10, 30) == list(range(10, 20))
    assert window_layers("attn", 29, 10, 30) == list(range(24, 30))
    assert window_layers("resid", 7, 10, 30) == [7]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"noise": -1.0}, "noise"),
        ({"samples": 0}, "samples"),
        ({"window": 0}, "window"),
        ({"kind": "mlp_out"}, "kind"),
        ({"positions": "all"}, "positions must be 'each'"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_options_are_refused_before_any_pass(tiny_llama, facts, no_pass, options, message):
    with pytest.raises(ValueError, match=message):
        lsc.causal_trace(tiny_llama, facts, progress=False, **options)


def test_prompts_without_a_subject_are_refused_before_any_pass(tiny_llama, no_pass):
    plain = [Prompt("The capital of France is the city of", " Paris", spans={"END": "of"})]
    with pytest.raises(ValueError, match="no 'subject' span"):
        lsc.causal_trace(tiny_llama, plain, progress=False)


def test_it_streams_into_a_store(tiny_llama, facts, tmp_path):
    memory = lsc.causal_trace(tiny_llama, facts, samples=2, progress=False)
    stored = lsc.causal_trace(
        tiny_llama, facts, samples=2, store=tmp_path / "trace.zarr", batch_size=2, progress=False
    ).load()
    np.testing.assert_allclose(stored.values, memory.values, atol=1e-6)
    np.testing.assert_allclose(
        stored["total_effect"].values, memory["total_effect"].values, atol=1e-7
    )
    assert lsc.estimate(tiny_llama, "causal_trace", facts).batch_size >= 1


def test_rome_position_roles():
    from lenscape.capture.tracing import position_roles

    # "The Eiffel Tower is in the city of": subject at 1..3 of 8 tokens
    assert position_roles([1, 2, 3], 8) == [
        "before the subject",
        "first subject token",
        "middle subject tokens",
        "last subject token",
        "first subsequent token",
        "further tokens",
        "further tokens",
        "last token",
    ]
    assert position_roles([0], 3) == ["last subject token", "first subsequent token", "last token"]


def test_by_role_averages_each_role(tiny_llama, facts):
    from lenscape.capture.tracing import by_role

    trace = lsc.causal_trace(tiny_llama, facts, samples=2, progress=False)
    roles = by_role(trace)
    assert roles.dims == ("prompt", "layer", "role")
    row = trace.isel(prompt=0)
    further = row["role"].values == "further tokens"
    np.testing.assert_allclose(
        roles.isel(prompt=0).sel(role="further tokens").values,
        row.values[:, further].mean(1),
        atol=1e-7,
    )
