"""Exact edge patching: one plan of edge-set variants, three uses.

The plan (``_edge_variants``, an internal method) runs, per prompt, the ``base`` run
("clean" or "corrupt") once per variant with a set of edges reading their sender from the
other run, and keeps the metric of each (after one unedited pass of each input, whose
metrics it keeps too). A variant is ``(mode, edges)``: ``"only"`` patches just ``edges``,
``"outside"`` every real edge but ``edges``; ``edges`` are flat indices into the graph's
(sender, receiver) grid, read from labelled inputs (``kept_edges``), never by position.

- ``edge_patching``: one variant, the edges outside a circuit;
- ``circuit_faithfulness``: the circuits of a score map over edge budgets and random
  circuits of the same sizes: faithfulness f(C) = (m(C) - m(empty)) / (m(full) - m(empty))
  with its area (CPR, higher is better) and the area between it and 1 (CMD, lower is
  better), as in the MIB circuit track;
- ``edge_agreement`` (``agreement``): each sampled edge alone, on the corrupt run.

With ``positions="spans"`` the variants index the edges between (component, span) nodes
(``graph.SpanGraph``): an edge reads the other run at its span's positions only, a k or v
edge for its query span's queries only (``hooks.SpanPatch``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from ... import _validate, schema
from ...data import Prompts
from ...models import LensModel
from ...sweep import memory, metrics
from ...sweep.inputs import Batch, Inputs, batched
from ...sweep.metrics import LONG_NAMES, UNITS
from ...sweep.options import BATCHING, Options
from ...sweep.plan import Call, Plan, Scores, top_is_target
from ...sweep.registry import method, run
from ...sweep.result import prompt_coords, provenance, span_order
from .circuits import CIRCUIT_METHOD, SCORE_METHODS, budget, check_kind, scores_values, top_edges
from .graph import Graph, SpanGraph, aligned, span_graph_of
from .hooks import Pass, SpanPatch, check_supported, metric_of, run_pass, unedited
from .scores import check_positions, check_span_order, span_graph

BASES = ("clean", "corrupt")
#: A variant's edges are the ones patched ("only") or the ones kept ("outside").
MODES = ("only", "outside")
#: Edge budgets (fractions of all edges) of a faithfulness curve.
DEFAULT_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: Most random circuits per budget: each is one more forward pass per batch and budget.
MAX_RANDOM = 100
Variant = tuple[str, tuple[int, ...]]


def graph_for(model: LensModel, result: xr.DataArray) -> Graph | SpanGraph:
    """``model``'s graph, by span (in the spans of ``result``) when ``result`` is."""
    graph = Graph.of(model)
    if "span" not in result.dims:
        return graph
    return span_graph_of(graph, SpanGraph.of_result(result).spans)


def span_options(graph: Graph | SpanGraph) -> dict[str, Any]:
    """The options of ``_edge_variants`` whose variants index ``graph``: by span, the span
    order they were made in (the prompts must have it)."""
    return {"positions": "spans", "spans": graph.spans} if isinstance(graph, SpanGraph) else {}


def kept_edges(model: LensModel, circuit: Any) -> tuple[Graph | SpanGraph, tuple[int, ...]]:
    """The graph of ``circuit`` (by span when it is) and the flat indices of its edges there.

    Raises:
        TypeError: not a DataArray.
        ValueError: not a circuit (scores, or not boolean), from another model, or with
            labels that are not this model's graph.
    """
    check_kind("circuit", circuit, methods=(CIRCUIT_METHOD,), made_by="lsc.circuit")
    _validate.origin("circuit", circuit, model.origin, made_by="lsc.circuit")
    graph = graph_for(model, circuit)
    kept = aligned("circuit", circuit, graph, made_by="lsc.circuit").values & graph.valid
    return graph, tuple(int(i) for i in np.flatnonzero(kept))


def _weights(graph: Graph | SpanGraph, variant: Variant) -> np.ndarray:
    """``graph.shape`` 0/1: which edges of ``variant`` read the other run."""
    mode, edges = variant
    flat = np.zeros(graph.valid.size, dtype=bool)
    flat[list(edges)] = True
    marked = flat.reshape(graph.valid.shape)
    return (graph.valid & ~marked if mode == "outside" else marked).astype(np.float64)


def _patched_metrics(
    inputs: Inputs, batch: Batch, weights: Sequence[np.ndarray], base: str
) -> Scores:
    """Per prompt of ``batch``: the metric of ``base`` with each of ``weights``' edges
    reading the other run, then of ``base`` and of the other run unedited; and whether the
    model answers each clean prompt correctly."""
    assert batch.corrupt is not None
    base_tokens, other_tokens = (
        (batch.clean, batch.corrupt) if base == "clean" else (batch.corrupt, batch.clean)
    )
    graph, by_span = Graph.of(inputs.model), span_graph(inputs)
    other, other_logits = unedited(inputs, other_tokens)
    _, base_logits = unedited(inputs, base_tokens)
    values = []
    read = metrics.read_ids(inputs.metric, batch.target, batch.distractor)
    with torch.no_grad():
        for weight in weights:
            patch = torch.as_tensor(weight, device=other.device)
            if by_span is None:
                state = Pass(graph, other=other, patched=patch)
            else:
                assert batch.cells is not None
                spans = SpanPatch(by_span, patch.to(other.dtype), batch.cells)
                state = Pass(graph, other=other, span_patch=spans)
            logits = run_pass(
                inputs.model, inputs.backend, base_tokens, state, grad=False, vocab=read
            )
            values.append(metric_of(inputs, logits, batch, read))
        values += [metric_of(inputs, base_logits, batch), metric_of(inputs, other_logits, batch)]
    clean_logits = base_logits if base == "clean" else other_logits
    return Scores(torch.stack(values, 1).cpu(), top_is_target(clean_logits, batch.target).cpu())


def plan_edge_variants(call: Call) -> Plan[xr.Dataset]:
    """``_edge_variants`` as a plan: per batch, two unedited passes and one per variant."""
    model, tokens, options = call.model, call.tokens, call.options
    inputs = batched(model, tokens, options, level="head")
    check_span_order(inputs)
    graph: Graph | SpanGraph = span_graph(inputs) or Graph.of(model)
    if options.get("spans") is not None and getattr(graph, "spans", None) != options.spans:
        raise ValueError(
            f"The edges were chosen by span in the order {list(options.spans)}, but these "
            f"prompts' spans are {list(getattr(graph, 'spans', ()))}: a circuit or scores by "
            "span apply to prompts with the same named spans, in the same order. Score "
            "these prompts with edge_attribution(..., positions='spans') and use those."
        )
    weights = [_weights(graph, variant) for variant in options.variants]
    other = "corrupt" if options.base == "clean" else "clean"
    attrs = provenance(inputs, "edge_patching", base=options.base)
    if inputs.positions != "all":
        attrs |= {"positions": inputs.positions, **span_order(inputs)}
    units = {"units": UNITS[options.metric]}

    def score(batch: Batch, step) -> Scores:
        scores = _patched_metrics(inputs, batch, weights, options.base)
        step()
        return scores

    def finish(values, correct, index) -> xr.Dataset:
        values = np.asarray(values, dtype=np.float32)
        coords = prompt_coords(inputs, index, correct)
        return xr.Dataset(
            {
                "patched": (("prompt", "variant"), values[:, :-2], units),
                "base": ("prompt", values[:, -2], units),
                "other": ("prompt", values[:, -1], units),
            },
            coords={**coords, "variant": np.arange(len(weights))},
            attrs={**attrs, "other": other, "n_variants": len(weights)},
        )

    return Plan(inputs, len(weights) + 2, score, finish, desc="edge patching")


def edge_variants_memory(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """Footprint of ``_edge_variants``: the other run's sender outputs, a patched pass's own
    and its (sender, batch, pos, d_model) differences, and one block's q, k and v receivers
    rebuilt from their own inputs (with a projection-wide QK-norm, every q and k receiver's
    whole projection, twice: before and after the norm)."""
    spec, graph = model.spec, Graph.of(model)
    tokens, e = work.rows * work.width, memory.element_bytes(model.dtype)
    senders = tokens * graph.shape[0] * spec.d_model * e
    receivers = 4 * tokens * (graph.per_layer - 1) * spec.d_model * e
    if spec.computation.qk_norm == "projection":
        squares = spec.n_heads**2 + spec.n_kv_heads**2
        receivers += 2 * tokens * squares * spec.d_head * e
    return memory.Need(
        activations=memory.forward_pass(model, work.rows, work.width),
        buffers=3 * senders + receivers,
    )


def _check_edge_variants(model: LensModel, options: Options) -> None:
    """``_edge_variants``' own options (``Method.checks``): the base run, the positions
    and the backend."""
    _validate.choice("base", options.base, BASES)
    check_positions(options)
    check_supported(model, options.backend)


@method(
    plan_edge_variants,
    memory=edge_variants_memory,
    needs_corrupt=True,
    public=False,
    checks=_check_edge_variants,
    shared=(*BATCHING, "positions"),
)
def _edge_variants(
    model: LensModel,
    prompts: Prompts,
    *,
    variants: tuple[Variant, ...],
    base: str = "clean",
    spans: tuple[str, ...] | None = None,
    **shared,
) -> xr.Dataset:
    """Per prompt, the metric of ``base`` with each variant's edges patched (module
    docstring); with ``positions="spans"``, edges between (component, span) nodes
    (``graph.SpanGraph``; a variant's edges index its (span, sender, receiver) grid, made
    in the span order ``spans``, which the prompts must have: refused otherwise).

    Returns:
        Dataset: ``patched`` (prompt, variant), ``base`` and ``other`` (prompt,) metrics.
    """
    return run(_edge_variants, locals())


@method(None, needs_corrupt=True)
def edge_patching(
    model: LensModel,
    prompts: Prompts,
    circuit: xr.DataArray,
    *,
    base: str = "clean",
    **shared,
) -> xr.DataArray:
    """Exact edge patching: the metric with every edge outside ``circuit`` patched.

    ``base="clean"``: the clean run, each edge outside the circuit reading its sender from
    the corrupt run (the circuit alone carries the clean answer). ``base="corrupt"``: the
    reverse. One forward pass per batch (after one unedited pass of each input): every
    receiver's input is rebuilt from the residual stream minus the patched senders'
    differences (``lenscape.capture.edges.hooks``).

    Args:
        circuit: boolean (sender, receiver) from ``lsc.circuit`` on this model (read by
            label: its order does not matter).
        base: "clean" or "corrupt".

    Returns:
        DataArray (prompt,) of the patched metric (``correct`` on ``prompt``); attrs
        ``n_edges`` and ``base``.

    Raises:
        TypeError: a circuit that is not a DataArray.
        ValueError: a circuit from another model, scores instead of a circuit, an unknown
            ``base``.
    """
    graph, kept = kept_edges(model, circuit)
    result = _edge_variants(
        model, prompts, variants=(("outside", kept),), base=base, **shared, **span_options(graph)
    )
    patched = result["patched"].isel(variant=0, drop=True).load().astype(np.float64)
    return schema.make(
        patched.values,
        dims=("prompt",),
        coords={name: patched[name].values for name in ("prompt", "text", "category")}
        | {"correct": ("prompt", patched["correct"].values)},
        attrs={
            **result.attrs,
            "long_name": f"{LONG_NAMES[result.attrs['metric']]} with the edges outside the "
            "circuit patched",
            "units": UNITS[result.attrs["metric"]],
            "n_edges": len(kept),
        },
    )


# ------------------------------------------------------------------------- faithfulness


def _area(fractions: np.ndarray, curve: np.ndarray) -> float:
    """Trapezoid area under ``curve`` over ``fractions``, divided by their span."""
    span = fractions[-1] - fractions[0]
    if span == 0:
        return float(curve[0])
    widths = np.diff(fractions)
    return float((widths * (curve[1:] + curve[:-1]) / 2).sum() / span)


def check_fractions(fractions: Any) -> list[float]:
    """Edge budgets as a list of increasing shares in (0, 1].

    Raises:
        TypeError: not a list (or array) of numbers. ValueError: out of (0, 1], repeated or
            not increasing, or none.
    """
    fix = f"e.g. {list(DEFAULT_FRACTIONS)}"
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, (Sequence, np.ndarray)):
        raise TypeError(
            f"fractions must be a list of shares in (0, 1], got {fractions!r} "
            f"({type(fractions).__name__}); {fix}."
        )
    shares = [
        _validate.number(f"fractions[{i}]", f, low=0.0, high=1.0) for i, f in enumerate(fractions)
    ]
    if not shares or min(shares) <= 0 or shares != sorted(set(shares)):
        raise ValueError(f"fractions must be increasing shares in (0, 1], got {shares}; {fix}.")
    return shares


def _random_circuits(
    graph: Graph | SpanGraph, sizes: list[int], n_random: int, seed: int
) -> list[tuple[int, ...]]:
    """``n_random`` random circuits of each size in ``sizes`` (valid edges drawn from
    ``seed``, draw by draw), as flat edge indices."""
    rng = np.random.default_rng(seed)
    valid_edges = np.flatnonzero(graph.valid)
    return [
        tuple(int(i) for i in np.sort(rng.choice(valid_edges, size=size, replace=False)))
        for _ in range(n_random)
        for size in sizes
    ]


def _curves(
    report: xr.Dataset, fractions: list[float], n_random: int
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Faithfulness of every variant from the prompt means of ``report``: (budget,) of the
    scored circuits, (seed, budget) of the random ones, m(full) and m(empty). NaN, with a
    warning, where m(full) = m(empty)."""
    m_patched = report["patched"].astype(np.float64).mean("prompt").values
    m_full = float(report["base"].astype(np.float64).mean())
    m_empty = float(report["other"].astype(np.float64).mean())
    if m_full == m_empty:
        warnings.warn(
            f"The clean and corrupt runs give the same mean metric ({m_full:g}), so "
            "faithfulness (m(C) - m(empty)) / (m(full) - m(empty)) is undefined: NaN. "
            "Corrupt prompts must change the answer (check them with lsc.inspect_prompts).",
            UserWarning,
            stacklevel=3,
        )
        curves = np.full(len(m_patched), np.nan)
    else:
        curves = (m_patched - m_empty) / (m_full - m_empty)
    count = len(fractions)
    return curves[:count], curves[count:].reshape(n_random, count), m_full, m_empty


@method(None, needs_corrupt=True)
def circuit_faithfulness(
    model: LensModel,
    prompts: Prompts,
    scores: xr.DataArray,
    *,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    n_random: int = 3,
    seed: int = 0,
    **shared,
) -> xr.Dataset:
    """Faithfulness of the circuits of ``scores`` over edge budgets, beside random ones.

    For each budget, the circuit ``lsc.circuit(scores, fraction=f)`` would pick (empty where
    its top edges lie on no path: faithfulness m(empty)) is run by exact edge patching (the
    clean run, edges outside the circuit reading the corrupt run) and so are ``n_random``
    random sets of valid edges of the same size (after pruning). Faithfulness
    f(C) = (m(C) - m(empty)) / (m(full) - m(empty)) with m the prompt-mean metric, m(full)
    the clean run and m(empty) the corrupt run (every edge patched).

    Args:
        scores: (sender, receiver) from ``edge_attribution`` on this model (read by label).
        fractions: edge budgets as shares of all edges, increasing, in (0, 1].
        n_random: random circuits per budget (0 .. ``MAX_RANDOM``).
        seed: seeds the random circuits.
        store: a ``.zarr`` path: the per-prompt metrics of every circuit stream there and
            an interrupted run resumes (the curves are computed from it).

    Returns:
        Dataset over ``budget`` (the fractions; coords ``n_edges``, kept after pruning):
        ``faithfulness`` (budget), ``random_faithfulness`` (seed, budget), and scalars
        ``cpr`` / ``random_cpr`` (area under the curve over the budget span, divided by
        the span: higher is better) and ``cmd`` / ``random_cmd`` (area of |1 - f|, the same
        way: lower is better), ``m_full`` and ``m_empty``. NaN, with a warning and the
        reason in attrs ``undefined``, where the clean and corrupt runs agree.

    Raises:
        TypeError: fractions that are not a list of numbers, scores that are not a
            DataArray, a seed that is not an integer.
        ValueError: budgets not increasing in (0, 1], scores from another model or of
            another kind (a circuit), a negative seed or ``n_random`` out of range.
    """
    fractions = check_fractions(fractions)
    n_random = _validate.integer("n_random", n_random, low=0, high=MAX_RANDOM)
    seed = _validate.seed("seed", seed)
    check_kind("scores", scores, methods=SCORE_METHODS, made_by="lsc.edge_attribution")
    _validate.origin("scores", scores, model.origin, made_by="lsc.edge_attribution")
    graph = graph_for(model, scores)
    values, n_edges = scores_values(scores, graph), int(graph.valid.sum())
    kept = [
        tuple(int(i) for i in np.flatnonzero(top_edges(graph, values, budget(n_edges, None, f))[0]))
        for f in fractions
    ]
    random = _random_circuits(graph, [len(edges) for edges in kept], n_random, seed)
    variants = [("outside", edges) for edges in [*kept, *random]]
    report = _edge_variants(
        model, prompts, variants=tuple(variants), **shared, **span_options(graph)
    )
    return _report(report, scores, fractions, [len(edges) for edges in kept], n_random, seed)


def _report(
    report: xr.Dataset,
    scores: xr.DataArray,
    fractions: list[float],
    sizes: list[int],
    n_random: int,
    seed: int,
) -> xr.Dataset:
    """``circuit_faithfulness``'s Dataset from the per-prompt metrics of its variants."""
    curve, random, m_full, m_empty = _curves(report, fractions, n_random)
    x = np.asarray(fractions)
    attrs = {
        **report.attrs,
        "long_name": "circuit faithfulness (m(C) - m(empty)) / (m(full) - m(empty))",
        "units": "",
        "method": "circuit_faithfulness",
        "scored_by": str(scores.attrs.get("estimator", "")),
        "n_random": n_random,
        "seed": seed,
    }
    if np.isnan(curve).all():
        attrs["undefined"] = "the clean and corrupt runs give the same mean metric"
    return xr.Dataset(
        {
            "faithfulness": (("budget",), curve),
            "random_faithfulness": (("seed", "budget"), random),
            "cpr": _area(x, curve),
            "cmd": _area(x, np.abs(1 - curve)),
            "random_cpr": float(np.mean([_area(x, row) for row in random]))
            if n_random
            else float("nan"),
            "random_cmd": float(np.mean([_area(x, np.abs(1 - row)) for row in random]))
            if n_random
            else float("nan"),
            "m_full": m_full,
            "m_empty": m_empty,
        },
        coords={"budget": x, "n_edges": ("budget", np.asarray(sizes)), "seed": np.arange(n_random)},
        attrs=attrs,
    )
