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

``refine=k`` on the exact methods ranks every component with a gradient estimate and runs
the exact sweep on the k components whose prompt-mean estimate is largest in absolute
value; the others are NaN ("not computed").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import _validate
from ..data import Prompts
from ..models import LensModel
from ..sweep import memory, metrics
from ..sweep.backend import Site, TokenBatch, get_backend
from ..sweep.inputs import Batch, Inputs, batched
from ..sweep.options import EXACT, LEVELLED, MAX_STEPS, Options, integration_points
from ..sweep.plan import Call, Plan, Result, Scores, once, one_level_plan, top_is_target
from ..sweep.registry import method, run
from ..sweep.relevance import RULE_SETS, clean_pass, rules_or_plain, unsupported
from ..sweep.result import LEVELS, components, to_dataarray

ABLATION_KINDS = ("zero", "mean")
#: Gradient estimators of a patching effect; see the module docstring.
ESTIMATORS = ("atp", "ig", "relp")
#: The estimators that integrate along the corrupt -> clean input path.
PATH_ESTIMATORS = ("ig",)
#: The rule set of ``estimator="relp"`` when ``rules`` is not given: RelP's released rules
#: (``sweep/relevance.RULE_SETS``). ``rules="secant"`` agrees best with exact patching
#: (benchmarks/RESULTS.md, section faithfulness).
DEFAULT_RULES = "relp"
#: Integration points of ``estimator="ig"`` when ``steps`` is not given. Measured on SmolLM2
#: (benchmarks/RESULTS.md, section faithfulness): 2 points raise MLP-block agreement with
#: exact patching most per unit of cost (Pearson r over cells 0.71 -> 0.90 on the factual set,
#: 0.59 -> 0.88 on IOI, for 1.4-1.7x AtP's time); 8 points reach 0.93 / 0.96 at 4-6x.
DEFAULT_IG_STEPS = 2
#: Where integrated gradients interpolates: the residual stream entering block 0.
INPUT_SITE: Site = ("resid_pre", 0)
Variant = tuple[Site, "int | None"]


def _sites(variants: list[Variant]) -> list[Site]:
    return list(dict.fromkeys(site for site, _ in variants))


def _index(head: int | None, rows: slice = slice(None)) -> tuple:
    """Index (rows, pos[, head]) into a site activation."""
    return (rows, slice(None)) if head is None else (rows, slice(None), head)


def _stacked_edit(chunk: list[Variant], batch_rows: int, replacement):
    """Edit for a stacked pass: copy ``c`` of the batch gets ``chunk[c]`` replaced.

    ``replacement(site, head)`` -> tensor broadcastable to (batch_rows, pos[, d]).
    """

    def edit(site: Site, value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        for copy_index, (variant_site, head) in enumerate(chunk):
            if variant_site == site:
                rows = slice(copy_index * batch_rows, (copy_index + 1) * batch_rows)
                value[_index(head, rows)] = replacement(site, head)
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
    chunk: list[Variant],
    unedited: Any,
    replacement: Callable,
) -> torch.Tensor:
    """(copies * rows,) metric of one stacked pass: copy ``c`` of ``batch``'s ``source``
    tokens with ``chunk[c]`` replaced, resumed from the unedited run's residual stream at
    the chunk's block (every variant of a chunk edits the same block)."""
    (_, layer), _ = chunk[0]
    copies, rows = len(chunk), len(batch.index)
    tokens = getattr(batch, source)
    resume = (
        None if layer == 0 else (layer, unedited.acts[("resid_pre", layer)].repeat(copies, 1, 1))
    )
    run = backend.run(
        tokens.repeat(copies),
        sites=_sites(chunk),
        edit=_stacked_edit(chunk, rows, replacement),
        resume=resume,
    )
    return metrics.compute(
        metric,
        run.logits,
        batch.target.repeat(copies),
        batch.distractor.repeat(copies),
    )


def _sweep_scorer(
    inputs: Inputs,
    *,
    source: str,
    replacement_for,
    variants_per_pass: int | None,
    columns: list[int] | None = None,
) -> Callable[[Batch, Callable], Scores]:
    """``score(batch, step)``: metric change when each component is replaced, (rows,
    n_components), and whether the model answers each clean prompt correctly.

    Args:
        source: which tokens the edited passes run on, "clean" or "corrupt".
        replacement_for: ``(batch) -> (replacement(site, head), clean logits)``:
            ``replacement`` gives the new value of a component for the rows of one copy of
            ``batch``; the clean logits (rows, vocab) at the read position come from a
            clean pass it makes, or are None when ``source`` is "clean" (the unedited
            pass is the clean one).
        variants_per_pass: copies per pass; None: one block's components, or fewer if
            they do not fit the memory budget.
        columns: the components to measure (positions in ``components(inputs)``); the
            others are NaN. None: all of them.
    """
    model, metric = inputs.model, inputs.metric
    backend = get_backend(model, inputs.backend)
    variants = components(inputs)
    columns = list(range(len(variants))) if columns is None else columns
    groups = _layer_groups(variants, columns)
    resid_sites = [("resid_pre", layer) for layer, _ in groups if layer > 0]

    def score(batch: Batch, step) -> Scores:
        tokens = getattr(batch, source)
        rows = len(batch.index)
        per_pass = variants_per_pass or memory.auto_variants_per_pass(
            model,
            rows=rows,
            width=tokens.input_ids.shape[1],
            wanted=max(len(group) for _, group in groups),
        )
        effects = torch.full((rows, len(variants)), float("nan"))
        with torch.no_grad():
            unedited = backend.run(tokens, sites=resid_sites)
            base = metrics.check_finite(
                metrics.compute(metric, unedited.logits, batch.target, batch.distractor),
                batch.index,
                metric,
            )
            replacement, clean_logits = replacement_for(batch)
            correct = top_is_target(
                unedited.logits if clean_logits is None else clean_logits, batch.target
            )
            for _, group in groups:
                for start in range(0, len(group), per_pass):
                    chunk_columns = group[start : start + per_pass]
                    chunk = [variants[c] for c in chunk_columns]
                    value = _edited_metric(
                        backend, metric, batch, source, chunk, unedited, replacement
                    )
                    change = value.view(len(chunk), rows) - base
                    effects[:, chunk_columns] = change.T.float().cpu()
                step()
            for _ in range(model.spec.n_layers - len(groups)):  # blocks with nothing to measure
                step()
        metrics.check_finite(effects[:, columns], batch.index, metric)
        return Scores(effects, correct)

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
) -> dict[Site, torch.Tensor]:
    """Gradient estimate of replacing each site's activation on ``base`` by ``goal``.

    estimate = mean_k grad(metric)|x(a_k) . (goal - base activation), per position, with
    x(a) = base input + a (clean_input - base input) the residual stream entering block 0
    and a_k = k / steps (k = 0..steps-1). ``steps=1`` is attribution patching: the gradient
    at the base run alone (``clean_input`` unused).

    Args:
        base: tokens of the run the replacement is made in (corrupt for patching, clean
            for ablation).
        goal: ``(site, base activation) -> replacement activation``, same shape.
        clean_input: (batch, pos, d_model) the clean residual stream entering block 0;
            needed when ``steps > 1``.

    Returns:
        site -> (batch, pos, [head,] d) float32 products, not yet summed over positions.
    """
    grad_sums: dict[Site, torch.Tensor] = {}
    deltas: dict[Site, torch.Tensor] = {}
    for k in range(steps):

        def interpolate(site: Site, value: torch.Tensor, alpha=k / steps) -> torch.Tensor:
            if site != INPUT_SITE:
                return value
            assert clean_input is not None  # steps > 1 comes with clean_input (see Args)
            return value + alpha * (clean_input - value)

        run = runner.run(
            base,
            sites=[INPUT_SITE, *sites] if k > 0 else sites,
            edit=interpolate if k > 0 else None,
            grad=True,
        )
        value = metrics.compute(metric, run.logits, batch.target, batch.distractor)
        metrics.check_finite(value, batch.index, metric)
        grads = torch.autograd.grad(value.sum(), [run.acts[site] for site in sites])
        for site, grad in zip(sites, grads, strict=True):
            if k == 0:
                act = run.acts[site].detach()
                deltas[site] = (goal(site, act) - act).float()
                grad_sums[site] = grad.float()
            else:
                grad_sums[site] = grad_sums[site] + grad.float()
    return {site: deltas[site] * grad_sums[site] / steps for site in sites}


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
    return "Attribution patching"


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


def check_relevance(model: LensModel, rules: str | None, *, backend: str = "nnsight") -> None:
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


def _check_refine(model: LensModel, options: Options) -> None:
    """``refine`` against the number of components of ``options.level``."""
    refine = options.refine
    if refine is None:
        return
    spec = model.spec
    n_components = spec.n_layers * (spec.n_heads if options.level == "head" else 2)
    if refine > n_components:
        raise ValueError(
            f"refine must be an integer from 1 to {n_components} (the number of "
            f"components at level={options.level!r}), got {refine!r}; None measures all."
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


def _patching_estimator(
    inputs: Inputs, variants: list[Variant], *, steps: int, rules: str | None = None
) -> Callable[[Batch], Scores]:
    """``estimate(batch)`` -> (rows, len(variants)) gradient estimate of activation
    patching, with whether the model answers each clean prompt correctly: the gradient at
    ``steps`` points of the input path, or at the corrupt run under relevance ``rules``."""
    model, runner = inputs.model, get_backend(inputs.model, inputs.backend)
    sites = _sites(variants)

    def estimate(batch: Batch) -> Scores:
        assert batch.corrupt is not None  # inputs prepared with needs_corrupt=True
        with rules_or_plain(model, rules, backend=inputs.backend) as relevance:
            with torch.no_grad(), clean_pass(relevance):
                clean_sites = [INPUT_SITE, *sites] if steps > 1 else sites
                clean_run = runner.run(batch.clean, sites=clean_sites)
            clean = clean_run.acts
            products = _gradient_effects(
                runner,
                inputs.metric,
                batch,
                sites,
                base=batch.corrupt,
                goal=lambda site, act: clean[site],
                steps=steps,
                clean_input=clean.get(INPUT_SITE),
            )
        mask = batch.corrupt.attention_mask.float()
        values = metrics.check_finite(
            _component_columns(products, variants, mask).cpu(), batch.index, inputs.metric
        )
        return Scores(values, top_is_target(clean_run.logits, batch.target))

    return estimate


def _refined_columns(
    inputs: Inputs, estimate: Callable[[Batch], torch.Tensor], k: int, progress: bool
) -> list[int]:
    """Positions (in ``components(inputs)``) of the ``k`` components whose prompt-mean
    estimate is largest in absolute value, in component order."""
    n_components = len(components(inputs))
    k = _validate.positive_int("refine", k)
    if k > n_components:
        raise ValueError(
            f"refine must be an integer from 1 to {n_components} (the number of "
            f"components at level={inputs.level!r}), got {k!r}; None measures all."
        )
    total = torch.zeros(n_components, dtype=torch.float64)
    for batch in tqdm(
        inputs.batches(), total=inputs.n_batches(), disable=not progress, desc="ranking components"
    ):
        total += estimate(batch).double().sum(0)
    order = np.argsort(-np.abs(total.numpy()), kind="stable")
    return sorted(int(c) for c in order[:k])


def _exact_plan(
    call: Call,
    inputs: Inputs,
    sweep: tuple[str, Callable, list[int] | None],
    *,
    desc: str,
    method: str,
    effect: str,
    **params: Any,
) -> Plan[xr.DataArray]:
    """The plan of an exact sweep: ``sweep`` is ``_sweep_scorer``'s (source,
    replacement_for, columns); one progress step per block."""
    source, replacement_for, columns = sweep
    score = _sweep_scorer(
        inputs,
        source=source,
        replacement_for=replacement_for,
        variants_per_pass=call.options.variants_per_pass,
        columns=columns,
    )
    return one_level_plan(
        inputs,
        score,
        desc=desc,
        method=method,
        effect=effect,
        steps_per_batch=call.model.spec.n_layers,
        prepass=call.prepass,
        **params,
    )


def _refine_params(refine: int | None, estimator: str, steps: int) -> dict[str, Any]:
    """Attrs recording a refined sweep (none for a full one)."""
    if refine is None:
        return {}
    return {"refined_k": refine, "refine_estimator": estimator, "refine_steps": steps}


# -------------------------------------------------------------------------------- memory


def _site_width(model: LensModel, level: str) -> int:
    """Numbers per token of every site a ``level`` sweep or estimate reads (z: n_heads x
    d_head per layer; blocks: the attention and MLP outputs, 2 x d_model per layer)."""
    spec = model.spec
    per_layer = {"head": spec.n_heads * spec.d_head, "block": 2 * spec.d_model}
    heads_and_blocks = per_layer["head"] + per_layer["block"]
    return spec.n_layers * (heads_and_blocks if level == "all" else per_layer[level])


def _estimate_need(model: LensModel, work: memory.Work, level: str, points: int) -> memory.Need:
    """What a gradient estimate of one batch holds: the clean pass's sites (and the input
    site with ``points`` > 1), then the graph of a pass with a backward and the sites'
    gradients, then float32 products over the sites (``_gradient_effects``)."""
    tokens = work.rows * work.width
    width = _site_width(model, level) + (model.spec.d_model if points > 1 else 0)
    sites = tokens * width * memory.element_bytes(model.dtype)
    backward = memory.Need(
        activations=memory.gradient_pass(model, work.rows, work.width), buffers=2 * sites
    )
    products = memory.Need(buffers=2 * sites + 3 * tokens * width * 4)
    return memory.largest(backward, products)


def _sweep_need(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """What an exact sweep of one batch holds: the residual stream entering every block
    (kept by the unedited pass) and a pass of ``variants_per_pass`` stacked copies (by
    default one block's components, as many as memory allows)."""
    spec, e = model.spec, memory.element_bytes(model.dtype)
    level, refine = options.get("level", "head"), options.get("refine")
    wanted = spec.n_heads if level == "head" else 2  # one block's components
    if refine is not None:  # at most ``refine`` components of one block
        wanted = min(wanted, refine)
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
        need = memory.largest(need, _estimate_need(model, work, level, 1))
    return need + _result_need(model, level, work)


def activation_patching_memory(
    model: LensModel, options: Options, work: memory.Work
) -> memory.Need:
    """Footprint of ``activation_patching``: its exact sweep with the clean run's sites
    kept, or its ranking pass (``refine``) when that holds more. Options a call did not give
    are taken at their defaults."""
    e, level = memory.element_bytes(model.dtype), options.get("level", "head")
    clean = work.rows * work.width * _site_width(model, level) * e
    need = _sweep_need(model, options, work) + memory.Need(buffers=clean)
    if options.get("refine") is not None:
        points = _check_estimator(options.get("estimator", ESTIMATORS[0]), options.get("steps"))
        need = memory.largest(need, _estimate_need(model, work, level, points))
    return need + _result_need(model, level, work)


def attribution_patching_memory(
    model: LensModel, options: Options, work: memory.Work
) -> memory.Need:
    """Footprint of ``attribution_patching``: one gradient estimate per batch. Options a call
    did not give are taken at their defaults."""
    level = options.get("level", "head")
    points = _check_estimator(options.get("estimator", ESTIMATORS[0]), options.get("steps"))
    return _estimate_need(model, work, level, points) + _result_need(model, level, work)


# ------------------------------------------------------------------------------ ablation


def _ablation_targets(
    inputs: Inputs, variants: list[Variant], kind: str, prepass: dict[str, Any], progress: bool
) -> tuple[Callable, Callable]:
    """What an ablation replaces a component with: ``goal(site, act)`` (the replacement of
    a whole activation, for the ranking pass of ``refine``) and ``replacement_for(batch)``
    (as ``_sweep_scorer`` takes it); the means of kind="mean" are kept in ``prepass``."""
    if kind == "zero":
        return (lambda site, act: torch.zeros_like(act)), (lambda batch: ((lambda s, h: 0.0), None))
    cpu_means = once(
        prepass,
        "means",
        lambda: {s: m.cpu() for s, m in _site_means(inputs, _sites(variants), progress).items()},
    )
    means = {site: mean.to(inputs.model.device) for site, mean in cpu_means.items()}

    def replacement_for(batch):
        return (lambda site, head: means[site] if head is None else means[site][head]), None

    return (lambda site, act: means[site].expand_as(act)), replacement_for


def plan_ablation(call: Call) -> Plan[xr.DataArray]:
    """``ablation`` as a plan: one exact sweep per batch (after the means, for kind="mean",
    and the ranking pass, with ``refine``; both kept in the plan's ``prepass``)."""
    model, tokens, options = call.model, call.tokens, call.options
    prepass, progress = call.prepass, call.progress
    kind, refine = options.kind, options.refine
    inputs = batched(model, tokens, options)
    variants = components(inputs)
    goal, replacement_for = _ablation_targets(inputs, variants, kind, prepass, progress)
    columns = None
    if refine is not None:
        runner = get_backend(model, options.backend)

        def estimate(batch: Batch) -> torch.Tensor:
            products = _gradient_effects(
                runner, options.metric, batch, _sites(variants), base=batch.clean, goal=goal
            )
            return _component_columns(products, variants, batch.clean.attention_mask.float()).cpu()

        columns = once(
            prepass, "columns", lambda: _refined_columns(inputs, estimate, refine, progress)
        )
    return _exact_plan(
        call,
        inputs,
        ("clean", replacement_for, columns),
        desc=f"{kind}-ablation",
        method=f"{kind}_ablation",
        effect=f"{kind.capitalize()}-ablation effect on",
        kind=kind,
        **_refine_params(refine, "atp", 1),
    )


@method(plan_ablation, levels=LEVELS, shared=EXACT, memory=ablation_memory, checks=_check_ablation)
def ablation(
    model: LensModel, prompts: Prompts, *, kind: str = "zero", refine: int | None = None, **shared
) -> xr.DataArray:
    """Exact ablation of every head or block: metric(ablated) - metric(clean), per prompt.

    Args:
        kind: "zero" or "mean" (mean over all real tokens of the prompt set).
        refine: measure exactly only the ``refine`` components whose first-order estimate
            grad_clean(metric) . (replacement - clean activation), averaged over prompts,
            is largest in absolute value; the others are NaN. None: all components.

    Returns:
        DataArray of metric changes (negative: the component helps the metric).
    """
    return run(ablation, locals())


# ------------------------------------------------------------------- activation patching


def plan_activation_patching(call: Call) -> Plan[xr.DataArray]:
    """``activation_patching`` as a plan: one exact sweep per batch (after the ranking
    pass, with ``refine``, kept in the plan's ``prepass``)."""
    model, tokens, options = call.model, call.tokens, call.options
    prepass, progress = call.prepass, call.progress
    points = _check_estimator(options.estimator, options.steps)
    inputs = batched(model, tokens, options)
    runner = get_backend(model, options.backend)
    variants = components(inputs)
    sites = _sites(variants)
    columns = None
    if options.refine is not None:
        rules = check_rules(options.estimator, options.rules)
        estimate = _patching_estimator(inputs, variants, steps=points, rules=rules)
        refine = options.refine
        columns = once(
            prepass,
            "columns",
            lambda: _refined_columns(inputs, lambda b: estimate(b).values, refine, progress),
        )

    def replacement_for(batch):  # called under no_grad
        clean = runner.run(batch.clean, sites=sites)
        return (lambda site, head: clean.acts[site][_index(head)]), clean.logits

    return _exact_plan(
        call,
        inputs,
        ("corrupt", replacement_for, columns),
        desc="activation patching",
        method="activation_patching",
        effect="Patching effect (clean -> corrupt) on",
        **_refine_params(options.refine, options.estimator, points),
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
    refine: int | None = None,
    estimator: str = "atp",
    steps: int | None = None,
    rules: str | None = None,
    **shared,
) -> xr.DataArray:
    """Exact activation patching (clean -> corrupt): metric(patched) - metric(corrupt).

    Each prompt's corrupt run gets one component's clean activation (all positions).
    Every prompt needs a ``corrupt`` text of equal token length.

    Args:
        refine: measure exactly only the ``refine`` components whose prompt-mean
            ``attribution_patching`` estimate is largest in absolute value; the others are
            NaN ("not computed"). Attrs record ``refined_k``, ``refine_estimator`` and
            ``refine_steps``. None: all components.
        estimator, steps, rules: the estimator that ranks components for ``refine`` (see
            ``attribution_patching``).

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
    estimate = _patching_estimator(
        first,
        [variant for lvl in levels for variant in components(inputs_by_level[lvl])],
        steps=points,
        rules=rules,
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
            start += width
        if level != "all":
            return results[level]
        # Plural names: a variable named like its own "head" dim would become a coordinate.
        return xr.Dataset({"heads": results["head"], "blocks": results["block"]})

    return Plan(
        first,
        sum(widths),
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
    checks=check_estimate,
)
def attribution_patching(
    model: LensModel,
    prompts: Prompts,
    *,
    estimator: str = "atp",
    steps: int | None = None,
    rules: str | None = None,
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
    cost of "atp". ``lsc.faithfulness`` measures how well each agrees with exact patching.

    Args:
        level: "head", "block", or "all" (both, returned as a Dataset with variables
            ``heads`` and ``blocks``).
        estimator: "atp", "ig" or "relp".
        steps: integration points for "ig" (default ``DEFAULT_IG_STEPS``); "atp" and "relp"
            take 1.
        rules: the relevance rules of "relp" (``sweep/relevance.RULE_SETS``; None:
            ``DEFAULT_RULES``, RelP's own: RMSNorm scale held, identity rule through the MLP
            non-linearity, half rule through gate x up). "secant" linearises every
            operation between the corrupt and the clean run (a clean reference pass, about
            1.2x "atp"'s time) and agrees best with exact patching on MLPs.

    Returns:
        DataArray (prompt, layer, head | component), or a Dataset for level="all".
    """
    return run(attribution_patching, locals())
