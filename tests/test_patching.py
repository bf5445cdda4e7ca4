"""Ablation, activation patching and attribution patching (``capture/patching.py``) against
independent computations with plain PyTorch hooks (the references in ``_helpers.py``);
integrated gradients, ``refine=k`` and low-precision runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from _helpers import (
    answered_prompts,
    block_outputs,
    head_replacer,
    logit_diff,
    o_proj_module,
    reference_activation_patching,
    reference_correct,
    reference_head_effects,
    reference_zero_ablation,
)

import lenscape as lsc
from lenscape import models
from lenscape.capture.patching import exact

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
    from lenscape.sweep.backend import get_backend

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


def _pass_cost(
    chunk_layers: list[int], chunk_rows: list[int], n_layers: int, width: int, first: int = 0
):
    """A stacked pass's cost in token-blocks, by ``_packed``'s own rule, written out; it
    runs the columns from ``first`` on."""
    blocks = n_layers - chunk_layers[0]
    overhead = exact.BLOCK_OVERHEAD_TOKENS
    cost = blocks * (overhead + (width - first) * sum(chunk_rows))
    return cost + exact.PASS_OVERHEAD_BLOCKS * overhead


@pytest.mark.parametrize("seed", range(40))
def test_packing_is_the_cheapest_cut_into_passes(seed):
    """``_packed`` keeps the pieces in order, never puts more than the budget's rows in a
    pass of several pieces, and its cut costs what the cheapest of every contiguous cut
    costs (brute force over all 2^(n-1) cuts), with and without position cells (a pass
    runs the columns from its pieces' first start on)."""
    rng = np.random.default_rng(seed)
    n, n_layers, width = int(rng.integers(1, 9)), 18, int(rng.integers(1, 20))
    layers = sorted(rng.integers(0, n_layers, n).tolist())
    starts = rng.integers(0, width, n).tolist() if seed % 2 else None
    pieces = [(i, torch.arange(int(rng.integers(1, 9)))) for i in range(n)]
    budget = int(rng.integers(4, 24))
    passes = list(
        exact._packed(pieces, budget, layers=layers, n_layers=n_layers, width=width, starts=starts)
    )
    assert [i for chunk in passes for i, _ in chunk] == list(range(n))
    assert all(len(chunk) == 1 or sum(len(r) for _, r in chunk) <= budget for chunk in passes)

    def cost(chunks):
        return sum(
            _pass_cost(
                [layers[i] for i, _ in c],
                [len(r) for _, r in c],
                n_layers,
                width,
                0 if starts is None else min(starts[i] for i, _ in c),
            )
            for c in chunks
        )

    def cuts(items):
        if not items:
            yield []
            return
        for end in range(1, len(items) + 1):
            head = items[:end]
            if len(head) > 1 and sum(len(r) for _, r in head) > budget:
                break
            for rest in cuts(items[end:]):
                yield [head, *rest]

    assert cost(passes) == pytest.approx(min(cost(c) for c in cuts(pieces)))


def test_packing_keeps_one_pass_per_block_for_a_full_sweep_and_splits_far_blocks():
    """Every row of every head: one pass per block, as a full sweep always made. A few rows
    of block 0 and of block 17 go in two passes (one would run the block-17 rows through
    17 blocks they need not), but two neighbouring blocks' rows share one."""
    rows = torch.arange(8)
    full = [((layer, head), rows) for layer in range(18) for head in range(4)]
    passes = list(
        exact._packed(full, 32, layers=[layer for (layer, _), _ in full], n_layers=18, width=12)
    )
    assert [{layer for (layer, _), _ in chunk} for chunk in passes] == [{b} for b in range(18)]
    few = torch.arange(3)

    def blocks_of(layers):
        pieces = [(layer, few) for layer in layers]
        return [
            [layer for layer, _ in chunk]
            for chunk in exact._packed(pieces, 32, layers=layers, n_layers=18, width=12)
        ]

    assert blocks_of([0, 17]) == [[0], [17]]
    assert blocks_of([16, 17]) == [[16, 17]]


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
    means = {layer: (total / count).float() for layer, total in sums.items()}
    d_head = spec.d_head
    expected = reference_head_effects(
        model, prompts, lambda i, layer, head: means[layer][head * d_head : (head + 1) * d_head]
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


# ----------------------------------------------------------------------------- invariances


def test_unknown_ablation_kind(tiny_llama, factual):
    with pytest.raises(ValueError, match="Unknown ablation kind"):
        lsc.ablation(tiny_llama, factual[:1], kind="resample-ish", progress=False)


@pytest.fixture(scope="module")
def pairs(factual):
    return factual[:4]


def test_ig_with_one_step_is_attribution_patching(tiny_model, pairs):
    atp = lsc.attribution_patching(tiny_model, pairs, level="all", progress=False)
    ig1 = lsc.attribution_patching(
        tiny_model, pairs, level="all", estimator="ig", steps=1, progress=False
    )
    xr.testing.assert_equal(atp["heads"].drop_attrs(), ig1["heads"].drop_attrs())
    xr.testing.assert_equal(atp["blocks"].drop_attrs(), ig1["blocks"].drop_attrs())
    assert ig1["heads"].attrs["estimator"] == "ig" and ig1["heads"].attrs["steps"] == 1


def test_ig_differs_from_atp_and_records_steps(tiny_llama, pairs):
    atp = lsc.attribution_patching(tiny_llama, pairs, level="block", progress=False)
    ig = lsc.attribution_patching(
        tiny_llama, pairs, level="block", estimator="ig", steps=4, progress=False
    )
    assert ig.attrs["steps"] == 4 and "Integrated-gradient" in ig.attrs["long_name"]
    assert not np.allclose(atp.values, ig.values, atol=1e-6)


@pytest.mark.parametrize("estimator, steps", [("atp", None), ("ig", 3), ("trapezoid", None)])
@pytest.mark.parametrize("level", ["head", "block"])
def test_estimators_exact_where_the_metric_is_linear(
    linear_tail_model, pairs, estimator, steps, level
):
    exact = lsc.activation_patching(linear_tail_model, pairs, level=level, progress=False)
    estimate = lsc.attribution_patching(
        linear_tail_model, pairs, level=level, estimator=estimator, steps=steps, progress=False
    )
    last = exact.sel(layer=1)
    # Metrics are float32 differences of logits of size ~30: exact up to float32 rounding.
    np.testing.assert_allclose(estimate.sel(layer=1).values, last.values, atol=1e-4, rtol=1e-5)
    assert np.abs(last.values).max() > 1.0  # the check compares something
    # The first block feeds a non-linear attention and norm: there the estimate is off.
    assert not np.allclose(estimate.sel(layer=0).values, exact.sel(layer=0).values, atol=1e-2)


def test_ig_backends_agree(tiny_model, pairs):
    runs = [
        lsc.attribution_patching(
            tiny_model, pairs, level="all", estimator="ig", steps=3, backend=backend, progress=False
        )
        for backend in ("nnsight", "transformer_lens")
    ]
    for name in ("heads", "blocks"):
        np.testing.assert_allclose(runs[0][name].values, runs[1][name].values, atol=1e-4)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (dict(estimator="eap"), ValueError, "Unknown estimator"),
        (dict(estimator="nope:3"), ValueError, "Unknown estimator"),
        (dict(estimator="atp:secant"), ValueError, "Unknown estimator"),  # atp takes no rules
        (dict(estimator="relp:8"), ValueError, "Unknown estimator"),  # nor relp points
        # a report's label: told how to spell it here, before any pass
        (dict(estimator="ig:3"), ValueError, "estimator='ig', steps=3"),
        (dict(estimator="relp:secant"), ValueError, "estimator='relp', rules='secant'"),
        (dict(estimator="atp", steps=4), ValueError, "needs estimator='ig'"),
        (dict(estimator="ig", steps=0), ValueError, "steps must be"),
        (dict(estimator="ig", steps=2.5), TypeError, "steps must be"),
    ],
)
def test_bad_estimator_options(tiny_llama, pairs, bad, error, match):
    with pytest.raises(error, match=match):
        lsc.attribution_patching(tiny_llama, pairs, progress=False, **bad)


@pytest.mark.parametrize(
    "method, options",
    [
        ("activation_patching", dict(level="head")),
        ("activation_patching", dict(level="block", estimator="ig", steps=2)),
        ("ablation", dict(level="head", kind="mean")),
    ],
)
def test_refine_equals_full_sweep_on_refined_components(tiny_llama, pairs, method, options):
    run = getattr(lsc, method)
    # The full sweep takes no ranking estimator: without refine it is refused (Method.checks).
    plain = {k: v for k, v in options.items() if k not in ("estimator", "steps")}
    full = run(tiny_llama, pairs, variants_per_pass=1, progress=False, **plain)
    refined = run(tiny_llama, pairs, variants_per_pass=1, refine=3, progress=False, **options)
    computed = ~np.isnan(refined.values[0])
    assert computed.sum() == 3
    assert (~np.isnan(refined.values) == computed).all()  # the same components for every prompt
    np.testing.assert_array_equal(refined.values[:, computed], full.values[:, computed])
    assert refined.attrs["refined_k"] == 3
    assert refined.attrs["refine_estimator"] == options.get("estimator", "atp")
    # With stacked passes (the default) the refined values still match to float32 noise.
    stacked = run(tiny_llama, pairs, refine=3, progress=False, **options)
    np.testing.assert_allclose(stacked.values[:, computed], full.values[:, computed], atol=1e-5)


def test_refine_picks_the_largest_estimates(tiny_llama, pairs):
    estimate = lsc.attribution_patching(tiny_llama, pairs, level="head", progress=False)
    refined = lsc.activation_patching(tiny_llama, pairs, level="head", refine=4, progress=False)
    mean = np.abs(estimate.mean("prompt").values.ravel())
    chosen = ~np.isnan(refined.values[0].ravel())
    assert mean[chosen].min() >= mean[~chosen].max()


@pytest.mark.parametrize(
    "refine, error, match",
    [
        (1000, ValueError, "refine must be an integer from 1 to 12"),
        (0, ValueError, "refine must be a positive integer"),
        (2.0, TypeError, "refine must be a positive integer"),
        (True, TypeError, "refine must be a positive integer"),
    ],
)
def test_refine_out_of_range(tiny_llama, pairs, refine, error, match):
    with pytest.raises(error, match=match):
        lsc.activation_patching(tiny_llama, pairs, refine=refine, progress=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_runs_track_float32(tokenizer, factual, dtype):
    prompts = factual[:4]
    full = models.tiny("llama", n_layers=2, tokenizer=tokenizer)
    low = models.from_hf(
        models.tiny("llama", n_layers=2, tokenizer=tokenizer).hf,
        tokenizer,
        dtype=dtype,
        device="cpu",
    )
    for method in (lsc.attribution_patching, lsc.ablation):
        a = method(full, prompts, progress=False)
        b = method(low, prompts, progress=False)
        assert b.attrs["dtype"] == dtype and b.dtype == np.float32  # metrics in float32
        scale = np.abs(a.values).max()
        np.testing.assert_allclose(b.values, a.values, atol=0.1 * scale)


# ------------------------------------------------------------------ wrong answers are data


@pytest.mark.parametrize(
    "method, options",
    [
        ("ablation", {}),
        ("ablation", {"kind": "mean", "level": "block", "padding_side": "left"}),
        ("ablation", {"backend": "transformer_lens"}),
        ("activation_patching", {"level": "block"}),
        ("attribution_patching", {}),
        ("attribution_patching", {"level": "all", "backend": "transformer_lens"}),
    ],
)
def test_correct_is_the_models_own_top_answer(tiny_llama, factual, method, options):
    prompts = answered_prompts(tiny_llama, factual[:7])
    expected = reference_correct(tiny_llama, prompts)
    assert expected.any() and not expected.all()  # the check can tell right from wrong
    result = getattr(lsc, method)(tiny_llama, prompts, batch_size=3, progress=False, **options)
    for da in result.data_vars.values() if isinstance(result, xr.Dataset) else [result]:
        assert da["correct"].dims == ("prompt",) and da["correct"].dtype == bool
        np.testing.assert_array_equal(da["correct"].values, expected)


# ---------------------------------------------------------------- relevance patching (RelP)


def _ids(model, text: str, special: bool = True) -> list[int]:
    return model.tokenizer(text, add_special_tokens=special)["input_ids"]


def _plain_relp(model, prompts, rules):
    """An independent RelP of every head and block of ``prompts``, one prompt at a time: HF
    forward hooks keep the o_proj inputs and the attention and MLP outputs of the corrupt
    run under ``relevance_rules`` (its clean run first, as the reference), and the logit
    difference's gradient at them times (clean - corrupt), summed over positions."""
    from lenscape.sweep.relevance import relevance_rules

    hf, spec = model.hf, model.spec
    heads = np.zeros((len(prompts), spec.n_layers, spec.n_heads))
    blocks = np.zeros((len(prompts), spec.n_layers, 2))
    kept: dict = {}

    def keep(name):
        def hook(module, args, output=None):
            value = args[0] if output is None else output
            kept[name] = value[0] if isinstance(value, tuple) else value

        return hook

    def leaf(module, args, output):  # gradients flow from the embeddings on
        return output.detach().requires_grad_(True)

    handles = [hf.model.embed_tokens.register_forward_hook(leaf)]
    for layer, block in enumerate(hf.model.layers):
        handles += [
            block.self_attn.o_proj.register_forward_pre_hook(keep(("z", layer))),
            block.self_attn.register_forward_hook(keep(("attn", layer))),
            block.mlp.register_forward_hook(keep(("mlp", layer))),
        ]
    try:
        for i, p in enumerate(prompts):
            with relevance_rules(model, rules) as relevance:
                with torch.no_grad(), relevance.reference():
                    hf(torch.tensor([_ids(model, p.text)]))
                    clean = {k: v.detach() for k, v in kept.items()}
                logits = hf(torch.tensor([_ids(model, p.corrupt)])).logits[0, -1].float()
                target, wrong = _ids(model, p.target, False)[0], _ids(model, p.distractor, False)[0]
                grads = torch.autograd.grad(logits[target] - logits[wrong], list(kept.values()))
            for (kind, layer), grad in zip(kept, grads, strict=True):
                product = ((clean[kind, layer] - kept[kind, layer].detach()) * grad).float()[0]
                if kind == "z":
                    per_head = product.view(-1, spec.n_heads, spec.d_head).sum((0, 2))
                    heads[i, layer] = per_head.numpy()
                else:
                    blocks[i, layer, 0 if kind == "attn" else 1] = float(product.sum())
    finally:
        for handle in handles:
            handle.remove()
    return heads, blocks


@pytest.mark.parametrize("rules", ["relp", "secant"])
def test_relp_equals_an_independent_computation(tiny_llama, pairs, rules):
    got = lsc.attribution_patching(
        tiny_llama, pairs, level="all", estimator="relp", rules=rules, progress=False
    )
    heads, blocks = _plain_relp(tiny_llama, pairs, rules)
    np.testing.assert_allclose(got["heads"].values, heads, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(got["blocks"].values, blocks, atol=1e-5, rtol=1e-4)
    assert got["heads"].attrs["rules"] == rules and got["heads"].attrs["estimator"] == "relp"
    assert f"Relevance patching ({rules} rules)" in got["heads"].attrs["long_name"]
    atp = lsc.attribution_patching(tiny_llama, pairs, level="all", progress=False)
    assert not np.allclose(atp["blocks"].values, got["blocks"].values, atol=1e-5)


def test_relp_backends_agree_and_the_model_is_left_as_it_was(tiny_llama, pairs):
    before = lsc.attribution_patching(tiny_llama, pairs, level="all", progress=False)
    runs = [
        lsc.attribution_patching(
            tiny_llama,
            pairs,
            level="all",
            estimator="relp",
            rules="secant",
            backend=backend,
            progress=False,
        )
        for backend in ("nnsight", "transformer_lens")
    ]
    for name in ("heads", "blocks"):
        np.testing.assert_allclose(runs[0][name].values, runs[1][name].values, atol=1e-5)
    after = lsc.attribution_patching(tiny_llama, pairs, level="all", progress=False)
    xr.testing.assert_identical(after, before)  # no rule outlives its call


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(estimator="atp", rules="secant"), ValueError, "takes plain gradients"),
        (dict(estimator="relp", rules="lrp"), ValueError, "Unknown rules .lrp."),
        (dict(estimator="relp", steps=3), ValueError, "needs estimator='ig'"),
    ],
)
def test_bad_relp_options(tiny_llama, pairs, options, error, match):
    with pytest.raises(error, match=match):
        lsc.attribution_patching(tiny_llama, pairs, progress=False, **options)


def test_relp_refuses_what_its_rules_do_not_cover(tokenizer, pairs):
    """The secant rules on routed experts; the rules on the TransformerLens bridge of a
    LayerNorm model (GPT-2 runs them on nnsight)."""
    mixtral = models.tiny("mixtral", n_layers=2, seed=0, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="top-k routing"):
        lsc.attribution_patching(mixtral, pairs, estimator="relp", rules="secant", progress=False)
    gpt2 = models.tiny("gpt2", n_layers=2, seed=0, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"backend=.nnsight."):
        lsc.attribution_patching(
            gpt2, pairs, estimator="relp", backend="transformer_lens", progress=False
        )
