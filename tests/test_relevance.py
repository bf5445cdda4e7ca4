"""Relevance rules (``sweep/relevance.py``): forward outputs untouched, the model restored,
relevance conserved where the rules promise it, and the same coefficients on both backends."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import pytest
import torch

import lenscape as lsc
from lenscape.sweep import metrics, relevance
from lenscape.sweep.backend import get_backend
from lenscape.sweep.inputs import Inputs, tokenize
from lenscape.sweep.relevance import RULE_SETS, Rules, norm_input_gradient, relevance_rules

#: Families the rules cover on both backends, and those they cover on nnsight only (the
#: TransformerLens bridge computes LayerNorms, soft-capping and routing in its own code).
FAMILIES = ("llama", "qwen3", "gemma3", "olmo2")
NNSIGHT_ONLY = ("gpt2", "gpt_neox", "phi3", "gemma2", "qwen2_moe", "qwen3_moe", "mixtral")
EVERY = FAMILIES + NNSIGHT_ONLY


def _tiny_gemma3(tokenizer, dtype):
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=4,
        final_logit_softcapping=None,
        tie_word_embeddings=False,
    )
    hf_model = transformers.Gemma3ForCausalLM(config)
    hf_model.config.architectures = [type(hf_model).__name__]
    # Random norms and weights of the usual size, so every rule has something to change.
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    return lsc.from_hf(hf_model, tokenizer, name="tiny-gemma3", device="cpu", dtype=dtype)


def _tiny_gemma2(tokenizer, dtype):
    """Gemma 2 with attention soft-capping that acts (scores of the order of the cap 1.0)
    and no final soft-capping (the logits linear in the last norm's output)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=None,
        tie_word_embeddings=False,
    )
    hf_model = transformers.Gemma2ForCausalLM(config)
    hf_model.config.architectures = [type(hf_model).__name__]
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
            elif "q_proj" in name or "k_proj" in name:
                param.normal_(0.0, 0.1)
    return lsc.from_hf(hf_model, tokenizer, name="tiny-gemma2", device="cpu", dtype=dtype)


def _tiny(family: str, tokenizer, dtype: str = "float32") -> lsc.LensModel:
    if family == "gemma3":
        return _tiny_gemma3(tokenizer, dtype)
    if family == "gemma2":
        return _tiny_gemma2(tokenizer, dtype)
    base = lsc.models.tiny(family, n_layers=3, seed=0, tokenizer=tokenizer)
    hf = copy.deepcopy(base.hf)
    if base.spec.computation.n_experts and dtype == "float64":
        hf.set_experts_implementation("eager")  # grouped_mm has no float64
    return lsc.from_hf(hf, tokenizer, name=base.name, dtype=dtype)


def _without_biases(model: lsc.LensModel) -> lsc.LensModel:
    """``model`` with every bias set to 0 (GPT-2, GPT-NeoX and Qwen2-MoE have some), so
    that zero in gives zero out and the rules' conservation is exact."""
    with torch.no_grad():
        for name, param in model.hf.named_parameters():
            if name.endswith("bias"):
                param.zero_()
    return model


def _refused(model: lsc.LensModel, rules: str) -> bool:
    """Whether ``rules`` refuse ``model``: the secant rules on routed experts."""
    secant = "secant" in (RULE_SETS[rules].activation, RULE_SETS[rules].product)
    return bool(model.spec.computation.n_experts) and secant


@pytest.fixture(scope="module", params=EVERY)
def model(request, tokenizer):
    return _tiny(request.param, tokenizer)


@pytest.fixture(scope="module", params=FAMILIES)
def bridged(request, tokenizer):
    """The families whose rules run on the TransformerLens backend too."""
    return _tiny(request.param, tokenizer)


@pytest.fixture(scope="module", params=EVERY)
def model64(request, tokenizer):
    """Float64, without biases."""
    return _without_biases(_tiny(request.param, tokenizer, "float64"))


def _first_batch(model, prompts):
    """All of ``prompts`` in one right-padded batch (logit difference, nnsight)."""
    tokens = tokenize(model, prompts, needs_corrupt=True, needs_distractor=True)
    return Inputs(model, tokens, "logit_diff", "block", "nnsight", len(prompts), "right").batch(0)


@pytest.fixture(scope="module")
def batch(tiny_llama, factual):
    """Three factual pairs, right-padded (their clean texts differ in length)."""
    return _first_batch(tiny_llama, factual[:3])


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.hf(
            batch.clean.input_ids,
            attention_mask=batch.clean.attention_mask,
            position_ids=batch.clean.position_ids,
        ).logits


def _logit_diff(logits: torch.Tensor, batch) -> torch.Tensor:
    """The logit difference in the model's own precision (``metrics.compute`` rounds to
    float32, too coarse for the float64 exactness checks)."""
    rows = torch.arange(len(logits))
    return logits[rows, batch.target] - logits[rows, batch.distractor]


def _coefficients(model, batch, sites, *, backend="nnsight", relevance=None):
    """Metric (logit difference) and its gradients at ``sites`` on the clean prompts (the
    corrupt ones recorded first as the reference, where ``relevance``'s rules need one)."""
    runner = get_backend(model, backend)
    if relevance is not None and relevance.rules.needs_reference:
        with torch.no_grad(), relevance.reference():
            runner.run(batch.corrupt, sites=sites)
    run = runner.run(batch.clean, sites=sites, grad=True)
    value = _logit_diff(run.logits, batch)
    grads = torch.autograd.grad(value.sum(), [run.acts[site] for site in sites])
    return value.detach(), dict(zip(sites, grads, strict=True)), run


def _hook_count(module: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


@pytest.mark.parametrize("rules", list(RULE_SETS))
def test_forward_outputs_unchanged(model, batch, rules):
    if _refused(model, rules):
        with pytest.raises(ValueError, match="top-k routing"), relevance_rules(model, rules):
            pass
        return
    sites = [("z", 1), ("attn", 1), ("mlp", 1)]
    before = get_backend(model, "nnsight").run(batch.clean, sites=sites)
    with relevance_rules(model, rules) as relevance:
        assert relevance.rules == RULE_SETS[rules]
        inside = _logits(model, batch)
        _, _, run = _coefficients(model, batch, sites, relevance=relevance)
    torch.testing.assert_close(inside, _logits(model, batch), atol=1e-6, rtol=0)
    torch.testing.assert_close(run.logits.detach(), before.logits, atol=1e-6, rtol=0)
    for site in sites:
        torch.testing.assert_close(run.acts[site].detach(), before.acts[site], atol=1e-6, rtol=0)


def test_forward_outputs_unchanged_on_transformer_lens(bridged, batch):
    runner = get_backend(bridged, "transformer_lens")
    with torch.no_grad():
        before = runner.run(batch.clean, sites=[("mlp", 1)])
        with relevance_rules(bridged, "relp-ah", backend="transformer_lens"):
            inside = runner.run(batch.clean, sites=[("mlp", 1)])
    torch.testing.assert_close(inside.logits, before.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(inside.acts[("mlp", 1)], before.acts[("mlp", 1)], atol=0, rtol=0)


@pytest.mark.parametrize("fail", [False, True])
def test_model_restored_after_the_block(model, batch, fail):
    """Hooks removed and the attention function restored, on the TransformerLens bridge too
    where the rules run on it: the same logits and plain gradients (rules=None) after."""
    sites = [("mlp", 1), ("attn", 0)]
    logits, (_, plain, _) = _logits(model, batch), _coefficients(model, batch, sites)
    backend = "transformer_lens" if model.name in [f"tiny-{f}" for f in FAMILIES] else "nnsight"
    bridge = get_backend(model, backend).bridge if backend != "nnsight" else torch.nn.Module()
    hooks = _hook_count(model.hf), _hook_count(bridge)
    implementation = model.hf.config._attn_implementation
    failing = pytest.raises(RuntimeError, match="inside") if fail else contextlib.nullcontext()
    with failing, relevance_rules(model, "relp-ah", backend=backend):
        assert model.hf.config._attn_implementation != implementation
        assert (_hook_count(model.hf), _hook_count(bridge)) != hooks
        if fail:
            raise RuntimeError("failure inside the block")
    assert (_hook_count(model.hf), _hook_count(bridge)) == hooks
    assert model.hf.config._attn_implementation == implementation
    torch.testing.assert_close(_logits(model, batch), logits, atol=0, rtol=0)
    _, after, _ = _coefficients(model, batch, sites)
    for site in sites:
        torch.testing.assert_close(after[site], plain[site], atol=0, rtol=0)


def test_blocks_do_not_nest(tiny_llama):
    with (
        relevance_rules(tiny_llama),
        pytest.raises(ValueError, match="do not nest"),
        relevance_rules(tiny_llama, "ah"),
    ):
        pass


@pytest.mark.parametrize("layer", [0, 2])
def test_relevance_conserved_and_relp_exact_for_a_patch_to_zero(model64, factual, layer):
    """Under RelP's rules with the AH-rule every module conserves relevance, so the
    relevance of the residual stream entering any block sums (over positions) to the metric;
    patching it to zero sends every activation after it, and the metric, to zero (no biases),
    so RelP's estimate of that patch is exact. Plain gradients (AtP) are not."""
    batch = _first_batch(model64, factual[:3])
    site = ("resid_pre", layer)
    with relevance_rules(model64, "relp-ah"):
        metric, grads, run = _coefficients(model64, batch, [site])
    resid = run.acts[site].detach()
    relevance = torch.einsum("bpd,bpd->b", resid, grads[site])
    # HF norms compute in float32 even in a float64 model: equal to float32 rounding.
    torch.testing.assert_close(relevance, metric, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        zeroed = get_backend(model64, "nnsight").run(
            batch.clean, sites=[site], edit=lambda s, value: torch.zeros_like(value)
        )
    exact = _logit_diff(zeroed.logits, batch) - metric
    estimate = torch.einsum("bpd,bpd->b", -resid, grads[site])
    torch.testing.assert_close(estimate, exact, atol=1e-6, rtol=1e-6)
    _, plain, _ = _coefficients(model64, batch, [site])
    assert not torch.allclose(torch.einsum("bpd,bpd->b", -resid, plain[site]), exact, atol=1e-3)


def test_secant_rules_split_an_mlps_change_exactly(model64):
    """The secant rules through an MLP (the activation's secant, and in a gated MLP the
    product split at its midpoints: separate or fused gate and up projections) are exact:
    (x1 - x0) . c sums to the change of the readout, including where x1 and x0 are within
    ``SECANT_TOLERANCE`` (the derivative at the midpoint)."""
    if _refused(model64, "secant"):  # refused before any pass, with the reason
        with pytest.raises(ValueError, match="top-k routing"), relevance_rules(model64, "secant"):
            pass
        return
    mlp = model64.module(model64.spec.computation.mlp, 1)
    generator = torch.Generator().manual_seed(0)
    x1 = torch.randn(2, 5, 64, generator=generator, dtype=torch.float64)
    x0 = torch.randn(2, 5, 64, generator=generator, dtype=torch.float64)
    x0[:, :2] = x1[:, :2] + 1e-6  # first positions: nearly equal inputs
    x0.requires_grad_(True)
    readout = torch.randn(2, 5, 64, generator=generator, dtype=torch.float64)
    with relevance_rules(model64, "secant") as relevance:
        with torch.no_grad(), relevance.reference():
            y1 = mlp(x1)
        y0 = mlp(x0)
        (coefficient,) = torch.autograd.grad((y0 * readout).sum(), x0)
    total = ((x1 - x0.detach()) * coefficient).sum((0, 2))
    torch.testing.assert_close(total, ((y1 - y0.detach()) * readout).sum((0, 2)))


def test_shortened_secant_rules_split_an_mlps_partial_change_exactly(model64):
    """With ``reach`` r < 1 each operation's segment ends r of the way to the reference, the
    activation and the product evaluated there, so within an MLP the coefficients split the
    change over the shortened segment exactly: r (x1 - x0) . c = y(x0 + r (x1 - x0)) - y(x0)
    (and not the whole change y(x1) - y(x0), which the full secant splits)."""
    rules = RULE_SETS["secant-0.9"]
    if _refused(model64, "secant-0.9"):  # refused before any pass, with the reason
        with pytest.raises(ValueError, match="top-k routing"), relevance_rules(model64, rules):
            pass
        return
    mlp = model64.module(model64.spec.computation.mlp, 1)
    generator = torch.Generator().manual_seed(1)
    x1, x0, readout = torch.randn(3, 2, 5, 64, generator=generator, dtype=torch.float64)
    x0.requires_grad_(True)
    with relevance_rules(model64, rules) as relevance:
        with torch.no_grad(), relevance.reference():
            y1 = mlp(x1)
        y0 = mlp(x0)
        (coefficient,) = torch.autograd.grad((y0 * readout).sum(), x0)
    step = rules.reach * (x1 - x0.detach())
    with torch.no_grad():
        partial = ((mlp(x0 + step) - y0) * readout).sum((0, 2))
    total = (step * coefficient).sum((0, 2))
    torch.testing.assert_close(total, partial)
    assert not torch.allclose(total, ((y1 - y0.detach()) * readout).sum((0, 2)), rtol=1e-3)


def test_shortened_secant_attention_splits_its_partial_change(tokenizer):
    """The secant attention rule with ``reach`` r: (dq, dk, dv) . r (q1 - q0, ...) sums to
    the change of the read-out output between q0, k0, v0 and the point r of the way to
    q1, k1, v1 (soft-capped scores, Gemma 2), up to the softmax's quadrature."""
    model = _tiny_gemma2(tokenizer, "float64")
    reach = 0.6
    rules = Rules(norm="gradient", activation="gradient", product="gradient", attention="secant")
    generator = torch.Generator().manual_seed(0)
    q1, q0 = torch.randn(2, 1, 4, 6, 16, generator=generator, dtype=torch.float64)
    k1, k0, v1, v0 = torch.randn(4, 1, 2, 6, 16, generator=generator, dtype=torch.float64)
    q0, k0, v0 = (t.clone().requires_grad_(True) for t in (q1 + 0.3 * q0, k1 + 0.3 * k0, v0))
    readout = torch.randn(1, 6, 4, 16, generator=generator, dtype=torch.float64)
    mask = torch.full((6, 6), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    steps = [reach * (end - start.detach()) for end, start in ((q1, q0), (k1, k0), (v1, v0))]
    with relevance_rules(model, dataclasses.replace(rules, reach=reach)) as relevance:
        call = _capped_attention_call(model)
        with torch.no_grad(), relevance.reference():
            call(q1, k1, v1, mask[None, None])
        out0 = call(q0, k0, v0, mask[None, None])
        grads = torch.autograd.grad((out0 * readout).sum(), (q0, k0, v0))
        with torch.no_grad():  # no gradient: the attention's own output
            ends = [s.detach() + step for s, step in zip((q0, k0, v0), steps, strict=True)]
            moved = call(*ends, mask[None, None])
    change = ((moved - out0.detach()) * readout).sum()
    total = sum((d * g).sum() for d, g in zip(steps, grads, strict=True))
    torch.testing.assert_close(total, change, rtol=1e-3, atol=1e-6)


def test_reach_is_checked():
    for reach in (0, -0.5, 1.5, math.nan, True, "0.9"):
        with pytest.raises(ValueError, match=r"reach must be a number in \(0, 1\]"):
            Rules(norm="secant", reach=reach)
    with pytest.raises(ValueError, match="use a secant rule"):
        Rules(reach=0.9)


def test_secant_coefficients_add_up_to_the_whole_change(model64, factual):
    """Along the whole corrupt -> clean change the secant coefficients add up: the sum over
    positions of (clean - corrupt residual stream entering block 0) . c is the change of the
    metric, up to the quadrature of the norms' and softmax's Jacobians (about 1% here, where
    the two runs differ at every token); attribution patching's sum is far off."""
    if _refused(model64, "secant"):  # refused before any pass, with the reason
        with pytest.raises(ValueError, match="top-k routing"), relevance_rules(model64, "secant"):
            pass
        return
    batch = _first_batch(model64, factual[:3])
    site = ("resid_pre", 0)
    runner = get_backend(model64, "nnsight")
    totals = {}
    for rules in ("secant", None):
        with relevance_rules(model64, rules) if rules else contextlib.nullcontext() as relevance:
            with torch.no_grad(), relevance.reference() if rules else contextlib.nullcontext():
                clean = runner.run(batch.corrupt, sites=[site])
            metric, grads, run = _coefficients(model64, batch, [site])
        delta = clean.acts[site] - run.acts[site].detach()
        totals[rules] = torch.einsum("bpd,bpd->b", delta, grads[site])
    change = _logit_diff(clean.logits, batch) - metric
    torch.testing.assert_close(totals["secant"], change, rtol=0.03, atol=2e-3)
    assert not torch.allclose(totals[None], change, rtol=0.3)


def test_secant_rules_need_their_reference(tiny_llama, batch, factual):
    runner = get_backend(tiny_llama, "nnsight")
    with relevance_rules(tiny_llama, "secant") as relevance:
        with pytest.raises(RuntimeError, match="reference"):
            runner.run(batch.clean, sites=[("mlp", 0)], grad=True)
        with torch.no_grad(), relevance.reference():
            runner.run(_first_batch(tiny_llama, factual[3:5]).clean)
        with pytest.raises(ValueError, match="same batch"):
            runner.run(batch.clean, sites=[("mlp", 0)], grad=True)


def test_norm_and_mlp_conserve_relevance(tiny_llama):
    """Piece by piece: x . c sums to the relevance of the output (y . w for a readout w)
    through an RMSNorm with its scale held constant and through the gated MLP."""
    generator = torch.Generator().manual_seed(0)
    for path in ("input_layernorm", "mlp"):
        module = tiny_llama.module(path, 1)
        x = torch.randn(2, 5, 64, generator=generator, requires_grad=True)
        readout = torch.randn(2, 5, 64, generator=generator)
        with relevance_rules(tiny_llama, "relp"):
            y = module(x)
            (grad,) = torch.autograd.grad((y * readout).sum(), x)
        torch.testing.assert_close((x * grad).sum(), (y * readout).sum(), atol=1e-4, rtol=1e-5)
        (plain,) = torch.autograd.grad((module(x) * readout).sum(), x)
        assert not torch.allclose((x * plain).sum(), (y * readout).sum(), atol=1e-2)


@pytest.mark.parametrize("rules", ["relp", "secant"])
def test_norm_input_gradient_follows_the_block(tiny_llama, rules):
    """``norm_input_gradient`` (closed form, no autograd) gives, for a batch of output
    gradients (n, batch, pos, d) as edge attribution makes them, what autograd gives through
    a call of the norm: inside a block its rule, outside it the plain norm's gradient."""
    norm = tiny_llama.module("input_layernorm", 0)
    generator = torch.Generator().manual_seed(1)
    x1, x = torch.randn(2, 2, 5, 64, generator=generator)
    readout = torch.randn(3, 2, 5, 64, generator=generator)

    def autograd(weights) -> torch.Tensor:
        inputs = x.clone().requires_grad_(True)
        return torch.autograd.grad((norm(inputs) * weights).sum(), inputs)[0]

    with relevance_rules(tiny_llama, rules) as relevance:
        with torch.no_grad(), relevance.reference():
            norm(x1)
        found = norm_input_gradient(norm, x, readout)
        for receiver in range(3):
            torch.testing.assert_close(found[receiver], autograd(readout[receiver]))
    plain = norm_input_gradient(norm, x, readout)
    assert not torch.allclose(plain, found)
    for receiver in range(3):
        torch.testing.assert_close(plain[receiver], autograd(readout[receiver]))


def test_attention_rules_scale_the_last_layers_query_key_and_value(tiny_llama, batch):
    """The AH-rule sends no gradient into queries and keys; the uniform rule sends a quarter
    of it (a half into values). Seen at the last block, whose attention nothing follows but
    its own output (the other rules off, so the rest of the backward is plain)."""
    attention = tiny_llama.module("self_attn", 2)
    runner = get_backend(tiny_llama, "nnsight")

    def grads(rules: Rules | None) -> dict[str, torch.Tensor]:
        kept: dict[str, torch.Tensor] = {}

        def keep(module, args, output):
            kept[module.kind] = output

        projections = {name: getattr(attention, f"{name}_proj") for name in "qkv"}
        handles = []
        for name, projection in projections.items():
            projection.kind = name
            handles.append(projection.register_forward_hook(keep))
        try:
            with relevance_rules(tiny_llama, rules) if rules else contextlib.nullcontext():
                run = runner.run(batch.clean, grad=True)
                value = metrics.compute("logit_diff", run.logits, batch.target, batch.distractor)
                found = torch.autograd.grad(
                    value.sum(),
                    [kept[name] for name in "qkv"],
                    allow_unused=True,
                    materialize_grads=True,
                )
        finally:
            for handle in handles:
                handle.remove()
            for projection in projections.values():
                del projection.kind
        return dict(zip("qkv", found, strict=True))

    plain = grads(None)
    off = dict(norm="gradient", activation="gradient", product="gradient")
    ah = grads(Rules(**off, attention="ah"))
    uniform = grads(Rules(**off, attention="uniform"))
    assert plain["q"].abs().max() > 0 and plain["k"].abs().max() > 0
    assert ah["q"].abs().max() == 0 and ah["k"].abs().max() == 0
    torch.testing.assert_close(ah["v"], plain["v"])
    for name, factor in (("q", 0.25), ("k", 0.25), ("v", 0.5)):
        torch.testing.assert_close(uniform[name], factor * plain[name])


@pytest.mark.parametrize("rules", ["relp", "relp-ah", "attnlrp", "secant", "secant-0.9"])
def test_backends_give_the_same_coefficients(bridged, batch, rules):
    model = bridged
    sites = [(kind, layer) for layer in range(3) for kind in ("z", "attn", "mlp")]
    sites.append(("resid_pre", 0))
    found = {}
    for backend in ("nnsight", "transformer_lens"):
        with relevance_rules(model, rules, backend=backend) as relevance:
            found[backend] = _coefficients(
                model, batch, sites, backend=backend, relevance=relevance
            )[1]
    _, plain, _ = _coefficients(model, batch, sites)
    for site in sites:
        torch.testing.assert_close(
            found["transformer_lens"][site], found["nnsight"][site], atol=1e-4, rtol=1e-3
        )
    assert not torch.allclose(found["nnsight"][("resid_pre", 0)], plain[("resid_pre", 0)])


def test_refuses_what_it_does_not_support(tokenizer, tiny_llama):
    mixtral = lsc.models.tiny("mixtral", n_layers=1, seed=0, tokenizer=tokenizer)
    refused = pytest.raises(ValueError, match=r"is not covered: .*top-k routing jumps")
    with refused, relevance_rules(mixtral, "secant"):
        pass
    gpt2 = lsc.models.tiny("gpt2", n_layers=1, seed=0, tokenizer=tokenizer)
    refused = pytest.raises(ValueError, match=r"not its LayerNorms.*backend='nnsight'")
    with refused, relevance_rules(gpt2, backend="transformer_lens"):
        pass
    from lenscape.sweep.backend import _state

    assert "transformer_lens" not in _state(gpt2).backends  # refused before booting it
    with pytest.raises(ValueError, match="Unknown rule set"), relevance_rules(tiny_llama, "lrp"):
        pass
    with (
        pytest.raises(ValueError, match="Unknown backend"),
        relevance_rules(tiny_llama, backend="torch"),
    ):
        pass
    with pytest.raises(ValueError, match="Unknown attention rule"):
        Rules(attention="softmax")


# ------------------------------------------------- the rules of LayerNorm, plain MLPs, soft-caps


def test_norms_and_mlps_of_every_family_conserve_relevance(model64):
    """Piece by piece in every family (no biases): x . c sums to the relevance of the output
    (y . w for a readout w) through a norm with its scale held constant (RMSNorm or
    LayerNorm) and through the MLP (gated, fused gate_up, plain act(up), or routed with
    the routing weights held). Plain gradients do not conserve it."""
    c = model64.spec.computation
    norm = c.attn_norm or c.post_attn_norm
    assert norm is not None
    generator = torch.Generator().manual_seed(0)
    for path in (norm, c.mlp):
        module = model64.module(path, 1)
        x = torch.randn(2, 5, 64, generator=generator, dtype=torch.float64, requires_grad=True)
        readout = torch.randn(2, 5, 64, generator=generator, dtype=torch.float64)
        with relevance_rules(model64, "relp"):
            y = module(x)
            (grad,) = torch.autograd.grad((y * readout).sum(), x)
        total = (y * readout).sum()
        scale = float(total.detach().abs())
        torch.testing.assert_close((x * grad).sum(), total, atol=1e-5 * scale, rtol=1e-5)
        (plain,) = torch.autograd.grad((module(x) * readout).sum(), x)
        assert not torch.allclose((x * plain).sum(), total, rtol=1e-3), path


def _gpt2_64(tokenizer) -> lsc.LensModel:
    base = lsc.models.tiny("gpt2", n_layers=2, seed=0, tokenizer=tokenizer)
    return lsc.from_hf(copy.deepcopy(base.hf), tokenizer, name=base.name, dtype="float64")


def test_layer_norm_rules_centre_scale_and_leave_the_bias_out(tokenizer):
    """A LayerNorm (random gain and bias) under the held rule: the gradient is s c(gain g)
    with s = 1 / std(x) held and c the centring, so x . c sums to the relevance of y - bias
    (the bias, a constant, keeps its own share) and sums to 0 over d; under the secant rule
    (x1 - x0) . c is the change y1 - y0 read out (Gauss-Legendre: float rounding here)."""
    model = _gpt2_64(tokenizer)
    norm = model.module("ln_1", 1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5, generator=generator)
        norm.bias.normal_(0.0, 0.5, generator=generator)
    x1, x = 2 + torch.randn(2, 2, 5, 64, generator=generator, dtype=torch.float64)
    x0 = (x1 + 0.2 * x).requires_grad_(True)
    readout = torch.randn(2, 5, 64, generator=generator, dtype=torch.float64)
    with relevance_rules(model, "relp"):
        y = norm(x0)
        (grad,) = torch.autograd.grad((y * readout).sum(), x0)
    centred = x0.detach() - x0.detach().mean(-1, keepdim=True)
    scale = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps)
    h = norm.weight * readout
    torch.testing.assert_close(grad, scale * (h - h.mean(-1, keepdim=True)))
    torch.testing.assert_close((x0 * grad).sum(), ((y - norm.bias) * readout).sum())
    torch.testing.assert_close(grad.sum(-1), torch.zeros(2, 5, dtype=torch.float64))
    (plain,) = torch.autograd.grad((norm(x0) * readout).sum(), x0)
    assert not torch.allclose(plain, grad, atol=1e-3)
    with relevance_rules(model, "secant") as relevance:
        with torch.no_grad(), relevance.reference():
            y1 = norm(x1)
        y0 = norm(x0)
        (grad,) = torch.autograd.grad((y0 * readout).sum(), x0)
    change = ((y1 - y0.detach()) * readout).sum()
    torch.testing.assert_close(((x1 - x0.detach()) * grad).sum(), change, rtol=1e-6, atol=1e-9)
    assert not torch.allclose(((x1 - x0.detach()) * plain).sum(), change, rtol=1e-3)


def test_a_formula_check_passed_once_does_not_pass_another_formula(tiny_llama):
    """Rules blocks remember the modules that passed their formula check (one check per
    module, not per block); a remembered pass is for that formula only: the same norm
    checked as a Gemma norm (gain 1 + weight) or as a LayerNorm is still refused."""
    norm = tiny_llama.module("input_layernorm", 0)
    with relevance_rules(tiny_llama, "secant"):
        pass
    relevance._Norm(norm, centred=False).check()  # remembered: passes
    for wrong in (dict(centred=False, offset=1.0), dict(centred=True)):
        with pytest.raises(ValueError, match="does not compute the formula"):
            relevance._Norm(norm, **wrong).check()


@pytest.mark.parametrize("activation", ["gelu_new", "gelu", "relu"])
def test_a_plain_mlps_activation_follows_the_identity_rule(tokenizer, activation):
    """GPT-2's act(up) under "relp": the coefficient at the activation's input is act(x) / x
    times the one at its output, so x . c = act(x) . g (relevance passes unchanged)."""
    import transformers

    model = _gpt2_64(tokenizer)
    for block in model.hf.transformer.h:
        block.mlp.act = transformers.activations.ACT2FN[activation]
    act = model.module("mlp.act", 0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 256, generator=generator, dtype=torch.float64, requires_grad=True)
    readout = torch.randn(2, 5, 256, generator=generator, dtype=torch.float64)
    with relevance_rules(model, "relp"):
        y = act(x)
        (grad,) = torch.autograd.grad((y * readout).sum(), x)
    torch.testing.assert_close(x * grad, y.detach() * readout)
    (plain,) = torch.autograd.grad((act(x) * readout).sum(), x)
    if activation != "relu":  # ReLU's ratio is its derivative
        assert not torch.allclose(plain, grad, atol=1e-3)


def _capped_attention_call(model):
    """Block 1's attention function as the model calls it (inside a rules block: the one
    registered around the model's own), on queries, keys and values given."""
    import transformers

    attention = model.module("self_attn", 1)
    name = model.hf.config._attn_implementation
    function = transformers.AttentionInterface._global_mapping[name]

    def call(q, k, v, mask):
        out, _ = function(
            attention,
            q,
            k,
            v,
            mask,
            scaling=attention.scaling,
            softcap=attention.attn_logit_softcapping,
        )
        return out  # (batch, pos, heads, d)

    return call


def test_soft_capped_attention_rules(tokenizer):
    """Gemma 2's scores capped at c tanh(s / c) (c = 1, scores of that order): under the
    uniform rule the gradients into q, k and v are those of softmax(r s + mask) v with the
    ratio r = c tanh(s / c) / s held, times 1/4, 1/4 and 1/2 (a hand computation); under the
    secant rule (dq, dk, dv) . c sums to the change of the read-out output up to the
    softmax's quadrature, where the plain gradient does not."""
    model = _tiny_gemma2(tokenizer, "float64")
    off = dict(norm="gradient", activation="gradient", product="gradient")
    generator = torch.Generator().manual_seed(0)

    def sample(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q1, q0 = sample(2, 1, 4, 6, 16)
    k1, k0, v1, v0 = sample(4, 1, 2, 6, 16)
    q0, k0, v0 = (t.clone().requires_grad_(True) for t in (q1 + 0.2 * q0, k1 + 0.2 * k0, v0))
    readout = sample(1, 6, 4, 16)
    mask = torch.full((6, 6), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    mask = mask[None, None]
    scaling, cap = model.module("self_attn", 1).scaling, 1.0

    with relevance_rules(model, Rules(**off, attention="uniform")):
        out = _capped_attention_call(model)(q0, k0, v0, mask)
        uniform = torch.autograd.grad((out * readout).sum(), (q0, k0, v0))
    q, k = q0.detach().requires_grad_(True), k0.detach().requires_grad_(True)
    v = v0.detach().requires_grad_(True)
    repeat = dict(repeats=2, dim=1)

    def scores_of(q, k):
        return q @ k.repeat_interleave(**repeat).transpose(-1, -2) * scaling

    scores = scores_of(q, k)
    assert scores.abs().max() > 0.5 * cap  # the cap acts
    ratio = (cap * torch.tanh(scores / cap) / scores).detach()
    hand = torch.softmax(scores * ratio + mask, -1) @ v.repeat_interleave(**repeat)
    by_hand = torch.autograd.grad((hand.transpose(1, 2) * readout).sum(), (q, k, v))
    for found, expected, factor in zip(uniform, by_hand, (0.25, 0.25, 0.5), strict=True):
        torch.testing.assert_close(found, factor * expected, rtol=1e-5, atol=1e-7)
    capped = torch.softmax(cap * torch.tanh(scores_of(q, k) / cap) + mask, -1)
    true = torch.autograd.grad(
        ((capped @ v.repeat_interleave(**repeat)).transpose(1, 2) * readout).sum(), q
    )[0]
    assert not torch.allclose(uniform[0], 0.25 * true, rtol=1e-2)

    with relevance_rules(model, Rules(**off, attention="secant")) as relevance:
        call = _capped_attention_call(model)
        with torch.no_grad(), relevance.reference():
            out1 = call(q1, k1, v1, mask)
        out0 = call(q0, k0, v0, mask)
        secant = torch.autograd.grad((out0 * readout).sum(), (q0, k0, v0))
    change = ((out1 - out0.detach()) * readout).sum()
    deltas = (q1 - q0.detach(), k1 - k0.detach(), v1 - v0.detach())
    total = sum((d * g).sum() for d, g in zip(deltas, secant, strict=True))
    torch.testing.assert_close(total, change, rtol=1e-3, atol=1e-6)
    plain = torch.autograd.grad((call(q0, k0, v0, mask) * readout).sum(), (q0, k0, v0))
    linear = sum((d * g).sum() for d, g in zip(deltas, plain, strict=True))
    assert not torch.allclose(linear, change, rtol=1e-2)


@pytest.mark.parametrize("architecture", ["qwen2_moe", "mixtral"])
def test_routing_weights_are_held_under_relp(tokenizer, architecture):
    """A routed block under "relp": no gradient reaches the router (or a shared expert's
    gate), as none reaches held attention probabilities; plain gradients reach it."""
    model = lsc.models.tiny(architecture, n_layers=1, seed=0, tokenizer=tokenizer)
    block = model.module(model.spec.computation.mlp, 0)
    gates = [block.get_submodule(model.spec.computation.router)]
    gates += [block.shared_expert_gate] if hasattr(block, "shared_expert_gate") else []
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    weights = [g.weight for g in gates]
    for weight in weights:
        weight.requires_grad_(True)
    try:
        for rules, reaches in (("relp", False), (None, True)):
            with relevance_rules(model, rules) if rules else contextlib.nullcontext():
                out = block(x)
                grads = torch.autograd.grad(out.sum(), weights, allow_unused=True)
            for grad in grads:
                assert (grad is not None and grad.abs().max() > 0) == reaches
    finally:
        for weight in weights:
            weight.requires_grad_(False)


def test_averaged_softmax_vjp_is_the_softmax_jacobian_along_the_segment():
    """``_averaged_softmax_vjp`` from the two runs' probabilities equals the Gauss-Legendre
    average of the softmax Jacobian at the interpolated scores, computed from the scores;
    a key masked in both runs (causal mask, padding) gets exactly 0, not a subnormal
    number (which slowed every product of the backward pass 3-5x on an Intel CPU)."""
    torch.manual_seed(0)
    shape = (2, 3, 6, 6)
    s0 = 4 * torch.randn(shape, dtype=torch.float64)
    s1 = s0 + 4 * torch.randn(shape, dtype=torch.float64)
    masked = torch.ones(6, 6, dtype=torch.bool).triu(1).expand(shape).clone()
    masked[1, :, :, 4:] = True  # the second prompt padded after its fourth token
    masked[..., 0] = False  # every query sees at least the first key
    s0, s1 = s0.masked_fill(masked, -math.inf), s1.masked_fill(masked, -math.inf)
    grad = torch.randn(shape, dtype=torch.float64)
    got = relevance._averaged_softmax_vjp(grad, s0.softmax(-1), s1.softmax(-1))
    expected = torch.zeros_like(grad)
    for t, weight in zip(relevance._NODES, relevance._WEIGHTS, strict=True):
        p = ((1 - t) * s0 + t * s1).softmax(-1)
        expected += weight * p * (grad - (p * grad).sum(-1, keepdim=True))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert (got[masked] == 0).all()
    float32 = relevance._averaged_softmax_vjp(
        grad.float(), s0.softmax(-1).float(), s1.softmax(-1).float()
    )
    assert (float32[masked] == 0).all()
    assert not (float32.abs() < torch.finfo(torch.float32).tiny)[float32 != 0].any()
