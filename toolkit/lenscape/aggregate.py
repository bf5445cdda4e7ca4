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

How sure is a map? ``mean`` gives the mean over prompts with a percentile-bootstrap
interval per cell (``lenscape.bootstrap``: one seeded draw of resampled prompts, every
cell's resampled means from one matrix product), as a DataArray with a ``bound`` dim
(``BOUNDS``: mean, low, high) that ``heatmap`` draws with the uncertain cells hatched.
``reliability`` answers "how many prompts do I need": the maps of two disjoint halves of
n prompts, compared by correlation and top-k overlap, for growing n.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import xarray as xr

from . import _validate, bootstrap, mask_rules, schema

#: Role codes of ``roles``: a head facilitates, interferes, both, or neither.
ROLES = ("neither", "facilitating", "interfering", "both")
#: Labels of the ``bound`` dim of ``mean``'s and ``reliability``'s results.
BOUNDS = ("mean", "low", "high")
#: The coord of each position's token (``positions="each"`` results: on (prompt, pos), or
#: on pos once pooled), and what a pooled position's label says when the prompts' tokens
#: there differ (``pooled_tokens``).
TOKEN = "token"
TOKENS_DIFFER = "tokens differ"
#: The attr that counts the pooled positions whose tokens differ between prompts.
MIXED_POSITIONS = "mixed_positions"
#: Most random splits per size in ``reliability``, and most sizes.
MAX_SPLITS = 10_000
MAX_SIZES = 50


def _check(da: xr.DataArray, dim: str) -> None:
    """Refuse what is not a DataArray with ``dim``."""
    _validate.result("da", da, kind=xr.DataArray, made_by="a lenscape method")
    _validate.text("dim", dim, example="'prompt'")
    if dim not in da.dims:
        raise ValueError(
            f"Cannot aggregate over '{dim}': the data has dims {list(da.dims)}; "
            "pass dim= one of them."
        )


def _shared_tokens(token: xr.DataArray, dim: str) -> tuple[np.ndarray, int]:
    """``token_labels``' labels (along ``pos``, in ``token``'s order) and mixed count."""
    texts = token.transpose(dim, "pos").values.astype(str)
    labels, mixed = [], 0
    for p, column in zip(token["pos"].values.tolist(), texts.T, strict=True):
        present = {t for t in column.tolist() if t != ""}
        if len(present) > 1:
            mixed += 1
            labels.append(f"pos {p} ({TOKENS_DIFFER})")
        else:
            labels.append(present.pop() if present else "")
    return np.array(labels, dtype=object), mixed


def token_labels(da: xr.DataArray, dim: str = "prompt") -> xr.DataArray:
    """One label per position of a result by position (a (``dim``, pos) ``token`` coord):
    the token every prompt has there (prompts past their end, "", do not count), "" where
    no prompt reaches, and "pos 7 (tokens differ)" (``TOKENS_DIFFER``) where the prompts'
    tokens differ, so that a mean over them there mixes words.

    Args:
        da: a result with a ``token`` coord on (``dim``, pos), e.g. (prompt, layer, pos).
        dim: the dim the labels pool over.

    Returns:
        The labels along ``pos`` (its coords), with the count of positions whose tokens
        differ in the ``mixed_positions`` attr.

    Raises:
        TypeError: ``da`` not a DataArray. ValueError: no (``dim``, pos) ``token`` coord.
    """
    _check(da, dim)
    token = da.coords.get(TOKEN)
    if token is None or set(token.dims) != {dim, "pos"}:
        raise ValueError(
            f"da has no token coord on ({dim}, pos) (coords {list(map(str, da.coords))}); "
            "pass a result captured with positions='each'."
        )
    labels, mixed = _shared_tokens(token, dim)
    return xr.DataArray(
        labels, dims="pos", coords={"pos": token["pos"].values}, attrs={MIXED_POSITIONS: mixed}
    )


def pooled_tokens(pooled: xr.DataArray, da: xr.DataArray, dim: str = "prompt") -> xr.DataArray:
    """``pooled`` (``da`` reduced over ``dim``, e.g. ``da.mean("prompt")``) with the 1-D
    ``token`` label per position that xarray's reduction dropped (``token_labels``) and the
    count of positions whose tokens differ in its ``mixed_positions`` attr.

    Args:
        pooled: the reduced result, with a ``pos`` dim.
        da: the result before the reduction.
        dim: the dim reduced.

    Returns:
        ``pooled`` with the labels, or ``pooled`` itself where ``da`` had no (``dim``, pos)
        ``token`` coord or ``pooled`` no ``pos`` dim.

    Raises:
        TypeError: ``pooled`` or ``da`` not a DataArray.
    """
    _validate.result("pooled", pooled, kind=xr.DataArray, made_by="a reduction of a result")
    _check(da, dim)
    token = da.coords.get(TOKEN)
    if token is None or set(token.dims) != {dim, "pos"} or "pos" not in pooled.dims:
        return pooled
    labels = token_labels(da, dim).sel(pos=pooled["pos"])
    out = pooled.assign_coords({TOKEN: ("pos", labels.values)})
    return out.assign_attrs({MIXED_POSITIONS: labels.attrs[MIXED_POSITIONS]})


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
    _check(da, dim)
    _validate.number("threshold", threshold, low=0, high=1)
    mask = mask_rules.all_(mask_rules.binarize(da, threshold), dim)
    return _finish(da, mask, dim, f">= {threshold} in every {dim}", mask_rules.MASK_UNITS)


def any_(da: xr.DataArray, dim: str = "seed", threshold: float = 0.5) -> xr.DataArray:
    """True where ``da >= threshold`` for at least one computed value along ``dim``
    ("Any"); NaN where none is computed (``mask_rules.any_``)."""
    _check(da, dim)
    _validate.number("threshold", threshold, low=0, high=1)
    mask = mask_rules.any_(mask_rules.binarize(da, threshold), dim)
    return _finish(da, mask, dim, f">= {threshold} in any {dim}", mask_rules.MASK_UNITS)


def always_score(da: xr.DataArray, dim: str = "seed") -> xr.DataArray:
    """Continuous "Always": the minimum along ``dim`` (a cell is as high as its weakest seed).

    ``always(da, threshold=t)`` is exactly ``always_score(da) >= t`` where something is
    computed (both skip NaN); the F4 reference draws this value on a sequential scale, so
    Always is sparse by construction of the data.
    """
    _check(da, dim)
    name = schema.name_from_attrs(da)
    units = da.attrs.get("units", "score")
    return _finish(da, da.min(dim), dim, f"minimum over {dim}", units).assign_attrs(
        long_name=f"{name}: Always (min over {dim})"
    )


def any_score(da: xr.DataArray, dim: str = "seed") -> xr.DataArray:
    """Continuous "Any": the maximum along ``dim``; ``any_(da, threshold=t)`` is exactly
    ``any_score(da) >= t`` where something is computed."""
    _check(da, dim)
    name = schema.name_from_attrs(da)
    units = da.attrs.get("units", "score")
    return _finish(da, da.max(dim), dim, f"maximum over {dim}", units).assign_attrs(
        long_name=f"{name}: Any (max over {dim})"
    )


def fraction(da: xr.DataArray, dim: str = "seed", threshold: float = 0.5) -> xr.DataArray:
    """Share of the computed values along ``dim`` with ``da >= threshold``, in [0, 1]; NaN
    where none is computed (``mask_rules.share``)."""
    _check(da, dim)
    _validate.number("threshold", threshold, low=0, high=1)
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


def binarize(da: xr.DataArray, threshold: float, side: str = "above") -> xr.DataArray:
    """Scores to a mask, cell by cell, by a ``mask_rules.SIDES`` rule: ``above`` (value >=
    threshold), ``below`` (<=) or ``abs`` (|value| >=); NaN (not computed) stays NaN.

    Args:
        da: scores, any dims (e.g. per-seed gates before ``agreement``).
        threshold: the value the rule compares with.
        side: "above", "below" or "abs".

    Returns:
        A mask with the dims, coords and attrs of ``da`` (bool, or float 1/0/NaN with
        ``units`` "bool" where some cell is NaN); ``long_name`` names the rule.

    Raises:
        TypeError: ``da`` not a DataArray, or ``threshold`` not a number.
        ValueError: a NaN or infinite ``threshold``, or an unknown ``side``.
    """
    _validate.result("da", da, kind=xr.DataArray, made_by="a lenscape method")
    threshold = _validate.number("threshold", threshold)
    return mask_rules.binarize(da, threshold, mask_rules.check_side(side))


def _categories(name: str, da: xr.DataArray) -> None:
    """Refuse continuous values where categories are compared (``agreement``): a mask, an
    integer or bool array, or float codes that are whole numbers (NaN: not computed)."""
    if mask_rules.is_mask(da) or da.dtype.kind in "biu":
        return
    if da.dtype.kind != "f":
        raise TypeError(f"{name} must hold numbers (masks or category codes), got {da.dtype}.")
    values = da.values[np.isfinite(da.values)]
    odd = values[values != np.round(values)]
    if odd.size:
        raise ValueError(
            f"{name} holds continuous values (such as {odd[:3].tolist()}), and agreement "
            "counts the cells whose values are equal, so two seeds that differ by 1e-7 would "
            f"agree nowhere. Compare masks or categories: binarize first, e.g. "
            f"lsc.aggregate.binarize({name}, 0.5), or lsc.aggregate.roles(...) codes."
        )


def agreement(
    da: xr.DataArray, other: xr.DataArray | None = None, dim: str = "seed"
) -> xr.DataArray:
    """How often two maps give a cell the same value, e.g. the head roles of two seeds.

    Per pair of labels along ``dim``: the share of the cells computed in both whose values
    are equal. Pairs: with ``other``, every label of ``da`` with every label of ``other``
    (a live fit against a recording); without, every two different labels of ``da`` (how
    well the seeds of one fit agree among themselves: the scale for the first).

    It compares categories, never scores: equal values of continuous scores are chance
    (two seeds differing by 1e-7 everywhere would agree on no cell), so such input is
    refused with the fix (``binarize`` first).

    Args:
        da: categorical values over ``dim`` and the cells' dims: a mask (``binarize``,
            ``always``), bools or integers, or float codes that are whole numbers (e.g.
            ``roles`` codes; NaN not computed).
        other: values over the same dims, its cells matched to ``da``'s by label (any
            order, any transpose), with its own labels along ``dim``.
        dim: the dim whose labels are paired.

    Returns:
        0-d: the mean share over pairs, in [0, 1]; attrs ``n_pairs``, ``lowest`` and
        ``highest`` (the least and most agreeing pair), ``aggregation``. NaN where no pair
        has a cell computed in both.

    Raises:
        TypeError: an input that is not a DataArray, or of values that are not numbers.
        ValueError: continuous values (not a mask nor categories: binarize first), no
            ``dim``, other dims or cell labels in ``other`` (named), or no pair (``da``
            alone with one label along ``dim``).
    """
    _check(da, dim)
    _categories("da", da)
    cells = [d for d in da.dims if d != dim]
    alone = other is None
    if other is None:
        if da.sizes[dim] < 2:
            raise ValueError(
                f"agreement of da with itself pairs two different {dim} labels; da has "
                f"{da.sizes[dim]}. Pass other= to compare with another result."
            )
        other = da
    else:
        _validate.result("other", other, kind=xr.DataArray, made_by="a lenscape method")
        _categories("other", other)
        if set(other.dims) != set(da.dims):
            raise ValueError(
                f"other has dims {list(other.dims)}, da {list(da.dims)}; pass maps over "
                "the same dims."
            )
        other = _validate.labels(
            "other", other, {str(d): da[d].values for d in cells}, made_by="the same method"
        )
    # other, read by label, holds the cells in da's order: (dim, *cells).
    first, second = _rows(da, dim), _rows(other.transpose(dim, *cells), dim)
    computed = ~np.isnan(first)[:, None] & ~np.isnan(second)[None]
    with np.errstate(invalid="ignore"):
        share = ((first[:, None] == second[None]) & computed).sum(-1) / computed.sum(-1)
    pairs = share[np.triu_indices(len(first), 1)] if alone else share.ravel()
    found = pairs[~np.isnan(pairs)]
    mean = float(found.mean()) if found.size else np.nan
    return xr.DataArray(mean).assign_attrs(
        {
            **da.attrs,
            "long_name": f"{schema.name_from_attrs(da)}: agreement",
            "units": "share of cells",
            "aggregation": f"same value, mean over pairs of {dim}",
            "n_pairs": len(pairs),
            "lowest": float(found.min()) if found.size else np.nan,
            "highest": float(found.max()) if found.size else np.nan,
        }
    )


def normalize(da: xr.DataArray, over: str = "component") -> xr.DataArray:
    """Share of each cell in the total over ``over`` (sums to 1 along it; NaN ignored)."""
    _validate.result("da", da, kind=xr.DataArray, made_by="a lenscape method")
    _validate.text("over", over, example="'component'")
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
    if not isinstance(arrays, dict):
        raise TypeError(
            f"arrays must be a dict {{model name: DataArray}}, got {type(arrays).__name__}."
        )
    if not arrays:
        raise ValueError("No arrays to combine; pass arrays={model name: DataArray}.")
    for name, da in arrays.items():
        _validate.result(f"arrays[{name!r}]", da, kind=xr.DataArray, made_by="a lenscape method")
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
    (the model's own top prediction at the read position is the target token).

    Args:
        da: a result with a ``prompt`` dim and a boolean ``correct`` coord on it, e.g.
            (prompt, layer, head) from a capture function. A method records ``correct``
            only when every prompt has a target (the logit lens of plain texts and
            attention patterns of texts have none, and say why in ``correct_note``).

    Returns:
        ``da`` without the wrongly answered prompts; ``correct_only`` in attrs names how many
        of how many prompts were kept ("13 of 16 prompts the model gets right").

    Raises:
        ValueError: if ``da`` has no ``prompt`` dim or no boolean ``correct`` coord on it
            (the message quotes ``correct_note`` where the method said why), or the model
            gets no prompt right (nothing would be left to draw).
        TypeError: ``da`` is not a DataArray.
    """
    _validate.result("da", da, kind=xr.DataArray, made_by="a lenscape method")
    if "prompt" not in da.dims:
        raise ValueError(
            f"correct_only keeps prompts, but da has dims {tuple(da.dims)}; "
            "pass a result that still has its prompt dim (before .mean('prompt'))."
        )
    if "correct" not in da.coords or da["correct"].dims != ("prompt",):
        why = da.attrs.get("correct_note")
        raise ValueError(
            "correct_only needs a boolean 'correct' coord on the prompt dim, and da has "
            + (
                f"none ({why})."
                if why
                else f"coords {tuple(map(str, da.coords))}; recompute the result with a "
                "capture function given prompts with targets (they record it), or assign "
                "one: da.assign_coords(correct=('prompt', flags))."
            )
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


def _along_labels(da: xr.DataArray, dims: list[Hashable]) -> xr.DataArray:
    """``da`` with each of ``dims`` in label order (labels ascending), so resampling by
    position resamples the same labels whatever order the input came in.

    Raises:
        ValueError: a dim whose labels repeat (two values would claim one label).
    """
    order = {}
    for dim in dims:
        if dim not in da.indexes:
            continue
        _validate.unique_labels("da", da, dim, because="its values cannot be read by label")
        order[dim] = da.indexes[dim].argsort(kind="stable")
    return da.isel(order)


def _rows(da: xr.DataArray, dim: str) -> np.ndarray:
    """(n along ``dim``, cells): ``dim`` first, the other dims flattened in order, as floats
    of the data's own precision (float32 maps stay float32: resampling them in float64
    would cost twice the time for digits the data does not have; anything else float64)."""
    dtype = np.float32 if da.dtype == np.float32 else np.float64
    return da.transpose(dim, ...).values.astype(dtype).reshape(da.sizes[dim], -1)


def _weighted_means(rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each weighting's mean of every cell over its finite values, by one matrix product.

    Args:
        rows: (n, cells); NaN (not computed) and infinite values do not count.
        weights: (k, n) how much each of the n rows counts in each of k samples (how often
            a resample drew it, or 1 for the prompts of a half).

    Returns:
        (k, cells); NaN where a sample holds no finite value of the cell.
    """
    finite = np.isfinite(rows)
    weights = weights.astype(rows.dtype)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (weights @ np.where(finite, rows, 0)) / (weights @ finite.astype(rows.dtype))


def _bounds(rows: np.ndarray, ci: float, n_resamples: int, seed: int) -> np.ndarray:
    """The bootstrap interval of every cell's mean: (2, cells) low and high, NaN for cells
    with fewer than 2 finite values or an infinite one."""
    n, cells = rows.shape
    weights = bootstrap.counts(bootstrap.draw(n, n_resamples=n_resamples, seed=seed), n)
    out = np.full((2, cells), np.nan)
    step = max(1, bootstrap.BLOCK_VALUES // n_resamples)
    for start in range(0, cells, step):
        block = slice(start, start + step)
        out[:, block] = bootstrap.percentiles(_weighted_means(rows[:, block], weights), ci)
    out[:, (np.isfinite(rows).sum(0) < 2) | np.isinf(rows).any(0)] = np.nan
    return out


def _interval_note(rows: np.ndarray, dim: str) -> str:
    """Why some intervals are NaN (empty when none is): one value, or an infinite one."""
    if rows.shape[0] == 1:
        return (
            f"one {dim}: a bootstrap of one value has no spread, so every interval is NaN; "
            f"pass at least 2 {dim}s"
        )
    few = int(((np.isfinite(rows).sum(0) < 2) & ~np.isinf(rows).any(0)).sum())
    infinite = int(np.isinf(rows).any(0).sum())
    parts = [f"{few} cells computed for fewer than 2 {dim}s"] if few else []
    parts += [f"{infinite} cells holding an infinite value"] if infinite else []
    return " and ".join(parts) + " have no interval (NaN)" if parts else ""


def _pooled_error_coords(da: xr.DataArray, dim: str) -> dict[str, xr.DataArray]:
    """``mean``'s ``error`` and ``measured`` coords over the other dims (see there)."""
    coords = {}
    if "error" in da.coords and dim in da["error"].dims:
        error = da["error"]
        coords["error"] = error.mean(dim, skipna=False).assign_attrs(
            {
                **error.attrs,
                "long_name": f"error estimate of the mean over {dim}s",
                "pooling": f"mean over {dim}s of the per-{dim} error estimates (a bound on "
                "the mean's error by the triangle inequality)",
            }
        )
    if "measured" in da.coords and dim in da["measured"].dims:
        coords["measured"] = (
            da["measured"].all(dim).assign_attrs(long_name=f"measured exactly on every {dim}")
        )
    return coords


def mean(
    da: xr.DataArray,
    dim: str = "prompt",
    *,
    ci: float = 0.95,
    n_resamples: int = bootstrap.DEFAULT_RESAMPLES,
    seed: int = 0,
) -> xr.DataArray:
    """The mean over ``dim`` (prompts) with a percentile-bootstrap interval per cell.

    The prompts are resampled with replacement ``n_resamples`` times (one seeded draw over
    the prompts in label order, so a ``sortby`` or ``transpose`` of ``da`` gives the same
    interval); each cell's interval is the middle ``ci`` of its resampled means
    (``lenscape.bootstrap``). NaN cells (not computed) never count: a cell's mean and
    resampled means are over its computed prompts, and a cell computed for fewer than 2
    prompts gets a NaN interval (``interval_note`` says how many).

    Args:
        da: per-prompt values, e.g. (prompt, layer, head) from a capture function.
        dim: the dim averaged and resampled.
        ci: the share of resampled means between ``low`` and ``high``, in (0, 1).
        n_resamples: resamples drawn (``bootstrap.MIN_RESAMPLES`` to
            ``bootstrap.MAX_RESAMPLES``).
        seed: seeds the draw.

    Returns:
        The other dims of ``da`` (in its order) and a last dim ``bound`` = ("mean", "low",
        "high") (``BOUNDS``): ``out.sel(bound="mean")`` is ``da.mean(dim)``; a coord ``n``
        (the other dims) counts each cell's computed prompts. ``lsc.heatmap`` draws it with
        the cells whose interval includes 0 hatched. Attrs: ``da``'s, with ``long_name``
        "<name>: mean over N prompts, 95% interval", ``interval`` (the method in a
        sentence), ``ci``, ``n_resamples``, ``interval_seed`` and, where some interval is
        NaN, ``interval_note``; a mask's mean has ``units`` "share of prompts". A fast
        estimate's per-cell ``error`` coord (``attribution_patching(error=True)``,
        ``refine="auto"``) becomes the mean's: the mean over ``dim`` of the per-prompt
        error estimates, which bounds the mean's error as they bound each prompt's
        (|mean(estimate - exact)| <= mean |estimate - exact|); NaN where any prompt's is
        (unknown stays unknown). A ``measured`` coord becomes "measured on every prompt".
        A (prompt, pos) ``token`` coord becomes one label per position (``pooled_tokens``:
        the shared token, or "pos 7 (tokens differ)"), with the count of mixed positions
        in the ``mixed_positions`` attr.

    Raises:
        TypeError: ``da`` not a DataArray, or an option of the wrong type.
        ValueError: ``dim`` not a dim of ``da``, its labels repeat, or an option out of
            range (each message names it).
    """
    _check(da, dim)
    ci, n_resamples, seed = bootstrap.check(ci, n_resamples, seed)
    da = _along_labels(da, [dim])
    rows = _rows(da, dim)
    point = pooled_tokens(da.mean(dim), da, dim)
    low, high = _bounds(rows, ci, n_resamples, seed).reshape((2, *point.shape))
    out = point.expand_dims(bound=list(BOUNDS), axis=-1).copy(
        data=np.stack([point.values.astype(np.float64), low, high], axis=-1)
    )
    computed = (~np.isnan(rows)).sum(0).reshape(point.shape)
    out = out.assign_coords(n=(point.dims, computed, {"long_name": f"N ({dim}s computed)"}))
    out = out.assign_coords(_pooled_error_coords(da, dim))
    name, n = schema.name_from_attrs(da), da.sizes[dim]
    units = mask_rules.share_units(dim) if mask_rules.is_mask(da) else da.attrs.get("units")
    note = _interval_note(rows, dim)
    return out.assign_attrs(
        {
            **{k: v for k, v in da.attrs.items() if k != "interval_note"},
            **bootstrap.attrs(dim, ci, n_resamples, seed),
            "long_name": f"{name}: mean over {n} {dim}s, {bootstrap.percent(ci)} interval",
            "aggregation": f"mean with {bootstrap.percent(ci)} interval (over {dim})",
            **({"units": units} if units else {}),
            **({"interval_note": note} if note else {}),
        }
    )


def _split_sizes(sizes: Sequence[int] | None, n: int) -> list[int]:
    """``reliability``'s sizes, checked: ascending distinct counts of prompts per half, 1 to
    n // 2; by default up to 10 sizes spaced evenly on a log scale.

    Raises:
        TypeError: not a list of integers.
        ValueError: a size outside 1 .. n // 2, or more than ``MAX_SIZES``.
    """
    if sizes is None:
        steps = np.geomspace(1, n // 2, num=min(10, n // 2))
        return sorted({int(s) for s in np.round(steps)})
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise TypeError(
            f"sizes must be a non-empty list of prompt counts such as [2, 4, 8], got {sizes!r}."
        )
    if len(sizes) > MAX_SIZES:
        raise ValueError(f"sizes lists {len(sizes)} counts; pass at most {MAX_SIZES}.")
    return sorted(
        {_validate.integer(f"sizes[{i}]", s, low=1, high=n // 2) for i, s in enumerate(sizes)}
    )


def _split_half(
    rows: np.ndarray, order: np.ndarray, size: int, top_k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per split, r and top-k overlap between the maps of its first ``size`` prompts and
    its next ``size`` prompts.

    Args:
        rows: (n, cells) per-prompt values.
        order: (splits, n) a permutation of the prompts per split.

    Returns:
        Two (splits,) arrays: correlation and top-k overlap.
    """
    picked = np.arange(order.shape[0])[:, None]
    maps = []
    for half in (order[:, :size], order[:, size : 2 * size]):
        weights = np.zeros((order.shape[0], rows.shape[0]))
        weights[picked, half] = 1.0
        maps.append(_weighted_means(rows, weights))
    first, second = maps
    return bootstrap.pearson(first, second), bootstrap.top_overlap(first, second, top_k)


def reliability(
    da: xr.DataArray,
    dim: str = "prompt",
    *,
    sizes: Sequence[int] | None = None,
    n_splits: int = 200,
    top_k: int = 10,
    ci: float = 0.95,
    seed: int = 0,
) -> xr.Dataset:
    """How many prompts do I need? The split-half reliability of a map's mean over ``dim``.

    For each size n, the prompts are split ``n_splits`` times at random into two disjoint
    halves of n prompts (one seeded draw of orders over the prompts in label order); each
    half's map is its mean over those prompts, and the two maps are compared by Pearson r
    over the cells and by the overlap of their top ``top_k`` cells by |mean|. When r and
    the overlap are near 1 at n, maps from n prompts already agree with each other; a map
    from all N prompts is at least as stable as the curve at n = N / 2 says.

    Args:
        da: per-prompt values, e.g. (prompt, layer, head); NaN cells (not computed) are
            left out of each comparison.
        dim: the dim split into halves.
        sizes: prompts per half, each 1 to N // 2 (default: up to 10 sizes from 1 to
            N // 2, evenly spaced on a log scale).
        n_splits: random splits per size, 2 to ``MAX_SPLITS``.
        top_k: cells in each top set; the overlap is NaN where at most ``top_k`` cells are
            compared (the sets would hold every cell).
        ci: the share of splits between ``low`` and ``high``, in (0, 1).
        seed: seeds the splits.

    Returns:
        Dataset with coords ``size`` (prompts per half) and ``bound`` = ("mean", "low",
        "high") (``BOUNDS``: the mean over splits and the middle ``ci`` of the splits), and
        variables ``correlation`` and ``top_overlap`` (size, bound). Attrs: ``long_name``,
        ``method`` "reliability", the map's own (``map``: its long_name; ``map_method``,
        ``map_units``, ``model``, ``metric``), ``n_prompts``, ``n_splits``, ``top_k``, ``ci``,
        ``seed``.

    Raises:
        TypeError: ``da`` not a DataArray, or an option of the wrong type.
        ValueError: ``dim`` not a dim of ``da``, fewer than 2 prompts, labels that
            repeat, or an option out of range (each message names it).
    """
    _check(da, dim)
    n = da.sizes[dim]
    if n < 2:
        raise ValueError(
            f"reliability splits the {dim}s into two halves, and da has {n}; pass at least "
            f"2 {dim}s (more than 20 for a curve worth reading)."
        )
    sizes = _split_sizes(sizes, n)
    n_splits = _validate.integer("n_splits", n_splits, low=2, high=MAX_SPLITS)
    top_k = _validate.positive_int("top_k", top_k)
    ci, seed = bootstrap.check_ci(ci), _validate.seed("seed", seed)
    da = _along_labels(da, list(da.dims))
    rows = _rows(da.transpose(*sorted(da.dims, key=str)), dim)
    orders = np.argsort(np.random.default_rng(seed).random((n_splits, n)), axis=1)
    step = max(1, bootstrap.BLOCK_VALUES // max(rows.shape[1], 1))
    stats = np.full((2, len(sizes), len(BOUNDS)), np.nan)
    for i, size in enumerate(sizes):
        parts = [
            _split_half(rows, orders[s : s + step], size, top_k) for s in range(0, n_splits, step)
        ]
        values = np.concatenate([np.stack(p) for p in parts], axis=1)  # (2, n_splits)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a size where every split is NaN
            stats[:, i, 0] = np.nanmean(values, axis=1)
        stats[:, i, 1], stats[:, i, 2] = bootstrap.percentiles(values.T, ci)
    return _reliability_dataset(
        da, stats, sizes, dim=dim, n_splits=n_splits, top_k=top_k, ci=ci, seed=seed
    )


def _reliability_dataset(
    da: xr.DataArray, stats: np.ndarray, sizes: list[int], **settings: Any
) -> xr.Dataset:
    """``reliability``'s Dataset from its (statistic, size, bound) numbers."""
    dim, top_k, ci = settings["dim"], settings["top_k"], settings["ci"]
    keep = ("model", "metric", "prompt_set", "layout_fingerprint", "weights_fingerprint")
    name = schema.name_from_attrs(da)
    return xr.Dataset(
        {
            "correlation": (
                ("size", "bound"),
                stats[0],
                {"long_name": "r between the two halves' maps", "units": "r"},
            ),
            "top_overlap": (
                ("size", "bound"),
                stats[1],
                {
                    "long_name": f"top-{top_k} overlap of the halves' maps (by |mean|)",
                    "units": "share",
                },
            ),
        },
        coords={
            "size": ("size", sizes, {"long_name": f"{dim}s per half"}),
            "bound": list(BOUNDS),
        },
        attrs={
            "long_name": f"Split-half reliability of {name}",
            "method": "reliability",
            "map": name,
            **{f"map_{k}": da.attrs[k] for k in ("method", "units") if k in da.attrs},
            **{k: da.attrs[k] for k in keep if k in da.attrs},
            "n_prompts": da.sizes[dim],
            "split": f"two disjoint halves of `size` {dim}s, {settings['n_splits']} random "
            f"splits per size (seed {settings['seed']}); bound: mean over splits and the "
            f"middle {bootstrap.percent(ci)} of the splits",
            **settings,
        },
    )
