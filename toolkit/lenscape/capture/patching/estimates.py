"""Gradient estimates of a patching effect, for every component at once, and their
error estimates (``ERROR_METHODS``; the package docstring says what each is).

``_gradient_effects`` gives per-site, per-position products grad . (goal - activation)
(and the error terms); ``_columns`` sums them over positions into (batch, component)
columns; ``_patching_estimator`` is activation patching's estimate of one batch (AtP,
integrated gradients, RelP, the trapezoid rule), ``with_error`` labels its errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from ...models import LensModel
from ...sweep import metrics
from ...sweep.backend import HEAD_SITES, RunResult, Site, TokenBatch, get_backend
from ...sweep.inputs import Batch, Inputs
from ...sweep.plan import Scores, top_is_target
from ...sweep.relevance import RULE_SETS, clean_pass, rules_or_plain
from ..attention import eager_attention
from ..lens import read_out
from .checks import DEFAULT_RULES
from .exact import Variant, _fixed_key, _FixedPasses, _index, _sites
from .pattern import pattern_sites, swapped_output, value_sites

#: Where integrated gradients interpolates: the residual stream entering block 0.
INPUT_SITE: Site = ("resid_pre", 0)
#: The residual stream entering the final norm, (batch, pos, d_model).
FINAL_SITE: Site = ("resid_final", -1)
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


def _gradient_effects(
    runner,
    metric: str,
    batch: Batch,
    sites: list[Site],
    *,
    base: TokenBatch,
    goal: Callable[[Site, torch.Tensor, dict[Site, torch.Tensor]], torch.Tensor],
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
        goal: ``(site, base activation, the base run's kept activations) -> replacement
            activation``, the activation's shape.
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
                deltas[site] = (goal(site, act, run.acts) - act).float()
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
    # Once each: the input site is also a site of level "resid" (an edit applied twice
    # would interpolate twice).
    wanted = list(dict.fromkeys([*also, *sites, *final]))
    run = runner.run(tokens, sites=wanted, edit=edit, grad=True, vocab=read)
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
    """Sum per-site products over real positions (or over each position cell's) into
    (batch, len(variants)) columns.

    Args:
        products: site -> (batch, pos, head, d_head) for "z" sites, (batch, pos, d_model)
            for blocks and the residual stream.
        mask: (batch, pos) 1 at real tokens, or (batch, pos, n_cells) the batch's cell map
            (``Batch.cells``): then each component's cells, cells last.
    """
    columns = []
    by_cell = mask.ndim == 3
    for site in _sites(variants):
        product = products[site]
        per_head = site[0] in HEAD_SITES
        if per_head and by_cell:  # (batch, pos, head, d_head) -> (batch, head * cell)
            columns.append(torch.einsum("bphd,bpc->bhc", product, mask).flatten(1))
        elif per_head:  # (batch, pos, head, d_head) -> (batch, head)
            columns.append(torch.einsum("bphd,bp->bh", product, mask))
        elif by_cell:  # (batch, pos, d_model) -> (batch, cell)
            columns.append(torch.einsum("bpd,bpc->bc", product, mask))
        else:  # (batch, pos, d_model) -> (batch, 1)
            columns.append(torch.einsum("bpd,bp->b", product, mask)[:, None])
    return torch.cat(columns, dim=1)


def cell_weights(batch: Batch, tokens: TokenBatch) -> torch.Tensor:
    """What ``_columns`` sums a batch's per-position products with: its cell map
    (``Batch.cells``), or with ``positions="all"`` the real tokens of ``tokens``."""
    return tokens.attention_mask.float() if batch.cells is None else batch.cells


def _columns(
    products: dict[Site, torch.Tensor],
    terms: dict[Site, torch.Tensor] | None,
    variants: list[Variant],
    mask: torch.Tensor,
) -> torch.Tensor:
    """(batch, len(variants)) estimates on the CPU, then, with error ``terms``
    (``_gradient_effects``), (batch, len(variants)) error estimates: |terms summed over
    real positions| (or over each cell's, ``mask`` as in ``_component_columns``)."""
    values = _component_columns(products, variants, mask)
    if terms is not None:
        values = torch.cat([values, _component_columns(terms, variants, mask).abs()], dim=1)
    return values.cpu()


def checked_columns(
    products: dict[Site, torch.Tensor],
    terms: dict[Site, torch.Tensor] | None,
    variants: list[Variant],
    batch: Batch,
    tokens: TokenBatch,
    metric: str,
) -> torch.Tensor:
    """``_columns`` of one batch summed with ``cell_weights(batch, tokens)``, checked to be
    finite, then NaN in the position cells a row holds no token of (not computed)."""
    weights = cell_weights(batch, tokens)
    values = metrics.check_finite(_columns(products, terms, variants, weights), batch.index, metric)
    if batch.cells is None:
        return values
    held = (weights.sum(1) > 0).cpu()  # (rows, n_cells)
    return torch.where(held.repeat(1, values.shape[1] // held.shape[1]), values, float("nan"))


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


def _patching_goal(
    model: LensModel, clean: dict[Site, torch.Tensor], pattern: bool
) -> tuple[Callable, dict[Site, torch.Tensor]]:
    """What activation patching's estimate moves each site towards (``_gradient_effects``'s
    ``goal``): the clean run's activation ``clean[site]`` or, with ``pattern``, the head
    outputs of the clean patterns ``clean[("pattern", layer)]`` over the corrupt run's
    values (``capture/patching/pattern``), kept in the returned dict as they are made."""
    replaced: dict[Site, torch.Tensor] = {}

    def goal(site: Site, act: torch.Tensor, acts: dict[Site, torch.Tensor]) -> torch.Tensor:
        if not pattern:
            return clean[site]
        values = acts[("v", site[1])].detach()
        replaced[site] = swapped_output(model.spec, clean[("pattern", site[1])], values)
        return replaced[site]

    return goal, replaced


# long: one closure per batch: its clean end (plain, both ends, patterns), goal and error terms
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

    pattern = inputs.part == "pattern"  # the goal: the clean patterns over the corrupt values

    def estimate(batch: Batch) -> Scores:
        assert batch.corrupt is not None  # inputs prepared with needs_corrupt=True
        with rules_or_plain(model, rules, backend=inputs.backend) as relevance:
            clean_sites = list(dict.fromkeys([INPUT_SITE, *sites])) if steps > 1 else sites
            other, first, keep = None, None, resid_sites if kept is not None else []
            if two_ends:
                (clean_run, other), first = _gradients_at_both_ends(
                    runner, metric, batch, sites, model=model, keep=keep
                )
            elif pattern:  # plain AtP only (``check_part``)
                clean_sites = pattern_sites(model.spec)
                with torch.no_grad(), eager_attention(model):
                    clean_run = runner.run(batch.clean, sites=clean_sites)
                keep = [*keep, *value_sites(model.spec)]
            else:
                with torch.no_grad(), clean_pass(relevance):
                    clean_run = runner.run(batch.clean, sites=clean_sites)
            clean = {site: clean_run.acts[site].detach() for site in clean_sites}
            goal, replaced = _patching_goal(model, clean, pattern)
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
                _keep_estimate_passes(kept, metric, batch, corrupt_run, replaced or clean)
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
        values = checked_columns(products, terms, variants, batch, batch.corrupt, metric)
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
