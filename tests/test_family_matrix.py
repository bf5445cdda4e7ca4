"""The family x method matrix (docs/site/explanation/families.md): every family ``lsc.models.tiny``
builds, every node-level method, each checked against an independent computation.

The references are written by hand from the Hugging Face modules (``_helpers.hand_block``
and its neighbours find each family's modules without lenscape's layout table, and the
weight table below names each family's parameters from the modeling files), so a wrong
layout, a wrong definition or a family-specific slip shows up as a mismatch:

- ablation and activation patching: forward hooks that zero or patch one head's o_proj
  input columns, or one block's contribution to the residual stream;
- attribution patching and integrated gradients: plain autograd through hooks, at the
  points lenscape integrates over (``attrs["steps"]``);
- direct logit attribution: each head's o_proj share (linearised through a post-norm at the
  run's scale) and each block's output, through the final norm at the run's scale and the
  unembedding (pre-soft-cap logits), and the shares adding up to the logit difference;
- the logit lens: the final norm and unembedding of ``output_hidden_states``;
- attention patterns: the eager attention's ``output_attentions``;
- head gating and block masks: the loss at given gates or masks against hooks that scale
  heads or skip blocks, and a 2-step fit;
- weight maps: |w dL/dw| per matrix by plain autograd, and the change of a hand-edited copy;
- the TransformerLens backend: the same numbers as the nnsight backend.

Models are 2-layer tiny random ones in float64 (lenscape computes metrics, products and
projections in float32, so results agree to about 1e-7 of the largest value; the tolerance
is ``RTOL`` of it; mixture-of-experts models run their experts in a loop, as grouped_mm has
no float64 kernel). The two prompts have different token lengths: every batched run is
padded, every reference is not. Padding is on the right (the default): in float64, Hugging
Face's Gemma 2 and TransformerLens's bridge turn a left-padded row's fully masked pad
positions into NaN, which reach its real positions (0 x NaN); float32 is unaffected.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _helpers import (
    _hidden_of,
    _pair,
    _replace_hidden,
    block_outputs,
    hand_block,
    hand_final_norm,
    hand_senders,
    hand_target_nll,
    o_proj_module,
    reference_activation_patching,
    reference_zero_ablation,
    span_positions_by_rule,
    torch_threads,
)

import lenscape as lsc
from lenscape import cluster, models
from lenscape.capture.patching import DEFAULT_IG_STEPS
from lenscape.models.loader import _tiny_configs

FAMILIES = models.TINY_ARCHITECTURES
#: Largest difference allowed, relative to the largest value of the reference.
RTOL = 1e-5
#: Between the two backends (TransformerLens runs its own copy of the weights).
RTOL_BACKENDS = 1e-5
COMPONENTS = ("attn", "mlp")

# Per-layer weight components -> (parameter path within a block, column block of GPT-2's
# fused c_attn or None), read from transformers/models/*/modeling_*.py. Fused tensors that
# hold several components (GPT-NeoX query_key_value, Phi-3 qkv_proj and gate_up_proj, the
# expert banks) are not weight components.
_ATTN = {f"{x}_proj": (f"self_attn.{x}_proj.weight", None) for x in "qkvo"}
_MLP = {f"{x}_proj": (f"mlp.{x}_proj.weight", None) for x in ("gate", "up", "down")}
_NORMS = {
    "input_layernorm": ("input_layernorm.weight", None),
    "post_attention_layernorm": ("post_attention_layernorm.weight", None),
}
_QK_NORMS = {f"{x}_norm": (f"self_attn.{x}_norm.weight", None) for x in "qk"}
_GEMMA = {
    **_ATTN,
    **_MLP,
    **_NORMS,
    "pre_feedforward_layernorm": ("pre_feedforward_layernorm.weight", None),
    "post_feedforward_layernorm": ("post_feedforward_layernorm.weight", None),
}
HAND_WEIGHTS = {
    "llama": {**_ATTN, **_MLP, **_NORMS},
    "mistral": {**_ATTN, **_MLP, **_NORMS},
    "qwen2": {**_ATTN, **_MLP, **_NORMS},
    "qwen3": {**_ATTN, **_MLP, **_NORMS, **_QK_NORMS},
    "gpt2": {
        "q_proj": ("attn.c_attn.weight", 0),
        "k_proj": ("attn.c_attn.weight", 1),
        "v_proj": ("attn.c_attn.weight", 2),
        "o_proj": ("attn.c_proj.weight", None),
        "up_proj": ("mlp.c_fc.weight", None),
        "down_proj": ("mlp.c_proj.weight", None),
        "input_layernorm": ("ln_1.weight", None),
        "post_attention_layernorm": ("ln_2.weight", None),
    },
    "gpt_neox": {
        "o_proj": ("attention.dense.weight", None),
        "up_proj": ("mlp.dense_h_to_4h.weight", None),
        "down_proj": ("mlp.dense_4h_to_h.weight", None),
        **_NORMS,
    },
    "olmo2": {
        **_ATTN,
        **_MLP,
        **_QK_NORMS,
        "post_attention_layernorm": ("post_attention_layernorm.weight", None),
        "post_feedforward_layernorm": ("post_feedforward_layernorm.weight", None),
    },
    "phi3": {
        "o_proj": ("self_attn.o_proj.weight", None),
        "down_proj": ("mlp.down_proj.weight", None),
        **_NORMS,
    },
    "gemma2": _GEMMA,
    "gemma3_text": {**_GEMMA, **_QK_NORMS},
    "qwen2_moe": {**_ATTN, **_NORMS},
    "qwen3_moe": {**_ATTN, **_NORMS, **_QK_NORMS},
    "mixtral": {**_ATTN, **_NORMS},
}
#: RMSNorms that multiply by (1 + weight) (Gemma's).
GAIN_OFFSET = {"gemma2": 1.0, "gemma3_text": 1.0}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (as under ``make test``'s workers): a second
    thread only adds hand-offs, and on a busy machine waits."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tokenizer):
    """A 2-layer tiny random model of the family in float64, its norms' gains and biases
    drawn at random (Gemma's start at 0)."""
    tiny = models.tiny(request.param, n_layers=2, tokenizer=tokenizer, check=False)
    if request.param in ("qwen2_moe", "qwen3_moe", "mixtral"):
        tiny.hf.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in tiny.hf.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.nn.Parameter) and weight.dim() == 1:  # a norm
                for param in (weight, getattr(module, "bias", None)):
                    if param is not None:
                        param += 0.1 * torch.randn(param.shape, generator=generator)
    return models.from_hf(
        tiny.hf, tokenizer, name=f"tiny-{request.param}", device="cpu", dtype="float64", check=False
    )  # test_self_check checks it


@pytest.fixture(scope="module")
def prompts(factual, tokenizer):
    """Two factual pairs of different token lengths (batched runs are padded)."""
    first = factual[0]
    length = len(tokenizer(first.text)["input_ids"])
    other = next(p for p in factual if len(tokenizer(p.text)["input_ids"]) != length)
    return lsc.data.PromptSet([first, other], name="factual")


_RESULTS: dict = {}


def result(model, prompts, method, **options):
    """``lsc.<method>(model, prompts, **options)``, run once per model and options (the
    backend test compares the same results)."""
    key = (model.name, method, tuple(sorted(options.items())))
    if key not in _RESULTS:
        _RESULTS[key] = getattr(lsc, method)(model, prompts, progress=False, **options)
    return _RESULTS[key]


def assert_matches(actual, expected, what, rtol=RTOL):
    """Largest |actual - expected| at most ``rtol`` x the largest |expected| (not all 0)."""
    actual, expected = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = float(np.abs(expected).max())
    assert scale > 0, f"{what}: the reference is all zeros"
    error = float(np.abs(actual - expected).max())
    assert error <= rtol * scale, f"{what}: max |difference| {error:.3g} > {rtol:g} x {scale:.3g}"


def grid(da):
    """A (prompt, layer, head | component) result's values in the model's order, by label."""
    if "component" in da.dims:
        da = da.sel(component=list(COMPONENTS))
    return da.transpose("prompt", "layer", ...).values


# ------------------------------------------------------------------------ hand references


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _with_first(output, value):
    return (value, *output[1:]) if isinstance(output, tuple) else value


def hand_run(model, ids, edit=None):
    """One unpadded forward pass of the HF model with plain hooks at the sites ("in", layer)
    (the residual stream entering each block), ("z", layer) (the o_proj input, (pos, n_heads x
    d_head)), ("attn", layer) / ("mlp", layer) (the block's contribution to the residual
    stream) and ("final", -1) (the final norm's input). ``edit(site, value)`` (values with
    a batch dim of 1) may return a replacement.

    Returns:
        (logits at the last position, {site: (pos, width) value as the model used it}).
    """
    acts, handles = {}, []

    def apply(site, value):
        new = None if edit is None else edit(site, value)
        value = value if new is None else new
        acts[site] = value[0]
        return value

    def stream(site):
        return lambda m, a, k: _replace_hidden(a, k, apply(site, _hidden_of(a, k)))

    for layer in range(model.spec.n_layers):
        block = hand_block(model, layer)["block"]
        handles.append(block.register_forward_pre_hook(stream(("in", layer)), with_kwargs=True))
        handles.append(
            o_proj_module(model, layer).register_forward_pre_hook(
                lambda m, a, site=("z", layer): (apply(site, a[0]), *a[1:])
            )
        )
        for kind, module in zip(COMPONENTS, block_outputs(model, layer), strict=True):
            handles.append(
                module.register_forward_hook(
                    lambda m, a, out, site=(kind, layer): _with_first(out, apply(site, _first(out)))
                )
            )
    handles.append(
        hand_final_norm(model).register_forward_pre_hook(stream(("final", -1)), with_kwargs=True)
    )
    try:
        logits = model.hf(ids).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    return logits, acts


def _diff(logits, target, distractor):
    return logits[target] - logits[distractor]


def hand_block_effects(model, prompt, *, source, replacement):
    """(layer, component): metric change when one block's contribution on ``source``
    ("text" or "corrupt") is replaced by ``replacement(site, value)``."""
    tok = model.tokenizer
    ids = torch.tensor([tok(getattr(prompt, source))["input_ids"]])
    target, distractor = (
        tok(t, add_special_tokens=False)["input_ids"][0] for t in (prompt.target, prompt.distractor)
    )
    out = np.zeros((model.spec.n_layers, 2))
    with torch.no_grad():
        base = float(_diff(hand_run(model, ids)[0], target, distractor))
        for layer in range(model.spec.n_layers):
            for c, kind in enumerate(COMPONENTS):

                def edit(site, value, chosen=(kind, layer)):
                    return replacement(site, value) if site == chosen else None

                logits, _ = hand_run(model, ids, edit)
                out[layer, c] = float(_diff(logits, target, distractor)) - base
    return out


def hand_gradient_scores(model, prompt, steps=1, by_position=False):
    """Attribution patching (``steps=1``) or its integrated-gradient variant by plain
    autograd: the gradient of the corrupt run's logit difference w.r.t. each head's o_proj
    input slice and each block's output, averaged over the runs whose block-0 input is
    corrupt + k / steps (clean - corrupt), k = 0..steps-1, times (clean - corrupt activation),
    summed over positions.

    Returns:
        (heads (layer, head), blocks (layer, component)) float64 arrays; ``by_position``:
        (heads (layer, head, pos), blocks (layer, component, pos), resid (layer, pos)), the
        products not summed over positions, the residual stream entering each block too.
    """
    spec = model.spec
    clean_ids, corrupt_ids, target, distractor = _pair(model, prompt)
    with torch.no_grad():
        _, clean = hand_run(model, clean_ids)
    sites = [site for site in clean if site[0] in ("z", *COMPONENTS, "in")]
    grads, corrupt = dict.fromkeys(sites, 0.0), {}
    for k in range(steps):
        leaves = {site: torch.zeros_like(clean[site], requires_grad=True) for site in sites}

        def edit(site, value, alpha=k / steps, leaves=leaves):
            if site == ("in", 0) and alpha:
                value = value + alpha * (clean[site][None] - value)
            return value + leaves[site][None] if site in leaves else None

        logits, acts = hand_run(model, corrupt_ids, edit)
        found = torch.autograd.grad(_diff(logits, target, distractor), list(leaves.values()))
        for site, grad in zip(sites, found, strict=True):
            grads[site] = grads[site] + grad.double() / steps
            if k == 0:
                corrupt[site] = acts[site].detach()
    n_pos = clean_ids.shape[1]
    heads = np.zeros((spec.n_layers, spec.n_heads, n_pos))
    blocks = np.zeros((spec.n_layers, 2, n_pos))
    resid = np.zeros((spec.n_layers, n_pos))
    for site in sites:
        kind, layer = site
        product = grads[site] * (clean[site] - corrupt[site]).double()  # (pos, width)
        if kind == "z":
            heads[layer] = product.view(n_pos, spec.n_heads, spec.d_head).sum(2).T.numpy()
        elif kind == "in":
            resid[layer] = product.sum(1).numpy()
        else:
            blocks[layer, COMPONENTS.index(kind)] = product.sum(1).numpy()
    if by_position:
        return heads, blocks, resid
    return heads.sum(-1), blocks.sum(-1)


def hand_positional_patching(model, prompt, level, cells):
    """(layer, [head | component,] cell) exact patching by hand, unpadded: the corrupt
    run's logit difference change when one component's clean value is patched in at the
    positions of one cell (``cells``: lists of positions; an empty one is NaN)."""
    spec = model.spec
    clean_ids, corrupt_ids, target, distractor = _pair(model, prompt)
    with torch.no_grad():
        _, clean = hand_run(model, clean_ids)
        base = float(_diff(hand_run(model, corrupt_ids)[0], target, distractor))
    parts = {
        "resid": [("in", None)],
        "head": [("z", head) for head in range(spec.n_heads)],
        "block": [(kind, None) for kind in COMPONENTS],
    }[level]
    out = np.full((spec.n_layers, len(parts), len(cells)), np.nan)
    for layer in range(spec.n_layers):
        for k, (kind, head) in enumerate(parts):
            columns = (
                slice(None) if head is None else slice(head * spec.d_head, (head + 1) * spec.d_head)
            )
            for c, positions in enumerate(cells):
                if not positions:
                    continue

                def edit(site, value, chosen=(kind, layer), at=positions, cols=columns):
                    if site != chosen:
                        return None
                    value = value.clone()
                    value[0, at, cols] = clean[site][at, cols]
                    return value

                with torch.no_grad():
                    logits, _ = hand_run(model, corrupt_ids, edit)
                out[layer, k, c] = float(_diff(logits, target, distractor)) - base
    return out[:, 0] if level == "resid" else out


def hand_dla(model, prompt):
    """Direct logit attribution by hand at the last position: each head's share of the
    o_proj output (its input columns x its weight columns; through a post-norm at the run's
    own scale, ``hand_senders``) and each block's output, through the final norm with its
    scale frozen at the run's and the unembedding onto W_U[target] - W_U[distractor]
    (logits before any soft-capping). A LayerNorm also centres each share.

    Returns:
        heads (layer, head), blocks (layer, component), the embedding's share and the
        logit difference before soft-capping (the shares, the embedding's and the final
        LayerNorm bias's add up to it).
    """
    spec, tok, arch = model.spec, model.tokenizer, model.hf.config.model_type
    ids = torch.tensor([tok(prompt.text)["input_ids"]])
    target, distractor = (
        tok(t, add_special_tokens=False)["input_ids"][0] for t in (prompt.target, prompt.distractor)
    )
    senders, _ = hand_senders(model, ids)
    with torch.no_grad():
        _, acts = hand_run(model, ids)
        norm = hand_final_norm(model)
        resid = acts[("final", -1)][-1].double()
        unembed = model.hf.get_output_embeddings().weight.double()
        direction = unembed[target] - unembed[distractor]
        layer_norm = isinstance(norm, torch.nn.LayerNorm)
        eps = norm.eps if hasattr(norm, "eps") else norm.variance_epsilon
        centred = resid - resid.mean() if layer_norm else resid
        scale = torch.rsqrt(centred.pow(2).mean() + eps)
        gain = norm.weight.double() + (0.0 if layer_norm else GAIN_OFFSET.get(arch, 0.0))
        effective = direction * gain * scale

        def share(part):
            part = part.double()
            return float((part - part.mean() if layer_norm else part) @ effective)

        heads = np.array(
            [
                [share(senders[f"L{layer}.H{h}"][-1]) for h in range(spec.n_heads)]
                for layer in range(spec.n_layers)
            ]
        )
        blocks = np.array(
            [
                [share(acts[(kind, layer)][-1]) for kind in COMPONENTS]
                for layer in range(spec.n_layers)
            ]
        )
        bias = float(norm.bias.double() @ direction) if layer_norm else 0.0
        logit_diff = float(norm(resid[None].to(model.dtype))[0].double() @ direction)
    return heads, blocks, share(acts[("in", 0)][-1]) + bias, logit_diff


def hand_lens(model, prompt):
    """(layer, pos) p(target) of the residual stream after each block: the final norm and
    unembedding (and the final soft-capping) of ``output_hidden_states`` by hand; after the
    last block, the model's own output."""
    tok, hf = model.tokenizer, model.hf
    ids = torch.tensor([tok(prompt.text)["input_ids"]])
    target = tok(prompt.target, add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        rows = []
        for layer in range(model.spec.n_layers - 1):
            logits = hf.get_output_embeddings()(
                hand_final_norm(model)(out.hidden_states[layer + 1])
            )
            cap = getattr(hf.config, "final_logit_softcapping", None)
            rows.append(torch.tanh(logits / cap) * cap if cap else logits)
        rows.append(out.logits)
    return np.stack([torch.softmax(r[0].double(), -1)[:, target].numpy() for r in rows])


def hand_patterns(model, prompt):
    """(layer, head, query, key) attention weights of the HF model's eager attention."""
    hf = model.hf
    previous = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        ids = torch.tensor([model.tokenizer(prompt.text)["input_ids"]])
        with torch.no_grad():
            attentions = hf(ids, output_attentions=True).attentions
    finally:
        hf.set_attn_implementation(previous)
    return np.stack([a[0].double().numpy() for a in attentions])


def hand_masked_nll(model, prompts, mask):
    """Mean over prompts of the mean next-token NLL of text + target, with every block whose
    ``mask`` (layer, component) entry is 0 skipped (its output zeroed: the residual passes)."""
    handles = []
    for layer in range(model.spec.n_layers):
        for c, module in enumerate(block_outputs(model, layer)):
            if not mask[layer][c]:
                handles.append(
                    module.register_forward_hook(
                        lambda m, a, out: _with_first(out, torch.zeros_like(_first(out)))
                    )
                )
    losses = []
    try:
        for p in prompts:
            ids = torch.tensor([model.tokenizer(p.text + p.target)["input_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(model.hf(ids).logits[0, :-1].double(), -1)
            losses.append(-float(logp.gather(-1, ids[0, 1:, None]).mean()))
    finally:
        for handle in handles:
            handle.remove()
    return float(np.mean(losses))


def hand_parameters(model):
    """{(layer or None, component): (parameter, column slice or None)} from ``HAND_WEIGHTS``
    and the model-level embedding, unembedding (when not tied) and final norm."""
    hf, arch, out = model.hf, model.hf.config.model_type, {}
    for layer in range(model.spec.n_layers):
        block = hand_block(model, layer)["block"]
        for component, (path, part) in HAND_WEIGHTS[arch].items():
            param = block.get_parameter(path)
            columns = None
            if part is not None:  # GPT-2's Conv1D c_attn: (d_model, 3 d_model), [q | k | v]
                width = param.shape[1] // 3
                columns = slice(part * width, (part + 1) * width)
            out[layer, component] = (param, columns)
    out[None, "embed"] = (hf.get_input_embeddings().weight, None)
    if hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
        out[None, "lm_head"] = (hf.get_output_embeddings().weight, None)
    out[None, "final_norm"] = (hand_final_norm(model).weight, None)
    return out


def _view(param, columns):
    return param if columns is None else param[:, columns]


def _cells(ds, keys):
    """The values of ``ds`` (a weight map) at ``keys`` ((layer or None, component))."""
    return np.array(
        [
            float(
                ds["model_level"].sel(component=c)
                if layer is None
                else ds["per_layer"].sel(layer=layer, component=c)
            )
            for layer, c in keys
        ]
    )


# ----------------------------------------------------------------------------------- tests


def test_every_tiny_family_is_in_the_matrix():
    assert set(FAMILIES) == set(_tiny_configs(10, 1)) == set(HAND_WEIGHTS)


def test_self_check(model):
    checked = lsc.check(model)
    assert checked.attrs["passed"]
    assert max(float(checked[name].max()) for name in ("heads", "residual", "logits")) < 1e-5


def test_ablation_matches_hand_hooks(model, prompts):
    heads = result(model, prompts, "ablation", level="head")
    assert_matches(grid(heads), reference_zero_ablation(model, prompts), "head ablation")
    blocks = result(model, prompts, "ablation", level="block")
    expected = [
        hand_block_effects(model, p, source="text", replacement=lambda s, v: torch.zeros_like(v))
        for p in prompts
    ]
    assert_matches(grid(blocks), expected, "block ablation")


def test_activation_patching_matches_hand_hooks(model, prompts):
    heads = result(model, prompts, "activation_patching", level="head")
    assert_matches(grid(heads), reference_activation_patching(model, prompts), "head patching")
    blocks = result(model, prompts, "activation_patching", level="block")
    expected = []
    for p in prompts:
        with torch.no_grad():
            _, clean = hand_run(model, torch.tensor([model.tokenizer(p.text)["input_ids"]]))
        expected.append(
            hand_block_effects(
                model, p, source="corrupt", replacement=lambda s, v, clean=clean: clean[s][None]
            )
        )
    assert_matches(grid(blocks), expected, "block patching")


@pytest.mark.parametrize("estimator", ["atp", "ig"])
def test_gradient_estimates_match_plain_autograd(model, prompts, estimator):
    scores = result(model, prompts, "attribution_patching", level="all", estimator=estimator)
    steps = int(scores["heads"].attrs["steps"])
    assert steps == (1 if estimator == "atp" else DEFAULT_IG_STEPS)
    expected = [hand_gradient_scores(model, p, steps) for p in prompts]
    assert_matches(grid(scores["heads"]), [e[0] for e in expected], f"{estimator} heads")
    assert_matches(grid(scores["blocks"]), [e[1] for e in expected], f"{estimator} blocks")


def _by_position(values, width):
    """Per-prompt arrays (..., pos) padded with NaN to ``width`` positions."""
    pad = [(0, 0)] * (values.ndim - 1) + [(0, width - values.shape[-1])]
    return np.pad(values, pad, constant_values=np.nan)


def assert_cells_match(actual, expected, what):
    """As ``assert_matches``, over the cells the reference computes; the others NaN in both."""
    actual, expected = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=what)
    known = ~np.isnan(expected)
    assert_matches(actual[known], expected[known], what)


@pytest.mark.parametrize("level", ["resid", "head", "block"])
def test_patching_by_position_matches_hand_hooks(model, prompts, level):
    """Exact patching one token position at a time (prompts of different lengths, padded
    in one call), against unpadded hand hooks; positions past a prompt's end are NaN."""
    got = result(model, prompts, "activation_patching", level=level, positions="each")
    width = got.sizes["pos"]
    expected = []
    for p in prompts:
        length = len(model.tokenizer(p.text)["input_ids"])
        cells = [[pos] for pos in range(length)]
        expected.append(_by_position(hand_positional_patching(model, p, level, cells), width))
    assert_cells_match(grid(got), expected, f"{level} patching by position")


def test_patching_by_span_matches_hand_hooks(model, prompts):
    """Heads patched at all of a span's tokens together, the spans found by the rule
    (characters overlap) from the tokenizer's offsets, against hand hooks."""
    got = result(model, prompts, "activation_patching", level="head", positions="spans")
    names = list(got["span"].values)
    assert names[-1] == "other"
    expected = []
    for p in prompts:
        held = span_positions_by_rule(model.tokenizer, p)
        expected.append(
            hand_positional_patching(model, p, "head", [held.get(n, []) for n in names])
        )
    assert_cells_match(grid(got), expected, "head patching by span")


def test_attribution_by_position_matches_plain_autograd_and_adds_up(model, prompts):
    """AtP per position (heads, blocks and the residual stream) equals plain autograd, and
    each estimate's positions and spans add up to its all-positions score."""
    by_pos = result(model, prompts, "attribution_patching", level="all", positions="each")
    width = by_pos["heads"].sizes["pos"]
    expected = [hand_gradient_scores(model, p, by_position=True) for p in prompts]
    for name, k in (("heads", 0), ("blocks", 1)):
        want = [_by_position(e[k], width) for e in expected]
        assert_cells_match(grid(by_pos[name]), want, f"AtP {name} by position")
    resid = result(model, prompts, "attribution_patching", level="resid", positions="each")
    assert_cells_match(grid(resid), [_by_position(e[2], width) for e in expected], "AtP resid")
    whole = result(model, prompts, "attribution_patching", level="all")
    by_span = result(model, prompts, "attribution_patching", level="all", positions="spans")
    for name in ("heads", "blocks"):
        assert_matches(grid(by_pos[name].sum("pos")), grid(whole[name]), f"{name}: positions")
        assert_matches(grid(by_span[name].sum("span")), grid(whole[name]), f"{name}: spans")


def test_integrated_gradients_of_the_residual_stream_by_position(model, prompts):
    """IG at level "resid": its input site (the stream entering block 0) is one of the sites
    it scores, interpolated once, not once per time it is named."""
    got = result(
        model, prompts, "attribution_patching", level="resid", positions="each", estimator="ig"
    )
    steps = int(got.attrs["steps"])
    width = got.sizes["pos"]
    expected = [
        _by_position(hand_gradient_scores(model, p, steps, by_position=True)[2], width)
        for p in prompts
    ]
    assert_cells_match(grid(got), expected, "IG resid by position")


def test_direct_logit_attribution_matches_the_hand_projection(model, prompts):
    heads = result(model, prompts, "direct_logit_attribution", level="head")
    blocks = result(model, prompts, "direct_logit_attribution", level="block")
    expected = [hand_dla(model, p) for p in prompts]
    assert_matches(grid(heads), [e[0] for e in expected], "head DLA")
    assert_matches(grid(blocks), [e[1] for e in expected], "block DLA")
    for p_heads, p_blocks, embed, logit_diff in expected:  # the reference adds up
        assert_matches([embed + p_blocks.sum()], [logit_diff], "shares and the logit diff")
        if o_proj_module(model, 0).bias is None:  # a bias belongs to no head
            assert_matches(p_heads.sum(1), p_blocks[:, 0], "heads and their block")


def test_logit_lens_matches_the_final_norm_and_unembedding(model, prompts):
    lens = result(model, prompts, "logit_lens")
    for i, p in enumerate(prompts):
        expected = hand_lens(model, p)
        got = lens.isel(prompt=i).values
        assert np.isnan(got[:, expected.shape[1] :]).all()
        assert_matches(got[:, : expected.shape[1]], expected, f"logit lens, prompt {i}")


def test_attention_patterns_match_hf_eager_attention(model, prompts):
    expected_by_prompt = [hand_patterns(model, p) for p in prompts]
    for layer in range(model.spec.n_layers):
        pattern = result(model, prompts, "attention_pattern", layer=layer)
        for i, all_layers in enumerate(expected_by_prompt):
            expected = all_layers[layer]
            n = expected.shape[-1]
            got = pattern.isel(prompt=i).values
            assert np.isnan(got[:, n:]).all() and np.isnan(got[:, :, n:]).all()
            assert_matches(got[:, :n, :n], expected, f"pattern, layer {layer}, prompt {i}")


def test_head_gating_loss_is_the_hand_gated_loss(model, prompts):
    spec = model.spec
    gates = torch.rand(2, spec.n_layers, spec.n_heads, generator=torch.Generator().manual_seed(0))
    gates[1, 0, 1] = gates[1, 1, 2] = 0  # heads removed
    losses = lsc.task_loss(model, prompts, gates).numpy()
    expected = [hand_target_nll(model, prompts, g.numpy()) for g in gates]
    assert_matches(losses, expected, "task_loss")
    fit = lsc.head_gating(model, prompts, seeds=1, max_steps=2, batch_size=2, progress=False)
    for name in ("gate", "gate_plus", "gate_minus"):
        values = fit[name].values
        assert values.shape == (1, spec.n_layers, spec.n_heads)
        assert ((values >= 0) & (values <= 1)).all(), name
    expected = hand_target_nll(model, prompts, fit["gate_plus"].values[0])
    assert_matches(fit["val_loss_plus"].values, [expected], "the fit's validation loss")


def test_block_mask_loss_is_the_hand_skipped_loss(model, prompts, factual):
    masks = torch.tensor([[[1, 1], [1, 1]], [[0, 1], [1, 0]], [[1, 0], [0, 0]]])
    losses = lsc.masked_loss(model, prompts, masks).numpy()
    assert_matches(losses, [hand_masked_nll(model, prompts, m) for m in masks], "masked_loss")
    texts = factual[:4]
    rng = np.random.default_rng(0)
    clusters = cluster.kmeans(rng.normal(size=(len(texts), 8)), 2, prompts=texts)
    fit = lsc.block_masks(model, texts, clusters=clusters, max_steps=2, progress=False)
    keep = fit["keep_prob"].values
    assert keep.shape == (2, model.spec.n_layers, 2) and ((keep >= 0) & (keep <= 1)).all()
    assert (fit["mask"].sum(("layer", "component")) == round(0.7 * 2 * 2)).all()
    mask = fit["mask"].sel(cluster=0)
    expected = hand_masked_nll(model, prompts, mask.transpose("layer", "component").values)
    assert_matches(lsc.masked_loss(model, prompts, mask).numpy(), [expected], "fitted mask")


def test_weight_importance_is_the_hand_gradient_times_weight(model, prompts):
    ds = lsc.weight_importance(model, prompts, progress=False)
    cells = hand_parameters(model)
    params = list({id(p): p for p, _ in cells.values()}.values())
    for param in params:
        param.requires_grad_(True)
    try:
        total, count = 0.0, 0
        for p in prompts:
            ids = torch.tensor([model.tokenizer(p.text + p.target)["input_ids"]])
            logp = torch.log_softmax(model.hf(ids).logits[0, :-1].double(), -1)
            total = total - logp.gather(-1, ids[0, 1:, None]).sum()
            count += ids.shape[1] - 1
        grads = dict(zip(map(id, params), torch.autograd.grad(total / count, params), strict=True))
    finally:
        for param in params:
            param.requires_grad_(False)
    expected = [
        float((_view(param, cols) * _view(grads[id(param)], cols)).abs().sum())
        for param, cols in cells.values()
    ]
    assert_matches(_cells(ds, list(cells)), expected, "weight importance")
    per_layer = ds["per_layer"].dropna("component", how="all")
    assert set(per_layer["component"].values) == set(HAND_WEIGHTS[model.hf.config.model_type])
    tied = (None, "lm_head") not in cells
    assert bool(np.isnan(float(ds["model_level"].sel(component="lm_head")))) == tied


def test_weight_change_of_a_hand_edited_copy(model):
    cells = hand_parameters(model)
    edited = copy.copy(model)
    edited.hf = copy.deepcopy(model.hf)
    edited_cells = hand_parameters(edited)
    generator = torch.Generator().manual_seed(0)
    expected = {}
    with torch.no_grad():
        for key, (param, cols) in edited_cells.items():
            if key[0] == 0:  # layer 0 stays as it was
                expected[key] = 0.0
                continue
            view = _view(param, cols)
            change = 0.1 * torch.randn(view.shape, generator=generator, dtype=view.dtype)
            expected[key] = float(change.norm() / _view(*cells[key]).norm())
            view += change
    change = lsc.weight_change(model, edited)
    np.testing.assert_allclose(_cells(change, list(expected)), list(expected.values()), rtol=1e-5)


#: One call per site kind the backend edits or reads: head outputs edited on a resumed
#: pass, block outputs edited on a resumed pass, gradients at heads and blocks with the
#: block-0 input edited, heads and the final residual stream read, each block's residual
#: stream read, attention weights read.
TL_CALLS = (
    ("activation_patching", dict(level="head")),
    ("ablation", dict(level="block")),
    ("attribution_patching", dict(level="all", estimator="ig")),
    ("direct_logit_attribution", dict(level="head")),
    ("logit_lens", {}),
    ("attention_pattern", dict(layer=1)),
)


def test_transformer_lens_agrees_with_nnsight(model, prompts):
    for method, options in TL_CALLS:
        ours = result(model, prompts, method, **options)
        theirs = getattr(lsc, method)(
            model, prompts, backend="transformer_lens", progress=False, **options
        )
        pairs = (
            [(v, ours[v], theirs[v]) for v in ours.data_vars]
            if hasattr(ours, "data_vars")
            else [("", ours, theirs)]
        )
        for name, a, b in pairs:
            assert b.attrs["backend"] == "transformer_lens"
            a, b = a.values, b.values
            assert (np.isnan(a) == np.isnan(b)).all()
            assert_matches(
                np.nan_to_num(b), np.nan_to_num(a), f"{method} {options} {name}", RTOL_BACKENDS
            )
