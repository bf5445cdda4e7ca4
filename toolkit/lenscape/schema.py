"""The lenscape data model: names, constructors and validation for result DataArrays.

Every measurement lenscape produces is one ``xarray.DataArray`` whose dims come from a
fixed, ordered vocabulary (``DIMS``), whose integer coords count from 0, whose
``component`` labels come from ``COMPONENTS`` and whose attrs carry provenance
(``method``, ``metric``, ``model``, ``backend`` ...). Constructors here stamp the
provenance attrs and the derived ``depth`` coord; ``validate`` checks all of it so a
bad array fails early with a sentence instead of producing a wrong picture later.

NaN means "not computed"; never fill it with 0.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from ._version import package_version

SCHEMA_VERSION = 1

#: Every dim lenscape uses, in canonical order.
DIMS: tuple[str, ...] = (
    "model",
    "seed",
    "prompt",
    "cluster",
    "layer",
    "head",
    # A key/value head (a head's key or value under grouped-query attention, shared by
    # its query heads): ``part="k"`` / ``"v"`` of the patching methods.
    "kv_head",
    "component",
    "pos",
    # Named spans of the prompts (``Prompt(spans=...)``), in prompt order: string labels.
    "span",
    "query_pos",
    "key_pos",
    # Edges (capture/edges/): labelled "embed", "L3.H2", "L3.MLP" / "L3.H2.q", "logits".
    "sender",
    "receiver",
    # Intervals (aggregate.mean): the mean and its bounds, last.
    "bound",
)
#: Dims whose coords are integers counting from 0.
INT_DIMS: tuple[str, ...] = (
    "seed",
    "prompt",
    "cluster",
    "layer",
    "head",
    "kv_head",
    "pos",
    "query_pos",
    "key_pos",
)

BLOCK_COMPONENTS: tuple[str, ...] = ("attn", "mlp")
WEIGHT_COMPONENTS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "input_layernorm",
    "post_attention_layernorm",
    # Gemma-3 wraps the MLP in two more norms; they are per-layer weights like the others.
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "q_norm",
    "k_norm",
)
MODEL_COMPONENTS: tuple[str, ...] = ("embed", "lm_head", "final_norm")
COMPONENTS: tuple[str, ...] = BLOCK_COMPONENTS + WEIGHT_COMPONENTS + MODEL_COMPONENTS
#: Kinds of an edge's receiver (the ``receiver_kind`` coord on ``receiver``): a head's query,
#: key or value input, an MLP's input, or the logits.
RECEIVER_KINDS: tuple[str, ...] = ("q", "k", "v", "mlp", "logits")
#: The dims of an edge result (by span, ``span`` comes before them).
EDGE_DIMS: tuple[str, ...] = ("sender", "receiver")


def edge_exists(
    sender_kind: Any,
    sender_layer: Any,
    receiver_kind: Any,
    receiver_layer: Any,
    *,
    parallel: bool = False,
) -> np.ndarray:
    """Whether a receiver reads a sender: the sender lies upstream of it, in an earlier layer
    (the embeddings are layer -1, the logits layer ``n_layers``), or it is a head of the
    layer whose MLP receives, unless the model's residual is parallel (GPT-NeoX, GPT-J:
    a block's MLP reads the block's input, as its attention does).

    Args:
        sender_kind, sender_layer: the senders' ``sender_kind`` and ``sender_layer`` coords.
        receiver_kind, receiver_layer: the receivers' ``receiver_kind`` and
            ``receiver_layer`` coords; all four broadcast together (e.g. senders as a column,
            receivers as a row).
        parallel: the model's blocks have a parallel residual (an edge result's
            ``residual`` attr is "parallel").

    Returns:
        A bool array of the broadcast shape: True where the edge exists.
    """
    s_kind, s_layer = np.asarray(sender_kind), np.asarray(sender_layer)
    r_kind, r_layer = np.asarray(receiver_kind), np.asarray(receiver_layer)
    same_layer_mlp = (r_kind == "mlp") & (s_kind == "head") & (s_layer == r_layer)
    return np.asarray((s_layer < r_layer) | (same_layer_mlp & (not parallel)))


#: Non-dimension coords and the dim they hang on.
LABEL_COORDS: dict[str, str] = {
    "text": "prompt",
    "category": "prompt",
    "depth": "layer",
    "query_token": "query_pos",
    "key_token": "key_pos",
}

#: Provenance attrs every captured result carries.
PROVENANCE_ATTRS: tuple[str, ...] = (
    "long_name",
    "units",
    "method",
    "metric",
    "model",
    "backend",
    "dtype",
    "lenscape_version",
    "schema_version",
)

_SCALAR_TYPES = (str, int, float, bool, np.integer, np.floating, np.bool_)


def name_from_attrs(da: xr.DataArray, default: str = "value") -> str:
    """What ``da`` holds, for titles and derived names: its ``long_name`` attr, else its
    name, else ``default``. One bound picked from an interval (``aggregate.mean(...).sel(
    bound=...)``, a scalar ``bound`` coord) is named as such: "...: mean over 16 prompts"
    for the mean, "...: mean over 16 prompts, 95% interval: low bound" for a bound, never
    an interval it no longer holds."""
    name = str(da.attrs.get("long_name") or (da.name if da.name is not None else default))
    bound = da.coords.get("bound")
    interval = re.search(r", [\d.]+% interval$", name)
    if bound is None or bound.ndim != 0 or interval is None:
        return name
    which = str(bound.item())
    return name[: interval.start()] if which == "mean" else f"{name}: {which} bound"


def ordered_dims(dims: Sequence[Hashable]) -> tuple[str, ...]:
    """Return ``dims`` (e.g. a DataArray's ``dims``) sorted into canonical ``DIMS`` order.

    Raises:
        ValueError: if a dim is not in the vocabulary.

    Examples:
        >>> lsc.schema.ordered_dims(("head", "layer", "prompt"))
        ('prompt', 'layer', 'head')
    """
    known = [d for d in dims if isinstance(d, str) and d in DIMS]
    if len(known) < len(dims):
        unknown = [d for d in dims if d not in known]
        raise ValueError(f"Unknown dim(s) {unknown}; lenscape dims are {list(DIMS)}.")
    return tuple(sorted(known, key=DIMS.index))


def depth_coord(n_layers: int, layers: Sequence[int] | None = None) -> np.ndarray:
    """Relative depth ``layer / (n_layers - 1)`` in [0, 1], to align models of different depth.

    Examples:
        >>> lsc.schema.depth_coord(5).tolist()
        [0.0, 0.25, 0.5, 0.75, 1.0]
    """
    index = np.arange(n_layers) if layers is None else np.asarray(layers)
    return index / max(n_layers - 1, 1)


def make(
    values: Any,
    *,
    dims: Sequence[str],
    coords: Mapping[str, Any] | None = None,
    attrs: Mapping[str, Any],
    n_layers: int | None = None,
) -> xr.DataArray:
    """Build a validated result DataArray.

    Args:
        values: array of shape matching ``dims`` (numpy or torch; torch is moved to CPU).
        dims: dim names from ``DIMS``, in canonical order.
        coords: coords by name; int dims without a coord get ``arange``; label coords
            (``text``, ``category``) are attached to ``prompt``.
        attrs: provenance; ``lenscape_version`` and ``schema_version`` are filled in.
        n_layers: total layers of the model; adds the ``depth`` coord on ``layer``.

    Returns:
        The DataArray, after ``validate``.
    """
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    values = np.asarray(values)
    coords = dict(coords or {})
    for dim, size in zip(dims, values.shape, strict=True):
        if dim in INT_DIMS and dim not in coords:
            coords[dim] = np.arange(size)
    full_coords: dict[str, Any] = {}
    for name, value in coords.items():
        if name in dims:
            full_coords[name] = (name, np.asarray(value))
        elif isinstance(value, tuple):  # (dims, values): placed already
            full_coords[name] = value
        elif name in LABEL_COORDS:
            full_coords[name] = (LABEL_COORDS[name], np.asarray(value))
        else:
            full_coords[name] = value
    if n_layers is not None and "layer" in dims:
        full_coords["depth"] = ("layer", depth_coord(n_layers, full_coords["layer"][1]))
    all_attrs = {"lenscape_version": package_version(), "schema_version": SCHEMA_VERSION, **attrs}
    if n_layers is not None:
        all_attrs.setdefault("n_layers", int(n_layers))
    da = xr.DataArray(values, dims=tuple(dims), coords=full_coords, attrs=all_attrs)
    return validate(da)


def validate(da: xr.DataArray, *, provenance: bool = True) -> xr.DataArray:
    """Check that ``da`` follows the lenscape schema; return it unchanged.

    Args:
        da: the array to check.
        provenance: also require every attr in ``PROVENANCE_ATTRS`` (true for capture output;
            derived arrays from plotting code may pass ``False``).

    Raises:
        ValueError: naming the first problem found and how to fix it.
    """
    if not isinstance(da, xr.DataArray):
        raise ValueError(
            f"Expected an xarray.DataArray, got {type(da).__name__}; "
            "wrap a Dataset variable with ds['name']."
        )
    ordered_dims(da.dims)  # unknown dims
    if tuple(da.dims) != ordered_dims(da.dims):
        raise ValueError(
            f"Dims {list(da.dims)} are out of order; use "
            f"da.transpose(*{list(ordered_dims(da.dims))})."
        )
    for dim in da.dims:
        if dim not in da.coords:
            if dim in INT_DIMS:
                continue
            raise ValueError(
                f"Dim '{dim}' has no coordinate labels; assign them with "
                f"da.assign_coords({dim}=[...])."
            )
        values = da[dim].values
        if dim in INT_DIMS and (not np.issubdtype(values.dtype, np.integer) or (values < 0).any()):
            raise ValueError(f"Coord '{dim}' must hold integers >= 0, got {values[:5]!r}.")
        if dim == "component":
            bad = sorted(set(map(str, values)) - set(COMPONENTS))
            if bad:
                raise ValueError(
                    f"Unknown component label(s) {bad}; the vocabulary is "
                    f"{list(COMPONENTS)} (map other names in models.py)."
                )
    for name, dim in LABEL_COORDS.items():
        if name in da.coords and dim not in da[name].dims:
            raise ValueError(f"Coord '{name}' must lie along '{dim}', found dims {da[name].dims}.")
    for key, value in da.attrs.items():
        if not isinstance(value, _SCALAR_TYPES):
            raise ValueError(
                f"Attr '{key}' is a {type(value).__name__}; attrs must be scalars "
                "(str, int, float, bool) so they survive zarr and netCDF."
            )
    if provenance:
        missing = [a for a in PROVENANCE_ATTRS if a not in da.attrs]
        if missing:
            raise ValueError(
                f"Missing provenance attrs {missing}; build results with lenscape.schema.make(...)."
            )
    return da
