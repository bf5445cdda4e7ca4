"""The bundled SmolLM2-135M: exact ablation vs plain hooks, backend agreement, padding.

Marked ``slow``; CI runs them. Exactness checks (1e-5) run the model in float64: in
float32 the same comparisons differ by up to ~4e-5 only because batched and single-prompt
passes sum in different orders. Backend agreement (1e-4) runs in float32.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import reference_zero_ablation

import lenscape as lsc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def few(factual):
    """Four prompts, the last a token longer than the others (8 and 9 tokens: padded)."""
    return lsc.data.PromptSet([factual[i] for i in (0, 11, 23, 37)], name="factual-4")


@pytest.fixture(scope="module")
def two(few, smol64):
    """Two prompts of different lengths: batched together, one is padded."""
    two = lsc.data.PromptSet([few[0], few[3]], name="factual-2")
    assert len({len(smol64.tokenizer(p.text)["input_ids"]) for p in two}) == 2
    return two


def test_zero_ablation_matches_plain_hooks_in_the_first_middle_and_last_layer(smol64, two):
    # Every head is ablated in one batched sweep of two prompts of different lengths (so one
    # is padded); the 27 heads of three layers are checked against one unpadded float64 pass
    # per prompt and head (54 reference passes). The float64 sweep is the cost (270 passes);
    # tests/test_family_matrix.py checks every head of each tiny family.
    layers = (0, 15, 29)
    scores = lsc.ablation(smol64, two, level="head", kind="zero", batch_size=2, progress=False)
    assert scores.shape == (2, 30, 9)
    expected = reference_zero_ablation(smol64, two, layers=layers)
    np.testing.assert_allclose(scores.sel(layer=list(layers)).values, expected, atol=1e-5)
    assert np.abs(expected).max() > 0.1  # the check is not vacuous


@pytest.mark.parametrize(
    "method", ["attribution_patching", "direct_logit_attribution", "activation_patching"]
)
def test_backends_agree_on_bundled_model(smol, few, method):
    fn = getattr(lsc, method)
    level = "block" if method == "activation_patching" else "head"  # keeps CI time down
    a = fn(smol, few, level=level, backend="nnsight", progress=False)
    b = fn(smol, few, level=level, backend="transformer_lens", progress=False)
    np.testing.assert_allclose(a.values, b.values, atol=1e-4)


@pytest.fixture(scope="module")
def one_at_a_time(smol64, two):
    """Each method's scores of ``two`` at ``batch_size=1`` (no padding), computed once for
    both padding sides: the unbatched run does not depend on the side."""
    computed = {}

    def scores(method, level):
        if method not in computed:
            computed[method] = method(smol64, two, level=level, batch_size=1, progress=False)
        return computed[method]

    return scores


def test_padding_invariance_on_bundled_model(smol64, two, one_at_a_time):
    # Both sides in one test: the unbatched reference is computed once (as two parametrized
    # tests on two xdist workers, each computed it). Two prompts, one padded: a batch of four
    # runs the same padded code path at twice the cost (the float64 block sweeps are most of
    # it).
    for side in ("left", "right"):
        for method, level in [
            (lsc.attribution_patching, "head"),
            (lsc.ablation, "block"),
            (lsc.direct_logit_attribution, "head"),
        ]:
            one = one_at_a_time(method, level)
            batched = method(
                smol64, two, level=level, batch_size=2, padding_side=side, progress=False
            )
            np.testing.assert_allclose(
                batched.values, one.values, atol=1e-5, err_msg=f"{method.__name__} {side}"
            )
