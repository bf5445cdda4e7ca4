"""``activation_patching``: exact patching (clean -> corrupt, "denoising"): the corrupt
prompt's run with one component's clean activation patched in; score = metric(patched) -
metric(corrupt)."""

from __future__ import annotations

import torch
import xarray as xr

from ...data import Prompts
from ...models import LensModel
from ...sweep.backend import get_backend
from ...sweep.inputs import Batch, batched
from ...sweep.options import POSITIONAL_EXACT, Options
from ...sweep.plan import Call, Plan
from ...sweep.registry import method, run
from ...sweep.result import NODE_LEVELS
from ..attention import eager_attention
from .checks import _check_estimator, check_estimate, check_part, check_positions, check_rules
from .estimates import _patching_estimator, error_method
from .exact import _FixedPasses, _index, _sites, variants_of
from .needs import activation_patching_memory
from .pattern import pattern_sites, swapped_outputs, value_sites
from .refine import (
    AUTO_TOP,
    Estimate,
    _check_refine,
    _exact_plan,
)


def _check_activation_patching(model: LensModel, options: Options) -> None:
    """``activation_patching``'s own options (``Method.checks``): the estimator that ranks
    components only means something with ``refine``."""
    check_estimate(model, options)
    check_positions(options)
    check_part(model, options)
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


def plan_activation_patching(call: Call) -> Plan[xr.DataArray]:
    """``activation_patching`` as a plan: one exact sweep per batch (after the ranking
    pass, with ``refine``, kept in the plan's ``prepass``)."""
    model, tokens, options = call.model, call.tokens, call.options
    points = _check_estimator(options.estimator, options.steps)
    rules = check_rules(options.estimator, options.rules)
    inputs = batched(model, tokens, options)
    runner = get_backend(model, options.backend)
    variants = variants_of(inputs)
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
        if inputs.part == "pattern":  # the clean patterns over the corrupt run's values
            with eager_attention(model):
                clean = runner.run(batch.clean, sites=pattern_sites(model.spec), vocab=vocab)
            values = runner.run(batch.corrupt, sites=value_sites(model.spec), vocab=vocab).acts
            replaced = swapped_outputs(model.spec, clean.acts, values)
        else:
            clean = runner.run(batch.clean, sites=sites, vocab=vocab)
            replaced = clean.acts
        logits = clean.logits if whole_vocab else None
        return (lambda site, head, rows: replaced[site][_index(head, rows)]), logits

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
    levels=NODE_LEVELS,
    needs_corrupt=True,
    shared=POSITIONAL_EXACT,
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
    part: str = "out",
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
        part: at level "head", which part of each head: "out" (its output before the
            output projection), "q" (its query: a dim ``head``), "k" or "v" (its key or
            value projection's output, per key/value head: a dim ``kv_head``, one cell
            shared by the query heads of a group under grouped-query attention, never
            copied out to them) or "pattern" (its attention pattern over the values it
            meets: the output A(source) V(target), ``capture/patching/pattern``; with
            estimator "atp" and no error estimate in ``attribution_patching``, and without
            refine="auto" here); families that fuse q/k/v refuse "q", "k", "v" and
            "pattern".
        tol: refine="auto"'s tolerance, in the metric's units (> 0); None: ``AUTO_TOL``
            (5%) of the largest |estimate| of the call.
        top: refine="auto" measures every component whose membership of the ``top`` by
            |prompt-mean| is in doubt (at most the number of components).

    Returns:
        DataArray (prompt, layer, head) or (prompt, layer, component); positive: the
        component carries the clean answer.
    """
    return run(activation_patching, locals())
