"""Per-cluster block masks: which attention and MLP blocks can each kind of input skip?

Every cluster gets one hard-concrete gate per block (2 x n_layers: attention and MLP;
Louizos et al. 2018, as in IG-Pruning, arXiv 2511.02213). A gate scales the block's
contribution to the residual stream, so a gate of 0 skips the block and the residual passes
through. With the model frozen, gate parameters are fitted to

    loss = NLL(next token, whole text) + penalty * (expected share of open gates - keep)^2

where keep = 1 - target_sparsity. All clusters train in one stacked batch: each row uses its
own cluster's gates. The final mask keeps the round((1 - target_sparsity) x 2L) blocks with
the largest gate logits, so every cluster meets the target exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import schema
from ..cluster import Clustering
from ..data import PromptSet
from ..models import LensModel

BETA, GAMMA, ZETA = 2 / 3, -0.1, 1.1  # hard-concrete temperature and stretch
COMPONENTS = schema.BLOCK_COMPONENTS  # ("attn", "mlp")


def _block_paths(model: LensModel) -> dict[str, str]:
    layout = model.spec.layout
    return {"attn": layout.attn_out, "mlp": layout.mlp_out}


@contextlib.contextmanager
def _scaled_blocks(model: LensModel, row_scale) -> Iterator[None]:
    """Scale each block's output per row: ``row_scale()`` -> (rows, layer, component)."""
    tuple_attn = model.spec.layout.attn_out_tuple
    handles = []
    for layer in range(model.spec.n_layers):
        for c, (name, path) in enumerate(_block_paths(model).items()):
            def hook(module, args, output, layer=layer, c=c, is_tuple=tuple_attn and name == "attn"):
                scale = row_scale()[:, layer, c].to(
                    (output[0] if is_tuple else output).dtype)[:, None, None]
                if is_tuple:
                    return (output[0] * scale, *output[1:])
                return output * scale
            handles.append(model.module(path, layer).register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _check_mask(model: LensModel, mask: xr.DataArray) -> torch.Tensor:
    """(layer, component) mask -> (layer, 2) float tensor, with clear shape errors."""
    spec = model.spec
    if set(mask.dims) != {"layer", "component"}:
        raise ValueError(f"The mask has dims {mask.dims}; apply_mask needs (layer, component). "
                         "Pick one cluster first, e.g. masks['mask'].sel(cluster=0).")
    if mask.sizes["layer"] != spec.n_layers or list(mask["component"].values) != list(COMPONENTS):
        raise ValueError(f"The mask has {mask.sizes['layer']} layers and components "
                         f"{list(mask['component'].values)}; {model.name} needs "
                         f"{spec.n_layers} layers and {list(COMPONENTS)}.")
    return torch.as_tensor(mask.transpose("layer", "component").values.astype(np.float32))


@contextlib.contextmanager
def apply_mask(model: LensModel, mask: xr.DataArray) -> Iterator[LensModel]:
    """Run ``model`` with the blocks where ``mask`` is 0/False skipped (residual passes).

    Args:
        mask: (layer, component) binary DataArray, e.g. ``masks["mask"].sel(cluster=3)``.
    """
    scale = _check_mask(model, mask).to(model.device)[None]
    with _scaled_blocks(model, lambda: scale):
        yield model


def _encode(model: LensModel, prompts: PromptSet) -> list[list[int]]:
    return [model.tokenizer(p.text + p.target)["input_ids"] for p in prompts]


def _nll_per_row(model: LensModel, rows: list[list[int]]) -> torch.Tensor:
    """Mean next-token NLL of each row (rows,) (right padding, real tokens only)."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), model.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(rows):
        ids[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq), 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    logits = model.hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    weight = mask[:, 1:].float()
    return (nll * weight).sum(1) / weight.sum(1)


@torch.no_grad()
def masked_loss(model: LensModel, prompts: PromptSet, masks: torch.Tensor | xr.DataArray, *,
                batch_size: int = 16) -> torch.Tensor:
    """Mean NLL of ``prompts`` under each of several masks (sets, layer, component) -> (sets,)."""
    if isinstance(masks, xr.DataArray):
        masks = torch.as_tensor(masks.transpose(..., "layer", "component").values)
    masks = torch.as_tensor(masks, dtype=torch.float32).reshape(-1, model.spec.n_layers, 2)
    items = _encode(model, prompts)
    totals = torch.zeros(len(masks))
    current: dict[str, torch.Tensor] = {}
    with _scaled_blocks(model, lambda: current["scale"]):
        for s, mask in enumerate(masks):
            for start in range(0, len(items), batch_size):
                chunk = items[start:start + batch_size]
                current["scale"] = mask.to(model.device)[None].expand(len(chunk), -1, -1)
                totals[s] += _nll_per_row(model, chunk).sum().cpu()
    return totals / len(items)


def block_masks(model: LensModel, prompts: PromptSet, *, clusters: Clustering,
                target_sparsity: float = 0.3, steps: int = 100, lr: float = 0.25,
                penalty: float = 10.0, seed: int = 0, batch_size: int = 2,
                progress: bool = True) -> xr.Dataset:
    """Learn one block mask per cluster.

    Args:
        model: a ``LensModel`` (frozen).
        prompts: the texts that were clustered (same order as ``clusters.labels``).
        clusters: from ``lenscape.cluster.kmeans``.
        target_sparsity: share of the 2 x n_layers blocks to skip, in (0, 1).
        steps: Adam steps; lr: its learning rate; penalty: weight of the sparsity term.
        seed: seeds gate noise and minibatches (same seed -> same masks).
        batch_size: texts per cluster per step.

    Returns:
        Dataset over (cluster, layer, component): ``mask`` (bool, True = kept) and
        ``keep_prob`` (probability that the gate is open); settings in attrs.
    """
    if not 0 < target_sparsity < 1:
        raise ValueError(f"target_sparsity must lie in (0, 1), got {target_sparsity}.")
    labels = clusters.labels.values
    if len(labels) != len(prompts):
        raise ValueError(f"The clustering has {len(labels)} prompts but {len(prompts)} were "
                         "given; pass the prompts that were clustered.")
    items = _encode(model, prompts)
    members = [np.flatnonzero(labels == c) for c in range(clusters.k)]
    empty = [c for c, m in enumerate(members) if len(m) == 0]
    if empty:
        raise ValueError(f"Cluster(s) {empty} have no prompts; re-cluster with a smaller k.")
    spec, k = model.spec, clusters.k
    generator = torch.Generator().manual_seed(seed)
    log_alpha = torch.full((k, spec.n_layers, 2), 2.0, device=model.device, requires_grad=True)
    optimizer = torch.optim.Adam([log_alpha], lr=lr)
    keep = 1 - target_sparsity
    current: dict[str, torch.Tensor] = {}
    bar = tqdm(total=steps, disable=not progress, desc=f"block masks ({k} clusters)")
    with _scaled_blocks(model, lambda: current["scale"]):
        for _ in range(steps):
            picks = [m[torch.randint(len(m), (batch_size,), generator=generator).numpy()]
                     for m in members]
            rows = [items[i] for pick in picks for i in pick]
            u = torch.rand(k, spec.n_layers, 2, generator=generator).clamp(1e-6, 1 - 1e-6)
            s = torch.sigmoid((u.log() - (1 - u).log() + log_alpha.cpu()) / BETA)
            gates = (s * (ZETA - GAMMA) + GAMMA).clamp(0, 1).to(model.device)
            current["scale"] = gates.repeat_interleave(batch_size, dim=0)
            open_prob = torch.sigmoid(log_alpha - BETA * np.log(-GAMMA / ZETA))
            sparsity_term = (open_prob.mean(dim=(1, 2)) - keep) ** 2
            nll = _nll_per_row(model, rows).view(k, batch_size).mean(1)
            loss = (nll + penalty * sparsity_term).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            bar.update()
    bar.close()
    with torch.no_grad():
        keep_prob = torch.sigmoid(log_alpha - BETA * np.log(-GAMMA / ZETA)).cpu()
    attrs = {"method": "block_masks", "metric": "loss", "model": model.name, "backend": "torch",
             "dtype": str(model.dtype).removeprefix("torch."), "architecture": spec.architecture,
             "prompt_set": prompts.name, "n_prompts": len(prompts), "k": k,
             "target_sparsity": float(target_sparsity), "steps": steps, "lr": lr,
             "penalty": penalty, "seed": seed, "batch_size": batch_size}
    dims, coords = ("cluster", "layer", "component"), {"component": list(COMPONENTS)}
    # Keep exactly round(keep * 2L) blocks per cluster, ranked by gate logit (thresholding the
    # clamped gates at 0.5 kept about 85% of blocks for a 70% target: many saturate at 1).
    n_keep = int(round(keep * 2 * spec.n_layers))
    order = log_alpha.detach().cpu().reshape(k, -1).argsort(dim=1, descending=True)
    kept = torch.zeros(k, 2 * spec.n_layers, dtype=torch.bool)
    kept.scatter_(1, order[:, :n_keep], True)
    mask = schema.make(kept.view(k, spec.n_layers, 2).numpy(), dims=dims, coords=coords,
                       attrs={**attrs, "long_name": "Block kept", "units": "bool"},
                       n_layers=spec.n_layers)
    prob = schema.make(keep_prob.numpy(), dims=dims, coords=coords,
                       attrs={**attrs, "long_name": "Probability the gate is open",
                              "units": "probability"}, n_layers=spec.n_layers)
    return xr.Dataset({"mask": mask, "keep_prob": prob}, attrs=attrs)
