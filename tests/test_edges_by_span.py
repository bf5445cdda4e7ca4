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

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape import data, models
from lenscape.capture import edges
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
    chosen, lengths = [], set()
    for prompt in IOI:
        n = len(model.tokenizer(prompt.text)["input_ids"])
        if n not in lengths:
            chosen.append(prompt)
            lengths.add(n)
        if len(chosen) == count:
            return chosen
    raise AssertionError("IOI has prompts of one length only")


def position_agnostic(by_span: xr.DataArray, like: xr.DataArray) -> xr.DataArray:
    """Scores by span summed over spans and over each k/v receiver's query spans, on
    ``like``'s receivers."""
    total = by_span.fillna(0).sum("span")
    base = xr.DataArray(
        [label.split("@")[0] for label in map(str, total["receiver"].values)],
        dims="receiver",
        name="base",
    )
    summed = total.groupby(base).sum().rename(base="receiver")
    return summed.sel(receiver=like["receiver"].values).transpose(*like.dims)


@pytest.mark.parametrize("estimator, steps", [("eap", 1), ("eap-ig", 2)])
def test_edges_by_span_equal_the_per_receiver_reference(family, estimator, steps):
    from _helpers import reference_edge_scores_by_span

    prompts = _mixed_lengths(family)
    scores = edges.edge_attribution(
        family,
        prompts,
        estimator=estimator,
        steps=steps if steps > 1 else None,
        positions="spans",
        per_prompt=True,
        padding_side="left",
        progress=False,
    )
    for row, prompt in enumerate(prompts):
        reference = reference_edge_scores_by_span(family, prompt, steps=steps)
        ours = scores.isel(prompt=row)
        got = np.array([float(ours.sel(span=c, sender=s, receiver=r)) for c, s, r in reference])
        expected = np.array(list(reference.values()))
        scale = np.abs(expected).max()
        assert scale > 1e-6  # the check can fail
        defined = ~np.isnan(got)
        # every edge the graph has is compared; those it has not are 0 in the reference
        assert int(defined.sum()) == int(ours.notnull().sum())
        error = np.abs(got[defined] - expected[defined]).max() / scale
        assert error < TOLERANCE, error
        assert np.abs(expected[~defined]).max(initial=0) < TOLERANCE * scale


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
    without = lsc.data.Prompt(
        text=with_io.text,
        corrupt=with_io.corrupt,
        target=with_io.target,
        distractor=with_io.distractor,
        spans={name: span for name, span in with_io.spans.items() if name != "IO"},
    )
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


def test_a_span_result_given_to_a_circuit_is_refused(tiny_llama):
    scores = edges.edge_attribution(tiny_llama, IOI[:2], positions="spans", progress=False)
    with pytest.raises(ValueError, match="by span"):
        lsc.circuit(scores, edges=5)
