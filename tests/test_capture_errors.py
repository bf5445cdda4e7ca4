"""Every bad input to a capture method gets a ValueError that names the problem and the fix."""

from __future__ import annotations

import copy

import pytest
import torch

import lenscape as lsc
from lenscape.data import Prompt


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


def test_unknown_ablation_kind(tiny_llama, factual):
    with pytest.raises(ValueError, match="Unknown ablation kind"):
        lsc.ablation(tiny_llama, factual[:1], kind="resample-ish", progress=False)


@pytest.mark.parametrize("batch_size, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError)])
def test_bad_batch_size(tiny_llama, factual, batch_size, error):
    with pytest.raises(error, match="batch_size must be a positive integer"):
        lsc.attribution_patching(tiny_llama, factual[:1], batch_size=batch_size, progress=False)


def test_dla_rejects_nonlinear_metrics(tiny_llama, factual):
    with pytest.raises(ValueError, match="direct_logit_attribution supports metric"):
        lsc.direct_logit_attribution(tiny_llama, factual[:1], metric="logprob", progress=False)


@pytest.mark.parametrize(
    "method", [lsc.ablation, lsc.activation_patching, lsc.attribution_patching]
)
def test_nan_metric_is_detected(tiny_llama, factual, method):
    broken = copy.copy(tiny_llama)
    broken.hf = copy.deepcopy(tiny_llama.hf)
    with torch.no_grad():
        broken.hf.lm_head.weight[:] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        method(broken, factual[:2], progress=False)
