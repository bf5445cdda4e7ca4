"""An exact cut: the edges at a circuit's boundary decided by exact edge patching.

A circuit is the top edges by |estimated score| (``lsc.circuit``, ``lsc.consensus_circuit``);
its boundary is where the estimate is least sure to rank edges right, because the edges just
inside and just outside it score alike. ``exact_cut`` measures those edges exactly: the
``edges`` kept edges of smallest |score| and the ``edges`` left-out edges of largest |score|,
each patched alone (the corrupt run with that one receiver reading its sender from the clean
run: the quantity EAP estimates, as ``lsc.edge_agreement`` measures it), and keeps, of those,
as many as were inside, by |exact effect|. The circuit keeps its size (before pruning to
paths again), and the edges it measured carry their exact effect (an ``exact_effect`` coord,
NaN elsewhere), which ``circuit_graph`` shows in its tooltips. A circuit by span
(``positions="spans"``) is cut the same way, each edge patched at its span's positions (a k
or v edge for its query span's queries only).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from ... import _validate
from ...data import Prompts
from ...models import LensModel
from ...sweep.registry import method
from .circuits import SCORE_METHODS, check_kind, on_labels_of, on_paths, scores_values
from .graph import Graph, SpanGraph
from .patching import _edge_variants, kept_edges, span_options

#: Most edges measured on each side of the cut: each is one forward pass per batch.
MAX_CUT = 1000


def _sides(kept: tuple[int, ...], valid: np.ndarray, magnitude: np.ndarray, count: int):
    """(inside, outside): the ``count`` kept edges of smallest |score| and the ``count``
    left-out real edges of largest |score| (flat indices; ties in graph order)."""
    inside_pool = np.asarray(kept, dtype=np.int64)
    inside = inside_pool[np.argsort(magnitude[inside_pool], kind="stable")[:count]]
    out_pool = np.setdiff1d(np.flatnonzero(valid), inside_pool)
    outside = out_pool[np.argsort(-magnitude[out_pool], kind="stable")[:count]]
    return inside, outside


@method(None, needs_corrupt=True)
def exact_cut(
    model: LensModel,
    prompts: Prompts,
    circuit: xr.DataArray,
    scores: xr.DataArray,
    *,
    edges: int = 10,
    **shared,
) -> xr.DataArray:
    """The circuit with its boundary decided by exact single-edge patching.

    The ``edges`` kept edges of smallest |score| (just inside the cut) and the ``edges``
    left-out edges of largest |score| (just outside) are each patched alone on the corrupt
    run (effect = m(corrupt with the edge reading the clean run) - m(corrupt), the prompt
    mean); of these, as many as were inside are kept, by |exact effect| (ties in graph
    order), and the circuit is pruned to paths embeddings -> logits again.

    Args:
        circuit: boolean (sender, receiver) from ``lsc.circuit`` or
            ``lsc.consensus_circuit`` on this model (read by label); or (span, sender,
            receiver), a circuit by span: its edges are patched by span (each at its span's
            positions, a k or v edge for its query span's queries).
        scores: edge scores of this model on the circuit's graph (``lsc.edge_attribution``,
            by span for a circuit by span; read by label): which edges lie at the cut.
        edges: edges measured on each side of the cut, 1 .. ``MAX_CUT``.

    Returns:
        Boolean circuit on the dims and in the order of ``circuit``, with an
        ``exact_effect`` coord on those dims: the measured edges' exact effect, NaN
        elsewhere. Attrs: the circuit's, ``n_edges`` (after pruning), ``cut_measured``
        (edges patched), ``cut_swapped`` (edges inside the cut that left it, as many came
        in), ``cut_rule`` (a sentence).

    Raises:
        TypeError: a circuit or scores that are not DataArrays, ``edges`` not an integer.
        ValueError: ``edges`` out of range, a circuit or scores of another model or kind,
            scores that cannot rank edges, scores by span for a position-agnostic circuit
            (or the reverse), or a circuit of every edge (no outside).
    """
    count = _validate.integer("edges", edges, low=1, high=MAX_CUT)
    graph, kept = kept_edges(model, circuit)
    check_kind("scores", scores, methods=SCORE_METHODS, made_by="lsc.edge_attribution")
    _validate.origin("scores", scores, model.origin, made_by="lsc.edge_attribution")
    magnitude = np.abs(scores_values(scores, graph)).ravel()
    if len(kept) == int(graph.valid.sum()) or not kept:
        raise ValueError(
            f"circuit keeps {len(kept)} of {int(graph.valid.sum())} edges, so it has no cut "
            "to check; pass a circuit of some of the edges (lsc.circuit(scores, edges=50))."
        )
    inside, outside = _sides(kept, graph.valid.ravel(), magnitude, count)
    measured = np.concatenate([inside, outside])
    report = _edge_variants(
        model,
        prompts,
        variants=tuple(("only", (int(edge),)) for edge in measured),
        base="corrupt",
        **shared,
        **span_options(graph),
    )
    effect = (report["patched"] - report["base"]).astype(np.float64).mean("prompt").values
    chosen = measured[np.argsort(-np.abs(effect), kind="stable")[: len(inside)]]
    mask = np.zeros(graph.valid.size, dtype=bool)
    mask[list(kept)] = True
    mask[inside] = False
    mask[chosen] = True
    pruned = on_paths(graph, mask.reshape(graph.shape))
    effects = np.full(graph.valid.size, np.nan)
    effects[measured] = effect
    attrs: dict[str, Any] = {
        **circuit.attrs,
        "n_edges": int(pruned.sum()),
        "cut_measured": len(measured),
        "cut_swapped": len(set(inside.tolist()) - set(chosen.tolist())),
        "cut_rule": f"the {len(inside)} kept edges of smallest |score| and the {len(outside)} "
        "left-out edges of largest |score| patched alone on the corrupt run; as many as were "
        "inside kept by |exact effect|",
    }
    return _labelled(circuit, graph, pruned, effects, attrs)


def _labelled(
    circuit: xr.DataArray,
    graph: Graph | SpanGraph,
    kept: np.ndarray,
    effects: np.ndarray,
    attrs: dict[str, Any],
) -> xr.DataArray:
    """``exact_cut``'s circuit on ``circuit``'s labels and order, with its (flat)
    ``effects`` as the ``exact_effect`` coord."""
    labelled = on_labels_of(circuit, kept, graph, attrs)
    effect = on_labels_of(circuit, effects.reshape(graph.shape), graph, {})
    return labelled.assign_coords(exact_effect=(effect.dims, effect.values))
