"""Edge scores: EAP and EAP-IG for every edge, as a plan over prompt batches.

Scores (denoising sign, as ``lsc.attribution_patching`` and TransformerLens 4.3's
``attribution_patch``): EAP (Syed et al. 2023)
``score(s -> r) = sum_pos (clean_s - corrupt_s) . d metric / d(input of r)`` at the corrupt
run; positive: the edge carries the clean answer. EAP-IG (Hanna et al. 2024, arXiv
2403.17806) averages the gradient over ``steps`` points ``a_k = k / steps`` of the straight
path from the corrupt to the clean embeddings (left Riemann sum); ``steps=1`` is EAP.

Error estimates (``edge_attribution(..., error=True)``), per edge and prompt, as
``lsc.attribution_patching``'s (``capture/patching.py``: the same coord ``error``, attrs
and ``ERROR_METHODS``), from the same quadrature's next term, never from exact patching:

- "eap" (and "eap-ig" with 1 step): the trapezoid rule's correction,
  ``|1/2 sum_pos (clean_s - corrupt_s) . (g_r(clean) - g_r(corrupt))|``, g_r the
  metric's gradient at receiver r's input in the clean and in the corrupt run: one backward
  pass more (the clean pass keeps its graph);
- "eap-ig" with n >= 2 steps: ``|EAP-IG_n - the left rule on the even points a_0, a_2, ...|``
  (each even point weighted by the width it covers): free;
- "relp": the trapezoid correction with both receivers' gradients under the rules (one
  backward pass more); for rules that linearise towards the clean run ("secant"),
  ``|secant - eap|`` (one forward and one backward pass more).

The clean run's gradient stands in for the gradient at the end of the one-edge path (the
corrupt run with one receiver reading one sender's clean output): a first-order guess, not
a bound; ``benchmarks/error_estimates.py --edges`` measures how well it ranks the actual
error against exact single-edge patching.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import xarray as xr

from ... import _validate, schema
from ...data import Prompts
from ...models import LensModel
from ...models.parts import projections
from ...sweep import memory, metrics
from ...sweep.backend import TokenBatch
from ...sweep.inputs import Batch, Inputs, batched
from ...sweep.memory import Need, Work
from ...sweep.metrics import LONG_NAMES, UNITS
from ...sweep.options import BATCHING, Options, integration_points
from ...sweep.plan import Call, Plan, Scores, top_is_target
from ...sweep.registry import method, run
from ...sweep.relevance import RULE_SETS, clean_pass, rules_or_plain
from ...sweep.result import position_coords, prompt_coords, provenance, span_order
from ..patching import check_relevance, check_rules, error_method, with_error
from .by_span import SpanCells, gradients_by_query_span, span_step_scores
from .graph import Graph, SpanGraph, span_graph_of
from .hooks import (
    Pass,
    check_supported,
    metric_of,
    receiver_chunk,
    receiver_gradients,
    run_pass,
)

ESTIMATORS = ("eap", "eap-ig", "relp")
#: The estimators that integrate along the corrupt -> clean embedding path.
PATH_ESTIMATORS = ("eap-ig",)
#: Integration points of ``estimator="eap-ig"`` when ``steps`` is not given.
DEFAULT_IG_STEPS = 5
#: Why an edge score's error estimate is NaN where it is (``with_error``'s ``undefined``).
NO_EDGE = "NaN where no edge exists (the receiver is upstream of the sender), as the scores"


def _zero_leaves(model: LensModel, rows: int, width: int) -> dict[tuple[str, int], torch.Tensor]:
    """Zero leaves (``hooks.Pass.deltas``) whose gradients give every receiver's: at each
    block's q/k/v receiver values (each projection's output, or its projection-wide
    QK-norm's: ``models.parts.projections``), at the inputs of its MLP's norm and of the
    final norm; (batch, pos, size) in the model's dtype."""
    spec = model.spec
    sizes = {projection.kind: projection.count * spec.d_head for projection in projections(spec)}
    sizes["mlp"] = spec.d_model
    keys = [(kind, layer) for layer in range(spec.n_layers) for kind in sizes]
    return {
        key: torch.zeros(
            (rows, width, sizes.get(key[0], spec.d_model)),
            dtype=model.dtype,
            device=model.device,
            requires_grad=True,
        )
        for key in [*keys, ("logits", -1)]
    }


def _receiver_gradients(
    model: LensModel, state: Pass, grads: dict
) -> Iterator[tuple[int, torch.Tensor]]:
    """Every receiver's input gradient of the pass ``state`` in receiver order, a chunk at a
    time: (first receiver, (n, batch, pos, d_model) gradients of receivers first..first+n)."""
    graph = state.graph
    for layer in range(graph.n_layers):
        first = graph.attn_receivers(layer).start
        for columns, gradient in receiver_gradients(model, state, grads, layer):
            yield first + columns.start, gradient
        yield graph.mlp_receiver(layer), grads["mlp", layer][None]
    yield graph.shape[1] - 1, grads["logits", -1][None]


def contraction_dtype(model: LensModel) -> torch.dtype:
    """The dtype edge scores are contracted in: bfloat16 for a bfloat16 model (its
    products accumulate in float32 inside the matrix kernels; inputs and each score are
    rounded to bfloat16, a smaller error than the model's own bfloat16 gradients carry, and
    twice as fast on a CPU with bfloat16 dot products: 178 against 81 GFLOP/s on a
    Llama-3-8B chunk, one thread), float32 otherwise (a float16 model too: its range is too
    narrow for the products)."""
    return torch.bfloat16 if model.dtype == torch.bfloat16 else torch.float32


def span_graph(inputs: Inputs) -> SpanGraph | None:
    """The edges by span of ``inputs`` (``positions="spans"``), or None."""
    if inputs.positions != "spans":
        return None
    assert inputs.tokens.span_names is not None  # ``inputs.batched`` checked the spans
    return span_graph_of(Graph.of(inputs.model), inputs.tokens.span_names)


def _span_cells(inputs: Inputs, batch: Batch) -> SpanCells | None:
    """``batch``'s tokens by span, for edges by span; else None."""
    graph = span_graph(inputs)
    if graph is None:
        return None
    assert batch.cells is not None
    return SpanCells.of(graph, batch.cells)


def _step_scores(
    model: LensModel,
    state: Pass,
    grads: dict,
    differences: torch.Tensor,
    spans: SpanCells | None = None,
) -> torch.Tensor:
    """(batch, n_senders, n_receivers) float32 scores of one gradient pass ``state`` (its
    leaves' gradients ``grads``): sum over positions of the senders' clean - corrupt
    ``differences`` (batch, n_senders, pos, d_model; 0 at padding, in
    ``contraction_dtype``) times each receiver's input gradient; 0 off the graph.

    Receivers are taken in chunks of at most ``hooks.CHUNK_BYTES`` of gradients (never all
    of them at once), and each chunk is one matrix product per prompt with the senders
    upstream of its last receiver (per prompt and chunk-major: the fastest layout on a CPU,
    for bfloat16 twice as fast as one batched product). With ``spans``, the scores by
    span (``by_span.span_step_scores``), (batch, n_spans, n_senders, n_receivers).
    """
    if spans is not None:
        return span_step_scores(model, state, grads, differences, spans)
    graph = state.graph
    rows, _, width, d_model = differences.shape
    scores = differences.new_zeros((rows, *graph.shape), dtype=torch.float32)
    capacity = receiver_chunk(rows * width * d_model * differences.element_size())
    chunk = differences.new_empty((rows, min(capacity, graph.shape[1]), width * d_model))
    senders = differences.flatten(2)  # (batch, n_senders, pos * d_model)
    filled, start = 0, 0

    def contract() -> None:
        upstream = int(graph.upstream[start + filled - 1])
        for row in range(rows):
            block = torch.mm(chunk[row, :filled], senders[row, :upstream].T)
            scores[row, :upstream, start : start + filled] = block.T

    for first, gradient in _receiver_gradients(model, state, grads):
        n = gradient.shape[0]
        if filled + n > chunk.shape[1]:
            contract()
            filled, start = 0, first
        chunk[:, filled : filled + n] = gradient.transpose(0, 1).flatten(2)  # (batch, n, p*d)
        filled += n
    contract()
    return scores * torch.from_numpy(graph.valid).to(scores.device)


def _batch_scores(
    inputs: Inputs, batch: Batch, steps: int, rules: str | None, error: bool = False
) -> Scores:
    """Edge scores of one batch, (batch, n_senders * n_receivers) float32 (0 off the graph),
    and whether the model answers each clean prompt correctly; the gradients at ``steps``
    points of the embedding path, or at the corrupt run under relevance ``rules``. With
    ``error``, (batch, n_senders * n_receivers) more: each score's error estimate (module
    docstring).

    One buffer of (batch, n_senders, pos, d_model) in ``contraction_dtype`` holds the clean
    sender outputs minus the corrupt ones (written by the passes themselves: each element
    is rounded once, to the buffer's dtype); each gradient pass is then contracted with it
    receiver chunk by receiver chunk (``_step_scores``).
    """
    assert batch.corrupt is not None
    model, graph = inputs.model, Graph.of(inputs.model)
    rows, width = batch.clean.input_ids.shape
    spans = _span_cells(inputs, batch)
    differences = torch.zeros(
        (rows, graph.shape[0], width, model.spec.d_model),
        dtype=contraction_dtype(model),
        device=model.device,
    )
    secant = rules is not None and RULE_SETS[rules].needs_reference
    # The trapezoid's other end: the receivers' gradients at the clean run (under the rules).
    two_ends = error and steps == 1 and not secant
    terms: torch.Tensor | None = None
    with rules_or_plain(model, rules, backend=inputs.backend) as relevance:
        if two_ends:
            clean = Pass(
                graph,
                deltas=_zero_leaves(model, rows, width),
                keep_senders=False,
                into=differences,
                keep_resids=True,
            )
            clean_logits, clean_grads = _gradient_pass(
                inputs, batch, batch.clean, clean, whole_vocab=True, spans=spans
            )
        else:
            with torch.no_grad(), clean_pass(relevance):
                clean = Pass(graph, keep_senders=False, into=differences)
                clean_logits = run_pass(model, inputs.backend, batch.clean, clean, grad=False)
        scores, coarse = _path_scores(inputs, batch, steps, differences, coarse=error, spans=spans)
        scores = scores / steps
        if two_ends:  # 1/2 (g_clean - g_corrupt) . delta, contracted like the scores
            clean_scores = _step_scores(model, clean, clean_grads, differences, spans)
            terms = 0.5 * (clean_scores - scores)
        elif error and steps > 1:
            assert coarse is not None
            terms = scores - coarse
    if error and secant:  # the disagreement with EAP: plain gradients at the corrupt run
        plain, _ = _path_scores(inputs, batch, 1, differences, fill=False, spans=spans)
        terms = plain - scores
    correct = top_is_target(clean_logits.detach(), batch.target).cpu()
    values = scores.flatten(1)
    if terms is not None:
        values = torch.cat([values, terms.abs().flatten(1)], dim=1)
    return Scores(values.cpu(), correct)


def _gradient_pass(
    inputs: Inputs,
    batch: Batch,
    tokens: TokenBatch,
    state: Pass,
    *,
    whole_vocab: bool = False,
    spans: SpanCells | None = None,
) -> tuple[torch.Tensor, dict]:
    """One pass over ``tokens`` with ``state``'s hooks and the metric's gradients at its
    leaves (``state.deltas``): (logits, key -> gradient). The logits are those the metric
    reads (``metrics.read_ids``), every token's with ``whole_vocab``. With ``spans``, also
    each key/value leaf's gradient through each query span
    (``by_span.gradients_by_query_span``)."""
    read = None if whole_vocab else metrics.read_ids(inputs.metric, batch.target, batch.distractor)
    state.keep_heads_input = spans is not None
    logits = run_pass(inputs.model, inputs.backend, tokens, state, grad=True, vocab=read)
    metric = metric_of(inputs, logits, batch, read).sum()
    if spans is not None:
        return logits, gradients_by_query_span(metric, state, spans.mask)
    leaves = list(state.deltas.values())
    return logits, dict(zip(state.deltas, torch.autograd.grad(metric, leaves), strict=True))


def _path_scores(
    inputs: Inputs,
    batch: Batch,
    steps: int,
    differences: torch.Tensor,
    *,
    fill: bool = True,
    coarse: bool = False,
    spans: SpanCells | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(batch, n_senders, n_receivers) scores summed over ``steps`` gradient passes along the
    corrupt -> clean embedding path; ``differences`` holds the clean sender outputs and,
    with ``fill``, gets the corrupt ones taken away by the first pass (the corrupt run;
    without, it is complete already). With ``spans``, the scores by span
    (``_step_scores``). With ``coarse`` and ``steps > 1``, also the left rule
    on the even points a_0, a_2, ... (each weighted by the width it covers, so a mean, not a
    sum); else None."""
    assert batch.corrupt is not None
    model, graph = inputs.model, Graph.of(inputs.model)
    rows, width = batch.clean.input_ids.shape
    # Without ``fill``, differences[:, 0] is clean - corrupt already: no path to follow.
    clean_embed = differences[:, 0].to(model.dtype, copy=True) if fill else None
    mask = batch.corrupt.attention_mask[:, None, :, None].to(differences.dtype)
    scores: torch.Tensor | None = None
    coarse_sum: torch.Tensor | None = None
    for k in range(steps):

        def interpolate(out: torch.Tensor, alpha: float = k / steps) -> torch.Tensor:
            assert clean_embed is not None  # steps > 1 comes with fill
            return out + alpha * (clean_embed - out)

        state = Pass(
            graph,
            deltas=_zero_leaves(model, rows, width),
            embed_path=None if k == 0 else interpolate,
            keep_senders=False,
            into=differences if k == 0 and fill else None,  # the first pass: the corrupt run
            sign=-1.0,
            keep_resids=True,
        )
        _, grads = _gradient_pass(inputs, batch, batch.corrupt, state, spans=spans)
        if k == 0 and fill:  # the differences are complete: no position of padding counts
            differences.mul_(mask)
        step = _step_scores(model, state, grads, differences, spans)
        scores = step if scores is None else scores + step
        weight = (min(k + 2, steps) - k) / steps if coarse and steps > 1 and k % 2 == 0 else 0.0
        if weight:
            coarse_sum = weight * step if coarse_sum is None else coarse_sum + weight * step
    assert scores is not None
    return scores, coarse_sum


def check_steps(estimator: str, steps: int | None) -> int:
    """The integration points of ``estimator`` (``steps`` checked; None: its default)."""
    return integration_points(
        estimator, steps, estimators=ESTIMATORS, paths=PATH_ESTIMATORS, default=DEFAULT_IG_STEPS
    )


def edge_result(
    inputs: Inputs,
    graph: Graph | SpanGraph,
    values: Any,
    index: Any,
    correct: Any,
    attrs: dict[str, Any],
) -> xr.DataArray:
    """(prompt, sender, receiver) DataArray of (k, n_senders * n_receivers) ``values`` for
    the prompts ``index``, NaN where no edge exists; on a ``SpanGraph``, (prompt, span,
    sender, receiver), NaN also where a prompt has no token in the span or in a k or v
    receiver's query span (not computed: ``Inputs.valid_cells``)."""
    values = np.asarray(values, dtype=np.float32).reshape(-1, *graph.shape)
    exists = np.broadcast_to(graph.valid, values.shape)
    coords = {**graph.coords(), **prompt_coords(inputs, index, correct)}
    dims: tuple[str, ...] = ("prompt", "sender", "receiver")
    if isinstance(graph, SpanGraph):
        has = inputs.valid_cells().numpy()[coords["prompt"]]  # (k, n_spans)
        query = graph.query_index
        has_query = np.where(query >= 0, has[:, query], True)  # (k, n_receivers)
        exists = exists & has[:, :, None, None] & has_query[:, None, None, :]
        dims = ("prompt", "span", "sender", "receiver")
        coords |= position_coords(inputs, list(coords["prompt"]))
    return schema.make(
        np.where(exists, values, np.float32("nan")), dims=dims, coords=coords, attrs=attrs
    )


def edge_attribution_memory(model: LensModel, options: Options, work: Work) -> Need:
    """Footprint of ``edge_attribution``: the (batch, n_senders, pos, d_model) clean -
    corrupt buffer (``contraction_dtype``) throughout; during a gradient pass, its graph,
    the receivers' gradient leaves and each block's input; during the contraction, one
    chunk of receiver gradients (``hooks.CHUNK_BYTES``), the norm's batched product and
    the float32 scores; the float32 (prompt, sender x receiver) result and its labelled
    copies. With ``error``: the clean pass's leaves, gradients and block inputs kept for
    the trapezoid's other end, three more float32 score blocks (the other end's or coarse
    rule's scores, the terms, the joined columns) and a result twice as wide. By span
    (``positions="spans"``): the score blocks and the result over ``SpanGraph``'s edges,
    the differences' copy sorted by span, each block's kept attention output and each
    key/value leaf's gradient per query span. Options a call did not give (a building
    block's ``Options``) are taken at their defaults."""
    check_steps(options.get("estimator", ESTIMATORS[0]), options.get("steps"))
    error = bool(options.get("error", False))
    spec, graph = model.spec, Graph.of(model)
    by_span = options.get("positions", "all") == "spans"
    n_spans = (work.n_spans or work.width) if by_span else 1
    spans = tuple(map(str, range(n_spans)))  # the names do not change the count
    edges = int(np.prod(SpanGraph(graph, spans).shape)) if by_span else graph.valid.size
    n_receivers = graph.shape[1]
    tokens, d_model = work.rows * work.width, spec.d_model
    c = memory.element_bytes(contraction_dtype(model))
    e = memory.element_bytes(model.dtype)
    differences = tokens * graph.shape[0] * d_model * c * (2 if by_span else 1)
    per_layer = (spec.n_heads + 2 * spec.n_kv_heads) * spec.d_head + d_model
    leaves = 2 * tokens * (spec.n_layers * per_layer + d_model) * e  # and their gradients
    if by_span:  # the attention outputs and each k/v leaf's gradient per query span
        kv = 2 * spec.n_kv_heads * spec.d_head * n_spans + spec.n_heads * spec.d_head
        leaves += tokens * spec.n_layers * kv * e
    resids = spec.n_layers * tokens * d_model * e
    heads = tokens * spec.n_heads * d_model * e  # one block's head outputs being recorded
    if error:  # the clean end's leaves, their gradients and its block inputs
        leaves, resids = 2 * leaves, 2 * resids
    backward = Need(
        activations=memory.gradient_pass(model, work.rows, work.width),
        buffers=differences + leaves + resids + heads,
    )
    per_receiver = tokens * d_model * 4  # the norm's batched product works in float32
    chunk = min(receiver_chunk(tokens * d_model * c), n_receivers) * tokens * d_model * c
    norm_product = 3 * min(receiver_chunk(per_receiver), spec.n_heads) * per_receiver
    blocks = (6 if error else 3) * work.rows * edges * 4
    contraction = Need(buffers=differences + leaves + resids + chunk + norm_product + blocks)
    result = Need(buffers=(6 if error else 3) * work.n_prompts * edges * 4)
    return memory.largest(backward, contraction) + result


def plan_edge_attribution(call: Call) -> Plan[xr.DataArray]:
    """``edge_attribution`` as a plan: per batch, one unedited clean pass and ``steps``
    corrupt passes with a backward each (with ``error``: the clean pass with a backward
    too, or, under the secant rules, one more plain corrupt pass; ``_batch_scores``). No
    pre-pass."""
    model, tokens, options = call.model, call.tokens, call.options
    points = check_steps(options.estimator, options.steps)
    rules = check_rules(options.estimator, options.rules)
    error = bool(options.get("error", False))
    inputs = batched(model, tokens, options, level="head")
    check_span_order(inputs)
    graph: Graph | SpanGraph = span_graph(inputs) or Graph.of(model)
    effect = {"eap": "EAP", "eap-ig": f"EAP-IG ({points} steps)"}.get(
        options.estimator, f"RelP ({rules} rules)"
    )
    attrs = {
        "long_name": f"{effect} edge score (clean -> corrupt) of {LONG_NAMES[options.metric]}",
        "units": UNITS[options.metric],
        **provenance(inputs, "edge_attribution", estimator=options.estimator, steps=points),
        "residual": graph.residual,
        **({} if rules is None else {"rules": rules}),
        **({} if inputs.positions == "all" else {"positions": inputs.positions}),
        **span_order(inputs),
    }

    n_edges = graph.valid.size

    def score(batch: Batch, step) -> Scores:
        scores = _batch_scores(inputs, batch, points, rules, error)
        step()
        return scores

    def finish(values, correct, index) -> xr.DataArray:
        values = np.asarray(values)
        result = edge_result(inputs, graph, values[:, :n_edges], index, correct, attrs)
        if not error:
            return result
        # The error estimates follow the scores (``_batch_scores``); NaN where no edge is.
        errors = values[:, n_edges:].reshape(-1, *graph.shape)
        errors = np.where(result.notnull().values, errors, np.nan)
        method = error_method(options.estimator, points, rules)
        return with_error(result, errors, method, undefined=NO_EDGE)

    return Plan(
        inputs,
        n_edges * (2 if error else 1),
        score,
        finish,
        desc=f"{effect} edge scores",
    )


def _prompt_mean(scores: xr.DataArray, options: Options, prompts: Any) -> xr.DataArray:
    """The view ``edge_attribution`` returns: per prompt, or the mean over prompts
    (float64, as (sender, receiver))."""
    if options.per_prompt:
        return scores
    # By span, a cell is NaN in the prompts without the span: the mean is over the others.
    skipna = "span" in scores.dims
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a mean of no edge: NaN
        mean = scores.load().astype(np.float64).mean("prompt", skipna=skipna, keep_attrs=True)
        if "error" not in scores.coords:
            return mean
        # The mean's error is |mean of the corrections|, at most the mean of their sizes.
        error = scores["error"].astype(np.float64).mean("prompt", skipna=skipna, keep_attrs=True)
    long_name = "prompt-mean error estimate (at least the mean score's own)"
    return mean.assign_coords(error=error.assign_attrs(long_name=long_name))


def check_span_order(inputs: Inputs) -> None:
    """Refuse edges by span on prompts whose spans come in different orders.

    Raises:
        ValueError: naming each order and its prompts, and how to split the set.
    """
    tokens = inputs.tokens
    if inputs.positions != "spans" or tokens.span_order_agrees:
        return
    assert tokens.spans is not None
    groups: dict[tuple[str, ...], list[int]] = {}
    for row, held in enumerate(tokens.spans):
        groups.setdefault(tuple(held or {}), []).append(row)
    listed = "; ".join(
        f"{', '.join(order)} in prompt(s) {', '.join(map(str, rows[:6]))}"
        + (f" ... ({len(rows)})" if len(rows) > 6 else "")
        for order, rows in groups.items()
    )
    raise ValueError(
        "positions='spans' on edges needs the spans in one order in every prompt: a key or "
        "value edge runs from a span to the spans after it, and a span cannot be before "
        f"another in one prompt and after it in the next. These prompts differ: {listed}. "
        "Split the set by order and run each part on its own, e.g. "
        "lsc.data.PromptSet([prompts[i] for i in rows])."
    )


def check_edge_attribution(model: LensModel, options: Options) -> None:
    """``edge_attribution``'s own options (``Method.checks``): the estimator with its steps
    and rules, ``error``, the rules and the backend against the model. Every estimator has
    an error estimate (``patching.error_method``), so ``error`` only has to be a flag."""
    check_steps(options.estimator, options.steps)
    _validate.flag("error", options.get("error", False))
    check_positions(options)
    check_relevance(model, check_rules(options.estimator, options.rules))
    check_supported(model, options.backend)


def check_positions(options: Options) -> None:
    """Refuse ``positions="each"`` on edges (a node per token), naming spans instead.

    Raises:
        ValueError: positions="each".
    """
    if options.get("positions", "all") == "each":
        raise ValueError(
            "Edges take positions='all' or 'spans', not 'each': a node per "
            "(component, token) makes a graph that grows as the prompt's length squared "
            "through keys and values, and tokens of prompts of different lengths do not "
            "line up. Name the tokens that matter as spans (Prompt(..., spans=...)) and "
            "use positions='spans'."
        )


@method(
    plan_edge_attribution,
    checks=check_edge_attribution,
    memory=edge_attribution_memory,
    needs_corrupt=True,
    shared=(*BATCHING, "positions"),
    view=_prompt_mean,
    view_options=("per_prompt",),
)
def edge_attribution(
    model: LensModel,
    prompts: Prompts,
    *,
    estimator: str = "eap",
    steps: int | None = None,
    rules: str | None = None,
    error: bool = False,
    per_prompt: bool = False,
    **shared,
) -> xr.DataArray:
    """Score every edge sender -> receiver with EAP, EAP-IG or RelP (see
    ``lenscape.capture.edges``).

    Args:
        model: a ``LensModel`` of any family whose computation its layout describes
            (``lsc.models.ARCHITECTURES``, checked on load; grouped-query attention is
            exact: k and v receivers are key/value heads; under a parallel residual a
            layer's heads send nothing to its own MLP; through a post-norm a head's output
            is linearised at the run's scale: ``lenscape.models.layouts.Computation``).
        prompts: prompts with a ``corrupt`` text of the same token length and single-token
            targets (and distractors for ``metric="logit_diff"``).
        estimator: "eap" (gradient at the corrupt run), "eap-ig" (integrated gradients
            along the corrupt -> clean embedding path) or "relp" (relevance patching: the
            corrupt run's gradient under relevance ``rules``, at EAP's cost).
        steps: integration points of "eap-ig" (default 5, at most
            ``options.MAX_STEPS``); "eap" and "relp" take 1.
        rules: the relevance rules of "relp" (as in ``lsc.attribution_patching``); a model
            whose computation no rule covers (LayerNorms, attention soft-capping, routed
            experts, a fused gate/up) is refused before any pass, with the reason.
        backend: "nnsight" (TransformerLens cannot express per-receiver inputs: an error
            says so).
        error: also estimate each score's error (module docstring): a coord ``error``
            with the scores' dims and units, >= 0 (NaN where no edge exists, the reason in
            its attrs' ``undefined``), its method and cost in the coord's attrs
            (``patching.ERROR_METHODS``; ``error_method`` in the result's attrs), as
            ``lsc.attribution_patching(error=True)``'s. "eap": the trapezoid correction,
            one backward pass more; "eap-ig" with 2+ steps: the gap to the coarser rule on
            the even points, free; "relp": the trapezoid correction under the rules (one
            backward pass more) or, for the "secant" rules, the gap to "eap" (one forward
            and one backward pass more). The prompt mean's ``error`` is the mean of the
            per-prompt ones (at least the mean score's own).
        positions: "all" (the default: every edge summed over token positions) or
            "spans": edges between (component, span) nodes (``graph.SpanGraph``), on
            prompts that all name spans in one order (``Prompt(..., spans=...)``; the built-in
            sets carry them): a ``span`` dim where the sender writes and the receiver reads,
            and k and v receivers per query span ("L3.KV1.k@END": the key/value head at
            ``span`` read by its queries at END; coord ``query_span``). Summed over
            ``span`` and query spans, the scores are the position-agnostic ones. A cell a
            prompt lacks is NaN; the prompt mean is over the prompts that have it.
        per_prompt: keep the ``prompt`` dim (with its ``correct`` flags, so
            ``lsc.aggregate.correct_only`` can drop wrong answers) instead of averaging
            over prompts. A ``store`` always holds the per-prompt scores.

    Returns:
        DataArray (sender, receiver), or (prompt, sender, receiver) with ``per_prompt``
        (``span`` before ``sender`` with ``positions="spans"``);
        coords ``sender_kind`` (embed, head, mlp), ``sender_layer``, ``sender_head`` and
        ``receiver_kind`` (q, k, v, mlp, logits), ``receiver_layer``, ``receiver_head``
        (-1 where there is none; the logits' layer is ``n_layers``). NaN where no edge
        exists (the receiver is upstream of the sender).

    Raises:
        TypeError: ``error`` or ``per_prompt`` not True or False.
        ValueError: unknown estimator, steps < 1 (or > 1 with "eap"), a corrupt prompt of
            another token length, an unsupported architecture, backend="transformer_lens",
            positions="each", or positions="spans" on prompts without spans or with
            spans in different orders.
    """
    per_prompt = _validate.flag("per_prompt", per_prompt)
    return run(edge_attribution, locals())
