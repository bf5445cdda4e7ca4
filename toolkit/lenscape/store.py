"""Save and open results (DataArray or Dataset) as zarr or netCDF, losslessly.

The format follows the suffix: ``.zarr`` (a directory store) or ``.nc`` (netCDF4).
What comes back equals what went in: values (NaN kept), dims, integer and string coords,
attrs (booleans too, which netCDF cannot hold natively and we encode), the array's name,
and whether it was a DataArray or a Dataset.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr

FORMATS = {".zarr": "zarr", ".nc": "netcdf4"}
_KIND = "_lenscape_kind"
_BOOL_ATTRS = "_lenscape_bool_attrs"
_UNNAMED = "__xarray_dataarray_variable__"


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


def save(obj: xr.DataArray | xr.Dataset, path: str | Path, *, mode: str = "w") -> Path:
    """Write ``obj`` to ``path`` (``.zarr`` or ``.nc``); ``mode="w"`` overwrites.

    Returns:
        The path written.
    """
    path = Path(path)
    engine = _engine(path)
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
