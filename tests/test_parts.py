"""The parts of a head (``part="q" | "k" | "v" | "pattern"``): exact patching and attribution
patching of a head's query, a key/value head's key or value, or a head's attention pattern,
by position, against plain hooks on the Hugging Face projections (for patterns, an attention
function of our own that swaps the weights), against TransformerLens's q/k/v/pattern
patching, on every tiny family that has separate projections; and the refusals."""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
import torch
from _helpers import _pair
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import lenscape as lsc
from lenscape import models
from lenscape.data import PromptSet
from lenscape.sweep.backend import get_backend

#: Families whose attention has separate q, k and v projections (``self_attn.q_proj`` ...).
SEPARATE = [f for f in models.TINY_ARCHITECTURES if f not in ("gpt2", "gpt_neox", "phi3")]


def projections(model, layer):
    attention = model.hf.model.layers[layer].self_attn
    return {"q": attention.q_proj, "k": attention.k_proj, "v": attention.v_proj}


def hand_part_patching(model, prompt, part, layers=None):
    """(layer, head, pos): the corrupt run's logit difference change when one head's slice
    of the ``part`` projection's output at one position is its clean value (plain forward
    hooks, unpadded); ``layers``: only those (rows in that order; None: every layer)."""
    spec = model.spec
    heads = spec.n_kv_heads if part in ("k", "v") else spec.n_heads
    clean_ids, corrupt_ids, target, other = _pair(model, prompt)
    n_pos = clean_ids.shape[1]
    clean = {}
    handles = [
        projections(model, layer)[part].register_forward_hook(
            lambda m, a, out, layer=layer: clean.__setitem__(layer, out.detach().clone())
        )
        for layer in range(spec.n_layers)
    ]
    with torch.no_grad():
        model.hf(clean_ids)
    for handle in handles:
        handle.remove()

    def diff(edit_layer=None, head=None, pos=None):
        handle = None
        if edit_layer is not None:
            cols = slice(head * spec.d_head, (head + 1) * spec.d_head)

            def put(m, a, out):
                out = out.clone()
                out[0, pos, cols] = clean[edit_layer][0, pos, cols]
                return out

            handle = projections(model, edit_layer)[part].register_forward_hook(put)
        try:
            with torch.no_grad():
                logits = model.hf(corrupt_ids).logits[0, -1]
        finally:
            if handle is not None:
                handle.remove()
        return float(logits[target] - logits[other])

    base = diff()
    layers = range(spec.n_layers) if layers is None else layers
    out = np.zeros((len(layers), heads, n_pos))
    for row, layer in enumerate(layers):
        for head in range(heads):
            for pos in range(n_pos):
                out[row, head, pos] = diff(layer, head, pos) - base
    return out


@contextlib.contextmanager
def swapped_attention(model, swap):
    """Within the block the HF model runs its family's eager attention through ``swap(layer,
    weights) -> weights`` (batch, heads, query, key) before the weights meet the values
    (an attention function registered for the test; the values repeated per query head as
    the family's own ``repeat_kv`` does)."""
    family = sys.modules[type(model.hf.model.layers[0].self_attn).__module__]

    def attention(module, query, key, value, attention_mask, **kwargs):
        _, weights = family.eager_attention_forward(
            module, query, key, value, attention_mask, **kwargs
        )
        weights = swap(module.layer_idx, weights)
        values = family.repeat_kv(value, module.num_key_value_groups)
        return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights

    AttentionInterface.register("lenscape_test_swap", attention)
    AttentionMaskInterface.register("lenscape_test_swap", eager_mask)  # an additive mask
    previous = model.hf.config._attn_implementation
    model.hf.set_attn_implementation("lenscape_test_swap")
    try:
        yield
    finally:
        model.hf.set_attn_implementation(previous)


def hand_pattern_patching(model, prompt, layers=None):
    """(layer, head, pos): the corrupt run's logit difference change when one head's
    attention weights at one query position are its clean ones; ``layers`` as
    ``hand_part_patching``'s."""
    spec = model.spec
    clean_ids, corrupt_ids, target, other = _pair(model, prompt)
    clean = {}

    def record(layer, weights):
        clean[layer] = weights.clone()
        return weights

    with torch.no_grad(), swapped_attention(model, record):
        model.hf(clean_ids)

    def diff(at=None):
        def put(layer, weights):
            if at is None or layer != at[0]:
                return weights
            weights = weights.clone()
            weights[0, at[1], at[2]] = clean[layer][0, at[1], at[2]]
            return weights

        with torch.no_grad(), swapped_attention(model, put):
            logits = model.hf(corrupt_ids).logits[0, -1]
        return float(logits[target] - logits[other])

    base = diff()
    n_pos = clean_ids.shape[1]
    layers = range(spec.n_layers) if layers is None else layers
    out = np.zeros((len(layers), spec.n_heads, n_pos))
    for row, layer in enumerate(layers):
        for head in range(spec.n_heads):
            for pos in range(n_pos):
                out[row, head, pos] = diff((layer, head, pos)) - base
    return out


@pytest.fixture(scope="module")
def pair(factual):
    return PromptSet([factual[0]], name="factual")


@pytest.fixture(scope="module", params=SEPARATE)
def family(request, tokenizer):
    """A 2-layer tiny model of the family in float64 (as the family matrix's), so the
    comparison is exact to rounding."""
    tiny = models.tiny(request.param, n_layers=2, seed=0, tokenizer=tokenizer, check=False)
    if request.param in ("qwen2_moe", "qwen3_moe", "mixtral"):
        tiny.hf.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return models.from_hf(
        tiny.hf, tokenizer, name=f"tiny-{request.param}", device="cpu", dtype="float64", check=False
    )


@pytest.mark.parametrize("part", ["q", "k", "v"])
def test_parts_by_position_equal_plain_hooks_on_every_family(family, pair, part):
    got = lsc.activation_patching(family, pair, part=part, positions="each", progress=False)
    head_dim = "kv_head" if part in ("k", "v") else "head"
    assert got.dims == ("prompt", "layer", head_dim, "pos") and got.attrs["part"] == part
    expected = hand_part_patching(family, pair[0], part)
    scale = np.abs(expected).max()
    assert scale > 0
    # metrics in float32: to 1e-4 of the largest effect (or 1e-7 of a logit, tiny effects)
    assert np.abs(got.values[0] - expected).max() <= 1e-4 * scale + 1e-7


def test_patterns_by_position_equal_plain_attention_on_every_family(family, pair):
    got = lsc.activation_patching(family, pair, part="pattern", positions="each", progress=False)
    assert got.dims == ("prompt", "layer", "head", "pos") and got.attrs["part"] == "pattern"
    expected = hand_pattern_patching(family, pair[0])
    scale = np.abs(expected).max()
    assert scale > 0
    assert np.abs(got.values[0] - expected).max() <= 1e-4 * scale + 1e-7
    # all positions at once: the whole pattern of a head
    whole = lsc.activation_patching(family, pair, part="pattern", progress=False)
    assert whole.dims == ("prompt", "layer", "head")


def test_attribution_of_patterns_equals_plain_autograd(tiny_llama, pair):
    """AtP of a pattern: the corrupt run's metric gradient w.r.t. each head's attention
    weights, times (clean - corrupt weights), summed over key positions, by query position."""
    spec = tiny_llama.spec
    got = lsc.attribution_patching(
        tiny_llama, pair, part="pattern", positions="each", progress=False
    )
    clean_ids, corrupt_ids, target, other = _pair(tiny_llama, pair[0])
    weights = {}

    def keep(grad):
        def hook(layer, value):
            if grad:
                value = value.detach().requires_grad_(True)
            weights[layer, grad] = value
            return value

        return hook

    with torch.no_grad(), swapped_attention(tiny_llama, keep(False)):
        tiny_llama.hf(clean_ids)
    with swapped_attention(tiny_llama, keep(True)):
        logits = tiny_llama.hf(corrupt_ids).logits[0, -1]
    (logits[target] - logits[other]).backward()
    for layer in range(spec.n_layers):
        corrupt = weights[layer, True]
        product = corrupt.grad * (weights[layer, False] - corrupt.detach())
        np.testing.assert_allclose(
            got.values[0, layer], product[0].sum(-1).numpy(), atol=1e-5, rtol=1e-4
        )
    tiny_llama.hf.zero_grad(set_to_none=True)


def test_grouped_keys_stay_grouped(tiny_llama, pair):
    """Under grouped-query attention a key is one cell per key/value head (2 here), not
    one per query head (4)."""
    spec = tiny_llama.spec
    assert spec.n_kv_heads < spec.n_heads
    keys = lsc.attribution_patching(tiny_llama, pair, part="k", progress=False)
    assert keys.sizes["kv_head"] == spec.n_kv_heads and "head" not in keys.dims


@pytest.mark.parametrize("part", ["q", "k", "v"])
def test_attribution_of_parts_equals_plain_autograd(tiny_llama, pair, part):
    """AtP of a part: the gradient of the corrupt run's metric w.r.t. the projection's
    output, times (clean - corrupt output), summed over each head's slice, by position."""
    spec = tiny_llama.spec
    got = lsc.attribution_patching(tiny_llama, pair, part=part, positions="each", progress=False)
    clean_ids, corrupt_ids, target, other = _pair(tiny_llama, pair[0])
    outputs = {}

    def keep(layer, grad):
        def hook(m, a, out):
            if grad:
                out.retain_grad()
            outputs[layer, grad] = out

        return hook

    for ids, grad in ((clean_ids, False), (corrupt_ids, True)):
        handles = [
            projections(tiny_llama, layer)[part].register_forward_hook(keep(layer, grad))
            for layer in range(spec.n_layers)
        ]
        embedded = tiny_llama.hf.get_input_embeddings()(ids).detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            logits = tiny_llama.hf(inputs_embeds=embedded).logits[0, -1]
        for handle in handles:
            handle.remove()
        if grad:
            (logits[target] - logits[other]).backward()
    heads = spec.n_kv_heads if part in ("k", "v") else spec.n_heads
    for layer in range(spec.n_layers):
        corrupt = outputs[layer, True]
        delta = (outputs[layer, False] - corrupt).detach()
        product = (corrupt.grad * delta)[0].view(-1, heads, spec.d_head).sum(-1).T
        np.testing.assert_allclose(got.values[0, layer], product.numpy(), atol=1e-5)
    tiny_llama.hf.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("part", "function"),
    [
        ("q", "get_act_patch_attn_head_q_by_pos"),
        ("k", "get_act_patch_attn_head_k_by_pos"),
        ("v", "get_act_patch_attn_head_v_by_pos"),
        ("pattern", "get_act_patch_attn_head_pattern_by_pos"),
    ],
)
def test_parts_equal_transformer_lens_by_position(tiny_llama, pair, part, function):
    from transformer_lens import patching

    bridge = get_backend(tiny_llama, "transformer_lens").bridge
    clean_ids, corrupt_ids, target, other = _pair(tiny_llama, pair[0])

    def metric(logits):
        return logits[:, -1, target] - logits[:, -1, other]

    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean_ids)
        base = float(metric(bridge(corrupt_ids))[0])
        got = getattr(patching, function)(bridge, corrupt_ids, cache, metric, reduce="mean")
        theirs = got.numpy() - base
    ours = lsc.activation_patching(tiny_llama, pair, part=part, positions="each", progress=False)
    # TransformerLens: [layer, pos, heads]; patterns [layer, head, dest_pos]
    order = ("layer", "head", "pos") if part == "pattern" else ("layer", "pos", ...)
    np.testing.assert_allclose(ours.isel(prompt=0).transpose(*order).values, theirs, atol=1e-5)


@pytest.mark.parametrize("family_name", ["gpt2", "gpt_neox", "phi3"])
def test_fused_projections_refuse_parts(tokenizer, pair, family_name):
    fused = models.tiny(family_name, n_layers=1, seed=0, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="fuses its query, key and value"):
        lsc.activation_patching(fused, pair, part="k", progress=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"part": "k", "level": "block"}, "takes level='head'"),
        ({"part": "pattern", "error": True}, "plain AtP only"),
        ({"part": "pattern", "estimator": "ig"}, "plain AtP only"),
        ({"part": "pattern", "level": "block"}, "takes level='head'"),
        ({"part": "keys"}, "Unknown part"),
    ],
)
def test_bad_parts_are_refused(tiny_llama, pair, options, message):
    with pytest.raises(ValueError, match=message):
        lsc.attribution_patching(tiny_llama, pair, progress=False, **options)
