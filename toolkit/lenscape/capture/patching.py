"""Causal attributions: exact ablation and activation patching, and attribution patching.

Exact methods change one component (a head's output before ``o_proj``, or an attention
or MLP block's contribution to the residual stream) and re-run the model:

- ``ablation``: replace it with zeros or its mean over the prompt set's real tokens, on
  the clean prompt; score = metric(ablated) - metric(clean).
- ``activation_patching``: run the corrupt prompt with the component's clean activation
  patched in (clean -> corrupt, "denoising"); score = metric(patched) - metric(corrupt).

Exact sweeps reuse the unedited run: it is run once per batch and keeps the residual
stream entering every block; a component of block ``l`` is then measured by running only
blocks ``l..L-1`` from that residual stream (about half the model on average). The
variants of one block are stacked in the batch dimension (``variants_per_pass`` copies of
the batch per pass, each copy editing one component), so one pass measures many components.

``attribution_patching`` estimates ``activation_patching`` from gradients, for every
component at once:

- ``estimator="atp"`` (attribution patching, first order): score = sum over positions of
  grad_corrupt(metric) . (clean - corrupt activation); 2 forward passes + 1 backward pass.
- ``estimator="ig"`` (integrated gradients along the input path, as in EAP-IG, Hanna et al.
  2024, arXiv 2403.17806): the gradient is averaged over ``steps`` points of the straight
  line from the corrupt to the clean residual stream entering block 0,
  x(a) = corrupt + a (clean - corrupt), a = k / steps for k = 0..steps-1 (left Riemann sum),
  score = sum_pos mean_k grad_x(a_k)(metric) . (clean - corrupt activation). ``steps=1`` is
  exactly ``"atp"``; each further step costs one forward + backward pass.

**Error estimates** (``attribution_patching(..., error=True)``: a coord ``error``, >= 0,
the scores' dims and units). Each estimate is a quadrature of the metric's gradient along
a path from the corrupt to the clean activation; its error is estimated from the same
quadrature's next term, never from exact patching:

- "atp" (and "ig" with 1 step): AtP is the left rule, one point. The trapezoid rule adds
  1/2 (g_clean - g_corrupt) . delta, with g_clean the gradient at the path's other end (the
  clean run), and is exact where the metric is quadratic in the activations; so
  error = |1/2 sum_pos (g_clean - g_corrupt) . (clean - corrupt activation)|, zero where
  the metric is linear in the component (its gradient is the same at both ends). Cost:
  one backward pass more (the clean pass keeps its graph).
- "ig" with n >= 2 points: the left rule's error halves with its step (Richardson), so
  the n-point rule's error is about |IG_n - IG_coarse|, IG_coarse the left rule on the
  even points a_0, a_2, ... of the same path (each weighted by the width it covers). Free.
- "relp": the trapezoid correction with both ends' coefficients under the rules (one
  backward pass more); for rules that linearise towards the clean run ("secant") both ends
  give the same coefficients, so there the error is |secant - atp|: exact patching of one
  component moves each operation only part of the corrupt -> clean segment, between the
  tangent at the corrupt end (AtP) and the whole segment's secant (one forward and one
  backward pass more).

The gradient at the clean run stands in for the gradient at the end of the one-component
path (the corrupt run with that component patched): the error estimate is a first-order
guess, not a bound. ``benchmarks/error_estimates.py`` measures how well it predicts the
error against exact patching.

``refine=k`` on the exact methods ranks every component with a gradient estimate and runs
the exact sweep on the k components whose prompt-mean estimate is largest in absolute
value; the others are NaN ("not computed"). ``refine="auto"`` estimates every cell and its
error, measures exactly the cells whose estimate could be wrong by more than ``tol``
(``auto_cells``), then, with those exact values in hand, the other cells of every component
whose membership of the ``top`` components is still in doubt (``ranking_cells``); the others
keep the estimate, and a coord ``measured`` says which is which. A pass stacks only the
prompts a component is measured on.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import _validate
from ..data import Prompts
from ..models import LensModel
from ..sweep import memory, metrics
from ..sweep.backend import RunResult, Site, TokenBatch, get_backend
from ..sweep.inputs import Batch, Inputs, batched
from ..sweep.options import DEFAULTS, EXACT, LEVELLED, MAX_STEPS, Options, integration_points
from ..sweep.plan import Call, Plan, Result, Scores, once, one_level_plan, top_is_target
from ..sweep.registry import method, run
from ..sweep.relevance import RULE_SETS, clean_pass, rules_or_plain, unsupported
from ..sweep.result import LEVELS, components, to_dataarray
from .lens import read_out

ABLATION_KINDS = ("zero", "mean")
#: Gradient estimators of a patching effect; see the module docstring.
ESTIMATORS = ("atp", "ig", "relp", "trapezoid")
#: The estimators that integrate along the corrupt -> clean input path.
PATH_ESTIMATORS = ("ig",)
#: The rule set of ``estimator="relp"`` when ``rules`` is not given: RelP's released rules
#: (``sweep/relevance.RULE_SETS``). ``rules="secant-0.9"`` agrees best with exact patching
#: of MLP blocks at about "secant"'s cost (benchmarks/RESULTS.md, sections faithfulness and
#: MLP-block estimator).
DEFAULT_RULES = "relp"
#: Integration points of ``estimator="ig"`` when ``steps`` is not given. Measured on SmolLM2
#: (benchmarks/RESULTS.md, section faithfulness): 2 points raise MLP-block agreement with
#: exact patching most per unit of cost (Pearson r over cells 0.71 -> 0.90 on the factual set,
#: 0.59 -> 0.88 on IOI, for 1.4-1.7x AtP's time); 8 points reach 0.93 / 0.96 at 4-6x.
DEFAULT_IG_STEPS = 2
#: Where integrated gradients interpolates: the residual stream entering block 0.
INPUT_SITE: Site = ("resid_pre", 0)
#: The residual stream entering the final norm, (batch, pos, d_model).
FINAL_SITE: Site = ("resid_final", -1)
#: ``refine="auto"``: the components whose ranking it keeps exact, the tolerance (a share
#: of the largest |estimate|) when ``tol`` is not given, and how many error estimates a
#: cell's value may be off (``auto_cells``). A factor 2 leaves room for error estimates that
#: come out low (benchmarks/error_estimates.py measures how often they do).
AUTO_TOP = 10
AUTO_TOL = 0.05
AUTO_MARGIN = 2.0
#: How refine="auto" picks its cells, for its results' attrs.
AUTO_RULE = (
    "first the cells where margin * error > tol are measured; each component's margin is "
    "then raised to the largest actual / estimated error among its measured cells, and its "
    "other cells where that margin * error > tol are measured; so is every other cell of a "
    "component whose membership of the top components by |prompt-mean| is still in doubt "
    "(neither surely in nor surely out with |mean| +- the mean of margin * error over its "
    "cells not measured, measured ones exact); lenscape.capture.patching.auto_cells, "
    "calibrated_margins, ranking_cells"
)
#: How each fast estimate's error is estimated (``error=True``; the module docstring says
#: why): name -> (what it is, the passes it adds per batch).
ERROR_METHODS = {
    "trapezoid": (
        "|1/2 sum_pos (g_other - g_base) . (replacement - activation)|: the trapezoid rule's "
        "correction to the one-point rule, g_other the metric's gradient at the other end "
        "(the clean run; for ablation the run with every component replaced); for an edge "
        "sender -> receiver, g the gradient at the receiver's input and the change the "
        "sender's clean - corrupt output",
        "one backward pass (ablation: one forward and one backward)",
    ),
    "trapezoid-rules": (
        "|1/2 sum_pos (c_clean - c_corrupt) . (clean - corrupt activation)|: the trapezoid "
        "correction with both coefficients taken under the relevance rules",
        "one backward pass",
    ),
    "correction-size": (
        "|the trapezoid correction the estimate added to AtP| (AtP's own error estimate): "
        "conservative, as the trapezoid rule's error is usually smaller than its correction",
        "none",
    ),
    "coarse-rule": (
        "|IG on all points - IG on the even points a_0, a_2, ... of the same path|: the "
        "left rule's error halves with its step, so this estimates the n-point rule's error",
        "none",
    ),
    "secant-vs-atp": (
        "|secant estimate - atp estimate| (edges: - eap estimate): the secant rules "
        "linearise each operation over the whole corrupt -> clean change (over its first "
        "90% under 'secant-0.9'), AtP at the corrupt end; patching one component "
        "moves each operation part of the way, so under monotone curvature the exact "
        "effect lies between them",
        "one forward and one backward pass",
    ),
}
Variant = tuple[Site, "int | None"]
#: ``estimate(batch)`` -> ((rows, width) gradient estimates, (rows,) bool whether the model
#: answers each clean prompt correctly, or None when the estimate does not run them).
Estimate = Callable[[Batch], tuple[torch.Tensor, "torch.Tensor | None"]]
#: ``scorer_for(cells, correct)`` -> ``_sweep_scorer``'s score of those cells.
ScorerFor = Callable[
    ["torch.Tensor | None", "torch.Tensor | None"], Callable[[Batch, Callable], Scores]
]
#: A variant and the batch rows (a 1-D index tensor) an exact pass edits it on.
Piece = tuple[Variant, torch.Tensor]


def _sites(variants: list[Variant]) -> list[Site]:
    return list(dict.fromkeys(site for site, _ in variants))


def _index(head: int | None, rows: slice | torch.Tensor = slice(None)) -> tuple:
    """Index (rows, pos[, head]) into a site activation; ``rows`` a slice or 1-D indices."""
    return (rows, slice(None)) if head is None else (rows, slice(None), head)


def _stacked_edit(pieces: list[Piece], replacement):
    """Edit for a stacked pass: the rows of piece ``i`` (stacked in order) get its
    variant replaced.

    ``replacement(site, head, rows)`` -> tensor broadcastable to (len(rows), pos[, d]) for
    the batch rows ``rows``.
    """

    def edit(site: Site, value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        start = 0
        for (variant_site, head), rows in pieces:
            if variant_site == site:
                stacked = slice(start, start + len(rows))
                value[_index(head, stacked)] = replacement(site, head, rows)
            start += len(rows)
        return value

    return edit


def _site_means(inputs: Inputs, sites: list[Site], progress: bool) -> dict[Site, torch.Tensor]:
    """Mean activation of each site over all real tokens of all prompts: z (n_heads, d_head),
    blocks (d_model,)."""
    backend = get_backend(inputs.model, inputs.backend)
    sums: dict[Site, torch.Tensor] = {}
    count = 0
    for batch in tqdm(
        inputs.batches(), total=inputs.n_batches(), disable=not progress, desc="mean activations"
    ):
        with torch.no_grad():
            run = backend.run(batch.clean, sites=sites)
        mask = batch.clean.attention_mask.bool()
        count += int(mask.sum())
        for site in sites:
            total = run.acts[site][mask].double().sum(0)
            sums[site] = sums[site] + total if site in sums else total
    return {site: (total / count).to(inputs.model.dtype) for site, total in sums.items()}


def _layer_groups(variants: list[Variant], columns: list[int]) -> list[tuple[int, list[int]]]:
    """``columns`` of ``variants`` grouped by the block they edit: [(layer, [column, ...])]."""
    groups: dict[int, list[int]] = {}
    for column in columns:
        (_, layer), _ = variants[column]
        groups.setdefault(layer, []).append(column)
    return sorted(groups.items())


def _edited_metric(
    backend: Any,
    metric: str,
    batch: Batch,
    source: str,
    pieces: list[Piece],
    unedited: Any,
    replacement: Callable,
) -> torch.Tensor:
    """(sum of len(rows),) metric of one stacked pass: for each piece (variant, rows), the
    rows ``rows`` of ``batch``'s ``source`` tokens with the variant replaced, stacked in
    order and resumed from the unedited run's residual stream at the first piece's block
    (pieces in block order: the rows of a later block's piece run the blocks before it
    unedited)."""
    (_, layer), _ = pieces[0][0]
    stacked = torch.cat([rows for _, rows in pieces])
    resume = None if layer == 0 else (layer, unedited.acts[("resid_pre", layer)][stacked])
    target, distractor = batch.target[stacked], batch.distractor[stacked]
    read = metrics.read_ids(metric, target, distractor)
    run = backend.run(
        getattr(batch, source).select(stacked),
        sites=_sites([variant for variant, _ in pieces]),
        edit=_stacked_edit(pieces, replacement),
        resume=resume,
        vocab=read,
    )
    return metrics.compute_read(metric, run.logits, target, distractor, read)


# What a stacked pass costs beside its rows' compute, in token-blocks (one token through
# one block): each block it runs has a fixed cost (hooks, kernel launches) of about
# BLOCK_OVERHEAD_TOKENS tokens, and the pass itself (tracing, final norm, unembedding)
# about PASS_OVERHEAD_BLOCKS blocks' worth. Measured on SmolLM2 and gemma3-270m, 2-core
# CPU, float32: 5-6 ms a block whatever the rows, against 0.06-0.12 ms a token-block.
BLOCK_OVERHEAD_TOKENS = 64
PASS_OVERHEAD_BLOCKS = 2


def _packed(
    pieces: list[tuple[Any, torch.Tensor]],
    budget: int,
    *,
    layers: Sequence[int],
    n_layers: int,
    width: int,
) -> Iterator[list[tuple[Any, torch.Tensor]]]:
    """``pieces`` (anything, rows), in block order, cut into passes of at most ``budget``
    stacked rows (a piece larger than ``budget`` gets a pass of its own) at the least
    estimated cost.

    A pass resumes at its first piece's block ``l`` and runs every row through blocks
    ``l..n_layers-1``, so a row of a later block's piece runs blocks it need not: packing
    a block-17 piece after a block-1 piece costs it 16 blocks. A pass costs
    (n_layers - l) * (BLOCK_OVERHEAD_TOKENS + width * rows) + PASS_OVERHEAD_BLOCKS *
    BLOCK_OVERHEAD_TOKENS token-blocks; the cut is the cheapest one (dynamic programming
    over the cut points). A full sweep's pieces (every row of every component) fill one
    pass per block as before; sparse cells (refine) no longer run early blocks for rows
    of late ones.

    Args:
        layers: (len(pieces),) the block each piece edits.
        width: tokens per row.
    """
    n = len(pieces)
    sizes = [len(rows) for _, rows in pieces]
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of the first j pieces
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        rows = 0
        for i in range(j - 1, -1, -1):  # the last pass holds pieces i..j-1
            rows += sizes[i]
            if rows > budget and i < j - 1:
                break
            blocks = n_layers - layers[i]
            cost = blocks * (BLOCK_OVERHEAD_TOKENS + width * rows)
            cost += PASS_OVERHEAD_BLOCKS * BLOCK_OVERHEAD_TOKENS
            if best[i] + cost < best[j]:
                best[j], cut[j] = best[i] + cost, i
    ends = [n]
    while ends[-1]:
        ends.append(cut[ends[-1]])
    for start, end in itertools.pairwise(reversed(ends)):
        yield pieces[start:end]


def _write_changes(
    effects: torch.Tensor, chunk: list[tuple[int, torch.Tensor]], changes: torch.Tensor
) -> None:
    """Write one stacked pass's ``changes`` (its rows in ``chunk``'s order) into ``effects``
    (rows, n_components) at each piece's (rows, column)."""
    start = 0
    for column, rows in chunk:
        effects[rows.cpu(), column] = changes[start : start + len(rows)].float().cpu()
        start += len(rows)


def _unedited(
    backend: Any,
    metric: str,
    batch: Batch,
    tokens: TokenBatch,
    sites: list[Site],
    read: torch.Tensor | None,
) -> tuple[Any, torch.Tensor]:
    """The unedited pass over ``tokens`` keeping ``sites``, unembedding the ids ``read``
    only (all when None), and its metric (rows,)."""
    run = backend.run(tokens, sites=sites, vocab=read)
    value = metrics.compute_read(metric, run.logits, batch.target, batch.distractor, read)
    return run, metrics.check_finite(value, batch.index, metric)


class _FixedPasses:
    """Each batch's fixed passes of an exact sweep (its unedited run with the residual
    stream entering every block, that run's metric, and the replacement), kept for the
    sweeps of the same call that measure other cells of the batch (refine="auto"'s two
    stages), up to ``budget`` bytes; filled by the first sweep over a batch, or by
    activation patching's estimate, whose clean and corrupt passes are these (measured:
    they were a third of refine="auto"'s time on gemma3-270m heads). A pickled copy (a
    plan sent to another process) keeps none."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.entries: dict[tuple, tuple] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"budget": self.budget, "used": 0, "entries": {}}

    def get(self, key: tuple) -> tuple | None:
        return self.entries.get(key)

    def put(self, key: tuple, passes: tuple, size: int) -> None:
        """Keep ``passes`` of ``size`` bytes if the budget allows."""
        if self.used + size <= self.budget:
            self.entries[key] = passes
            self.used += size


def _fixed_key(batch: Batch, read: torch.Tensor | None, decides_correct: bool) -> tuple:
    """What ``_FixedPasses`` keys a batch's passes by: its prompts, whether its passes
    unembed every token (``read`` None) or only the ids the metric reads, and whether they
    hold the clean logits that decide whether the model answers each prompt."""
    return tuple(batch.index.tolist()), read is None, decides_correct


def _blocks_done(groups: list[tuple[int, list[int]]], variants: list[Variant], last: int) -> int:
    """How many blocks of ``groups`` (``_layer_groups``) a sweep has finished once its
    pieces (in block order) up to column ``last`` are measured."""
    layer = variants[last][0][1]
    return sum(1 for block, group in groups if block < layer or group[-1] == last)


# long: one closure per sweep: fixed passes (made or kept), packing, progress steps
def _sweep_scorer(
    inputs: Inputs,
    *,
    source: str,
    replacement_for,
    variants_per_pass: int | None,
    cells: torch.Tensor | None = None,
    correct: torch.Tensor | None = None,
    kept: _FixedPasses | None = None,
) -> Callable[[Batch, Callable], Scores]:
    """``score(batch, step)``: metric change when each component is replaced, (rows,
    n_components), and whether the model answers each clean prompt correctly.

    Args:
        source: which tokens the edited passes run on, "clean" or "corrupt".
        replacement_for: ``(batch, whole_vocab) -> (replacement(site, head, rows), clean
            logits)``: ``replacement`` gives the new value of a component for the batch
            rows ``rows`` (a 1-D index tensor); the clean logits (rows, vocab) at the read
            position come from a clean pass it makes (unembedding every token only when
            ``whole_vocab``), or are None when ``source`` is "clean" (the unedited pass is
            the clean one) or not ``whole_vocab``.
        variants_per_pass: a pass stacks at most this many copies of the batch's rows;
            None: as many as a block has components, or fewer if they do not fit the
            memory budget.
            The pieces (component, rows measured) go in block order, so a pass whose
            pieces span blocks resumes at its first piece's block.
        cells: (n_prompts, n_components) bool, the cells to measure (prompts in prompt-list
            order, components in ``components(inputs)`` order); the others are NaN. A pass
            stacks only the rows a component is measured on. None: every cell.
        correct: (n_prompts,) bool, known from an earlier pass (refine="auto"'s estimate):
            then every pass unembeds only what the metric reads (``metrics.read_ids``) and
            a batch with no cell to measure makes no pass. None: from the sweep's passes.
        kept: each batch's unedited and replacement passes, shared with the call's other
            sweeps (they keep the residual stream entering every block), or None.
    """
    model, metric = inputs.model, inputs.metric
    backend = get_backend(model, inputs.backend)
    variants = components(inputs)
    if cells is None:
        cells = torch.ones(len(inputs.tokens), len(variants), dtype=torch.bool)
    columns = [c for c in range(len(variants)) if cells[:, c].any()]
    groups = _layer_groups(variants, columns)
    # A pass holds as many rows as a full sweep's pass over one block would.
    per_block = max(len(group) for _, group in _layer_groups(variants, list(range(len(variants)))))
    if kept is None:
        resid_sites = [("resid_pre", layer) for layer, _ in groups if layer > 0]
    else:  # another sweep may resume anywhere
        resid_sites = [("resid_pre", layer) for layer in range(1, model.spec.n_layers)]
    site_bytes = _site_width(model, inputs.level) * memory.element_bytes(model.dtype)

    def score(batch: Batch, step) -> Scores:
        tokens = getattr(batch, source)
        rows = len(batch.index)
        wanted = cells[batch.index]  # (rows, n_components): the cells to measure
        effects = torch.full((rows, len(variants)), float("nan"))
        if correct is not None and not wanted.any():  # nothing to measure: no pass
            for _ in range(model.spec.n_layers):
                step()
            return Scores(effects, correct[batch.index.cpu()])
        on_device = wanted.to(batch.target.device)
        per_pass = variants_per_pass or memory.auto_variants_per_pass(
            model,
            rows=rows,
            width=tokens.input_ids.shape[1],
            wanted=per_block,
        )
        # (component, rows measured), in block order.
        pieces = [(c, on_device[:, c].nonzero()[:, 0]) for _, group in groups for c in group]
        pieces = [(c, chosen) for c, chosen in pieces if len(chosen)]
        read = None if correct is None else metrics.read_ids(metric, batch.target, batch.distractor)
        key = _fixed_key(batch, read, correct is None)
        with torch.no_grad():
            passes = None if kept is None else kept.get(key)
            if passes is None:
                unedited, base = _unedited(backend, metric, batch, tokens, resid_sites, read)
                replacement, clean_logits = replacement_for(batch, correct is None)
                if kept is not None:
                    resid = sum(a.numel() * a.element_size() for a in unedited.acts.values())
                    size = resid + tokens.input_ids.numel() * site_bytes
                    kept.put(key, (unedited, base, replacement, clean_logits), size)
            else:
                unedited, base, replacement, clean_logits = passes
            if correct is None:
                clean = unedited.logits if clean_logits is None else clean_logits
                right = top_is_target(clean, batch.target)
            done = 0  # progress: one step per block, once its last piece is measured
            layers = [variants[c][0][1] for c, _ in pieces]
            width = tokens.input_ids.shape[1]
            for chunk in _packed(
                pieces, per_pass * rows, layers=layers, n_layers=model.spec.n_layers, width=width
            ):
                edited = [(variants[c], chosen) for c, chosen in chunk]
                value = _edited_metric(
                    backend, metric, batch, source, edited, unedited, replacement
                )
                _write_changes(effects, chunk, value - base[torch.cat([r for _, r in chunk])])
                finished = _blocks_done(groups, variants, chunk[-1][0])
                for _ in range(finished - done):
                    step()
                done = finished
            for _ in range(model.spec.n_layers - done):  # blocks with nothing left to measure
                step()
        metrics.check_finite(torch.where(wanted, effects, 0.0), batch.index, metric)
        return Scores(effects, right if correct is None else correct[batch.index.cpu()])

    return score


def _gradient_effects(
    runner,
    metric: str,
    batch: Batch,
    sites: list[Site],
    *,
    base: TokenBatch,
    goal: Callable[[Site, torch.Tensor], torch.Tensor],
    steps: int = 1,
    clean_input: torch.Tensor | None = None,
    error: bool = False,
    other: dict[Site, torch.Tensor] | None = None,
    keep: Sequence[Site] = (),
    first: tuple[Any, dict[Site, torch.Tensor]] | None = None,
) -> tuple[dict[Site, torch.Tensor], dict[Site, torch.Tensor] | None, Any]:
    """Gradient estimate of replacing each site's activation on ``base`` by ``goal``, the
    terms of its error estimate, and the pass over ``base`` itself.

    estimate = mean_k grad(metric)|x(a_k) . (goal - base activation), per position, with
    x(a) = base input + a (clean_input - base input) the residual stream entering block 0
    and a_k = k / steps (k = 0..steps-1). ``steps=1`` is attribution patching: the gradient
    at the base run alone (``clean_input`` unused).

    Error terms (``ERROR_METHODS``), with ``error``: for ``steps=1``, the trapezoid rule's
    correction 1/2 (g_other - g_base) . delta, ``other`` the gradient at the other end;
    for ``steps > 1``, the estimate less the coarser left rule on the even points a_0,
    a_2, ... of the same path (each weighted by the width it covers), at no extra pass.

    Args:
        base: tokens of the run the replacement is made in (corrupt for patching, clean
            for ablation).
        goal: ``(site, base activation) -> replacement activation``, same shape.
        clean_input: (batch, pos, d_model) the clean residual stream entering block 0;
            needed when ``steps > 1``.
        error: also return the error terms.
        other: site -> the metric's gradient at the other end of the replacement, shaped
            like the site; needed with ``error`` when ``steps == 1``.
        keep: more sites the pass over ``base`` keeps (unedited).
        first: the pass over ``base`` and its gradients at ``sites`` (``_gradients``),
            made already (``_gradients_at_both_ends``); None: made here.

    Returns:
        (products, terms, run): site -> (batch, pos, [head,] d) float32 products, not yet
        summed over positions; ``terms`` alike (None without ``error``): the estimate plus a
        component's terms summed over positions is the corrected estimate, their absolute
        value its error estimate; the pass over ``base`` (its logits those the metric reads,
        its acts the sites and ``keep``, with their graph).
    """
    grad_sums: dict[Site, torch.Tensor] = {}
    coarse_sums: dict[Site, torch.Tensor] = {}
    deltas: dict[Site, torch.Tensor] = {}
    base_run = None
    for k in range(steps):

        def interpolate(site: Site, value: torch.Tensor, alpha=k / steps) -> torch.Tensor:
            if site != INPUT_SITE:
                return value
            assert clean_input is not None  # steps > 1 comes with clean_input (see Args)
            return value + alpha * (clean_input - value)

        if k == 0 and first is not None:
            run, grads = first
        else:
            run, grads = _gradients(
                runner,
                metric,
                batch,
                base,
                sites,
                edit=interpolate if k > 0 else None,
                also=[INPUT_SITE] if k > 0 else keep,
            )
        base_run = run if k == 0 else base_run
        # The coarse rule's weight of point k: the even points, each covering two steps.
        width = (min(k + 2, steps) - k) / steps if error and k % 2 == 0 else 0.0
        for site, grad in grads.items():
            if k == 0:
                act = run.acts[site].detach()
                deltas[site] = (goal(site, act) - act).float()
                grad_sums[site] = grad.float()
                coarse_sums[site] = width * grad.float()
            else:
                grad_sums[site] = grad_sums[site] + grad.float()
                if width:
                    coarse_sums[site] = coarse_sums[site] + width * grad.float()
    products = {site: deltas[site] * grad_sums[site] / steps for site in sites}
    if not error:
        return products, None, base_run
    if steps > 1:
        coarse = {site: products[site] - deltas[site] * coarse_sums[site] for site in sites}
        return products, coarse, base_run
    assert other is not None  # see Args
    trapezoid = {site: 0.5 * (other[site].float() - grad_sums[site]) for site in sites}
    return products, {site: trapezoid[site] * deltas[site] for site in sites}, base_run


def _gradients(
    runner,
    metric: str,
    batch: Batch,
    tokens: TokenBatch,
    sites: list[Site],
    *,
    edit=None,
    also: Sequence[Site] = (),
    read_out_with: LensModel | None = None,
) -> tuple[Any, dict[Site, torch.Tensor]]:
    """One pass over ``tokens`` (with ``edit`` at ``sites`` and ``also``) and the metric's
    gradient at ``sites``: (the run, site -> gradient shaped like the site). The run's
    logits are those the metric reads (``metrics.read_ids``); with ``read_out_with`` (the
    model, and no ``edit``) every token's, (rows, vocab), read out without gradient from the
    residual stream entering the final norm, for ``top_is_target`` (the backward pass skips
    the full unembedding)."""
    read = metrics.read_ids(metric, batch.target, batch.distractor)
    whole = read_out_with is not None and read is not None
    assert not (whole and edit is not None), "read_out_with reads the unedited stream"
    final = [FINAL_SITE] if whole else []
    run = runner.run(tokens, sites=[*also, *sites, *final], edit=edit, grad=True, vocab=read)
    value = metrics.check_finite(
        metrics.compute_read(metric, run.logits, batch.target, batch.distractor, read),
        batch.index,
        metric,
    )
    grads = torch.autograd.grad(value.sum(), [run.acts[site] for site in sites])
    if whole:
        assert read_out_with is not None
        rows = torch.arange(len(tokens.read_pos), device=tokens.read_pos.device)
        with torch.no_grad():
            logits = read_out(read_out_with, run.acts[FINAL_SITE][rows, tokens.read_pos].detach())
        run = dataclasses.replace(run, logits=logits)
    return run, dict(zip(sites, grads, strict=True))


def _component_columns(
    products: dict[Site, torch.Tensor], variants: list[Variant], mask: torch.Tensor
) -> torch.Tensor:
    """Sum per-site products over real positions into (batch, len(variants)) columns.

    Args:
        products: site -> (batch, pos, head, d_head) for "z" sites, (batch, pos, d_model)
            for blocks.
        mask: (batch, pos) 1 at real tokens.
    """
    columns = []
    for site in _sites(variants):
        product = products[site]
        if site[0] == "z":  # (batch, pos, head, d_head) -> (batch, head)
            columns.append(torch.einsum("bphd,bp->bh", product, mask))
        else:  # (batch, pos, d_model) -> (batch, 1)
            columns.append(torch.einsum("bpd,bp->b", product, mask)[:, None])
    return torch.cat(columns, dim=1)


def _columns(
    products: dict[Site, torch.Tensor],
    terms: dict[Site, torch.Tensor] | None,
    variants: list[Variant],
    mask: torch.Tensor,
) -> torch.Tensor:
    """(batch, len(variants)) estimates on the CPU, then, with error ``terms``
    (``_gradient_effects``), (batch, len(variants)) error estimates: |terms summed over
    real positions|."""
    values = _component_columns(products, variants, mask)
    if terms is not None:
        values = torch.cat([values, _component_columns(terms, variants, mask).abs()], dim=1)
    return values.cpu()


def _check_estimator(estimator: str, steps: int | None) -> int:
    """Validate ``estimator``/``steps``; return the number of integration points."""
    return integration_points(
        estimator, steps, estimators=ESTIMATORS, paths=PATH_ESTIMATORS, default=DEFAULT_IG_STEPS
    )


def parse_estimator(
    label: str, *, estimators: Sequence[str], paths: Sequence[str], default: int
) -> tuple[str, int, str | None]:
    """An estimator's label -> (estimator, steps, relevance rules): ``NAME`` or
    ``NAME:DETAIL``, DETAIL the integration points of a path estimator (``paths``; without
    it ``default``) or the rules of "relp" (without them ``DEFAULT_RULES``): ``"ig:16"`` ->
    ("ig", 16, None), ``"relp:secant"`` -> ("relp", 1, "secant"), ``"atp"`` -> ("atp", 1,
    None).

    Raises:
        ValueError: an unknown estimator or rule set, a DETAIL where none belongs, steps
            out of 1..``MAX_STEPS``.
    """
    name, _, detail = str(label).partition(":")
    fix = (
        f"use one of {list(estimators)}, '{paths[0]}:N' (N integration points) or "
        f"'relp:RULES' (RULES one of {list(RULE_SETS)})"
    )
    if name not in estimators or (detail and name not in (*paths, "relp")):
        raise ValueError(f"Unknown estimator {label!r}; {fix}.")
    if name == "relp":
        return name, 1, check_rules(name, detail or None)
    if detail and not detail.isdigit():
        raise ValueError(f"Unknown estimator {label!r}; {fix}.")
    steps = integration_points(
        name, int(detail) if detail else None, estimators=estimators, paths=paths, default=default
    )
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(
            f"Estimator {label!r}: steps={steps} must lie in 1..{MAX_STEPS} (each step is a "
            f"forward and a backward pass per batch), e.g. '{paths[0]}:8'."
        )
    return name, steps, None


def with_relevance(labels: Sequence[str], model: LensModel) -> list[str]:
    """``labels`` less the "relp" ones whose rules cannot run on ``model`` (its family, or
    modules of another formula): the default estimators of a report."""
    return [
        label
        for label in labels
        if not label.startswith("relp")
        or unsupported(model, label.partition(":")[2] or DEFAULT_RULES) is None
    ]


def _estimator_name(estimator: str, points: int, rules: str | None) -> str:
    """How results and progress bars name an estimate."""
    if estimator == "ig":
        return f"Integrated-gradient estimate ({points} steps)"
    if estimator == "relp":
        return f"Relevance patching ({rules} rules)"
    if estimator == "trapezoid":
        return "Trapezoid-corrected attribution patching"
    return "Attribution patching"


def error_method(estimator: str, points: int, rules: str | None) -> str:
    """The ``ERROR_METHODS`` name of an estimate's error estimate."""
    if estimator == "relp":
        return (
            "secant-vs-atp"
            if RULE_SETS[rules or DEFAULT_RULES].needs_reference
            else "trapezoid-rules"
        )
    if estimator == "trapezoid":
        return "correction-size"
    return "coarse-rule" if points > 1 else "trapezoid"


def with_error(
    result: xr.DataArray, errors: Any, method: str, *, undefined: str | None = None
) -> xr.DataArray:
    """``result`` with the coord ``error``: (same dims) the error estimates ``errors``
    (prompt, n_components; or edge scores' (prompt, n_senders * n_receivers)), in its
    units, its method and cost in the coord's attrs and the method in the result's
    (``error_method``); ``undefined``: why an error estimate is NaN where it is (an attr
    of the coord, as faithfulness reports say why a statistic is NaN)."""
    coord = xr.DataArray(
        np.asarray(errors, dtype=np.float32).reshape(result.shape),
        dims=result.dims,
        attrs={
            "long_name": "error estimate",
            "units": result.attrs["units"],
            "method": f"{method}: {ERROR_METHODS[method][0]}",
            "extra_passes": ERROR_METHODS[method][1],
            **({} if undefined is None else {"undefined": undefined}),
        },
    )
    return result.assign_coords(error=coord).assign_attrs(error_method=method)


def check_rules(estimator: str, rules: str | None, *, relevance: str = "relp") -> str | None:
    """The relevance rule set an estimator runs under: ``rules`` (None: ``DEFAULT_RULES``)
    for the ``relevance`` estimator, None (plain gradients) for the others.

    Raises:
        ValueError: an unknown rule set, or ``rules`` with another estimator.
    """
    if estimator != relevance:
        if rules is not None:
            raise ValueError(
                f"rules={rules!r} chooses the relevance rules of estimator={relevance!r}; "
                f"estimator={estimator!r} takes plain gradients (leave rules=None)."
            )
        return None
    return _validate.choice("rules", DEFAULT_RULES if rules is None else rules, list(RULE_SETS))


def check_relevance(
    model: LensModel, rules: str | None, *, backend: str = DEFAULTS.backend
) -> None:
    """Refuse relevance ``rules`` on a model (and backend) they cannot run on, before any
    pass.

    Raises:
        ValueError: the family or one of its modules is not one the rules support.
    """
    why = None if rules is None else unsupported(model, rules, backend=backend)
    if why is not None:
        raise ValueError(
            f"estimator='relp' (rules={rules!r}) cannot run on {model.name}: {why} "
            "Use estimator='atp' or 'ig' on it."
        )


def check_estimate(model: LensModel, options: Options) -> None:
    """``attribution_patching``'s own options: ``estimator``, ``steps`` and ``rules``
    together, and the rules against the model (``Method.checks``)."""
    _check_estimator(options.estimator, options.steps)
    check_relevance(model, check_rules(options.estimator, options.rules), backend=options.backend)


def _check_attribution(model: LensModel, options: Options) -> None:
    """``attribution_patching``'s own options: the estimate's (``check_estimate``) and
    ``error``, which takes one level (a Dataset of both would hold two ``error`` coords of
    different dims)."""
    check_estimate(model, options)
    if _validate.flag("error", options.error) and options.level == "all":
        raise ValueError(
            "error=True takes level='head' or level='block' (the error coord has the "
            "scores' dims); call once per level for both."
        )


def _check_refine(model: LensModel, options: Options) -> None:
    """``refine`` against the number of components of ``options.level``, and ``tol`` and
    ``top``, which only refine="auto" reads."""
    refine = options.refine
    spec = model.spec
    n_components = spec.n_layers * (spec.n_heads if options.level == "head" else 2)
    if isinstance(refine, str):
        if refine != "auto":
            raise ValueError(
                f"refine must be a positive integer, 'auto' or None, got {refine!r}; e.g. "
                "refine=10 (the 10 largest estimates) or refine='auto'."
            )
    elif refine is not None and _validate.positive_int("refine", refine) > n_components:
        raise ValueError(
            f"refine must be an integer from 1 to {n_components} (the number of "
            f"components at level={options.level!r}), got {refine!r}; None measures all."
        )
    if options.tol is not None:
        _validate.number("tol", options.tol, above=0)
    _validate.positive_int("top", options.top)
    chosen = [
        f"{name}={options.get(name)!r}"
        for name, default in (("tol", None), ("top", AUTO_TOP))
        if options.get(name) != default
    ]
    if refine != "auto" and chosen:
        raise ValueError(
            f"{', '.join(chosen)} choose(s) what refine='auto' measures exactly; with "
            f"refine={refine!r} they would change nothing. Pass refine='auto' or leave them "
            "at their defaults."
        )


def _check_ablation(model: LensModel, options: Options) -> None:
    """``ablation``'s own options (``Method.checks``)."""
    if not isinstance(options.kind, str) or options.kind not in ABLATION_KINDS:
        raise ValueError(
            f"Unknown ablation kind {options.kind!r}; choose one of {list(ABLATION_KINDS)}."
        )
    _check_refine(model, options)


def _check_activation_patching(model: LensModel, options: Options) -> None:
    """``activation_patching``'s own options (``Method.checks``): the estimator that ranks
    components only means something with ``refine``."""
    check_estimate(model, options)
    _check_refine(model, options)
    chosen = {
        name: options.get(name)
        for name, default in (("estimator", "atp"), ("steps", None), ("rules", None))
        if options.get(name) != default
    }
    if options.refine is None and chosen:
        given = ", ".join(f"{name}={value!r}" for name, value in chosen.items())
        raise ValueError(
            f"{given} choose(s) how refine ranks components; without refine nothing is "
            "ranked and they would change nothing. Pass refine=k to measure exactly only "
            "the k components that estimator ranks highest, or leave them at their defaults "
            "(for the estimate itself, use lsc.attribution_patching)."
        )


def _at_both_ends(points: int, rules: str | None, both: bool) -> bool:
    """Whether a patching estimate takes its gradient at the clean end too (in one stacked
    pass with the corrupt one, ``_gradients_at_both_ends``): for the trapezoid correction
    or its size (``both``: error=True or estimator="trapezoid"), with one point and rules
    that do not linearise towards the clean run (those take a plain pass instead)."""
    secant = rules is not None and RULE_SETS[rules].needs_reference
    return both and points == 1 and not secant


def _gradients_at_both_ends(
    runner, metric: str, batch: Batch, sites: list[Site], *, model: LensModel, keep: Sequence[Site]
) -> tuple[tuple[Any, dict[Site, torch.Tensor]], tuple[Any, dict[Site, torch.Tensor]]]:
    """The clean and the corrupt pass of ``batch``, each with the metric's gradient at
    ``sites``, made as one stacked pass (the clean rows, then the corrupt ones: rows never
    interact, so each half is its own pass; one pass's fixed cost instead of two, 25-43%
    less time on SmolLM2 and gemma3-270m on a 2-core CPU).

    Returns:
        ((clean run, site -> gradient), (corrupt run, site -> gradient)), as ``_gradients``
        gives each: the clean run's logits every token's, (rows, vocab); the corrupt run's
        those the metric reads; both keep ``keep`` and ``sites``.
    """
    assert batch.corrupt is not None  # patching's inputs have corrupt prompts
    rows = len(batch.index)
    both = Batch(
        index=batch.index.repeat(2),
        clean=batch.clean.stacked(batch.corrupt),
        corrupt=None,
        target=batch.target.repeat(2),
        distractor=batch.distractor.repeat(2),
    )
    run, grads = _gradients(runner, metric, both, both.clean, sites, also=keep, read_out_with=model)
    read = metrics.read_ids(metric, batch.target, batch.distractor)
    halves = []
    for part in (slice(0, rows), slice(rows, 2 * rows)):
        logits = run.logits[part]
        if part.start and read is not None:  # the corrupt run: what the metric reads
            logits = logits.gather(1, read)
        acts = {site: act[part] for site, act in run.acts.items()}
        halves.append((RunResult(logits, acts), {site: g[part] for site, g in grads.items()}))
    return halves[0], halves[1]


def _patching_estimator(
    inputs: Inputs,
    variants: list[Variant],
    *,
    steps: int,
    rules: str | None = None,
    error: bool = False,
    corrected: bool = False,
    kept: _FixedPasses | None = None,
) -> Callable[[Batch], Scores]:
    """``estimate(batch)`` -> (rows, len(variants)) gradient estimate of activation
    patching (then, with ``error``, (rows, len(variants)) more: its error estimate,
    ``ERROR_METHODS``), with whether the model answers each clean prompt correctly: the
    gradient at ``steps`` points of the input path, or at the corrupt run under relevance
    ``rules``; ``corrected``: AtP plus its trapezoid correction ("trapezoid"). With
    ``kept``, the estimate's clean and corrupt passes serve as the exact sweeps' unedited
    and clean passes of each batch (``_keep_estimate_passes``)."""
    model, runner, metric = inputs.model, get_backend(inputs.model, inputs.backend), inputs.metric
    sites = _sites(variants)
    resid_sites = [("resid_pre", layer) for layer in range(1, model.spec.n_layers)]
    secant = rules is not None and RULE_SETS[rules].needs_reference
    two_ends = _at_both_ends(steps, rules, error or corrected)

    def estimate(batch: Batch) -> Scores:
        assert batch.corrupt is not None  # inputs prepared with needs_corrupt=True
        with rules_or_plain(model, rules, backend=inputs.backend) as relevance:
            clean_sites = [INPUT_SITE, *sites] if steps > 1 else sites
            other, first, keep = None, None, resid_sites if kept is not None else []
            if two_ends:
                (clean_run, other), first = _gradients_at_both_ends(
                    runner, metric, batch, sites, model=model, keep=keep
                )
            else:
                with torch.no_grad(), clean_pass(relevance):
                    clean_run = runner.run(batch.clean, sites=clean_sites)
            clean = {site: clean_run.acts[site].detach() for site in clean_sites}

            def goal(site: Site, act: torch.Tensor) -> torch.Tensor:
                return clean[site]

            products, terms, corrupt_run = _gradient_effects(
                runner,
                metric,
                batch,
                sites,
                base=batch.corrupt,
                goal=goal,
                steps=steps,
                clean_input=clean.get(INPUT_SITE),
                error=two_ends or (error and steps > 1),
                other=other,
                keep=keep,
                first=first,
            )
            if kept is not None:
                _keep_estimate_passes(kept, metric, batch, corrupt_run, clean)
        if corrected:
            assert terms is not None  # asked for above
            products = {site: products[site] + terms[site] for site in sites}
        if not error:
            terms = None
        if error and secant:  # the disagreement with the plain gradient at the corrupt run
            plain, _, _ = _gradient_effects(
                runner, metric, batch, sites, base=batch.corrupt, goal=goal
            )
            terms = {site: plain[site] - products[site] for site in sites}
        values = _columns(products, terms, variants, batch.corrupt.attention_mask.float())
        values = metrics.check_finite(values, batch.index, metric)
        return Scores(values, top_is_target(clean_run.logits, batch.target))

    return estimate


def _keep_estimate_passes(
    kept: _FixedPasses,
    metric: str,
    batch: Batch,
    corrupt_run: Any,
    clean: dict[Site, torch.Tensor],
) -> None:
    """Keep in ``kept`` what the exact sweeps of activation patching would make a batch's
    unedited and clean passes for: the corrupt run's residual stream entering every block
    (in ``corrupt_run``'s acts) and its metric, and the clean run's site activations (the
    replacements; site -> detached activation), under the key the sweeps look them up by
    (``_fixed_key``: not for a sweep that decides whether the model answers, which needs
    the clean logits). Forward values are the no-gradient passes' up to rounding."""
    read = metrics.read_ids(metric, batch.target, batch.distractor)
    logits = corrupt_run.logits.detach()
    base = metrics.compute_read(metric, logits, batch.target, batch.distractor, read)
    # Copies: a stacked pass's halves are views that would keep the other half alive.
    resid = {s: a.detach().clone() for s, a in corrupt_run.acts.items() if s[0] == "resid_pre"}
    clean = {site: act.clone() for site, act in clean.items()}
    size = sum(a.numel() * a.element_size() for a in (*resid.values(), *clean.values()))

    def replacement(site: Site, head: int | None, rows: torch.Tensor) -> torch.Tensor:
        return clean[site][_index(head, rows)]

    passes = (RunResult(logits, resid), base, replacement, None)
    kept.put(_fixed_key(batch, read, decides_correct=False), passes, size)


def _estimates(
    inputs: Inputs, estimate: Estimate, progress: bool, desc: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """``estimate`` of every batch: (n_prompts, width) float64 in prompt-list order, and
    (n_prompts,) bool whether the model answers each clean prompt correctly (None when the
    estimate does not tell)."""
    values: torch.Tensor | None = None
    correct: torch.Tensor | None = torch.zeros(len(inputs.tokens), dtype=torch.bool)
    for batch in tqdm(inputs.batches(), total=inputs.n_batches(), disable=not progress, desc=desc):
        part, right = estimate(batch)
        if values is None:
            values = torch.full(
                (len(inputs.tokens), part.shape[1]), float("nan"), dtype=torch.float64
            )
        values[batch.index] = part.double()
        if right is None or correct is None:
            correct = None
        else:
            correct[batch.index.cpu()] = right.cpu()
    assert values is not None  # a call has at least one prompt
    return values.numpy(), None if correct is None else correct.numpy()


def _refined_columns(inputs: Inputs, estimate: Estimate, k: int, progress: bool) -> list[int]:
    """Positions (in ``components(inputs)``) of the ``k`` components whose prompt-mean
    estimate is largest in absolute value, in component order."""
    n_components = len(components(inputs))
    k = _validate.positive_int("refine", k)
    if k > n_components:
        raise ValueError(
            f"refine must be an integer from 1 to {n_components} (the number of "
            f"components at level={inputs.level!r}), got {k!r}; None measures all."
        )
    total = _estimates(inputs, estimate, progress, "ranking components")[0].sum(0)
    order = np.argsort(-np.abs(total), kind="stable")
    return sorted(int(c) for c in order[:k])


def error_bounds(errors: np.ndarray, margin: float | np.ndarray = AUTO_MARGIN) -> np.ndarray:
    """How far refine="auto" lets each estimate be off: ``margin`` (a number, or one per
    component) times its error estimate; a NaN error (not computed) counts as unbounded."""
    return np.where(np.isnan(errors), np.inf, margin * np.abs(errors))


def calibrated_margins(
    estimates: np.ndarray,
    errors: np.ndarray,
    exact: np.ndarray,
    measured: np.ndarray,
    margin: float = AUTO_MARGIN,
) -> np.ndarray:
    """Each component's margin once some of its cells are measured: the larger of
    ``margin`` and the largest ratio of actual to estimated error among its measured cells.
    Where an error estimate undershot, it often undershoots on the component's other
    prompts too (the same downstream nonlinearity): of the cells beyond tol that
    ``auto_cells`` left on 24 held-out pairs of SmolLM2 and gemma3-270m (each family,
    heads and blocks), these margins catch half (70 of 140; 1-19 of 4-33 per setting),
    before the ranking stage measures more.

    Args:
        estimates, errors, exact: (prompt, component); ``exact`` read where ``measured``.
        measured: (prompt, component) bool.

    Returns:
        (component,) margins, at least ``margin``.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.abs(exact - estimates) / np.abs(errors)
    ratios = np.where(measured & np.isfinite(ratios), ratios, 0.0)
    return np.maximum(margin, ratios.max(0, initial=0.0))


def auto_cells(
    estimates: np.ndarray,
    errors: np.ndarray,
    *,
    tol: float | None = None,
    margin: float = AUTO_MARGIN,
) -> tuple[np.ndarray, float]:
    """The cells refine="auto" measures first: those whose estimate could be off by more
    than ``tol`` (margin * error > tol; a NaN error always).

    Args:
        estimates, errors: (prompt, component) the fast estimates and their error estimates.
        tol: tolerance in the estimates' units; None: ``AUTO_TOL`` times the largest
            |estimate|.

    Returns:
        ((prompt, component) bool, the tolerance used).
    """
    largest = float(np.abs(estimates).max()) if estimates.size else 0.0
    tol = AUTO_TOL * largest if tol is None else float(tol)
    return error_bounds(errors, margin) > tol, tol


def ranking_cells(
    values: np.ndarray, bounds: np.ndarray, measured: np.ndarray, *, top: int = AUTO_TOP
) -> np.ndarray:
    """The cells refine="auto" measures second: the cells not yet measured of every
    component whose membership of the ``top`` components by |prompt-mean| is in doubt.

    With b the prompt-mean of the bounds of the cells not yet measured (measured ones are
    exact), a component's |mean| lies in [|mean| - b, |mean| + b]; it is surely in the top
    when fewer than ``top`` others could reach its lower end, surely out when ``top`` others
    surely exceed its upper end, and in doubt otherwise.

    Args:
        values: (prompt, component) exact where ``measured``, the estimates elsewhere.
        bounds: (prompt, component) ``error_bounds`` of the estimates.
        measured: (prompt, component) bool, the cells measured so far.
        top: how many components the ranking must get right (at most the number of them).

    Returns:
        (prompt, component) bool.
    """
    spread = np.where(measured, 0.0, bounds).mean(0)
    mean = np.abs(values.mean(0))
    low, high = np.maximum(mean - spread, 0.0), mean + spread
    top = min(top, len(mean))
    # (component, other): whether the other could reach / surely exceeds the component.
    could_reach = high[None, :] >= low[:, None]
    np.fill_diagonal(could_reach, False)
    surely_in = could_reach.sum(1) < top
    surely_out = (low[None, :] > high[:, None]).sum(1) >= top
    in_doubt = ~(surely_in | surely_out)
    return in_doubt[None, :] & ~measured


def _measured(
    inputs: Inputs,
    scorer_for: ScorerFor,
    cells: np.ndarray,
    correct: np.ndarray | None,
    progress: bool,
) -> np.ndarray:
    """Exact values of ``cells`` ((prompt, component) bool), NaN elsewhere: one sweep over
    the batches that hold any (``scorer_for(cells, correct)``, ``_sweep_scorer``'s score;
    ``correct`` as there)."""
    values = np.full(cells.shape, np.nan)
    if not cells.any():
        return values
    score = scorer_for(
        torch.as_tensor(cells), None if correct is None else torch.as_tensor(correct)
    )
    batches = [b for b in inputs.batches() if cells[b.index.cpu().numpy()].any()]
    for batch in tqdm(batches, disable=not progress, desc="measuring beyond tol"):
        values[batch.index.cpu().numpy()] = score(batch, lambda: None).values.double().numpy()
    return values


def _auto_refinement(
    inputs: Inputs,
    estimate: Estimate,
    scorer_for: ScorerFor,
    tol: float | None,
    top: int,
    progress: bool,
) -> dict[str, Any]:
    """The pre-pass of ``refine="auto"``: every cell's estimate and error estimate
    ((prompt, component) float32, ``estimate`` giving both side by side); the cells off by
    more than tol (``auto_cells``), measured here (``scorer_for``), and their exact values
    (NaN elsewhere); then the cells the plan's sweep measures (``cells``): those off by more
    than tol under the margins those measurements calibrate (``calibrated_margins``;
    ``beyond``) and those the ranking needs (``ranking_cells``); the tolerance used; and
    whether the model answers each clean prompt correctly, when the estimate tells (then the
    sweeps skip the full unembedding)."""
    n = len(components(inputs))
    values, correct = _estimates(inputs, estimate, progress, "estimating errors")
    estimates, errors = values[:, :n], values[:, n:]
    first, tol_used = auto_cells(estimates, errors, tol=tol)
    exact = _measured(inputs, scorer_for, first, correct, progress)
    bounds = error_bounds(errors, calibrated_margins(estimates, errors, exact, first))
    beyond = (bounds > tol_used) & ~first
    known = np.where(first, exact, estimates)
    second = ranking_cells(known, bounds, first, top=top)
    return {
        "estimates": estimates.astype(np.float32),
        "errors": errors.astype(np.float32),
        "first": first,
        "exact": exact.astype(np.float32),
        "beyond": beyond,
        "cells": second | beyond,
        "tol": tol_used,
        "correct": correct,
    }


def _refined_cells(
    call: Call,
    inputs: Inputs,
    estimate_with: Callable[[bool], Estimate],
    scorer_for: ScorerFor,
    ranking: tuple[str, int, str],
) -> tuple[torch.Tensor | None, dict[str, Any] | None, dict[str, Any]]:
    """The cells the plan's sweep measures ((prompt, component) bool; None: all), the
    pre-pass of refine="auto" (``_auto_refinement``; None otherwise), and the attrs
    recording it; the pre-pass is kept in the plan's ``prepass``.

    Args:
        estimate_with: ``(error) -> estimate(batch)``, the gradient estimate that picks
            cells (``Estimate``): (rows, n_components), then with ``error`` (rows,
            n_components) error estimates.
        scorer_for: ``(cells, correct) -> score``, the exact sweep of those cells.
        ranking: that estimate's (estimator, steps, ``ERROR_METHODS`` name), for attrs.
    """
    options, prepass, progress = call.options, call.prepass, call.progress
    refine, (estimator, points, _) = options.refine, ranking
    n_components = len(components(inputs))
    if refine is None:
        return None, None, {}
    params: dict[str, Any] = {"refine_estimator": estimator, "refine_steps": points}
    if refine != "auto":
        columns = once(
            prepass,
            "columns",
            lambda: _refined_columns(inputs, estimate_with(False), refine, progress),
        )
        cells = torch.zeros(len(inputs.tokens), n_components, dtype=torch.bool)
        cells[:, columns] = True
        return cells, None, {"refined_k": refine, **params}
    top = min(int(options.top), n_components)
    auto = once(
        prepass,
        "auto",
        lambda: _auto_refinement(
            inputs, estimate_with(True), scorer_for, options.tol, top, progress
        ),
    )
    n_first, n_second = int(auto["first"].sum()), int(auto["cells"].sum())
    n_beyond = int(auto["beyond"].sum())
    return (
        torch.as_tensor(auto["cells"]),
        auto,
        {
            "refine": "auto",
            "refine_top": top,
            "refine_tol": auto["tol"],
            "refine_margin": AUTO_MARGIN,
            "refine_measured": n_first + n_second,
            "refine_measured_for_tol": n_first + n_beyond,
            "refine_measured_for_top": n_second - n_beyond,
            "refine_cells": int(auto["cells"].size),
            "refine_rule": AUTO_RULE,
            **params,
        },
    )


def _with_estimates(finish: Callable, auto: dict[str, Any], error_name: str) -> Callable:
    """``finish`` of a refine="auto" plan: the pre-pass's exact values where it measured,
    the sweep's where the sweep did, the estimates (and their error estimates, as
    ``with_error``) elsewhere, and the coord ``measured``."""

    def finished(values, correct, index):
        rows = slice(None) if index is None else np.asarray(index, dtype=np.int64)
        first, second = auto["first"][rows], auto["cells"][rows]
        filled = np.where(
            second,
            np.asarray(values, dtype=np.float32),
            np.where(first, auto["exact"][rows], auto["estimates"][rows]),
        )
        measured = first | second
        result = with_error(
            finish(filled, correct, index),
            np.where(measured, 0.0, auto["errors"][rows]),
            error_name,
        )
        return result.assign_coords(measured=(result.dims, measured.reshape(result.shape)))

    return finished


def _exact_plan(
    call: Call,
    inputs: Inputs,
    sweep: tuple[str, Callable],
    estimate_with: Callable[[bool, _FixedPasses | None], Estimate],
    *,
    ranking: tuple[str, int, str],
    desc: str,
    method: str,
    effect: str,
    **params: Any,
) -> Plan[xr.DataArray]:
    """The plan of an exact sweep (one progress step per block), of the cells ``refine``
    picks (``_refined_cells``: ``estimate_with`` and ``ranking`` as there).

    Args:
        sweep: ``_sweep_scorer``'s (source, replacement_for).
        estimate_with: ``(error, kept) -> estimate(batch)``; with refine="auto" its passes
            may fill ``kept``, the sweeps' fixed passes (``_FixedPasses``).
    """
    source, replacement_for = sweep
    # refine="auto" sweeps twice over batches: its fixed passes are kept in a quarter of
    # the memory left (beside the plan's own share).
    kept = None
    if call.options.refine == "auto":
        kept = _FixedPasses(memory.available_bytes(inputs.model.device) // 4)

    def scorer_for(
        cells: torch.Tensor | None, correct: torch.Tensor | None
    ) -> Callable[[Batch, Callable], Scores]:
        return _sweep_scorer(
            inputs,
            source=source,
            replacement_for=replacement_for,
            variants_per_pass=call.options.variants_per_pass,
            cells=cells,
            correct=correct,
            kept=kept,
        )

    cells, auto, refined = _refined_cells(
        call, inputs, lambda error: estimate_with(error, kept), scorer_for, ranking
    )
    known = None if auto is None else auto["correct"]  # the estimate's clean pass, if it told
    score = scorer_for(cells, None if known is None else torch.as_tensor(known))
    plan = one_level_plan(
        inputs,
        score,
        desc=desc,
        method=method,
        effect=effect,
        steps_per_batch=call.model.spec.n_layers,
        prepass=call.prepass,
        **params,
        **refined,
    )
    if auto is None:
        return plan
    return dataclasses.replace(plan, finish=_with_estimates(plan.finish, auto, ranking[2]))


# -------------------------------------------------------------------------------- memory


def _site_width(model: LensModel, level: str) -> int:
    """Numbers per token of every site a ``level`` sweep or estimate reads (z: n_heads x
    d_head per layer; blocks: the attention and MLP outputs, 2 x d_model per layer)."""
    spec = model.spec
    per_layer = {"head": spec.n_heads * spec.d_head, "block": 2 * spec.d_model}
    heads_and_blocks = per_layer["head"] + per_layer["block"]
    return spec.n_layers * (heads_and_blocks if level == "all" else per_layer[level])


def _estimate_need(
    model: LensModel,
    work: memory.Work,
    level: str,
    points: int,
    error: bool = False,
    *,
    both_ends: bool = False,
) -> memory.Need:
    """What a gradient estimate of one batch holds: the clean pass's sites (and the input
    site with ``points`` > 1), then the graph of a pass with a backward and the sites'
    gradients (``both_ends``: the clean and corrupt rows in one stacked pass,
    ``_gradients_at_both_ends``), then float32 products over the sites
    (``_gradient_effects``; with ``error`` two more: the other end's gradient or the coarse
    rule's sum, and the error terms)."""
    tokens = work.rows * work.width
    width = _site_width(model, level) + (model.spec.d_model if points > 1 else 0)
    sites = tokens * width * memory.element_bytes(model.dtype)
    stacked = 2 if both_ends else 1
    backward = memory.Need(
        activations=memory.gradient_pass(model, stacked * work.rows, work.width),
        buffers=2 * stacked * sites,
    )
    products = memory.Need(buffers=2 * sites + (5 if error else 3) * tokens * width * 4)
    return memory.largest(backward, products)


def _sweep_need(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """What an exact sweep of one batch holds: the residual stream entering every block
    (kept by the unedited pass) and a pass of ``variants_per_pass`` stacked copies (by
    default one block's components, as many as memory allows)."""
    spec, e = model.spec, memory.element_bytes(model.dtype)
    # One block's components: a pass of a sparse sweep (refine) packs as many rows.
    wanted = spec.n_heads if options.get("level", "head") == "head" else 2
    copies = options.get("variants_per_pass") or memory.auto_variants_per_pass(
        model, rows=work.rows, width=work.width, wanted=wanted
    )
    resid = work.rows * work.width * spec.d_model * e
    stacked = memory.forward_pass(model, copies * work.rows, work.width)
    return memory.Need(activations=stacked, buffers=(spec.n_layers + copies) * resid)


def _result_need(model: LensModel, level: str, work: memory.Work) -> memory.Need:
    """The (prompt, component) float32 result of every prompt, held in memory."""
    spec = model.spec
    columns = {"head": spec.n_heads, "block": 2, "all": spec.n_heads + 2}[level]
    return memory.Need(buffers=work.n_prompts * spec.n_layers * columns * 4)


def ablation_memory(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """Footprint of ``ablation``: its exact sweep, or its ranking pass (``refine``) when
    that holds more. Options a call did not give are taken at their defaults."""
    level = options.get("level", "head")
    need = _sweep_need(model, options, work)
    if options.get("refine") is not None:
        auto = options.get("refine") == "auto"
        need = memory.largest(need, _estimate_need(model, work, level, 1, auto))
    return need + _result_need(model, level, work)


def activation_patching_memory(
    model: LensModel, options: Options, work: memory.Work
) -> memory.Need:
    """Footprint of ``activation_patching``: its exact sweep with the clean run's sites
    kept, or its ranking pass (``refine``) when that holds more. Options a call did not give
    are taken at their defaults. (refine="auto" also keeps each batch's fixed passes for its
    second sweep, outside this footprint, in at most a quarter of the memory left:
    ``_FixedPasses``.)"""
    e, level = memory.element_bytes(model.dtype), options.get("level", "head")
    clean = work.rows * work.width * _site_width(model, level) * e
    need = _sweep_need(model, options, work) + memory.Need(buffers=clean)
    if options.get("refine") is not None:
        estimator = options.get("estimator", ESTIMATORS[0])
        points = _check_estimator(estimator, options.get("steps"))
        auto = options.get("refine") == "auto"
        stacked = _at_both_ends(points, check_rules(estimator, options.get("rules")), auto)
        estimate = _estimate_need(model, work, level, points, auto, both_ends=stacked)
        need = memory.largest(need, estimate)
    return need + _result_need(model, level, work)


def attribution_patching_memory(
    model: LensModel, options: Options, work: memory.Work
) -> memory.Need:
    """Footprint of ``attribution_patching``: one gradient estimate per batch (and the error
    estimates beside the result, with ``error``). Options a call did not give are taken at
    their defaults."""
    level = options.get("level", "head")
    estimator = options.get("estimator", ESTIMATORS[0])
    points = _check_estimator(estimator, options.get("steps"))
    error = bool(options.get("error", False))
    both = error or estimator == "trapezoid"
    stacked = _at_both_ends(points, check_rules(estimator, options.get("rules")), both)
    need = _estimate_need(model, work, level, points, both, both_ends=stacked)
    need = need + _result_need(model, level, work)
    return need + _result_need(model, level, work) if error else need


# ------------------------------------------------------------------------------ ablation


def _ablation_targets(
    inputs: Inputs, variants: list[Variant], kind: str, prepass: dict[str, Any], progress: bool
) -> tuple[Callable, Callable]:
    """What an ablation replaces a component with: ``goal(site, act)`` (the replacement of
    a whole activation, for the ranking pass of ``refine``) and ``replacement_for(batch)``
    (as ``_sweep_scorer`` takes it); the means of kind="mean" are kept in ``prepass``."""
    if kind == "zero":
        return (lambda site, act: torch.zeros_like(act)), (
            lambda batch, whole_vocab: ((lambda s, h, rows: 0.0), None)
        )
    cpu_means = once(
        prepass,
        "means",
        lambda: {s: m.cpu() for s, m in _site_means(inputs, _sites(variants), progress).items()},
    )
    means = {site: mean.to(inputs.model.device) for site, mean in cpu_means.items()}

    def replacement_for(batch, whole_vocab):
        return (lambda site, head, rows: means[site] if head is None else means[site][head]), None

    return (lambda site, act: means[site].expand_as(act)), replacement_for


def plan_ablation(call: Call) -> Plan[xr.DataArray]:
    """``ablation`` as a plan: one exact sweep per batch (after the means, for kind="mean",
    and the ranking pass, with ``refine``; both kept in the plan's ``prepass``)."""
    model, tokens, options = call.model, call.tokens, call.options
    kind = options.kind
    inputs = batched(model, tokens, options)
    variants = components(inputs)
    sites = _sites(variants)
    goal, replacement_for = _ablation_targets(inputs, variants, kind, call.prepass, call.progress)
    runner = get_backend(model, options.backend)

    def replaced_everywhere(site: Site, value: torch.Tensor) -> torch.Tensor:
        # The replacement's value, with the gradient passing through to ``value``.
        return value - value.detach() + goal(site, value.detach())

    # ``kept`` unused: the sweeps run on the clean prompts, whose unedited pass must say
    # whether the model answers (every token unembedded) where this estimate cannot.
    def estimate_with(error: bool, kept: _FixedPasses | None) -> Estimate:
        def estimate(batch: Batch) -> tuple[torch.Tensor, None]:
            other: dict[Site, torch.Tensor] | None = None
            if error:  # the gradient at the other end: every component replaced
                _, other = _gradients(
                    runner, options.metric, batch, batch.clean, sites, edit=replaced_everywhere
                )
            products, terms, _ = _gradient_effects(
                runner,
                options.metric,
                batch,
                sites,
                base=batch.clean,
                goal=goal,
                error=error,
                other=other,
            )
            return _columns(products, terms, variants, batch.clean.attention_mask.float()), None

        return estimate

    return _exact_plan(
        call,
        inputs,
        ("clean", replacement_for),
        estimate_with,
        ranking=("atp", 1, "trapezoid"),
        desc=f"{kind}-ablation",
        method=f"{kind}_ablation",
        effect=f"{kind.capitalize()}-ablation effect on",
        kind=kind,
    )


@method(plan_ablation, levels=LEVELS, shared=EXACT, memory=ablation_memory, checks=_check_ablation)
def ablation(
    model: LensModel,
    prompts: Prompts,
    *,
    kind: str = "zero",
    refine: int | str | None = None,
    tol: float | None = None,
    top: int = AUTO_TOP,
    **shared,
) -> xr.DataArray:
    """Exact ablation of every head or block: metric(ablated) - metric(clean), per prompt.

    Args:
        kind: "zero" or "mean" (mean over all real tokens of the prompt set).
        refine: an integer k: measure exactly only the k components whose first-order
            estimate grad_clean(metric) . (replacement - clean activation), averaged over
            prompts, is largest in absolute value; the others are NaN. "auto": measure
            exactly the cells whose estimate could be off by more than ``tol`` or could
            change the ``top`` components, and keep the estimate elsewhere (as
            ``activation_patching``'s; the error estimate's other end is the run with every
            component ablated, one forward and one backward pass more). None: all.
        tol, top: what refine="auto" keeps exact (see ``activation_patching``).

    Returns:
        DataArray of metric changes (negative: the component helps the metric).
    """
    return run(ablation, locals())


# ------------------------------------------------------------------- activation patching


def plan_activation_patching(call: Call) -> Plan[xr.DataArray]:
    """``activation_patching`` as a plan: one exact sweep per batch (after the ranking
    pass, with ``refine``, kept in the plan's ``prepass``)."""
    model, tokens, options = call.model, call.tokens, call.options
    points = _check_estimator(options.estimator, options.steps)
    rules = check_rules(options.estimator, options.rules)
    inputs = batched(model, tokens, options)
    runner = get_backend(model, options.backend)
    variants = components(inputs)
    sites = _sites(variants)

    def estimate_with(error: bool, kept: _FixedPasses | None) -> Estimate:
        estimate = _patching_estimator(
            inputs,
            variants,
            steps=points,
            rules=rules,
            error=error,
            corrected=options.estimator == "trapezoid",
            kept=kept,
        )

        def values_and_correct(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            scores = estimate(batch)
            return scores.values, scores.correct

        return values_and_correct

    def replacement_for(batch, whole_vocab):  # called under no_grad
        # Without whole_vocab the logits are not read: unembed one token, not all.
        vocab = None if whole_vocab else batch.target[:, None]
        clean = runner.run(batch.clean, sites=sites, vocab=vocab)
        logits = clean.logits if whole_vocab else None
        return (lambda site, head, rows: clean.acts[site][_index(head, rows)]), logits

    return _exact_plan(
        call,
        inputs,
        ("corrupt", replacement_for),
        estimate_with,
        ranking=(options.estimator, points, error_method(options.estimator, points, rules)),
        desc="activation patching",
        method="activation_patching",
        effect="Patching effect (clean -> corrupt) on",
    )


@method(
    plan_activation_patching,
    levels=LEVELS,
    needs_corrupt=True,
    shared=EXACT,
    memory=activation_patching_memory,
    checks=_check_activation_patching,
)
def activation_patching(
    model: LensModel,
    prompts: Prompts,
    *,
    refine: int | str | None = None,
    estimator: str = "atp",
    steps: int | None = None,
    rules: str | None = None,
    tol: float | None = None,
    top: int = AUTO_TOP,
    **shared,
) -> xr.DataArray:
    """Exact activation patching (clean -> corrupt): metric(patched) - metric(corrupt).

    Each prompt's corrupt run gets one component's clean activation (all positions).
    Every prompt needs a ``corrupt`` text of equal token length.

    Args:
        refine: measure exactly only the ``refine`` components whose prompt-mean
            ``attribution_patching`` estimate is largest in absolute value; the others are
            NaN ("not computed"). Attrs record ``refined_k``, ``refine_estimator`` and
            ``refine_steps``. "auto": estimate every cell and its error
            (``attribution_patching(..., error=True)``), measure exactly the cells whose
            estimate, off by up to ``AUTO_MARGIN`` error estimates, could be wrong by more
            than ``tol`` (``auto_cells``); then, with each component's margin raised to
            the largest actual / estimated error among its measured cells
            (``calibrated_margins``), its other cells that could be wrong by more than
            ``tol``, and the other cells of the components whose membership of the
            ``top`` by |prompt-mean| is still in doubt (``ranking_cells``); the other
            cells keep the estimate. Coords ``measured``
            (bool, the scores' dims) and ``error`` (0 where measured); attrs
            ``refine_measured`` of ``refine_cells`` (``refine_measured_for_tol`` and
            ``_for_top``), ``refine_tol``, ``refine_top``, ``refine_margin``,
            ``refine_rule``. None: all components.
        estimator, steps, rules: the estimator that ranks components for ``refine`` (see
            ``attribution_patching``). With either, refine="auto" keeps 99.1-100% of
            cells within 5% of the largest exact effect (benchmarks/RESULTS.md,
            error_estimates); AtP's error estimates run low at level="block", where the
            calibrated margins measure more. refine="auto" pays off on heads (with AtP
            0.10-0.13 of a full sweep's time on SmolLM2, 0.29 on gemma3-270m); a full
            sweep of blocks is cheap (two components a layer), and refine="auto" costs
            0.41-0.98 of one there.
        tol: refine="auto"'s tolerance, in the metric's units (> 0); None: ``AUTO_TOL``
            (5%) of the largest |estimate| of the call.
        top: refine="auto" measures every component whose membership of the ``top`` by
            |prompt-mean| is in doubt (at most the number of components).

    Returns:
        DataArray (prompt, layer, head) or (prompt, layer, component); positive: the
        component carries the clean answer.
    """
    return run(activation_patching, locals())


# ------------------------------------------------------------------ attribution patching


def plan_attribution_patching(call: Call) -> Plan[Result]:
    """``attribution_patching`` as a plan: one gradient estimate per batch, of every
    component of ``options.level`` ("all": head and block level side by side). It has no
    pre-pass: ``prepass`` is accepted like every planner's and stays empty."""
    model, tokens, options = call.model, call.tokens, call.options
    estimator, level = options.estimator, options.level
    points = _check_estimator(estimator, options.steps)
    levels = ("head", "block") if level == "all" else (level,)
    first = batched(model, tokens, options, level=levels[0])
    inputs_by_level = {lvl: dataclasses.replace(first, level=lvl) for lvl in levels}
    widths = [len(components(inputs_by_level[lvl])) for lvl in levels]
    rules = check_rules(estimator, options.rules)
    error = options.error
    estimate = _patching_estimator(
        first,
        [variant for lvl in levels for variant in components(inputs_by_level[lvl])],
        steps=points,
        rules=rules,
        error=error,
        corrected=estimator == "trapezoid",
    )

    def score(batch: Batch, step) -> Scores:
        scores = estimate(batch)
        step()
        return scores

    name = _estimator_name(estimator, points, rules)

    def finish(values, correct, index):
        results, start = {}, 0
        for lvl, width in zip(levels, widths, strict=True):
            results[lvl] = to_dataarray(
                inputs_by_level[lvl],
                values[:, start : start + width],
                correct=correct,
                method="attribution_patching",
                effect=f"{name} (clean -> corrupt) of",
                index=index,
                estimator=estimator,
                steps=points,
                **({} if rules is None else {"rules": rules}),
            )
            if error:  # the error estimates follow the estimates (``_patching_estimator``)
                errors = values[:, sum(widths) + start : sum(widths) + start + width]
                results[lvl] = with_error(
                    results[lvl], errors, error_method(estimator, points, rules)
                )
            start += width
        if level != "all":
            return results[level]
        # Plural names: a variable named like its own "head" dim would become a coordinate.
        return xr.Dataset({"heads": results["head"], "blocks": results["block"]})

    return Plan(
        first,
        sum(widths) * (2 if error else 1),
        score,
        finish,
        desc=name.lower(),
    )


@method(
    plan_attribution_patching,
    levels=(*LEVELS, "all"),
    needs_corrupt=True,
    shared=LEVELLED,
    memory=attribution_patching_memory,
    checks=_check_attribution,
)
def attribution_patching(
    model: LensModel,
    prompts: Prompts,
    *,
    estimator: str = "atp",
    steps: int | None = None,
    rules: str | None = None,
    error: bool = False,
    **shared,
) -> Result:
    """Gradient estimate of activation patching for every component at once.

    ``estimator="atp"``: score = sum_pos grad_corrupt(metric) . (clean - corrupt activation),
    from one clean forward, one corrupt forward and one backward per batch.
    ``estimator="ig"``: the gradient averaged over ``steps`` points a_k = k / steps of the
    path from the corrupt to the clean input (the residual stream entering block 0), as in
    EAP-IG (arXiv 2403.17806): score = sum_pos mean_k grad_{x(a_k)}(metric) . (clean -
    corrupt activation); ``steps`` forward + backward passes; ``steps=1`` equals "atp".
    ``estimator="relp"``: relevance patching (RelP, arXiv 2508.21258): score = sum_pos
    (clean - corrupt activation) . the metric's gradient at the corrupt run taken through a
    backward pass whose rules are changed module by module (``sweep/relevance.py``): the
    cost of "atp". ``estimator="trapezoid"``: AtP plus its estimated second-order term,
    score = sum_pos 1/2 (grad_corrupt + grad_clean)(metric) . (clean - corrupt activation)
    (the trapezoid rule; the gradient difference is a finite-difference Hessian-vector
    product along the corrupt -> clean change): one backward pass more than "atp".
    ``lsc.faithfulness`` measures how well each agrees with exact patching.

    Args:
        level: "head", "block", or "all" (both, returned as a Dataset with variables
            ``heads`` and ``blocks``).
        estimator: "atp", "ig", "relp" or "trapezoid".
        steps: integration points for "ig" (default ``DEFAULT_IG_STEPS``); "atp" and "relp"
            take 1.
        rules: the relevance rules of "relp" (``sweep/relevance.RULE_SETS``; None:
            ``DEFAULT_RULES``, RelP's own: RMSNorm scale held, identity rule through the MLP
            non-linearity, half rule through gate x up). "secant" linearises every
            operation between the corrupt and the clean run (a clean reference pass, about
            1.2x "atp"'s time); "secant-0.9" over the first 90% of each operation's change,
            at the same cost, agrees best with exact patching on MLPs.
        error: also estimate each cell's error: a coord ``error`` with the scores' dims and
            units, >= 0, its method and cost in the coord's attrs (``ERROR_METHODS``;
            ``error_method`` in the result's attrs). "atp": the trapezoid correction, one
            backward pass more; "ig" with 2+ steps: the coarse rule, free; "relp": the
            trapezoid correction under the rules (one backward pass more) or, for rules that
            linearise towards the clean run ("secant"), the gap to "atp" (one forward and
            one backward pass more); "trapezoid": the size of its correction (free). Not
            with level="all".

    Returns:
        DataArray (prompt, layer, head | component), or a Dataset for level="all".
    """
    return run(attribution_patching, locals())
