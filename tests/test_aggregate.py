"""Always / Any / fraction across seeds, head roles, their thresholds; shares over a dim
and stacking models of different depth."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape import aggregate, bootstrap, schema

ATTRS = {
    "long_name": "Facilitation",
    "units": "score",
    "method": "head_gating",
    "metric": "loss",
    "model": "tiny",
    "backend": "torch",
    "dtype": "float32",
}


def scores():
    values = np.array(
        [[[0.9, 0.2], [0.6, 0.1]], [[0.8, 0.7], [0.4, 0.1]], [[0.7, 0.1], [0.9, np.nan]]]
    )  # (seed 3, layer 2, head 2)
    return schema.make(values, dims=("seed", "layer", "head"), attrs=ATTRS, n_layers=2)


def test_always_any_fraction_count_only_the_computed_seeds():
    da = scores()  # layer 1, head 1: 0.1, 0.1 and one seed not computed
    always, any_ = aggregate.always(da), aggregate.any_(da)
    np.testing.assert_array_equal(always.values, [[1, 0], [0, 0]])
    np.testing.assert_array_equal(any_.values, [[1, 1], [1, 0]])
    share = aggregate.fraction(da)
    np.testing.assert_allclose(share.values, [[1, 1 / 3], [2 / 3, 0]])
    assert always.dtype == bool  # every cell has a computed seed
    assert "every seed" in always.attrs["long_name"] and always.attrs["aggregation"]
    assert always.attrs["units"] == "bool" and "depth" in always.coords
    assert share.attrs["units"] == "share of seeds"
    never = da.where(da["head"] == 0)  # head 1 never computed: NaN, never 0 or False
    for function in (aggregate.always, aggregate.any_, aggregate.fraction):
        out = function(never)
        assert np.isnan(out.values[:, 1]).all() and not np.isnan(out.values[:, 0]).any()


def test_threshold_changes_the_result():
    assert float(aggregate.always(scores(), threshold=0.65).sum()) == 1


def test_roles():
    da = scores().isel(seed=0)  # [[0.9, 0.2], [0.6, 0.1]]
    fac, inter = da >= 0.5, da <= 0.15
    codes = aggregate.roles(fac.astype(float), inter.astype(float))
    np.testing.assert_array_equal(codes.values, [[1, 0], [1, 2]])
    # every combination, read back through the labels the result carries in its attrs
    fac = xr.DataArray([[True, True], [False, False]], dims=("layer", "head")).astype(float)
    inter = xr.DataArray([[True, False], [True, False]], dims=("layer", "head")).astype(float)
    codes = aggregate.roles(fac, inter.where([[True, True], [True, False]]))
    labels = dict(item.split(" ", 1) for item in codes.attrs["roles"].split(", "))
    named = [[labels[f"{c:.0f}"] if np.isfinite(c) else "NaN" for c in row] for row in codes.values]
    assert named == [["both", "facilitating"], ["interfering", "NaN"]]
    assert [aggregate.ROLES[int(codes[i, j])] for i, j in ((0, 0), (0, 1), (1, 0))] == [
        "both",
        "facilitating",
        "interfering",
    ]
    neither = aggregate.roles(fac * 0, inter * 0)
    assert set(neither.values.ravel()) == {aggregate.ROLES.index("neither")}


def test_roles_match_the_two_masks_by_label():
    """The interference mask is read by the labels of the facilitation mask: a sortby or
    transpose of either gives the same codes (in facilitation's order); other labels are
    refused by name."""
    da = scores()
    fac, inter = aggregate.always(da, threshold=0.5), aggregate.any_(1 - da, threshold=0.8)
    codes = aggregate.roles(fac, inter)
    moved = inter.sortby("head", ascending=False).transpose("head", "layer")
    xr.testing.assert_identical(aggregate.roles(fac, moved), codes)
    flipped = aggregate.roles(fac.sortby("layer", ascending=False), inter)
    xr.testing.assert_identical(flipped.sel(layer=codes["layer"]), codes)
    with pytest.raises(ValueError, match=r"interference's 'head' labels do not match .*\[7\]"):
        aggregate.roles(fac, inter.assign_coords(head=[0, 7]))
    with pytest.raises(TypeError, match=r"interference must be an xarray.DataArray"):
        aggregate.roles(fac, inter.values)
    with pytest.raises(TypeError, match=r"da must be an xarray.DataArray"):
        aggregate.always(da.to_dataset(name="facilitation"))


def codes_by_seed(rows, seeds):
    """Role codes (seed, layer 2, head 2) from one flat row of 4 codes per seed."""
    values = np.array(rows, dtype=float).reshape(len(rows), 2, 2)
    return schema.make(
        values, dims=("seed", "layer", "head"), coords={"seed": seeds}, attrs=ATTRS, n_layers=2
    )


def test_agreement_among_seeds_and_against_another_fit():
    """Among one fit's seeds every two different seeds are a pair; against another fit,
    every seed with every seed; a cell counts only where both computed it."""
    own = codes_by_seed([[0, 1, 2, 3], [0, 1, 2, 0], [1, 1, 1, 1]], seeds=[0, 1, 2])
    among = aggregate.agreement(own)  # pairs (0, 1): 3/4, (0, 2): 1/4, (1, 2): 1/4
    assert float(among) == pytest.approx((3 / 4 + 1 / 4 + 1 / 4) / 3)
    assert (among.attrs["n_pairs"], among.attrs["lowest"], among.attrs["highest"]) == (
        3,
        0.25,
        0.75,
    )
    assert among.attrs["units"] == "share of cells" and among.attrs["model"] == "tiny"
    live = codes_by_seed([[0, 1, 2, np.nan]], seeds=[5])  # head (1, 1) not computed
    against = aggregate.agreement(live, own)  # over 3 cells: 3/3, 3/3, 1/3
    assert float(against) == pytest.approx(7 / 9) and against.attrs["n_pairs"] == 3
    # read by label: the other fit's cells in any order give the same answer
    moved = own.sortby("head", ascending=False).transpose("head", "seed", "layer")
    assert float(aggregate.agreement(live, moved)) == float(against)
    assert float(aggregate.agreement(own.sortby("seed", ascending=False))) == float(among)


def test_agreement_refuses_what_has_no_pair_or_other_cells():
    own = codes_by_seed([[0, 1, 2, 3]], seeds=[0])
    with pytest.raises(ValueError, match="pairs two different seed labels; da has 1"):
        aggregate.agreement(own)
    with pytest.raises(ValueError, match=r"other's 'head' labels do not match"):
        aggregate.agreement(own, own.assign_coords(head=[0, 7]))
    with pytest.raises(ValueError, match="other has dims"):
        aggregate.agreement(own, own.isel(head=0))
    with pytest.raises(TypeError, match=r"other must be an xarray\.DataArray"):
        aggregate.agreement(own, own.values)
    with pytest.raises(ValueError, match="Cannot aggregate over 'prompt'"):
        aggregate.agreement(own, dim="prompt")


def test_agreement_refuses_continuous_values_and_says_binarize_first():
    """Issue 43: two seeds differing by 1e-7 everywhere agreed on 0% of cells, silently.
    Agreement compares categories; scores are refused with the fix, and once binarized
    the two seeds agree everywhere."""
    first = scores().isel(seed=0)
    close = xr.concat([first, first + 1e-7], dim="seed")
    with pytest.raises(ValueError, match=r"da holds continuous values.*aggregate\.binarize"):
        aggregate.agreement(close)
    masks = aggregate.binarize(close, 0.5)
    assert masks.dtype == bool and masks.attrs["long_name"] == "Facilitation >= 0.5"
    assert float(aggregate.agreement(masks)) == 1.0
    with pytest.raises(ValueError, match=r"other holds continuous values"):
        aggregate.agreement(masks, close)
    # masks with NaN (float, units "bool") and whole-number codes are categories
    with_nan = aggregate.binarize(scores(), 0.5, side="above")
    assert with_nan.attrs["units"] == "bool" and np.isnan(with_nan.values).any()
    assert 0 <= float(aggregate.agreement(with_nan)) <= 1
    assert float(aggregate.agreement(codes_by_seed([[0, 1, 2, 3], [0, 1, 2, 3]], [0, 1]))) == 1
    with pytest.raises(TypeError, match="must hold numbers"):
        aggregate.agreement(close.astype(str))


def test_binarize_follows_the_mask_rules_and_refuses_bad_input():
    da = scores()
    assert (aggregate.binarize(da, 0.5, side="below") == (da <= 0.5)).where(da.notnull()).all()
    strong = aggregate.binarize(da - 0.5, 0.3, side="abs")
    assert strong.attrs["long_name"].startswith("|") and strong.attrs["units"] == "bool"
    with pytest.raises(TypeError, match=r"da must be an xarray\.DataArray"):
        aggregate.binarize(da.values, 0.5)
    with pytest.raises(TypeError, match="threshold must be a number"):
        aggregate.binarize(da, "0.5")
    with pytest.raises(ValueError, match=r"side='up' is not a binarize rule"):
        aggregate.binarize(da, 0.5, side="up")


@pytest.mark.parametrize("threshold", [-0.1, 1.5])
def test_bad_threshold(threshold):
    with pytest.raises(ValueError, match=r"threshold must be a finite number in \[0, 1\]"):
        aggregate.always(scores(), threshold=threshold)


def test_missing_dim():
    with pytest.raises(ValueError, match="Cannot aggregate over 'cluster'"):
        aggregate.any_(scores(), dim="cluster")


def test_always_any_scores_are_min_and_max_and_match_thresholds():
    da = scores()
    low, high = aggregate.always_score(da), aggregate.any_score(da)
    np.testing.assert_allclose(low.values, [[0.7, 0.1], [0.4, 0.1]])  # NaN skipped
    np.testing.assert_allclose(high.values, [[0.9, 0.7], [0.9, 0.1]])
    assert low.attrs["units"] == "score" and "Always" in low.attrs["long_name"]
    da = da.where(da["head"] == 0)  # head 1 never computed: stays NaN
    low, high = aggregate.always_score(da), aggregate.any_score(da)
    assert np.isnan(low.values[:, 1]).all() and np.isnan(high.values[:, 1]).all()
    for threshold in (0.3, 0.5, 0.75):
        computed = da.notnull().any("seed")
        np.testing.assert_array_equal(
            (low >= threshold).where(computed).values,
            aggregate.always(da, threshold=threshold).values,
        )
        np.testing.assert_array_equal(
            (high >= threshold).where(computed).values,
            aggregate.any_(da, threshold=threshold).values,
        )


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
def test_threshold_type_and_range_in_every_function(function, threshold, error):
    with pytest.raises(error, match=r"threshold must be a (finite )?number in \[0, 1\]"):
        function(_seeds(), threshold=threshold)


def test_integer_and_numpy_thresholds_work():
    assert aggregate.always(_seeds(), threshold=1).sum() == 0
    xr.testing.assert_identical(
        aggregate.any_(_seeds(), threshold=np.float32(0.5)), aggregate.any_(_seeds(), threshold=0.5)
    )


def test_normalize_and_combine():
    a = xr.DataArray(
        np.arange(6.0).reshape(3, 2) + 1,
        dims=("layer", "component"),
        coords={
            "layer": [0, 1, 2],
            "component": ["q_proj", "k_proj"],
            "depth": ("layer", [0, 0.5, 1]),
        },
    )
    b = a.isel(layer=[0, 1]).assign_coords(depth=("layer", [0, 1.0]))
    np.testing.assert_allclose(aggregate.normalize(a).sum("component").values, 1)
    both = aggregate.combine_models({"a": a, "b": b})
    assert both.dims == ("model", "layer", "component") and both.shape == (2, 3, 2)
    assert np.isnan(both.sel(model="b", layer=2)).all()
    np.testing.assert_allclose(both["depth"].sel(model="b").values[:2], [0, 1])
    with pytest.raises(ValueError, match="Cannot normalise over 'head'"):
        aggregate.normalize(a, over="head")


def test_correct_only_keeps_the_prompts_the_model_gets_right():
    values = np.arange(12.0).reshape(3, 2, 2)
    da = schema.make(values, dims=("prompt", "layer", "head"), attrs=ATTRS, n_layers=2)
    flagged = da.assign_coords(correct=("prompt", [True, False, True]))
    kept = aggregate.correct_only(flagged)
    assert kept["prompt"].values.tolist() == [0, 2]
    np.testing.assert_array_equal(kept.values, values[[0, 2]])
    assert kept.attrs["correct_only"] == "2 of 3 prompts the model gets right"
    assert "correct_only" not in flagged.attrs  # a new object; the input is untouched
    with pytest.raises(ValueError, match=r"needs a boolean 'correct' coord.*assign_coords"):
        aggregate.correct_only(da)
    with pytest.raises(ValueError, match=r"dims \('layer', 'head'\).*before \.mean\('prompt'\)"):
        aggregate.correct_only(flagged.mean("prompt"))
    with pytest.raises(ValueError, match="answers none of the 3 prompts right"):
        aggregate.correct_only(da.assign_coords(correct=("prompt", [False] * 3)))


def test_routing_wins_judges_only_clusters_with_held_out_texts():
    loss_routed = np.array([[1.0, 3.0, 2.0], [5.0, 0.5, 9.0]])
    loss_global = np.array([[2.0, 2.0, 2.0], [4.0, 1.0, 1.0]])
    comparison = xr.Dataset(
        {
            "loss_routed": (("target_sparsity", "cluster"), loss_routed),
            "loss_global": (("target_sparsity", "cluster"), loss_global),
            "n_held_out": (("cluster",), np.array([3, 0, 2])),
        },
        coords={"target_sparsity": [0.1, 0.3], "cluster": [0, 1, 2]},
    )
    wins = aggregate.routing_wins(comparison)
    assert wins["cluster"].values.tolist() == [0, 2]  # cluster 1 received no held-out text
    assert wins.values.tolist() == [[True, False], [False, False]]  # a tie is not a win
    with pytest.raises(ValueError, match="No cluster received"):
        aggregate.routing_wins(comparison.assign(n_held_out=("cluster", np.zeros(3, int))))
    with pytest.raises(ValueError, match="loss_global"):
        aggregate.routing_wins(comparison.drop_vars("loss_global"))
    with pytest.raises(ValueError, match=r"comparison is a result of 'block_masks', not of"):
        aggregate.routing_wins(comparison.assign_attrs(method="block_masks"))


def per_prompt(n_prompts=40, seed=0):
    """(prompt, layer 3, head 4): head 0 strong in every prompt, head 1 flips sign."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 0.3, size=(n_prompts, 3, 4))
    values[:, :, 0] += 2.0
    values[:, :, 1] = rng.choice([-1.0, 1.0], size=(n_prompts, 3))
    return schema.make(values, dims=("prompt", "layer", "head"), attrs=ATTRS, n_layers=3)


def test_mean_gives_the_mean_and_a_bootstrap_interval_per_cell():
    da = per_prompt()
    out = aggregate.mean(da, "prompt", n_resamples=400)
    assert out.dims == ("layer", "head", "bound")
    assert out["bound"].values.tolist() == list(aggregate.BOUNDS)
    xr.testing.assert_allclose(out.sel(bound="mean", drop=True).drop_vars("n"), da.mean("prompt"))
    low, high = out.sel(bound="low"), out.sel(bound="high")
    assert (low < out.sel(bound="mean")).all() and (out.sel(bound="mean") < high).all()
    assert (low.sel(head=0) > 0).all()  # strong in every prompt: the interval excludes 0
    assert ((low.sel(head=1) < 0) & (high.sel(head=1) > 0)).all()  # a sign that flips
    # the same draw a loop over resamples would make (prompts in label order)
    drawn = bootstrap.draw(40, n_resamples=400, seed=0)
    cell = da.sel(layer=2, head=3).values[drawn].mean(1)
    np.testing.assert_allclose(
        out.sel(layer=2, head=3, bound=["low", "high"]), np.quantile(cell, [0.025, 0.975])
    )
    assert out["n"].values.tolist() == [[40] * 4] * 3
    assert out.attrs["long_name"] == "Facilitation: mean over 40 prompts, 95% interval"
    assert out.attrs["n_resamples"] == 400 and out.attrs["ci"] == 0.95
    assert out.attrs["interval"].startswith("percentile bootstrap over prompts")
    assert "interval_note" not in out.attrs and out.attrs["units"] == "score"


def test_one_bound_of_an_interval_is_named_as_what_it_holds():
    """A bound picked from the interval (by label or position) is titled as that bound, so a
    heatmap of the mean alone never claims an interval it does not draw."""
    out = aggregate.mean(per_prompt(), "prompt", n_resamples=100)
    whole = "Facilitation: mean over 40 prompts, 95% interval"
    assert schema.name_from_attrs(out) == whole
    assert schema.name_from_attrs(out.sel(bound="mean")) == "Facilitation: mean over 40 prompts"
    assert schema.name_from_attrs(out.isel(bound=1)) == f"{whole}: low bound"
    chart = lsc.heatmap(out.sel(bound="high"), x="head", y="layer").to_dict()
    assert chart["title"]["text"] == f"{whole}: high bound"
    assert (
        "interval"
        not in lsc.heatmap(out.sel(bound="mean"), x="head", y="layer").to_dict()["title"]["text"]
    )


def test_mean_carries_a_fast_estimates_error_and_what_was_measured():
    """The mean's error estimate bounds |mean(estimate) - mean(exact)| when every prompt's
    bounds that prompt's; a NaN error stays NaN; measured = measured on every prompt; the
    answer does not depend on the order of the prompts."""
    rng = np.random.default_rng(0)
    exact = per_prompt(6)
    error = np.abs(rng.normal(size=exact.shape)).astype(np.float32)
    estimate = exact + error * rng.uniform(-1, 1, size=exact.shape)  # within each error
    measured = rng.uniform(size=exact.shape) < 0.3
    error[measured] = 0.0
    estimate = estimate.where(~measured, exact)
    error[2, 1, 3] = np.nan  # unknown on one prompt
    da = estimate.assign_coords(
        error=(exact.dims, error, {"method": "trapezoid: test"}),
        measured=(exact.dims, measured),
    )
    out = aggregate.mean(da, "prompt", n_resamples=200).sel(bound="mean")
    np.testing.assert_allclose(out["error"], np.mean(error, axis=0), rtol=1e-5)
    assert np.isnan(out["error"].sel(layer=1, head=3)) and out["error"].isnull().sum() == 1
    known = out["error"].notnull()
    gap = np.abs(out - exact.mean("prompt"))
    assert bool((gap.where(known) <= out["error"].where(known) + 1e-6).sum() == known.sum())
    assert out["error"].attrs["method"] == "trapezoid: test"
    assert "triangle inequality" in out["error"].attrs["pooling"]
    np.testing.assert_array_equal(out["measured"], measured.all(axis=0))
    shuffled = aggregate.mean(da.isel(prompt=rng.permutation(6)), "prompt", n_resamples=200)
    xr.testing.assert_identical(shuffled.sel(bound="mean"), out)


def test_mean_reads_prompts_by_label_and_never_counts_nan():
    da = per_prompt(12)
    da[:, 0, 0] = np.nan  # never computed
    da[1:, 0, 2] = np.nan  # computed for one prompt
    da[:6, 1, 1] = np.nan  # computed for half of them
    out = aggregate.mean(da, n_resamples=200, seed=5)
    moved = da.isel(prompt=np.random.default_rng(0).permutation(12)).transpose("head", ...)
    xr.testing.assert_allclose(
        aggregate.mean(moved, n_resamples=200, seed=5).transpose(*out.dims), out
    )
    assert out.sel(layer=0, head=0).isnull().all()
    assert out["n"].sel(layer=0, head=0) == 0 and out["n"].sel(layer=1, head=1) == 6
    assert out.sel(layer=0, head=2, bound="mean") == da[0, 0, 2]
    assert out.sel(layer=0, head=2, bound=["low", "high"]).isnull().all()
    assert out.sel(layer=1, head=1).notnull().all()
    assert out.attrs["interval_note"] == (
        "2 cells computed for fewer than 2 prompts have no interval (NaN)"
    )


def test_mean_of_one_prompt_says_why_its_intervals_are_nan_and_refuses_bad_input():
    one = aggregate.mean(per_prompt(1), n_resamples=100)
    assert one.sel(bound=["low", "high"]).isnull().all()
    assert one.attrs["interval_note"].startswith("one prompt: a bootstrap of one value")
    mask = per_prompt(4) > 0
    assert aggregate.mean(mask.assign_attrs(units="bool")).attrs["units"] == "share of prompts"
    with pytest.raises(ValueError, match=r"Cannot aggregate over 'seed'.*pass dim="):
        aggregate.mean(per_prompt(), "seed")
    with pytest.raises(ValueError, match=r"'prompt' labels repeat"):
        aggregate.mean(per_prompt(3).assign_coords(prompt=[0, 0, 1]))
    with pytest.raises(ValueError, match="n_resamples must be"):
        aggregate.mean(per_prompt(), n_resamples=10**9)
    with pytest.raises(TypeError, match=r"da must be an xarray\.DataArray"):
        aggregate.mean(per_prompt().values)


def test_reliability_grows_with_the_prompts_per_half():
    da = per_prompt(40)
    rel = aggregate.reliability(da, sizes=[1, 5, 20], n_splits=50, top_k=3)
    assert set(rel.data_vars) == {"correlation", "top_overlap"}
    assert rel["correlation"].dims == ("size", "bound")
    assert rel["size"].values.tolist() == [1, 5, 20]
    r = rel["correlation"].sel(bound="mean").values
    assert r[0] < r[1] < r[2] and r[2] > 0.9
    assert (rel.sel(bound="low") <= rel.sel(bound="mean")).all().to_array().all()
    assert rel["top_overlap"].sel(size=20, bound="mean") == 1.0  # head 0 rows lead every half
    assert rel.attrs["method"] == "reliability" and rel.attrs["n_prompts"] == 40
    assert rel.attrs["map"] == "Facilitation" and rel.attrs["top_k"] == 3
    moved = da.isel(prompt=np.random.default_rng(1).permutation(40), head=[3, 1, 0, 2])
    again = aggregate.reliability(
        moved.transpose("head", ...), sizes=[1, 5, 20], n_splits=50, top_k=3
    )
    xr.testing.assert_allclose(again, rel)


def test_reliability_defaults_and_refusals():
    rel = aggregate.reliability(per_prompt(85), n_splits=10)
    assert rel["size"].values.tolist() == [1, 2, 3, 5, 8, 12, 18, 28, 42]  # log-spaced
    assert np.isnan(aggregate.reliability(per_prompt(8), n_splits=4, top_k=12)["top_overlap"]).all()
    with pytest.raises(ValueError, match="at least 2 prompts"):
        aggregate.reliability(per_prompt(1))
    with pytest.raises(ValueError, match=r"sizes\[0\] must be an integer from 1 to 5"):
        aggregate.reliability(per_prompt(10), sizes=[6])
    with pytest.raises(TypeError, match="sizes must be a non-empty list"):
        aggregate.reliability(per_prompt(10), sizes=5)
    with pytest.raises(ValueError, match="n_splits must be an integer from 2"):
        aggregate.reliability(per_prompt(10), n_splits=1)
