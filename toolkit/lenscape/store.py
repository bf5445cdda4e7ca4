"""Save and open results (DataArray or Dataset) as zarr or netCDF, losslessly.

The format follows the suffix: ``.zarr`` (a directory store) or ``.nc`` (netCDF4).
What comes back equals what went in: values (NaN kept), dims, integer and string coords,
string data variables, attrs (booleans too, which netCDF cannot hold natively and we
encode), the array's name, and whether it was a DataArray or a Dataset. Strings go to zarr
as variable-length strings, a dtype with a zarr v3 specification, so other zarr readers
(plain ``xarray.open_zarr`` among them) open a store without lenscape.

Results can also be written piece by piece along ``prompt`` (streaming capture): ``create``
writes the layout of the whole result (coords, attrs, NaN data: "not computed") and the
settings it is made with; ``write_part`` fills one prompt slice and then marks it done in
a boolean ``_lenscape_done`` variable. zarr writes each chunk file atomically (temp file
+ rename) and parts are chunk-aligned, so a run killed at any moment leaves every part
either done or recomputable; ``progress`` reads the settings and done flags back to resume.

Nothing is lost silently:

- ``save`` over an existing result writes a temporary sibling first and swaps it in only
  when it is complete, so a failed write keeps the old result, and saving a result that is
  lazily read from the same path (``lsc.open(path, lazy=True)``) writes its real values;
- every zarr chunk is written, even an all-NaN one, so ``open_result`` can check that each
  chunk file exists and decodes: a missing or unreadable chunk raises ``StoreError`` naming
  the store and the chunk. Only the chunks of prompts a streaming capture has not finished
  (not marked in ``_lenscape_done``) may be missing; they read as NaN, "not computed";
- damaged metadata raises ``StoreError`` naming the path, not a raw JSON or codec error;
- one writer per store: ``writer_lock`` holds an exclusive lock on a ``<store>.lock`` file
  beside the store (it records the owner's pid, host and start time for the message a
  second writer gets). The operating system releases the lock when its owner dies, so a
  lock left by a killed run is stale and the next run takes it over.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import socket
import uuid
import warnings
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xarray as xr

FORMATS = {".zarr": "zarr", ".nc": "netcdf4"}
_KIND = "_lenscape_kind"
_BOOL_ATTRS = "_lenscape_bool_attrs"
#: Where the provenance ``dtype`` attr is kept on disk: xarray's netCDF encoding of a
#: boolean variable writes its own ``dtype`` attr and cannot if one is already there.
_DTYPE_ATTR = "_lenscape_dtype"
_UNNAMED = "__xarray_dataarray_variable__"
_DONE = "_lenscape_done"
_SETTINGS = "_lenscape_capture"
#: ``save`` modes: "w" writes (replacing what is there), "a" adds to an existing result.
Mode = Literal["w", "a"]


class StoreError(ValueError):
    """A saved result that is damaged (missing or unreadable chunk, corrupt metadata) or
    a store that another process is writing."""


def as_path(path: Any, *, argument: str = "path") -> Path:
    """``path`` as a ``Path``.

    Raises:
        TypeError: not a string or path-like object.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{argument} must be a file path (str or pathlib.Path), got {path!r} "
            f"({type(path).__name__}); e.g. 'results.zarr'."
        )
    return Path(path)


def _engine(path: Path) -> str:
    if path.suffix not in FORMATS:
        raise ValueError(
            f"Cannot tell the format of '{path}'; use a path ending in one of "
            f"{sorted(FORMATS)} (zarr store or netCDF file)."
        )
    return FORMATS[path.suffix]


def _encode_attrs(attrs: dict[Any, Any]) -> dict[Any, Any]:
    renamed = {_DTYPE_ATTR if k == "dtype" else k: v for k, v in attrs.items()}
    bools = sorted(k for k, v in renamed.items() if isinstance(v, (bool, np.bool_)))
    out = {k: int(v) if k in bools else v for k, v in renamed.items()}
    if bools:
        out[_BOOL_ATTRS] = ",".join(bools)
    return out


def _decode_attrs(attrs: dict[Any, Any]) -> dict[Any, Any]:
    bools = set(filter(None, str(attrs.pop(_BOOL_ATTRS, "")).split(",")))
    return {
        "dtype" if k == _DTYPE_ATTR else k: bool(v)
        if k in bools
        else (v.item() if isinstance(v, np.generic) else v)
        for k, v in attrs.items()
    }


def _as_dataset(obj: xr.DataArray | xr.Dataset, engine: str) -> xr.Dataset:
    """The Dataset ``save`` writes: kind and name recorded, attrs encoded, zarr strings."""
    if isinstance(obj, xr.DataArray):
        ds = obj.to_dataset(name=_UNNAMED if obj.name is None else obj.name, promote_attrs=False)
        ds.attrs = {_KIND: "DataArray"}
    elif isinstance(obj, xr.Dataset):
        ds = obj.copy()
        ds.attrs = {**obj.attrs, _KIND: "Dataset"}
    else:
        raise ValueError(
            f"lsc.save takes an xarray DataArray or Dataset, got {type(obj).__name__}."
        )
    ds.attrs = _encode_attrs(ds.attrs)
    for name in ds.variables:
        ds[name].attrs = _encode_attrs(ds[name].attrs)
    if engine == "zarr":
        # Variable-length strings have a zarr v3 spec; fixed-width numpy unicode does not
        # (zarr warns that such a store "may be unreadable by other Zarr libraries"). numpy's
        # StringDType is written as one, also lazily (an object array would be loaded).
        text = {
            name: var.astype(np.dtypes.StringDType())
            for name, var in ds.variables.items()
            if var.dtype.kind == "U"
        }
        ds = ds.assign_coords({name: var for name, var in text.items() if name in ds.coords})
        ds = ds.assign({name: var for name, var in text.items() if name in ds.data_vars})
    return ds


def _write(ds: xr.Dataset, path: Path, engine: str, mode: Mode) -> None:
    if engine == "zarr":
        ds.to_zarr(path, mode=mode, consolidated=False, write_empty_chunks=True)
    else:
        ds.to_netcdf(path, mode=mode, engine="netcdf4")


def _replace(ds: xr.Dataset, path: Path, engine: str) -> None:
    """Write ``ds`` to a temporary sibling of ``path``, then swap it in.

    ``ds`` may be lazily read from ``path`` itself: it is read in full before the old
    result is moved away. A failed write leaves the old result untouched.
    """
    _swap_in(lambda temporary: _write(ds, temporary, engine, "w"), path)


def _swap_in(write: Callable[[Path], None], path: Path) -> None:
    """``write(temporary)`` to a temporary sibling of ``path``, then rename it to ``path``
    (moving an old one aside first): a write that fails or is killed midway leaves
    ``path`` as it was, never half written."""
    temporary = path.with_name(f".{path.name}.writing-{uuid.uuid4().hex[:8]}")
    try:
        write(temporary)
    except BaseException:
        if temporary.is_dir():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
        raise
    if path.is_dir():  # a directory cannot be renamed over: move the old one aside first
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
        os.rename(temporary, path)
        shutil.rmtree(old)
    else:
        os.replace(temporary, path)


def save(obj: xr.DataArray | xr.Dataset, path: str | Path, *, mode: Mode = "w") -> Path:
    """Write ``obj`` to ``path`` (``.zarr`` or ``.nc``); ``mode="w"`` overwrites, "a" adds.

    Overwriting writes a temporary copy next to ``path`` and swaps it in when complete, so
    ``obj`` may be lazily read from ``path`` itself and a failed write keeps the old result.

    Returns:
        The path written.

    Raises:
        StoreError: another process is writing ``path`` (see ``writer_lock``).
    """
    path = as_path(path)
    engine = _engine(path)
    ds = _as_dataset(obj, engine)
    with writer_lock(path):
        if mode == "w" and path.exists():
            _replace(ds, path, engine)
        else:
            _write(ds, path, engine, mode)
    return path


def open_result(
    path: str | Path, *, lazy: bool = False, verify: bool = True
) -> xr.DataArray | xr.Dataset:
    """Open what ``save`` (or a streaming capture) wrote.

    Args:
        lazy: keep the data dask/lazily backed instead of loading it.
        verify: check first that every chunk of a zarr store exists and decodes
            (``verify_store``); ``verify=False`` reads what is there (missing chunks as NaN),
            to rescue what a damaged store still holds.

    Raises:
        FileNotFoundError: nothing at ``path``.
        StoreError: a missing or unreadable chunk, or metadata that cannot be read.
    """
    path = as_path(path)
    engine = _engine(path)
    if not path.exists():
        raise FileNotFoundError(
            f"No saved result at '{path}'; check the path (lsc.save writes "
            "'.zarr' directories and '.nc' files)."
        )
    if verify and engine == "zarr":
        verify_store(path)
    kwargs: dict[str, Any] = {"consolidated": False} if engine == "zarr" else {}
    try:
        ds = xr.open_dataset(path, engine=engine, chunks={} if lazy else None, **kwargs)
        if not lazy:
            ds = ds.load()
            ds.close()
    except Exception as err:
        raise StoreError(
            f"Cannot read the saved result '{path}' ({type(err).__name__}: {err}); "
            "the file is damaged or was not written by lsc.save: save the result "
            "again."
        ) from err
    ds = ds.drop_vars([_DONE], errors="ignore")
    ds.attrs.pop(_SETTINGS, None)
    # Variable-length strings come back as objects or numpy StringDType: back to numpy unicode
    # (string data variables are read at once: they are labels, small beside the numbers).
    text = {
        name: ds[name].variable.copy(data=np.asarray(ds[name].values.tolist(), dtype=str))
        for name, var in ds.variables.items()
        if var.dtype.kind in "OT"
    }
    ds = ds.assign_coords({name: var for name, var in text.items() if name in ds.coords})
    ds = ds.assign({name: var for name, var in text.items() if name in ds.data_vars})
    for name in ds.variables:
        ds[name].attrs = _decode_attrs(dict(ds[name].attrs))
    attrs = _decode_attrs(dict(ds.attrs))
    kind = attrs.pop(_KIND, "Dataset")
    if kind == "DataArray":
        (name,) = ds.data_vars
        da = ds[name]
        return da.rename(None) if name == _UNNAMED else da
    ds.attrs = attrs
    return ds


def content_sha256(ds: xr.Dataset, *, skip: Collection[str] = ()) -> str:
    """SHA-256 (64 hex digits) of what ``save`` keeps of ``ds``: every variable's name,
    dims, shape, dtype, values and attrs, and the Dataset's attrs except those in ``skip``.

    ``open_result(save(ds, path))`` has the same checksum in either format (attrs are
    compared as plain values, a scalar as a list of one, as netCDF may read them back), so
    a checksum taken before saving, kept in an attr named in ``skip``, catches any later
    change to the file's contents.

    Args:
        ds: the Dataset.
        skip: names of Dataset attrs left out (the attr that will hold the checksum).

    Returns:
        The hex digest.
    """

    def plain(attrs: Mapping[Hashable, Any]) -> str:
        values = {str(k): np.atleast_1d(v).tolist() for k, v in attrs.items() if k not in skip}
        return json.dumps(values, sort_keys=True)

    digest = hashlib.sha256(plain(ds.attrs).encode())
    for name in sorted(ds.variables, key=str):
        var = ds.variables[name]
        values = np.asarray(var.values)
        text = values.dtype.kind in "OUT"
        kind = "str" if text else values.dtype.newbyteorder("<").str
        digest.update(json.dumps([str(name), list(var.dims), values.shape, kind]).encode())
        digest.update(plain(var.attrs).encode())
        if text:
            digest.update(json.dumps(values.tolist()).encode())
        else:
            digest.update(values.astype(kind, copy=False).tobytes())
    return digest.hexdigest()


def _dims_of(array: Any) -> tuple[str, ...]:
    """The xarray dims of a zarr array (zarr v3 ``dimension_names``, v2 ``_ARRAY_DIMENSIONS``)."""
    names = getattr(array.metadata, "dimension_names", None)
    return tuple(names or array.attrs.get("_ARRAY_DIMENSIONS", ()))


def verify_store(path: str | Path) -> None:
    """Check that every chunk of the zarr store at ``path`` exists and decodes.

    Chunks may only be missing where a streaming capture has not finished its prompts
    (all of the chunk's prompts not marked in ``_lenscape_done``): those are "not
    computed" and read as NaN. Anywhere else a missing chunk would read as NaN too, and
    pass for "not computed" when it is lost data.

    Raises:
        StoreError: metadata that cannot be read, a missing chunk, or a chunk that does
            not decode (truncated or overwritten file), naming the store and the chunk.
    """
    import zarr

    path = Path(path)
    try:
        group = zarr.open_group(path, mode="r")
        arrays = dict(group.arrays())
        done = np.asarray(arrays[_DONE][...], dtype=bool) if _DONE in arrays else None
    except Exception as err:
        raise StoreError(
            f"The metadata of the store '{path}' cannot be read "
            f"({type(err).__name__}: {err}); the store is damaged: save or capture "
            "the result again."
        ) from err
    for name, array in arrays.items():
        dims = _dims_of(array)
        prompt_axis = dims.index("prompt") if "prompt" in dims else None
        for coords in itertools.product(*(range(n) for n in array.cdata_shape)):
            chunk = path / array.path / array.metadata.encode_chunk_key(coords)
            if not chunk.exists():
                if name == _DONE:  # reads as False: those prompts are recomputed on resume
                    continue
                if prompt_axis is not None and done is not None:
                    size = array.chunks[prompt_axis]
                    start = coords[prompt_axis] * size
                    if not done[start : start + size].any():
                        continue
                raise StoreError(
                    f"The store '{path}' is missing the chunk "
                    f"'{chunk.relative_to(path)}' of '{name}', so part of the result is "
                    "lost (it would read as NaN, 'not computed'); re-run the capture, or "
                    "open it with verify=False to read the rest."
                )
            try:
                array.get_block_selection(coords)
            except Exception as err:
                raise StoreError(
                    f"The chunk '{chunk.relative_to(path)}' of '{name}' in the store "
                    f"'{path}' cannot be read ({type(err).__name__}: {err}); re-run "
                    "the capture, or open it with verify=False to read the rest."
                ) from err


@contextmanager
def writer_lock(path: str | Path) -> Iterator[None]:
    """Hold the one-writer lock of the result at ``path`` while the block runs.

    The lock is an exclusive ``flock`` on ``<path>.lock`` beside the result (inside it,
    zarr's overwrite would delete it); the file records the owner's pid, host and start
    time. The kernel drops the lock when its owner dies, so a lock file left by a killed
    run is stale: the next writer takes it over. On a file system without locks a warning
    says that nothing stops a second writer.

    Raises:
        StoreError: another process holds the lock (the message names it).
        ValueError: the lock file cannot be created (read-only folder).
    """
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise ValueError(
                f"Cannot create the lock file '{lock}' for '{path}': "
                f"{err.strerror or err}; choose a writable folder."
            ) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _lock_owner(fd)
            os.close(fd)
            raise StoreError(
                f"'{path}' is being written by another process ({owner}); wait for "
                "it to finish, or write to another path. Only one process may "
                "write a store at a time."
            ) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                os.close(fd)
                raise
            warnings.warn(
                f"The file system of '{path}' does not support locks "
                f"({err.strerror}), so nothing stops a second process from writing "
                "it at the same time; run one writer only.",
                stacklevel=3,
            )
            break
        # Its last owner may have removed the file between our open and our lock: then we
        # hold a lock on a deleted file and must lock the file now at that path instead.
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(
        fd,
        json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": datetime.datetime.now(datetime.timezone.utc).strftime(
                    "%Y-%m-%d %H:%M:%S UTC"
                ),
            }
        ).encode(),
    )
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def _lock_owner(fd: int) -> str:
    """Who holds a lock, from its file: "pid 12 on host h since ..." (or that it is unknown)."""
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {owner['pid']} on host {owner['host']}, since {owner['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not recorded yet"


# --------------------------------------------------------------------------- streaming


def check_writable(path: str | Path) -> Path:
    """Fail early, with the fix, when a zarr store cannot be written at ``path``.

    Raises:
        ValueError: not a ``.zarr`` path, a missing parent folder, a path that is a file,
            or a read-only location (checked by really writing a probe file).
        TypeError: ``path`` is not a path.
    """
    path = as_path(path, argument="store")
    if path.suffix != ".zarr":
        raise ValueError(
            f"Streaming capture writes a zarr store; use a path ending in '.zarr', got '{path}'."
        )
    if not path.parent.is_dir():
        raise ValueError(
            f"The folder '{path.parent}' for the store '{path.name}' does not exist; "
            "create it first (e.g. Path(...).mkdir(parents=True)) or choose another path."
        )
    if path.exists() and not path.is_dir():
        raise ValueError(f"'{path}' is a file, not a zarr store; choose another path.")
    probe = (path if path.is_dir() else path.parent) / f".lenscape-probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"Cannot write the store '{path}': {err.strerror or err}. The location is "
            "read-only for this process; choose a writable path."
        ) from err
    return path


def create(
    template: xr.DataArray | xr.Dataset, path: str | Path, *, chunk: int, settings: dict[str, Any]
) -> None:
    """Write the layout of a result that will be filled in prompt slices of ``chunk``.

    Args:
        template: the whole result with NaN data (ideally broadcast views: nothing is
            materialised; data is written lazily, coords eagerly).
        chunk: prompts per part; every ``write_part`` starts at a multiple of it. A part
            larger than the prompts is one chunk of the prompts: zarr would write (and
            allocate) a chunk of the size asked for, however few prompts it holds.
        settings: JSON-serialisable description of the capture, read back by ``progress``.
    """
    ds = _as_dataset(template, "zarr")
    n_prompts = ds.sizes["prompt"]
    chunk = max(1, min(chunk, n_prompts))
    ds[_DONE] = ("prompt", np.broadcast_to(np.False_, (n_prompts,)))
    ds.attrs[_SETTINGS] = json.dumps(settings, sort_keys=True)
    data = _per_prompt_data(ds)
    # Chunk the variables alone: a DataArray's ``chunk`` would chunk its coords too.
    chunked = {name: ds[name].variable.chunk({"prompt": chunk}) for name in data}
    ds = ds.assign_coords({n: v for n, v in chunked.items() if n in ds.coords})
    ds = ds.assign({n: v for n, v in chunked.items() if n in ds.data_vars})
    encoding = {
        name: {
            "chunks": tuple(
                chunk if dim == "prompt" else size for dim, size in ds[name].sizes.items()
            )
        }
        for name in data
    }
    # Swapped in whole: a run killed while writing the layout leaves no store that a rerun
    # would take for a resumable one with some of its coords or variables missing.
    _swap_in(
        lambda temporary: ds.to_zarr(
            temporary,
            mode="w",
            compute=False,
            consolidated=False,
            encoding=encoding,
            write_empty_chunks=True,
        ),
        Path(path),
    )


def _per_prompt_data(ds: xr.Dataset) -> list[Hashable]:
    """Variables filled part by part: data variables and coords along ``prompt`` (but the
    ``prompt`` index itself), such as the model's own answer ``correct`` or a logit lens's
    top tokens. ``create`` writes them whole with the template's values ("not computed"),
    chunked like the data, and every part overwrites its own chunks."""
    return [name for name, var in ds.data_vars.items() if "prompt" in var.dims] + [
        name for name, var in ds.coords.items() if "prompt" in var.dims and name != "prompt"
    ]


def write_part(part: xr.DataArray | xr.Dataset, path: str | Path, *, start: int) -> None:
    """Write the data of prompts ``start .. start + len(part)`` and then mark them done."""
    ds = _as_dataset(part, "zarr")
    ds = ds.reset_coords([name for name in _per_prompt_data(ds) if name in ds.coords])
    stop = start + ds.sizes["prompt"]
    region = {"prompt": slice(start, stop)}
    data = (
        ds[_per_prompt_data(ds)]
        .reset_coords(drop=True)
        .drop_vars(list(ds.indexes), errors="ignore")
    )
    data.drop_attrs().to_zarr(path, region=region, consolidated=False, write_empty_chunks=True)
    done = xr.Dataset({_DONE: ("prompt", np.ones(stop - start, dtype=bool))})
    done.to_zarr(path, region=region, consolidated=False, write_empty_chunks=True)


def progress(path: str | Path) -> tuple[dict[str, Any], np.ndarray]:
    """The settings a store was created with and its (prompt,) done flags.

    Raises:
        ValueError: ``path`` holds something that is not a lenscape streaming store.
    """
    try:
        with xr.open_zarr(path, consolidated=False) as ds:
            return json.loads(ds.attrs[_SETTINGS]), ds[_DONE].values.astype(bool)
    except (KeyError, OSError, ValueError, json.JSONDecodeError) as err:
        raise ValueError(
            f"'{path}' exists but is not a lenscape capture store, or its metadata "
            f"is damaged ({type(err).__name__}: {err}); choose another path or "
            "pass overwrite=True to replace it."
        ) from err


def remove_partial_files(path: str | Path) -> int:
    """Delete temp files a killed zarr write left behind (``*.partial``); returns how many."""
    removed = 0
    for root, _, files in os.walk(path):
        for name in files:
            if name.endswith(".partial"):
                os.unlink(os.path.join(root, name))
                removed += 1
    return removed
