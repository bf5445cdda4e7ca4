"""Gradient estimators (AtP, integrated gradients), refine=k, and the faithfulness report."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

import lenscape as lsc
from lenscape.capture.faithfulness import parse_estimator


@pytest.fixture(scope="module")
def pairs(factual):
    return factual[:4]


@pytest.fixture(scope="module")
def linear_tail_model(tokenizer):
    """A tiny GPT-2 whose last block and final norm are linear: the metric is linear in every
    activation of the last layer (its heads, attention block and MLP block)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        activation_function="linear",
        initializer_range=0.3,
    )
    hf_model = transformers.GPT2LMHeadModel(config)
    hf_model.transformer.ln_f = torch.nn.Identity()
    hf_model.transformer.h[-1].ln_2 = torch.nn.Identity()
    return lsc.from_hf(
        hf_model,
        tokenizer,
        name="tiny-gpt2-linear-tail",
        device="cpu",
        dtype="float64",
        check=False,
    )


def test_ig_with_one_step_is_attribution_patching(tiny_model, pairs):
    atp = lsc.attribution_patching(tiny_model, pairs, level="all", progress=False)
    ig1 = lsc.attribution_patching(
        tiny_model, pairs, level="all", estimator="ig", steps=1, progress=False
    )
    xr.testing.assert_equal(atp["heads"].drop_attrs(), ig1["heads"].drop_attrs())
    xr.testing.assert_equal(atp["blocks"].drop_attrs(), ig1["blocks"].drop_attrs())
    assert ig1["heads"].attrs["estimator"] == "ig" and ig1["heads"].attrs["steps"] == 1


def test_ig_differs_from_atp_and_records_steps(tiny_llama, pairs):
    atp = lsc.attribution_patching(tiny_llama, pairs, level="block", progress=False)
    ig = lsc.attribution_patching(
        tiny_llama, pairs, level="block", estimator="ig", steps=4, progress=False
    )
    assert ig.attrs["steps"] == 4 and "Integrated-gradient" in ig.attrs["long_name"]
    assert not np.allclose(atp.values, ig.values, atol=1e-6)


@pytest.mark.parametrize("estimator, steps", [("atp", None), ("ig", 3)])
@pytest.mark.parametrize("level", ["head", "block"])
def test_estimators_exact_where_the_metric_is_linear(
    linear_tail_model, pairs, estimator, steps, level
):
    exact = lsc.activation_patching(linear_tail_model, pairs, level=level, progress=False)
    estimate = lsc.attribution_patching(
        linear_tail_model, pairs, level=level, estimator=estimator, steps=steps, progress=False
    )
    last = exact.sel(layer=1)
    # Metrics are float32 differences of logits of size ~30: exact up to float32 rounding.
    np.testing.assert_allclose(estimate.sel(layer=1).values, last.values, atol=1e-4, rtol=1e-5)
    assert np.abs(last.values).max() > 1.0  # the check compares something
    # The first block feeds a non-linear attention and norm: there the estimate is off.
    assert not np.allclose(estimate.sel(layer=0).values, exact.sel(layer=0).values, atol=1e-2)


def test_ig_backends_agree(tiny_model, pairs):
    runs = [
        lsc.attribution_patching(
            tiny_model, pairs, level="all", estimator="ig", steps=3, backend=backend, progress=False
        )
        for backend in ("nnsight", "transformer_lens")
    ]
    for name in ("heads", "blocks"):
        np.testing.assert_allclose(runs[0][name].values, runs[1][name].values, atol=1e-4)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (dict(estimator="eap"), ValueError, "Unknown estimator"),
        (dict(estimator="atp", steps=4), ValueError, "needs estimator='ig'"),
        (dict(estimator="ig", steps=0), ValueError, "steps must be"),
        (dict(estimator="ig", steps=2.5), TypeError, "steps must be"),
    ],
)
def test_bad_estimator_options(tiny_llama, pairs, bad, error, match):
    with pytest.raises(error, match=match):
        lsc.attribution_patching(tiny_llama, pairs, progress=False, **bad)


@pytest.mark.parametrize(
    "method, options",
    [
        ("activation_patching", dict(level="head")),
        ("activation_patching", dict(level="block", estimator="ig", steps=2)),
        ("ablation", dict(level="head", kind="mean")),
    ],
)
def test_refine_equals_full_sweep_on_refined_components(tiny_llama, pairs, method, options):
    run = getattr(lsc, method)
    full = run(tiny_llama, pairs, variants_per_pass=1, progress=False, **options)
    refined = run(tiny_llama, pairs, variants_per_pass=1, refine=3, progress=False, **options)
    computed = ~np.isnan(refined.values[0])
    assert computed.sum() == 3
    assert (~np.isnan(refined.values) == computed).all()  # the same components for every prompt
    np.testing.assert_array_equal(refined.values[:, computed], full.values[:, computed])
    assert refined.attrs["refined_k"] == 3
    assert refined.attrs["refine_estimator"] == options.get("estimator", "atp")
    # With stacked passes (the default) the refined values still match to float32 noise.
    stacked = run(tiny_llama, pairs, refine=3, progress=False, **options)
    np.testing.assert_allclose(stacked.values[:, computed], full.values[:, computed], atol=1e-5)


def test_refine_picks_the_largest_estimates(tiny_llama, pairs):
    estimate = lsc.attribution_patching(tiny_llama, pairs, level="head", progress=False)
    refined = lsc.activation_patching(tiny_llama, pairs, level="head", refine=4, progress=False)
    mean = np.abs(estimate.mean("prompt").values.ravel())
    chosen = ~np.isnan(refined.values[0].ravel())
    assert mean[chosen].min() >= mean[~chosen].max()


@pytest.mark.parametrize(
    "refine, error, match",
    [
        (1000, ValueError, "refine must be an integer from 1 to 12"),
        (0, ValueError, "refine must be a positive integer"),
        (2.0, TypeError, "refine must be a positive integer"),
        (True, TypeError, "refine must be a positive integer"),
    ],
)
def test_refine_out_of_range(tiny_llama, pairs, refine, error, match):
    with pytest.raises(error, match=match):
        lsc.activation_patching(tiny_llama, pairs, refine=refine, progress=False)


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


def test_agreement_chart(tiny_llama, pairs):
    report = lsc.faithfulness(tiny_llama, pairs, estimators=("atp",), progress=False)
    spec = lsc.agreement(report).to_dict()
    panels = spec["hconcat"]
    assert [p["title"]["text"] for p in panels] == ["heads", "attention blocks", "MLP blocks"]
    r_mlp = float(report["pearson_means"].sel(estimator="atp", component_type="mlp"))
    assert panels[2]["title"]["subtitle"] == f"r {r_mlp:.2f} (atp)"
    points = next(layer for layer in panels[0]["layer"] if layer["mark"]["type"] == "circle")
    assert len(points["data"]["values"]) == 12  # 3 layers x 4 heads, one estimator
    first = points["data"]["values"][0]
    assert first["exact"] == pytest.approx(float(report["exact_heads"].mean("prompt")[0, 0]))
    assert points["encoding"]["x"]["title"].startswith("exact patching effect")
