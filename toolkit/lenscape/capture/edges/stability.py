"""Circuit stability: how often each edge enters the circuit when the prompts are redrawn.

A circuit picked from the prompt-mean scores of one set of prompts (``lsc.circuit``) is one
draw: other prompts of the same task could give other edges. ``circuit_stability`` redraws
the prompts with replacement ``n_resamples`` times (one seeded ``bootstrap.draw`` over the
prompts in label order, as every interval of lenscape is made), picks each resample's
circuit exactly as ``lsc.circuit`` does (the top edges by |mean score|, ties in graph order,
pruned to paths embeddings -> logits by ``circuits.on_paths``) and counts how often each
edge is in it: its inclusion frequency, from 0 to 1. ``consensus_circuit`` keeps the edges
in at least ``share`` of the resamples (pruned to paths again), a circuit like any other:
``edge_patching`` and ``circuit_graph`` take it. ``consensus_faithfulness`` judges the
consensus circuits of every edge budget by exact edge patching, as ``circuit_faithfulness``
judges the single-draw ones, so the two curves (and their CPR and CMD) compare.

Each resample's mean is one matrix product of the draw's counts (``bootstrap.counts``) with
the per-prompt scores, taken a block of resamples at a time (``bootstrap.BLOCK_VALUES``
numbers per block); ranking and pruning run on the whole block (``on_paths`` over a leading
dim): no Python loop per edge or per resample. Scores are read by label (``graph.aligned``,
prompts in label order), so a ``sortby``, ``isel`` or ``transpose`` never changes an answer.

Scores by span (``positions="spans"``, (prompt, span, sender, receiver)) resample the same
way: each resample's circuit is by span (paths through (component, span) nodes), and a prompt
that lacks a span is left out of that span's means, as ``edge_attribution`` leaves it out of
its prompt mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from ... import _validate, bootstrap
from ...data import Prompts
from ...models import LensModel
from ...sweep.registry import method
from .circuits import (
    CIRCUIT_METHOD,
    SCORE_METHODS,
    budget,
    check_kind,
    graph_of,
    on_labels_of,
    on_paths,
)
from .graph import Graph, SpanGraph, aligned
from .patching import (
    DEFAULT_FRACTIONS,
    MAX_RANDOM,
    _edge_variants,
    _random_circuits,
    _report,
    check_fractions,
    graph_for,
    span_options,
)

#: The ``method`` attr of ``circuit_stability``'s results.
STABILITY_METHOD = "circuit_stability"
#: Resamples when none is given: a frequency to about +-0.035 (one standard error at 0.5).
DEFAULT_RESAMPLES = 200
#: Most resamples one call may ask for: each ranks every edge (a sort of all of them) and
#: prunes its circuit, about 5 ms per resample on SmolLM2's 70,651 edges.
MAX_RESAMPLES = 10_000
#: The share of resamples an edge must be in to enter the consensus circuit, by default.
DEFAULT_SHARE = 0.5
PER_PROMPT = "lsc.edge_attribution(..., per_prompt=True)"


def check_options(n_resamples: Any, seed: Any) -> tuple[int, int]:
    """``n_resamples`` (1 .. ``MAX_RESAMPLES``) and ``seed`` (>= 0), checked.

    Raises:
        TypeError: not integers. ValueError: out of range.
    """
    return (
        _validate.integer("n_resamples", n_resamples, low=1, high=MAX_RESAMPLES),
        _validate.integer("seed", seed, low=0),
    )


def check_share(share: Any) -> float:
    """A consensus share: a number in (0, 1].

    Raises:
        TypeError: not a number. ValueError: outside (0, 1].
    """
    return _validate.number("share", share, above=0, high=1)


def prompt_values(scores: Any, graph: Graph | SpanGraph, *, name: str = "scores") -> np.ndarray:
    """(n_prompts, n_edges) float64 per-prompt scores of ``graph``'s real edges (in graph
    order), the prompts in label order, checked to rank edges. By span, NaN where a prompt
    lacks the edge's span (``edge_attribution`` leaves those cells out).

    Raises:
        TypeError: not a DataArray.
        ValueError: scores without a ``prompt`` dim (a prompt mean), of another kind, with
            other labels, repeated prompt labels, fewer than 2 prompts, NaN or infinite
            scores on real edges, or every edge's mean alike.
    """
    check_kind(name, scores, methods=SCORE_METHODS, made_by=PER_PROMPT)
    if "prompt" not in scores.dims:
        raise ValueError(
            f"{name} must hold per-prompt scores (a 'prompt' dim), got dims {list(scores.dims)}: "
            f"resampling draws prompts; score with {PER_PROMPT}."
        )
    by_label = aligned(
        name, scores, graph, made_by=PER_PROMPT, dims=("prompt", "sender", "receiver")
    )
    return _checked_values(name, by_label, graph)


def _lacks_span(values: np.ndarray, graph: Graph | SpanGraph) -> np.ndarray:
    """``values``' shape (prompt, *graph.shape), bool: the cell is NaN because its prompt
    lacks the edge's span or its k or v receiver's query span (a span whose every q, MLP and
    logits edge is NaN); all False off a ``SpanGraph``."""
    if not isinstance(graph, SpanGraph):
        return np.zeros(values.shape, dtype=bool)
    query = [q for *_, q in graph.receivers]
    within = graph.valid & (np.asarray(query) == "")[None, None, :]
    lacks = np.all(np.isnan(np.where(within, values, np.nan)), axis=(-2, -1))  # (prompt, span)
    at_query = np.zeros((len(values), len(query)), dtype=bool)
    for r, name in enumerate(query):
        if name:
            at_query[:, r] = lacks[:, graph.spans.index(name)]
    return np.broadcast_to(lacks[:, :, None, None] | at_query[:, None, None, :], values.shape)


def _checked_values(name: str, scores: xr.DataArray, graph: Graph | SpanGraph) -> np.ndarray:
    """The values of ``prompt_values`` from scores already on ``graph``'s labels."""
    if "prompt" in scores.indexes:
        _validate.unique_labels(name, scores, "prompt", because="a prompt is drawn by its label")
        scores = scores.isel(prompt=scores.indexes["prompt"].argsort(kind="stable"))
    if scores.sizes["prompt"] < 2:
        raise ValueError(
            f"{name} holds {scores.sizes['prompt']} prompt(s); resampling needs at least 2 "
            "(every resample of one prompt is that prompt)."
        )
    everything = scores.values.astype(np.float64)
    values = everything[:, graph.valid]
    bad = int((~np.isfinite(values) & ~_lacks_span(everything, graph)[:, graph.valid]).sum())
    if bad:
        raise ValueError(
            f"{name} holds {bad} NaN or infinite per-prompt score(s) on edges that exist; a "
            f"NaN cannot be ranked. Recompute the scores ({PER_PROMPT})."
        )
    if np.ptp(np.nan_to_num(np.nanmean(values, 0))) == 0:
        raise ValueError(
            f"Every edge of {name} has the same mean score, so no edge ranks above another "
            "(corrupt prompts equal to the clean ones give all zeros); check the prompts "
            "(lsc.inspect_prompts)."
        )
    return values


def _resample_means(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(block, n_edges) each resample's mean scores: ``weights`` (block, n_prompts) of the
    draw over ``values``' prompts; where some prompts lack an edge's span (NaN), the mean
    over the drawn prompts that have it (NaN when none was drawn), as ``edge_attribution``
    means over the prompts that have it."""
    finite = np.isfinite(values)
    if finite.all():
        means: np.ndarray = weights @ values
        return means
    with np.errstate(invalid="ignore", divide="ignore"):
        return (weights @ np.where(finite, values, 0.0)) / (weights @ finite)


def frequencies(
    graph: Graph | SpanGraph,
    values: np.ndarray,
    counts: Sequence[int],
    n_resamples: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per budget, how often each edge is in a resample's circuit.

    Args:
        graph: the edge graph (by span: the (span, sender, receiver) edges).
        values: (n_prompts, n_edges) per-prompt scores of the real edges (``prompt_values``;
            NaN where a prompt lacks the span: left out of that edge's means).
        counts: the budgets: how many top edges each resample's circuit takes.
        n_resamples: resamples of the prompts (one ``bootstrap.draw`` from ``seed``).
        seed: seeds the draw.

    Returns:
        ``(frequency, sizes)``: (budget, *graph.shape) float64 share of the
        resamples whose circuit keeps each edge (NaN where no edge exists), and (budget,
        n_resamples) each resample's circuit size after pruning.
    """
    n_prompts, n_edges = values.shape
    drawn = bootstrap.draw(n_prompts, n_resamples=n_resamples, seed=seed)
    weights = bootstrap.counts(drawn, n_prompts) / n_prompts
    real = np.flatnonzero(graph.valid)
    totals = np.zeros((len(counts), graph.valid.size))
    sizes = np.zeros((len(counts), n_resamples), dtype=np.int64)
    step = max(1, bootstrap.BLOCK_VALUES // n_edges)
    for start in range(0, n_resamples, step):
        means = _resample_means(weights[start : start + step], values)  # (block, n_edges)
        magnitude = np.nan_to_num(np.abs(means), nan=-1.0)  # an edge none drew: last
        order = np.argsort(-magnitude, axis=1, kind="stable")  # ties: graph order
        rows = np.arange(len(means))[:, None]
        for i, count in enumerate(counts):
            kept = np.zeros((len(means), graph.valid.size), dtype=bool)
            kept[rows, real[order[:, :count]]] = True
            pruned = on_paths(graph, kept.reshape(len(means), *graph.shape))
            flat = pruned.reshape(len(means), -1)
            totals[i] += flat.sum(0)
            sizes[i, start : start + len(means)] = flat.sum(1)
    shares = totals / n_resamples
    shares[:, ~graph.valid.ravel()] = np.nan
    return shares.reshape(len(counts), *graph.shape), sizes


def resampling(n_prompts: int, n_resamples: int, seed: int, count: int) -> str:
    """The sentence that says how a stability result was made (its ``resampling`` attr)."""
    return (
        f"{n_resamples} resamples of the {n_prompts} prompts with replacement (seed {seed}); "
        f"each resample's circuit: the top {count:,} edges by |mean score| pruned to paths "
        "embeddings -> logits (lsc.circuit)"
    )


def circuit_stability(
    scores: xr.DataArray,
    *,
    edges: int | None = None,
    fraction: float | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> xr.DataArray:
    """How often each edge enters the circuit over bootstrap resamples of the prompts.

    Each resample draws the prompts with replacement (one seeded draw over the prompts in
    label order) and picks its circuit as ``lsc.circuit`` would from its mean scores: the
    ``edges`` (or ``fraction``) top edges by |score|, pruned to paths embeddings -> logits.

    Args:
        scores: (prompt, sender, receiver) per-prompt scores from
            ``lsc.edge_attribution(..., per_prompt=True)`` (read by label), 2 prompts or
            more; or (prompt, span, sender, receiver) from ``positions="spans"``: the
            resamples' circuits are by span (``lsc.circuit``'s paths through (component,
            span) nodes), a prompt that lacks a span left out of that span's means.
        edges: how many top edges each resample's circuit takes (1 .. the edge count), or
        fraction: that as a share of all edges, in (0, 1].
        n_resamples: resamples of the prompts, 1 .. ``MAX_RESAMPLES``.
        seed: seeds the draw.

    Returns:
        (sender, receiver) float64 (by span: (span, sender, receiver)), in the order of
        ``scores``: the share of resamples
        whose circuit keeps the edge, in [0, 1] (NaN where no edge exists). Attrs:
        ``method`` "circuit_stability", ``budget``, ``total_edges``, ``n_resamples``,
        ``seed``, ``n_prompts``, ``mean_edges`` (a resample's circuit size, mean over
        resamples), ``resampling`` (a sentence) and the scores' provenance.

    Raises:
        TypeError: scores not a DataArray; a count or seed not an integer.
        ValueError: ``n_resamples`` of 0 or above ``MAX_RESAMPLES``, a negative seed, no
            budget or both, a budget out of range, or scores that are not per-prompt edge
            scores that rank edges (see ``prompt_values``).
    """
    n_resamples, seed = check_options(n_resamples, seed)
    check_kind("scores", scores, methods=SCORE_METHODS, made_by=PER_PROMPT)
    graph = graph_of(scores)
    count = budget(int(graph.valid.sum()), edges, fraction)
    values = prompt_values(scores, graph)
    shares, sizes = frequencies(graph, values, [count], n_resamples, seed)
    kept_attrs = {k: v for k, v in scores.attrs.items() if k not in ("long_name", "units")}
    attrs = {
        **kept_attrs,
        "long_name": "share of resamples whose circuit keeps the edge",
        "units": "share of resamples",
        "method": STABILITY_METHOD,
        "scored_by": str(scores.attrs.get("estimator", "")),
        "budget": count,
        "total_edges": int(graph.valid.sum()),
        "n_resamples": n_resamples,
        "seed": seed,
        "n_prompts": len(values),
        "mean_edges": float(sizes.mean()),
        "resampling": resampling(len(values), n_resamples, seed, count),
    }
    return on_labels_of(scores, shares[0], graph, attrs)


def stability_values(
    stability: Any, graph: Graph | SpanGraph | None = None
) -> tuple[np.ndarray, Graph | SpanGraph]:
    """``graph.shape`` inclusion frequencies of a ``circuit_stability`` result, by label, and
    its graph (by span when the result is).

    Raises:
        TypeError: not a DataArray.
        ValueError: a result of another method, a circuit, labels that are not a model's
            graph, or frequencies outside [0, 1].
    """
    made_by = "lsc.circuit_stability"
    _validate.result("stability", stability, kind=xr.DataArray, made_by=made_by)
    check_kind("stability", stability, methods=(STABILITY_METHOD,), made_by=made_by)
    graph = graph or graph_of(stability)
    shares = aligned("stability", stability, graph, made_by=made_by).values.astype(np.float64)
    outside = np.isfinite(shares) & ((shares < 0) | (shares > 1))
    if outside.any() or np.isinf(shares).any():
        raise ValueError(
            "stability holds values outside [0, 1]; pass the result of lsc.circuit_stability "
            "as it came (shares of resamples)."
        )
    return shares, graph


def consensus_circuit(stability: xr.DataArray, *, share: float = DEFAULT_SHARE) -> xr.DataArray:
    """The consensus circuit: the edges in at least ``share`` of the resamples' circuits,
    pruned to paths embeddings -> logits.

    Args:
        stability: (sender, receiver) from ``lsc.circuit_stability`` (read by label); by
            span, (span, sender, receiver): a circuit by span.
        share: the least share of resamples an edge must be in, in (0, 1] (1: every one).

    Returns:
        Boolean circuit on the dims and labels of ``stability``, in its order,
        like ``lsc.circuit``'s (``edge_patching`` and ``circuit_graph`` take it). Attrs:
        ``method`` "circuit", ``consensus_share``, ``n_edges`` (kept after pruning),
        ``budget`` (each resample's), ``total_edges``, ``tied_at_cut`` (0), and the
        stability's ``n_resamples``, ``seed``, ``resampling`` and provenance.

    Raises:
        TypeError: stability not a DataArray, share not a number.
        ValueError: share outside (0, 1], stability of another kind, or no edge in at
            least ``share`` of the resamples on a path embeddings -> logits.
    """
    share = check_share(share)
    shares, graph = stability_values(stability)
    kept = on_paths(graph, np.nan_to_num(shares) >= share)
    if not kept.any():
        raise ValueError(
            f"No edge on a path from the embeddings to the logits is in at least {share:g} "
            f"of the resamples (the most frequent edge is in {np.nanmax(shares):.0%}), so "
            "the consensus circuit would be empty; give a smaller share."
        )
    attrs = {
        **stability.attrs,
        "long_name": "edge in the consensus circuit",
        "units": "",
        "method": CIRCUIT_METHOD,
        "consensus_share": share,
        "n_edges": int(kept.sum()),
        "total_edges": int(graph.valid.sum()),
        "tied_at_cut": 0,
    }
    attrs.pop("mean_edges", None)
    return on_labels_of(stability, kept, graph, attrs)


@method(None, needs_corrupt=True)
def consensus_faithfulness(
    model: LensModel,
    prompts: Prompts,
    scores: xr.DataArray,
    *,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    share: float = DEFAULT_SHARE,
    n_resamples: int = DEFAULT_RESAMPLES,
    n_random: int = 3,
    seed: int = 0,
    **shared,
) -> xr.Dataset:
    """Faithfulness of the consensus circuits over edge budgets, beside random ones: what
    ``circuit_faithfulness`` reports for the single-draw circuits, for the consensus ones.

    For each budget, the consensus circuit (``consensus_circuit`` of
    ``circuit_stability(scores, fraction=f, n_resamples=, seed=)`` at ``share``; one draw of
    the prompts serves every budget; empty where no edge qualifies: faithfulness m(empty))
    and ``n_random`` random sets of valid edges of its size are run by exact edge patching,
    as in ``lsc.circuit_faithfulness``.

    Args:
        scores: (prompt, sender, receiver) per-prompt scores from
            ``lsc.edge_attribution(..., per_prompt=True)`` on this model (read by label), or
            by span (``positions="spans"``): consensus circuits by span, patched by span.
        fractions: each resample's edge budget as a share of all edges, increasing, in
            (0, 1].
        share: the least share of resamples a consensus edge is in, in (0, 1].
        n_resamples: resamples of the prompts, 1 .. ``MAX_RESAMPLES``.
        n_random: random circuits per budget (0 .. ``patching.MAX_RANDOM``).
        seed: seeds the draw of the prompts and the random circuits.
        store: a ``.zarr`` path: the per-prompt metrics of every circuit stream there and
            an interrupted run resumes.

    Returns:
        The Dataset of ``lsc.circuit_faithfulness`` (``faithfulness`` (budget),
        ``random_faithfulness``, ``cpr``, ``cmd``, ``random_cpr``, ``random_cmd``,
        ``m_full``, ``m_empty``; ``n_edges`` on ``budget``: the consensus circuits' sizes),
        with attrs ``consensus_share``, ``n_resamples``, ``resampling``;
        ``lsc.faithfulness_curve`` draws it.

    Raises:
        TypeError: an option of the wrong type, scores that are not a DataArray.
        ValueError: budgets not increasing in (0, 1], share outside (0, 1], ``n_resamples``
            of 0 or above ``MAX_RESAMPLES``, ``n_random`` out of range, a negative seed,
            scores from another model or not per-prompt edge scores.
    """
    fractions = check_fractions(fractions)
    share = check_share(share)
    n_resamples, seed = check_options(n_resamples, seed)
    n_random = _validate.integer("n_random", n_random, low=0, high=MAX_RANDOM)
    check_kind("scores", scores, methods=SCORE_METHODS, made_by=PER_PROMPT)
    _validate.origin("scores", scores, model.origin, made_by=PER_PROMPT)
    graph = graph_for(model, scores)
    values = prompt_values(scores, graph)
    n_edges = int(graph.valid.sum())
    counts = [budget(n_edges, None, f) for f in fractions]
    shares, _ = frequencies(graph, values, counts, n_resamples, seed)
    kept = [
        tuple(int(i) for i in np.flatnonzero(on_paths(graph, np.nan_to_num(f) >= share)))
        for f in shares
    ]
    sizes = [len(edges) for edges in kept]
    random = _random_circuits(graph, sizes, n_random, seed)
    variants = tuple(("outside", edges) for edges in [*kept, *random])
    report = _edge_variants(model, prompts, variants=variants, **shared, **span_options(graph))
    result = _report(report, scores, fractions, sizes, n_random, seed)
    return result.assign_attrs(
        long_name="consensus circuit faithfulness (m(C) - m(empty)) / (m(full) - m(empty))",
        consensus_share=share,
        n_resamples=n_resamples,
        resampling=resampling(len(values), n_resamples, seed, counts[0]).replace(
            f"the top {counts[0]:,} edges", "the top edges of each budget"
        ),
    )
