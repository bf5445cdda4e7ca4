"""Bad options fail up front with TypeError/ValueError naming the argument (issue 15,
group 1; ``_validate.py``): no scores from uninitialised memory, no errors from inside
torch. Prompt checks are in test_inputs.py and test_data.py, thresholds in
test_aggregate.py, fine-tuning options in test_finetune.py."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape import _validate, models

PARIS = {"text": "The capital of France is the city of", "target": " Paris", "distractor": " Rome"}


# ------------------------------------------------------------------ shared options


@pytest.mark.parametrize("method", [lsc.ablation, lsc.activation_patching])
@pytest.mark.parametrize(
    "value, error",
    [(-1, ValueError), (0, ValueError), (2.5, TypeError), ("4", TypeError), (True, TypeError)],
)
def test_bad_variants_per_pass(tiny_llama, factual, method, value, error):
    with pytest.raises(
        error,
        match=rf"variants_per_pass must be a positive integer or None.*"
        rf"got {value!r}",
    ):
        method(tiny_llama, factual[:2], variants_per_pass=value, progress=False)


def test_bad_variants_per_pass_touches_no_store(tiny_llama, factual, tmp_path):
    path = tmp_path / "r.zarr"
    with pytest.raises(ValueError, match="variants_per_pass must be a positive integer"):
        lsc.ablation(tiny_llama, factual[:2], variants_per_pass=-1, store=path, progress=False)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_numpy_integer_options_are_accepted(tiny_llama, factual):
    plain = lsc.ablation(tiny_llama, factual[:2], variants_per_pass=2, batch_size=2, progress=False)
    numpy = lsc.ablation(
        tiny_llama,
        factual[:2],
        variants_per_pass=np.int64(2),
        batch_size=np.int32(2),
        progress=False,
    )
    xr.testing.assert_allclose(plain, numpy)


@pytest.mark.parametrize("batch_size", ["8", 8.0])
def test_batch_size_of_wrong_type(tiny_llama, factual, batch_size):
    with pytest.raises(
        TypeError, match=rf"batch_size must be a positive integer.*got {batch_size!r}"
    ):
        lsc.direct_logit_attribution(tiny_llama, factual[:1], batch_size=batch_size, progress=False)


@pytest.mark.parametrize("option", ["metric", "backend", "padding_side"])
def test_choice_of_wrong_type(tiny_llama, factual, option):
    with pytest.raises(ValueError, match=f"Unknown {option} None; choose one of"):
        lsc.attribution_patching(tiny_llama, factual[:1], progress=False, **{option: None})


@pytest.mark.parametrize(
    "option, value",
    [
        ("level", "neuron"),
        ("metric", "accuracy"),
        ("backend", "pyvene"),
        ("padding_side", "middle"),
    ],
)
def test_unknown_options(tiny_llama, factual, option, value):
    with pytest.raises(ValueError, match=f"Unknown {option} '{value}'; choose one of"):
        lsc.ablation(tiny_llama, factual[:1], progress=False, **{option: value})


@pytest.mark.parametrize("batch_size, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError)])
def test_bad_batch_size(tiny_llama, factual, batch_size, error):
    with pytest.raises(error, match="batch_size must be a positive integer"):
        lsc.attribution_patching(tiny_llama, factual[:1], batch_size=batch_size, progress=False)


# ------------------------------------------------------------------ context length


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_prompt_longer_than_the_context(tokenizer, architecture):
    model = models.tiny(architecture, n_layers=1, seed=0, tokenizer=tokenizer)
    limit = model.context_length
    assert limit == 256
    long_text = "The capital of France is" + " and so on" * limit
    prompts = [PARIS, {**PARIS, "text": long_text}]
    with pytest.raises(
        ValueError,
        match=rf"Prompt 1: the text is \d+ tokens long, more than "
        rf"the {limit} positions",
    ):
        lsc.ablation(model, prompts, progress=False)


def test_prompt_at_the_context_limit_runs(tiny_llama, tokenizer):
    limit = tiny_llama.context_length
    words = tokenizer(PARIS["text"])["input_ids"]
    filler = " and" * (limit - len(words))
    text = filler.strip() + " " + PARIS["text"]
    assert len(tokenizer(text)["input_ids"]) <= limit
    scores = lsc.direct_logit_attribution(tiny_llama, [{**PARIS, "text": text}], progress=False)
    assert np.isfinite(scores.values).all()


# ------------------------------------------------------------------ the helpers themselves


def test_positive_int_helper():
    assert _validate.positive_int("steps", np.int64(3)) == 3
    assert _validate.positive_int("n", None, none_means="automatic") is None
    with pytest.raises(TypeError, match=r"steps must be a positive integer, got None \(NoneType\)"):
        _validate.positive_int("steps", None)


def test_number_helper():
    assert _validate.number("lambda_", 1, low=0) == 1.0
    with pytest.raises(ValueError, match=r"lambda_ must be a finite number >= 0, got -0.1"):
        _validate.number("lambda_", -0.1, low=0)
    with pytest.raises(ValueError, match="lr must be a finite number, got inf"):
        _validate.number("lr", float("inf"))


def test_integer_and_seed_list_helpers():
    assert _validate.integer("seed", np.int32(0), low=0) == 0
    with pytest.raises(TypeError, match=r"seed must be an integer >= 0, got True \(bool\)"):
        _validate.integer("seed", True, low=0)
    with pytest.raises(ValueError, match=r"k must be an integer from 1 to 3, got 4"):
        _validate.integer("k", 4, low=1, high=3)
    assert _validate.seed_list("seeds", 3) == [0, 1, 2]
    assert _validate.seed_list("seeds", (4, np.int64(7))) == [4, 7]
    with pytest.raises(TypeError, match=r"seeds must be a number of seeds or a list"):
        _validate.seed_list("seeds", "012")
    with pytest.raises(
        TypeError, match=r"seeds\[1\] must be a whole number from 0 to \d+, got 1\.5"
    ):
        _validate.seed_list("seeds", [0, 1.5])


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (-1, ValueError, r"got -1; pass e\.g\. seed=0"),  # random.Random(-1) is Random(1)
        (True, TypeError, r"got True \(bool\)"),  # True would be seed 1
        (None, TypeError, r"got None \(NoneType\) \(lenscape's draws are always seeded\)"),
        (1.0, TypeError, r"got 1\.0"),
        ("3", TypeError, r"got '3'"),
        (_validate.MAX_SEED + 1, ValueError, r"got 4294967296"),
    ],
)
def test_one_rule_for_every_seed(bad, error, match):
    """Issue 43: a seed is a whole number from 0 to ``MAX_SEED``, numpy integers too."""
    assert _validate.seed("seed", np.int64(3)) == 3 and _validate.seed("seed", 0) == 0
    assert type(_validate.seed("seed", np.uint32(_validate.MAX_SEED))) is int
    with pytest.raises(error, match=r"seed must be a whole number from 0 to 4294967295, " + match):
        _validate.seed("seed", bad)


def test_number_with_an_open_bound():
    assert _validate.number("lr", 1e-9, above=0) == 1e-9
    with pytest.raises(ValueError, match=r"lr must be a finite number > 0, got 0"):
        _validate.number("lr", 0, above=0)
    with pytest.raises(ValueError, match=r"p must be a finite number in \[0, 1\] and > 0"):
        _validate.number("p", 0.0, low=0, high=1, above=0)


def test_flag_strings_and_not_empty_helpers():
    assert _validate.flag("progress", np.bool_(True)) is True
    with pytest.raises(TypeError, match=r"progress must be True or False, got 1"):
        _validate.flag("progress", 1)
    assert _validate.strings("estimators", ("atp",), example="('atp',)") == ["atp"]
    with pytest.raises(TypeError, match=r"got the string 'ig'; wrap it in a list: \['ig'\]"):
        _validate.strings("estimators", "ig", example="('atp',)")
    with pytest.raises(ValueError, match="estimators is empty"):
        _validate.strings("estimators", [], example="('atp',)")
    with pytest.raises(ValueError, match=r"validation is empty \(\[\] \(list\)\); pass one"):
        _validate.not_empty("validation", [], fix="pass one")


def test_values_helper():
    np.testing.assert_array_equal(_validate.values("gates", [[0, 1]], binary=True), [[0.0, 1.0]])
    with pytest.raises(ValueError, match=r"gates holds 1 NaN or infinite value"):
        _validate.values("gates", np.array([0.5, np.inf]))
    with pytest.raises(ValueError, match=r"masks must be a binary mask.*values such as \[0\.5\]"):
        _validate.values("masks", np.array([1, 0.5, 0]), binary=True)
    with pytest.raises(ValueError, match=r"gates must lie in \[0, 1\], got values from -1\.0"):
        _validate.values("gates", [-1, 1], low=0, high=1)
    with pytest.raises(TypeError, match=r"gates must be an array of numbers, got 'abc'"):
        _validate.values("gates", "abc")
    with pytest.raises(TypeError, match=r"gates must be an array of numbers"):
        _validate.values("gates", xr.Dataset({"g": ("layer", [1.0])}))


def test_result_helper(tiny_llama):
    scores = lsc.direct_logit_attribution(tiny_llama, [PARIS], progress=False)
    same = _validate.result(
        "r", scores, kind=xr.DataArray, made_by="f", origin={"model": "tiny-llama"}
    )
    assert same is scores
    with pytest.raises(TypeError, match=r"r must be an xarray.Dataset from f, got DataArray"):
        _validate.result("r", scores, kind=xr.Dataset, made_by="f")
    with pytest.raises(TypeError, match=r"got Dataset; pick one variable, e.g. r\['s'\]"):
        _validate.result("r", scores.to_dataset(name="s"), kind=xr.DataArray, made_by="f")
    with pytest.raises(ValueError, match=r"r lacks the variable\(s\) \['t'\]"):
        _validate.result(
            "r", scores.to_dataset(name="s"), kind=xr.Dataset, made_by="f", variables=["t"]
        )
    with pytest.raises(ValueError, match=r"r lacks the dim\(s\) \['seed'\]"):
        _validate.result("r", scores, kind=xr.DataArray, made_by="f", dims=["seed"])
    with pytest.raises(ValueError, match=r"another model .*model 'other' \(the result\) vs 'tiny-"):
        _validate.result(
            "r",
            scores.assign_attrs(model="other"),
            kind=xr.DataArray,
            made_by="f",
            origin=tiny_llama.origin,
        )
    moved = scores.assign_attrs(layout_fingerprint="llama/L9")
    with pytest.raises(
        ValueError, match=r"layout_fingerprint 'llama/L9' \(the result\) vs 'llama/L"
    ):
        _validate.result(
            "r",
            moved,
            kind=xr.DataArray,
            made_by="f",
            origin=tiny_llama.origin,
        )
    other_weights = scores.assign_attrs(weights_fingerprint="0" * 64)
    with pytest.raises(ValueError, match=r"weights_fingerprint '0000.*\(the result\) vs"):
        _validate.result(
            "r", other_weights, kind=xr.DataArray, made_by="f", origin=tiny_llama.origin
        )


def test_result_helper_checks_the_method_attr(tiny_llama):
    scores = lsc.direct_logit_attribution(tiny_llama, [PARIS], progress=False)
    ok = ("direct_logit_attribution",)
    assert _validate.result("r", scores, kind=xr.DataArray, made_by="f", methods=ok) is scores
    by_hand = scores.copy()
    del by_hand.attrs["method"]  # made by hand: judged by its type and dims alone
    _validate.result("r", by_hand, kind=xr.DataArray, made_by="f", methods=ok)
    with pytest.raises(ValueError, match=r"r is a result of 'direct_logit_attribution', not of f"):
        _validate.result("r", scores, kind=xr.DataArray, made_by="f", methods=("head_gating",))
    report = scores.to_dataset(name="s").assign_attrs(method="gating_check")
    with pytest.raises(ValueError, match=r"a result of 'gating_check', not of f"):
        _validate.result(
            "r", report, kind=xr.Dataset, made_by="f", variables=["t"], methods=("head_gating",)
        )


def test_labels_reads_by_label_and_names_what_does_not_match(tiny_llama):
    scores = lsc.direct_logit_attribution(tiny_llama, [PARIS], progress=False).isel(prompt=0)
    layers, heads = list(range(3)), list(range(4))
    shuffled = scores.sortby("head", ascending=False).transpose("head", "layer")
    got = _validate.labels("r", shuffled, {"layer": layers, "head": heads}, made_by="f")
    xr.testing.assert_identical(got, scores)
    for bad, match in [
        (scores.isel(head=[0, 1]), r"'head' labels do not match .*missing \[2, 3\]"),
        (scores.assign_coords(head=[0, 1, 2, 7]), r"missing \[3\]; unknown \[7\]"),
        (scores.assign_coords(head=[0, 1, 1, 2]), "some repeated"),
        (scores.rename(head="component"), "has no 'head' dim"),
    ]:
        with pytest.raises(ValueError, match=match):
            _validate.labels("r", bad, {"layer": layers, "head": heads}, made_by="f")


def test_text():
    assert _validate.text("x", "head", example="'head'") == "head"
    assert _validate.text("title", None, example="'T'", optional=True) is None
    with pytest.raises(
        TypeError, match=r"x must be a string, got \['head'\] \(list\); pass e\.g\. x='head'"
    ):
        _validate.text("x", ["head"], example="'head'")
    with pytest.raises(TypeError, match="title must be a string or None, got 5"):
        _validate.text("title", 5, example="'T'", optional=True)
    with pytest.raises(TypeError, match="x must be a string, got None"):
        _validate.text("x", None, example="'head'")
