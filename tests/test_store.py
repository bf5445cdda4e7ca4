"""Saving and opening results (``lenscape.store``).

- round trips: values, NaN, dims, int and string coords, attrs, names, kinds;
- stores cannot lose data silently (issue 15, group 2): saving over the store a result is
  lazily read from, failed writes, missing/unreadable chunks, corrupt metadata;
- one writer per store (issue 15, group 3): a second writer fails at once naming the first,
  the first finishes as if alone, and a dead writer's lock does not block resuming.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings

import dask.array
import numpy as np
import pytest
import xarray as xr
from _helpers import TESTS, answered_prompts

import lenscape as lsc
from lenscape import schema, store
from lenscape.store import StoreError

#: The plain provenance of a dask-backed score (no method parameters).
SCORE_ATTRS = ("units", "method", "metric", "model", "backend", "dtype")
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


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_boolean_results_round_trip(tmp_path, suffix):
    """Block masks are boolean and carry the provenance ``dtype`` attr, which xarray's
    netCDF encoding of booleans also writes: it is kept under its own key on disk."""
    kept = schema.make(
        np.array([[[True, False], [False, True], [True, True]]]),
        dims=("cluster", "layer", "component"),
        coords={"component": ["attn", "mlp"]},
        attrs={**ATTRS, "units": "bool"},
        n_layers=3,
    )
    keep_prob = xr.full_like(kept, 0.5, dtype=np.float32)  # attrs kept, dtype attr too
    masks = xr.Dataset({"mask": kept, "keep_prob": keep_prob}, attrs=ATTRS)
    for obj in (kept, masks):
        back = lsc.open(lsc.save(obj, tmp_path / f"m{suffix}"))
        xr.testing.assert_identical(back, obj)
    assert back["mask"].dtype == bool and back["mask"].attrs["dtype"] == "float32"
    zarr = {"engine": "zarr", "consolidated": False} if suffix == ".zarr" else {}
    on_disk = xr.open_dataset(tmp_path / f"m{suffix}", **zarr)
    assert on_disk["mask"].attrs["_lenscape_dtype"] == "float32"
    on_disk.close()


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


# ------------------------------------------------------------- stores other tools can read


def labelled_dataset() -> xr.Dataset:
    """Numbers with string coords (1-d and 2-d) and string data variables (2-d and 0-d)."""
    return xr.Dataset(
        {
            "score": result(),
            "top_token": (("prompt", "layer"), np.array([[" Paris", "é", ""], ["x", "yy", "z"]])),
            "note": ((), "Zürich"),
        },
        coords={"top_tokens": (("prompt", "layer"), np.array([["a b", "c", "d"]] * 2))},
        attrs={"model": "tiny"},
    )


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_strings_are_saved_without_warnings_and_come_back_as_str(tmp_path, suffix):
    ds = labelled_dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = lsc.open(lsc.save(ds, tmp_path / f"s{suffix}"))
        lazy = lsc.open(tmp_path / f"s{suffix}", lazy=True).compute()
    for opened in (back, lazy):
        xr.testing.assert_identical(opened, ds)
        assert all(opened[name].dtype.kind == "U" for name in ("top_token", "note", "text"))


def test_streaming_writes_strings_without_warnings(tmp_path):
    """``create`` and ``write_part`` (lazily chunked data, string labels and string data
    along ``prompt``) write variable-length strings too."""
    whole = labelled_dataset()
    template = whole.copy()
    template["score"] = template["score"] * np.nan
    template["top_token"] = template["top_token"].copy(data=np.full((2, 3), "", dtype=str))
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.create(template, path, chunk=1, settings={"method": "test"})
        for start in range(2):
            store.write_part(whole.isel(prompt=slice(start, start + 1)), path, start=start)
        back = lsc.open(path)
    xr.testing.assert_identical(back, whole)


def test_a_streamed_capture_and_a_logit_lens_save_without_zarr_warnings(
    tiny_llama, factual, tmp_path
):
    import zarr.errors

    lens = lsc.logit_lens(tiny_llama, factual[0])
    with warnings.catch_warnings():
        for category in (zarr.errors.ZarrFutureWarning, zarr.errors.ZarrUserWarning):
            warnings.filterwarnings("error", category=category)
        warnings.filterwarnings("error", category=xr.SerializationWarning)
        streamed = lsc.capture_to(
            tmp_path / "a.zarr", "ablation", tiny_llama, factual[:2], batch_size=1, progress=False
        )
        back = lsc.open(lsc.save(lens, tmp_path / "lens.zarr"))
    assert streamed["text"].values.tolist() == [p.text for p in factual[:2]]
    xr.testing.assert_identical(back, lens)


PLAIN_READER = """
import json, sys, warnings
warnings.simplefilter("error")
import xarray as xr
ds = xr.open_zarr(sys.argv[1], consolidated=False).load()
assert "lenscape" not in sys.modules
print(json.dumps({
    name: {"dims": list(var.dims), "values": var.values.tolist()}
    for name, var in ds.variables.items()
}))
"""


def test_a_saved_store_opens_in_plain_xarray_without_lenscape(tmp_path):
    """Another tool reads the store: plain ``xarray.open_zarr`` in a fresh process that
    never imports lenscape gets every value back, strings as strings, with no warning."""
    ds = labelled_dataset()
    path = lsc.save(ds, tmp_path / "s.zarr")
    out = subprocess.run(
        [sys.executable, "-c", PLAIN_READER, str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    read = json.loads(out.stdout)
    expected = {
        name: {"dims": list(var.dims), "values": var.values.tolist()}
        for name, var in ds.variables.items()
    }
    assert np.isnan(read["score"]["values"][0][1][1])  # NaN != NaN: compare the rest
    read["score"]["values"][0][1][1] = expected["score"]["values"][0][1][1] = 0.0
    assert read == expected


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_content_checksum_survives_a_round_trip_and_sees_any_change(tmp_path, suffix):
    ds = labelled_dataset().assign_attrs(n_seeds=[3], flag=True)  # netCDF reads [3] as 3
    before = store.content_sha256(ds)
    assert store.content_sha256(lsc.open(lsc.save(ds, tmp_path / f"s{suffix}"))) == before
    changed = ds.copy(deep=True)
    changed["score"][1, 0, 0] = changed["score"][1, 0, 0] + 1e-6
    for other in (changed, ds.assign_attrs(flag=False), ds.assign(note="Zurich")):
        assert store.content_sha256(other) != before
    assert store.content_sha256(ds.assign_attrs(sum="x"), skip=("sum",)) == before


# ----------------------------------------------------------------------------- integrity


def chunked_result(n_prompts: int = 4) -> xr.DataArray:
    """(prompt, layer, head) scores chunked 2 prompts at a time: zarr writes 2+ chunks."""
    values = np.arange(n_prompts * 3 * 2, dtype=np.float32).reshape(n_prompts, 3, 2) / 7
    da = schema.make(
        values,
        dims=("prompt", "layer", "head"),
        coords={"text": [f"text {i}" for i in range(n_prompts)], "category": ["a"] * n_prompts},
        attrs={"long_name": "score", **{k: ATTRS[k] for k in SCORE_ATTRS}},
        n_layers=3,
    )
    return da.copy(data=dask.array.from_array(values, chunks=(2, 3, 2)))


def chunk_file(path, name="__xarray_dataarray_variable__", key="c/1/0/0"):
    return path / name / key


# ------------------------------------------------------------------ saving over a lazy input


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_saving_a_lazy_result_over_its_own_store_keeps_it(tmp_path, suffix):
    path = lsc.save(chunked_result(), tmp_path / f"r{suffix}")
    lazy = lsc.open(path, lazy=True)
    lsc.save(lazy, path)
    xr.testing.assert_identical(lsc.open(path), chunked_result().compute())
    lsc.save(lsc.open(path, lazy=True) * 2, path)
    np.testing.assert_array_equal(lsc.open(path).values, chunked_result().values * 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"r{suffix}"]


def test_failed_overwrite_keeps_the_old_result(tmp_path):
    path = lsc.save(chunked_result(), tmp_path / "r.zarr")

    def explode(block):
        raise RuntimeError("boom while computing")

    failing = chunked_result().copy(
        data=dask.array.map_blocks(explode, chunked_result().data, dtype=np.float32)
    )
    with pytest.raises(RuntimeError, match="boom"):
        lsc.save(failing, path)
    xr.testing.assert_identical(lsc.open(path), chunked_result().compute())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.zarr"]


# ------------------------------------------------------------------ completeness on open


def test_all_nan_chunk_is_written_and_opens(tmp_path):
    da = chunked_result()
    da = da.where(da["prompt"] < 2)  # prompts 2-3, one whole chunk, all NaN: "not computed"
    path = lsc.save(da, tmp_path / "r.zarr")
    assert chunk_file(path).exists()
    xr.testing.assert_identical(lsc.open(path), da.compute())


@pytest.mark.parametrize("lazy", [False, True])
def test_missing_chunk_is_an_error_naming_store_and_chunk(tmp_path, lazy):
    path = lsc.save(chunked_result(), tmp_path / "r.zarr")
    chunk_file(path).unlink()
    with pytest.raises(
        StoreError,
        match=rf"'{re.escape(str(path))}' is missing the chunk "
        r"'__xarray_dataarray_variable__/c/1/0/0'",
    ):
        lsc.open(path, lazy=lazy)
    rescued = lsc.open(path, verify=False)
    np.testing.assert_array_equal(rescued.values[:2], chunked_result().values[:2])
    assert np.isnan(rescued.values[2:]).all()


def test_missing_coordinate_chunk_is_an_error(tmp_path):
    path = lsc.save(chunked_result(), tmp_path / "r.zarr")
    chunk_file(path, "text", "c/0").unlink()
    with pytest.raises(StoreError, match="missing the chunk 'text/c/0' of 'text'"):
        lsc.open(path)


def test_truncated_chunk_is_an_error_naming_it(tmp_path):
    path = lsc.save(chunked_result(), tmp_path / "r.zarr")
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
    path = lsc.save(chunked_result(), tmp_path / "r.zarr")
    (path / metadata).write_text('{"zarr_format": 3, "node_type": ')
    with pytest.raises(
        StoreError, match=rf"metadata of the store '{re.escape(str(path))}' cannot be read"
    ):
        lsc.open(path)
    with pytest.raises(StoreError, match=rf"Cannot read the saved result '{re.escape(str(path))}'"):
        lsc.open(path, verify=False)


def test_truncated_netcdf_is_an_error_naming_the_path(tmp_path):
    path = lsc.save(chunked_result(), tmp_path / "r.nc")
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(StoreError, match=rf"Cannot read the saved result '{re.escape(str(path))}'"):
        lsc.open(path)


# ------------------------------------------------------------------ unfinished captures


def _half_captured(tmp_path):
    """A streaming store of 4 prompts in chunks of 2 with only prompts 0-1 written."""
    path = tmp_path / "s.zarr"
    template = chunked_result().copy(data=np.full((4, 3, 2), np.nan, dtype=np.float32))
    store.create(template, path, chunk=2, settings={"method": "test"})
    store.write_part(chunked_result().isel(prompt=slice(0, 2)), path, start=0)
    return path


def test_unfinished_capture_opens_with_not_computed_nan(tmp_path):
    path = _half_captured(tmp_path)
    opened = lsc.open(path)
    np.testing.assert_array_equal(opened.values[:2], chunked_result().values[:2])
    assert np.isnan(opened.values[2:]).all()
    assert store.progress(path)[1].tolist() == [True, True, False, False]


def test_a_layout_write_killed_midway_leaves_no_store(tmp_path, monkeypatch):
    # A run killed while ``create`` writes the layout must not leave a store that a rerun
    # would resume with some arrays missing: the layout is written aside and swapped in.
    path = tmp_path / "s.zarr"
    template = chunked_result().copy(data=np.full((4, 3, 2), np.nan, dtype=np.float32))
    to_zarr = xr.Dataset.to_zarr

    def killed_midway(ds, target, **kwargs):
        to_zarr(ds[["_lenscape_done"]], target, mode="w", consolidated=False)  # some arrays,
        raise KeyboardInterrupt  # the kill

    monkeypatch.setattr(xr.Dataset, "to_zarr", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        store.create(template, path, chunk=2, settings={"method": "test"})
    assert list(tmp_path.iterdir()) == []  # neither the store nor the half-written copy
    monkeypatch.setattr(xr.Dataset, "to_zarr", to_zarr)
    store.create(template, path, chunk=2, settings={"method": "test"})
    assert store.progress(path)[1].tolist() == [False] * 4


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
    with pytest.raises(ValueError, match=r"metadata is damaged.*overwrite=True"):
        lsc.capture_to(path, "ablation", tiny_llama, factual[:2], batch_size=1, progress=False)


def test_path_of_wrong_type(tmp_path):
    with pytest.raises(TypeError, match="path must be a file path"):
        lsc.save(chunked_result(), None)
    with pytest.raises(TypeError, match="path must be a file path"):
        lsc.open(42)


# ----------------------------------------------------------------------------- one writer per store

N_PROMPTS, BATCH = 6, 2

#: A capture of the tiny Llama (as the ``tiny_llama`` fixture builds it) into argv[1].
#: argv[2] ("hold:FILE" or "start:FILE"): stop before the second batch until FILE exists,
#: holding the store's lock with one batch written; or start only once FILE exists (so
#: imports overlap with the first writer's run).
WRITER = textwrap.dedent(f"""
    import pathlib, sys, time
    sys.path.insert(0, {TESTS!r})
    import lenscape as lsc
    from lenscape import models
    from lenscape.sweep import streaming
    from _helpers import small_tokenizer

    model = models.tiny("llama", n_layers=3, seed=0, tokenizer=small_tokenizer())
    prompts = lsc.data.prompts("factual")[:{N_PROMPTS}]
    mode, _, file = sys.argv[2].partition(":")
    file = pathlib.Path(file)
    while mode == "start" and not file.exists():
        time.sleep(0.05)
    if mode == "hold":
        gate, write_batch = file, streaming.write_batch

        def gated(plan, number, path, step=lambda *_: None):
            while number == 1 and not gate.exists():
                time.sleep(0.05)
            write_batch(plan, number, path, step)
        streaming.write_batch = gated
    started = time.monotonic()
    try:
        lsc.capture_to(sys.argv[1], "ablation", model, prompts, batch_size={BATCH},
                       progress=False)
    except lsc.store.StoreError as err:
        print("REFUSED", round(time.monotonic() - started, 3), err, flush=True)
        sys.exit(3)
""")


def _capture(model, factual, path):
    return lsc.capture_to(
        path, "ablation", model, factual[:N_PROMPTS], batch_size=BATCH, progress=False
    )


def _lock_file(path):
    return path.with_name(path.name + ".lock")


def _wait_until_gated(child, path):
    """Wait until ``child`` holds the lock of ``path`` with its first batch written."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert child.poll() is None, "the first writer exited early"
        try:
            owner = json.loads(_lock_file(path).read_text())
            if owner["pid"] == child.pid and store.progress(path)[1].sum() >= BATCH:
                return owner
        except (OSError, ValueError, KeyError):  # not created or being written yet
            pass
        time.sleep(0.05)
    pytest.fail("the first writer did not get to its second batch in 300 s")


def test_second_writer_fails_fast_and_first_finishes(tiny_llama, factual, tmp_path, warm_python):
    path, gate, start = tmp_path / "r.zarr", tmp_path / "go", tmp_path / "start"
    first = warm_python.popen(WRITER, str(path), f"hold:{gate}")
    second = warm_python.popen(WRITER, str(path), f"start:{start}")
    try:
        owner = _wait_until_gated(first, path)
        assert owner["host"] == socket.gethostname()
        start.touch()
        stdout, stderr = second.communicate(timeout=300)
        assert second.returncode == 3, stderr[-2000:]
        seconds, message = stdout.split(maxsplit=2)[1:]
        assert float(seconds) < 5, f"the second writer took {seconds} s to fail"
        assert (
            f"'{path}' is being written by another process (pid {first.pid} on host "
            f"{socket.gethostname()}, since " in message
        )
        assert "wait for it to finish, or write to another path" in message
        gate.touch()
        assert first.wait(timeout=300) == 0, first.communicate()[1][-2000:]
    finally:
        for child in (first, second):
            if child.poll() is None:
                child.kill()
    assert not _lock_file(path).exists()
    alone = _capture(tiny_llama, factual, tmp_path / "alone.zarr")
    xr.testing.assert_identical(lsc.open(path), alone.compute())


def test_writer_killed_holding_the_lock_is_resumed(tiny_llama, factual, tmp_path, warm_python):
    path = tmp_path / "r.zarr"
    first = warm_python.popen(WRITER, str(path), f"hold:{tmp_path / 'never'}")
    try:
        _wait_until_gated(first, path)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
    assert json.loads(_lock_file(path).read_text())["pid"] == first.pid  # a stale lock file
    assert store.progress(path)[1].sum() == BATCH
    resumed = _capture(tiny_llama, factual, path)
    alone = _capture(tiny_llama, factual, tmp_path / "alone.zarr")
    xr.testing.assert_identical(resumed.compute(), alone.compute())
    assert not _lock_file(path).exists()


def test_lock_held_in_this_process_refuses_other_writers(tiny_llama, factual, tmp_path):
    path = tmp_path / "r.zarr"
    scores = _capture(tiny_llama, factual, path).compute()
    with store.writer_lock(path):
        with pytest.raises(
            StoreError,
            match=rf"'{re.escape(str(path))}' is being written by "
            r"another process "
            rf"\(pid {os.getpid()} on host ",
        ):
            _capture(tiny_llama, factual, path)
        with pytest.raises(StoreError, match="is being written by another process"):
            lsc.save(scores, path)
    lsc.save(scores, path)  # released
    xr.testing.assert_identical(lsc.open(path), scores)


def test_stale_lock_file_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "r.nc"
    _lock_file(path).write_text(
        json.dumps(
            {"pid": dead.pid, "host": socket.gethostname(), "since": "2026-01-01 00:00:00 UTC"}
        )
    )
    scores = xr.DataArray([1.0, 2.0], dims=("layer",), coords={"layer": [0, 1]})
    lsc.save(scores, path)
    xr.testing.assert_identical(lsc.open(path), scores)
    assert not _lock_file(path).exists()


def test_file_system_without_locks_warns(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(store.fcntl, "flock", no_locks)
    scores = xr.DataArray([1.0, 2.0], dims=("layer",), coords={"layer": [0, 1]})
    with pytest.warns(UserWarning, match="does not support locks.*run one writer only"):
        lsc.save(scores, tmp_path / "r.zarr")
    xr.testing.assert_identical(lsc.open(tmp_path / "r.zarr"), scores)


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_correct_flags_of_a_capture_round_trip(tiny_llama, factual, tmp_path, suffix):
    result = lsc.direct_logit_attribution(
        tiny_llama, answered_prompts(tiny_llama, factual[:5]), progress=False
    )
    assert result["correct"].values.any() and not result["correct"].values.all()
    back = lsc.open(lsc.save(result, tmp_path / f"r{suffix}"))
    assert back["correct"].dtype == bool
    xr.testing.assert_identical(back, result)
