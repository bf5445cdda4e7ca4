"""More architecture families on tiny random models: self-check, every capture method, both
backends where TransformerLens 4.3 supports the family.

The references below find each family's modules by hand (not through lenscape's layout
table), so a wrong layout shows up as a mismatch. README, section Models, tabulates what
these tests cover.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers import block_outputs, o_proj_module

import lenscape as lsc
from lenscape import cluster, models

FAMILIES = ("gpt_neox", "olmo2", "phi3", "gemma2", "qwen3_moe", "mixtral")


def logit_diff(model, prompt, module=None, hook=None, pre=False):
    """Logit difference at the last token of one unpadded prompt, with one optional hook."""
    tok = model.tokenizer
    ids = torch.tensor([tok(prompt.text)["input_ids"]])
    target, distractor = (
        tok(t, add_special_tokens=False)["input_ids"][0] for t in (prompt.target, prompt.distractor)
    )
    handle = None
    if module is not None:
        handle = (
            module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
        )
    try:
        with torch.no_grad():
            logits = model.hf(ids).logits[0, -1].double()
    finally:
        if handle is not None:
            handle.remove()
    return float(logits[target] - logits[distractor])


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tokenizer):
    return models.tiny(request.param, n_layers=2, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def prompts(factual):
    return factual[:2]


def test_self_check_passes(family):
    result = lsc.check(family)
    assert result.attrs["passed"]
    assert max(float(result[name].max()) for name in ("heads", "residual", "logits")) < 1e-5


def test_head_ablation_matches_a_hand_hook(family, prompts):
    scores = lsc.ablation(family, prompts, progress=False)
    d_head = family.spec.d_head
    for i, prompt in enumerate(prompts):
        base = logit_diff(family, prompt)
        for layer in range(family.spec.n_layers):
            for head in range(family.spec.n_heads):

                def zero_head(module, args, head=head):
                    z = args[0].clone()
                    z[..., head * d_head : (head + 1) * d_head] = 0
                    return (z, *args[1:])

                expected = (
                    logit_diff(family, prompt, o_proj_module(family, layer), zero_head, pre=True)
                    - base
                )
                assert float(scores[i, layer, head]) == pytest.approx(expected, abs=1e-5)


def test_block_ablation_matches_a_hand_hook(family, prompts):
    scores = lsc.ablation(family, prompts, level="block", progress=False)

    def zero_output(module, args, output):
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    for i, prompt in enumerate(prompts):
        base = logit_diff(family, prompt)
        for layer in range(family.spec.n_layers):
            for c, module in enumerate(block_outputs(family, layer)):
                expected = logit_diff(family, prompt, module, zero_output) - base
                assert float(scores[i, layer, c]) == pytest.approx(expected, abs=1e-5)


def test_patching_and_logit_attribution(family, prompts):
    patched = lsc.activation_patching(family, prompts, level="block", progress=False)
    estimated = lsc.attribution_patching(family, prompts, level="all", progress=False)
    heads = lsc.direct_logit_attribution(family, prompts, level="head", progress=False)
    blocks = lsc.direct_logit_attribution(family, prompts, level="block", progress=False)
    for result in (patched, estimated["heads"], estimated["blocks"], heads, blocks):
        assert np.isfinite(result.values).all() and np.abs(result.values).max() > 0
    # Heads' direct effects add up to their block's, up to o_proj's bias (GPT-NeoX has one,
    # which belongs to no head).
    bias = o_proj_module(family, 0).bias
    if bias is None:
        np.testing.assert_allclose(
            heads.sum("head").values, blocks.sel(component="attn").values, atol=1e-5
        )


def test_learned_and_weight_methods(family, prompts):
    task = lsc.data.task("syntax")[:6]
    gates = lsc.head_gating(family, task, seeds=1, max_steps=2, batch_size=3, progress=False)
    assert gates["facilitation"].sizes["head"] == family.spec.n_heads
    texts = lsc.data.prompts("mixed")[::40]
    clusters = cluster.kmeans(
        np.random.default_rng(0).normal(size=(len(texts), 8)), 2, prompts=texts
    )
    masks = lsc.block_masks(family, texts, clusters=clusters, max_steps=2, progress=False)
    assert masks["mask"].sizes == {"cluster": 2, "layer": 2, "component": 2}
    importance = lsc.weight_importance(family, prompts, batch_size=2, progress=False)
    per_layer = importance["per_layer"].dropna("component", how="all")
    assert set(per_layer["component"].values) == set(family.spec.layout.weights)
    assert np.isfinite(per_layer.values).all()
    assert float(lsc.weight_change(family, family)["per_layer"].max()) == 0


TL_METHODS = ("ablation", "activation_patching", "attribution_patching", "direct_logit_attribution")


@pytest.mark.parametrize("level", ["head", "block"])
def test_backends_agree(family, prompts, level):
    for method in TL_METHODS:
        fn = getattr(lsc, method)
        a = fn(family, prompts, level=level, backend="nnsight", progress=False)
        b = fn(family, prompts, level=level, backend="transformer_lens", progress=False)
        np.testing.assert_allclose(a.values, b.values, atol=1e-4, err_msg=method)


def test_a_family_without_a_layout_says_how_to_add_one(tokenizer):
    import transformers

    config = transformers.FalconConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        ValueError, match=r"Unsupported architecture 'falcon'.*layout=lsc\.ArchLayout.*self-check"
    ):
        models.from_hf(hf, tokenizer)
