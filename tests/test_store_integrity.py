"""Stores cannot lose data silently (issue 15, group 2): saving over the store a result is
lazily read from, failed writes, missing/unreadable chunks, corrupt metadata."""

from __future__ import annotations

import json
import re

import dask.array
import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape import schema, store
from lenscape.store import StoreError


def result(n_prompts: int = 4) -> xr.DataArray:
    """(prompt, layer, head) scores chunked 2 prompts at a time: zarr writes 2+ chunks."""
    values = np.arange(n_prompts * 3 * 2, dtype=np.float32).reshape(n_prompts, 3, 2) / 7
    da = schema.make(
        values,
        dims=("prompt", "layer", "head"),
        coords={"text": [f"text {i}" for i in range(n_prompts)], "category": ["a"] * n_prompts},
        attrs={
            "long_name": "score",
            "units": "logits",
            "method": "ablation",
            "metric": "logit_diff",
            "model": "tiny",
            "backend": "nnsight",
            "dtype": "float32",
        },
        n_layers=3,
    )
    return da.copy(data=dask.array.from_array(values, chunks=(2, 3, 2)))


def chunk_file(path, name="__xarray_dataarray_variable__", key="c/1/0/0"):
    return path / name / key


# ------------------------------------------------------------------ saving over a lazy input


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_saving_a_lazy_result_over_its_own_store_keeps_it(tmp_path, suffix):
    path = lsc.save(result(), tmp_path / f"r{suffix}")
    lazy = lsc.open(path, lazy=True)
    lsc.save(lazy, path)
    xr.testing.assert_identical(lsc.open(path), result().compute())
    lsc.save(lsc.open(path, lazy=True) * 2, path)
    np.testing.assert_array_equal(lsc.open(path).values, result().values * 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"r{suffix}"]


def test_failed_overwrite_keeps_the_old_result(tmp_path):
    path = lsc.save(result(), tmp_path / "r.zarr")

    def explode(block):
        raise RuntimeError("boom while computing")

    failing = result().copy(data=dask.array.map_blocks(explode, result().data, dtype=np.float32))
    with pytest.raises(RuntimeError, match="boom"):
        lsc.save(failing, path)
    xr.testing.assert_identical(lsc.open(path), result().compute())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.zarr"]


# ------------------------------------------------------------------ completeness on open


def test_all_nan_chunk_is_written_and_opens(tmp_path):
    da = result()
    da = da.where(da["prompt"] < 2)  # prompts 2-3, one whole chunk, all NaN: "not computed"
    path = lsc.save(da, tmp_path / "r.zarr")
    assert chunk_file(path).exists()
    xr.testing.assert_identical(lsc.open(path), da.compute())


@pytest.mark.parametrize("lazy", [False, True])
def test_missing_chunk_is_an_error_naming_store_and_chunk(tmp_path, lazy):
    path = lsc.save(result(), tmp_path / "r.zarr")
    chunk_file(path).unlink()
    with pytest.raises(
        StoreError,
        match=rf"'{re.escape(str(path))}' is missing the chunk "
        r"'__xarray_dataarray_variable__/c/1/0/0'",
    ):
        lsc.open(path, lazy=lazy)
    rescued = lsc.open(path, verify=False)
    np.testing.assert_array_equal(rescued.values[:2], result().values[:2])
    assert np.isnan(rescued.values[2:]).all()


def test_missing_coordinate_chunk_is_an_error(tmp_path):
    path = lsc.save(result(), tmp_path / "r.zarr")
    chunk_file(path, "text", "c/0").unlink()
    with pytest.raises(StoreError, match="missing the chunk 'text/c/0' of 'text'"):
        lsc.open(path)


def test_truncated_chunk_is_an_error_naming_it(tmp_path):
    path = lsc.save(result(), tmp_path / "r.zarr")
    chunk = chunk_file(path)
    chunk.write_bytes(chunk.read_bytes()[:5])
    with pytest.raises(
        StoreError,
        match=r"chunk '__xarray_dataarray_variable__/c/1/0/0' of "
        r"'__xarray_dataarray_variable__' in the store "
        rf"'{re.escape(str(path))}' "
        "cannot be read",
    ):
        lsc.open(path, lazy=True)


@pytest.mark.parametrize("metadata", ["zarr.json", "layer/zarr.json"])
def test_corrupt_metadata_is_an_error_naming_the_path(tmp_path, metadata):
    path = lsc.save(result(), tmp_path / "r.zarr")
    (path / metadata).write_text('{"zarr_format": 3, "node_type": ')
    with pytest.raises(
        StoreError, match=rf"metadata of the store '{re.escape(str(path))}' cannot be read"
    ):
        lsc.open(path)
    with pytest.raises(StoreError, match=rf"Cannot read the saved result '{re.escape(str(path))}'"):
        lsc.open(path, verify=False)


def test_truncated_netcdf_is_an_error_naming_the_path(tmp_path):
    path = lsc.save(result(), tmp_path / "r.nc")
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(StoreError, match=rf"Cannot read the saved result '{re.escape(str(path))}'"):
        lsc.open(path)


# ------------------------------------------------------------------ unfinished captures


def _half_captured(tmp_path):
    """A streaming store of 4 prompts in chunks of 2 with only prompts 0-1 written."""
    path = tmp_path / "s.zarr"
    template = result().copy(data=np.full((4, 3, 2), np.nan, dtype=np.float32))
    store.create(template, path, chunk=2, settings={"method": "test"})
    store.write_part(result().isel(prompt=slice(0, 2)), path, start=0)
    return path


def test_unfinished_capture_opens_with_not_computed_nan(tmp_path):
    path = _half_captured(tmp_path)
    opened = lsc.open(path)
    np.testing.assert_array_equal(opened.values[:2], result().values[:2])
    assert np.isnan(opened.values[2:]).all()
    assert store.progress(path)[1].tolist() == [True, True, False, False]


def test_missing_chunk_of_finished_prompts_is_an_error(tmp_path):
    path = _half_captured(tmp_path)
    chunk_file(path, key="c/0/0/0").unlink()
    with pytest.raises(
        StoreError, match="missing the chunk '__xarray_dataarray_variable__/c/0/0/0'"
    ):
        lsc.open(path)


def test_damaged_settings_on_resume_say_so(tiny_llama, factual, tmp_path):
    path = tmp_path / "r.zarr"
    lsc.capture_to(path, "ablation", tiny_llama, factual[:2], batch_size=1, progress=False)
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["_lenscape_capture"] = "{not json"
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="metadata is damaged.*overwrite=True"):
        lsc.capture_to(path, "ablation", tiny_llama, factual[:2], batch_size=1, progress=False)


def test_path_of_wrong_type(tmp_path):
    with pytest.raises(TypeError, match="path must be a file path"):
        lsc.save(result(), None)
    with pytest.raises(TypeError, match="path must be a file path"):
        lsc.open(42)
