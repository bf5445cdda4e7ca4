"""Head detectors (``capture/heads.py``) and the next-token loss (``capture/loss.py``)
against plain computations from the Hugging Face model's own outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lenscape as lsc
from lenscape.capture.heads import PATTERNS, induction
from lenscape.sweep.backend import get_backend


@pytest.fixture(scope="module")
def repeated():
    return lsc.data.prompts("repeated")[:3]


def hand_scores(model, prompt, pattern_of, rows="all"):
    """(layer, head) sum(attention x pattern) / sum(attention) from ``output_attentions``."""
    ids = model.tokenizer(prompt.text)["input_ids"]
    previous = model.hf.config._attn_implementation
    model.hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model.hf(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        model.hf.set_attn_implementation(previous)
    pattern = torch.as_tensor(pattern_of(np.asarray(ids)), dtype=torch.float64)
    keep = pattern.sum(1) > 0 if rows == "pattern" else torch.ones(len(ids), dtype=torch.bool)
    out = []
    for weights in attentions:  # (1, head, q, k)
        weights = weights[0].double()[:, keep]
        out.append(((weights * pattern[keep]).sum((1, 2)) / weights.sum((1, 2))).numpy())
    return np.stack(out)


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_scores_equal_the_attention_weights_times_the_pattern(tiny_llama, repeated, kind):
    got = lsc.head_scores(tiny_llama, repeated, kind=kind, progress=False)
    assert got.dims == ("prompt", "layer", "head")
    for i, p in enumerate(repeated):
        np.testing.assert_allclose(
            got.values[i], hand_scores(tiny_llama, p, PATTERNS[kind]), atol=1e-5
        )
    by_rows = lsc.head_scores(tiny_llama, repeated, kind=kind, rows="pattern", progress=False)
    expected = hand_scores(tiny_llama, repeated[0], PATTERNS[kind], rows="pattern")
    np.testing.assert_allclose(by_rows.values[0], expected, atol=1e-5)


def test_the_patterns_mark_the_right_keys():
    ids = np.array([5, 7, 9, 5, 7])
    assert PATTERNS["previous_token"](ids)[3, 2] == 1 and PATTERNS["previous_token"](ids).sum() == 4
    assert (
        PATTERNS["duplicate_token"](ids)[3, 0] == 1 and PATTERNS["duplicate_token"](ids)[4, 1] == 1
    )
    # the induction pattern at the second 5 looks at what followed the first: the 7 at 1
    assert induction(ids)[3, 1] == 1 and induction(ids)[4, 2] == 1 and induction(ids).sum() == 2


def test_a_custom_pattern_function_is_used_and_checked(tiny_llama, repeated, monkeypatch):
    def first_key(ids):  # every query on the first token (an attention sink)
        pattern = np.zeros((len(ids), len(ids)))
        pattern[:, 0] = 1
        return pattern

    got = lsc.head_scores(tiny_llama, repeated[:1], kind=first_key, progress=False)
    np.testing.assert_allclose(
        got.values[0], hand_scores(tiny_llama, repeated[0], first_key), atol=1e-5
    )
    backend = get_backend(tiny_llama, "nnsight")
    monkeypatch.setattr(type(backend), "run", lambda *a, **k: pytest.fail("a pass ran first"))
    for bad, message in (
        (lambda ids: np.ones((len(ids), 2)), "shape"),
        (lambda ids: 2 * np.eye(len(ids)), "probabilities"),
        (lambda ids: np.triu(np.ones((len(ids), len(ids)))), "after their query"),
    ):
        with pytest.raises(ValueError, match=message):
            lsc.head_scores(tiny_llama, repeated[:1], kind=bad, progress=False)
    with pytest.raises(ValueError, match="Unknown head pattern"):
        lsc.head_scores(tiny_llama, repeated[:1], kind="copying", progress=False)


def test_token_loss_is_the_next_token_cross_entropy(tiny_llama, repeated):
    got = lsc.token_loss(tiny_llama, repeated, progress=False)
    tok = tiny_llama.tokenizer
    for i, p in enumerate(repeated):
        ids = tok(p.text)["input_ids"]
        following = [*ids[1:], tok(p.target, add_special_tokens=False)["input_ids"][0]]
        with torch.no_grad():
            logits = tiny_llama.hf(torch.tensor([ids])).logits[0].double()
        expected = torch.nn.functional.cross_entropy(
            logits, torch.tensor(following), reduction="none"
        )
        np.testing.assert_allclose(got.values[i, : len(ids)], expected.numpy(), atol=1e-4)
        assert np.isnan(got.values[i, len(ids) :]).all()
        assert got["next_token"].values[i, len(ids) - 1] == p.target


def test_heads_off_zero_those_heads_outputs_only(tiny_llama, repeated):
    """Within ``lsc.heads_off`` the model's logits are those of a plain forward hook that
    zeroes the heads' slices of the output projection's input; outside it, the intact ones."""
    spec = tiny_llama.spec
    off = [(0, 1), (2, 3), (2, 0)]
    ids = torch.tensor([tiny_llama.tokenizer(repeated[0].text)["input_ids"]])

    def zero(layer):
        def hook(module, args):
            z = args[0].clone().view(*args[0].shape[:2], spec.n_heads, spec.d_head)
            z[:, :, [h for at, h in off if at == layer]] = 0
            return (z.flatten(2),)

        return hook

    layers = tiny_llama.hf.model.layers
    handles = [
        layers[layer].self_attn.o_proj.register_forward_pre_hook(zero(layer))
        for layer in {at for at, _ in off}
    ]
    with torch.no_grad():
        expected = tiny_llama.hf(ids).logits
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        intact = tiny_llama.hf(ids).logits
        with lsc.heads_off(tiny_llama, off) as model:
            got = model.hf(ids).logits
        after = tiny_llama.hf(ids).logits
    assert (expected - intact).abs().max() > 1e-3  # the heads matter
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(after, intact)


@pytest.mark.parametrize(
    ("heads", "message"),
    [([(0, 4)], "head in 0..3"), ([(3, 0)], "layer in 0..2"), (7, "list of"), ([(1,)], "pairs")],
)
def test_heads_off_refuses_what_names_no_head(tiny_llama, heads, message):
    with pytest.raises(ValueError, match=message), lsc.heads_off(tiny_llama, heads):
        pass
