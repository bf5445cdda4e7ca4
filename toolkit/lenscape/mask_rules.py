"""Masks, defined once: what counts as a mask and as kept, how scores become a mask, how a
mask reduces over a dim, and how the results are labelled. The views (``lenscape.views``)
and ``aggregate`` all follow these rules.

- **A mask** is an array that says so by its type, never by its values: bool dtype, or
  ``units == "bool"`` (``MASK_UNITS``) for a float mask that holds NaN. A float array
  holding only 0 and 1 is still a score.
- **Kept** (or active) means computed and non-zero.
- **NaN means "not computed"** (``NAN_LABEL``). It is never kept and never counts against
  a cell either: a reduction over a dim counts only the computed cells along it. ``any``
  is "at least one computed cell is kept", ``all`` is "every computed cell is kept", and
  ``share`` is kept / computed, in [0, 1]. Each is NaN where no cell along the dim was
  computed. So ``any`` is ``share > 0`` and ``all`` is ``share == 1``.
- **Dtype**: a mask (from ``binarize``, ``any_`` or ``all_``) is bool when every cell is
  computed. When some cells are not, it is float (1.0 kept, 0.0 not kept, NaN not
  computed) with ``units == "bool"``, because a bool array cannot hold NaN. A share is
  always float.
- **Binarizing** follows one of the ``SIDES`` rules: ``abs`` (|value| >= t), ``above``
  (value >= t) or ``below`` (value <= t). The rule names the result ("|x| >= 0.5") and its
  two legend states.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import xarray as xr

from lenscape.schema import name_from_attrs

#: ``units`` of a mask stored as floats (NaN where not computed).
MASK_UNITS = "bool"
#: How a NaN cell ("not computed") is named in legends, subtitles and notes.
NAN_LABEL = "not computed"
#: Default legend names of a mask's 0/False and 1/True states.
STATES = ("skipped", "kept")


@dataclasses.dataclass(frozen=True)
class Side:
    """A binarize rule: which values pass a threshold ``t``, and how that reads.

    Attributes:
        passes: ``(da, t) -> bool DataArray``: True where a value passes.
        rule: the result's ``long_name``, a template with ``{name}`` and ``{t}``.
        states: legend names of the failing and passing states, templates with ``{t}``.
    """

    passes: Callable[[xr.DataArray, float], xr.DataArray]
    rule: str
    states: tuple[str, str]


#: Binarize rules by name. ``abs`` keeps strong values of either sign.
SIDES = {
    "abs": Side(lambda da, t: abs(da) >= t, "|{name}| >= {t}", ("|value| < {t}", "|value| >= {t}")),
    "above": Side(lambda da, t: da >= t, "{name} >= {t}", ("< {t}", ">= {t}")),
    "below": Side(lambda da, t: da <= t, "{name} <= {t}", ("> {t}", "<= {t}")),
}


def check_side(side: object) -> str:
    """Check that ``side`` names a ``SIDES`` rule.

    Raises:
        ValueError: anything else (the message lists the rules).
    """
    if not isinstance(side, str) or side not in SIDES:
        raise ValueError(f"side={side!r} is not a binarize rule; pick one of {list(SIDES)}.")
    return side


def is_mask(da: xr.DataArray) -> bool:
    """Whether ``da`` declares itself a mask: bool dtype, or ``units == MASK_UNITS`` (a float
    mask whose NaN cells were not computed)."""
    return da.dtype == bool or da.attrs.get("units") == MASK_UNITS


def kept(da: xr.DataArray) -> xr.DataArray:
    """True where a cell is computed and non-zero; NaN (not computed) is never kept.

    Args:
        da: a mask or any numbers, any dims.

    Returns:
        A bool DataArray with the dims and coords of ``da``.
    """
    return da.notnull() & (da != 0)


def _computed_only(result: xr.DataArray, computed: xr.DataArray) -> xr.DataArray:
    """``result`` with NaN where ``computed`` is False; kept bool when every cell is computed."""
    return result if bool(computed.all()) else result.where(computed)


def binarize(da: xr.DataArray, threshold: float, side: str = "above") -> xr.DataArray:
    """Scores to a mask by a ``SIDES`` rule; NaN (not computed) stays NaN.

    Args:
        da: scores, any dims.
        threshold: the value the rule compares with.
        side: the rule's name in ``SIDES``.

    Returns:
        A mask with the dims, coords and attrs of ``da``; ``long_name`` says the rule
        (e.g. "|attribution| >= 0.5") and ``units`` is ``MASK_UNITS``.

    Raises:
        ValueError: an unknown ``side``.
    """
    rule = SIDES[check_side(side)]
    mask = _computed_only(rule.passes(da, threshold), da.notnull())
    name = rule.rule.format(name=name_from_attrs(da), t=f"{threshold:g}")
    return mask.assign_attrs({**da.attrs, "long_name": name, "units": MASK_UNITS})


def _dim_list(dims: Hashable | Sequence[Hashable]) -> list[Hashable]:
    return list(dims) if isinstance(dims, (list, tuple)) else [dims]


def _counts(
    mask: xr.DataArray, dims: Hashable | Sequence[Hashable]
) -> tuple[xr.DataArray, xr.DataArray]:
    """How many cells along ``dims`` are kept, and how many are computed."""
    names = _dim_list(dims)
    return kept(mask).sum(names), mask.notnull().sum(names)


def any_(mask: xr.DataArray, dims: Hashable | Sequence[Hashable]) -> xr.DataArray:
    """True where at least one computed cell along ``dims`` is kept.

    Args:
        mask: a mask (any numbers: non-zero is kept).
        dims: the dim (or dims) to reduce.

    Returns:
        The mask without ``dims``: NaN where nothing along them was computed, bool when
        every cell has something computed. No attrs (the caller names the result).
    """
    n_kept, n_computed = _counts(mask, dims)
    return _computed_only(n_kept > 0, n_computed > 0)


def all_(mask: xr.DataArray, dims: Hashable | Sequence[Hashable]) -> xr.DataArray:
    """True where every computed cell along ``dims`` is kept (NaN cells are skipped).

    Returns:
        As ``any_``.
    """
    n_kept, n_computed = _counts(mask, dims)
    return _computed_only(n_kept == n_computed, n_computed > 0)


def share(mask: xr.DataArray, dims: Hashable | Sequence[Hashable]) -> xr.DataArray:
    """The share of computed cells along ``dims`` that are kept, in [0, 1].

    Returns:
        A float DataArray without ``dims``: NaN where nothing along them was computed.
        No attrs (``share_units`` names the units).
    """
    n_kept, n_computed = _counts(mask, dims)
    return (n_kept / n_computed).where(n_computed > 0)


#: Reductions of a mask over a dim (or dims), by name.
REDUCERS: dict[str, Callable[[xr.DataArray, Hashable | Sequence[Hashable]], xr.DataArray]] = {
    "share": share,
    "any": any_,
    "all": all_,
}


def share_units(dims: Hashable | Sequence[Hashable]) -> str:
    """``units`` of a share over ``dims``, e.g. "share of prompts and seeds"."""
    return "share of " + " and ".join(f"{d}s" for d in _dim_list(dims))
