"""The faithfulness report (``capture/faithfulness.py``): agreement of gradient estimates
with exact activation patching per component type, and estimator labels. The estimators
themselves (AtP, integrated gradients, ``refine=k``) are tested in test_patching.py."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape import bootstrap
from lenscape.capture.faithfulness import agreement, agreement_bounds
from lenscape.capture.patching import (
    DEFAULT_IG_STEPS,
    ESTIMATORS,
    PATH_ESTIMATORS,
    checks,
    parse_estimator,
)
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


TABLE = dict(estimators=ESTIMATORS, paths=PATH_ESTIMATORS, default=DEFAULT_IG_STEPS)


@pytest.mark.parametrize(
    "label, parsed",
    [
        ("atp", ("atp", 1, None)),
        ("ig", ("ig", DEFAULT_IG_STEPS, None)),
        ("ig:16", ("ig", 16, None)),
        ("relp", ("relp", 1, "relp")),
        ("relp:secant", ("relp", 1, "secant")),
        ("relp:secant-0.9", ("relp", 1, "secant-0.9")),
        ("trapezoid", ("trapezoid", 1, None)),
    ],
)
def test_parse_estimator(label, parsed):
    assert parse_estimator(label, **TABLE) == parsed


@pytest.mark.parametrize(
    "label", ["ig:x", "atp:3", "gradients", "ig:0", "ig:513", "relp:nope", "relp:3"]
)
def test_parse_estimator_rejects(label):
    with pytest.raises(ValueError, match=r"estimator|step|rules"):
        parse_estimator(label, **TABLE)


def test_the_trapezoid_estimator_takes_its_place_in_the_report(tiny_llama, pairs):
    report = lsc.faithfulness(tiny_llama, pairs[:2], estimators=("trapezoid",), progress=False)
    assert list(report["estimator"].values) == ["trapezoid"]
    assert (report["forward_passes"].values == [2]).all()
    assert (report["backward_passes"].values == [2]).all()
    estimate = lsc.attribution_patching(
        tiny_llama, pairs[:2], level="block", estimator="trapezoid", progress=False
    )
    got = report["estimate_blocks"].sel(estimator="trapezoid").transpose(*estimate.dims)
    np.testing.assert_allclose(got.values, estimate.values, atol=1e-6)


def test_the_default_report_compares_relp_where_the_rules_apply(tiny_llama, tokenizer, pairs):
    report = lsc.faithfulness(tiny_llama, pairs[:2], progress=False)
    assert list(report["estimator"].values) == ["atp", "ig:2", "relp:relp", "relp:secant-0.9"]
    # routed experts: the held-routing rules apply, the secant rules do not
    mixtral = lsc.models.tiny("mixtral", n_layers=2, seed=0, tokenizer=tokenizer)
    report = lsc.faithfulness(mixtral, pairs[:2], progress=False)
    assert list(report["estimator"].values) == ["atp", "ig:2", "relp:relp"]


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
    assert checks._check_estimator("ig", MAX_STEPS) == MAX_STEPS == 512
    with pytest.raises(ValueError, match=r"steps=513 integration points.*at most 512"):
        lsc.edge_attribution(tiny_llama, pairs, estimator="eap-ig", steps=513, progress=False)


def maps(n_prompts=12, seed=0):
    """An exact (prompt, layer 3, head 4) map and a noisy estimate of it."""
    rng = np.random.default_rng(seed)
    exact = rng.normal(size=(n_prompts, 3, 4)) + np.arange(12).reshape(3, 4) / 4
    estimate = exact + rng.normal(scale=0.8, size=exact.shape)
    coords = {"prompt": np.arange(n_prompts), "layer": [0, 1, 2], "head": [0, 1, 2, 3]}
    dims = ("prompt", "layer", "head")
    return xr.DataArray(exact, dims=dims, coords=coords), xr.DataArray(
        estimate, dims=dims, coords=coords
    )


def test_agreement_bounds_are_the_percentiles_of_the_statistic_on_each_resample():
    exact, estimate = maps()
    bounds = agreement_bounds(exact, estimate, top_k=3, n_resamples=300, seed=2)
    drawn = bootstrap.draw(12, n_resamples=300, seed=2)
    x, y = exact.values.reshape(12, -1), estimate.values.reshape(12, -1)
    r_means = [np.corrcoef(x[d].mean(0), y[d].mean(0))[0, 1] for d in drawn]  # the plain loop
    assert bounds["pearson_means"] == pytest.approx(tuple(np.quantile(r_means, [0.025, 0.975])))
    r_cells = [np.corrcoef(x[d].ravel(), y[d].ravel())[0, 1] for d in drawn]
    assert bounds["pearson_cells"] == pytest.approx(tuple(np.quantile(r_cells, [0.025, 0.975])))
    point = agreement(exact, estimate, top_k=3)
    for stat, (low, high) in bounds.items():
        assert low <= high and 0 <= point[stat] <= 1, stat
    # read by label: prompts in another order, dims transposed, the same interval
    moved = estimate.isel(prompt=np.random.default_rng(0).permutation(12)).transpose("head", ...)
    assert agreement_bounds(exact, moved, top_k=3, n_resamples=300, seed=2) == bounds


def test_agreement_bounds_are_nan_where_undefined_or_one_prompt():
    exact, estimate = maps()
    bounds = agreement_bounds(exact, estimate, top_k=12)  # every head in both top sets
    assert np.isnan(bounds["top_overlap"]).all() and np.isfinite(bounds["pearson_means"]).all()
    one = agreement_bounds(exact[:1], estimate[:1], top_k=3)
    assert all(np.isnan(pair).all() for pair in one.values())
    with pytest.raises(ValueError, match=r"ci must lie in \(0, 1\)"):
        agreement_bounds(exact, estimate, ci=1.0)


def test_the_report_carries_an_interval_beside_each_statistic(tiny_llama, pairs):
    report = lsc.faithfulness(tiny_llama, pairs, estimators=("atp",), ci=0.9, progress=False)
    for stat in ("pearson_cells", "spearman_means", "top_overlap", "sign_agreement"):
        interval = report[f"{stat}_interval"]
        assert interval.dims == ("estimator", "component_type", "bound")
        assert interval["bound"].values.tolist() == ["low", "high"]
        assert interval.attrs["ci"] == 0.9 and interval.attrs["n_resamples"] == 1000
        assert interval.attrs["interval"].startswith("percentile bootstrap over prompts")
        defined = np.isfinite(report[stat])
        assert (np.isfinite(interval).all("bound") == defined).all()  # NaN where undefined
    head = report["pearson_means_interval"].sel(estimator="atp", component_type="head")
    exact = report["exact_heads"]
    estimate = report["estimate_heads"].sel(estimator="atp", drop=True)
    expected = agreement_bounds(exact, estimate, ci=0.9)["pearson_means"]
    assert head.values.tolist() == pytest.approx(list(expected))
    with pytest.raises(ValueError, match=r"ci must lie in \(0, 1\)"):
        lsc.faithfulness(tiny_llama, pairs, estimators=("atp",), ci=1, progress=False)
