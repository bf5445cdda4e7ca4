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


# ------------------------------------------------------------ a wall-time budget (issue 43)


@pytest.fixture
def fake_clock(monkeypatch):
    """``optim.clock`` on a fake clock: ``tick()`` advances it (one call per update below),
    so a deadline stops a fit at the same update on any machine."""
    now = [0.0]
    monkeypatch.setattr(optim, "clock", lambda: now[0])

    def tick(seconds: float = 1.0) -> None:
        now[0] += seconds

    return tick


def _two_sets(tick, *, deadline=None, max_steps=20):
    """The fit of ``test_a_still_set_stops_while_others_go_on``, each update taking 1 s."""
    target = torch.tensor([[0.0], [50.0]])

    def loss_and_grad(params, active):
        tick()
        loss = ((params[active] - target[active]) ** 2).sum(1)
        loss.sum().backward()
        return loss.detach()

    return optim.fit_until_still(
        torch.zeros(2, 1),
        loss_and_grad,
        watch=lambda p: p,
        lr=0.5,
        grad_clip=None,
        max_steps=max_steps,
        window=5,
        tol=1e-3,
        deadline=deadline,
    )


def test_a_deadline_stops_every_set_still_moving_and_says_so(fake_clock):
    """Updates of 1 s and a deadline at 7.5 s: no update starts that the last one's time
    would take past it, so 7 updates; set 0 was still at update 5, set 1 stops moving."""
    fit = _two_sets(fake_clock, deadline=7.5)
    assert fit.stopped == "time budget" and fit.updates == 7 and fit.seconds == 7.0
    assert fit.steps.tolist() == [5, 7] and fit.converged.tolist() == [True, False]
    assert fit.seconds_per_update == 1.0
    note = optim.longer_run(fit, max_steps=20, tol=1e-3, sets="gate sets")
    assert note.startswith("stopped at its time budget after 7 of at most 20 updates (7 s, ")
    assert "1 of 2 gate sets still moving" in note and "up to 13 more updates" in note
    assert "about 0.2 min at this speed" in note and "larger time_budget" in note


def test_a_fit_within_its_deadline_is_the_fit_without_one(fake_clock):
    free = _two_sets(fake_clock)
    timed = _two_sets(fake_clock, deadline=1e9)
    torch.testing.assert_close(timed.params, free.params, rtol=0, atol=0)
    assert timed.steps.tolist() == free.steps.tolist() == [5, 20]
    assert timed.stopped == free.stopped == "max_steps" and timed.updates == 20
    assert optim.longer_run(timed, max_steps=20, tol=1e-3) == ""


def test_the_first_update_runs_even_past_the_deadline(fake_clock):
    """Its time is not known before it runs: one update, then the stop."""
    fit = _two_sets(fake_clock, deadline=-1.0)
    assert (fit.updates, fit.stopped, fit.steps.tolist()) == (1, "time budget", [1, 1])
    assert fit.movement.isinf().all()  # no window was compared yet
    assert "the largest last change" not in optim.longer_run(fit, max_steps=20, tol=1e-3)


def test_a_fit_stopped_by_its_deadline_continues_with_the_same_numbers(tmp_path, fake_clock):
    """The budget is not in the state's key: stopped between two checks (update 6, window
    4), the fit continues on the next call, without a budget or with another, to the numbers
    of a fit never stopped; minibatch noise included."""
    whole = _noisy_fit(None)
    state = tmp_path / "fit.pt"

    def ticking(params):  # the noisy fit's passes take 1 s each on the fake clock
        fake_clock()

    stopped = _timed_noisy_fit(state, ticking, deadline=6.5)
    assert (stopped.stopped, stopped.updates) == ("time budget", 6)
    saved = optim._read_state(state)
    assert (saved["step"], saved["done"]) == (6, False)
    resumed = _timed_noisy_fit(state, ticking, deadline=1e9)
    assert (resumed.updates, resumed.stopped) == (6, "max_steps")
    torch.testing.assert_close(resumed.params, whole.params, rtol=0, atol=0)
    assert resumed.steps.tolist() == whole.steps.tolist()
    assert optim._read_state(state)["done"] is True


def _timed_noisy_fit(state, on_pass, *, deadline):
    """``_noisy_fit`` (12 updates, window 4) with ``on_pass`` before each update's pass."""
    rng = torch.Generator().manual_seed(0)

    def loss_and_grad(params, active):
        on_pass(params)
        noise = torch.randn(params.shape, generator=rng)
        loss = ((params - noise) ** 2).flatten(1).sum(1)
        loss.sum().backward()
        return loss.detach()

    resume = optim.Resume(
        state,
        {"data": "noise"},
        lambda: {"rng": rng.get_state()},
        lambda s: rng.set_state(s["rng"]),
    )
    return optim.fit_until_still(
        torch.zeros(3, 2),
        loss_and_grad,
        watch=lambda p: p,
        lr=0.1,
        grad_clip=1.0,
        max_steps=12,
        window=4,
        tol=0.0,
        resume=resume,
        deadline=None if deadline is None else optim.clock() + deadline,
    )


@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, r"time_budget must be a finite number > 0, got 0"),
        (-5.0, ValueError, r"time_budget must be a finite number > 0, got -5\.0"),
        (float("nan"), ValueError, r"time_budget must be a finite number > 0, got nan"),
        (float("inf"), ValueError, r"time_budget must be a finite number > 0, got inf"),
        (True, TypeError, r"time_budget must be a number > 0, got True"),
        ("300", TypeError, r"time_budget must be a number > 0, got '300'"),
    ],
)
def test_a_time_budget_is_seconds_above_zero_or_none(value, error, message):
    assert optim.check_time_budget(None) is None
    assert optim.check_time_budget(120) == 120.0
    with pytest.raises(error, match=message):
        optim.check_time_budget(value)
