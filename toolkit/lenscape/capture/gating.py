"""Causal head gating (CHG): learn which heads a task needs, with the model frozen.

Every query head gets a gate G = sigmoid(g) in [0, 1] that scales its output before the
output projection. Gate logits g are fitted to the next-token loss on the task's target
tokens, with a regulariser that pushes all gates open or shut:

    loss = NLL(targets) - lam * mean(clip(g, -4, 4))

Stage 0 fits with lam = 0 from a seeded random start; from there, lam = +lambda_ gives
G+ (gates stay open unless a head hurts) and lam = -lambda_ gives G- (gates close unless a
head is needed). Per head: facilitation = G-, interference = 1 - G+, irrelevance =
G+ * (1 - G-). Repeating over seeds separates robust roles from accidents of the start
("Always" vs "Any" in ``lenscape.aggregate``). All seeds, and the two signed stages, train
together: each gate set owns its own rows of one stacked batch.

Reference: "Causal Head Gating" (arXiv 2505.13737).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import schema
from ..data import PromptSet
from ..models import LensModel
from ._inputs import _as_prompt_set

CLIP = 4.0


def _encode(model: LensModel, prompts: PromptSet) -> list[tuple[list[int], int]]:
    """Per prompt: token ids of text + target, and how many of them are target tokens."""
    tok = model.tokenizer
    out = []
    for i, p in enumerate(prompts):
        target = tok(p.target, add_special_tokens=False)["input_ids"]
        if not p.target.strip() or not target:
            raise ValueError(f"Prompt {i} has an empty target; head gating scores the loss "
                             "on target tokens, so every prompt needs a non-empty target.")
        out.append((tok(p.text)["input_ids"] + target, len(target)))
    return out


def _pad(items: list[tuple[list[int], int]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Right-pad; returns input_ids, attention_mask (rows, pos) and the target mask marking
    the positions whose *next* token is a target token (rows, pos)."""
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    predicts = torch.zeros((len(items), width), dtype=torch.bool)
    for row, (seq, n_target) in enumerate(items):
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
        predicts[row, len(seq) - 1 - n_target:len(seq) - 1] = True
    return ids.to(device), mask.to(device), predicts.to(device)


class _Gates:
    """Installs o_proj pre-hooks that scale each row's heads by its gate set's gates."""

    def __init__(self, model: LensModel):
        self.model = model
        self.row_gates: torch.Tensor | None = None  # (rows, layer, head)

    def __enter__(self) -> _Gates:
        spec = self.model.spec

        def hook(layer):
            def scale(module, args):
                z = args[0]
                shape = z.shape
                gates = self.row_gates[:, layer].to(z.dtype)[:, None, :, None]
                z = (z.view(*shape[:2], spec.n_heads, spec.d_head) * gates).reshape(shape)
                return (z, *args[1:])
            return scale
        self.handles = [self.model.module(spec.layout.o_proj, layer).register_forward_pre_hook(
            hook(layer)) for layer in range(spec.n_layers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def _nll(model: LensModel, gates: _Gates, gate_values: torch.Tensor,
         rows: list[tuple[list[int], int]]) -> torch.Tensor:
    """Mean target NLL per gate set.

    Args:
        gate_values: (sets, layer, head); ``rows`` holds ``len(rows) // sets`` items per set.

    Returns:
        (sets,) mean NLL over each set's target tokens.
    """
    sets = gate_values.shape[0]
    per_set = len(rows) // sets
    ids, mask, predicts = _pad(rows, model.tokenizer.pad_token_id, model.device)
    gates.row_gates = gate_values.repeat_interleave(per_set, dim=0)
    logits = model.hf(input_ids=ids, attention_mask=mask, logits_to_keep=predicts).logits
    # logits_to_keep with a bool mask returns the kept positions flattened, row by row.
    next_ids = torch.roll(ids, -1, dims=1)[predicts]
    nll = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                            next_ids, reduction="none")
    row_of = torch.arange(len(rows), device=model.device)[:, None].expand_as(predicts)[predicts]
    set_of = row_of // per_set
    totals = torch.zeros(sets, device=model.device).index_add(0, set_of, nll)
    counts = torch.zeros(sets, device=model.device).index_add(0, set_of, torch.ones_like(nll))
    return totals / counts


def _fit(model, gates, logits: torch.Tensor, signs: torch.Tensor, items, *, lambda_: float,
         steps: int, lr: float, batch_size: int, generator: torch.Generator, bar) -> torch.Tensor:
    """Adam on gate logits (sets, layer, head); set ``k`` uses regulariser sign ``signs[k]``."""
    logits = logits.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=lr)
    sets = logits.shape[0]
    for _ in range(steps):
        picks = torch.randint(len(items), (sets, batch_size), generator=generator)
        rows = [items[i] for i in picks.flatten().tolist()]
        nll = _nll(model, gates, torch.sigmoid(logits), rows)
        reg = logits.clamp(-CLIP, CLIP).mean(dim=(1, 2))
        loss = (nll - signs * lambda_ * reg).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        bar.update()
    return logits.detach()


@torch.no_grad()
def _validation_loss(model, gates, gate_values: torch.Tensor, items, batch_size: int) -> torch.Tensor:
    """(sets,) mean target NLL over all validation items, for each gate set."""
    total = torch.zeros(gate_values.shape[0], device=model.device)
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        nll = _nll(model, gates, gate_values, chunk * gate_values.shape[0])
        total += nll * len(chunk)
    return total / len(items)


def task_loss(model: LensModel, prompts, gates: torch.Tensor | None = None, *,
              batch_size: int = 8) -> torch.Tensor:
    """Mean target NLL of ``prompts`` under each gate set: a causal check of gate results.

    Args:
        gates: (sets, layer, head) values in [0, 1] scaling each head's output (0 ablates
            it); default: one set of all-ones (the unmodified model).

    Returns:
        (sets,) mean NLL per gate set, in nats.
    """
    spec = model.spec
    gates = torch.ones(1, spec.n_layers, spec.n_heads) if gates is None else torch.as_tensor(gates)
    if gates.dim() != 3 or tuple(gates.shape[1:]) != (spec.n_layers, spec.n_heads):
        raise ValueError(f"gates must have shape (sets, {spec.n_layers}, {spec.n_heads}), "
                         f"got {tuple(gates.shape)}.")
    items = _encode(model, _as_prompt_set(prompts))
    with _Gates(model) as hooks:
        return _validation_loss(model, hooks, gates.float().to(model.device), items,
                                batch_size).cpu()


def head_gating(model: LensModel, task, *, seeds: int | Sequence[int] = 5,
                lambda_: float = 0.1, steps: int = 60, lr: float = 0.2, batch_size: int = 4,
                validation=None, progress: bool = True) -> xr.Dataset:
    """Fit causal head gates on a task and score every head's role.

    Args:
        model: a ``LensModel``.
        task: prompts whose ``target`` is the answer (one or more tokens), e.g.
            ``lsc.data.task("math")``; the loss is on target tokens only.
        seeds: number of seeds (0..n-1) or an explicit list; each seed draws its own random
            start and minibatches.
        lambda_: regulariser strength (>= 0).
        steps: Adam steps per stage (stage 0, then the +/- stages together).
        lr: Adam learning rate on gate logits.
        batch_size: prompts per gate set per step.
        validation: prompts for the validation loss (default: the task itself).
        progress: show a progress bar.

    Returns:
        Dataset over (seed, layer, head) with ``facilitation``, ``interference``,
        ``irrelevance``, the gates ``gate`` (stage 0), ``gate_plus``, ``gate_minus``, and
        ``val_loss``/``val_loss_plus``/``val_loss_minus`` over (seed,); settings and the
        ungated validation loss in attrs.
    """
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if len(seed_list) < 1:
        raise ValueError(f"seeds must be at least 1 (got {seeds!r}); Always/Any need >= 2.")
    if lambda_ < 0:
        raise ValueError(f"lambda_ must be >= 0 (got {lambda_}); its sign is set per stage.")
    if steps < 1 or batch_size < 1:
        raise ValueError("steps and batch_size must be positive integers.")
    prompts = _as_prompt_set(task)
    if len(prompts) == 0:
        raise ValueError("The task has no prompts; use lsc.data.task('math') or pass prompts.")
    items = _encode(model, prompts)
    val_items = items if validation is None else _encode(model, _as_prompt_set(validation))
    spec = model.spec
    starts = torch.stack([torch.randn(spec.n_layers, spec.n_heads,
                                      generator=torch.Generator().manual_seed(s))
                          for s in seed_list]).to(model.device)
    generator = torch.Generator().manual_seed(seed_list[0])
    n = len(seed_list)
    bar = tqdm(total=2 * steps, disable=not progress, desc=f"head gating ({n} seeds)")
    with _Gates(model) as gates:
        base = _fit(model, gates, starts, torch.zeros(n, device=model.device), items,
                    lambda_=lambda_, steps=steps, lr=lr, batch_size=batch_size,
                    generator=generator, bar=bar)
        signs = torch.tensor([1.0] * n + [-1.0] * n, device=model.device)
        signed = _fit(model, gates, base.repeat(2, 1, 1), signs, items, lambda_=lambda_,
                      steps=steps, lr=lr, batch_size=batch_size, generator=generator, bar=bar)
        all_gates = torch.sigmoid(torch.cat([base, signed]))
        val = _validation_loss(model, gates, torch.cat([all_gates, torch.ones_like(base[:1])]),
                               val_items, batch_size)
    bar.close()
    g0, g_plus, g_minus = all_gates[:n], all_gates[n:2 * n], all_gates[2 * n:]
    attrs = {"method": "head_gating", "metric": "loss", "model": model.name, "backend": "torch",
             "dtype": str(model.dtype).removeprefix("torch."), "architecture": spec.architecture,
             "prompt_set": prompts.name, "n_prompts": len(prompts), "n_seeds": n,
             "lambda_": float(lambda_), "steps": steps, "lr": lr, "batch_size": batch_size,
             "clip": CLIP, "val_loss_ungated": float(val[-1])}
    coords = {"seed": seed_list}

    def score(values, long_name, units="gate"):
        return schema.make(values, dims=("seed", "layer", "head"), coords=coords,
                           attrs={**attrs, "long_name": long_name, "units": units},
                           n_layers=spec.n_layers)

    def loss(values, long_name):
        return schema.make(values, dims=("seed",), coords=coords,
                           attrs={**attrs, "long_name": long_name, "units": "nats"})
    data = {
        "facilitation": score(g_minus, "Facilitation (G-)", "score"),
        "interference": score(1 - g_plus, "Interference (1 - G+)", "score"),
        "irrelevance": score(g_plus * (1 - g_minus), "Irrelevance (G+ (1 - G-))", "score"),
        "gate": score(g0, "Gate, stage 0 (lambda = 0)"),
        "gate_plus": score(g_plus, "Gate G+ (+lambda)"),
        "gate_minus": score(g_minus, "Gate G- (-lambda)"),
        "val_loss": loss(val[:n], "Validation loss, stage-0 gates"),
        "val_loss_plus": loss(val[n:2 * n], "Validation loss, G+"),
        "val_loss_minus": loss(val[2 * n:3 * n], "Validation loss, G-"),
    }
    return xr.Dataset(data, attrs=attrs)
