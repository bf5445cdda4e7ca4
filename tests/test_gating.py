"""Causal head gating on tiny models: protocol, convergence, determinism, the causal check."""

from __future__ import annotations

import copy
import re
import textwrap

import numpy as np
import pytest
import torch
import xarray as xr
from _helpers import TESTS, hand_target_nll

import lenscape as lsc
from lenscape import models
from lenscape.fits import gating, optim

FAST = dict(seeds=2, batch_size=3, max_steps=6, window=3, progress=False)


@pytest.fixture(scope="module")
def small_task():
    return lsc.data.task("syntax")[:24]


@pytest.fixture(scope="module")
def fitted(tiny_llama, small_task):
    return lsc.head_gating(tiny_llama, small_task, **FAST)


def test_dataset_layout_and_scores(fitted, tiny_llama):
    spec = tiny_llama.spec
    assert fitted["facilitation"].dims == ("seed", "layer", "head")
    assert fitted["facilitation"].shape == (2, spec.n_layers, spec.n_heads)
    for name in ("gate", "gate_plus", "gate_minus", "facilitation", "interference", "irrelevance"):
        assert ((fitted[name] >= 0) & (fitted[name] <= 1)).all(), name
    for name in ("facilitation", "interference"):
        lsc.schema.validate(fitted[name])


def test_a_dominant_regulariser_decides_every_role(tiny_llama, small_task):
    """With lambda_ so large that the task loss hardly matters, the +lambda stage opens and
    the -lambda stage shuts every gate the regulariser reaches (stage-0 logit inside the
    clip, |g| < 4): such a head neither facilitates (G- near 0) nor interferes (1 - G+ near
    0) and is irrelevant (G+ (1 - G-) near 1). A swapped stage sign or role formula fails."""
    ds = lsc.head_gating(tiny_llama, small_task, **{**FAST, "max_steps": 12}, lambda_=100.0)
    reached = (ds["gate"] > 0.02) & (ds["gate"] < 0.98)  # logit within about +-3.9
    assert int(reached.sum()) >= 6  # enough cells for the check to mean something
    assert float(ds["gate_plus"].where(reached).min()) > 0.9
    assert float(ds["gate_minus"].where(reached).max()) < 0.1
    assert float(ds["facilitation"].where(reached).max()) < 0.1
    assert float(ds["interference"].where(reached).max()) < 0.1
    assert float(ds["irrelevance"].where(reached).min()) > 0.8


def test_reference_protocol_is_the_default():
    import inspect

    defaults = {
        name: p.default for name, p in inspect.signature(lsc.head_gating).parameters.items()
    }
    assert defaults["seeds"] == 10 and defaults["lr"] == 1.0 and defaults["batch_size"] == 32
    assert defaults["grad_clip"] == 1.0 and defaults["lambda_"] == 0.1
    assert gating.CLIP == 4.0


def test_steps_per_stage_are_recorded(fitted):
    for stage in gating.STAGES:
        steps = fitted[f"steps_{stage}"]
        assert steps.dims == ("seed",) and steps.dtype.kind == "i"
        assert ((steps >= 1) & (steps <= 6)).all()
        assert fitted.attrs[f"steps_{stage}"] == int(steps.max())
    assert fitted.attrs["max_steps"] == 6 and fitted.attrs["converged"] in (0, 1)


def test_uniform_start():
    gates = torch.sigmoid(gating._uniform_logits(0, (200, 50)))
    assert float(gates.min()) > 0 and float(gates.max()) < 1
    assert abs(float(gates.mean()) - 0.5) < 0.01 and abs(float(gates.std()) - 12**-0.5) < 0.01
    assert not torch.equal(gating._uniform_logits(0, (3, 3)), gating._uniform_logits(1, (3, 3)))


def test_half_start_puts_every_gate_at_one_half(fitted, tiny_llama, small_task):
    """init="half": every seed starts with every gate at 0.5 (steps too small to move them
    leave them there), and with a batch of every item the seeds' gates stay equal: they
    differ only in their minibatches. The start is said in attrs."""
    still = lsc.head_gating(tiny_llama, small_task, **FAST, lr=1e-6, init="half")
    np.testing.assert_allclose(still["gate"].values, 0.5, atol=1e-4)
    whole = lsc.head_gating(
        tiny_llama, small_task, **{**FAST, "batch_size": len(small_task)}, init="half"
    )
    np.testing.assert_allclose(whole["gate"].isel(seed=0), whole["gate"].isel(seed=1), atol=1e-4)
    assert float(abs(whole["gate"] - 0.5).max()) > 0.1  # and they did move
    assert whole.attrs["init"] == "every gate 0.5"
    assert fitted.attrs["init"] == "gates uniform in (0, 1)"


def test_tolerance_decides_when_a_stage_stops(tiny_llama, small_task):
    loose = lsc.head_gating(tiny_llama, small_task, **{**FAST, "max_steps": 9}, tol=1.0)
    assert loose.attrs["converged"] == 1
    np.testing.assert_array_equal(loose["steps_stage0"].values, 3)  # first check: still
    strict = lsc.head_gating(tiny_llama, small_task, **{**FAST, "max_steps": 9}, tol=0.0)
    assert strict.attrs["converged"] == 0
    np.testing.assert_array_equal(strict["steps_minus"].values, 9)


def test_same_seed_same_gates(fitted, tiny_llama, small_task):
    again = lsc.head_gating(tiny_llama, small_task, **FAST)
    np.testing.assert_array_equal(fitted["gate_minus"].values, again["gate_minus"].values)
    other = lsc.head_gating(tiny_llama, small_task, **{**FAST, "seeds": [5, 6]})
    assert not np.allclose(fitted["gate"].values, other["gate"].values)


FRESH = f"import sys\nsys.path.insert(0, {TESTS!r})\n" + textwrap.dedent("""
    import json, sys, torch
    import lenscape as lsc
    from lenscape import models
    from _helpers import small_tokenizer
    model = models.tiny("llama", n_layers=3, seed=0, tokenizer=small_tokenizer())
    ds = lsc.head_gating(model, lsc.data.task("syntax")[:24], seeds=2, batch_size=3,
                         max_steps=6, window=3, progress=False)
    names = ("gate", "gate_plus", "gate_minus")
    print(json.dumps({name: ds[name].values.tolist() for name in names}))
""")


@pytest.mark.slow
def test_two_fresh_processes_give_identical_gates(fitted, fresh_runs):
    runs = fresh_runs(FRESH)
    assert runs[0] == runs[1]
    np.testing.assert_array_equal(
        np.array(runs[0]["gate_minus"], dtype=np.float32), fitted["gate_minus"].values
    )


def test_validation_losses_are_the_gated_target_nll(fitted, tiny_llama, small_task):
    """The recorded validation losses (the task itself is the default validation set) are
    the target NLL of the model with each stage's gates, recomputed here from the logits."""
    for i in range(fitted.sizes["seed"]):
        for loss, gates in (
            ("val_loss", "gate"),
            ("val_loss_plus", "gate_plus"),
            ("val_loss_minus", "facilitation"),  # facilitation is G-
        ):
            expected = hand_target_nll(tiny_llama, small_task, fitted[gates].values[i])
            assert float(fitted[loss][i]) == pytest.approx(expected, rel=1e-4), (loss, i)
    ungated = hand_target_nll(tiny_llama, small_task)
    assert fitted.attrs["val_loss_ungated"] == pytest.approx(ungated, rel=1e-4)
    gated = lsc.task_loss(tiny_llama, small_task, torch.as_tensor(fitted["gate_plus"].values))
    np.testing.assert_allclose(gated.numpy(), fitted["val_loss_plus"].values, rtol=1e-4)


def test_zero_gate_equals_zeroed_head(tiny_llama, small_task):
    """A gate of 0 removes exactly the head's output: same loss as zeroing its o_proj input."""
    spec = tiny_llama.spec
    gates = torch.ones(1, spec.n_layers, spec.n_heads)
    gates[0, 1, 2] = 0
    gated = float(lsc.task_loss(tiny_llama, small_task[:4], gates)[0])
    o_proj = tiny_llama.hf.model.layers[1].self_attn.o_proj

    def zero(module, args):
        z = args[0].clone()
        z[..., 2 * spec.d_head : 3 * spec.d_head] = 0
        return (z,)

    handle = o_proj.register_forward_pre_hook(zero)
    try:
        zeroed = float(lsc.task_loss(tiny_llama, small_task[:4])[0])
    finally:
        handle.remove()
    assert gated == pytest.approx(zeroed, rel=1e-6)


def _with_roles(fitted, facilitating=(), interfering=(), facilitation=0.0, interference=0.0):
    """``fitted`` with every seed's scores set by hand: the listed (layer, head) cells at 1,
    the rest at the given values."""
    fac = np.full(fitted["facilitation"].shape, facilitation)
    inter = np.full(fitted["interference"].shape, interference)
    for cells, values in ((facilitating, fac), (interfering, inter)):
        for layer, head in cells:
            values[:, layer, head] = 1.0
    return fitted.assign(
        facilitation=fitted["facilitation"].copy(data=fac),
        interference=fitted["interference"].copy(data=inter),
    )


def test_role_set_check_table(fitted, tiny_llama):
    val = lsc.data.task("syntax", split="validation")[:6]
    roles = _with_roles(fitted, facilitating=[(0, 1), (2, 3)], interfering=[(1, 0)])
    check = lsc.gating_check(tiny_llama, roles, val, n_random=20)
    assert check["loss_random_off"].sizes == {"role": 2, "draw": 20}
    assert check["set_size"].values.tolist() == [2, 1]
    assert np.argwhere(check["in_set"].sel(role="facilitating").values).tolist() == [[0, 1], [2, 3]]
    for role in ("facilitating", "interfering"):
        row = check.sel(role=role)
        random_off = row["loss_random_off"].values
        assert float(row["random_p95"]) == pytest.approx(np.percentile(random_off, 95))
        assert float(row["percentile"]) == pytest.approx(
            100 * (random_off < float(row["loss_off"])).mean()
        )
    fac = check.sel(role="facilitating")
    assert bool(fac["passes"]) == (float(fac["loss_off"]) > float(fac["random_p95"]))
    assert bool(check["all_pass"]) == bool(check["passes"].all())
    gates = np.ones((tiny_llama.spec.n_layers, tiny_llama.spec.n_heads))
    gates[0, 1] = gates[2, 3] = 0
    assert float(fac["loss_off"]) == pytest.approx(
        hand_target_nll(tiny_llama, val, gates), rel=1e-4
    )
    assert float(check["loss_intact"]) == pytest.approx(hand_target_nll(tiny_llama, val), rel=1e-4)


def test_random_sets_come_from_the_other_heads():
    others = np.array([1, 4, 5, 7, 9])
    sets = gating._random_sets(others, 3, 200, np.random.default_rng(0))
    assert sets.shape == (200, 3)
    assert set(sets.ravel()) == set(others)
    assert all(len(set(row)) == 3 for row in sets)


def test_role_sets_need_every_seed(fitted):
    scores = _with_roles(fitted, facilitating=[(1, 2)])
    one_seed_only = scores["facilitation"].values.copy()
    one_seed_only[0, 0, 0] = 1.0  # facilitating in seed 0 only: Any, not Always
    scores = scores.assign(facilitation=scores["facilitation"].copy(data=one_seed_only))
    n_heads = fitted.sizes["head"]
    assert gating._role_cells(scores, "facilitation", 0.5).tolist() == [1 * n_heads + 2]


def test_undefined_role_sets_are_nan_with_a_reason(fitted, tiny_llama):
    val = lsc.data.task("syntax", split="validation")[:4]
    roles = _with_roles(fitted, facilitation=0.0, interference=1.0)
    check = lsc.gating_check(tiny_llama, roles, val, n_random=20)
    for role, words in (
        ("facilitating", "no head is facilitating"),
        ("interfering", "no two different"),
    ):
        row = check.sel(role=role)
        assert np.isnan(float(row["loss_off"])) and np.isnan(float(row["random_p95"]))
        assert not bool(row["passes"])
        assert words in str(row["reason"].values)
    assert not bool(check["all_pass"])


def test_top_k_is_refused_when_the_kth_score_is_tied(fitted, tiny_llama):
    tied = _with_roles(fitted, facilitation=1.0, interfering=[(0, 0), (1, 1)])
    with pytest.raises(ValueError, match="tied"):
        lsc.gating_check(
            tiny_llama, tied, lsc.data.task("syntax", split="validation")[:4], k=2, n_random=20
        )


def test_top_k_without_a_tie(fitted, tiny_llama):
    spec = tiny_llama.spec
    distinct = np.linspace(0, 1, spec.n_layers * spec.n_heads).reshape(spec.n_layers, -1)
    scores = fitted.assign(
        facilitation=fitted["facilitation"].copy(
            data=np.broadcast_to(distinct, fitted["facilitation"].shape)
        ),
        interference=fitted["interference"].copy(
            data=np.broadcast_to(1 - distinct, fitted["interference"].shape)
        ),
    )
    check = lsc.gating_check(
        tiny_llama, scores, lsc.data.task("syntax", split="validation")[:4], k=2, n_random=20
    )
    top = np.argwhere(check["in_set"].sel(role="facilitating").values).tolist()
    assert top == [[spec.n_layers - 1, spec.n_heads - 2], [spec.n_layers - 1, spec.n_heads - 1]]
    assert check["set_size"].values.tolist() == [2, 2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_random": 5}, "n_random >= 20"),
        ({"k": 0}, "k must be a positive integer"),
    ],
)
def test_gating_check_errors(fitted, tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        lsc.gating_check(
            tiny_llama, fitted, lsc.data.task("syntax", split="validation")[:4], **kwargs
        )


def test_gating_check_refuses_a_progress_that_is_not_a_flag(fitted, tiny_llama):
    with pytest.raises(TypeError, match=r"progress must be True or False, got 'no'"):
        lsc.gating_check(
            tiny_llama, fitted, lsc.data.task("syntax", split="validation")[:4], progress="no"
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seeds": 0}, "seeds must be at least 1 seed"),
        ({"seeds": []}, "seeds must hold at least one seed"),
        ({"lambda_": -0.1}, "lambda_ must be a finite number >= 0"),
        ({"window": 0}, "window must be a positive integer"),
    ],
)
def test_bad_settings(tiny_llama, small_task, kwargs, message):
    with pytest.raises(ValueError, match=message):
        lsc.head_gating(tiny_llama, small_task, progress=False, **kwargs)


def test_empty_targets_and_task(tiny_llama):
    with pytest.raises(ValueError, match="empty target"):
        lsc.head_gating(tiny_llama, [{"text": "2 + 2 =", "target": " "}], progress=False)
    with pytest.raises(ValueError, match="no prompts"):
        lsc.head_gating(tiny_llama, [], progress=False)


def test_bad_gate_shape(tiny_llama, small_task):
    with pytest.raises(ValueError, match="gates must have shape"):
        lsc.task_loss(tiny_llama, small_task, torch.ones(1, 2, 2))


# ----------------------------------------------- options and results checked up front (issue 24)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"lambda_": float("nan")}, ValueError, r"lambda_ must be a finite number >= 0, got nan"),
        ({"seeds": 2.5}, TypeError, r"seeds must be a number of seeds or a list.*2\.5"),
        ({"seeds": "3"}, TypeError, r"seeds must be a number of seeds or a list.*'3'"),
        ({"seeds": [0, 0]}, ValueError, r"seeds must hold at least one seed, each once"),
        (
            {"seeds": [0, -1]},
            ValueError,
            r"seeds\[1\] must be a whole number from 0 to 4294967295, got -1",
        ),
        ({"max_steps": 0}, ValueError, r"max_steps must be an integer from 1 to 10000, got 0"),
        ({"max_steps": 10**9}, ValueError, r"max_steps must be an integer from 1 to 10000"),
        ({"batch_size": "32"}, TypeError, r"batch_size must be an integer from 1 .*'32'"),
        ({"batch_size": 10**9}, ValueError, r"batch_size must be an integer from 1 to 1024"),
        ({"seeds": 101}, ValueError, r"seeds asks for 101 seeds, more than MAX_SEEDS=100"),
        ({"rows_per_pass": 1.5}, TypeError, r"rows_per_pass must be a positive integer"),
        ({"lr": 0}, ValueError, r"lr must be a finite number > 0, got 0"),
        ({"grad_clip": float("inf")}, ValueError, r"grad_clip must be a finite number > 0"),
        ({"tol": -1}, ValueError, r"tol must be a finite number >= 0"),
        ({"progress": "no"}, TypeError, r"progress must be True or False, got 'no'"),
        ({"validation": []}, ValueError, r"validation is empty"),
        ({"init": "zeros"}, ValueError, r"Unknown init 'zeros'; choose one of \['uniform'"),
    ],
)
def test_fit_options_are_checked_before_any_fit(tiny_llama, small_task, kwargs, error, message):
    with pytest.raises(error, match=message):
        lsc.head_gating(tiny_llama, small_task, **{"progress": False, **kwargs})


def test_task_loss_takes_a_gate_dataarray_and_checks_its_values(tiny_llama, fitted, small_task):
    gates = fitted["gate_plus"]
    from_array = lsc.task_loss(tiny_llama, small_task[:4], gates)
    from_tensor = lsc.task_loss(tiny_llama, small_task[:4], torch.as_tensor(gates.values))
    torch.testing.assert_close(from_array, from_tensor)
    with pytest.raises(TypeError, match=r"gates must be an xarray.DataArray.*gating\['"):
        lsc.task_loss(tiny_llama, small_task[:4], fitted)
    with pytest.raises(ValueError, match=r"gates holds 2 NaN or infinite value"):
        lsc.task_loss(tiny_llama, small_task[:4], gates.where(gates["layer"] + gates["head"] > 0))
    with pytest.raises(ValueError, match=r"gates must lie in \[0, 1\], got values from"):
        lsc.task_loss(tiny_llama, small_task[:4], gates * 2)
    with pytest.raises(ValueError, match="prompts is empty"):
        lsc.task_loss(tiny_llama, [], gates)


def test_gate_results_are_read_by_label(tiny_llama, fitted, small_task):
    """A sortby or transpose of the gates or of the gating result changes no answer; a
    result of another method, or with other labels, is refused naming what differs."""
    gates = fitted["gate_plus"]
    shuffled = gates.sortby("head", ascending=False).sortby("layer", ascending=False)
    shuffled = shuffled.transpose("head", "seed", "layer")
    torch.testing.assert_close(
        lsc.task_loss(tiny_llama, small_task[:4], shuffled),
        lsc.task_loss(tiny_llama, small_task[:4], gates),
    )
    with pytest.raises(ValueError, match=r"gates's 'head' labels do not match .*missing \[3\]"):
        lsc.task_loss(tiny_llama, small_task[:4], gates.isel(head=[0, 1, 2]))
    with pytest.raises(ValueError, match=r"gates is a result of 'gating_check', not of lsc.head"):
        lsc.task_loss(tiny_llama, small_task[:4], gates.assign_attrs(method="gating_check"))
    validation = lsc.data.task("syntax", split="validation")[:4]
    check = lsc.gating_check(tiny_llama, fitted, validation, n_random=20)
    reordered = fitted.sortby("head", ascending=False).transpose("head", "layer", "seed")
    again = lsc.gating_check(tiny_llama, reordered, validation, n_random=20)
    xr.testing.assert_identical(again, check)
    with pytest.raises(ValueError, match=r"gating's 'layer' labels do not match .*unknown \[7\]"):
        lsc.gating_check(tiny_llama, fitted.assign_coords(layer=[0, 1, 7]), validation)
    with pytest.raises(ValueError, match=r"n_random must be an integer from 1 to 10000"):
        lsc.gating_check(tiny_llama, fitted, validation, n_random=10**6)


def test_gating_results_are_checked_for_kind_and_origin(tiny_llama, fitted, tokenizer):
    validation = lsc.data.task("syntax", split="validation")[:4]
    with pytest.raises(TypeError, match=r"gating must be an xarray.Dataset from lsc.head_gating"):
        lsc.gating_check(tiny_llama, fitted["facilitation"], validation)
    with pytest.raises(TypeError, match=r"gating must be an xarray.Dataset.*got Tensor"):
        lsc.gating_check(tiny_llama, torch.zeros(2, 2, 4), validation)
    renamed = copy.copy(tiny_llama)
    renamed.name = "another-llama"
    with pytest.raises(ValueError, match=r"model 'tiny-llama' \(the result\) vs 'another-llama'"):
        lsc.gating_check(renamed, fitted, validation)
    # Same name, same number of layers and heads, another layout: the fingerprint tells.
    n = tiny_llama.spec.n_layers
    lookalike = lsc.models.tiny("qwen3", n_layers=n, tokenizer=tokenizer)
    lookalike.name = tiny_llama.name
    with pytest.raises(ValueError, match=rf"layout_fingerprint 'llama/L{n}/.* vs 'qwen3/L{n}/"):
        lsc.gating_check(lookalike, fitted, validation)
    broken = fitted.copy()
    broken["facilitation"] = fitted["facilitation"] * np.nan
    with pytest.raises(ValueError, match=r"gating\['facilitation'\] holds \d+ NaN"):
        lsc.gating_check(tiny_llama, broken, validation)
    with pytest.raises(ValueError, match="validation is empty"):
        lsc.gating_check(tiny_llama, fitted, [])
    with pytest.raises(ValueError, match=r"threshold must be a finite number in \[0, 1\]"):
        lsc.gating_check(tiny_llama, fitted, validation, threshold=float("nan"))


def _interrupted_at(monkeypatch, call: int):
    """Make the ``call``-th gated pass raise KeyboardInterrupt (a killed fit)."""
    passes = [0]
    row_nll = gating._row_nll

    def counting(*args, **kwargs):
        passes[0] += 1
        if passes[0] == call:
            raise KeyboardInterrupt
        return row_nll(*args, **kwargs)

    monkeypatch.setattr(gating, "_row_nll", counting)


@pytest.mark.parametrize("call", [5, 9], ids=["in stage 0", "in the signed stage"])
def test_an_interrupted_fit_continues_from_its_checkpoint(
    fitted, tiny_llama, small_task, tmp_path, monkeypatch, call
):
    """One pass per update here (rows_per_pass covers both seeds): the fit is killed at
    update 5 of stage 0 (its state kept at update 3) or at update 3 of the signed stage
    (stage 0 finished); started again, it gives the uninterrupted gates exactly."""
    with monkeypatch.context() as patch:
        _interrupted_at(patch, call)
        with pytest.raises(KeyboardInterrupt):
            lsc.head_gating(tiny_llama, small_task, checkpoint=tmp_path, **FAST)
    assert (tmp_path / "stage0.pt").exists()
    resumed = lsc.head_gating(tiny_llama, small_task, checkpoint=tmp_path, **FAST)
    for name in ("gate", "gate_plus", "gate_minus", "steps_stage0", "steps_minus"):
        np.testing.assert_array_equal(resumed[name].values, fitted[name].values)
    with pytest.raises(ValueError, match=r"\(lambda_: written for 0\.1, this fit has 0\.2\)"):
        lsc.head_gating(tiny_llama, small_task, checkpoint=tmp_path, **{**FAST, "lambda_": 0.2})


def test_a_checkpoint_is_refused_after_an_edit_through_data(small_task, tokenizer, tmp_path):
    """The model of a finished fit, edited through ``param.data`` (no version counter
    moves), does not get the old fit back from its checkpoint: the weights differ."""
    model = models.tiny("llama", n_layers=3, tokenizer=tokenizer)
    lsc.head_gating(model, small_task, checkpoint=tmp_path, **FAST)
    model.hf.model.layers[1].self_attn.o_proj.weight.data[0] += 1
    with pytest.raises(ValueError, match=r"holds the state of another fit .*\(weights: written"):
        lsc.head_gating(model, small_task, checkpoint=tmp_path, **FAST)


def test_a_checkpoint_of_other_weights_or_damaged_is_refused(
    fitted, tiny_llama, small_task, tokenizer, tmp_path
):
    """A model with the same name and layout but other weights does not continue (or
    return) another model's fit; a damaged state file is named; files the fit does not own
    are never read."""
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "other.pt").write_bytes(b"garbage")
    done = lsc.head_gating(tiny_llama, small_task, checkpoint=tmp_path, **FAST)
    np.testing.assert_array_equal(done["gate_plus"].values, fitted["gate_plus"].values)
    other = models.tiny("llama", n_layers=3, seed=1, tokenizer=tokenizer)
    assert (other.name, other.spec) == (tiny_llama.name, tiny_llama.spec)
    mine, theirs = tiny_llama.weights_fingerprint[:12], other.weights_fingerprint[:12]
    with pytest.raises(
        ValueError,
        match=rf"folder {re.escape(str(tmp_path))} holds the state of another fit in stage0\.pt "
        rf"\(weights: "
        rf"written for '{mine}…', this fit has '{theirs}…'\)\. To start this fit, pass a new "
        "checkpoint folder or delete",
    ):
        lsc.head_gating(other, small_task, checkpoint=tmp_path, **FAST)
    stage0 = tmp_path / "stage0.pt"
    stage0.write_bytes(stage0.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"{re.escape(str(stage0))} in the checkpoint folder is"):
        lsc.head_gating(tiny_llama, small_task, checkpoint=tmp_path, **FAST)


# ------------------------------------------------------------ a wall-time budget (issue 43)


def _timed_passes(monkeypatch):
    """Each gated pass takes 1 s on a fake ``optim.clock`` (one pass per update here)."""
    now = [0.0]
    row_nll = gating._row_nll

    def timed(*args, **kwargs):
        now[0] += 1.0
        return row_nll(*args, **kwargs)

    monkeypatch.setattr(optim, "clock", lambda: now[0])
    monkeypatch.setattr(gating, "_row_nll", timed)


def test_a_time_budget_stops_both_stages_and_says_what_more_would_add(
    fitted, tiny_llama, small_task, monkeypatch
):
    """A 4.5 s budget: stage 0 may use a third (1.5 s: one update), the G+ and G- stage the
    rest (three updates); every set stopped is not converged, and the result says so."""
    _timed_passes(monkeypatch)
    with pytest.warns(optim.TimeBudgetWarning, match=r"head_gating: stage 0 stopped at its"):
        ds = lsc.head_gating(tiny_llama, small_task, time_budget=4.5, **FAST)
    assert ds["steps_stage0"].values.tolist() == [1, 1]
    assert ds["steps_plus"].values.tolist() == ds["steps_minus"].values.tolist() == [3, 3]
    assert ds.attrs["stopped"] == "time budget" and ds.attrs["converged"] == 0
    assert ds.attrs["time_budget"] == 4.5
    note = ds.attrs["longer_run"]
    assert note.startswith("stage 0 stopped at its time budget after 1 of at most 6 updates")
    assert "the G+ and G- stage stopped at its time budget after 3 of at most 6" in note
    assert "4 of 4 gate sets still moving" in note
    assert fitted.attrs["stopped"] in ("still", "max_steps")  # no budget: none of its attrs
    assert "time_budget" not in fitted.attrs and "longer_run" not in fitted.attrs


def test_a_fit_within_its_time_budget_is_the_fit_without_one(
    fitted, tiny_llama, small_task, monkeypatch
):
    _timed_passes(monkeypatch)
    timed = lsc.head_gating(tiny_llama, small_task, time_budget=1000, **FAST)
    for name in ("gate", "gate_plus", "gate_minus", "steps_stage0", "steps_minus"):
        np.testing.assert_array_equal(timed[name].values, fitted[name].values)
    assert timed.attrs["stopped"] == fitted.attrs["stopped"]
    assert (timed.attrs["time_budget"], timed.attrs["longer_run"]) == (1000.0, "")


def test_a_fit_stopped_by_its_budget_continues_from_its_checkpoint(
    fitted, tiny_llama, small_task, tmp_path, monkeypatch
):
    """Stage 0 stopped after one update (its state kept there; the G+ and G- stage, started
    from an unfinished stage 0, keeps none); called again without a budget, the fit
    continues stage 0 and gives the gates of a fit never stopped."""
    with monkeypatch.context() as patch:
        _timed_passes(patch)
        with pytest.warns(optim.TimeBudgetWarning):
            lsc.head_gating(tiny_llama, small_task, checkpoint=tmp_path, time_budget=4.5, **FAST)
    assert optim._read_state(tmp_path / "stage0.pt")["step"] == 1
    assert not (tmp_path / "signed.pt").exists()
    resumed = lsc.head_gating(tiny_llama, small_task, checkpoint=tmp_path, **FAST)
    for name in ("gate", "gate_plus", "gate_minus", "steps_stage0", "steps_minus"):
        np.testing.assert_array_equal(resumed[name].values, fitted[name].values)


@pytest.mark.parametrize(
    "budget, error",
    [(0, ValueError), (float("nan"), ValueError), (True, TypeError), ("60", TypeError)],
)
def test_a_time_budget_is_checked_before_any_pass(
    tiny_llama, small_task, monkeypatch, budget, error
):
    monkeypatch.setattr(gating, "_encode", None)  # any pass, even encoding, would fail
    with pytest.raises(error, match="time_budget must be"):
        lsc.head_gating(tiny_llama, small_task, time_budget=budget, **FAST)
