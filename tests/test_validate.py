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
    limit = _validate.context_length(model)
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
    limit = _validate.context_length(tiny_llama)
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
