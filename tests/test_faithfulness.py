"""The faithfulness report (``capture/faithfulness.py``): agreement of gradient estimates
with exact activation patching per component type, and estimator labels. The estimators
themselves (AtP, integrated gradients, ``refine=k``) are tested in test_patching.py."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape.capture import patching
from lenscape.capture.faithfulness import parse_estimator
from lenscape.sweep.options import MAX_STEPS


@pytest.fixture(scope="module")
def pairs(factual):
    return factual[:4]


def test_faithfulness_report_matches_plain_computation(tiny_llama, pairs):
    report = lsc.faithfulness(tiny_llama, pairs, estimators=("atp", "ig:2"), progress=False)
    assert list(report["estimator"].values) == ["atp", "ig:2"]
    assert list(report["component_type"].values) == ["head", "attn", "mlp"]
    exact = lsc.activation_patching(tiny_llama, pairs, level="block", progress=False)
    atp = lsc.attribution_patching(tiny_llama, pairs, level="block", progress=False)
    mlp_exact, mlp_atp = exact.sel(component="mlp").values, atp.sel(component="mlp").values
    r = np.corrcoef(mlp_exact.ravel(), mlp_atp.ravel())[0, 1]
    assert report["pearson_cells"].sel(estimator="atp", component_type="mlp") == pytest.approx(r)
    same_sign = np.mean(np.sign(mlp_exact) == np.sign(mlp_atp))
    assert report["sign_agreement"].sel(estimator="atp", component_type="mlp") == pytest.approx(
        same_sign
    )
    xr.testing.assert_identical(report["exact_blocks"].rename(None), exact)
    assert (report["forward_passes"].values == [2, 3]).all()
    assert (report["backward_passes"].values == [1, 2]).all()
    assert report["cost_vs_atp"].sel(estimator="atp") == 1.0
    # 12 heads: top-10 overlap defined; 3 attention and 3 MLP blocks: undefined, not 1.0.
    assert (
        (report["top_overlap"].sel(component_type="head") >= 0)
        & (report["top_overlap"].sel(component_type="head") <= 1)
    ).all()
    assert report["top_overlap"].sel(component_type=["attn", "mlp"]).isnull().all()
    assert report.attrs["n_prompts"] == 4 and report.attrs["metric"] == "logit_diff"


@pytest.mark.parametrize("label, parsed", [("atp", ("atp", 1)), ("ig:16", ("ig", 16))])
def test_parse_estimator(label, parsed):
    assert parse_estimator(label) == parsed


@pytest.mark.parametrize("label", ["ig:x", "atp:3", "gradients", "ig:0"])
def test_parse_estimator_rejects(label):
    with pytest.raises(ValueError, match=r"estimator|step"):
        parse_estimator(label)


# ------------------------------------------------- undefined statistics and bad options (issue 24)


def test_top_overlap_is_undefined_where_k_covers_every_component(tiny_llama, pairs):
    """Pure noise would "agree perfectly" with k >= the number of components of a type."""
    report = lsc.faithfulness(tiny_llama, pairs, estimators=["atp"], top_k=4, progress=False)
    spec = tiny_llama.spec
    assert report["n_components"].values.tolist() == [spec.n_layers * spec.n_heads, 3, 3]
    assert report["top_k_used"].sel(component_type="head") == 4
    assert report["top_k_used"].sel(component_type=["attn", "mlp"]).isnull().all()
    assert report["top_overlap"].sel(component_type=["attn", "mlp"]).isnull().all()
    assert "top_k >= the number of components" in report["top_overlap"].attrs["undefined"]
    exact = np.abs(report["exact_heads"].mean("prompt").values.ravel())
    estimate = np.abs(report["estimate_heads"].sel(estimator="atp").mean("prompt").values.ravel())
    shared = set(np.argsort(-exact)[:4]) & set(np.argsort(-estimate)[:4])
    assert report["top_overlap"].sel(estimator="atp", component_type="head") == len(shared) / 4
    assert report.attrs["layout_checked"] is True


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"estimators": "atp"},
            TypeError,
            r"estimators must be a list of strings, got the string 'atp'",
        ),
        ({"estimators": []}, ValueError, r"estimators is empty"),
        ({"estimators": [1]}, TypeError, r"estimators must be a list of strings"),
        ({"top_k": 0}, ValueError, r"top_k must be a positive integer, got 0"),
        ({"top_k": 2.0}, TypeError, r"top_k must be a positive integer, got 2\.0"),
        ({"progress": "yes"}, TypeError, r"progress must be True or False"),
        ({"estimators": ["ig:1000000000"]}, ValueError, r"steps=1000000000 must lie in 1\.\.512"),
    ],
)
def test_bad_options_are_refused_before_any_pass(tiny_llama, pairs, kwargs, error, message):
    with pytest.raises(error, match=message):
        lsc.faithfulness(tiny_llama, pairs, **{"progress": False, **kwargs})


def test_attribution_patching_bounds_the_integration_steps(tiny_llama, pairs):
    """A billion steps would run a billion forward and backward passes per batch."""
    with pytest.raises(ValueError, match=r"steps=1000000000 integration points.*at most 512"):
        lsc.attribution_patching(tiny_llama, pairs, estimator="ig", steps=10**9, progress=False)
    assert patching._check_estimator("ig", MAX_STEPS) == MAX_STEPS == 512
    with pytest.raises(ValueError, match=r"steps=513 integration points.*at most 512"):
        lsc.edge_attribution(tiny_llama, pairs, estimator="eap-ig", steps=513, progress=False)
