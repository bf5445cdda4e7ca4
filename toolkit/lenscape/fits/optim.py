"""One Adam loop for stacked, independent gate sets, run until the gates stop moving.

Head gating and block masks both fit small gate tensors with the model frozen, many sets at
once in one stacked batch (seeds, stages, clusters, sparsities). Set ``k`` of the parameters
only influences loss ``k``, so the sets are independent fits that share forward passes. Each
set's gradient is clipped on its own (as if it were fitted alone), and the fit stops when
every set's watched values (gates, keep probabilities) have stopped moving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

Precision = Literal["float32", "bfloat16"]
PRECISIONS: tuple[Precision, ...] = ("float32", "bfloat16")


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


@dataclass
class Fit:
    """Result of ``fit_until_still``.

    Attributes:
        params: (sets, ...) fitted parameters, detached.
        steps: (sets,) Adam updates each set took before it stopped moving (or hit the cap).
        movement: (sets,) mean absolute change of each set's watched values over its last
            window.
        converged: (sets,) whether each set stopped moving before ``max_steps``.
    """

    params: torch.Tensor
    steps: torch.Tensor
    movement: torch.Tensor
    converged: torch.Tensor


def clip_per_set(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale each set's gradient (sets, ...) so its L2 norm is at most ``max_norm``."""
    norms = grad.flatten(1).norm(dim=1)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return grad * scale.view(-1, *([1] * (grad.dim() - 1)))


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
        on_step: called after every update (a progress bar's ``update``).

    Returns:
        A ``Fit`` with the parameters and, per set, its updates, last movement and whether
        it converged.
    """
    params = start.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([params], lr=lr)
    sets = params.shape[0]
    active = torch.ones(sets, dtype=torch.bool)
    steps = torch.zeros(sets, dtype=torch.long)
    movement = torch.full((sets,), float("inf"))
    with torch.no_grad():
        previous = watch(params).clone()
    for step in range(1, max_steps + 1):
        optimizer.zero_grad()
        loss_and_grad(params, active.nonzero().flatten().tolist())
        if grad_clip is not None and params.grad is not None:
            params.grad = clip_per_set(params.grad, grad_clip)
        stopped = params.detach()[~active].clone()
        optimizer.step()
        with torch.no_grad():
            params[~active] = stopped  # Adam momentum must not move a stopped set
        steps[active] = step
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
                break
    return Fit(params.detach(), steps, movement, ~active)
