"""Prompt checks and batching for the capture methods (``sweep/inputs.py``): every bad
prompt gets an error that names the problem and the fix, and results do not depend on how
prompts are padded into batches."""

from __future__ import annotations

import numpy as np
import pytest

import lenscape as lsc
from lenscape.data import Prompt

PARIS = {"text": "The capital of France is the city of", "target": " Paris", "distractor": " Rome"}


def test_empty_prompt_list(tiny_llama):
    with pytest.raises(ValueError, match="prompt list is empty"):
        lsc.ablation(tiny_llama, [], progress=False)


def test_plain_strings_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="not plain strings"):
        lsc.ablation(tiny_llama, ["The capital of France is"], progress=False)


def test_multi_token_target(tiny_llama):
    bad = [Prompt("The capital of France is", " Parisiennesque", distractor=" Rome")]
    with pytest.raises(
        ValueError, match=r"Prompt 0: target ' Parisiennesque' tokenizes to \d+ tokens"
    ):
        lsc.ablation(tiny_llama, bad, progress=False)


def test_clean_corrupt_length_mismatch(tiny_llama):
    bad = [
        Prompt(
            "The capital of France is",
            " Paris",
            corrupt="The capital of the United Kingdom of Great Britain is",
            distractor=" London",
        )
    ]
    with pytest.raises(ValueError, match="differ in length"):
        lsc.activation_patching(tiny_llama, bad, progress=False)
    with pytest.raises(ValueError, match="differ in length"):
        lsc.attribution_patching(tiny_llama, bad, progress=False)


def test_missing_corrupt(tiny_llama):
    with pytest.raises(ValueError, match="no corrupt counterpart"):
        lsc.activation_patching(
            tiny_llama,
            [Prompt("The capital of France is", " Paris", distractor=" Rome")],
            progress=False,
        )


def test_missing_distractor_for_logit_diff(tiny_llama):
    with pytest.raises(ValueError, match="no distractor"):
        lsc.ablation(tiny_llama, [Prompt("The capital of France is", " Paris")], progress=False)
    # ... but a log-prob metric needs none.
    lsc.ablation(
        tiny_llama, [Prompt("The capital of France is", " Paris")], metric="logprob", progress=False
    )


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_invariance(tiny_model, factual, side):
    # Mixed lengths: prompts of different token counts in one batch.
    prompts = lsc.data.PromptSet([factual[i] for i in (0, 7, 20, 33)], name="mixed-lengths")
    lengths = {len(tiny_model.tokenizer(p.text)["input_ids"]) for p in prompts}
    assert len(lengths) > 1
    for method in (lsc.ablation, lsc.attribution_patching, lsc.direct_logit_attribution):
        one = method(tiny_model, prompts, batch_size=1, progress=False)
        batched = method(tiny_model, prompts, batch_size=4, padding_side=side, progress=False)
        np.testing.assert_allclose(
            batched.values, one.values, atol=1e-5, err_msg=f"{method.__name__} {side}"
        )


def test_empty_text_inside_a_batch_names_the_record(tiny_llama):
    records = [PARIS, {**PARIS, "text": ""}]
    with pytest.raises(ValueError, match="Record 1: Prompt text '' is empty"):
        lsc.ablation(tiny_llama, records, progress=False)


@pytest.mark.parametrize("field", ["target", "distractor"])
def test_empty_target_or_distractor(tiny_llama, field):
    prompt = Prompt(**{**PARIS, field: ""})
    with pytest.raises(ValueError, match=f"Prompt 0: the {field} '' is empty"):
        lsc.ablation(tiny_llama, [prompt], progress=False)


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
