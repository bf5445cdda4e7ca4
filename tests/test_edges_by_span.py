"""Edges between (component, span) nodes: ``edge_attribution(..., positions="spans")``.

On every tiny family (2 layers), EAP and EAP-IG by span equal
``_helpers.reference_edge_scores_by_span``: per receiver, the gradient at a zero leaf on its
own copy of the residual stream (plain hooks on the Hugging Face modules), a k or v receiver's
through one query span by keeping its block's attention output off the gradient elsewhere,
summed over each span's positions found from the tokenizer's character offsets. Edges the
graph says cannot exist (keys at a span after the query span) are 0 in the reference. Summed
over spans and query spans, every estimator's scores (and error estimates' cells) are the
position-agnostic ones.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape import bootstrap, data, models
from lenscape.capture import edges
from lenscape.capture.edges import patching as edge_patching
from lenscape.capture.edges.graph import Graph, SpanGraph

IOI = data.prompts("ioi")
FAMILIES = tuple(a for a in models.TINY_ARCHITECTURES if a not in ("mistral", "qwen2"))
#: Largest difference relative to the largest score (float32 models; measured <= 2e-6).
TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tokenizer):
    return models.tiny(request.param, n_layers=2, tokenizer=tokenizer)


def _mixed_lengths(model, count=2):
    """IOI prompts of different token lengths (the first ``count`` lengths met)."""
    from _helpers import mixed_length_prompts

    return mixed_length_prompts(model, IOI, count)


def _lacking(prompt: lsc.data.Prompt, span: str) -> lsc.data.Prompt:
    """``prompt`` without its span ``span``."""

    def without(spans):
        return None if spans is None else {k: at for k, at in spans.items() if k != span}

    return dataclasses.replace(
        prompt, spans=without(prompt.spans), corrupt_spans=without(prompt.corrupt_spans)
    )


@pytest.mark.parametrize("estimator, steps", [("eap", 1), ("eap-ig", 2)])
def test_edges_by_span_equal_the_per_receiver_reference(family, estimator, steps):
    from _helpers import span_score_errors

    for row in span_score_errors(family, _mixed_lengths(family), estimator, steps):
        assert row["scale"] > 1e-6  # the check can fail
        # every edge the graph has is compared; those it has not are 0 in the reference
        assert row["compared"] == row["edges"]
        assert row["error"] < TOLERANCE, row
        assert row["absent"] < TOLERANCE


@pytest.mark.parametrize(
    "options",
    [dict(), dict(estimator="eap-ig", steps=3), dict(error=True), dict(estimator="relp")],
    ids=["eap", "eap-ig", "error", "relp"],
)
def test_edges_by_span_add_up_to_the_position_agnostic_scores(tiny_llama, options):
    prompts = IOI[:5]
    shared = dict(per_prompt=True, batch_size=2, progress=False, **options)
    agnostic = edges.edge_attribution(tiny_llama, prompts, **shared)
    by_span = edges.edge_attribution(tiny_llama, prompts, positions="spans", **shared)
    assert by_span.dims == ("prompt", "span", "sender", "receiver")
    assert list(by_span["span"].values) == ["IO", "S1", "S2", "END", "other"]
    assert by_span.attrs["positions"] == "spans"
    from _helpers import position_agnostic

    summed = position_agnostic(by_span, agnostic)
    scale = float(np.nanmax(np.abs(agnostic.values)))
    np.testing.assert_allclose(
        summed.values, np.nan_to_num(agnostic.values), rtol=0, atol=1e-6 * scale
    )
    if options.get("error"):
        # the error estimates exist where the scores do, and are sizes
        assert bool((by_span["error"].isnull() == by_span.isnull()).all())
        assert float(by_span["error"].min()) >= 0


def test_edges_by_span_do_not_depend_on_padding_side_or_batching(tiny_llama):
    prompts = _mixed_lengths(tiny_llama, 3)
    runs = [
        edges.edge_attribution(
            tiny_llama,
            prompts,
            positions="spans",
            per_prompt=True,
            padding_side=side,
            batch_size=size,
            progress=False,
        )
        for side, size in (("right", 3), ("left", 3), ("left", 1))
    ]
    for other in runs[1:]:
        np.testing.assert_allclose(other.values, runs[0].values, rtol=0, atol=1e-6)


def test_the_prompt_mean_is_over_the_prompts_that_have_the_span(tiny_llama):
    with_io = IOI[0]
    without = _lacking(with_io, "IO")
    per_prompt = edges.edge_attribution(
        tiny_llama, [with_io, without], positions="spans", per_prompt=True, progress=False
    )
    assert bool(per_prompt.sel(span="IO").isel(prompt=1).isnull().all())
    mean = edges.edge_attribution(tiny_llama, [with_io, without], positions="spans", progress=False)
    io = per_prompt.sel(span="IO").isel(prompt=0)
    np.testing.assert_allclose(mean.sel(span="IO").values, io.values, rtol=1e-6, equal_nan=True)


def test_the_span_graph_counts_and_names_its_edges(tiny_llama):
    base = Graph.of(tiny_llama)
    graph = SpanGraph(base, ("IO", "S1", "END", "other"))
    n_spans, n_senders, n_receivers = graph.shape
    assert (n_spans, n_senders) == (4, len(base.senders))
    per_layer = base.n_heads + 2 * base.n_kv_heads * 4 + 1
    assert n_receivers == base.n_layers * per_layer + 1
    labels = graph.receiver_labels
    assert "L1.KV0.k@END" in labels and "L1.H0.q" in labels and labels[-1] == "logits"
    valid = xr.DataArray(graph.valid, dims=("span", "sender", "receiver"), coords=graph.coords())
    # keys at IO reach queries at END; keys at END do not reach queries at IO
    assert bool(valid.sel(span="IO", sender="embed", receiver="L1.KV0.k@END"))
    assert not bool(valid.sel(span="END", sender="embed", receiver="L1.KV0.k@IO"))
    # "other" tokens lie anywhere: both ways
    assert bool(valid.sel(span="other", sender="embed", receiver="L1.KV0.v@IO"))
    assert bool(valid.sel(span="END", sender="embed", receiver="L1.KV0.v@other"))
    # no edge upstream, whatever the span
    assert not bool(valid.sel(sender="L1.MLP", receiver="L0.MLP").any())
    # every base edge is there at every span through q, MLP and logits
    kept = valid.where(valid["query_span"] == "", drop=True).astype(bool)
    assert int(kept.sum()) == 4 * int(
        base.valid[:, [k for k, r in enumerate(base.receivers) if r[0] not in "kv"]].sum()
    )


def test_edges_by_span_are_refused_on_bad_input(tiny_llama):
    plain = [
        lsc.data.Prompt(text=p.text, corrupt=p.corrupt, target=p.target, distractor=p.distractor)
        for p in IOI[:2]
    ]
    with pytest.raises(ValueError, match="name no spans"):
        edges.edge_attribution(tiny_llama, plain, positions="spans", progress=False)
    with pytest.raises(ValueError, match="not 'each'"):
        edges.edge_attribution(tiny_llama, IOI[:2], positions="each", progress=False)
    first = IOI[0]
    # the same names in the other order: S1 before IO
    text = "When Alice and Peter went to the store, Alice gave a book to"
    swapped = lsc.data.Prompt(
        text=text,
        corrupt="When Alice and Peter went to the store, Peter gave a book to",
        target=" Peter",
        distractor=" Alice",
        spans={"S1": "Alice", "IO": "Peter", "S2": ("Alice", 2), "END": (" to", 2)},
    )
    assert first.spans["IO"][0] < first.spans["S1"][0]
    assert swapped.spans["S1"][0] < swapped.spans["IO"][0]
    with pytest.raises(ValueError, match=r"one order.*IO, S1.*S1, IO.*Split the set"):
        edges.edge_attribution(tiny_llama, [first, swapped], positions="spans", progress=False)


def _brute_force_paths(graph: SpanGraph, kept: np.ndarray) -> np.ndarray:
    """``kept`` pruned by a search over (component, span) nodes: an edge stays when its
    sender node is reached from an embedding node and its receiver's node reaches a logits
    node."""
    n_spans, n_senders, _ = graph.shape
    forward, backward, arcs = {}, {}, []
    for span, sender, receiver in zip(*np.nonzero(kept), strict=True):
        head = (int(sender), int(span))
        for component in np.flatnonzero(graph.feeds[receiver]):
            tail = (int(component), int(graph.target_span[span, receiver]))
            arcs.append((head, tail, (span, sender, receiver)))
            forward.setdefault(head, []).append(tail)
            backward.setdefault(tail, []).append(head)

    def closure(start, step):
        seen, todo = set(start), list(start)
        while todo:
            for node in step.get(todo.pop(), []):
                if node not in seen:
                    seen.add(node)
                    todo.append(node)
        return seen

    reached = closure([(0, c) for c in range(n_spans)], forward)
    live = closure([(n_senders, c) for c in range(n_spans)], backward)
    out = np.zeros_like(kept)
    for head, tail, edge in arcs:
        if head in reached and tail in live:
            out[edge] = True
    return out


def test_a_circuit_by_span_keeps_the_top_edges_on_paths_through_span_nodes(tiny_llama):
    scores = edges.edge_attribution(tiny_llama, IOI[:4], positions="spans", progress=False)
    graph = SpanGraph.of_result(scores)
    for budget in (10, 40, 200):
        circuit = lsc.circuit(scores, edges=budget)
        assert circuit.dims == scores.dims and circuit.dtype == bool
        top = np.zeros(graph.shape, dtype=bool)
        order = np.argsort(-np.where(graph.valid, np.abs(scores.values), -1).ravel(), kind="stable")
        top.ravel()[order[:budget]] = True
        expected = _brute_force_paths(graph, top)
        assert (circuit.values == expected).all() and expected.any()
        assert circuit.attrs["n_edges"] == int(expected.sum())
        # read by label: a sorted, transposed input gives the same circuit
        shuffled = lsc.circuit(
            scores.sortby("span").transpose("receiver", "span", "sender"), edges=budget
        )
        assert (shuffled.transpose(*circuit.dims).sel(span=circuit["span"]) == circuit).all()


def test_circuits_by_span_patch_exactly_and_refuse_the_wrong_graph(tiny_llama):
    prompts = IOI[:3]
    scores = edges.edge_attribution(tiny_llama, prompts, positions="spans", progress=False)
    every = lsc.circuit(scores, fraction=1.0)
    kept = edges.edge_patching(tiny_llama, prompts, every, progress=False)
    clean = edge_patching._edge_variants(
        tiny_llama, prompts, variants=(("only", ()),), positions="spans", progress=False
    )
    np.testing.assert_allclose(kept.values, clean["base"].values, rtol=0, atol=1e-5)
    curve = edges.circuit_faithfulness(
        tiny_llama, prompts, scores, fractions=(0.05, 0.5, 1.0), n_random=1, progress=False
    )
    np.testing.assert_allclose(curve["faithfulness"].sel(budget=1.0), 1.0, atol=1e-4)
    # prompts whose spans differ from the circuit's
    factual = list(lsc.data.prompts("factual")[:2])
    with pytest.raises(ValueError, match="same named spans"):
        edges.edge_patching(tiny_llama, factual, every, progress=False)
    # a circuit by span on position-agnostic scores, or the reverse
    agnostic = edges.edge_attribution(tiny_llama, prompts, progress=False)
    small = lsc.circuit(scores, edges=20)
    with pytest.raises(
        ValueError, match="position-agnostic edges, and edges by span were expected"
    ):
        edges.exact_cut(tiny_llama, prompts, small, agnostic, edges=2, progress=False)
    with pytest.raises(ValueError, match="by span"):
        edges.exact_cut(
            tiny_llama, prompts, lsc.circuit(agnostic, edges=20), scores, edges=2, progress=False
        )


@pytest.fixture(scope="module")
def per_prompt_by_span(tiny_llama):
    """Per-prompt scores by span on 5 IOI prompts, the last without its IO span."""
    prompts = [*IOI[:4], _lacking(IOI[4], "IO")]
    return edges.edge_attribution(
        tiny_llama, prompts, positions="spans", per_prompt=True, progress=False
    )


def test_circuit_stability_by_span_is_the_share_of_resampled_circuits(per_prompt_by_span):
    """Against a plain loop: each resample's mean scores by span (over the drawn prompts
    that have the span), ``lsc.circuit`` of them, counted; then the consensus circuit is
    the edges of at least ``share`` of them, pruned to paths through span nodes."""
    scores = per_prompt_by_span
    assert bool(scores.isel(prompt=-1).sel(span="IO").isnull().all())
    result = edges.circuit_stability(scores, edges=30, n_resamples=25, seed=4)
    assert result.dims == ("span", "sender", "receiver")
    drawn = bootstrap.draw(5, n_resamples=25, seed=4)
    assert (drawn != 4).any(axis=1).all()  # every resample has a prompt with an IO span
    total = np.zeros(result.shape)
    for row in drawn:
        mean = scores.isel(prompt=row).mean("prompt").assign_attrs(scores.attrs)
        total += lsc.circuit(mean, edges=30).values
    graph = SpanGraph.of_result(result)
    np.testing.assert_allclose(result.values[graph.valid], (total / 25)[graph.valid])
    assert 0 < result.values[graph.valid].mean() < 1
    # read by label: a sorted, transposed input gives the same shares
    moved = scores.sortby("span").transpose("receiver", "prompt", "sender", "span")
    again = edges.circuit_stability(moved, edges=30, n_resamples=25, seed=4)
    xr.testing.assert_equal(again.transpose(*result.dims).sel(span=result["span"]), result)
    for share in (0.3, 0.6):
        consensus = edges.consensus_circuit(result, share=share)
        expected = _brute_force_paths(graph, np.nan_to_num(result.values) >= share)
        assert consensus.dims == result.dims and (consensus.values == expected).all()
        assert consensus.attrs["n_edges"] == int(expected.sum()) > 0


def test_an_exact_cut_by_span_measures_each_edge_at_its_span(tiny_llama):
    from _helpers import reference_edge_patching_by_span, span_edge_labels

    prompts = IOI[:2]
    scores = edges.edge_attribution(tiny_llama, prompts, positions="spans", progress=False)
    circuit = lsc.circuit(scores, edges=30)
    cut = edges.exact_cut(tiny_llama, prompts, circuit, scores, edges=4, progress=False)
    assert cut.dims == circuit.dims and cut["exact_effect"].dims == circuit.dims
    effect = cut["exact_effect"].values
    measured = np.isfinite(effect)
    assert measured.sum() == 8 == cut.attrs["cut_measured"]
    inside = measured & circuit.values
    assert inside.sum() == 4
    strongest = np.sort(np.abs(effect[measured]))[::-1][:4]
    assert np.all(np.abs(effect[cut.values & measured]) >= strongest[-1])  # kept by |exact|
    graph = SpanGraph.of_result(scores)
    chosen = [int(i) for i in np.flatnonzero(measured.ravel())]
    alone = edge_patching._edge_variants(
        tiny_llama,
        prompts,
        variants=tuple(("only", (i,)) for i in chosen),
        base="corrupt",
        positions="spans",
        progress=False,
    )
    base = alone["base"].values.astype(np.float64)
    reference = [
        reference_edge_patching_by_span(
            tiny_llama, prompt, [span_edge_labels(graph, i) for i in chosen]
        )
        for prompt in prompts
    ]
    by_hand = np.mean([list(r.values()) for r in reference], axis=0) - base.mean()
    ours = effect.ravel()[chosen]
    assert np.abs(by_hand).max() > 1e-6  # the check can fail
    np.testing.assert_allclose(ours, by_hand, rtol=0, atol=1e-3 * np.abs(by_hand).max())
    assert cut.attrs["n_edges"] == int(cut.sum())


def test_consensus_circuits_by_span_of_every_edge_are_faithful(tiny_llama, per_prompt_by_span):
    prompts = [*IOI[:4], _lacking(IOI[4], "IO")]
    curve = edges.consensus_faithfulness(
        tiny_llama,
        prompts,
        per_prompt_by_span,
        fractions=(0.02, 1.0),
        n_resamples=5,
        n_random=1,
        progress=False,
    )
    np.testing.assert_allclose(curve["faithfulness"].sel(budget=1.0), 1.0, atol=1e-4)
    assert curve["n_edges"].sel(budget=0.02) < curve["n_edges"].sel(budget=1.0)


def test_exact_patching_by_span_equals_the_per_receiver_reference(family):
    """Each sampled edge alone on the corrupt run (its receiver reading the clean sender at
    the span; a k or v receiver for its query span's queries only), at the spans where the
    clean and corrupt senders differ (an IOI pair differs from S2 on)."""
    from _helpers import reference_edge_patching_by_span, sampled_span_edges, span_edge_labels

    prompt = IOI[0]
    inputs_graph = SpanGraph(Graph.of(family), ("IO", "S1", "S2", "END", "other"))
    chosen = sampled_span_edges(inputs_graph, 45, ("S2", "END", "other"))
    result = edge_patching._edge_variants(
        family,
        [prompt],
        variants=tuple(("only", (i,)) for i in chosen),
        base="corrupt",
        positions="spans",
        progress=False,
    )
    reference = reference_edge_patching_by_span(
        family, prompt, [span_edge_labels(inputs_graph, i) for i in chosen]
    )
    ours = result["patched"].isel(prompt=0).values.astype(np.float64)
    expected = np.array(list(reference.values()))
    effects = np.abs(expected - float(result["base"].isel(prompt=0)))
    # the edges move the metric well above float32 rounding (~3e-8): the check can fail
    assert (effects > 1e-6).sum() >= 10, effects
    error = np.abs(ours - expected).max() / effects.max()
    assert error < 1e-3, error


def test_patching_every_edge_by_span_gives_the_other_run_and_none_the_base(family):
    from _helpers import patched_every_and_none_by_span

    every, none, other, base = patched_every_and_none_by_span(family, _mixed_lengths(family, 2))
    scale = float(np.abs(base - other).max())
    assert scale > 1e-4
    np.testing.assert_allclose(every, other, rtol=0, atol=1e-4 * scale)
    # no edge patched: the base run up to float32 rounding of the metric (~1e-7 of it)
    rounding = 1e-6 * float(np.abs(base).max())
    np.testing.assert_allclose(none, base, rtol=0, atol=1e-5 * scale + rounding)
