"""Bad options and prompts fail up front with TypeError/ValueError naming the argument
(issue 15, group 1): no scores from uninitialised memory, no errors from inside torch."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape import _validate, aggregate, models
from lenscape.data import Prompt, from_records

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


def test_capture_to_checks_options_before_the_store(tiny_llama, factual, tmp_path):
    with pytest.raises(TypeError, match="variants_per_pass must be a positive integer"):
        lsc.capture_to(
            tmp_path / "r.zarr",
            "ablation",
            tiny_llama,
            factual[:2],
            variants_per_pass=1.5,
            progress=False,
        )
    with pytest.raises(TypeError, match="store must be a file path"):
        lsc.capture_to(3, "ablation", tiny_llama, factual[:2], progress=False)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ prompts


def test_empty_text_is_refused():
    with pytest.raises(ValueError, match="Prompt text '' is empty"):
        Prompt("", " Paris")
    with pytest.raises(ValueError, match="Prompt text '  ' is empty"):
        Prompt("  ", " Paris")
    with pytest.raises(ValueError, match=r"Prompt corrupt '' is empty.*corrupt=None"):
        Prompt("The capital of France is", " Paris", corrupt="")


def test_empty_text_inside_a_batch_names_the_record(tiny_llama):
    records = [PARIS, {**PARIS, "text": ""}]
    with pytest.raises(ValueError, match="Record 1: Prompt text '' is empty"):
        lsc.ablation(tiny_llama, records, progress=False)


@pytest.mark.parametrize("field", ["target", "distractor"])
def test_empty_target_or_distractor(tiny_llama, field):
    prompt = Prompt(**{**PARIS, field: ""})
    with pytest.raises(ValueError, match=f"Prompt 0: the {field} '' is empty"):
        lsc.ablation(tiny_llama, [prompt], progress=False)


@pytest.mark.parametrize(
    "field, value",
    [("text", 7), ("target", 5), ("target", None), ("corrupt", 1.0), ("category", None)],
)
def test_field_of_wrong_type_names_the_field(field, value):
    with pytest.raises(TypeError, match=f"Prompt {field} must be a string"):
        Prompt(**{**PARIS, field: value})
    with pytest.raises(TypeError, match=f"Record 0: Prompt {field} must be a string"):
        from_records([{**PARIS, field: value}])


def test_non_string_target_through_a_method_blames_the_target(tiny_llama):
    with pytest.raises(TypeError, match="Prompt target must be a string, got 5"):
        lsc.ablation(tiny_llama, [{**PARIS, "target": 5}], progress=False)


@pytest.mark.parametrize("prompts", [PARIS, Prompt(**PARIS), 5], ids=["dict", "Prompt", "int"])
def test_one_prompt_instead_of_a_list(tiny_llama, prompts):
    with pytest.raises(
        TypeError,
        match="prompts must be a PromptSet or a list of Prompts or "
        r"dicts.*\[prompt\]",
    ):
        lsc.attribution_patching(tiny_llama, prompts, progress=False)


@pytest.mark.parametrize("records", [PARIS, Prompt(**PARIS), "The capital", None])
def test_from_records_wants_a_list(records):
    with pytest.raises(TypeError, match=r"records must be a list of Prompts or dicts.*\[record\]"):
        from_records(records)


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


# ------------------------------------------------------------------ thresholds


def _seeds() -> xr.DataArray:
    return xr.DataArray(
        np.linspace(0, 1, 12).reshape(3, 2, 2),
        dims=("seed", "layer", "head"),
        coords={"seed": [0, 1, 2], "layer": [0, 1], "head": [0, 1]},
    )


@pytest.mark.parametrize("function", [aggregate.always, aggregate.any_, aggregate.fraction])
@pytest.mark.parametrize(
    "threshold, error",
    [
        ("0.5", TypeError),
        (None, TypeError),
        (True, TypeError),
        (float("nan"), ValueError),
        (2, ValueError),
    ],
)
def test_bad_threshold(function, threshold, error):
    with pytest.raises(error, match=r"threshold must be a (finite )?number in \[0, 1\]"):
        function(_seeds(), threshold=threshold)


def test_integer_and_numpy_thresholds_work():
    assert aggregate.always(_seeds(), threshold=1).sum() == 0
    xr.testing.assert_identical(
        aggregate.any_(_seeds(), threshold=np.float32(0.5)), aggregate.any_(_seeds(), threshold=0.5)
    )


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


@pytest.mark.parametrize(
    "option, value, error",
    [
        ("steps", 0, ValueError),
        ("steps", 2.0, TypeError),
        ("batch_size", "4", TypeError),
        ("lr", "1e-4", TypeError),
        ("lr", -1.0, ValueError),
    ],
)
def test_finetune_options(tiny_llama, option, value, error):
    with pytest.raises(error, match=f"{option} must be a "):
        lsc.finetune(
            tiny_llama, ["The capital of France is Paris."], progress=False, **{option: value}
        )


def test_finetune_text_longer_than_the_context(tiny_llama):
    texts = ["The capital of France is Paris.", "and so on " * 300]
    with pytest.raises(ValueError, match=r"Prompt 1: the text \+ target is \d+ tokens long"):
        lsc.finetune(tiny_llama, texts, steps=1, progress=False)
