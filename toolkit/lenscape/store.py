"""Save and open results (DataArray or Dataset) as zarr or netCDF, losslessly.

The format follows the suffix: ``.zarr`` (a directory store) or ``.nc`` (netCDF4).
What comes back equals what went in: values (NaN kept), dims, integer and string coords,
attrs (booleans too, which netCDF cannot hold natively and we encode), the array's name,
and whether it was a DataArray or a Dataset.

Results can also be written piece by piece along ``prompt`` (streaming capture): ``create``
writes the layout of the whole result (coords, attrs, NaN data: "not computed") and the
settings it is made with; ``write_part`` fills one prompt slice and then marks it done in
a boolean ``_lenscape_done`` variable. zarr writes each chunk file atomically (temp file
+ rename) and parts are chunk-aligned, so a run killed at any moment leaves every part
either done or recomputable; ``progress`` reads the settings and done flags back to resume.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

FORMATS = {".zarr": "zarr", ".nc": "netcdf4"}
_KIND = "_lenscape_kind"
_BOOL_ATTRS = "_lenscape_bool_attrs"
_UNNAMED = "__xarray_dataarray_variable__"
_DONE = "_lenscape_done"
_SETTINGS = "_lenscape_capture"


def _engine(path: Path) -> str:
    if path.suffix not in FORMATS:
        raise ValueError(f"Cannot tell the format of '{path}'; use a path ending in one of "
                         f"{sorted(FORMATS)} (zarr store or netCDF file).")
    return FORMATS[path.suffix]


def _encode_attrs(attrs: dict) -> dict:
    bools = sorted(k for k, v in attrs.items() if isinstance(v, (bool, np.bool_)))
    out = {k: int(v) if k in bools else v for k, v in attrs.items()}
    if bools:
        out[_BOOL_ATTRS] = ",".join(bools)
    return out


def _decode_attrs(attrs: dict) -> dict:
    bools = set(filter(None, str(attrs.pop(_BOOL_ATTRS, "")).split(",")))
    return {k: bool(v) if k in bools else (v.item() if isinstance(v, np.generic) else v)
            for k, v in attrs.items()}


def _as_dataset(obj: xr.DataArray | xr.Dataset, engine: str) -> xr.Dataset:
    """The Dataset ``save`` writes: kind and name recorded, attrs encoded, zarr strings."""
    if isinstance(obj, xr.DataArray):
        ds = obj.to_dataset(name=_UNNAMED if obj.name is None else obj.name, promote_attrs=False)
        ds.attrs = {_KIND: "DataArray"}
    elif isinstance(obj, xr.Dataset):
        ds = obj.copy()
        ds.attrs = {**obj.attrs, _KIND: "Dataset"}
    else:
        raise ValueError(f"lsc.save takes an xarray DataArray or Dataset, got {type(obj).__name__}.")
    ds.attrs = _encode_attrs(ds.attrs)
    for name in ds.variables:
        ds[name].attrs = _encode_attrs(ds[name].attrs)
    if engine == "zarr":
        # Variable-length strings have a zarr v3 spec; fixed-width numpy unicode does not.
        ds = ds.assign_coords({name: ds[name].astype(object) for name in ds.coords
                               if ds[name].dtype.kind == "U"})
    return ds


def save(obj: xr.DataArray | xr.Dataset, path: str | Path, *, mode: str = "w") -> Path:
    """Write ``obj`` to ``path`` (``.zarr`` or ``.nc``); ``mode="w"`` overwrites.

    Returns:
        The path written.
    """
    path = Path(path)
    engine = _engine(path)
    ds = _as_dataset(obj, engine)
    if engine == "zarr":
        ds.to_zarr(path, mode=mode, consolidated=False)
    else:
        ds.to_netcdf(path, mode=mode, engine="netcdf4")
    return path


def open_result(path: str | Path, *, lazy: bool = False) -> xr.DataArray | xr.Dataset:
    """Open what ``save`` wrote; eager by default, ``lazy=True`` keeps it dask/lazily backed.

    Raises:
        FileNotFoundError: nothing at ``path``.
    """
    path = Path(path)
    engine = _engine(path)
    if not path.exists():
        raise FileNotFoundError(f"No saved result at '{path}'; check the path (lsc.save writes "
                                "'.zarr' directories and '.nc' files).")
    kwargs = {"consolidated": False} if engine == "zarr" else {}
    ds = xr.open_dataset(path, engine=engine, chunks={} if lazy else None, **kwargs)
    ds = ds.drop_vars([_DONE], errors="ignore")
    ds.attrs.pop(_SETTINGS, None)
    if not lazy:
        ds = ds.load()
        ds.close()
    # Variable-length strings come back as objects or numpy StringDType: back to numpy unicode.
    ds = ds.assign_coords({name: (ds[name].dims, np.asarray(ds[name].values.tolist(), dtype=str))
                           for name in ds.coords if ds[name].dtype.kind in "OT"})
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


# --------------------------------------------------------------------------- streaming


def check_writable(path: str | Path) -> Path:
    """Fail early, with the fix, when a zarr store cannot be written at ``path``.

    Raises:
        ValueError: not a ``.zarr`` path, a missing parent folder, a path that is a file,
            or a read-only location (checked by really writing a probe file).
    """
    path = Path(path)
    if path.suffix != ".zarr":
        raise ValueError(f"Streaming capture writes a zarr store; use a path ending in '.zarr', "
                         f"got '{path}'.")
    if not path.parent.is_dir():
        raise ValueError(f"The folder '{path.parent}' for the store '{path.name}' does not exist; "
                         "create it first (e.g. Path(...).mkdir(parents=True)) or choose another path.")
    if path.exists() and not path.is_dir():
        raise ValueError(f"'{path}' is a file, not a zarr store; choose another path.")
    probe = (path if path.is_dir() else path.parent) / f".lenscape-probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"Cannot write the store '{path}': {err.strerror or err}. The location is "
                         "read-only for this process; choose a writable path.") from err
    return path


def create(template: xr.DataArray | xr.Dataset, path: str | Path, *, chunk: int,
           settings: dict[str, Any]) -> None:
    """Write the layout of a result that will be filled in prompt slices of ``chunk``.

    Args:
        template: the whole result with NaN data (ideally broadcast views: nothing is
            materialised; data is written lazily, coords eagerly).
        chunk: prompts per part; every ``write_part`` starts at a multiple of it.
        settings: JSON-serialisable description of the capture, read back by ``progress``.
    """
    ds = _as_dataset(template, "zarr")
    n_prompts = ds.sizes["prompt"]
    ds[_DONE] = ("prompt", np.broadcast_to(np.False_, (n_prompts,)))
    ds.attrs[_SETTINGS] = json.dumps(settings, sort_keys=True)
    data = _per_prompt_data(ds)
    ds = ds.assign({name: ds[name].chunk({"prompt": chunk}) for name in data})
    encoding = {name: {"chunks": tuple(chunk if dim == "prompt" else size
                                       for dim, size in ds[name].sizes.items())}
                for name in data}
    ds.to_zarr(path, mode="w", compute=False, consolidated=False, encoding=encoding)


def _per_prompt_data(ds: xr.Dataset) -> list[str]:
    """Data variables filled part by part (those along ``prompt``); coords such as the
    ``text`` and ``category`` labels are written whole by ``create``."""
    return [name for name, var in ds.data_vars.items() if "prompt" in var.dims]


def write_part(part: xr.DataArray | xr.Dataset, path: str | Path, *, start: int) -> None:
    """Write the data of prompts ``start .. start + len(part)`` and then mark them done."""
    ds = _as_dataset(part, "zarr")
    stop = start + ds.sizes["prompt"]
    region = {"prompt": slice(start, stop)}
    data = ds[_per_prompt_data(ds)].reset_coords(drop=True).drop_vars(list(ds.indexes),
                                                                      errors="ignore")
    data.drop_attrs().to_zarr(path, region=region, consolidated=False)
    done = xr.Dataset({_DONE: ("prompt", np.ones(stop - start, dtype=bool))})
    done.to_zarr(path, region=region, consolidated=False)


def progress(path: str | Path) -> tuple[dict[str, Any], np.ndarray]:
    """The settings a store was created with and its (prompt,) done flags.

    Raises:
        ValueError: ``path`` holds something that is not a lenscape streaming store.
    """
    try:
        with xr.open_zarr(path, consolidated=False) as ds:
            return json.loads(ds.attrs[_SETTINGS]), ds[_DONE].values.astype(bool)
    except (KeyError, OSError, ValueError, json.JSONDecodeError) as err:
        raise ValueError(f"'{path}' exists but is not a lenscape capture store; choose another "
                         "path or pass overwrite=True to replace it.") from err


def remove_partial_files(path: str | Path) -> int:
    """Delete temp files a killed zarr write left behind (``*.partial``); returns how many."""
    removed = 0
    for root, _, files in os.walk(path):
        for name in files:
            if name.endswith(".partial"):
                os.unlink(os.path.join(root, name))
                removed += 1
    return removed
