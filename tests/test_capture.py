"""Capture methods against independent computations written here with plain PyTorch hooks.

The references below deliberately avoid lenscape internals: they tokenize one prompt at a
time (no padding), hook the HF modules directly and read the last token's logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lenscape as lsc
from lenscape import models


def o_proj_module(model, layer):
    """The HF output projection of one block, found without lenscape's layout table."""
    hf = model.hf
    if hasattr(hf, "transformer"):  # GPT-2
        return hf.transformer.h[layer].attn.c_proj
    return hf.model.layers[layer].self_attn.o_proj


def block_outputs(model, layer):
    """(attention, MLP) modules whose outputs are added to the residual stream."""
    hf = model.hf
    if hasattr(hf, "transformer"):
        block = hf.transformer.h[layer]
        return block.attn, block.mlp
    block = hf.model.layers[layer]
    if hasattr(block, "post_feedforward_layernorm"):  # Gemma
        return block.post_attention_layernorm, block.post_feedforward_layernorm
    return block.self_attn, block.mlp


def logit_diff(model, text, target, distractor, hooks=()):
    """Logit difference at the last token of one unpadded prompt, with forward hooks."""
    tok = model.tokenizer
    ids = torch.tensor([tok(text)["input_ids"]])
    t = tok(target, add_special_tokens=False)["input_ids"][0]
    d = tok(distractor, add_special_tokens=False)["input_ids"][0]
    handles = [
        module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn)
        for module, fn, pre in hooks
    ]
    try:
        with torch.no_grad():
            logits = model.hf(ids).logits[0, -1].double()
    finally:
        for h in handles:
            h.remove()
    return float(logits[t] - logits[d])


def head_replacer(model, head, value):
    """Pre-hook replacing one head's slice of the o_proj input; value(ids_shape)->tensor."""
    d_head = model.spec.d_head

    def hook(module, args):
        z = args[0].clone()
        z[..., head * d_head : (head + 1) * d_head] = value(z)
        return (z, *args[1:])

    return hook


def reference_zero_ablation(model, prompts, layers=None):
    spec = model.spec
    layers = range(spec.n_layers) if layers is None else layers
    out = np.zeros((len(prompts), len(layers), spec.n_heads))
    for i, p in enumerate(prompts):
        base = logit_diff(model, p.text, p.target, p.distractor)
        for li, layer in enumerate(layers):
            for head in range(spec.n_heads):
                hook = head_replacer(model, head, lambda z: 0.0)
                out[i, li, head] = (
                    logit_diff(
                        model,
                        p.text,
                        p.target,
                        p.distractor,
                        [(o_proj_module(model, layer), hook, True)],
                    )
                    - base
                )
    return out


def reference_activation_patching(model, prompts):
    spec, d_head = model.spec, model.spec.d_head
    out = np.zeros((len(prompts), spec.n_layers, spec.n_heads))
    for i, p in enumerate(prompts):
        clean_z = {}
        hooks = []
        for layer in range(spec.n_layers):

            def save(module, args, layer=layer, clean_z=clean_z):
                clean_z[layer] = args[0].clone()

            hooks.append((o_proj_module(model, layer), save, True))
        logit_diff(model, p.text, p.target, p.distractor, hooks)
        base = logit_diff(model, p.corrupt, p.target, p.distractor)
        for layer in range(spec.n_layers):
            for head in range(spec.n_heads):
                sl = slice(head * d_head, (head + 1) * d_head)
                hook = head_replacer(
                    model,
                    head,
                    lambda z, layer=layer, sl=sl, clean_z=clean_z: clean_z[layer][..., sl],
                )
                out[i, layer, head] = (
                    logit_diff(
                        model,
                        p.corrupt,
                        p.target,
                        p.distractor,
                        [(o_proj_module(model, layer), hook, True)],
                    )
                    - base
                )
    return out


# ----------------------------------------------------------------------------- exact methods


def test_zero_ablation_matches_plain_hooks(tiny_model, factual):
    prompts = factual[:5]
    scores = lsc.ablation(
        tiny_model, prompts, level="head", kind="zero", batch_size=3, progress=False
    )
    assert scores.dims == ("prompt", "layer", "head")
    assert scores.shape == (5, tiny_model.spec.n_layers, tiny_model.spec.n_heads)
    np.testing.assert_allclose(
        scores.values, reference_zero_ablation(tiny_model, prompts), atol=1e-5
    )
    assert scores.attrs["method"] == "zero_ablation"
    lsc.schema.validate(scores)


@pytest.mark.parametrize("backend", ["nnsight", "transformer_lens"])
def test_exact_sweep_reruns_only_the_blocks_after_the_edit(tiny_llama, factual, backend):
    """One batch: the unedited pass runs every block once, then the pass editing block l's
    heads runs blocks l..L-1 only, so block l's MLP runs 1 + (l + 1) times (not 1 + L)."""
    from lenscape.capture._backend import get_backend

    model = tiny_llama
    runner = get_backend(model, backend)
    blocks = runner.bridge.blocks if backend == "transformer_lens" else model.hf.model.layers
    calls = [0] * model.spec.n_layers
    handles = [
        block.mlp.register_forward_hook(
            lambda *args, layer=layer: calls.__setitem__(layer, calls[layer] + 1)
        )
        for layer, block in enumerate(blocks)
    ]
    try:
        scores = lsc.ablation(model, factual[:2], batch_size=2, backend=backend, progress=False)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [1 + layer + 1 for layer in range(model.spec.n_layers)]
    np.testing.assert_allclose(
        scores.values, reference_zero_ablation(model, factual[:2]), atol=1e-5
    )


def test_activation_patching_matches_plain_hooks(tiny_model, factual):
    prompts = factual[:4]
    scores = lsc.activation_patching(tiny_model, prompts, batch_size=4, progress=False)
    np.testing.assert_allclose(
        scores.values, reference_activation_patching(tiny_model, prompts), atol=1e-5
    )


def test_mean_ablation_matches_plain_hooks(tiny_llama, factual):
    model, prompts = tiny_llama, factual[:4]
    spec = model.spec
    # Independent mean of each layer's o_proj input over every real token of every prompt.
    sums = {}
    count = 0
    for p in prompts:
        hooks = []
        for layer in range(spec.n_layers):

            def acc(module, args, layer=layer):
                sums[layer] = sums.get(layer, 0) + args[0][0].double().sum(0)

            hooks.append((o_proj_module(model, layer), acc, True))
        logit_diff(model, p.text, p.target, p.distractor, hooks)
        count += len(model.tokenizer(p.text)["input_ids"])
    expected = np.zeros((len(prompts), spec.n_layers, spec.n_heads))
    for i, p in enumerate(prompts):
        base = logit_diff(model, p.text, p.target, p.distractor)
        for layer in range(spec.n_layers):
            mean = (sums[layer] / count).float()
            for head in range(spec.n_heads):
                sl = slice(head * spec.d_head, (head + 1) * spec.d_head)
                hook = head_replacer(model, head, lambda z, m=mean, sl=sl: m[sl])
                expected[i, layer, head] = (
                    logit_diff(
                        model,
                        p.text,
                        p.target,
                        p.distractor,
                        [(o_proj_module(model, layer), hook, True)],
                    )
                    - base
                )
    scores = lsc.ablation(model, prompts, kind="mean", batch_size=2, progress=False)
    np.testing.assert_allclose(scores.values, expected, atol=1e-5)


def test_block_ablation_matches_plain_hooks(tiny_model, factual):
    prompts = factual[:3]
    scores = lsc.ablation(tiny_model, prompts, level="block", batch_size=3, progress=False)
    assert scores.dims == ("prompt", "layer", "component")
    assert list(scores["component"].values) == ["attn", "mlp"]

    def zero_output(module, args, output):
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    for i, p in enumerate(prompts):
        base = logit_diff(tiny_model, p.text, p.target, p.distractor)
        for layer in range(tiny_model.spec.n_layers):
            for c, module in enumerate(block_outputs(tiny_model, layer)):
                expected = (
                    logit_diff(
                        tiny_model, p.text, p.target, p.distractor, [(module, zero_output, False)]
                    )
                    - base
                )
                assert scores.values[i, layer, c] == pytest.approx(expected, abs=1e-5)


# ----------------------------------------------------------------------------- gradient methods


def test_attribution_patching_is_the_first_order_effect(tokenizer, factual):
    """Finite difference along (clean - corrupt) of one head equals the attribution (float64)."""
    model = models.from_hf(
        models.tiny("llama", n_layers=2, seed=1, tokenizer=tokenizer).hf,
        tokenizer,
        dtype=torch.float64,
        device="cpu",
    )
    p = factual[0]
    scores = lsc.attribution_patching(model, [p], progress=False)
    eps = 1e-3  # HF norms compute in float32 even in a float64 model: smaller eps is noise
    for layer, head in [(0, 1), (1, 3)]:
        clean_z = {}

        def save(module, args, clean_z=clean_z):
            clean_z["z"] = args[0].clone()

        logit_diff(
            model, p.text, p.target, p.distractor, [(o_proj_module(model, layer), save, True)]
        )
        sl = slice(head * model.spec.d_head, (head + 1) * model.spec.d_head)
        moved = {}
        for step in (eps, -eps):

            def moved_by(z, step=step, sl=sl, clean=clean_z["z"]):
                return z[..., sl] + step * (clean[..., sl] - z[..., sl])

            hook = head_replacer(model, head, moved_by)
            moved[step] = logit_diff(
                model,
                p.corrupt,
                p.target,
                p.distractor,
                [(o_proj_module(model, layer), hook, True)],
            )
        # Central difference: its error is O(eps^2), so the comparison is tight.
        slope = (moved[eps] - moved[-eps]) / (2 * eps)
        assert slope == pytest.approx(float(scores[0, layer, head]), rel=2e-3)


def test_attribution_patching_all_levels(tiny_llama, factual):
    ds = lsc.attribution_patching(tiny_llama, factual[:3], level="all", progress=False)
    head = lsc.attribution_patching(tiny_llama, factual[:3], level="head", progress=False)
    block = lsc.attribution_patching(tiny_llama, factual[:3], level="block", progress=False)
    assert set(ds.data_vars) == {"heads", "blocks"}
    np.testing.assert_allclose(ds["heads"].values, head.values, atol=1e-6)
    np.testing.assert_allclose(ds["blocks"].values, block.values, atol=1e-6)


def test_dla_adds_up_to_the_logit_difference(tiny_llama, factual):
    """Blocks' DLA + the embedding's own direct term == logit difference (frozen final norm)."""
    model, prompts = tiny_llama, factual[:4]
    blocks = lsc.direct_logit_attribution(model, prompts, level="block", progress=False)
    heads = lsc.direct_logit_attribution(model, prompts, level="head", progress=False)
    np.testing.assert_allclose(
        heads.sum("head").values, blocks.sel(component="attn").values, atol=1e-4
    )
    hf, final = model.hf, model.hf.model.norm
    for i, p in enumerate(prompts):
        ids = torch.tensor([model.tokenizer(p.text)["input_ids"]])
        seen = {}

        def keep(module, args, seen=seen):
            seen["resid"] = args[0][0, -1].clone()

        handle = final.register_forward_pre_hook(keep)
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
        handle.remove()
        embedding = out.hidden_states[0][0, -1]
        t = model.tokenizer(p.target, add_special_tokens=False)["input_ids"][0]
        d = model.tokenizer(p.distractor, add_special_tokens=False)["input_ids"][0]
        direction = hf.lm_head.weight[t] - hf.lm_head.weight[d]
        scale = torch.rsqrt(seen["resid"].pow(2).mean() + final.variance_epsilon)
        embed_term = float((embedding * scale * final.weight * direction).sum())
        logits = out.logits[0, -1]
        assert float(blocks[i].sum()) + embed_term == pytest.approx(
            float(logits[t] - logits[d]), abs=1e-4
        )


# ----------------------------------------------------------------------------- invariances


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_invariance(tiny_model, factual, side):
    # Mixed lengths: prompts of different token counts in one batch.
    prompts = lsc.data.PromptSet([factual[i] for i in (0, 7, 20, 33)], name="mixed-lengths")
    lengths = {len(tiny_model.tokenizer(p.text)["input_ids"]) for p in prompts}
    assert len(lengths) > 1
    for method in (lsc.ablation, lsc.attribution_patching, lsc.direct_logit_attribution):
        one = method(tiny_model, prompts, batch_size=1, progress=False)
        batched = method(tiny_model, prompts, batch_size=4, padding_side=side, progress=False)
        np.testing.assert_allclose(
            batched.values, one.values, atol=1e-5, err_msg=f"{method.__name__} {side}"
        )


@pytest.mark.parametrize(
    "method",
    ["ablation", "activation_patching", "attribution_patching", "direct_logit_attribution"],
)
@pytest.mark.parametrize("level", ["head", "block"])
def test_backends_agree(tiny_model, factual, method, level):
    fn = getattr(lsc, method)
    a = fn(tiny_model, factual[:3], level=level, backend="nnsight", progress=False)
    b = fn(tiny_model, factual[:3], level=level, backend="transformer_lens", progress=False)
    np.testing.assert_allclose(a.values, b.values, atol=1e-4)
    assert b.attrs["backend"] == "transformer_lens"
