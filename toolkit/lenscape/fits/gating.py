"""Causal head gating (CHG): learn which heads a task needs, with the model frozen.

Every query head gets a gate G = sigmoid(g) in [0, 1] that scales its output before the
output projection. Gate logits g are fitted to the next-token loss on the task's target
tokens, with a regulariser that pushes all gates open or shut:

    loss = NLL(targets) - lam * mean(clip(g, -4, 4))

The protocol follows the reference implementation (github.com/andrewnam/causal_head_gating,
``chg_trainer.py``): gates start uniform in (0, 1), Adam at learning rate 1.0 on batches of
32 items, each gate set's gradient clipped to norm 1.0, lambda 0.1. Stage 0 fits with
lam = 0; from its result, lam = +lambda_ gives G+ (gates stay open unless a head hurts) and
lam = -lambda_ gives G- (gates close unless a head is needed). Instead of a fixed number of
updates, a stage stops for a gate set when its gates stop moving (``optim.fit_until_still``).
Per head: facilitation = G-, interference = 1 - G+, irrelevance = G+ * (1 - G-).

Repeating over seeds separates robust roles from accidents of the start ("Always" vs "Any"
in ``lenscape.aggregate``). All seeds, and the two signed stages, train together: each gate
set owns its own rows of one stacked batch. ``gating_check`` tests the roles causally on
held-out items.

Reference: "Causal Head Gating" (arXiv 2505.13737).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import _validate, schema
from ..data import Prompts, PromptSet, as_prompt_set
from ..models import LensModel, in_one_call
from ..sweep import memory
from ..sweep.backend import Site, standing_edit
from ..sweep.inputs import pad
from ..sweep.options import DEFAULTS
from . import optim
from .optim import (
    MAX_FIT_BATCH,
    MAX_FIT_STEPS,
    Fit,
    Precision,
    Resume,
    check_precision,
    checkpoint_folder,
    fit_key,
    fit_passes,
    fit_plan,
    fit_until_still,
    sets_per_pass,
)

CLIP = 4.0
STAGES = ("stage0", "plus", "minus")
#: Stage 0's share of a fit's ``time_budget``: it fits one gate set per seed and the G+ and
#: G- stage two, so at equal updates stage 0 costs a third of the fit; the G+ and G- stage
#: gets the rest, with whatever stage 0 left unused.
STAGE0_SHARE = 1 / 3
#: Most seeds one fit takes: the reference and the recorded roles use 10, and 100 seeds
#: resolve "in what share of seeds" to 1%; each seed is three more gate sets in every pass.
MAX_SEEDS = 100
#: What made the results these functions take back (their ``method`` attr).
GATING_METHOD = "head_gating"
GATES_MADE_BY = "lsc.head_gating (e.g. gating['gate_plus'])"


def _encode(model: LensModel, prompts: PromptSet) -> list[tuple[list[int], int]]:
    """Per prompt: token ids of text + target, and how many of them are target tokens."""
    tok = model.tokenizer
    out = []
    for i, p in enumerate(prompts):
        target = tok(p.target, add_special_tokens=False)["input_ids"]
        if not p.target.strip() or not target:
            raise ValueError(
                f"Prompt {i} has an empty target; head gating scores the loss "
                "on target tokens, so every prompt needs a non-empty target."
            )
        out.append((tok(p.text)["input_ids"] + target, len(target)))
    return out


def _pad(items: list[tuple[list[int], int]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Right-pad (``inputs.pad``); returns input_ids, attention_mask (rows, pos) and the
    target mask marking the positions whose *next* token is a target token (rows, pos)."""
    tokens = pad([seq for seq, _ in items], pad_id, "right")
    predicts = torch.zeros(tokens.input_ids.shape, dtype=torch.bool)
    for row, (seq, n_target) in enumerate(items):
        predicts[row, len(seq) - 1 - n_target : len(seq) - 1] = True
    return tokens.input_ids.to(device), tokens.attention_mask.to(device), predicts.to(device)


class _Gates:
    """Scales each row's heads by ``row_gates`` (rows, layer, head): a standing edit of the
    ``z`` sites (head outputs entering the output projection) while the block is active."""

    def __init__(self, model: LensModel):
        self.model = model
        self.row_gates: torch.Tensor | None = None
        self._edit = contextlib.ExitStack()

    def _scale(self, site: Site, z: torch.Tensor) -> torch.Tensor:
        assert self.row_gates is not None, "set row_gates before a gated pass"
        return z * self.row_gates[:, site[1]].to(z.dtype)[:, None, :, None]

    def __enter__(self) -> _Gates:
        sites = [("z", layer) for layer in range(self.model.spec.n_layers)]
        self._edit.enter_context(standing_edit(self.model, sites, self._scale))
        return self

    def __exit__(self, *exc) -> None:
        self._edit.close()


def _row_nll(
    model: LensModel, gates: _Gates, row_gates: torch.Tensor, rows: list[tuple[list[int], int]]
) -> torch.Tensor:
    """Mean NLL over each row's target tokens, with row ``i`` gated by ``row_gates[i]``.

    Args:
        row_gates: (rows, layer, head) gate values.

    Returns:
        (rows,) mean NLL per row, in nats.
    """
    ids, mask, predicts = _pad(rows, model.tokenizer.pad_token_id, model.device)
    gates.row_gates = row_gates
    logits = model.hf(input_ids=ids, attention_mask=mask, logits_to_keep=predicts).logits
    # logits_to_keep with a bool mask returns the kept positions flattened, row by row.
    next_ids = torch.roll(ids, -1, dims=1)[predicts]
    nll = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), next_ids, reduction="none"
    )
    row_of = torch.arange(len(rows), device=model.device)[:, None].expand_as(predicts)[predicts]
    totals = torch.zeros(len(rows), device=model.device).index_add(0, row_of, nll)
    return totals / predicts.sum(1)


class _Batches:
    """Per gate set, minibatches drawn by reshuffling the items every epoch (seeded)."""

    def __init__(self, n_items: int, keys: Sequence[tuple[int, ...]], batch_size: int):
        self.n_items, self.batch_size = n_items, batch_size
        self.rngs = [np.random.default_rng(list(key)) for key in keys]
        self.queues: list[list[int]] = [[] for _ in keys]

    def next(self, set_index: int) -> list[int]:
        queue = self.queues[set_index]
        while len(queue) < self.batch_size:
            queue += self.rngs[set_index].permutation(self.n_items).tolist()
        picked, self.queues[set_index] = queue[: self.batch_size], queue[self.batch_size :]
        return picked

    def get_state(self) -> dict[str, Any]:
        """Where each set is in its shuffled order (for ``optim.Resume``)."""
        return {
            "rngs": [rng.bit_generator.state for rng in self.rngs],
            "queues": [list(queue) for queue in self.queues],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        for rng, saved in zip(self.rngs, state["rngs"], strict=True):
            rng.bit_generator.state = saved
        self.queues = [list(queue) for queue in state["queues"]]


def _stage(
    model: LensModel,
    gates: _Gates,
    start: torch.Tensor,
    signs: torch.Tensor,
    items,
    batches: _Batches,
    *,
    lambda_: float,
    lr: float,
    grad_clip: float,
    max_steps: int,
    window: int,
    tol: float,
    rows_per_pass: int,
    bar,
    resume: tuple[Path, dict[str, Any]] | None = None,
    deadline: float | None = None,
):
    """Fit stacked gate logits (sets, layer, head) until each set's gates stop moving.

    Set ``k`` uses regulariser ``-signs[k] * lambda_ * mean(clip(g_k))`` and its own batches.
    Rows go through the model ``rows_per_pass`` at a time, backward after each pass.
    ``resume``: (state file, key) to keep the stage's state in (``optim.Resume``);
    ``deadline``: an ``optim.clock()`` time the stage's updates stop at (or None).
    """
    per_pass = sets_per_pass(rows_per_pass, batches.batch_size)

    def loss_and_grad(logits: torch.Tensor, active: list[int]) -> torch.Tensor:
        losses = []
        picks = {k: batches.next(k) for k in active}
        for first in range(0, len(active), per_pass):
            chunk = active[first : first + per_pass]
            rows = [items[i] for k in chunk for i in picks[k]]
            part = logits[chunk]
            row_gates = torch.sigmoid(part).repeat_interleave(batches.batch_size, dim=0)
            nll = _row_nll(model, gates, row_gates, rows).view(len(chunk), -1).mean(1)
            reg = part.clamp(-CLIP, CLIP).mean(dim=(1, 2))
            loss = nll - signs[chunk].to(nll.device) * lambda_ * reg
            loss.sum().backward()
            losses.append(loss.detach().cpu())
        return torch.cat(losses)

    return fit_until_still(
        start,
        loss_and_grad,
        watch=torch.sigmoid,
        lr=lr,
        grad_clip=grad_clip,
        max_steps=max_steps,
        window=window,
        tol=tol,
        on_step=bar.update,
        resume=None if resume is None else Resume(*resume, batches.get_state, batches.set_state),
        deadline=deadline,
    )


@torch.no_grad()
def _validation_loss(
    model, gates, gate_values: torch.Tensor, items, batch_size: int
) -> torch.Tensor:
    """(sets,) mean over validation items of the per-item target NLL, for each gate set."""
    sets = gate_values.shape[0]
    total = torch.zeros(sets, device=model.device)
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        nll = _row_nll(model, gates, gate_values.repeat_interleave(len(chunk), dim=0), chunk * sets)
        total += nll.view(sets, len(chunk)).sum(1)
    return total / len(items)


def _grid(model: LensModel) -> dict[str, range]:
    """The model's own (layer, head) labels, to read gate results by."""
    return {"layer": range(model.spec.n_layers), "head": range(model.spec.n_heads)}


def _check_gates(model: LensModel, gates) -> torch.Tensor:
    spec = model.spec
    gates = torch.ones(1, spec.n_layers, spec.n_heads) if gates is None else torch.as_tensor(gates)
    if gates.dim() != 3 or tuple(gates.shape[1:]) != (spec.n_layers, spec.n_heads):
        raise ValueError(
            f"gates must have shape (sets, {spec.n_layers}, {spec.n_heads}), "
            f"got {tuple(gates.shape)}."
        )
    return gates.float().to(model.device)


@in_one_call
@contextlib.contextmanager
def heads_off(model: LensModel, heads: Any) -> Iterator[LensModel]:
    """Within the block every forward pass of ``model`` runs with ``heads`` switched off
    (gate 0: each one's output before the output projection is zero), on every backend
    and in direct ``model.hf`` calls; yields ``model``.

    Args:
        heads: (layer, head) pairs, e.g. ``[(17, 3), (18, 6)]``, or a (layer, head) bool
            DataArray, True where a head is off (read by label: any transpose).

    Raises:
        ValueError: a pair that is not two ints naming a head of the model, or a mask
            whose labels are not the model's layers and heads.
    """
    spec = model.spec
    if isinstance(heads, xr.DataArray):
        expected = {"layer": range(spec.n_layers), "head": range(spec.n_heads)}
        off = _validate.labels("heads", heads, expected, made_by="a (layer, head) bool mask")
        if off.dims != ("layer", "head") or off.dtype != bool:
            raise ValueError(
                f"heads must be a bool (layer, head) DataArray, True where a head is off; "
                f"got dims {heads.dims} of dtype {heads.dtype}. For example "
                "heads=scores.mean('prompt') > 0.3."
            )
        pairs = [(int(layer), int(head)) for layer, head in np.argwhere(off.values)]
    elif isinstance(heads, (list, tuple, set)):
        pairs = [_head_pair(spec.n_layers, spec.n_heads, pair) for pair in heads]
    else:
        raise ValueError(
            f"heads takes a list of (layer, head) pairs or a (layer, head) bool DataArray, "
            f"got {type(heads).__name__}; for example heads=[(17, 3), (18, 6)]."
        )
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        by_layer.setdefault(layer, []).append(head)

    def zeroed(site: Site, z: torch.Tensor) -> torch.Tensor:
        z = z.clone()
        z[:, :, by_layer[site[1]]] = 0
        return z

    sites = [("z", layer) for layer in sorted(by_layer)]
    with standing_edit(model, sites, zeroed) if sites else contextlib.nullcontext():
        yield model


def _head_pair(n_layers: int, n_heads: int, pair: Any) -> tuple[int, int]:
    """``pair`` as (layer, head), checked to name a head of a model of that size."""
    ints = (
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in pair)
    )
    if not ints or not (0 <= pair[0] < n_layers and 0 <= pair[1] < n_heads):
        raise ValueError(
            f"heads takes (layer, head) pairs of ints with layer in 0..{n_layers - 1} and "
            f"head in 0..{n_heads - 1}; got {pair!r}. For example heads=[(17, 3), (18, 6)]."
        )
    return int(pair[0]), int(pair[1])


def task_loss(
    model: LensModel,
    prompts: Prompts,
    gates: torch.Tensor | xr.DataArray | None = None,
    *,
    batch_size: int = 8,
) -> torch.Tensor:
    """Mean target NLL of ``prompts`` under each gate set: a causal check of gate results.

    Args:
        gates: (sets, layer, head) values in [0, 1] scaling each head's output (0 ablates
            it): a tensor or array in the model's layer and head order, or a DataArray of
            ``head_gating`` (e.g. ``gating["gate_plus"]``), read by its ``layer`` and
            ``head`` labels (any order, any transpose), whose other dims (``seed``) are
            the sets, flattened in the order given; default: one set of all-ones (the
            unmodified model).

    Returns:
        (sets,) mean over prompts of each prompt's mean NLL on its target tokens, in nats.

    Raises:
        TypeError: gates that are not numbers (a Dataset: pick one of its gate variables).
        ValueError: gates outside [0, 1] or NaN, gates of another method or from another
            model, a DataArray whose layers or heads are not the model's, no prompts.
    """
    batch_size = _validate.positive_int("batch_size", batch_size)
    _validate.not_empty("prompts", as_prompt_set(prompts), fix="pass at least one prompt")
    given: Any = gates
    if isinstance(gates, (xr.DataArray, xr.Dataset)):
        _validate.result(
            "gates",
            gates,
            kind=xr.DataArray,
            made_by=GATES_MADE_BY,
            origin=model.origin,
            dims=("layer", "head"),
            methods=(GATING_METHOD,),
        )
        given = _validate.labels("gates", gates, _grid(model), made_by=GATES_MADE_BY).values
    if given is not None:
        given = torch.as_tensor(
            _validate.values(
                "gates", given, low=0, high=1, fix="pass gate values in [0, 1] (0 removes a head)"
            ),
            dtype=torch.float32,
        )
    sets = _check_gates(model, given)
    items = _encode(model, as_prompt_set(prompts))
    with _Gates(model) as hooks:
        return _validation_loss(model, hooks, sets, items, batch_size).cpu()


def check_seeds(seeds: Any) -> list[int]:
    """Head gating's seeds: a number of seeds or a list (``_validate.seed_list``), at most
    ``MAX_SEEDS`` of them.

    Raises:
        TypeError: neither an integer nor a list of integers.
        ValueError: no seeds, a negative or repeated seed, or more than ``MAX_SEEDS``.
    """
    seed_list = _validate.seed_list("seeds", seeds)
    if len(seed_list) > MAX_SEEDS:
        raise ValueError(
            f"seeds asks for {len(seed_list)} seeds, more than MAX_SEEDS={MAX_SEEDS} (each "
            "seed is three more gate sets in every pass); the reference uses 10."
        )
    return seed_list


def _gating_plan(
    model: LensModel,
    items: list[tuple[list[int], int]],
    val_items: list[tuple[list[int], int]],
    n_seeds: int,
    *,
    batch_size: int,
    rows_per_pass: int,
    precision: Precision,
) -> memory.Estimate:
    """The memory plan of a gating fit: a pass stacks the rows of as many gate sets as
    ``rows_per_pass`` allows (the G+ and G- sets of every seed train together) and keeps its
    graph (the gated head outputs too) for the backward; the validation runs every gate
    set's rows without gradients."""
    spec = model.spec
    dtype = torch.bfloat16 if precision == "bfloat16" else None  # the fit's autocast
    e = memory.element_bytes(dtype or model.dtype)
    width = max(len(ids) for ids, _ in [*items, *val_items])
    targets = max(n for _, n in [*items, *val_items])
    val_rows = (3 * n_seeds + 1) * min(batch_size, len(val_items))

    def need(rows: int) -> memory.Need:
        gated = spec.n_layers * rows * width * spec.n_heads * spec.d_head * e
        logits = memory.loss_logits(model, rows * targets, dtype=dtype)
        fit = memory.Need(
            activations=memory.gradient_pass(model, rows, width, dtype=dtype) + logits,
            buffers=gated,
            optimizer=3 * n_seeds * spec.n_layers * spec.n_heads * 4 * 4,  # gates, Adam
        )
        validation = memory.Need(
            activations=memory.forward_pass(model, val_rows, width)
            + val_rows * targets * spec.vocab_size * 4 * 2
        )
        return memory.largest(fit, validation)

    plan = fit_plan(
        model,
        "head_gating",
        need,
        n_prompts=len(items),
        width=width,
        n_sets=2 * n_seeds,
        batch_size=batch_size,
        rows_per_pass=rows_per_pass,
    )
    return memory.fit_ways(plan, batch_size=batch_size, autocast=precision == "bfloat16")


@memory.estimator("head_gating")
def _gating_estimate(model: LensModel, task: Prompts, options: dict[str, Any]) -> memory.Estimate:
    """``lsc.estimate`` of ``head_gating(model, task, **options)``.

    Raises:
        TypeError: an option ``head_gating`` does not take; as ``head_gating``'s checks.
    """
    given = inspect.signature(head_gating).bind(model, task, **options)
    given.apply_defaults()
    arguments = given.arguments
    items = _encode(model, as_prompt_set(task, name="task"))
    validation = arguments["validation"]
    return _gating_plan(
        model,
        items,
        items if validation is None else _encode(model, as_prompt_set(validation)),
        len(check_seeds(arguments["seeds"])),
        batch_size=_validate.integer(
            "batch_size", arguments["batch_size"], low=1, high=MAX_FIT_BATCH
        ),
        rows_per_pass=_validate.positive_int("rows_per_pass", arguments["rows_per_pass"]),
        precision=check_precision(arguments["precision"]),
    )


#: ``head_gating``'s starts, as its ``init`` attr says them.
INITS = {"uniform": "gates uniform in (0, 1)", "half": "every gate 0.5"}


def _uniform_logits(seed: int, shape: tuple[int, int]) -> torch.Tensor:
    """Gate logits whose gates are uniform in (0, 1), drawn from ``seed``."""
    u = torch.rand(shape, generator=torch.Generator().manual_seed(seed)).clamp(1e-6, 1 - 1e-6)
    return torch.logit(u)


def _start_logits(init: str, seeds: list[int], shape: tuple[int, int]) -> torch.Tensor:
    """(seeds, layer, head) stage-0 logits: each seed's uniform draw, or 0 (gates 0.5)."""
    if init == "half":
        return torch.zeros(len(seeds), *shape)
    return torch.stack([_uniform_logits(seed, shape) for seed in seeds])


# long: the reference protocol's options, each checked before a fit of minutes
@in_one_call
def head_gating(
    model: LensModel,
    task: Prompts,
    *,
    seeds: int | Sequence[int] = 10,
    lambda_: float = 0.1,
    lr: float = 1.0,
    batch_size: int = 32,
    grad_clip: float = 1.0,
    max_steps: int = 500,
    window: int = 20,
    tol: float = 0.01,
    rows_per_pass: int = 64,
    validation: Prompts | None = None,
    precision: Precision = "float32",
    init: str = "uniform",
    checkpoint: str | Path | None = None,
    time_budget: float | None = None,
    progress: bool = DEFAULTS.progress,
) -> xr.Dataset:
    """Fit causal head gates on a task at the reference protocol and score every head's role.

    Args:
        model: a ``LensModel``.
        task: prompts whose ``target`` is the answer (one or more tokens), e.g.
            ``lsc.data.task("math")``; the loss is on target tokens only.
        seeds: number of seeds (0..n-1) or an explicit list (at most ``MAX_SEEDS``); each
            seed draws its own uniform start and its own minibatches.
        lambda_: regulariser strength (>= 0) on gate logits clamped to +-4.
        lr: Adam learning rate on gate logits (reference: 1.0).
        batch_size: items per gate set per update (reference: 32; at most
            ``optim.MAX_FIT_BATCH``).
        grad_clip: maximum gradient norm of each gate set (reference: 1.0).
        max_steps: most updates per stage (the reference example runs 500; at most
            ``optim.MAX_FIT_STEPS``).
        window: convergence is checked every ``window`` updates ...
        tol: ... and a gate set's stage ends when the mean absolute change of its gates
            over the last window is below ``tol``.
        rows_per_pass: rows per forward/backward pass (memory bound; results do not depend
            on it beyond float rounding).
        validation: held-out prompts for the validation loss (default: the task itself).
        precision: ``"float32"`` or ``"bfloat16"`` (the fit's forward and backward passes
            under bfloat16 autocast, as the reference trainer's mixed precision; gates,
            Adam and the validation losses stay float32). benchmarks/RESULTS.md records
            how much faster it is and how well its roles agree with float32.
        init: where stage 0 starts. ``"uniform"`` (reference): each seed draws its gates
            uniform in (0, 1). ``"half"``: every gate starts at 0.5 and seeds differ only in
            their minibatches; a short fit then keeps no trace of a random start
            (benchmarks/RESULTS.md "Notebook 03's teaching fit" measures how much closer
            its roles come to the reference's).
        checkpoint: a folder where each stage keeps its state every ``window`` updates; a
            fit interrupted and started again with the same folder and arguments continues
            from its last check (same numbers at the same torch thread count). None keeps
            nothing. Other files in the folder are ignored.
        time_budget: seconds the fit's updates may take (wall time; encoding the prompts
            and the validation losses after the fit aside), or None for no budget. Stage 0
            may use a third of it (at equal updates it fits a third of the gate sets), the
            G+ and G- stage the rest; a stage whose budget is spent stops with its gate sets
            still moving, not converged (attrs ``stopped == "time budget"``; a
            ``TimeBudgetWarning`` and the ``longer_run`` attr say what a longer run would
            add). A fit that ends within its budget is the same as without one. The budget
            is not part of the checkpoint's key: with ``checkpoint``, a fit stopped by its
            budget continues from where it stopped when called again (with any budget);
            the G+ and G- stage then starts over from the continued stage 0.
        progress: show a progress bar.

    Returns:
        Dataset over (seed, layer, head) with ``facilitation``, ``interference``,
        ``irrelevance``, the gates ``gate`` (stage 0), ``gate_plus``, ``gate_minus``;
        over (seed,): ``val_loss``/``val_loss_plus``/``val_loss_minus`` and the updates
        used ``steps_stage0``/``steps_plus``/``steps_minus``; settings, the ungated
        validation loss, the most updates per stage (``steps_stage0``, ``steps_plus``,
        ``steps_minus``), whether every set converged (``converged``) and why the fit
        stopped (``stopped``: "still", "max_steps" or "time budget"; with a budget,
        ``time_budget`` and ``longer_run``) in attrs.

    Raises:
        TypeError, ValueError: an option of the wrong type or out of range (more than
            ``MAX_SEEDS`` seeds, ``max_steps`` above ``optim.MAX_FIT_STEPS``, ``batch_size``
            above ``optim.MAX_FIT_BATCH``), an empty task.
        ValueError: a ``checkpoint`` folder holding the state of another fit (other model
            weights, prompts or settings: each difference is named) or a damaged state
            file; the message names the file and says to use a new folder or delete it.
        MemoryError: the fit needs more memory than is available (``lsc.estimate``), before
            anything is allocated; the message says what to change.
    """
    seed_list = check_seeds(seeds)
    lambda_ = _validate.number("lambda_", lambda_, low=0)  # its sign is set per stage
    lr = _validate.number("lr", lr, above=0)
    grad_clip = _validate.number("grad_clip", grad_clip, above=0)
    tol = _validate.number("tol", tol, low=0)
    max_steps = _validate.integer("max_steps", max_steps, low=1, high=MAX_FIT_STEPS)
    batch_size = _validate.integer("batch_size", batch_size, low=1, high=MAX_FIT_BATCH)
    window = _validate.positive_int("window", window)
    rows_per_pass = _validate.positive_int("rows_per_pass", rows_per_pass)
    progress = _validate.flag("progress", progress)
    if validation is not None:
        _validate.not_empty(
            "validation",
            as_prompt_set(validation, name="validation"),
            fix="pass held-out prompts, or None",
        )
    precision = check_precision(precision)
    init = _validate.choice("init", init, list(INITS))
    folder = checkpoint_folder(checkpoint)
    time_budget = optim.check_time_budget(time_budget)
    prompts = as_prompt_set(task, name="task")
    if len(prompts) == 0:
        raise ValueError("The task has no prompts; use lsc.data.task('math') or pass prompts.")
    items = _encode(model, prompts)
    val_items = items if validation is None else _encode(model, as_prompt_set(validation))
    memory.check(
        _gating_plan(
            model,
            items,
            val_items,
            len(seed_list),
            batch_size=batch_size,
            rows_per_pass=rows_per_pass,
            precision=precision,
        )
    )
    settings: dict[str, Any] = dict(
        lambda_=lambda_,
        lr=lr,
        grad_clip=grad_clip,
        max_steps=max_steps,
        window=window,
        tol=tol,
        rows_per_pass=rows_per_pass,
    )
    with _Gates(model) as gates:
        base, signed = _fit_stages(
            model,
            gates,
            items,
            seed_list,
            settings,
            batch_size=batch_size,
            precision=precision,
            init=init,
            folder=folder,
            deadlines=_deadlines(time_budget),
            progress=progress,
        )
        all_gates = torch.sigmoid(torch.cat([base.params, signed.params]))
        ungated = torch.ones_like(base.params[:1])
        val = _validation_loss(model, gates, torch.cat([all_gates, ungated]), val_items, batch_size)
    attrs = model.provenance(
        "head_gating",
        metric="loss",
        prompt_set=prompts.name,
        n_prompts=len(prompts),
        **_gating_attrs(settings, batch_size, precision, init, base, signed, val),
        **_budget_attrs(time_budget, base, signed, settings),
    )
    if attrs.get("longer_run"):
        warnings.warn(f"head_gating: {attrs['longer_run']}", optim.TimeBudgetWarning, stacklevel=2)
    return _gating_result(model, seed_list, all_gates, val, base, signed, attrs)


def _fit_stages(
    model: LensModel,
    gates: _Gates,
    items: list[tuple[list[int], int]],
    seed_list: list[int],
    settings: dict[str, Any],
    *,
    batch_size: int,
    precision: Precision,
    init: str,
    folder: Path | None,
    deadlines: tuple[float | None, float | None] = (None, None),
    progress: bool,
) -> tuple[Fit, Fit]:
    """Stage 0 (lambda 0) from each seed's start (``INITS[init]``), then G+ and G- from
    its result.

    Args:
        settings: ``_stage``'s options (lambda_, lr, grad_clip, max_steps, window, tol,
            rows_per_pass).
        folder: where each stage keeps its state (``optim.Resume``, keyed by the settings,
            the model's name, layout and weights fingerprint and a fingerprint of the
            items), or None. The G+ and G- stage keeps none after a stage 0 stopped by its
            budget: its start would change when stage 0 continues.
        deadlines: the ``optim.clock()`` times stage 0 and the G+ and G- stage stop at
            (``_deadlines``; None: no deadline).

    Returns:
        Stage 0's fit, params (seeds, layer, head), and the signed stages' fit, params
        (2 x seeds, layer, head): G+ of every seed, then G-.
    """
    spec, n = model.spec, len(seed_list)
    key = fit_key(
        model,
        (items,),
        **settings,
        seeds=seed_list,
        batch_size=batch_size,
        precision=precision,
        init=init,
    )

    def resume(stage: str) -> tuple[Path, dict[str, Any]] | None:
        return None if folder is None else (folder / f"{stage}.pt", {**key, "stage": stage})

    signed_keys = [(s, stage) for stage in (1, 2) for s in seed_list]  # G+ of each seed, G-
    bar = tqdm(
        total=2 * settings["max_steps"],
        disable=not progress,
        desc=f"head gating ({n} seeds), stage 0",
    )
    with fit_passes(model.hf, precision):
        base = _stage(
            model,
            gates,
            _start_logits(init, seed_list, (spec.n_layers, spec.n_heads)).to(model.device),
            torch.zeros(n),
            items,
            _Batches(len(items), [(s, 0) for s in seed_list], batch_size),
            bar=bar,
            resume=resume("stage0"),
            deadline=deadlines[0],
            **settings,
        )
        bar.set_description(f"head gating ({n} seeds), G+ and G- stages")
        signed = _stage(
            model,
            gates,
            base.params.repeat(2, 1, 1),
            torch.tensor([1.0] * n + [-1.0] * n),
            items,
            _Batches(len(items), signed_keys, batch_size),
            bar=bar,
            resume=resume("signed") if base.stopped != "time budget" else None,
            deadline=deadlines[1],
            **settings,
        )
    bar.close()
    return base, signed


def _deadlines(time_budget: float | None) -> tuple[float | None, float | None]:
    """The ``optim.clock()`` times stage 0 and the G+ and G- stage stop at: ``STAGE0_SHARE``
    of ``time_budget`` from now, and all of it (None and None without a budget)."""
    if time_budget is None:
        return None, None
    began = optim.clock()
    return began + STAGE0_SHARE * time_budget, began + time_budget


def _budget_attrs(
    time_budget: float | None, base: Fit, signed: Fit, settings: dict[str, Any]
) -> dict[str, Any]:
    """Why the fit stopped (``stopped``: "time budget" when a stage ran out of it, else
    "max_steps" when a gate set was still moving at the cap, else "still") and, with a
    budget, ``time_budget`` and ``longer_run`` (what a longer run would add, "" if
    nothing)."""
    stops = {base.stopped, signed.stopped}
    attrs: dict[str, Any] = {
        "stopped": next((s for s in ("time budget", "max_steps") if s in stops), "still")
    }
    if time_budget is not None:
        rule = dict(max_steps=settings["max_steps"], tol=settings["tol"], sets="gate sets")
        notes = [
            f"{name} {optim.longer_run(fit, **rule)}"
            for name, fit in (("stage 0", base), ("the G+ and G- stage", signed))
            if fit.stopped == "time budget"
        ]
        attrs.update(time_budget=time_budget, longer_run=" ".join(notes))
    return attrs


def _gating_attrs(
    settings: dict[str, Any],
    batch_size: int,
    precision: Precision,
    init: str,
    base: Fit,
    signed: Fit,
    val: torch.Tensor,
) -> dict[str, Any]:
    """The settings and the fit's outcome, as attrs: updates per stage, convergence and the
    ungated validation loss (the last of ``val``)."""
    n = len(base.steps)
    return dict(
        n_seeds=n,
        lambda_=float(settings["lambda_"]),
        lr=float(settings["lr"]),
        batch_size=batch_size,
        grad_clip=float(settings["grad_clip"]),
        clip=CLIP,
        max_steps=settings["max_steps"],
        window=settings["window"],
        tol=float(settings["tol"]),
        init=INITS[init],
        precision=precision,
        steps_stage0=int(base.steps.max()),
        steps_plus=int(signed.steps[:n].max()),
        steps_minus=int(signed.steps[n:].max()),
        converged=int(base.converged.all() and signed.converged.all()),
        val_loss_ungated=float(val[-1]),
    )


def _gating_result(
    model: LensModel,
    seed_list: list[int],
    all_gates: torch.Tensor,
    val: torch.Tensor,
    base: Fit,
    signed: Fit,
    attrs: dict[str, Any],
) -> xr.Dataset:
    """The roles, gates, validation losses and updates of every seed, as a Dataset.

    Args:
        all_gates: (3 x seeds, layer, head): stage 0, G+ and G- of every seed.
        val: (3 x seeds + 1,) validation losses of those gate sets, then ungated.
    """
    n = len(seed_list)
    g0, g_plus, g_minus = all_gates[:n], all_gates[n : 2 * n], all_gates[2 * n :]
    coords = {"seed": seed_list}

    def score(values, long_name, units="gate"):
        return schema.make(
            values,
            dims=("seed", "layer", "head"),
            coords=coords,
            attrs={**attrs, "long_name": long_name, "units": units},
            n_layers=model.spec.n_layers,
        )

    def per_seed(values, long_name, units):
        return schema.make(
            values,
            dims=("seed",),
            coords=coords,
            attrs={**attrs, "long_name": long_name, "units": units},
        )

    data = {
        "facilitation": score(g_minus, "Facilitation (G-)", "score"),
        "interference": score(1 - g_plus, "Interference (1 - G+)", "score"),
        "irrelevance": score(g_plus * (1 - g_minus), "Irrelevance (G+ (1 - G-))", "score"),
        "gate": score(g0, "Gate, stage 0 (lambda = 0)"),
        "gate_plus": score(g_plus, "Gate G+ (+lambda)"),
        "gate_minus": score(g_minus, "Gate G- (-lambda)"),
        "val_loss": per_seed(val[:n], "Validation loss, stage-0 gates", "nats"),
        "val_loss_plus": per_seed(val[n : 2 * n], "Validation loss, G+", "nats"),
        "val_loss_minus": per_seed(val[2 * n : 3 * n], "Validation loss, G-", "nats"),
        "steps_stage0": per_seed(base.steps.numpy(), "Updates, stage 0", "steps"),
        "steps_plus": per_seed(signed.steps[:n].numpy(), "Updates, G+ stage", "steps"),
        "steps_minus": per_seed(signed.steps[n:].numpy(), "Updates, G- stage", "steps"),
        "movement_stage0": per_seed(base.movement, "Gate movement, last window, stage 0", "gate"),
        "movement_plus": per_seed(signed.movement[:n], "Gate movement, last window, G+", "gate"),
        "movement_minus": per_seed(signed.movement[n:], "Gate movement, last window, G-", "gate"),
    }
    return xr.Dataset(data, attrs=attrs)


TIE = 1e-3  # scores closer than this are one value: saturated gates differ only by float noise
ROLES = {"facilitating": "facilitation", "interfering": "interference"}
SETS_PER_PASS = 32  # gate sets evaluated together (rows = sets x validation batch)
#: Most random sets per role (``n_random``): the 5th and 95th percentiles of 10,000 draws
#: move by about 0.5 percentile between seeds, and each set is one more pass over the
#: validation prompts.
MAX_RANDOM_SETS = 10_000


def _role_cells(gating: xr.Dataset, score: str, threshold: float) -> np.ndarray:
    """Flat (layer * n_heads + head) cells whose ``score`` is >= ``threshold`` in every seed.

    Args:
        gating: read by label (``_check_gating``): (..., layer, head) in the model's order.
    """
    values = gating[score].values
    values = values.reshape(-1, *values.shape[-2:])  # (seed, layer, head), one seed or many
    return np.flatnonzero((values >= threshold).all(axis=0).ravel())


def _seed_mean(gating: xr.Dataset, score: str) -> np.ndarray:
    """(layer, head) mean of ``score`` over its seeds (every dim but layer and head), of
    ``gating`` read by label (``_check_gating``)."""
    values = gating[score].values
    return values.reshape(-1, *values.shape[-2:]).mean(axis=0)


def _top_cells(scores: np.ndarray, k: int) -> np.ndarray:
    """The k highest-scoring cells of (layer, head) scores, flat, highest first.

    Raises:
        ValueError: when the k-th score is tied (within ``TIE``) with a cell left out, so
            the top k would be a draw: converged gates saturate, and dozens of heads can
            share a score of 1.0.
    """
    flat = scores.ravel()
    order = np.argsort(-flat, kind="stable")
    kth = flat[order[k - 1]]
    tied = int((np.abs(flat - kth) <= TIE).sum())
    if (np.abs(flat[order[k:]] - kth) <= TIE).any():
        raise ValueError(
            f"The {k}th highest score is tied with {tied} heads (within {TIE}), so a top-{k} "
            "set would be a random draw from the tie. Use the role-set check (k=None), "
            "which is defined when gates saturate."
        )
    return order[:k]


def _random_sets(others: np.ndarray, size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, size) cells, each row a set drawn without replacement from ``others``."""
    return np.stack([rng.choice(others, size, replace=False) for _ in range(n)])


# long: every option checked before any pass; each step after that is a helper
@in_one_call
def gating_check(
    model: LensModel,
    gating: xr.Dataset,
    validation: Prompts,
    *,
    n_random: int = 200,
    threshold: float = 0.5,
    k: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = DEFAULTS.progress,
) -> xr.Dataset:
    """Causal check of head-gating roles on held-out items, defined when gates saturate.

    For each role, switches off (gate 0) its whole *role set* (every head whose score is
    >= ``threshold`` in every seed: facilitation for facilitating heads, interference for
    interfering ones) and ``n_random`` random sets of the same size drawn from the other
    heads, and measures the task loss of ``validation`` each time. The facilitating check
    passes when switching off the role set costs more than the random sets' 95th
    percentile; the interfering check passes when it costs less than their 5th percentile
    and no more than the intact model. A role set that is empty, or larger than the heads
    outside it, cannot be compared: its numbers are NaN and ``reason`` says why.

    Args:
        model: the model the gates were fitted on.
        gating: a ``head_gating`` result (one seed or many), or ``lsc.recorded("head_roles")``,
            read by its ``layer`` and ``head`` labels (any order, any transpose).
        validation: held-out prompts (never the training items).
        n_random: random sets per role (20 to ``MAX_RANDOM_SETS``; 200 or more for stable
            percentiles).
        threshold: the role threshold (0.5 in the reference).
        k: instead of the role sets, the ``k`` heads with the highest seed-mean score per
            role; refused when the k-th score is tied (a top-k of tied heads is a draw).
        seed: seeds the random sets.
        batch_size: validation items per forward pass.
        progress: show a progress bar (one step per pass over ``validation``, each
            measuring up to 32 gate sets).

    Returns:
        Dataset over ``role`` (facilitating, interfering): ``set_size``, ``loss_off``,
        ``random_p5``/``random_p50``/``random_p95``, ``percentile`` (share of random sets
        whose loss is below ``loss_off``, in %), ``passes``, ``reason`` ("" where
        defined); ``loss_random_off`` (role, draw); ``in_set`` (role, layer, head);
        ``loss_intact`` and ``all_pass`` (both roles pass) as scalars.

    Raises:
        TypeError: ``gating`` that is not a Dataset, options of the wrong type.
        ValueError: ``gating`` of another method or model, whose layers or heads are not
            the model's, or whose scores lie outside [0, 1]; options out of range; a tied
            top ``k``; no validation prompts.
    """
    gating = _check_gating(model, gating)
    _validate.not_empty(
        "validation", as_prompt_set(validation, name="validation"), fix="pass held-out prompts"
    )
    n_random = _validate.integer("n_random", n_random, low=1, high=MAX_RANDOM_SETS)
    threshold = _validate.number("threshold", threshold, low=0, high=1)
    k = _validate.positive_int("k", k, none_means="use the role sets")
    seed = _validate.seed("seed", seed)
    batch_size = _validate.positive_int("batch_size", batch_size)
    progress = _validate.flag("progress", progress)
    spec = model.spec
    n_cells = spec.n_layers * spec.n_heads
    if n_random < 20:
        raise ValueError(
            f"n_random={n_random} random sets give no usable 5th/95th percentile; "
            "use n_random >= 20 (200 or more for stable percentiles)."
        )
    if k is not None and not 1 <= k < n_cells:
        raise ValueError(f"k must lie in [1, {n_cells - 1}] (heads of {model.name}), got {k}.")
    sets = {
        role: _role_cells(gating, score, threshold)
        if k is None
        else _top_cells(_seed_mean(gating, score), k)
        for role, score in ROLES.items()
    }
    reasons = {role: _undefined(role, cells, n_cells, threshold) for role, cells in sets.items()}
    rows = _switched_off(sets, reasons, n_cells, n_random, np.random.default_rng(seed))
    gates = torch.as_tensor(rows, dtype=torch.float32).view(-1, spec.n_layers, spec.n_heads)
    parts = gates.split(SETS_PER_PASS)
    bar = tqdm(parts, disable=not progress, desc=f"gating check ({len(gates)} gate sets)")
    losses = torch.cat(
        [task_loss(model, validation, part, batch_size=batch_size) for part in bar]
    ).numpy()
    table, random_off = _compare(losses, reasons, n_random)
    attrs = {
        "method": "gating_check",
        "model": model.name,
        "sets": "role sets (score >= threshold in every seed)" if k is None else f"top {k}",
        "threshold": threshold,
        "n_random": n_random,
        "seed": seed,
        "n_seeds": gating["facilitation"].sizes.get("seed", 1),
        "n_validation": len(as_prompt_set(validation)),
        "prompt_set": gating.attrs.get("prompt_set", ""),
        "units": "nats",
        "criterion": (
            "facilitating off > random p95; interfering off < random p5 and <= intact; "
            "random sets have the role set's size and are drawn from the other heads"
        ),
    }
    return _check_result(model, sets, reasons, table, random_off, float(losses[0]), attrs)


def _check_gating(model: LensModel, gating: Any) -> xr.Dataset:
    """Refuse what is not a ``head_gating`` result of ``model`` (its kind, method,
    variables and origin: ``_validate.result``; its layers and heads: ``_validate.labels``)
    or holds scores outside [0, 1].

    Returns:
        ``gating`` read by label: every variable (..., layer, head) in the model's order.
    """
    _validate.result(
        "gating",
        gating,
        kind=xr.Dataset,
        made_by="lsc.head_gating",
        origin=model.origin,
        variables=tuple(ROLES.values()),
        dims=("layer", "head"),
        methods=(GATING_METHOD,),
    )
    aligned = cast(
        xr.Dataset, _validate.labels("gating", gating, _grid(model), made_by="lsc.head_gating")
    )
    for score in ROLES.values():
        _validate.values(f"gating[{score!r}]", aligned[score], low=0, high=1, fix="refit it")
    return aligned


def _undefined(role: str, cells: np.ndarray, n_cells: int, threshold: float) -> str:
    """Why the role set ``cells`` cannot be compared with random sets ("" when it can)."""
    n_others = len(np.setdiff1d(np.arange(n_cells), cells))
    if len(cells) == 0:
        return f"no head is {role} in every seed (threshold {threshold})"
    if len(cells) >= n_others:
        return (
            f"{len(cells)} {role} heads, {n_others} other heads: no two different "
            "random sets of the same size can be drawn from the other heads"
        )
    return ""


def _switched_off(
    sets: dict[str, np.ndarray],
    reasons: dict[str, str],
    n_cells: int,
    n_random: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Gate rows (rows, cells) to measure: all 1 (the intact model), then for each role that
    can be compared (no reason), its set at 0 and ``n_random`` random sets of its size from
    the other heads at 0, drawn from ``rng`` role by role."""
    rows = [np.ones(n_cells)]
    for role, cells in sets.items():
        if reasons[role]:
            continue
        others = np.setdiff1d(np.arange(n_cells), cells)
        for off in [cells, *_random_sets(others, len(cells), n_random, rng)]:
            gates = np.ones(n_cells)
            gates[off] = 0
            rows.append(gates)
    return np.stack(rows)


def _compare(
    losses: np.ndarray, reasons: dict[str, str], n_random: int
) -> tuple[dict[str, list], np.ndarray]:
    """Per role, the loss with its set off against the random sets' (rows as from
    ``_switched_off``: intact first).

    Returns:
        Per statistic (``off``, ``p5``, ``p50``, ``p95``, ``pct``, ``pass``), one value per
        role (NaN and False where the role cannot be compared); the random sets' losses
        (role, draw), NaN where none were drawn.
    """
    intact, row = float(losses[0]), 1
    table: dict[str, list] = {name: [] for name in ("off", "p5", "p50", "p95", "pct", "pass")}
    random_off = np.full((len(ROLES), n_random), np.nan)
    for i, role in enumerate(ROLES):
        if reasons[role]:
            for name in ("off", "p5", "p50", "p95", "pct"):
                table[name].append(np.nan)
            table["pass"].append(False)
            continue
        off, random_off[i] = losses[row], losses[row + 1 : row + 1 + n_random]
        row += 1 + n_random
        p5, p50, p95 = np.percentile(random_off[i], [5, 50, 95])
        passes = off > p95 if role == "facilitating" else off < p5 and off <= intact
        for name, value in zip(
            ("off", "p5", "p50", "p95", "pct", "pass"),
            (off, p5, p50, p95, 100 * float((random_off[i] < off).mean()), bool(passes)),
            strict=True,
        ):
            table[name].append(value)
    return table, random_off


def _check_result(
    model: LensModel,
    sets: dict[str, np.ndarray],
    reasons: dict[str, str],
    table: dict[str, list],
    random_off: np.ndarray,
    intact: float,
    attrs: dict[str, Any],
) -> xr.Dataset:
    """``gating_check``'s Dataset over ``role`` (and ``draw``, ``layer``, ``head``)."""
    spec = model.spec
    in_set = np.zeros((len(ROLES), spec.n_layers * spec.n_heads), dtype=bool)
    for i, role in enumerate(ROLES):
        in_set[i, sets[role]] = True
    role_dim = ("role",)
    return xr.Dataset(
        {
            "set_size": (role_dim, [len(sets[r]) for r in ROLES]),
            "loss_off": (role_dim, table["off"]),
            "random_p5": (role_dim, table["p5"]),
            "random_p50": (role_dim, table["p50"]),
            "random_p95": (role_dim, table["p95"]),
            "percentile": (role_dim, table["pct"]),
            "passes": (role_dim, table["pass"]),
            "reason": (role_dim, [reasons[r] for r in ROLES]),
            "loss_random_off": (("role", "draw"), random_off),
            "in_set": (("role", "layer", "head"), in_set.reshape(-1, spec.n_layers, spec.n_heads)),
            "loss_intact": intact,
            "all_pass": bool(all(table["pass"])),
        },
        coords={
            "role": list(ROLES),
            "draw": np.arange(random_off.shape[1]),
            "layer": np.arange(spec.n_layers),
            "head": np.arange(spec.n_heads),
        },
        attrs=attrs,
    )
