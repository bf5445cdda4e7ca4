"""The fitting loop shared by head gating and block masks (``fits/optim.py``): per-set
gradient clipping, and each set stops when it is still."""

from __future__ import annotations

import hashlib
import io
import pickle
import re
from fractions import Fraction

import pytest
import torch

from lenscape.fits import optim


def test_clip_per_set_bounds_each_set_alone():
    grad = torch.stack([torch.full((2, 3), 10.0), torch.full((2, 3), 0.01)])
    clipped = optim.clip_per_set(grad, 1.0)
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

    fit = optim.fit_until_still(
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


def _loss_and_gate_grad(model, passes):
    """Target NLL of a few items and its gradient w.r.t. per-head gates, under ``passes``."""
    import lenscape as lsc
    from lenscape.fits import gating

    items = gating._encode(model, lsc.data.task("syntax")[:6])
    row_gates = torch.full((len(items), model.spec.n_layers, model.spec.n_heads), 0.7)
    row_gates.requires_grad_(True)
    with gating._Gates(model) as gates, passes:
        loss = gating._row_nll(model, gates, row_gates, items).mean()
    loss.backward()
    return loss.detach(), row_gates.grad


def test_fit_passes_float32_match_the_models_own_attention(tiny_llama):
    """Eager attention on the CPU changes the kernel, not the numbers (float rounding)."""
    assert tiny_llama.hf.config._attn_implementation != "eager"
    plain = _loss_and_gate_grad(tiny_llama, torch.autocast("cpu", enabled=False))
    fast = _loss_and_gate_grad(tiny_llama, optim.fit_passes(tiny_llama.hf, "float32"))
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)
    assert tiny_llama.hf.config._attn_implementation != "eager", "restored on exit"


def test_fit_passes_bfloat16_equal_plain_autocast_bit_for_bit(tiny_llama):
    """Casting the linear weights once gives exactly what autocast computes pass by pass."""
    weights = {name: p.clone() for name, p in tiny_llama.hf.named_parameters()}
    with optim.fit_passes(tiny_llama.hf, "float32"):  # the same (eager) attention in both
        autocast = _loss_and_gate_grad(tiny_llama, torch.autocast("cpu", dtype=torch.bfloat16))
    cast_once = _loss_and_gate_grad(tiny_llama, optim.fit_passes(tiny_llama.hf, "bfloat16"))
    assert torch.equal(cast_once[0], autocast[0]) and torch.equal(cast_once[1], autocast[1])
    for name, p in tiny_llama.hf.named_parameters():  # weights restored, dtype and values
        assert p.dtype == weights[name].dtype and torch.equal(p, weights[name]), name


def test_fit_passes_restore_the_model_after_an_interruption(tiny_llama):
    dtypes = {name: p.dtype for name, p in tiny_llama.hf.named_parameters()}
    with pytest.raises(KeyboardInterrupt), optim.fit_passes(tiny_llama.hf, "bfloat16"):
        raise KeyboardInterrupt
    assert {name: p.dtype for name, p in tiny_llama.hf.named_parameters()} == dtypes
    assert tiny_llama.hf.config._attn_implementation != "eager"


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision must be one of"):
        optim.check_precision("bf16")


def _noisy_fit(resume, stop_at=None, max_steps=12, start=None):
    """A fit whose gradient uses the caller's random state (as minibatches do): a resumed
    fit only matches an uninterrupted one if that state is kept too."""
    rng = torch.Generator().manual_seed(0)
    calls = [0]

    def loss_and_grad(params, active):
        calls[0] += 1
        if calls[0] == stop_at:
            raise KeyboardInterrupt
        noise = torch.randn(params.shape, generator=rng)
        loss = ((params - noise) ** 2).flatten(1).sum(1)
        loss.sum().backward()
        return loss.detach()

    if resume is not None:
        resume = optim.Resume(
            resume,
            {"data": "noise"},
            lambda: {"rng": rng.get_state()},
            lambda s: rng.set_state(s["rng"]),
        )
    return optim.fit_until_still(
        torch.zeros(3, 2) if start is None else start,
        loss_and_grad,
        watch=lambda p: p,
        lr=0.1,
        grad_clip=1.0,
        max_steps=max_steps,
        window=4,
        tol=0.0,
        resume=resume,
    )


def test_an_interrupted_fit_continues_from_its_last_check(tmp_path):
    whole = _noisy_fit(None)
    state = tmp_path / "fit.pt"
    with pytest.raises(KeyboardInterrupt):
        _noisy_fit(state, stop_at=7)  # after the check at update 4
    assert optim._read_state(state)["step"] == 4
    resumed = _noisy_fit(state)
    torch.testing.assert_close(resumed.params, whole.params, rtol=0, atol=0)
    assert resumed.steps.tolist() == whole.steps.tolist()
    # A finished fit left its final state: a rerun returns it without a pass.
    again = _noisy_fit(state, stop_at=1)
    torch.testing.assert_close(again.params, whole.params, rtol=0, atol=0)


def test_a_state_from_other_settings_is_refused(tmp_path):
    state = tmp_path / "fit.pt"
    _noisy_fit(state)
    with pytest.raises(
        ValueError,
        match=rf"folder {re.escape(str(tmp_path))} holds the state of another fit in fit\.pt "
        r"\(max_steps: written for 12, this fit has 8\)\. To start this fit, pass a new",
    ):
        _noisy_fit(state, max_steps=8)


def _cut_short(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbled(path):
    """64 bytes zeroed in the middle: torch alone would load the file, tensors changed."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(data))


def _intact(path, payload: bytes):
    """A state file with a matching checksum around ``payload`` (another state layout)."""
    digest = hashlib.sha256(payload).hexdigest().encode()
    path.write_bytes(optim._STATE_HEADER + digest + b"\n" + payload)


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "damage, problem",
    [
        (_cut_short, "do not match the checksum"),
        (_garbled, "do not match the checksum"),
        (lambda path: path.write_bytes(b"not a torch file"), "does not start as"),
        (lambda path: torch.save(torch.zeros(3), path), "does not start as"),
        (lambda path: path.write_bytes(pickle.dumps({"k": Fraction(1, 3)})), "does not start as"),
        (lambda path: _intact(path, pickle.dumps(Fraction(1, 3), protocol=2)), "does not load"),
        (lambda path: _intact(path, _torch_bytes(torch.zeros(3))), "holds a Tensor"),
        (lambda path: _intact(path, _torch_bytes({"key": {}, "step": 4})), r"fields \['caller'"),
        (lambda path: (path.unlink(), path.mkdir()), r"cannot be read \(Is a directory\)"),
    ],
    ids=[
        "cut short",
        "garbled",
        "not torch",
        "a tensor",
        "a pickle",
        "an intact pickle",
        "an intact tensor",
        "other fields",
        "a folder",
    ],
)
def test_a_damaged_or_foreign_state_file_is_refused_with_its_path(tmp_path, damage, problem):
    """Never torch's or pickle's own error (one advises weights_only=False, which would run
    the file's code) and never a silently changed state: the file's path, what is wrong
    and what to do."""
    state = tmp_path / "fit.pt"
    with pytest.raises(KeyboardInterrupt):
        _noisy_fit(state, stop_at=7)
    damage(state)
    with pytest.raises(ValueError, match=r"fit\.pt in the checkpoint folder is not a fit") as err:
        _noisy_fit(state)
    message = str(err.value)
    assert re.search(problem, message), message
    assert str(state) in message and "delete it, or pass another checkpoint folder" in message
    assert "weights_only" not in message and err.value.__context__ is None


def test_a_start_within_rounding_resumes_another_is_refused(tmp_path):
    """Another CPU draws the same start up to its last bits: that state is continued; a
    start that differs (another seed) is refused, naming the start."""
    state = tmp_path / "fit.pt"
    with pytest.raises(KeyboardInterrupt):
        _noisy_fit(state, stop_at=7)
    whole = _noisy_fit(None)
    rounded = _noisy_fit(state, start=torch.full((3, 2), 1e-7))
    torch.testing.assert_close(rounded.params, whole.params, rtol=0, atol=0)
    with pytest.raises(ValueError, match="from another start"):
        _noisy_fit(state, start=torch.full((3, 2), 0.1))


def test_checkpoint_folder_is_checked(tmp_path):
    assert optim.checkpoint_folder(None) is None
    assert optim.checkpoint_folder(str(tmp_path / "new")) == tmp_path / "new"
    with pytest.raises(TypeError, match="checkpoint must be a file path"):
        optim.checkpoint_folder(3)
    with pytest.raises(ValueError, match="empty path"):
        optim.checkpoint_folder("")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; pass a folder"):
        optim.checkpoint_folder(tmp_path / "file")
