"""Relevance rules (``sweep/relevance.py``): forward outputs untouched, the model restored,
relevance conserved where the rules promise it, and the same coefficients on both backends."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import lenscape as lsc
from lenscape.sweep import metrics
from lenscape.sweep.backend import get_backend
from lenscape.sweep.inputs import Inputs, tokenize
from lenscape.sweep.relevance import RULE_SETS, Rules, norm_input_gradient, relevance_rules

FAMILIES = ("llama", "qwen3", "gemma3", "olmo2")


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


def _tiny(family: str, tokenizer, dtype: str = "float32") -> lsc.LensModel:
    if family == "gemma3":
        return _tiny_gemma3(tokenizer, dtype)
    base = lsc.models.tiny(family, n_layers=3, seed=0, tokenizer=tokenizer)
    return lsc.from_hf(copy.deepcopy(base.hf), tokenizer, name=base.name, dtype=dtype)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tokenizer):
    return _tiny(request.param, tokenizer)


@pytest.fixture(scope="module", params=FAMILIES)
def model64(request, tokenizer):
    return _tiny(request.param, tokenizer, "float64")


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


def test_forward_outputs_unchanged_on_transformer_lens(model, batch):
    runner = get_backend(model, "transformer_lens")
    with torch.no_grad():
        before = runner.run(batch.clean, sites=[("mlp", 1)])
        with relevance_rules(model, "relp-ah", backend="transformer_lens"):
            inside = runner.run(batch.clean, sites=[("mlp", 1)])
    torch.testing.assert_close(inside.logits, before.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(inside.acts[("mlp", 1)], before.acts[("mlp", 1)], atol=0, rtol=0)


@pytest.mark.parametrize("fail", [False, True])
def test_model_restored_after_the_block(model, batch, fail):
    sites = [("mlp", 1), ("attn", 0)]
    logits, (_, plain, _) = _logits(model, batch), _coefficients(model, batch, sites)
    bridge = get_backend(model, "transformer_lens").bridge  # type: ignore[attr-defined]
    hooks = _hook_count(model.hf), _hook_count(bridge)
    implementation = model.hf.config._attn_implementation
    failing = pytest.raises(RuntimeError, match="inside") if fail else contextlib.nullcontext()
    with failing, relevance_rules(model, "relp-ah", backend="transformer_lens"):
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


def test_secant_rules_split_a_gated_mlps_change_exactly(model64):
    """The secant rules through a gated MLP (the activation's secant, the product split at
    its midpoints) are exact: (x1 - x0) . c sums to the change of the readout, including
    where x1 and x0 are within ``SECANT_TOLERANCE`` (the derivative at the midpoint)."""
    mlp = model64.module("mlp", 1)
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


def test_secant_coefficients_add_up_to_the_whole_change(model64, factual):
    """Along the whole corrupt -> clean change the secant coefficients add up: the sum over
    positions of (clean - corrupt residual stream entering block 0) . c is the change of the
    metric, up to the quadrature of the norms' and softmax's Jacobians (about 1% here, where
    the two runs differ at every token); attribution patching's sum is far off."""
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


@pytest.mark.parametrize("rules", ["relp", "relp-ah", "attnlrp", "secant"])
def test_backends_give_the_same_coefficients(model, batch, rules):
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
    gpt2 = lsc.models.tiny("gpt2", n_layers=1, seed=0, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="support"), relevance_rules(gpt2):
        pass
    with pytest.raises(ValueError, match="Unknown rule set"), relevance_rules(tiny_llama, "lrp"):
        pass
    with (
        pytest.raises(ValueError, match="Unknown backend"),
        relevance_rules(tiny_llama, backend="torch"),
    ):
        pass
    with pytest.raises(ValueError, match="Unknown attention rule"):
        Rules(attention="softmax")
