"""Scalar metrics, against values worked out by hand, and the not-finite guard."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import lenscape as lsc
from lenscape.sweep import metrics

# Two rows over a 3-token vocabulary; targets (2, 0), distractors (1, 2).
LOGITS = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, math.log(2.0)]])
TARGET, DISTRACTOR = torch.tensor([2, 0]), torch.tensor([1, 2])


@pytest.mark.parametrize(
    "metric, expected",
    [
        ("logit_diff", [3.0 - 2.0, 0.0 - math.log(2.0)]),
        ("logit", [3.0, 0.0]),
        # log softmax: row 0 = 3 - log(e + e^2 + e^3); row 1 = 0 - log(1 + 1 + 2) = -log 4
        ("logprob", [3.0 - math.log(math.e + math.e**2 + math.e**3), -math.log(4.0)]),
        ("loss", [math.log(math.e + math.e**2 + math.e**3) - 3.0, math.log(4.0)]),
    ],
)
def test_each_metric_by_hand(metric, expected):
    values = metrics.compute(metric, LOGITS, TARGET, DISTRACTOR)
    assert values.shape == (2,) and values.dtype == torch.float32
    assert values.tolist() == pytest.approx(expected, rel=1e-6)
    assert metric in metrics.METRICS and metrics.UNITS[metric] in ("logits", "nats")


def test_low_precision_logits_are_scored_in_float32():
    """bfloat16 keeps about 3 significant digits: a log-probability computed in bfloat16 is
    off by ~1e-3, so the metric upcasts the logits first."""
    logits = torch.tensor([[3.0, 2.0, 1.0]]).bfloat16()  # exactly representable
    exact = 2.0 - math.log(math.e**3 + math.e**2 + math.e)
    in_bf16 = float(torch.log_softmax(logits, dim=-1)[0, 1])
    assert abs(in_bf16 - exact) > 1e-4  # the check below can tell the two apart
    value = metrics.compute("logprob", logits, torch.tensor([1]), torch.tensor([0]))
    assert value.dtype == torch.float32 and float(value) == pytest.approx(exact, abs=1e-6)


def test_not_finite_values_name_the_prompts():
    values = torch.tensor([[0.5, 1.0], [float("nan"), 2.0], [1.0, float("inf")]])
    with pytest.raises(
        ValueError, match=r"metric 'loss' is not finite \(NaN/inf\) for prompt\(s\) \[7, 9\]"
    ):
        metrics.check_finite(values, torch.tensor([4, 7, 9]), "loss")
    ok = values[:1]
    assert metrics.check_finite(ok, torch.tensor([0]), "loss") is ok


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
