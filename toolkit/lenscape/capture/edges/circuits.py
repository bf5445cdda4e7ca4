"""Circuits: the edges with the largest |score|, pruned to paths from the embeddings to the
logits. Pure numpy over a labelled result: no model, no pass.

Scores are read by label (``graph.aligned``), so a ``sortby``, ``isel`` or ``transpose`` of
them never changes the circuit; the circuit comes back in the order of the scores given.
Scores that cannot rank edges (all equal, as corrupt == clean gives; NaN on a real edge) are
refused with the cause; ties at the budget's cut are said (a warning and the ``tied_at_cut``
attr), never settled silently.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import xarray as xr

from ... import _validate
from .graph import Graph, SpanGraph, aligned

#: The ``method`` attr of results that rank edges (``edge_attribution``'s).
SCORE_METHODS = ("edge_attribution",)
CIRCUIT_METHOD = "circuit"


def check_kind(name: str, result: Any, *, methods: tuple[str, ...], made_by: str) -> None:
    """Refuse an edge result of the wrong kind: scores where a circuit is expected, or the
    other way round, naming what it is. A circuit is boolean, scores are numbers; a result
    whose ``method`` attr names what made it must come from one of ``methods`` (a
    DataArray made by hand, without the attr, is judged by its dtype alone).

    Raises:
        TypeError: not a DataArray. ValueError: another kind of result.
    """
    _validate.result(name, result, kind=xr.DataArray, made_by=made_by)
    made = result.attrs.get("method")
    wants_mask = methods == (CIRCUIT_METHOD,)
    if (result.dtype == bool) != wants_mask or (made is not None and made not in methods):
        found = (
            f"a result of {made!r}"
            if made is not None and made not in methods
            else "a boolean array (a circuit, from lsc.circuit)"
            if result.dtype == bool
            else f"{result.dtype} numbers (scores, from lsc.edge_attribution)"
        )
        raise ValueError(f"{name} must be the result of {made_by}; got {found}.")


def scores_values(scores: Any, graph: Graph | SpanGraph, *, name: str = "scores") -> np.ndarray:
    """``graph.shape`` float64 values of edge ``scores`` (of the right kind:
    ``check_kind``) on ``graph``, by label, checked to rank edges.

    Raises:
        ValueError: per-prompt scores, labels that are not ``graph``'s, NaN or infinite
            scores on real edges, or every real edge scored alike.
    """
    values = aligned(name, scores, graph, made_by="lsc.edge_attribution").values.astype(float)
    real = values[graph.valid]
    bad = ~np.isfinite(real)
    if bad.any():
        raise ValueError(
            f"{name} holds {int(bad.sum())} NaN or infinite score(s) on edges that exist; a "
            "NaN cannot be ranked and would silently drop a real edge. Recompute the scores "
            "(lsc.edge_attribution), or set those edges to 0 deliberately."
        )
    if np.ptp(real) == 0:
        raise ValueError(
            f"Every edge of {name} has the same score ({real[0]:g}), so no edge ranks above "
            "another (corrupt prompts equal to the clean ones give all zeros). Check the "
            "prompts' corrupt texts (lsc.inspect_prompts), then score again."
        )
    return values


def on_span_paths(graph: SpanGraph, kept: np.ndarray) -> np.ndarray:
    """``kept`` (..., n_spans, n_senders, n_receivers) bool pruned to edges on a path from
    the embeddings (at any span) to the logits, through (component, span) nodes: an edge at
    span c runs from its sender at c to its receiver's component at ``graph.target_span``
    (a k or v receiver's query span, else c). Components only grow along an edge, so one
    pass forward and one back settle every span at once."""
    n_spans, n_senders, _ = graph.shape
    feeds, target = graph.feeds, graph.target_span  # (n_r, n_s + 1), (n_spans, n_r)
    batch = kept.shape[:-3]
    reached = np.zeros((*batch, n_spans, n_senders + 1), dtype=bool)
    reached[..., 0] = True
    spans = np.arange(n_spans)
    for component in range(1, n_senders + 1):  # senders in forward order, then the logits
        into = kept[..., :, :, feeds[:, component]] & reached[..., :, :n_senders, None]
        arriving = into.any(-2)  # (..., span c, receivers into the component)
        hits = target[:, feeds[:, component]]  # the span each arrival reaches
        for t in spans:
            reached[..., t, component] = (arriving & (hits == t)).any(axis=(-2, -1))
    # live[t, k]: node (k, t) reaches the logits; a receiver at span c is live when the node
    # its edge reaches is
    live = np.zeros_like(reached)
    live[..., -1] = True
    receiver_live = np.zeros((*batch, n_spans, len(feeds)), dtype=bool)

    def settle(component: int) -> None:
        fed = feeds[:, component]
        receiver_live[..., fed] |= live[..., component][..., target[:, fed]]

    settle(n_senders)
    for component in range(n_senders - 1, -1, -1):  # downstream receivers are settled
        live[..., component] = (kept[..., :, component, :] & receiver_live).any(-1)
        if component:
            settle(component)
    pruned: np.ndarray = kept & reached[..., :n_senders, None] & receiver_live[..., :, None, :]
    return pruned


def on_paths(graph: Graph | SpanGraph, kept: np.ndarray) -> np.ndarray:
    """``kept`` (..., n_senders, n_receivers) bool pruned to edges on a path from the
    embeddings to the logits: the sender is reached from the embeddings and the receiver
    feeds a component that reaches the logits, through kept edges. Leading dims are
    independent circuits (the resamples of ``circuit_stability``), pruned together: the
    loops run over the graph's components, never over the circuits. Edges by span:
    ``on_span_paths``."""
    if isinstance(graph, SpanGraph):
        return on_span_paths(graph, kept)
    n_senders = len(graph.senders)
    feeds = graph.feeds
    batch = kept.shape[:-2]
    reached = np.zeros((*batch, n_senders + 1), dtype=bool)
    reached[..., 0] = True
    for component in range(1, n_senders + 1):  # senders in forward order, then the logits
        into = kept[..., :, feeds[:, component]] & reached[..., :n_senders, None]
        reached[..., component] = into.any(axis=(-2, -1))
    receiver_live = np.broadcast_to(feeds[:, -1], (*batch, feeds.shape[0])).copy()
    for component in range(n_senders - 1, -1, -1):  # downstream receivers are settled
        live = (kept[..., component, :] & receiver_live).any(-1)
        receiver_live |= live[..., None] & feeds[:, component]
    pruned: np.ndarray = kept & reached[..., :n_senders, None] & receiver_live[..., None, :]
    return pruned


def budget(n_edges: int, edges: int | None, fraction: float | None) -> int:
    """How many top edges a circuit takes, from ``edges`` (a count) or ``fraction``.

    Raises:
        ValueError: neither or both given, or out of range.
    """
    if (edges is None) == (fraction is None):
        raise ValueError(
            "Give exactly one edge budget: edges=N (a count) or fraction=f (a share of all "
            f"{n_edges} edges), e.g. circuit(scores, fraction=0.05)."
        )
    if edges is not None:
        return _validate.integer("edges", edges, low=1, high=n_edges)
    share = _validate.number("fraction", fraction, low=0.0, high=1.0)
    if share == 0:
        raise ValueError(f"fraction=0 keeps no edge; give a share in (0, 1] of {n_edges} edges.")
    return max(1, round(share * n_edges))


def top_edges(graph: Graph | SpanGraph, values: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """The ``count`` real edges of largest |value| (ties broken in graph order), pruned to
    paths, and how many edges tie with the last one taken but were left out."""
    magnitude = np.where(graph.valid, np.abs(values), -np.inf).ravel()
    order = np.argsort(-magnitude, kind="stable")
    kept = np.zeros(values.size, dtype=bool)
    kept[order[:count]] = True
    cut = magnitude[order[count - 1]]
    tied_out = int((magnitude[order[count:]] == cut).sum())
    return on_paths(graph, kept.reshape(values.shape)), tied_out


def circuit(
    scores: xr.DataArray, *, edges: int | None = None, fraction: float | None = None
) -> xr.DataArray:
    """The edges with the largest |score|, pruned to those on a path embeddings -> logits.

    Args:
        scores: (sender, receiver) scores from ``edge_attribution`` (in any order: they are
            read by label), or (span, sender, receiver) from ``positions="spans"``: a
            circuit of (component, span) nodes, pruned to paths through them (a key or value
            edge reaches its head at its query span).
        edges: how many top edges to take (1 .. the number of edges), or
        fraction: that as a share of all edges, in (0, 1].

    Returns:
        Boolean DataArray on the labels of ``scores``, in their order (True: in the
        circuit); attrs add ``n_edges`` (kept after pruning), ``budget`` (taken before),
        ``total_edges`` and ``tied_at_cut`` (edges whose |score| equals the last one taken
        but that were left out: the circuit then depends on the graph's order, and a
        ``UserWarning`` says so).

    Raises:
        TypeError: scores that are not a DataArray.
        ValueError: no budget or both, a budget of 0 or above the edge count, scores with
            a ``prompt`` dim, of another kind (a circuit), with NaN on real edges or all
            alike, or whose top edges lie on no path from the embeddings to the logits.
    """
    check_kind("scores", scores, methods=SCORE_METHODS, made_by="lsc.edge_attribution")
    graph = graph_of(scores)
    values = scores_values(scores, graph)
    count = budget(int(graph.valid.sum()), edges, fraction)
    kept, tied_out = top_edges(graph, values, count)
    if not kept.any():
        raise ValueError(
            f"None of the top {count} edges lies on a path from the embeddings to the "
            "logits, so the circuit would be empty; give a larger budget."
        )
    if tied_out:
        warnings.warn(
            f"{tied_out} edge(s) tie in |score| with the last of the top {count} and were "
            "left out by graph order; the circuit at this budget is not determined by the "
            "scores alone (attrs 'tied_at_cut').",
            UserWarning,
            stacklevel=2,
        )
    attrs = {
        **scores.attrs,
        "long_name": "edge in the circuit",
        "units": "",
        "method": CIRCUIT_METHOD,
        "scored_by": str(scores.attrs.get("estimator", "")),
        "budget": count,
        "n_edges": int(kept.sum()),
        "total_edges": int(graph.valid.sum()),
        "tied_at_cut": tied_out,
    }
    return on_labels_of(scores, kept, graph, attrs)


def on_labels_of(
    result: xr.DataArray, values: np.ndarray, graph: Graph | SpanGraph, attrs: dict[str, Any]
) -> xr.DataArray:
    """``values`` (``graph.shape``, canonical order) labelled, then put on the labels and
    in the order of ``result`` (whose other dims, such as ``prompt``, it does not have)."""
    labelled = xr.DataArray(values, dims=graph.dims, coords=graph.coords(), attrs=attrs)
    ordered = labelled.sel({dim: result[dim].values for dim in graph.dims})
    return ordered.transpose(*(dim for dim in result.dims if dim in graph.dims))


def graph_of(result: xr.DataArray) -> Graph | SpanGraph:
    """The graph an edge result was measured on: by span when it has a ``span`` dim."""
    return SpanGraph.of_result(result) if "span" in result.dims else Graph.of_result(result)
