"""Edges on every family, against an independent per-receiver computation.

On each tiny random family (``lsc.models.tiny``, 2 layers), for every edge: EAP and EAP-IG
against ``_helpers.reference_edge_scores`` (the gradient at a zero leaf on one receiver's
own copy of the residual stream, made with plain forward hooks on the Hugging Face modules,
autograd through the model), exact single-edge patching against
``_helpers.reference_edge_patching`` (the corrupt run with one receiver's copy reading one
sender's clean output), each as the largest difference relative to the largest score.
The references find each family's modules and q/k/v columns by hand from the Hugging Face
source, never through lenscape's layouts, descriptions or hooks; a head's output through a
post-norm is linearised at the run's scale there too (the convention of
``lenscape.models.layouts.Computation``). Then exact edge patching with every edge is the
other run and with none the base run; circuit faithfulness and edge agreement run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lenscape as lsc
from lenscape import data, models
from lenscape.capture import edges
from lenscape.capture.edges import hooks
from lenscape.capture.edges import patching as edge_patching
from lenscape.capture.edges.graph import Graph
from lenscape.sweep.inputs import batched, tokenize
from lenscape.sweep.options import Options

IOI = data.prompts("ioi")
#: Every tiny family but Mistral and Qwen 2, which compute as Llama does.
FAMILIES = tuple(a for a in models.TINY_ARCHITECTURES if a not in ("mistral", "qwen2"))
#: Largest difference relative to the largest score, float32 models (measured: at most
#: 2e-6 for EAP and EAP-IG, 2e-5 for exact patching, relative to its largest effect).
TOLERANCE = {"eap": 1e-5, "eap-ig": 1e-5, "exact": 1e-4}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tokenizer):
    return models.tiny(request.param, n_layers=2, tokenizer=tokenizer)


def _inputs(model, prompts):
    tokens = tokenize(model, prompts, needs_corrupt=True, needs_distractor=True)
    options = Options.of(
        "edge_attribution",
        dict(metric="logit_diff", backend="nnsight", batch_size=8, padding_side="right"),
    )
    return batched(model, tokens, options)


def _relative(ours: np.ndarray, reference: np.ndarray, scale: float | None = None) -> float:
    scale = np.abs(reference).max() if scale is None else scale
    assert scale > 1e-6  # the check can fail
    return float(np.abs(ours - reference).max() / scale)


@pytest.mark.parametrize("estimator, steps", [("eap", 1), ("eap-ig", 2)])
def test_edge_scores_equal_the_per_receiver_reference(family, estimator, steps):
    from _helpers import reference_edge_scores

    prompt = IOI[0]
    scores = edges.edge_attribution(
        family, [prompt], estimator=estimator, steps=steps if steps > 1 else None, progress=False
    )
    reference = reference_edge_scores(family, prompt, steps=steps)
    graph = Graph.of(family)
    assert len(reference) == int(graph.valid.sum())  # the same edges exist
    ours = np.array([float(scores.sel(sender=s, receiver=r)) for s, r in reference])
    error = _relative(ours, np.array(list(reference.values())))
    assert error < TOLERANCE[estimator], error


def test_exact_single_edge_patching_equals_the_per_receiver_reference(family):
    from _helpers import reference_edge_patching

    prompt, graph = IOI[0], Graph.of(family)
    valid = np.flatnonzero(graph.valid)
    variants = tuple(("only", (int(i),)) for i in valid)
    result = edge_patching._edge_variants(
        family, [prompt], variants=variants, base="corrupt", progress=False
    )
    senders, receivers = np.unravel_index(valid, graph.shape)
    labels = [
        (graph.sender_labels[s], graph.receiver_labels[r])
        for s, r in zip(senders, receivers, strict=True)
    ]
    reference = reference_edge_patching(family, prompt, labels)
    expected = np.array([reference[label] for label in labels])
    base = float(result["base"][0])
    error = _relative(result["patched"].values[0], expected, np.abs(expected - base).max())
    assert error < TOLERANCE["exact"], error


def test_patching_every_edge_is_the_other_run_and_none_the_base(family):
    tokens = tokenize(family, IOI[:3], needs_corrupt=True, needs_distractor=True)
    valid = Graph.of(family).valid
    variants = (("outside", ()), ("only", ()))  # every edge patched; none
    for base in ("clean", "corrupt"):
        result = edge_patching._edge_variants(
            family, tokens, variants=variants, base=base, progress=False
        )
        everything, nothing = result["patched"].values.T
        scale = float(np.abs(result["base"] - result["other"]).max())
        assert scale > 1e-4 and valid.any()
        np.testing.assert_allclose(everything, result["other"], rtol=0, atol=1e-5 * scale + 1e-6)
        np.testing.assert_allclose(nothing, result["base"], rtol=0, atol=1e-6)


def test_circuit_faithfulness_and_edge_agreement_run(family):
    prompts = IOI[:3]
    scores = edges.edge_attribution(family, prompts, progress=False)
    curve = edges.circuit_faithfulness(
        family, prompts, scores, fractions=(0.2, 1.0), n_random=1, progress=False
    )
    np.testing.assert_allclose(curve["faithfulness"].sel(budget=1.0), 1.0, rtol=1e-4)
    agreement = edges.edge_agreement(
        family, prompts, estimators=["eap", "eap-ig"], steps=2, n_top=5, n_random=5, progress=False
    )
    assert np.isfinite(agreement["exact"].values).all()
    assert scores.attrs["residual"] == Graph.of(family).residual


def test_the_senders_sum_to_the_residual_stream(family):
    """Every sender's output summed (the embedding, each head, each MLP) is the stream
    entering the final norm, less the constants no edge carries (output-projection biases):
    with post-norms, the heads' linearised shares sum to the normalised attention output."""
    from _helpers import hand_block, hand_final_norm

    inputs = _inputs(family, IOI[:2])
    batch = inputs.batch(0)
    senders, _ = hooks.unedited(inputs, batch.clean)
    final = {}
    handle = hand_final_norm(family).register_forward_pre_hook(
        lambda m, args: final.setdefault("x", args[0].detach())
    )
    try:
        with torch.no_grad():
            family.hf(batch.clean.input_ids, attention_mask=batch.clean.attention_mask)
    finally:
        handle.remove()
    constant = sum(
        hand_block(family, layer)["o_proj"].bias
        for layer in range(family.spec.n_layers)
        if hand_block(family, layer)["post_attn"] is None
        and hand_block(family, layer)["o_proj"].bias is not None
    )
    mask = batch.clean.attention_mask[:, :, None].bool()
    summed = (senders.sum(2) + constant).masked_select(mask)
    expected = final["x"].masked_select(mask)
    assert _relative(summed.numpy(), expected.numpy()) < 1e-5


def test_a_parallel_residual_has_no_edge_from_a_layers_heads_to_its_own_mlp(tokenizer):
    """GPT-NeoX with use_parallel_residual: the same labels, no such edge (NaN), and the
    MLP receiver's gradient is that of the block's input copy; with the flag off, the
    sequential graph."""
    parallel = models.tiny("gpt_neox", n_layers=2, tokenizer=tokenizer)
    assert parallel.spec.computation.parallel
    scores = edges.edge_attribution(parallel, IOI[:2], progress=False)
    assert scores.attrs["residual"] == "parallel"
    assert np.isnan(scores.sel(sender="L1.H0", receiver="L1.MLP"))
    assert np.isfinite(scores.sel(sender="L0.H0", receiver="L1.MLP"))
    # read back without attrs, the graph is still the parallel one
    assert lsc.circuit(scores.drop_attrs(), fraction=1.0).sum() == int(
        Graph.of(parallel).valid.sum()
    )
    hf = parallel.hf
    hf.config.use_parallel_residual = False
    for block in hf.gpt_neox.layers:
        block.use_parallel_residual = False
    try:
        sequential = models.from_hf(hf, tokenizer, name="tiny-neox-sequential")
        assert not sequential.spec.computation.parallel
        again = edges.edge_attribution(sequential, IOI[:2], progress=False)
        assert np.isfinite(again.sel(sender="L1.H0", receiver="L1.MLP"))
        assert again.attrs["residual"] == "sequential"
    finally:
        hf.config.use_parallel_residual = True
        for block in hf.gpt_neox.layers:
            block.use_parallel_residual = True


@pytest.mark.parametrize("architecture", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_a_routed_block_is_one_mlp_node(tokenizer, architecture):
    """The MLP sender of a mixture-of-experts block is the whole routed block's output
    (router, chosen experts, shared expert), and its receiver is the block's input norm's
    input, so a patched edge into it changes what the router sees too."""
    model = models.tiny(architecture, n_layers=2, tokenizer=tokenizer)
    inputs = _inputs(model, IOI[:1])
    batch = inputs.batch(0)
    senders, _ = hooks.unedited(inputs, batch.clean)
    outputs, routes = {}, {}
    handles = []
    for layer, block in enumerate(model.hf.model.layers):
        handles.append(
            block.mlp.register_forward_hook(
                lambda m, a, out, layer=layer: outputs.setdefault(layer, out.detach())
            )
        )
        handles.append(
            block.mlp.gate.register_forward_hook(
                lambda m, a, out, layer=layer: routes.setdefault(layer, out)
            )
        )
    try:
        with torch.no_grad():
            model.hf(batch.clean.input_ids)
    finally:
        for handle in handles:
            handle.remove()
    graph = Graph.of(model)
    for layer in range(2):
        mlp = graph.head_sender(layer) + model.spec.n_heads
        torch.testing.assert_close(senders[:, :, mlp], outputs[layer], rtol=0, atol=0)
        assert layer in routes  # the router ran inside the node


def test_a_post_normed_blocks_head_edges_together_are_the_block_patched(tokenizer):
    """Gemma 3: a head's sender output is its o_proj share times the post-attention norm's
    scale and gain in that run, so the shares sum to the block's normalised output; every
    outgoing edge of every head of a block patched together is then exactly activation
    patching of the block's output."""
    model = models.tiny("gemma3_text", n_layers=2, tokenizer=tokenizer)
    prompts = IOI[:2]
    graph = Graph.of(model)
    heads = [graph.head_sender(0) + h for h in range(model.spec.n_heads)]
    weights = np.zeros(graph.valid.shape, dtype=bool)
    weights[heads] = graph.valid[heads]
    result = edge_patching._edge_variants(
        model,
        prompts,
        variants=(("only", tuple(int(i) for i in np.flatnonzero(weights))),),
        base="corrupt",
        progress=False,
    )
    block = lsc.activation_patching(model, prompts, level="block", progress=False)
    patched_edges = result["patched"].values[:, 0] - result["base"].values
    patched_block = block.sel(layer=0, component="attn").values
    assert np.abs(patched_block).max() > 1e-3
    np.testing.assert_allclose(patched_edges, patched_block, rtol=1e-4, atol=1e-5)


def test_bad_descriptions_are_refused_with_the_field_to_fix():
    layout = lsc.models.ARCHITECTURES["llama"]
    import dataclasses

    for changes, match in [
        ({"qkv": ("a", "b")}, "qkv=.*three paths"),
        ({"qkv_order": "interleaved"}, "qkv_order='interleaved'"),
        ({"qk_norm": "head"}, "q_norm and k_norm"),
        ({"position": "learned"}, "position_embed"),
    ]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(layout, **changes)


def test_a_per_head_fused_projection_under_grouped_query_attention_is_refused(tokenizer):
    """An interleaved q/k/v projection does not say which query group a key/value head
    serves: refused before any pass."""
    import dataclasses

    llama = models.tiny("llama", n_layers=2, tokenizer=tokenizer, check=False)
    layout = dataclasses.replace(llama.spec.layout, qkv=("self_attn.q_proj",), qkv_order="per_head")
    model = models.from_hf(llama.hf, tokenizer, layout=layout, check=False)
    with pytest.raises(ValueError, match="as many key/value heads as query heads"):
        edges.edge_attribution(model, IOI[:1], progress=False)


#: (family, rule set) pairs the relevance rules refuse, with a word of the reason their
#: refusal gives: the secant rules on routed experts (top-k routing jumps between runs).
REFUSED = {
    (architecture, "secant"): "top-k routing"
    for architecture in ("qwen2_moe", "qwen3_moe", "mixtral")
}


@pytest.mark.parametrize("rules", ["relp", "secant"])
def test_relp_edges_equal_the_per_receiver_reference_under_the_rules(family, rules):
    """RelP: the same per-receiver reference, its backward passes under the rules."""
    from _helpers import reference_edge_scores

    name = family.spec.architecture
    prompt = IOI[0]
    if (name, rules) in REFUSED:  # refused before any pass, with the reason
        with pytest.raises(ValueError, match=REFUSED[name, rules]):
            edges.edge_attribution(family, [prompt], estimator="relp", rules=rules, progress=False)
        return
    scores = edges.edge_attribution(family, [prompt], estimator="relp", rules=rules, progress=False)
    reference = reference_edge_scores(family, prompt, rules=rules)
    ours = np.array([float(scores.sel(sender=s, receiver=r)) for s, r in reference])
    error = _relative(ours, np.array(list(reference.values())))
    assert error < TOLERANCE["eap"], error


@pytest.mark.parametrize("architecture, rules", sorted(REFUSED))
def test_relp_is_refused_with_the_reason_before_any_pass(tokenizer, architecture, rules):
    model = models.tiny(architecture, n_layers=1, tokenizer=tokenizer)
    passes = []
    handle = model.hf.register_forward_hook(lambda *args: passes.append(1))
    try:
        for call in (
            lambda: edges.edge_attribution(
                model, IOI[:1], estimator="relp", rules=rules, progress=False
            ),
            lambda: lsc.attribution_patching(
                model, IOI[:1], estimator="relp", rules=rules, progress=False
            ),
        ):
            reason = REFUSED[architecture, rules]
            with pytest.raises(ValueError, match=f"is not covered: .*{reason}"):
                call()
    finally:
        handle.remove()
    assert not passes


@pytest.mark.slow
def test_gemma3_270m_edges_equal_the_per_receiver_reference(bundled):
    """The bundled gemma3-270m (post-norms, 1 + weight, per-head QK-norm, one key/value
    head, sliding windows): a seeded sample of 24 edges into 6 receivers, EAP and exact
    single-edge patching against the references; every / no edge patched. The benchmark
    (benchmarks/edge_families.py) runs 232 edges and EAP-IG."""
    from _helpers import reference_edge_patching, reference_edge_scores

    model = bundled("gemma3-270m")
    prompts = [p for p in IOI[:8] if _same_length(model, p)][:1]
    graph = Graph.of(model)
    rng = np.random.default_rng(0)
    receivers = [len(graph.receivers) - 1]
    for kind in ("q", "k", "v", "mlp"):
        of_kind = [r for r, (k, layer, _) in enumerate(graph.receivers) if k == kind and layer > 3]
        receivers.append(int(rng.choice(of_kind)))
    receivers.append(graph.attn_receivers(0).start)  # a layer-0 receiver: reads the embedding
    flat = sorted(
        int(s) * graph.shape[1] + r
        for r in receivers
        for s in rng.choice(
            np.flatnonzero(graph.valid[:, r]),
            size=min(4, int(graph.valid[:, r].sum())),
            replace=False,
        )
    )
    senders, columns = np.unravel_index(flat, graph.shape)
    labels = [
        (graph.sender_labels[s], graph.receiver_labels[r])
        for s, r in zip(senders, columns, strict=True)
    ]
    scores = edges.edge_attribution(model, prompts, progress=False)
    reference = reference_edge_scores(
        model, prompts[0], receivers={graph.receiver_labels[r] for r in receivers}
    )
    ours = [float(scores.sel(sender=s, receiver=r)) for s, r in labels]
    assert _relative(np.array(ours), np.array([reference[label] for label in labels])) < 1e-4
    exact = edge_patching._edge_variants(
        model,
        prompts,
        variants=tuple(("only", (i,)) for i in flat),
        base="corrupt",
        progress=False,
    )
    patched = reference_edge_patching(model, prompts[0], labels)
    expected = np.array([patched[label] for label in labels])
    base = float(exact["base"][0])
    scale = np.abs(expected - base).max()
    assert _relative(exact["patched"].values[0], expected, scale) < 1e-3
    ends = edge_patching._edge_variants(
        model, prompts, variants=(("outside", ()), ("only", ())), base="corrupt", progress=False
    )
    every, none = ends["patched"].values[0]
    gap = abs(float(ends["other"][0]) - base)
    assert abs(every - float(ends["other"][0])) < 1e-4 * gap and abs(none - base) < 1e-5 * gap


def _same_length(model, prompt) -> bool:
    try:
        tokenize(model, [prompt], needs_corrupt=True, needs_distractor=True)
    except ValueError:
        return False
    return True
