"""save/open round trips: values, NaN, dims, int and string coords, attrs, names, kinds."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape import schema

ATTRS = {
    "long_name": "Change in logit difference",
    "units": "logits",
    "method": "ablation",
    "metric": "logit_diff",
    "model": "tiny",
    "backend": "nnsight",
    "dtype": "float32",
    "normalized": True,
    "tied": False,
    "lambda_": 0.1,
    "n_seeds": 5,
}


def result(dtype=np.float32):
    values = np.arange(2 * 3 * 2, dtype=dtype).reshape(2, 3, 2) / 7
    values[0, 1, 1] = np.nan
    return schema.make(
        values,
        dims=("prompt", "layer", "component"),
        coords={
            "component": ["attn", "mlp"],
            "text": ["The capital of France is", "Été à Zürich"],
            "category": ["capital", "landmark"],
        },
        attrs=ATTRS,
        n_layers=3,
    )


def assert_same(a, b):
    xr.testing.assert_identical(a, b)
    for name in a.coords:
        assert a[name].dtype.kind == b[name].dtype.kind, name
    assert a.attrs == b.attrs and all(type(a.attrs[k]) is type(b.attrs[k]) for k in a.attrs)


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dataarray_round_trip(tmp_path, suffix, dtype):
    da = result(dtype)
    back = lsc.open(lsc.save(da, tmp_path / f"r{suffix}"))
    assert isinstance(back, xr.DataArray) and back.name is None
    assert back.dtype == dtype and np.isnan(back.values[0, 1, 1])
    assert_same(da, back)
    named = da.rename("scores")
    assert lsc.open(lsc.save(named, tmp_path / f"n{suffix}")).name == "scores"


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_dataset_round_trip(tmp_path, suffix):
    ds = xr.Dataset({"a": result(), "b": result() * 2}, attrs={"model": "tiny", "flag": True})
    back = lsc.open(lsc.save(ds, tmp_path / f"d{suffix}"))
    assert isinstance(back, xr.Dataset)
    xr.testing.assert_identical(ds, back)
    assert back.attrs["flag"] is True


def test_lazy_open(tmp_path):
    back = lsc.open(lsc.save(result(), tmp_path / "r.zarr"), lazy=True)
    assert back.chunks is not None
    assert_same(result(), back.compute())


def test_overwrite(tmp_path):
    path = lsc.save(result(), tmp_path / "r.zarr")
    lsc.save(result() + 1, path)
    np.testing.assert_allclose(lsc.open(path).values, (result() + 1).values)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="Cannot tell the format"):
        lsc.save(result(), tmp_path / "r.csv")
    with pytest.raises(FileNotFoundError, match="No saved result"):
        lsc.open(tmp_path / "missing.zarr")
    with pytest.raises(ValueError, match="takes an xarray"):
        lsc.save(np.zeros(3), tmp_path / "r.nc")
