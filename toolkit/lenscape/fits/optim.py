"""One Adam loop for stacked, independent gate sets, run until the gates stop moving.

Head gating and block masks both fit small gate tensors with the model frozen, many sets at
once in one stacked batch (seeds, stages, clusters, sparsities). Set ``k`` of the parameters
only influences loss ``k``, so the sets are independent fits that share forward passes. Each
set's gradient is clipped on its own (as if it were fitted alone), and the fit stops when
every set's watched values (gates, keep probabilities) have stopped moving.

A fit given a ``Resume`` keeps its state in a file at every convergence check (parameters,
Adam's moments, the per-set counters and the caller's random state), so a fit that is
killed continues from its last check instead of from zero, with the same numbers as an
uninterrupted fit at the same torch thread count. The state is keyed by what the fit depends
on (the model's name, layout and weights fingerprint, a fingerprint of the data, the
settings): the state of another fit, or a damaged file, is refused with what differs.

A fit may also be given a ``deadline`` (a wall-time budget, on ``clock``): no update starts
that would end past it (judged by the last update's time), every set still moving stops
there, not converged, and the ``Fit`` says so (``stopped == "time budget"``). The deadline
is a speed option: it never enters the state's key, and a fit stopped by it keeps its state
like an interrupted one, so a rerun with the same checkpoint continues it (with the same
numbers as a fit never stopped); a fit that finishes within it is unchanged by it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from .. import _validate
from ..models import LensModel
from ..store import as_path
from ..sweep import memory

Precision = Literal["float32", "bfloat16"]
PRECISIONS: tuple[Precision, ...] = ("float32", "bfloat16")

#: Most Adam updates a fit may be asked for (``max_steps``): the fits stop moving within
#: hundreds of updates (the head-gating reference runs 500 per stage, the recorded block
#: masks need at most 800), so 10,000 is 20 times the reference; a fit that has not stopped
#: by then will not (raise ``tol`` or lower ``lr``), and a larger cap is a typo's hours.
MAX_FIT_STEPS = 10_000
#: Most items per gate set per update (``batch_size`` of a fit): the head-gating reference
#: uses 32 and the mask fit 4; past a thousand, an update only repeats the task's items,
#: each one more forward and backward row per set.
MAX_FIT_BATCH = 1024


def check_precision(precision: object) -> Precision:
    """``precision`` if it is one of ``PRECISIONS``, else a ValueError naming the choices."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {list(PRECISIONS)}, got {precision!r}; 'bfloat16' "
            "trains the gates under bfloat16 autocast (faster on CPUs with bf16 units and "
            "on GPUs), 'float32' trains in full precision."
        )
    return precision


@contextlib.contextmanager
def fit_passes(hf: PreTrainedModel, precision: Precision) -> Iterator[None]:
    """The forward and backward passes of a gate fit, made fast without changing the fit.

    - On a CPU, attention runs in eager mode: at a fit's short sequences the CPU kernel of
      scaled-dot-product attention has a slow backward (measured in benchmarks/RESULTS.md,
      ``fit_speed``); the numbers agree to float rounding.
    - ``"bfloat16"``: bfloat16 autocast (mixed precision, as the reference head-gating
      trainer); gates, Adam and the loss stay float32. Autocast casts a frozen weight anew
      in every pass, so the weights of linear layers are cast once for the fit instead,
      which gives bit-identical numbers (the embedding, and an output layer tied to it,
      stay float32 as autocast leaves them).

    Everything is restored on exit, also after an interruption.
    """
    device = next(hf.parameters()).device
    attention = hf.config._attn_implementation
    originals: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        if device.type == "cpu" and attention != "eager":
            hf.set_attn_implementation("eager")
        with contextlib.ExitStack() as stack:
            if precision == "bfloat16":
                embedding = hf.get_input_embeddings().weight
                for module in hf.modules():
                    if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
                        originals.append((module.weight, module.weight.data))
                        module.weight.data = module.weight.data.to(torch.bfloat16)
                stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
            yield
    finally:
        for weight, data in originals:
            weight.data = data
        if hf.config._attn_implementation != attention:
            hf.set_attn_implementation(attention)


#: The clock wall-time budgets are measured on (seconds); tests put a fake clock here.
clock: Callable[[], float] = time.perf_counter

#: Why a fit stopped: every set still, the update cap, or its wall-time budget.
STOPS = ("still", "max_steps", "time budget")


class TimeBudgetWarning(UserWarning):
    """A fit stopped at its wall-time budget with sets still moving; the message says what a
    longer run would add (``longer_run``)."""


def check_time_budget(value: object) -> float | None:
    """A fit's ``time_budget``: None (no budget) or seconds, a finite number > 0.

    Raises:
        TypeError: not a number (a bool, a string ...). ValueError: zero, negative, NaN or
            infinite (None is the way to say "no budget").
    """
    if value is None:
        return None
    return _validate.number("time_budget", value, above=0)


@dataclass
class Fit:
    """Result of ``fit_until_still``.

    Attributes:
        params: (sets, ...) fitted parameters, detached.
        steps: (sets,) Adam updates each set took before it stopped moving (or hit the cap
            or the deadline).
        movement: (sets,) mean absolute change of each set's watched values over its last
            window (inf before the first window).
        converged: (sets,) whether each set stopped moving (before ``max_steps`` and the
            deadline).
        stopped: why the fit stopped (``STOPS``): ``"still"`` (every set converged),
            ``"max_steps"`` or ``"time budget"``.
        updates: updates made by this call (0 when a finished fit's state was read back).
        seconds: wall time of those updates (``clock``).
    """

    params: torch.Tensor
    steps: torch.Tensor
    movement: torch.Tensor
    converged: torch.Tensor
    stopped: str = "still"
    updates: int = 0
    seconds: float = 0.0

    @property
    def seconds_per_update(self) -> float:
        """Mean wall time of this call's updates (NaN when it made none)."""
        return self.seconds / self.updates if self.updates else math.nan


@dataclass
class Resume:
    """Where a fit keeps its state, so an interrupted fit continues where it stopped.

    Attributes:
        path: the state file (written atomically every ``window`` updates; a finished fit
            leaves its final state there, so a rerun returns at once).
        key: plain values the fit depends on (settings, fingerprints of its data and of
            the model's weights); a file written under another key, or from a start more
            than ``START_ATOL`` away, is refused rather than continued, and so is a file
            that is not a fit state (damaged, or another program's). Other files in the
            folder are never read.
        get_state: the caller's random state (minibatch order, gate noise), as plain values
            and tensors.
        set_state: puts a state from ``get_state`` back.
    """

    path: Path
    key: dict[str, Any]
    get_state: Callable[[], dict[str, Any]]
    set_state: Callable[[dict[str, Any]], None]


def digest(*parts: object) -> str:
    """SHA-256 (16 hex chars) of the ``repr`` of ``parts``: a fingerprint of a fit's data."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def sets_per_pass(rows_per_pass: int, batch_size: int) -> int:
    """How many gate (or mask) sets, ``batch_size`` rows each, one pass stacks: as many as
    ``rows_per_pass`` rows hold, at least one."""
    return max(1, rows_per_pass // batch_size)


def fit_plan(
    model: LensModel,
    method: str,
    need: Callable[[int], memory.Need],
    *,
    n_prompts: int,
    width: int,
    n_sets: int,
    batch_size: int,
    rows_per_pass: int,
) -> memory.Estimate:
    """The memory plan of a fit whose passes stack ``sets_per_pass`` of its ``n_sets`` sets
    (``need(rows)``: one pass of that many rows); a refusal proposes a smaller
    ``rows_per_pass``."""
    rows = min(n_sets, sets_per_pass(rows_per_pass, batch_size)) * batch_size
    return memory.plan(
        model,
        method,
        need,
        n_prompts=n_prompts,
        width=width,
        batch_size=rows,
        batch_option="rows_per_pass",
    )


def fit_key(model: LensModel, data: tuple[object, ...], **settings: Any) -> dict[str, Any]:
    """What a fit's saved state is checked against before it resumes: the model (name, layer
    layout, weights and dtype), a digest of the fit's ``data`` and its ``settings``."""
    return dict(
        settings,
        model=model.name,
        layout=model.spec.fingerprint,
        weights=model.weights_fingerprint,
        dtype=str(model.dtype).removeprefix("torch."),
        items=digest(*data),
    )


def checkpoint_folder(value: object) -> Path | None:
    """A fit's ``checkpoint`` argument as a folder path (None stays None).

    Raises:
        TypeError: not a path. ValueError: an empty path, or a path that is not a folder.
    """
    if value is None:
        return None
    folder = as_path(value, argument="checkpoint")
    if str(value) == "":
        raise ValueError("checkpoint is an empty path; pass a folder such as 'fit-state'.")
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"checkpoint={str(folder)!r} is a file; pass a folder (it is created if missing) "
            "where the fit can keep its state."
        )
    return folder


#: A fit state file starts with this line, then the SHA-256 (hex) of the rest, a torch file:
#: torch reads a file whose tensor bytes were overwritten without a word.
_STATE_HEADER = b"lenscape fit state\n"


def _save_state(resume: Resume, state: dict[str, Any]) -> None:
    """Write ``state`` with the key and the caller's state to ``resume.path`` atomically,
    behind ``_STATE_HEADER`` and the checksum of the torch bytes."""
    resume.path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({"key": resume.key, "caller": resume.get_state(), **state}, buffer)
    payload = buffer.getvalue()
    partial = resume.path.with_name(resume.path.name + ".partial")
    partial.write_bytes(
        _STATE_HEADER + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    )
    os.replace(partial, resume.path)


#: How far a saved fit's start may lie from this run's and still be the same start: float
#: rounding differs between CPU kinds (measured: gate logits drawn from one seed differ in the
#: last bits between an AMD AVX2 and an Intel AVX512 CPU), a different start differs by O(1).
START_ATOL = 1e-5


#: What a fit state file holds (``_save_state``), by type: anything else is not one.
_STATE_FIELDS: dict[str, type] = {
    "key": dict,
    "caller": dict,
    "optimizer": dict,
    "start": torch.Tensor,
    "params": torch.Tensor,
    "active": torch.Tensor,
    "steps": torch.Tensor,
    "movement": torch.Tensor,
    "previous": torch.Tensor,
    "step": int,
    "done": bool,
}


def _parse_state(data: bytes) -> dict[str, Any] | str:
    """The fit state in a state file's bytes, or what is wrong with them."""
    digest, _, payload = data.removeprefix(_STATE_HEADER).partition(b"\n")
    if not data.startswith(_STATE_HEADER):
        return "it does not start as a lenscape fit state"
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        return "its contents do not match the checksum written with them"
    try:
        saved = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as err:  # intact, so written by a lenscape with another state layout
        return f"it does not load ({type(err).__name__})"
    if not isinstance(saved, dict):
        return f"it holds a {type(saved).__name__}, not a fit state"
    wrong = [k for k, kind in _STATE_FIELDS.items() if not isinstance(saved.get(k), kind)]
    return f"its fields {wrong} are missing or of the wrong type" if wrong else saved


def _read_state(path: Path) -> dict[str, Any]:
    """The fit state saved at ``path`` (``_save_state``).

    Raises:
        ValueError: the file cannot be read, is cut short, garbled (its checksum does not
            match) or not a fit state, naming the file and the fix; never torch's or
            pickle's own error (which would advise loading untrusted code with
            ``weights_only=False``).
    """
    try:
        found = _parse_state(path.read_bytes())
    except OSError as err:  # a folder, no permission
        found = f"it cannot be read ({err.strerror})"
    if isinstance(found, str):
        raise ValueError(
            f"{path} in the checkpoint folder is not a fit state lenscape can continue: "
            f"{found}. It was damaged (e.g. cut short by a full disk) or written by "
            "something else; delete it, or pass another checkpoint folder, to start the fit "
            "over."
        )
    return found


def _shown(value: object) -> str:
    """A key's value, short enough for a message (fingerprints cut to 12 characters)."""
    if isinstance(value, str) and len(value) > 16:
        return repr(value[:12] + "…")
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _load_state(resume: Resume, start: torch.Tensor) -> dict[str, Any] | None:
    """The saved state of ``resume`` if it is the state of this fit: same key and a start
    within ``START_ATOL`` of ``start``; None when nothing was saved yet.

    Raises:
        ValueError: the file is damaged or not a fit state (``_read_state``), or holds a
            fit with other settings, data or weights (each difference named), or from
            another start.
    """
    if not resume.path.exists():
        return None
    saved = _read_state(resume.path)
    if saved["key"] != resume.key:
        changed = "; ".join(
            f"{k}: written for {_shown(saved['key'].get(k, '<none>'))}, this fit has "
            f"{_shown(resume.key.get(k, '<none>'))}"
            for k in sorted({*saved["key"], *resume.key})
            if saved["key"].get(k) != resume.key.get(k)
        )
        raise ValueError(
            f"The checkpoint folder {resume.path.parent} holds the state of another fit in "
            f"{resume.path.name} ({changed}). To start this fit, pass a new checkpoint "
            f"folder or delete {resume.path}; to continue that fit, run it with the model, "
            "data and settings it was written for."
        )
    here = start.detach().cpu().float()
    there = saved["start"]
    if there.shape != here.shape or not torch.allclose(there, here, rtol=0, atol=START_ATOL):
        raise ValueError(
            f"{resume.path} holds the state of a fit from another start (the parameters it "
            "began with differ, e.g. another seed or initialisation); pass the same start "
            "to continue it, or delete the file to start over."
        )
    resume.set_state(saved["caller"])
    return saved


def clip_per_set(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale each set's gradient (sets, ...) so its L2 norm is at most ``max_norm``."""
    norms = grad.flatten(1).norm(dim=1)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return grad * scale.view(-1, *([1] * (grad.dim() - 1)))


def _restore(
    saved: dict[str, Any],
    params: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    on_step: Callable[[], None] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Put a saved fit state back (``_load_state``): the parameters and Adam's moments in
    place, ``on_step`` called once per update already made.

    Returns:
        The per-set ``active``, ``steps``, ``movement``, the watched values at the last
        check (``previous``) and the next update's number.
    """
    with torch.no_grad():
        params.copy_(saved["params"])
    optimizer.load_state_dict(saved["optimizer"])
    for _ in range(saved["step"]):
        if on_step is not None:
            on_step()
    return saved["active"], saved["steps"], saved["movement"], saved["previous"], saved["step"] + 1


# long: one Adam loop (per-set clipping, convergence, deadline, resumable state), read top to bottom
def fit_until_still(
    start: torch.Tensor,
    loss_and_grad: Callable[[torch.Tensor, list[int]], torch.Tensor],
    *,
    watch: Callable[[torch.Tensor], torch.Tensor],
    lr: float,
    grad_clip: float | None,
    max_steps: int,
    window: int,
    tol: float,
    on_step: Callable[[], None] | None = None,
    resume: Resume | None = None,
    deadline: float | None = None,
) -> Fit:
    """Adam on stacked parameters; each set stops updating once its watched values are still.

    Args:
        start: (sets, ...) initial parameters.
        loss_and_grad: ``(params, active) -> losses`` of the sets listed in ``active``; it
            must call ``backward`` itself (so it can go chunk by chunk), leaving gradients
            in ``params.grad``. Sets not in ``active`` have stopped: skip their rows.
        watch: maps parameters (sets, ...) to the values whose movement decides convergence
            (e.g. ``torch.sigmoid`` for gates), same shape.
        lr: Adam learning rate.
        grad_clip: maximum L2 norm of each set's gradient; ``None`` for no clipping.
        max_steps: every set stops here even if it still moves.
        window: every ``window`` updates, compare the watched values with those ``window``
            updates earlier.
        tol: a set stops when the mean absolute change of its watched values over a window
            is below ``tol``.
        on_step: called after every update (a progress bar's ``update``), and once per
            update already made when a fit is resumed.
        resume: where to keep the fit's state at every convergence check and to continue
            from (``Resume``); None keeps nothing.
        deadline: a ``clock()`` time: no update after the first starts when the last
            update's duration would take it past the deadline; the sets still moving then
            stop, not converged (``stopped="time budget"``), and the state is kept (with
            ``resume``) so a rerun continues. Not part of the state's key. None: no deadline.

    Returns:
        A ``Fit`` with the parameters and, per set, its updates, last movement and whether
        it converged; why it stopped, and the updates and wall time of this call.
    """
    params = start.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([params], lr=lr)
    sets = params.shape[0]
    active = torch.ones(sets, dtype=torch.bool)
    steps = torch.zeros(sets, dtype=torch.long)
    movement = torch.full((sets,), float("inf"))
    with torch.no_grad():
        previous = watch(params).clone()
    key = {
        "lr": lr,
        "grad_clip": grad_clip,
        "max_steps": max_steps,
        "window": window,
        "tol": tol,
    }
    if resume is not None:
        resume = Resume(resume.path, {**resume.key, **key}, resume.get_state, resume.set_state)
    saved = _load_state(resume, start) if resume is not None else None
    first = 1
    if saved is not None:
        active, steps, movement, previous, first = _restore(saved, params, optimizer, on_step)
        if saved["done"]:
            stopped = "max_steps" if active.any() else "still"
            return Fit(params.detach(), steps, movement, ~active, stopped=stopped)

    def keep(step: int, done: bool) -> None:
        if resume is not None:
            state = dict(active=active, steps=steps, movement=movement, previous=previous)
            _save_state(
                resume,
                dict(
                    start=start.detach().cpu().float(),
                    params=params.detach(),
                    optimizer=optimizer.state_dict(),
                    step=step,
                    done=done,
                    **state,
                ),
            )

    began, last, made, stopped = clock(), 0.0, 0, "max_steps"
    for step in range(first, max_steps + 1):
        if deadline is not None and made and clock() + last > deadline:
            keep(step - 1, done=False)  # a rerun continues from here
            stopped = "time budget"
            break
        update_began = clock()
        optimizer.zero_grad()
        loss_and_grad(params, active.nonzero().flatten().tolist())
        if grad_clip is not None and params.grad is not None:
            params.grad = clip_per_set(params.grad, grad_clip)
        frozen = params.detach()[~active].clone()
        optimizer.step()
        with torch.no_grad():
            params[~active] = frozen  # Adam momentum must not move a stopped set
        steps[active] = step
        made, last = made + 1, clock() - update_began
        if on_step is not None:
            on_step()
        if step % window == 0:
            with torch.no_grad():
                now = watch(params)
                moved = (now - previous).abs().flatten(1).mean(1).cpu()
                previous = now.clone()
            movement[active] = moved[active]
            active &= ~(moved < tol)
            if not active.any():
                keep(step, done=True)
                stopped = "still"
                break
            keep(step, done=step == max_steps)
        elif step == max_steps:
            keep(step, done=True)
    return Fit(params.detach(), steps, movement, ~active, stopped, made, clock() - began)


def longer_run(fit: Fit, *, max_steps: int, tol: float, sets: str = "sets") -> str:
    """What a longer run would add to a fit stopped by its time budget, in words (for a
    warning, a notebook, a result's ``longer_run`` attr); "" for a fit stopped otherwise.

    Args:
        fit: the ``Fit`` (its ``seconds_per_update`` prices the updates left).
        max_steps: the fit's update cap; tol: its stopping rule.
        sets: what a set is, plural ("gate sets", "mask sets").
    """
    if fit.stopped != "time budget":
        return ""
    moving = ~fit.converged
    done = int(fit.steps.max())
    left = max_steps - done
    measured = fit.movement[moving][torch.isfinite(fit.movement[moving])]
    change = f"; the largest last change {float(measured.max()):.3g}" if len(measured) else ""
    cost = fit.seconds_per_update * left
    return (
        f"stopped at its time budget after {done} of at most {max_steps} updates "
        f"({fit.seconds:.0f} s, {fit.seconds_per_update:.2g} s per update): "
        f"{int(moving.sum())} of {len(moving)} {sets} still moving (the rule stops them "
        f"below a change of {tol:g} per window{change}). A longer run would let them settle "
        f"or reach the cap: up to {left} more updates, at most about {cost / 60:.1f} min at "
        "this speed (less as sets stop); pass a larger time_budget, or None, and the same "
        "checkpoint folder to continue from here."
    )
