"""Causal attributions: exact ablation and activation patching, and attribution patching.

Exact methods change one component (a head's output before ``o_proj``, or an attention
or MLP block's contribution to the residual stream) and re-run the model:

- ``ablation``: replace it with zeros or its mean over the prompt set's real tokens, on
  the clean prompt; score = metric(ablated) - metric(clean).
- ``activation_patching``: run the corrupt prompt with the component's clean activation
  patched in (clean -> corrupt, "denoising"); score = metric(patched) - metric(corrupt).

The variants are stacked in the batch dimension (``variants_per_pass`` copies of the
batch per forward pass, each copy editing one component), so one pass measures many
components.

``attribution_patching`` is the first-order (gradient) estimate of ``activation_patching``:
score = sum over positions of grad_corrupt(metric) . (clean - corrupt activation); every
component from 2 forward passes + 1 backward pass.
"""

from __future__ import annotations

from typing import Any

import torch
import xarray as xr
from tqdm.auto import tqdm

from . import metrics
from ._backend import Site, TokenBatch, get_backend
from ._inputs import Inputs, prepare
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


def _exact_sweep(inputs: Inputs, *, source: str, replacement_for, progress: bool,
                 variants_per_pass: int | None, desc: str) -> torch.Tensor:
    """Metric change when each component is replaced, (prompt, n_components).

    Args:
        source: which tokens the edited passes run on, "clean" or "corrupt".
        replacement_for: ``(batch) -> replacement(site, head)`` giving the new value of
            a component for the rows of one copy of ``batch``.
    """
    backend = get_backend(inputs.model, inputs.backend)
    variants = components(inputs)
    per_pass = variants_per_pass or inputs.model.spec.n_heads
    chunks = [variants[i:i + per_pass] for i in range(0, len(variants), per_pass)]
    scores = torch.full((len(inputs.prompts), len(variants)), float("nan"))
    bar = tqdm(total=inputs.n_batches() * len(chunks), disable=not progress, desc=desc)
    with torch.no_grad():
        for batch in inputs.batches():
            tokens: TokenBatch = getattr(batch, source)
            base = metrics.compute(inputs.metric, backend.run(tokens).logits,
                                   batch.target, batch.distractor)
            metrics.check_finite(base, batch.index, inputs.metric)
            replacement = replacement_for(batch)
            rows, column = len(batch.index), 0
            for chunk in chunks:
                run = backend.run(tokens.repeat(len(chunk)), sites=_sites(chunk),
                                  edit=_stacked_edit(chunk, rows, replacement))
                value = metrics.compute(inputs.metric, run.logits,
                                        batch.target.repeat(len(chunk)),
                                        batch.distractor.repeat(len(chunk)))
                effect = (value.view(len(chunk), rows) - base).T.cpu()
                scores[batch.index, column:column + len(chunk)] = metrics.check_finite(
                    effect, batch.index, inputs.metric)
                column += len(chunk)
                bar.update()
    bar.close()
    return scores


def ablation(model, prompts, *, level: str = "head", kind: str = "zero",
             metric: str = "logit_diff", batch_size: int = 8, backend: str = "nnsight",
             padding_side: str = "right", variants_per_pass: int | None = None,
             progress: bool = True) -> xr.DataArray:
    """Exact ablation of every head or block: metric(ablated) - metric(clean), per prompt.

    Args:
        model: a ``LensModel`` from ``lsc.load``.
        prompts: a ``PromptSet`` (or Prompts / dicts) with single-token targets.
        level: "head" -> dims (prompt, layer, head); "block" -> (prompt, layer, component).
        kind: "zero" or "mean" (mean over all real tokens of the prompt set).
        metric: "logit_diff", "logprob", "loss" or "logit".
        batch_size: prompts per forward pass (each pass holds ``variants_per_pass`` copies).
        backend: "nnsight" or "transformer_lens".
        padding_side: "right" or "left"; results do not depend on it.
        variants_per_pass: components measured per pass (default: n_heads).
        progress: show a progress bar.

    Returns:
        DataArray of metric changes (negative: the component helps the metric).
    """
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
    scores = _exact_sweep(inputs, source="clean", replacement_for=replacement_for,
                          progress=progress, variants_per_pass=variants_per_pass,
                          desc=f"{kind}-ablation")
    return to_dataarray(inputs, scores, method=f"{kind}_ablation",
                        effect=f"{kind.capitalize()}-ablation effect on", kind=kind)


def activation_patching(model, prompts, *, level: str = "head", metric: str = "logit_diff",
                        batch_size: int = 8, backend: str = "nnsight",
                        padding_side: str = "right", variants_per_pass: int | None = None,
                        progress: bool = True) -> xr.DataArray:
    """Exact activation patching (clean -> corrupt): metric(patched) - metric(corrupt).

    Each prompt's corrupt run gets one component's clean activation (all positions).
    Arguments as in ``ablation``; every prompt needs a ``corrupt`` text of equal token length.

    Returns:
        DataArray (prompt, layer, head) or (prompt, layer, component); positive: the
        component carries the clean answer.
    """
    inputs = prepare(model, prompts, metric=metric, level=level, backend=backend,
                     batch_size=batch_size, padding_side=padding_side, needs_corrupt=True)
    runner = get_backend(model, backend)
    sites = _sites(components(inputs))

    def replacement_for(batch):
        clean = runner.run(batch.clean, sites=sites).acts
        return lambda site, head: clean[site][_index(head)]
    scores = _exact_sweep(inputs, source="corrupt", replacement_for=replacement_for,
                          progress=progress, variants_per_pass=variants_per_pass,
                          desc="activation patching")
    return to_dataarray(inputs, scores, method="activation_patching",
                        effect="Patching effect (clean -> corrupt) on")


def attribution_patching(model, prompts, *, level: str = "head", metric: str = "logit_diff",
                         batch_size: int = 8, backend: str = "nnsight",
                         padding_side: str = "right", progress: bool = True) -> Any:
    """Gradient estimate of activation patching for every component at once.

    score = sum_pos grad_corrupt(metric) . (clean - corrupt activation), from one clean
    forward, one corrupt forward and one backward per batch.

    Args:
        level: "head", "block", or "all" (both, returned as a Dataset with variables
            ``head`` and ``block``).
        Others as in ``activation_patching``.

    Returns:
        DataArray (prompt, layer, head | component), or a Dataset for level="all".
    """
    levels = ("head", "block") if level == "all" else (level,)
    inputs_by_level = {
        lvl: prepare(model, prompts, metric=metric, level=lvl, backend=backend,
                     batch_size=batch_size, padding_side=padding_side, needs_corrupt=True)
        for lvl in levels}
    inputs = inputs_by_level[levels[0]]
    variants = {lvl: components(inp) for lvl, inp in inputs_by_level.items()}
    sites = [site for lvl in levels for site in _sites(variants[lvl])]
    runner = get_backend(model, backend)
    scores = {lvl: torch.full((len(inputs.prompts), len(variants[lvl])), float("nan"))
              for lvl in levels}
    for batch in tqdm(inputs.batches(), total=inputs.n_batches(), disable=not progress,
                      desc="attribution patching"):
        with torch.no_grad():
            clean = runner.run(batch.clean, sites=sites).acts
        corrupt = runner.run(batch.corrupt, sites=sites, grad=True)
        value = metrics.compute(metric, corrupt.logits, batch.target, batch.distractor)
        metrics.check_finite(value, batch.index, metric)
        grads = dict(zip(sites, torch.autograd.grad(value.sum(), [corrupt.acts[s] for s in sites])))
        mask = batch.corrupt.attention_mask.to(value.dtype)
        for lvl in levels:
            columns = []
            for site in _sites(variants[lvl]):
                delta = (clean[site] - corrupt.acts[site].detach()).float()
                product = delta * grads[site].float()
                if site[0] == "z":  # (batch, pos, head, d_head) -> (batch, head)
                    columns.append(torch.einsum("bphd,bp->bh", product, mask))
                else:  # (batch, pos, d_model) -> (batch, 1)
                    columns.append(torch.einsum("bpd,bp->b", product, mask)[:, None])
            scores[lvl][batch.index] = metrics.check_finite(
                torch.cat(columns, dim=1).cpu(), batch.index, metric)
    results = {lvl: to_dataarray(inputs_by_level[lvl], scores[lvl],
                                 method="attribution_patching",
                                 effect="Attribution patching (clean -> corrupt) of")
               for lvl in levels}
    return xr.Dataset(results) if level == "all" else results[level]
