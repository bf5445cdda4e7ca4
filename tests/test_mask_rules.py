"""The mask rules (mask_rules.py): what a mask is, what is kept, binarizing, any/all/share with
NaN as "not computed", and that aggregate and the Explorer follow the same rules."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from lenscape import aggregate, mask_rules
from lenscape.views.explorer import View, reduce

NAN = np.nan


def grid(values, dims=("seed", "head")) -> xr.DataArray:
    return xr.DataArray(np.asarray(values), dims=dims)


def test_a_mask_is_declared_by_its_type_never_its_values():
    zero_one = grid([[0.0, 1.0]])
    assert not mask_rules.is_mask(zero_one)
    assert mask_rules.is_mask(zero_one > 0.5)
    assert mask_rules.is_mask(zero_one.assign_attrs(units=mask_rules.MASK_UNITS))


def test_kept_is_computed_and_non_zero():
    values = grid([[0.0, 1.0, NAN, -2.0, 0.3]])
    assert mask_rules.kept(values).values.tolist() == [[False, True, False, True, True]]


def test_reductions_count_only_computed_cells_and_are_nan_when_none_is():
    mask = grid([[1, 0, NAN, NAN], [1, 1, 0, NAN], [NAN, 1, 0, NAN]])  # (seed 3, head 4)
    np.testing.assert_array_equal(mask_rules.any_(mask, "seed").values, [1, 1, 0, NAN])
    np.testing.assert_array_equal(mask_rules.all_(mask, "seed").values, [1, 0, 0, NAN])
    np.testing.assert_allclose(mask_rules.share(mask, "seed").values, [1, 2 / 3, 0, NAN])
    full = mask.isel(head=[0, 1, 2]).fillna(0)
    assert (
        mask_rules.any_(full, "seed").dtype == bool and mask_rules.all_(full, "seed").dtype == bool
    )
    assert mask_rules.share(full, "seed").dtype == float


def test_any_is_a_positive_share_and_all_a_full_share():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2, size=(5, 6, 4)).astype(float)
    values[rng.random(values.shape) < 0.4] = NAN
    values[:, 0, 0] = NAN  # one cell never computed
    mask = grid(values, dims=("seed", "layer", "head"))
    share = mask_rules.share(mask, "seed")
    assert np.isnan(share.values[0, 0])
    computed = share.notnull()
    xr.testing.assert_equal(mask_rules.any_(mask, "seed"), (share > 0).where(computed))
    xr.testing.assert_equal(mask_rules.all_(mask, "seed"), (share == 1).where(computed))
    both = mask_rules.share(mask, ["seed", "layer"])  # several dims pool into one share
    pooled = mask.stack(cell=["seed", "layer"])
    np.testing.assert_allclose(both.values, pooled.mean("cell").values)


@pytest.mark.parametrize(
    "side, passed, name",
    [
        ("abs", [1, 0, 1, NAN], "|gate| >= 0.5"),
        ("above", [0, 0, 1, NAN], "gate >= 0.5"),
        ("below", [1, 1, 0, NAN], "gate <= 0.5"),
    ],
)
def test_binarize_follows_its_rule_and_names_it(side, passed, name):
    scores = grid([-0.7, 0.2, 0.9, NAN], dims=("head",)).assign_attrs(long_name="gate")
    mask = mask_rules.binarize(scores, 0.5, side)
    np.testing.assert_array_equal(mask.values, passed)
    assert mask.attrs == {"long_name": name, "units": "bool"} and mask_rules.is_mask(mask)
    assert mask_rules.binarize(scores.fillna(0), 0.5, side).dtype == bool  # all computed


def test_an_unknown_side_is_refused_with_the_rules():
    with pytest.raises(ValueError, match=r"side='up' is not a binarize rule.*'abs'"):
        mask_rules.binarize(grid([0.1], dims=("head",)), 0.5, "up")


def test_share_units_name_the_pooled_dims():
    assert mask_rules.share_units("seed") == "share of seeds"
    assert mask_rules.share_units(["prompt", "seed"]) == "share of prompts and seeds"


def test_aggregate_and_the_explorer_agree_cell_for_cell():
    gates = np.array([[0.9, 0.9, 0.1, NAN], [0.9, 0.2, NAN, NAN], [NAN, 0.8, 0.1, NAN]])
    da = grid(gates[:, None, :], dims=("seed", "layer", "head")).assign_attrs(long_name="g")
    for how, function in (
        ("all", aggregate.always),
        ("any", aggregate.any_),
        ("share", aggregate.fraction),
    ):
        view = View(x="head", y="layer", pick={"seed": how}, threshold=0.5)
        shown = reduce(da, view)
        np.testing.assert_array_equal(shown.values, function(da).values)
        assert np.isnan(shown.values[0, 3])  # never computed: NaN in both, never 0
