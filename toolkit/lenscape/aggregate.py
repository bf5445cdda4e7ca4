"""Pure DataArray -> DataArray functions: thresholds across seeds, head roles, shares,
and stacking models of different depth.

Every function keeps coords and attrs, and records what it did in attrs (``aggregation``)
and in ``long_name``, so a plot of the result titles itself. Thresholds, Always, Any and
fractions follow the mask rules of ``lenscape.mask_rules``: NaN ("not computed") is never
kept, a reduction along ``dim`` counts only the computed values, and a cell with none
computed stays NaN.

Every function reads its inputs by label, as xarray's own reductions do: a ``sortby``,
``isel`` or ``transpose`` of an input gives the same cells (in the input's order), and two
inputs combined (``roles``) are matched label by label, their labels checked to agree.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from . import _validate, mask_rules, schema

#: Role codes of ``roles``: a head facilitates, interferes, both, or neither.
ROLES = ("neither", "facilitating", "interfering", "both")


def _check(da: xr.DataArray, dim: str, threshold: float) -> None:
    """Refuse what is not a DataArray with ``dim``, or a threshold outside [0, 1]."""
    _validate.result("da", da, kind=xr.DataArray, made_by="a lenscape method")
    if dim not in da.dims:
        raise ValueError(f"Cannot aggregate over '{dim}': the data has dims {list(da.dims)}.")
    _validate.number("threshold", threshold, low=0, high=1)


def _finish(
    da: xr.DataArray, result: xr.DataArray, dim: str, what: str, units: str
) -> xr.DataArray:
    name = schema.name_from_attrs(da)
    return result.assign_attrs(
        {
            **da.attrs,
            "long_name": f"{name}: {what}",
            "aggregation": f"{what} (over {dim})",
            "units": units,
        }
    )


def always(da: xr.DataArray, dim: str = "seed", threshold: float = 0.5) -> xr.DataArray:
    """True where ``da >= threshold`` for every computed value along ``dim`` ("Always");
    NaN where none is computed (``mask_rules.all_``)."""
    _check(da, dim, threshold)
    mask = mask_rules.all_(mask_rules.binarize(da, threshold), dim)
    return _finish(da, mask, dim, f">= {threshold} in every {dim}", mask_rules.MASK_UNITS)


def any_(da: xr.DataArray, dim: str = "seed", threshold: float = 0.5) -> xr.DataArray:
    """True where ``da >= threshold`` for at least one computed value along ``dim``
    ("Any"); NaN where none is computed (``mask_rules.any_``)."""
    _check(da, dim, threshold)
    mask = mask_rules.any_(mask_rules.binarize(da, threshold), dim)
    return _finish(da, mask, dim, f">= {threshold} in any {dim}", mask_rules.MASK_UNITS)


def always_score(da: xr.DataArray, dim: str = "seed") -> xr.DataArray:
    """Continuous "Always": the minimum along ``dim`` (a cell is as high as its weakest seed).

    ``always(da, threshold=t)`` is exactly ``always_score(da) >= t`` where something is
    computed (both skip NaN); the F4 reference draws this value on a sequential scale, so
    Always is sparse by construction of the data.
    """
    _check(da, dim, 0.5)
    name = schema.name_from_attrs(da)
    units = da.attrs.get("units", "score")
    return _finish(da, da.min(dim), dim, f"minimum over {dim}", units).assign_attrs(
        long_name=f"{name}: Always (min over {dim})"
    )


def any_score(da: xr.DataArray, dim: str = "seed") -> xr.DataArray:
    """Continuous "Any": the maximum along ``dim``; ``any_(da, threshold=t)`` is exactly
    ``any_score(da) >= t`` where something is computed."""
    _check(da, dim, 0.5)
    name = schema.name_from_attrs(da)
    units = da.attrs.get("units", "score")
    return _finish(da, da.max(dim), dim, f"maximum over {dim}", units).assign_attrs(
        long_name=f"{name}: Any (max over {dim})"
    )


def fraction(da: xr.DataArray, dim: str = "seed", threshold: float = 0.5) -> xr.DataArray:
    """Share of the computed values along ``dim`` with ``da >= threshold``, in [0, 1]; NaN
    where none is computed (``mask_rules.share``)."""
    _check(da, dim, threshold)
    share = mask_rules.share(mask_rules.binarize(da, threshold), dim)
    return _finish(
        da, share, dim, f"fraction >= {threshold} over {dim}", mask_rules.share_units(dim)
    )


def roles(facilitation: xr.DataArray, interference: xr.DataArray) -> xr.DataArray:
    """Combine two masks into role codes (see ``ROLES``): 0 neither, 1 facilitating,
    2 interfering, 3 both, a mask's kept cells (``mask_rules.kept``) counting as in the role.
    NaN where either input is NaN.

    Args:
        facilitation: a mask (or scores: non-zero counts) over any dims, e.g. (layer, head).
        interference: the same dims, matched to ``facilitation`` by label (any order, any
            transpose).

    Returns:
        Role codes with the dims, coords and order of ``facilitation``.

    Raises:
        TypeError: an input that is not a DataArray.
        ValueError: other dims, or labels that differ (named).
    """
    for name, da in (("facilitation", facilitation), ("interference", interference)):
        _validate.result(name, da, kind=xr.DataArray, made_by="lsc.aggregate.always")
    if set(facilitation.dims) != set(interference.dims):
        raise ValueError(
            f"facilitation dims {facilitation.dims} differ from interference "
            f"dims {interference.dims}; aggregate both the same way first."
        )
    interference = _validate.labels(
        "interference",
        interference,
        {str(d): facilitation[d].values for d in facilitation.dims},
        made_by="lsc.aggregate.always (as facilitation)",
    ).transpose(*facilitation.dims)
    code = mask_rules.kept(facilitation).astype(int) + 2 * mask_rules.kept(interference).astype(int)
    code = code.where(facilitation.notnull() & interference.notnull())
    return code.assign_attrs(
        {
            **facilitation.attrs,
            "long_name": "Head role",
            "units": "role",
            "roles": ", ".join(f"{i} {name}" for i, name in enumerate(ROLES)),
            "aggregation": facilitation.attrs.get("aggregation", ""),
        }
    )


def normalize(da: xr.DataArray, over: str = "component") -> xr.DataArray:
    """Share of each cell in the total over ``over`` (sums to 1 along it; NaN ignored)."""
    if over not in da.dims:
        raise ValueError(f"Cannot normalise over '{over}': the data has dims {list(da.dims)}.")
    out = da / da.sum(over, skipna=True)
    name = schema.name_from_attrs(da)
    return out.assign_attrs(
        {
            **da.attrs,
            "long_name": f"{name}: share over {over}",
            "units": "share",
            "aggregation": f"share over {over}",
        }
    )


def combine_models(arrays: dict[str, xr.DataArray]) -> xr.DataArray:
    """Stack results of several models along a new ``model`` dim.

    Models of different depth are aligned on ``layer`` (NaN where a model has no such
    layer); ``depth`` becomes a (model, layer) coord so plots can share a relative axis.
    """
    if not arrays:
        raise ValueError("No arrays to combine; pass {model name: DataArray}.")
    parts = [
        da.drop_vars("depth", errors="ignore").expand_dims(model=[name])
        for name, da in arrays.items()
    ]
    out = xr.concat(parts, dim="model", join="outer", combine_attrs="drop_conflicts")
    if "component" in out.dims:  # the outer join sorts labels: restore the vocabulary order
        known = [c for c in schema.COMPONENTS if c in out["component"].values]
        out = out.reindex(component=known + [c for c in out["component"].values if c not in known])
    if "layer" in out.dims:
        depth = [
            da["depth"].reindex(layer=out["layer"])
            if "depth" in da.coords
            else xr.full_like(out["layer"], np.nan, dtype=float)
            for da in arrays.values()
        ]
        out = out.assign_coords(depth=(("model", "layer"), np.stack([d.values for d in depth])))
    return out.assign_attrs(models=", ".join(arrays))


def correct_only(da: xr.DataArray) -> xr.DataArray:
    """Keep the prompts the model answers right: those whose ``correct`` coord is True
    (the model's own top prediction at the read position is the target's first token).

    Args:
        da: a result with a ``prompt`` dim and a boolean ``correct`` coord on it, e.g.
            (prompt, layer, head) from a capture function.

    Returns:
        ``da`` without the wrongly answered prompts; ``correct_only`` in attrs names how many
        of how many prompts were kept ("13 of 16 prompts the model gets right").

    Raises:
        ValueError: if ``da`` has no ``prompt`` dim or no boolean ``correct`` coord on it,
            or the model gets no prompt right (nothing would be left to draw).
    """
    if "prompt" not in da.dims:
        raise ValueError(
            f"correct_only keeps prompts, but da has dims {tuple(da.dims)}; "
            "pass a result that still has its prompt dim (before .mean('prompt'))."
        )
    if "correct" not in da.coords or da["correct"].dims != ("prompt",):
        raise ValueError(
            "correct_only needs a boolean 'correct' coord on the prompt dim, and da has coords "
            f"{tuple(map(str, da.coords))}; recompute the result with a capture function "
            "(they record it), or assign one: da.assign_coords(correct=('prompt', flags))."
        )
    if da["correct"].dtype != bool:
        odd = list(np.unique(da["correct"].values.astype(str))[:3])
        raise ValueError(
            f"correct_only needs the 'correct' coord to hold True/False, got dtype "
            f"{da['correct'].dtype} (values such as {odd}); a NaN or a string flag would be "
            "read as True. Recompute the result with a capture function, or assign booleans."
        )
    correct = da["correct"].values
    if not correct.any():
        raise ValueError(
            f"The model answers none of the {correct.size} prompts right (correct is False "
            "everywhere), so correct_only would leave nothing; draw all prompts instead."
        )
    kept = da.isel(prompt=np.flatnonzero(correct))
    return kept.assign_attrs(
        correct_only=f"{int(correct.sum())} of {correct.size} prompts the model gets right"
    )


def routing_wins(comparison: xr.Dataset) -> xr.DataArray:
    """Where routing beats one global mask, per cluster (F1's claim, cluster by cluster).

    Args:
        comparison: ``lsc.mask_comparison``'s Dataset (or a recorded one,
            ``lsc.recorded("block_masks", ...)``), with ``loss_routed``/``loss_global``
            (target_sparsity, cluster) and ``n_held_out`` (cluster,).

    Returns:
        bool (target_sparsity, cluster), True where the held-out texts routed to the cluster
        have a lower mean loss under its own mask than under the global mask. Only the
        clusters that received held-out texts are kept: elsewhere there is nothing to judge.

    Raises:
        TypeError: ``comparison`` is not a Dataset.
        ValueError: if it is of another method, a variable is missing, or no cluster
            received a held-out text.
    """
    _validate.result(
        "comparison",
        comparison,
        kind=xr.Dataset,
        made_by="lsc.mask_comparison or lsc.recorded('block_masks', model=...)",
        variables=("loss_routed", "loss_global", "n_held_out"),
        methods=("mask_comparison",),
    )
    scored = comparison["n_held_out"].values > 0
    if not scored.any():
        raise ValueError(
            "No cluster received a held-out text, so no cluster can be judged; "
            "hold out more texts (mask_comparison's held_out)."
        )
    wins = (comparison["loss_routed"] < comparison["loss_global"]).isel(
        cluster=np.flatnonzero(scored)
    )
    return wins.assign_attrs(
        long_name="routed mask beats the global mask on the cluster's held-out texts",
        units=mask_rules.MASK_UNITS,
    )
