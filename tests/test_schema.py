"""The data model: constructors stamp provenance and depth; validate names the problem."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from lenscape import schema

ATTRS = {
    "long_name": "score",
    "units": "logits",
    "method": "m",
    "metric": "logit_diff",
    "model": "tiny",
    "backend": "nnsight",
    "dtype": "float32",
}


def make(**kw):
    return schema.make(
        np.zeros((2, 3, 4)),
        dims=("prompt", "layer", "head"),
        coords={"text": ["a", "b"], "category": ["x", "y"]},
        attrs=ATTRS,
        **kw,
    )


def test_make_adds_coords_attrs_and_depth():
    da = make(n_layers=3)
    assert list(da["layer"].values) == [0, 1, 2]
    np.testing.assert_allclose(da["depth"].values, [0, 0.5, 1])
    assert da["text"].dims == ("prompt",)
    assert da.attrs["schema_version"] == schema.SCHEMA_VERSION
    assert "lenscape_version" in da.attrs and da.attrs["n_layers"] == 3


def test_validate_rejects_unknown_dim():
    with pytest.raises(ValueError, match="Unknown dim"):
        schema.validate(xr.DataArray(np.zeros(2), dims=["neuron"], attrs=ATTRS))


def test_validate_rejects_misordered_dims():
    with pytest.raises(ValueError, match=r"out of order; use da\.transpose"):
        schema.validate(make().transpose("head", "layer", "prompt"), provenance=False)


def test_validate_rejects_unknown_component():
    da = xr.DataArray(np.zeros(2), dims=["component"], coords={"component": ["attn", "ffn"]})
    with pytest.raises(ValueError, match=r"Unknown component label\(s\) \['ffn'\]"):
        schema.validate(da, provenance=False)


def test_validate_rejects_non_scalar_attrs_and_missing_provenance():
    da = make()
    with pytest.raises(ValueError, match="must be scalars"):
        schema.validate(da.assign_attrs(layers=[1, 2]))
    with pytest.raises(ValueError, match="Missing provenance"):
        schema.validate(da.drop_attrs())
    schema.validate(da.drop_attrs(), provenance=False)


def test_validate_rejects_negative_int_coords():
    with pytest.raises(ValueError, match="integers >= 0"):
        schema.validate(make().assign_coords(layer=[-1, 0, 1]))


def test_provenance_names_the_layout_and_whether_it_was_checked(tokenizer):
    from lenscape import models

    checked = models.tiny("qwen3", n_layers=2, tokenizer=tokenizer)
    unchecked = models.tiny("qwen3", n_layers=2, tokenizer=tokenizer, check=False)
    for model in (checked, unchecked):
        attrs = model.provenance("m")
        assert attrs["layout_fingerprint"] == model.spec.fingerprint
        assert attrs["layout_checked"] is model.layout_checked
    assert checked.layout_checked and not unchecked.layout_checked
    assert checked.spec.fingerprint.startswith("qwen3/L2/H4/KV2/D16/d64/V")
