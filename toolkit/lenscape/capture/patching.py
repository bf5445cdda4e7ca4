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

``attribution_patching`` is the first-order (gradient) estimate of ``activation_patching``:
score = sum over positions of grad_corrupt(metric) . (clean - corrupt activation); every
component from 2 forward passes + 1 backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import xarray as xr
from tqdm.auto import tqdm

from . import memory, metrics
from ._backend import Site, get_backend
from ._inputs import Batch, Inputs, prepare
from ._plan import Plan, execute, planner
from ._result import components, to_dataarray

ABLATION_KINDS = ("zero", "mean")
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
    for batch in tqdm(inputs.batches(), total=inputs.n_batches(), disable=not progress,
                      desc="mean activations"):
        with torch.no_grad():
            run = backend.run(batch.clean, sites=sites)
        mask = batch.clean.attention_mask.bool()
        count += int(mask.sum())
        for site in sites:
            total = run.acts[site][mask].double().sum(0)
            sums[site] = sums[site] + total if site in sums else total
    return {site: (total / count).to(inputs.model.dtype) for site, total in sums.items()}


def _layer_groups(variants: list[Variant]) -> list[tuple[int, list[int]]]:
    """Columns of ``variants`` grouped by the block they edit: [(layer, [column, ...])]."""
    groups: dict[int, list[int]] = {}
    for column, ((_, layer), _) in enumerate(variants):
        groups.setdefault(layer, []).append(column)
    return sorted(groups.items())


def _sweep_scorer(inputs: Inputs, *, source: str, replacement_for,
                  variants_per_pass: int | None) -> Callable[[Batch, Callable], torch.Tensor]:
    """``score(batch, step)``: metric change when each component is replaced, (rows, n_components).

    Args:
        source: which tokens the edited passes run on, "clean" or "corrupt".
        replacement_for: ``(batch) -> replacement(site, head)`` giving the new value of
            a component for the rows of one copy of ``batch``.
        variants_per_pass: copies per pass; None: one block's components, or fewer if
            they do not fit the memory budget.
    """
    model, metric = inputs.model, inputs.metric
    backend = get_backend(model, inputs.backend)
    variants = components(inputs)
    groups = _layer_groups(variants)
    resid_sites = [("resid_pre", layer) for layer, _ in groups if layer > 0]

    def score(batch: Batch, step) -> torch.Tensor:
        tokens = getattr(batch, source)
        rows = len(batch.index)
        per_pass = variants_per_pass or memory.auto_variants_per_pass(
            model, rows=rows, width=tokens.input_ids.shape[1],
            wanted=max(len(columns) for _, columns in groups))
        effects = torch.empty(rows, len(variants))
        with torch.no_grad():
            unedited = backend.run(tokens, sites=resid_sites)
            base = metrics.check_finite(metrics.compute(metric, unedited.logits, batch.target,
                                                        batch.distractor), batch.index, metric)
            replacement = replacement_for(batch)
            for layer, columns in groups:
                for start in range(0, len(columns), per_pass):
                    chunk_columns = columns[start:start + per_pass]
                    chunk = [variants[c] for c in chunk_columns]
                    copies = len(chunk)
                    resume = None if layer == 0 else (
                        layer, unedited.acts[("resid_pre", layer)].repeat(copies, 1, 1))
                    run = backend.run(tokens.repeat(copies), sites=_sites(chunk),
                                      edit=_stacked_edit(chunk, rows, replacement), resume=resume)
                    value = metrics.compute(metric, run.logits, batch.target.repeat(copies),
                                            batch.distractor.repeat(copies))
                    effects[:, chunk_columns] = (value.view(copies, rows) - base).T.float().cpu()
                step()
        return metrics.check_finite(effects, batch.index, metric)
    return score


def _one_level_plan(method: str, inputs: Inputs, score, *, steps_per_batch: int = 1,
                    desc: str, method_attr: str, effect: str, **params: Any) -> Plan:
    """A one-level plan whose result is ``to_dataarray`` of the scores."""
    return Plan(method, inputs, len(components(inputs)), score,
                lambda values, index: to_dataarray(inputs, values, method=method_attr,
                                                   effect=effect, index=index, **params),
                desc=desc, steps_per_batch=steps_per_batch)


@planner("ablation")
def _ablation_plan(model, prompts, *, level: str = "head", kind: str = "zero",
                   metric: str = "logit_diff", batch_size: int | None = 8,
                   backend: str = "nnsight", padding_side: str = "right",
                   variants_per_pass: int | None = None, progress: bool = False) -> Plan:
    if kind not in ABLATION_KINDS:
        raise ValueError(f"Unknown ablation kind {kind!r}; choose one of {list(ABLATION_KINDS)}.")
    inputs = prepare(model, prompts, metric=metric, level=level, backend=backend,
                     batch_size=batch_size, padding_side=padding_side, needs_corrupt=False)
    if kind == "zero":
        def replacement_for(batch):
            return lambda site, head: 0.0
    else:
        means = _site_means(inputs, _sites(components(inputs)), progress)

        def replacement_for(batch):
            return lambda site, head: means[site] if head is None else means[site][head]
    score = _sweep_scorer(inputs, source="clean", replacement_for=replacement_for,
                          variants_per_pass=variants_per_pass)
    return _one_level_plan("ablation", inputs, score, steps_per_batch=model.spec.n_layers,
                           desc=f"{kind}-ablation", method_attr=f"{kind}_ablation",
                           effect=f"{kind.capitalize()}-ablation effect on", kind=kind)


def ablation(model, prompts, *, level: str = "head", kind: str = "zero",
             metric: str = "logit_diff", batch_size: int | None = 8, backend: str = "nnsight",
             padding_side: str = "right", variants_per_pass: int | None = None,
             store=None, client=None, progress: bool = True) -> xr.DataArray:
    """Exact ablation of every head or block: metric(ablated) - metric(clean), per prompt.

    Args:
        model: a ``LensModel`` from ``lsc.load``.
        prompts: a ``PromptSet`` (or Prompts / dicts) with single-token targets.
        level: "head" -> dims (prompt, layer, head); "block" -> (prompt, layer, component).
        kind: "zero" or "mean" (mean over all real tokens of the prompt set).
        metric: "logit_diff", "logprob", "loss" or "logit".
        batch_size: prompts per forward pass (each pass holds ``variants_per_pass`` copies);
            None picks one from free memory (GPU: up to 256).
        backend: "nnsight" or "transformer_lens".
        padding_side: "right" or "left"; results do not depend on it.
        variants_per_pass: components measured per pass (default: one block's, n_heads
            at head level, fewer if they do not fit in memory).
        store: a ``.zarr`` path: stream results there batch by batch and resume an
            interrupted run (see ``lsc.capture_to``); returns the stored result, lazily.
        client: a ``dask.distributed.Client``: score batches on its workers (needs ``store``).
        progress: show a progress bar.

    Returns:
        DataArray of metric changes (negative: the component helps the metric).
    """
    return execute("ablation", model, prompts, store=store, client=client, progress=progress,
                   level=level, kind=kind, metric=metric, batch_size=batch_size,
                   backend=backend, padding_side=padding_side,
                   variants_per_pass=variants_per_pass)


@planner("activation_patching")
def _activation_patching_plan(model, prompts, *, level: str = "head",
                              metric: str = "logit_diff", batch_size: int | None = 8,
                              backend: str = "nnsight", padding_side: str = "right",
                              variants_per_pass: int | None = None,
                              progress: bool = False) -> Plan:
    inputs = prepare(model, prompts, metric=metric, level=level, backend=backend,
                     batch_size=batch_size, padding_side=padding_side, needs_corrupt=True)
    runner = get_backend(model, backend)
    sites = _sites(components(inputs))

    def replacement_for(batch):  # called under no_grad
        clean = runner.run(batch.clean, sites=sites).acts
        return lambda site, head: clean[site][_index(head)]
    score = _sweep_scorer(inputs, source="corrupt", replacement_for=replacement_for,
                          variants_per_pass=variants_per_pass)
    return _one_level_plan("activation_patching", inputs, score,
                           steps_per_batch=model.spec.n_layers, desc="activation patching",
                           method_attr="activation_patching",
                           effect="Patching effect (clean -> corrupt) on")


def activation_patching(model, prompts, *, level: str = "head", metric: str = "logit_diff",
                        batch_size: int | None = 8, backend: str = "nnsight",
                        padding_side: str = "right", variants_per_pass: int | None = None,
                        store=None, client=None, progress: bool = True) -> xr.DataArray:
    """Exact activation patching (clean -> corrupt): metric(patched) - metric(corrupt).

    Each prompt's corrupt run gets one component's clean activation (all positions).
    Arguments as in ``ablation``; every prompt needs a ``corrupt`` text of equal token length.

    Returns:
        DataArray (prompt, layer, head) or (prompt, layer, component); positive: the
        component carries the clean answer.
    """
    return execute("activation_patching", model, prompts, store=store, client=client,
                   progress=progress, level=level, metric=metric, batch_size=batch_size,
                   backend=backend, padding_side=padding_side,
                   variants_per_pass=variants_per_pass)


@planner("attribution_patching")
def _attribution_patching_plan(model, prompts, *, level: str = "head",
                               metric: str = "logit_diff", batch_size: int | None = 8,
                               backend: str = "nnsight", padding_side: str = "right",
                               progress: bool = False) -> Plan:
    levels = ("head", "block") if level == "all" else (level,)
    first = prepare(model, prompts, metric=metric, level=levels[0], backend=backend,
                    batch_size=batch_size, padding_side=padding_side, needs_corrupt=True,
                    grad=True)
    inputs_by_level = {lvl: first if lvl == levels[0] else
                       prepare(model, prompts, metric=metric, level=lvl, backend=backend,
                               batch_size=first.batch_size, padding_side=padding_side,
                               needs_corrupt=True)
                       for lvl in levels}
    variants = {lvl: components(inp) for lvl, inp in inputs_by_level.items()}
    widths = [len(variants[lvl]) for lvl in levels]
    sites = [site for lvl in levels for site in _sites(variants[lvl])]
    runner = get_backend(model, backend)

    def score(batch: Batch, step) -> torch.Tensor:
        with torch.no_grad():
            clean = runner.run(batch.clean, sites=sites).acts
        corrupt = runner.run(batch.corrupt, sites=sites, grad=True)
        value = metrics.compute(metric, corrupt.logits, batch.target, batch.distractor)
        metrics.check_finite(value, batch.index, metric)
        grads = dict(zip(sites, torch.autograd.grad(value.sum(), [corrupt.acts[s] for s in sites])))
        mask = batch.corrupt.attention_mask.to(value.dtype)
        columns = []
        for lvl in levels:
            for site in _sites(variants[lvl]):
                delta = (clean[site] - corrupt.acts[site].detach()).float()
                product = delta * grads[site].float()
                if site[0] == "z":  # (batch, pos, head, d_head) -> (batch, head)
                    columns.append(torch.einsum("bphd,bp->bh", product, mask))
                else:  # (batch, pos, d_model) -> (batch, 1)
                    columns.append(torch.einsum("bpd,bp->b", product, mask)[:, None])
        step()
        return metrics.check_finite(torch.cat(columns, dim=1).cpu(), batch.index, metric)

    def finish(values, index):
        results, start = {}, 0
        for lvl, width in zip(levels, widths):
            results[lvl] = to_dataarray(inputs_by_level[lvl], values[:, start:start + width],
                                        method="attribution_patching",
                                        effect="Attribution patching (clean -> corrupt) of",
                                        index=index)
            start += width
        if level != "all":
            return results[level]
        # Plural names: a variable named like its own "head" dim would become a coordinate.
        return xr.Dataset({"heads": results["head"], "blocks": results["block"]})
    return Plan("attribution_patching", first, sum(widths), score, finish,
                desc="attribution patching")


def attribution_patching(model, prompts, *, level: str = "head", metric: str = "logit_diff",
                         batch_size: int | None = 8, backend: str = "nnsight",
                         padding_side: str = "right", store=None, client=None,
                         progress: bool = True) -> Any:
    """Gradient estimate of activation patching for every component at once.

    score = sum_pos grad_corrupt(metric) . (clean - corrupt activation), from one clean
    forward, one corrupt forward and one backward per batch.

    Args:
        level: "head", "block", or "all" (both, returned as a Dataset with variables
            ``heads`` and ``blocks``).
        Others as in ``ablation``.

    Returns:
        DataArray (prompt, layer, head | component), or a Dataset for level="all".
    """
    return execute("attribution_patching", model, prompts, store=store, client=client,
                   progress=progress, level=level, metric=metric, batch_size=batch_size,
                   backend=backend, padding_side=padding_side)
