"""The fitting loop shared by head gating and block masks (``capture/_fit.py``): per-set
gradient clipping, and each set stops when it is still."""

from __future__ import annotations

import pytest
import torch

from lenscape.capture import _fit


def test_clip_per_set_bounds_each_set_alone():
    grad = torch.stack([torch.full((2, 3), 10.0), torch.full((2, 3), 0.01)])
    clipped = _fit.clip_per_set(grad, 1.0)
    assert float(clipped[0].norm()) == pytest.approx(1.0, rel=1e-4)
    torch.testing.assert_close(clipped[1], grad[1])


def test_a_still_set_stops_while_others_go_on():
    """Set 0 sits at its optimum; set 1 is far from it: set 0 stops at the first check and
    its parameters stay put (no Adam momentum), set 1 keeps going."""
    target = torch.tensor([[0.0], [50.0]])

    def loss_and_grad(params, active):
        loss = ((params[active] - target[active]) ** 2).sum(1)
        loss.sum().backward()
        return loss.detach()

    fit = _fit.fit_until_still(
        torch.zeros(2, 1),
        loss_and_grad,
        watch=lambda p: p,
        lr=0.5,
        grad_clip=None,
        max_steps=20,
        window=5,
        tol=1e-3,
    )
    assert fit.steps.tolist() == [5, 20] and fit.converged.tolist() == [True, False]
    assert float(fit.params[0]) == 0.0 and float(fit.params[1]) > 5
