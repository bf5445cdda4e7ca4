"""``ablation``: exact zero- or mean-ablation of every head or block, on the clean prompt;
score = metric(ablated) - metric(clean)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import xarray as xr

from ...data import Prompts
from ...models import LensModel
from ...sweep.backend import Site, get_backend
from ...sweep.inputs import Batch, Inputs, batched
from ...sweep.options import POSITIONAL_EXACT, Options
from ...sweep.plan import Call, Plan, once
from ...sweep.registry import method, run
from ...sweep.result import NODE_LEVELS
from .checks import check_positions
from .estimates import _gradient_effects, _gradients, checked_columns
from .exact import Variant, _FixedPasses, _site_means, _sites, variants_of
from .needs import ablation_memory
from .refine import AUTO_TOP, Estimate, _check_refine, _exact_plan

ABLATION_KINDS = ("zero", "mean")


def _check_ablation(model: LensModel, options: Options) -> None:
    """``ablation``'s own options (``Method.checks``)."""
    check_positions(options)
    if not isinstance(options.kind, str) or options.kind not in ABLATION_KINDS:
        raise ValueError(
            f"Unknown ablation kind {options.kind!r}; choose one of {list(ABLATION_KINDS)}."
        )
    _check_refine(model, options)


def _ablation_targets(
    inputs: Inputs, variants: list[Variant], kind: str, prepass: dict[str, Any], progress: bool
) -> tuple[Callable, Callable]:
    """What an ablation replaces a component with: ``goal(site, act, acts)`` (the
    replacement of a whole activation, for the ranking pass of ``refine``; ``acts``, the
    run's other kept activations, unread) and ``replacement_for(batch)`` (as
    ``_sweep_scorer`` takes it); the means of kind="mean" are kept in ``prepass``."""
    if kind == "zero":
        return (lambda site, act, acts=None: torch.zeros_like(act)), (
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

    return (lambda site, act, acts=None: means[site].expand_as(act)), replacement_for


def plan_ablation(call: Call) -> Plan[xr.DataArray]:
    """``ablation`` as a plan: one exact sweep per batch (after the means, for kind="mean",
    and the ranking pass, with ``refine``; both kept in the plan's ``prepass``)."""
    model, tokens, options = call.model, call.tokens, call.options
    kind = options.kind
    inputs = batched(model, tokens, options)
    variants = variants_of(inputs)
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
            values = checked_columns(products, terms, variants, batch, batch.clean, options.metric)
            return values, None

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


@method(
    plan_ablation,
    levels=NODE_LEVELS,
    shared=POSITIONAL_EXACT,
    memory=ablation_memory,
    checks=_check_ablation,
)
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
