"""The faithfulness report (``capture/faithfulness.py``): agreement of gradient estimates
with exact activation patching per component type, and estimator labels. The estimators
themselves (AtP, integrated gradients, ``refine=k``) are tested in test_patching.py."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape.capture.faithfulness import parse_estimator


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
    assert ((report["top_overlap"] >= 0) & (report["top_overlap"] <= 1)).all()
    assert report.attrs["n_prompts"] == 4 and report.attrs["metric"] == "logit_diff"


@pytest.mark.parametrize("label, parsed", [("atp", ("atp", 1)), ("ig:16", ("ig", 16))])
def test_parse_estimator(label, parsed):
    assert parse_estimator(label) == parsed


@pytest.mark.parametrize("label", ["ig:x", "atp:3", "gradients", "ig:0"])
def test_parse_estimator_rejects(label):
    with pytest.raises(ValueError, match=r"estimator|step"):
        parse_estimator(label)
