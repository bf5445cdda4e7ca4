"""Edge attribution, circuits and exact edge patching (capture/edges/).

Exactness is checked two ways on tiny float64 Llamas with grouped-query attention (4 query
heads, 2 key/value heads):
- on the real (non-linear) model, every edge's EAP score is the derivative of exact
  single-edge patching (a central difference of patching a scaled clean-minus-corrupt
  difference into that one receiver), for q, k, v, MLP and logits receivers;
- on a model made linear in its residual inputs (identity norms, constant MLP gate, zero
  queries: uniform attention), EAP equals exact patching of whole edge sets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

import lenscape as lsc
from lenscape import data, models
from lenscape.capture import edges
from lenscape.capture.edges import circuits, hooks
from lenscape.capture.edges import patching as edge_patching
from lenscape.capture.edges import scores as edge_scores
from lenscape.capture.edges.graph import Graph
from lenscape.sweep.inputs import batched, tokenize
from lenscape.sweep.options import Options

IOI = data.prompts("ioi")


def _float64(tokenizer, seed: int = 0, **changes) -> models.LensModel:
    """A fresh tiny Llama (3 layers) in float64; ``changes`` edit its config first."""
    import transformers

    base = models.tiny("llama", n_layers=3, seed=seed, tokenizer=tokenizer, check=False)
    config = base.hf.config
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config) if changes else base.hf
    return models.from_hf(hf, tokenizer, name="tiny-llama64", dtype="float64", check=False)


class _RMSNorm64(torch.nn.Module):
    """Llama's RMS norm without its float32 round trip (exact in float64)."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )


@pytest.fixture(scope="module")
def gqa64(tokenizer):
    model = _float64(tokenizer)
    hf = model.hf
    hf.model.norm = _RMSNorm64(hf.model.norm)
    for block in hf.model.layers:
        block.input_layernorm = _RMSNorm64(block.input_layernorm)
        block.post_attention_layernorm = _RMSNorm64(block.post_attention_layernorm)
    return model


class _Ones(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x)


@pytest.fixture(scope="module")
def linear64(tokenizer):
    """Affine in the residual stream: identity norms, MLP = down(up(x)), q = 0 so every
    pattern is uniform over the prefix (attention = a fixed average of v)."""
    model = _float64(tokenizer, seed=1)
    hf = model.hf
    hf.model.norm = torch.nn.Identity()
    for block in hf.model.layers:
        block.input_layernorm = torch.nn.Identity()
        block.post_attention_layernorm = torch.nn.Identity()
        block.mlp.act_fn = _Ones()
        block.self_attn.q_proj.weight.zero_()
    hf.lm_head.weight.mul_(1000.0)  # effects of order 1 (the metric is float32)
    return model


def _inputs(model, prompts):
    tokens = tokenize(model, prompts, needs_corrupt=True, needs_distractor=True)
    options = Options.of(
        "edge_attribution",
        dict(metric="logit_diff", backend="nnsight", batch_size=8, padding_side="right"),
    )
    return batched(model, tokens, options)


def _patched_metrics(inputs, weights, base):
    """(variants, batch) patched metrics, (batch,) base and (batch,) other metric."""
    values = edge_patching._patched_metrics(inputs, inputs.batch(0), weights, base).values.T
    return values[:-2], values[-2], values[-1]


def _logit_diff(logits: torch.Tensor, batch) -> torch.Tensor:
    """Logit difference in the model's precision (the library's metrics use float32)."""
    rows = torch.arange(len(logits))
    return logits[rows, batch.target] - logits[rows, batch.distractor]


def _patch_derivative(model, prompts, weights: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """d/dt of the metric when ``weights``' edges read corrupt + t (clean - corrupt), at
    t = 0 (central difference in float64), per prompt."""
    inputs = _inputs(model, prompts)
    batch = inputs.batch(0)
    clean, _ = hooks.unedited(inputs, batch.clean)
    values = []
    for t in (eps, -eps):
        state = hooks.Pass(Graph.of(model), other=clean, patched=torch.as_tensor(t * weights))
        with torch.no_grad():
            logits = hooks.run_pass(model, "nnsight", batch.corrupt, state, grad=False)
        values.append(_logit_diff(logits, batch))
    return ((values[0] - values[1]) / (2 * eps)).numpy()


def test_graph_counts_senders_receivers_and_edges(gqa64):
    scores = edges.edge_attribution(gqa64, IOI[:2], progress=False)
    layers, heads, kv = 3, 4, 2
    assert scores.sizes == {"sender": 1 + layers * (heads + 1), "receiver": layers * 9 + 1}
    assert list(scores["receiver_kind"].values[:9]) == ["q"] * 4 + ["k"] * 2 + ["v"] * 2 + ["mlp"]
    # An MLP reads its own layer's heads; q/k/v read only earlier layers.
    mlp0 = scores.sel(receiver="L0.MLP")
    assert np.isfinite(mlp0.sel(sender=["embed", "L0.H3"])).all()
    assert np.isnan(mlp0.sel(sender="L0.MLP"))
    assert np.isnan(scores.sel(sender="L1.H0", receiver="L1.KV0.k"))
    assert np.isfinite(scores.sel(sender="L0.MLP", receiver="L1.KV1.v"))
    graph = Graph(layers, heads, kv)
    assert int(np.isfinite(scores.values).sum()) == int(graph.valid.sum())


@pytest.mark.parametrize(
    "sender, receiver",
    [
        ("embed", "L0.H2.q"),
        ("embed", "L0.KV1.k"),
        ("L0.H1", "L2.KV0.k"),
        ("L0.MLP", "L1.KV1.v"),
        ("L1.H3", "L2.H0.q"),
        ("L1.H2", "L1.MLP"),
        ("L2.MLP", "logits"),
        ("L0.H0", "logits"),
    ],
)
def test_eap_is_the_derivative_of_exact_single_edge_patching(gqa64, sender, receiver):
    """GQA: a k/v receiver is the key/value head itself, so its score is the effect of
    patching that one input once (a repeat-and-resum over its query group would count it
    twice)."""
    prompts = IOI[:3]
    scores = edges.edge_attribution(gqa64, prompts, per_prompt=True, progress=False)
    weights = xr.zeros_like(scores.isel(prompt=0), dtype=float)
    weights.loc[{"sender": sender, "receiver": receiver}] = 1.0
    expected = _patch_derivative(gqa64, prompts, weights.values)
    got = scores.sel(sender=sender, receiver=receiver).values
    assert np.abs(expected).max() > 1e-6  # the edge matters: the check can fail
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-8)


def test_query_head_scores_sum_to_patching_the_shared_query_input(gqa64):
    """Patching one sender into every query head of a layer at once: its derivative is
    the sum of the per-query-head scores (and likewise for a group's k and v)."""
    prompts = IOI[:3]
    scores = edges.edge_attribution(gqa64, prompts, per_prompt=True, progress=False)
    q_heads = [f"L2.H{h}.q" for h in range(4)]
    weights = xr.zeros_like(scores.isel(prompt=0), dtype=float)
    weights.loc[{"sender": "L1.MLP", "receiver": q_heads}] = 1.0
    expected = _patch_derivative(gqa64, prompts, weights.values)
    summed = scores.sel(sender="L1.MLP", receiver=q_heads).sum("receiver").values
    np.testing.assert_allclose(summed, expected, rtol=1e-5, atol=1e-8)


def test_eap_equals_exact_edge_patching_on_a_linear_model(linear64):
    """Patched edges from senders no patch reaches (the embeddings and layer 0) into
    receivers of layers 1 and up: in a linear model their joint effect is exactly the sum
    of their EAP scores (a chain of patched edges would instead cut the paths through it)."""
    prompts = IOI[:4]
    scores = edges.edge_attribution(linear64, prompts, per_prompt=True, progress=False)
    graph = Graph(3, 4, 2)
    early = scores["sender_layer"].values <= 0
    late = scores["receiver_layer"].values >= 1
    rng = np.random.default_rng(0)
    patched_edges = graph.valid & early[:, None] & late[None, :]
    patched_edges &= rng.random(graph.valid.shape) < 0.5
    kept = graph.valid & ~patched_edges
    circuit = xr.DataArray(kept, dims=("sender", "receiver"), coords=scores.isel(prompt=0).coords)
    # The corrupt run with every edge outside the circuit reading the clean run.
    patched = edges.edge_patching(linear64, prompts, circuit, base="corrupt", progress=False)
    inputs = _inputs(linear64, prompts)
    _, corrupt, clean = _patched_metrics(inputs, [], "corrupt")
    estimate = corrupt.numpy() + np.where(patched_edges[None], scores.values, 0).sum((1, 2))
    assert np.abs(patched.values - corrupt.numpy()).max() > 1e-3
    np.testing.assert_allclose(patched.values, estimate, rtol=1e-5, atol=1e-5)
    # All edges into the logits carry the whole clean - corrupt difference.
    into_logits = scores.sel(receiver="logits").sum("sender").values
    np.testing.assert_allclose(into_logits, (clean - corrupt).numpy(), rtol=1e-5, atol=1e-5)


def test_eap_ig_with_one_step_is_eap_and_more_steps_differ(tiny_llama):
    prompts = IOI[:4]
    eap = edges.edge_attribution(tiny_llama, prompts, progress=False)
    one = edges.edge_attribution(tiny_llama, prompts, estimator="eap-ig", steps=1, progress=False)
    xr.testing.assert_equal(eap.drop_attrs(), one.drop_attrs())
    three = edges.edge_attribution(tiny_llama, prompts, estimator="eap-ig", steps=3, progress=False)
    assert three.attrs["steps"] == 3
    assert np.nanmax(np.abs(three.values - eap.values)) > 1e-6


def test_patching_every_edge_gives_the_other_run_and_none_gives_the_base(gqa64):
    prompts = IOI[:5]
    inputs = _inputs(gqa64, prompts)
    valid = Graph.of(gqa64).valid
    for base in ("clean", "corrupt"):
        patched, base_metric, other_metric = _patched_metrics(
            inputs, [valid.astype(float), np.zeros(valid.shape)], base
        )
        np.testing.assert_allclose(patched[0], other_metric, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(patched[1], base_metric, rtol=1e-10, atol=1e-10)
        assert (base_metric - other_metric).abs().max() > 1e-3


def test_scores_do_not_depend_on_padding_side_or_batching(tiny_llama):
    prompts = IOI[:5]
    right = edges.edge_attribution(tiny_llama, prompts, batch_size=5, progress=False)
    left = edges.edge_attribution(
        tiny_llama, prompts, batch_size=2, padding_side="left", progress=False
    )
    np.testing.assert_allclose(left.values, right.values, rtol=1e-4, atol=1e-6)


def test_circuit_keeps_top_edges_on_paths_and_round_trips(gqa64, tmp_path):
    scores = edges.edge_attribution(gqa64, IOI[:4], progress=False)
    chosen = edges.circuit(scores, edges=20)
    assert chosen.dtype == bool and chosen.attrs["budget"] == 20
    assert 0 < chosen.attrs["n_edges"] <= 20 == int(chosen.attrs["budget"])
    kept = chosen.values
    magnitude = np.abs(np.nan_to_num(scores.values))
    assert magnitude[kept].min() >= np.sort(magnitude.ravel())[-20]  # from the top 20
    graph = Graph.of(gqa64)
    np.testing.assert_array_equal(circuits.on_paths(graph, kept), kept)  # pruning is stable
    assert kept[:, -1].any()  # something reaches the logits
    every = edges.circuit(scores, fraction=1.0)
    assert every.attrs["n_edges"] == int(graph.valid.sum())
    path = lsc.save(chosen, tmp_path / "circuit.zarr")
    loaded = lsc.open(path)
    xr.testing.assert_identical(loaded, chosen)


def test_pruning_drops_edges_that_lead_nowhere():
    graph = Graph(2, 2, 1)
    kept = np.zeros(graph.valid.shape, dtype=bool)
    receivers = {label: r for r, label in enumerate(graph.receiver_labels)}
    senders = {label: s for s, label in enumerate(graph.sender_labels)}
    kept[senders["embed"], receivers["L0.H1.q"]] = True  # embed -> head 0.1 ...
    kept[senders["L0.H1"], receivers["logits"]] = True  # ... -> logits: a path
    kept[senders["embed"], receivers["L1.KV0.v"]] = True  # L1 heads reach nothing: dropped
    kept[senders["L1.MLP"], receivers["logits"]] = True  # L1 MLP reads nothing: dropped
    pruned = circuits.on_paths(graph, kept)
    assert pruned.sum() == 2
    assert pruned[senders["embed"], receivers["L0.H1.q"]]
    assert pruned[senders["L0.H1"], receivers["logits"]]


def test_faithfulness_curve_ends_at_one_and_beats_random(gqa64):
    prompts = IOI[:6]
    scores = edges.edge_attribution(gqa64, prompts, progress=False)
    result = edges.circuit_faithfulness(
        gqa64, prompts, scores, fractions=(0.05, 0.2, 1.0), n_random=2, progress=False
    )
    assert result["faithfulness"].sizes == {"budget": 3}
    assert result["random_faithfulness"].sizes == {"seed": 2, "budget": 3}
    np.testing.assert_allclose(result["faithfulness"].sel(budget=1.0), 1.0, rtol=1e-9)
    np.testing.assert_allclose(result["random_faithfulness"].sel(budget=1.0), 1.0, rtol=1e-9)
    curve = result["faithfulness"].values
    expected_cpr = ((curve[1:] + curve[:-1]) / 2 * np.diff([0.05, 0.2, 1.0])).sum() / 0.95
    np.testing.assert_allclose(float(result["cpr"]), expected_cpr)
    assert float(result["m_full"]) != float(result["m_empty"])
    assert list(result["n_edges"].values) == sorted(result["n_edges"].values)


def test_transformer_lens_backend_is_refused_naming_nnsight(tiny_llama):
    with pytest.raises(ValueError, match="backend='nnsight'"):
        edges.edge_attribution(tiny_llama, IOI[:2], backend="transformer_lens", progress=False)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"steps": 0}, "steps"),
        ({"estimator": "eap", "steps": 3}, "eap-ig"),
        ({"estimator": "atp"}, "estimator"),
        ({"metric": "accuracy"}, "metric"),
    ],
)
def test_bad_options_are_refused(tiny_llama, options, match):
    with pytest.raises(ValueError, match=match):
        edges.edge_attribution(tiny_llama, IOI[:2], progress=False, **options)


def test_corrupt_prompt_of_another_length_is_refused(tiny_llama):
    prompt = data.Prompt(
        text=IOI[0].text,
        target=IOI[0].target,
        distractor=IOI[0].distractor,
        corrupt=IOI[0].text + " and so on",
    )
    with pytest.raises(ValueError, match="differ in length"):
        edges.edge_attribution(tiny_llama, [prompt], progress=False)


def test_bad_budgets_and_foreign_circuits_are_refused(gqa64, tiny_llama, tokenizer):
    scores = edges.edge_attribution(gqa64, IOI[:2], progress=False)
    n_edges = int(Graph.of(gqa64).valid.sum())
    for budget, match in [
        ({"edges": 0}, "edges"),
        ({"edges": n_edges + 1}, "edges"),
        ({"fraction": 0.0}, "fraction"),
        ({}, "exactly one"),
        ({"edges": 3, "fraction": 0.1}, "exactly one"),
    ]:
        with pytest.raises(ValueError, match=match):
            edges.circuit(scores, **budget)
    with pytest.raises(ValueError, match="mean"):
        edges.circuit(
            edges.edge_attribution(gqa64, IOI[:2], per_prompt=True, progress=False), edges=3
        )
    two_layers = models.tiny("llama", n_layers=2, seed=0, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="this model"):
        edges.edge_patching(two_layers, IOI[:2], edges.circuit(scores, edges=5), progress=False)


def test_bad_circuits_budgets_and_seeds_are_refused_by_name(tiny_llama):
    scores = edges.edge_attribution(tiny_llama, IOI[:2], progress=False)
    for circuit, error in [
        (None, TypeError),
        (lsc.circuit(scores, fraction=0.5).to_dataset(name="kept"), TypeError),
        (lsc.circuit(scores, fraction=0.5).isel(sender=0), ValueError),
    ]:
        with pytest.raises(error, match=r"^circuit "):
            edges.edge_patching(tiny_llama, IOI[:2], circuit, progress=False)
    for options, error, match in [
        ({"fractions": None}, TypeError, "fractions must be a list"),
        ({"fractions": ["a"]}, TypeError, r"fractions\[0\] must be a number"),
        ({"fractions": (0.5, 0.2)}, ValueError, "fractions must be increasing"),
        ({"seed": -1}, ValueError, "seed must be a whole number from 0"),
        ({"seed": 0.0}, TypeError, "seed must be a whole number from 0"),
    ]:
        with pytest.raises(error, match=match):
            edges.circuit_faithfulness(
                tiny_llama, IOI[:2], scores, n_random=1, progress=False, **options
            )


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"n_top": 0, "n_random": 0}, ValueError, "sample no edge"),
        ({"estimators": ["eap", "eap"]}, ValueError, "estimators names one twice"),
        ({"top_k": 0}, ValueError, "top_k must be a positive integer"),
        ({"steps": 1.5}, TypeError, "steps must be a positive integer"),
        ({"seed": -1}, ValueError, "seed must be a whole number from 0"),
    ],
)
def test_agreement_options_are_checked_before_any_pass(tiny_llama, options, error, match):
    passes = []
    handle = tiny_llama.hf.register_forward_hook(lambda *args: passes.append(1))
    try:
        with pytest.raises(error, match=match):
            edges.edge_agreement(tiny_llama, IOI[:2], progress=False, **options)
    finally:
        handle.remove()
    assert not passes


def test_a_module_the_description_lacks_is_refused_before_any_pass(tiny_llama):
    """A layout naming a fused q/k/v projection the model does not have (the self-check
    skipped): refused before any pass, naming the module and the field that describes it."""
    import dataclasses

    circuit = lsc.circuit(edges.edge_attribution(tiny_llama, IOI[:2], progress=False), fraction=0.5)
    layout = dataclasses.replace(tiny_llama.spec.layout, qkv=("self_attn.qkv_proj",))
    model = models.from_hf(
        tiny_llama.hf, tiny_llama.tokenizer, name=tiny_llama.name, layout=layout, check=False
    )
    passes = []
    handle = model.hf.register_forward_hook(lambda *args: passes.append(1))
    try:
        for call in (
            lambda: edges.edge_attribution(model, IOI[:2], progress=False),
            lambda: edges.edge_patching(model, IOI[:2], circuit, progress=False),
        ):
            with pytest.raises(
                ValueError, match=r"'self_attn\.qkv_proj'.*lsc\.ArchLayout\(\.\.\., qkv="
            ):
                call()
    finally:
        handle.remove()
    assert not passes


def test_eap_equals_transformer_lens_edge_attribution(tokenizer):
    """Peer check: TransformerLens 4.3's ``attribution_patch(granularity="edge")`` on a tiny
    random Llama with as many key/value heads as query heads (it refuses GQA).

    Same sign convention (denoising: (clean - corrupt sender) . gradient at the corrupt
    run, positive = the edge carries the clean answer) and the same metric (logit
    difference at the last token). TransformerLens scores edges per position and averages
    over prompts; lenscape sums over positions, so its per-position scores are summed
    here. Tolerance: 1e-4 relative to the largest score (float32 runs of two different
    hook stacks)."""
    import copy

    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis import attribution_patching as tl

    model = _float64(tokenizer, seed=2, num_key_value_heads=4)
    model = models.from_hf(model.hf, tokenizer, name="tiny-llama-mha", dtype="float32")
    prompts = IOI[:2]
    ours = edges.edge_attribution(model, prompts, progress=False)
    # Its own bridge with trainable weights: TransformerLens differentiates through them.
    bridge = TransformerBridge.boot_transformers(
        model.name, hf_model=copy.deepcopy(model.hf), tokenizer=tokenizer, device="cpu"
    ).requires_grad_(True)
    kinds = {"q_input": "q", "k_input": "k", "v_input": "v", "mlp_in": "mlp", "logits": "logits"}
    theirs = xr.zeros_like(ours)
    for prompt in prompts:
        clean = torch.tensor([tokenizer(prompt.text)["input_ids"]])
        corrupt = torch.tensor([tokenizer(prompt.corrupt)["input_ids"]])
        target = tokenizer(prompt.target, add_special_tokens=False)["input_ids"][0]
        distractor = tokenizer(prompt.distractor, add_special_tokens=False)["input_ids"][0]

        def metric(logits, target=target, distractor=distractor):
            return logits[0, -1, target] - logits[0, -1, distractor]

        result = tl.attribution_patch(
            bridge, clean, corrupt, metric, tl.EdgeAttributionConfig(granularity="edge")
        )
        for (writer, reader), score in result.edge_scores.items():
            sender = {
                "embed": "embed",
                "attn_head_out": f"L{writer.layer}.H{writer.head}",
                "mlp_out": f"L{writer.layer}.MLP",
            }[writer.kind]
            kind = kinds[reader.kind]
            receiver = {
                "q": f"L{reader.layer}.H{reader.head}.q",
                "k": f"L{reader.layer}.KV{reader.head}.k",
                "v": f"L{reader.layer}.KV{reader.head}.v",
                "mlp": f"L{reader.layer}.MLP",
                "logits": "logits",
            }[kind]
            theirs.loc[{"sender": sender, "receiver": receiver}] += score / len(prompts)
    valid = np.isfinite(ours.values)
    assert np.abs(ours.values[valid]).max() > 1e-5
    scale = np.abs(ours.values[valid]).max()
    np.testing.assert_allclose(ours.values[valid], theirs.values[valid], rtol=0, atol=1e-4 * scale)


def test_agreement_is_perfect_where_the_model_is_linear(linear64):
    """In a linear model EAP and EAP-IG both equal exact single-edge patching; queries are
    zero there, so q and k edges have no effect and their correlations are undefined."""
    result = edges.edge_agreement(linear64, IOI[:4], steps=3, n_top=10, n_random=30, progress=False)
    assert list(result["estimator"].values) == ["eap", "eap-ig"]
    for kind in ("v", "mlp", "logits"):
        if kind in result["receiver_kind"].values:
            np.testing.assert_allclose(
                result["pearson_cells"].sel(receiver_kind=kind), 1.0, atol=1e-6
            )
            # every resample of the prompts agrees perfectly too: the interval is [1, 1]
            np.testing.assert_allclose(
                result["pearson_cells_interval"].sel(receiver_kind=kind), 1.0, atol=1e-6
            )
    interval = result["pearson_cells_interval"]
    assert interval.dims == ("estimator", "receiver_kind", "bound")
    assert interval.attrs["interval_seed"] == 0 and interval.attrs["ci"] == 0.95
    np.testing.assert_allclose(
        result["estimate"].sel(estimator="eap"), result["exact"], rtol=1e-4, atol=1e-6
    )
    assert int(result["n_edges"].sum()) == result.sizes["edge"] >= 30


def test_agreement_samples_the_top_edges_of_each_estimator(gqa64):
    result = edges.edge_agreement(gqa64, IOI[:3], steps=2, n_top=5, n_random=0, progress=False)
    scores = edges.edge_attribution(gqa64, IOI[:3], progress=False)
    top = np.argsort(-np.abs(np.nan_to_num(scores.values)).ravel())[:5]
    labels = {
        (scores["sender"].values[s], scores["receiver"].values[r])
        for s, r in zip(*np.unravel_index(top, scores.shape), strict=True)
    }
    sampled = set(zip(result["sender"].values, result["receiver"].values, strict=True))
    assert labels <= sampled and 5 <= len(sampled) <= 10


def test_edge_patching_with_every_edge_kept_is_the_unpatched_run(gqa64):
    prompts = IOI[:3]
    scores = edges.edge_attribution(gqa64, prompts, progress=False)
    full = lsc.circuit(scores, fraction=1.0)
    inputs = _inputs(gqa64, prompts)
    _, clean, corrupt = _patched_metrics(inputs, [], "clean")
    for base, expected in (("clean", clean), ("corrupt", corrupt)):
        patched = lsc.edge_patching(gqa64, prompts, full, base=base, progress=False)
        assert patched.dims == ("prompt",) and patched.attrs["base"] == base
        np.testing.assert_allclose(patched.values, expected.numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="base"):
        lsc.edge_patching(gqa64, prompts, full, base="both", progress=False)


def test_a_heads_outgoing_edges_sum_to_its_attribution_patching_score(tiny_llama):
    """The residual stream feeds every receiver, so a sender's gradient is the sum of its
    receivers' gradients: summed over receivers, EAP is lsc.attribution_patching's head
    score (same denoising sign, gradient at the corrupt run)."""
    prompts = IOI[:4]
    scores = edges.edge_attribution(tiny_llama, prompts, per_prompt=True, progress=False)
    heads = lsc.attribution_patching(tiny_llama, prompts, level="head", progress=False)
    summed = scores.where(scores["sender_kind"] == "head", drop=True).sum("receiver")
    for layer in range(3):
        for head in range(4):
            np.testing.assert_allclose(
                summed.sel(sender=f"L{layer}.H{head}").values,
                heads.sel(layer=layer, head=head).values,
                rtol=1e-4,
                atol=1e-4 * float(np.abs(heads).max()),
            )


# ------------------------------------------------- read by label, kind and degenerate input


def test_a_sorted_or_transposed_input_gives_the_same_circuit_and_patching(gqa64):
    prompts = IOI[:3]
    scores = edges.edge_attribution(gqa64, prompts, progress=False)
    chosen = edges.circuit(scores, edges=15)
    shuffled = scores.sortby("receiver").isel(sender=np.random.default_rng(0).permutation(16))
    for variant in (shuffled, shuffled.transpose()):
        again = edges.circuit(variant, edges=15)
        assert again.attrs["n_edges"] == chosen.attrs["n_edges"]
        xr.testing.assert_identical(
            again.sel(sender=chosen["sender"], receiver=chosen["receiver"]).transpose(*chosen.dims),
            chosen,
        )
    expected = edges.edge_patching(gqa64, prompts, chosen, progress=False)
    for variant in (chosen.sortby("receiver"), chosen.transpose(), chosen[::-1, ::-1]):
        xr.testing.assert_identical(
            edges.edge_patching(gqa64, prompts, variant, progress=False), expected
        )
    curve = edges.circuit_faithfulness(
        gqa64, prompts, scores, fractions=(0.1, 1.0), n_random=1, progress=False
    )
    again = edges.circuit_faithfulness(
        gqa64, prompts, shuffled.transpose(), fractions=(0.1, 1.0), n_random=1, progress=False
    )
    xr.testing.assert_identical(again, curve)


def test_the_wrong_kind_of_edge_result_is_refused(gqa64):
    scores = edges.edge_attribution(gqa64, IOI[:2], progress=False)
    chosen = edges.circuit(scores, fraction=0.3)
    with pytest.raises(ValueError, match=r"circuit must be .*; got a result of .edge_attr"):
        edges.edge_patching(gqa64, IOI[:2], scores, progress=False)
    with pytest.raises(ValueError, match=r"scores must be .*; got a result of 'circuit'"):
        edges.circuit(chosen, edges=3)
    with pytest.raises(ValueError, match=r"scores must be .*; got a result of 'circuit'"):
        edges.circuit_faithfulness(gqa64, IOI[:2], chosen, progress=False)
    # made by hand, without a method attr: judged by the dtype
    with pytest.raises(ValueError, match=r"circuit must be .*; got float64 numbers"):
        edges.edge_patching(gqa64, IOI[:2], scores.drop_attrs(), progress=False)
    with pytest.raises(ValueError, match=r"scores must be .*; got a boolean array"):
        edges.circuit(chosen.drop_attrs(), edges=3)
    other = scores.assign_attrs(method="direct_logit_attribution")
    with pytest.raises(ValueError, match="got a result of 'direct_logit_attribution'"):
        edges.circuit(other, edges=3)


def test_results_of_another_model_are_refused_naming_what_differs(gqa64, tokenizer):
    scores = edges.edge_attribution(gqa64, IOI[:2], progress=False)
    chosen = edges.circuit(scores, fraction=0.3)
    # same name and shapes, other weights
    twin = models.from_hf(
        models.tiny("llama", n_layers=3, seed=5, tokenizer=tokenizer).hf.double(),
        tokenizer,
        name=gqa64.name,
        dtype="float64",
    )
    for call in (
        lambda: edges.edge_patching(twin, IOI[:2], chosen, progress=False),
        lambda: edges.circuit_faithfulness(twin, IOI[:2], scores, progress=False),
    ):
        with pytest.raises(ValueError, match=r"another model .*weights_fingerprint"):
            call()


def test_scores_that_cannot_rank_edges_are_refused(gqa64):
    scores = edges.edge_attribution(gqa64, IOI[:2], progress=False)
    flat = scores.where(scores.isnull(), 0.0)  # what corrupt == clean gives
    with pytest.raises(ValueError, match=r"same score .*corrupt prompts equal to the clean"):
        edges.circuit(flat, edges=5)
    holed = scores.copy()
    holed.loc[{"sender": "embed", "receiver": "logits"}] = np.nan
    with pytest.raises(ValueError, match="1 NaN or infinite score"):
        edges.circuit(holed, edges=5)


def test_ties_at_the_cut_are_said(gqa64):
    scores = edges.edge_attribution(gqa64, IOI[:2], progress=False)
    scale = float(np.abs(scores).max())
    tied = scores.copy(data=np.round(scores.values / scale * 3))  # a few levels: many ties
    with pytest.warns(UserWarning, match=r"tie in \|score\|"):
        chosen = edges.circuit(tied, fraction=0.4)
    assert chosen.attrs["tied_at_cut"] > 0
    assert edges.circuit(scores, edges=10).attrs["tied_at_cut"] == 0


def test_faithfulness_when_corrupt_equals_clean_is_nan_with_a_warning(gqa64):
    same = [data.Prompt(p.text, p.target, corrupt=p.text, distractor=p.distractor) for p in IOI[:2]]
    scores = edges.edge_attribution(gqa64, IOI[:2], progress=False)
    with pytest.warns(UserWarning, match="same mean metric"):
        result = edges.circuit_faithfulness(
            gqa64, same, scores, fractions=(0.5, 1.0), n_random=1, progress=False
        )
    assert np.isnan(result["faithfulness"]).all() and "undefined" in result.attrs


def test_per_prompt_edge_scores_carry_correct_and_can_be_filtered(tiny_llama):
    from _helpers import answered_prompts, reference_correct

    prompts = answered_prompts(tiny_llama, IOI[:6])
    expected = reference_correct(tiny_llama, prompts)
    assert expected.any() and not expected.all()
    scores = edges.edge_attribution(tiny_llama, prompts, per_prompt=True, progress=False)
    np.testing.assert_array_equal(scores["correct"].values, expected)
    kept = lsc.aggregate.correct_only(scores)
    assert kept.sizes["prompt"] == int(expected.sum())
    for flags in ([np.nan] * 6, ["False"] * 6):
        with pytest.raises(ValueError, match="True/False"):
            lsc.aggregate.correct_only(scores.assign_coords(correct=("prompt", flags)))


def _per_receiver_copy_scores(model, prompts) -> np.ndarray:
    """EAP as lenscape computed it before its scores were chunked (kept as the reference):
    a zero leaf on every receiver's own copy of its input (each q, k, v head recomputed
    from its own norm), every receiver's gradient stacked into one (batch, pos, receiver,
    d_model) buffer and one dense product with the senders' clean - corrupt outputs."""
    inputs = _inputs(model, prompts)
    batch = inputs.batch(0)
    graph = Graph.of(model)
    clean, _ = hooks.unedited(inputs, batch.clean)
    rows, width, _, d_model = clean.shape
    leaves = {("logits", -1): torch.zeros(rows, width, d_model, dtype=clean.dtype)}
    for layer in range(graph.n_layers):
        leaves["attn", layer] = torch.zeros(rows, width, graph.per_layer - 1, d_model)
        leaves["mlp", layer] = torch.zeros(rows, width, d_model)
    leaves = {key: leaf.to(clean.dtype).requires_grad_(True) for key, leaf in leaves.items()}
    state = hooks.Pass(graph, deltas=leaves)
    logits = hooks.run_pass(model, "nnsight", batch.corrupt, state, grad=True)
    metric = hooks.metric_of(inputs, logits, batch).sum()
    grads = torch.autograd.grad(metric, list(leaves.values()))
    by_key = dict(zip(leaves, grads, strict=True))
    stacked = []
    for layer in range(graph.n_layers):
        stacked += [by_key["attn", layer], by_key["mlp", layer][:, :, None]]
    stacked.append(by_key["logits", -1][:, :, None])
    gradient = torch.cat(stacked, dim=2).float()
    mask = batch.corrupt.attention_mask.float()[:, :, None, None]
    diff = (clean.float() - state.senders.float()) * mask
    scores = torch.einsum("bpsd,bprd->bsr", diff, gradient).numpy()
    return np.where(graph.valid, scores, np.nan)


@pytest.mark.parametrize("chunk_bytes", [hooks.CHUNK_BYTES, 1])
def test_chunked_scores_equal_the_per_receiver_copies(tiny_llama, monkeypatch, chunk_bytes):
    """Receiver chunks (of every size down to one receiver) give the scores of one dense
    product over per-receiver input copies, to 1e-6 of their scale."""
    monkeypatch.setattr(hooks, "CHUNK_BYTES", chunk_bytes)
    prompts = IOI[:5]
    got = edges.edge_attribution(tiny_llama, prompts, per_prompt=True, batch_size=5, progress=False)
    expected = _per_receiver_copy_scores(tiny_llama, prompts)
    scale = np.nanmax(np.abs(expected))
    assert scale > 1e-3
    np.testing.assert_allclose(got.values, expected, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_scores_equal_the_per_receiver_copies(tokenizer, monkeypatch, dtype):
    """A bfloat16 model's scores are contracted in bfloat16 (float32 accumulation; inputs
    and scores rounded to bfloat16): within bfloat16's rounding of a float32 contraction,
    and of the product of the model's own per-receiver copies (whose half-precision
    gradients differ by their own rounding). A float16 model's are contracted in float32."""
    model = models.from_hf(
        models.tiny("llama", n_layers=3, tokenizer=tokenizer).hf,
        tokenizer,
        dtype=dtype,
        device="cpu",
    )
    prompts = IOI[:5]
    options = dict(per_prompt=True, batch_size=5, progress=False)
    got = edges.edge_attribution(model, prompts, **options)
    expected = _per_receiver_copy_scores(model, prompts)
    scale = np.nanmax(np.abs(expected))
    assert scale > 1e-3 and got.dtype == np.float32
    monkeypatch.setattr(edge_scores, "contraction_dtype", lambda model: torch.float32)
    in_float32 = edges.edge_attribution(model, prompts, **options)
    contraction_error = np.nanmax(np.abs(got.values - in_float32.values)) / scale
    if dtype == "bfloat16":
        assert 0 < contraction_error < 2**-7
    else:
        assert contraction_error == 0
    error = np.nanmax(np.abs(got.values - expected)) / scale
    assert error < (2**-6 if dtype == "bfloat16" else 2**-9), error


@pytest.mark.slow
def test_chunked_scores_equal_the_per_receiver_copies_on_the_bundled_model(smol):
    prompts = IOI[:4]
    got = edges.edge_attribution(smol, prompts, per_prompt=True, batch_size=4, progress=False)
    expected = _per_receiver_copy_scores(smol, prompts)
    scale = np.nanmax(np.abs(expected))
    np.testing.assert_allclose(got.values, expected, rtol=0, atol=1e-6 * scale)


# ---------------------------------------------------------------- relevance patching (RelP)


@pytest.mark.parametrize("rules", ["relp", "secant"])
def test_relp_edges_out_of_a_head_add_up_to_its_node_score(tiny_llama, rules):
    """Under any rules a sender's coefficient is the sum of its receivers' (the residual
    stream feeds each), so a head's RelP edges summed over receivers are its RelP score."""
    prompts = IOI[:4]
    scores = edges.edge_attribution(
        tiny_llama, prompts, estimator="relp", rules=rules, per_prompt=True, progress=False
    )
    heads = lsc.attribution_patching(
        tiny_llama, prompts, level="head", estimator="relp", rules=rules, progress=False
    )
    summed = scores.where(scores["sender_kind"] == "head", drop=True).sum("receiver")
    got = summed.values.reshape(heads.shape)
    np.testing.assert_allclose(got, heads.values, atol=1e-6 * float(np.abs(heads).max()))
    assert scores.attrs["rules"] == rules and "RelP" in scores.attrs["long_name"]
    eap = edges.edge_attribution(tiny_llama, prompts, per_prompt=True, progress=False)
    assert not np.allclose(np.nan_to_num(eap.values), np.nan_to_num(scores.values), atol=1e-6)


def test_edge_agreement_compares_relp_labels(tiny_llama):
    result = edges.edge_agreement(
        tiny_llama,
        IOI[:2],
        estimators=["eap", "relp:secant"],
        n_top=3,
        n_random=3,
        progress=False,
    )
    assert list(result["estimator"].values) == ["eap", "relp:secant"]
    with pytest.raises(ValueError, match="Unknown rules 'nope'"):
        edges.edge_agreement(tiny_llama, IOI[:2], estimators=["relp:nope"], progress=False)


def test_agreement_by_span_is_perfect_where_the_model_is_linear(linear64):
    """By span too: in a linear model EAP by span equals exact single-edge patching at the
    edge's span (k and v receivers for their query span's queries only)."""
    result = edges.edge_agreement(
        linear64,
        IOI[:3],
        estimators=("eap",),
        n_top=20,
        n_random=40,
        positions="spans",
        progress=False,
    )
    assert {"span", "sender", "receiver"} <= set(result["edge"].coords)
    assert any("@" in str(label) for label in result["receiver"].values)
    np.testing.assert_allclose(
        result["estimate"].sel(estimator="eap"), result["exact"], rtol=1e-4, atol=1e-6
    )
    assert float(np.abs(result["exact"]).max()) > 1e-3  # the check can fail
