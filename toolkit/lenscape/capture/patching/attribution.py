"""``attribution_patching``: the gradient estimate of activation patching for every
component at once (AtP, integrated gradients, RelP, the trapezoid rule), with its error
estimate on request."""

from __future__ import annotations

import dataclasses

import xarray as xr

from ...data import Prompts
from ...models import LensModel
from ...sweep.inputs import Batch, batched
from ...sweep.options import POSITIONAL
from ...sweep.plan import Call, Plan, Result, Scores
from ...sweep.registry import method, run
from ...sweep.result import NODE_LEVELS, to_dataarray
from .checks import (
    _check_attribution,
    _check_estimator,
    check_rules,
)
from .estimates import _estimator_name, _patching_estimator, error_method, with_error
from .exact import variants_of
from .needs import attribution_patching_memory


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
    widths = [len(variants_of(inputs_by_level[lvl])) for lvl in levels]
    rules = check_rules(estimator, options.rules)
    error = options.error
    estimate = _patching_estimator(
        first,
        [variant for lvl in levels for variant in variants_of(inputs_by_level[lvl])],
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
    levels=(*NODE_LEVELS, "all"),
    needs_corrupt=True,
    shared=POSITIONAL,
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
    part: str = "out",
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
        part: at level "head", which part of each head: "out" (its output before the
            output projection), "q" (its query: a dim ``head``), "k" or "v" (its key or
            value projection's output, per key/value head: a dim ``kv_head``, one cell
            shared by the query heads of a group under grouped-query attention, never
            copied out to them) or "pattern" (its attention pattern over the values it
            meets: the output A(source) V(target), ``capture/patching/pattern``; with
            estimator "atp" and no error estimate in ``attribution_patching``, and without
            refine="auto" here); families that fuse q/k/v refuse "q", "k", "v" and
            "pattern".
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
