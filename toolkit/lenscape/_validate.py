"""Argument checks shared by every public function: one helper per kind of input.

Public functions check their inputs here, up front, before any model run or file write,
so a bad value fails with a message that names the argument, the value and the fix
instead of a wrong number or an error from deep inside torch, transformers or zarr.
A value of the wrong type raises ``TypeError``; a value of the right type outside its
allowed range raises ``ValueError``.

- ``positive_int``: counts and sizes (``batch_size``, ``variants_per_pass``, ``steps``);
- ``integer``: other whole numbers with a range (``n_random``, ``top_k``);
- ``seed``: every ``seed=``: one rule for the package (``MAX_SEED``);
- ``seed_list``: a number of seeds or an explicit list of them (each a ``seed``);
- ``number``: real-valued options with a closed range (``threshold``, ``lambda_``);
- ``flag``: True or False (``progress``, ``check``);
- ``choice``: one of a fixed set of strings (``metric``, ``level``, ``backend``);
- ``strings``: a list of strings, where a plain string would be read letter by letter;
- ``not_empty``: a collection that must hold something (prompts, validation sets);
- ``values``: arrays of numbers passed in (gates, masks): finite, in range, binary;
- ``result``: results passed back in: their kind (type and the ``method`` attr that
  names what made them), variables, dims and the model they were computed on (by name,
  layout and weights fingerprints);
- ``labels``: a result read by its labels, never by position;

Each check runs once per call, before any batch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping, Sequence, Sized
from typing import Any, TypeVar, cast, overload

import numpy as np
import xarray as xr

#: A labelled result: what ``labels`` reads and gives back, of the same type.
Labelled = TypeVar("Labelled", xr.DataArray, xr.Dataset)
#: The largest seed: numpy's legacy ``RandomState`` (scikit-learn's k-means) takes no
#: larger one, and one rule holds for every ``seed=`` of the package.
MAX_SEED = 2**32 - 1


def _shown(value: Any) -> str:
    """``value`` for a message: its repr, plus its type where the repr hides it."""
    text = repr(value)
    return (
        text
        if isinstance(value, (str, int, float)) and not isinstance(value, bool)
        else f"{text} ({type(value).__name__})"
    )


def _bounds(low: Any, high: Any, both: str) -> str:
    """How a range reads in a message: ``both`` when both ends are given, else one end."""
    if low is not None and high is not None:
        return both
    return f" >= {low}" if low is not None else f" <= {high}" if high is not None else ""


# Without ``none_means`` None is refused, so the result is an int.
@overload
def positive_int(name: str, value: Any) -> int: ...
@overload
def positive_int(name: str, value: Any, *, none_means: str | None) -> int | None: ...
def positive_int(name: str, value: Any, *, none_means: str | None = None) -> int | None:
    """Check that ``value`` is an integer >= 1 (or None where ``none_means`` says what None does).

    Args:
        name: the argument's name, for the message.
        value: the value passed; numpy integers are accepted (and returned as ``int``).
        none_means: what None does (e.g. "pick one from free memory"); None is refused
            when this is not given.

    Returns:
        ``int(value)``, or None.

    Raises:
        TypeError: not an integer (a float, a string, a bool ...).
        ValueError: an integer below 1.
    """
    wanted = "a positive integer" + (f" or None ({none_means})" if none_means else "")
    if value is None and none_means:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be {wanted}, got {_shown(value)}.")
    if value < 1:
        raise ValueError(f"{name} must be {wanted}, got {value!r}.")
    return int(value)


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """Check that ``value`` is an integer in ``[low, high]`` (either bound may be open).

    Returns:
        ``int(value)``.

    Raises:
        TypeError: not an integer (a float, a string, a bool ...).
        ValueError: outside ``[low, high]``.
    """
    wanted = "an integer" + _bounds(low, high, f" from {low} to {high}")
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be {wanted}, got {_shown(value)}.")
    whole = int(value)
    if (low is not None and whole < low) or (high is not None and whole > high):
        raise ValueError(f"{name} must be {wanted}, got {value!r}.")
    return whole


def seed(name: str, value: Any) -> int:
    """Check a seed, the one rule for every ``seed=`` in lenscape: a whole number from 0 to
    ``MAX_SEED`` (numpy integers too). ``None`` is refused, as every draw in lenscape is
    seeded (the same call gives the same answer); so are a bool (``True`` would be seed 1)
    and a negative number (Python's ``random`` would read -1 as 1).

    Returns:
        ``int(value)``.

    Raises:
        TypeError: not a whole number (None, a bool, a float, a string ...).
        ValueError: a negative number or one above ``MAX_SEED``.
    """
    wanted = f"a whole number from 0 to {MAX_SEED}"
    fix = f"pass e.g. {name}=0; the same seed gives the same draw"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        why = " (lenscape's draws are always seeded)" if value is None else ""
        raise TypeError(f"{name} must be {wanted}, got {_shown(value)}{why}; {fix}.")
    if not 0 <= int(value) <= MAX_SEED:
        raise ValueError(f"{name} must be {wanted}, got {value!r}; {fix}.")
    return int(value)


def seed_list(name: str, value: Any) -> list[int]:
    """A number of seeds (``n`` -> 0..n-1) or an explicit list of distinct seeds (each a
    ``seed``).

    Raises:
        TypeError: neither an integer nor a list of integers (a float, a string ...).
        ValueError: no seeds, a negative seed or a repeated one.
    """
    fix = "pass a count such as 3 or a list such as [0, 1, 2]"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"{name} must be at least 1 seed, got {value!r}; {fix}.")
        return list(range(int(value)))
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{name} must be a number of seeds or a list of seeds, got {_shown(value)}; {fix}."
        )
    seeds = [seed(f"{name}[{i}]", one) for i, one in enumerate(value)]
    if not seeds or len(set(seeds)) < len(seeds):
        raise ValueError(f"{name} must hold at least one seed, each once, got {value!r}; {fix}.")
    return seeds


def number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
) -> float:
    """Check that ``value`` is a finite real number in ``[low, high]`` (and ``> above``).

    Args:
        above: an open lower bound (e.g. 0 for a learning rate, which 0 would not move).

    Returns:
        ``float(value)``.

    Raises:
        TypeError: not a real number (a string such as "0.5", None, a bool ...).
        ValueError: NaN, infinite, or outside the bounds.
    """
    bounds = _bounds(low, high, f" in [{low}, {high}]")
    if above is not None:
        bounds += f" and > {above}" if bounds else f" > {above}"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(
            f"{name} must be a number{bounds}, got {_shown(value)}; pass it unquoted, e.g. 0.5."
        )
    # As a float (what is returned): numbers.Real declares no comparison with float.
    real = float(value)
    if (
        not math.isfinite(real)
        or (low is not None and real < low)
        or (high is not None and real > high)
        or (above is not None and real <= above)
    ):
        raise ValueError(f"{name} must be a finite number{bounds}, got {value!r}.")
    return real


def flag(name: str, value: Any) -> bool:
    """Check that ``value`` is True or False (numpy booleans too).

    Raises:
        TypeError: anything else (1, "yes", None ...).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_shown(value)}.")
    return bool(value)


def choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """Check that ``value`` is one of ``choices``.

    Raises:
        ValueError: anything else (the message lists the choices).
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"Unknown {name} {value!r}; choose one of {list(choices)}.")
    return value


def text(name: str, value: Any, *, example: str, optional: bool = False) -> str | None:
    """Check that ``value`` is a string (or None where ``optional``): a dim, a title, a name.

    Args:
        name: the argument's name, for the message.
        example: a valid value for the message, e.g. "'head'".

    Raises:
        TypeError: anything else (a list of names, a number, an array ...).
    """
    if value is None and optional:
        return None
    if not isinstance(value, str):
        wanted = "a string" + (" or None" if optional else "")
        raise TypeError(
            f"{name} must be {wanted}, got {_shown(value)}; pass e.g. {name}={example}."
        )
    return value


def strings(name: str, value: Any, *, example: str) -> list[str]:
    """Check that ``value`` is a non-empty list (or tuple) of strings, never one string
    (which would be read letter by letter).

    Args:
        example: a valid value for the message, e.g. "('atp', 'ig')".

    Raises:
        TypeError: a plain string, or not a sequence of strings.
        ValueError: an empty sequence.
    """
    if isinstance(value, str):
        raise TypeError(
            f"{name} must be a list of strings, got the string {value!r}; "
            f"wrap it in a list: [{value!r}] (e.g. {example})."
        )
    if not isinstance(value, Sequence) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"{name} must be a list of strings such as {example}, got {_shown(value)}.")
    if not value:
        raise ValueError(f"{name} is empty; pass e.g. {example}.")
    return list(value)


def not_empty(name: str, value: Sized, *, fix: str) -> None:
    """Refuse an empty collection (prompts, validation texts), whose mean would be NaN.

    Args:
        fix: what to pass instead, for the message.

    Raises:
        ValueError: ``len(value) == 0``.
    """
    if len(value) == 0:
        raise ValueError(f"{name} is empty ({_shown(value)}); {fix}.")


def values(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    binary: bool = False,
    fix: str = "",
) -> np.ndarray:
    """An array of numbers passed in (a tensor, numpy array or DataArray's values), checked.

    Args:
        low, high: the allowed closed range.
        binary: only 0/1 (or booleans) are allowed: a mask, not probabilities.
        fix: what to pass instead, for the message.

    Returns:
        The values as a float64 numpy array (a copy; the input is untouched).

    Raises:
        TypeError: not numbers (strings, objects, a Dataset ...).
        ValueError: NaN or infinite values, values outside the range, or non-binary values
            where a mask is expected.
    """
    raw: Any = value.values if isinstance(value, xr.DataArray) else value
    if hasattr(raw, "detach"):  # a torch tensor, without importing torch here
        raw = raw.detach().cpu()
        raw = (raw.float() if raw.is_floating_point() else raw).numpy()
    array = np.asarray(raw) if not isinstance(raw, (str, bytes, dict, xr.Dataset)) else None
    if array is None or array.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be an array of numbers, got {_shown(value)}; {fix}.")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError(
            f"{name} holds {int((~np.isfinite(array)).sum())} NaN or infinite value(s); "
            f"they would turn every result into NaN; {fix}."
        )
    if binary and not np.isin(array, (0.0, 1.0)).all():
        odd = array[~np.isin(array, (0.0, 1.0))]
        raise ValueError(
            f"{name} must be a binary mask (True/False or 0/1), got values such as "
            f"{odd[:3].tolist()} (probabilities?); {fix}."
        )
    if (low is not None and array.min(initial=low) < low) or (
        high is not None and array.max(initial=high) > high
    ):
        raise ValueError(
            f"{name} must lie in [{low}, {high}], got values from {array.min()} to "
            f"{array.max()}; {fix}."
        )
    return array


def result(
    name: str,
    value: Any,
    *,
    kind: type | tuple[type, ...],
    made_by: str,
    origin: Mapping[str, Any] | None = None,
    variables: Sequence[str] = (),
    dims: Sequence[str] = (),
    methods: Sequence[str] = (),
) -> Any:
    """Check a result passed back in: its kind, its variables and dims, and that it was
    computed on the model ``origin`` describes (``LensModel.origin``: name, layout and
    weights fingerprints; each checked where the result records it, see ``origin``).

    Args:
        kind: ``xr.DataArray``, ``xr.Dataset`` or a tuple of both.
        made_by: the function that makes such a result, for the message (e.g.
            "lsc.head_gating").
        variables: data variables a Dataset must hold.
        dims: dims the result (each of ``variables``, for a Dataset) must have.
        methods: the ``method`` attrs of the results accepted (e.g. ``("head_gating",)``);
            a result that records another method is refused, one without the attr (made
            by hand) is judged by its type, variables and dims alone. Empty: any method.

    Returns:
        ``value``, unchanged.

    Raises:
        TypeError: the wrong kind (a DataArray for a Dataset, a tensor for a DataArray ...).
        ValueError: a result of another method, a missing variable or dim, or a result
            from another model.
    """
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds):
        hint = (
            f"; pick one variable, e.g. {name}[{next(iter(value.data_vars))!r}]"
            if isinstance(value, xr.Dataset) and value.data_vars
            else ""
        )
        raise TypeError(
            f"{name} must be an xarray.{' or '.join(k.__name__ for k in kinds)} from "
            f"{made_by}, got "
            f"{type(value).__name__}{hint}."
        )
    checked = cast("xr.DataArray | xr.Dataset", value)  # one of the kinds: xarray types
    made = checked.attrs.get("method")
    if methods and made is not None and made not in methods:
        raise ValueError(
            f"{name} is a result of {made!r}, not of {made_by}; pass the result of {made_by}."
        )
    if isinstance(checked, xr.Dataset):
        missing = [v for v in variables if v not in checked.data_vars]
        if missing:
            raise ValueError(
                f"{name} lacks the variable(s) {missing}: it is not a result of {made_by} "
                f"(it holds {list(checked.data_vars)})."
            )
    arrays = [checked[v] for v in variables] if isinstance(checked, xr.Dataset) else [checked]
    for array in arrays:
        absent = [d for d in dims if d not in array.dims]
        if absent:
            raise ValueError(
                f"{name} lacks the dim(s) {absent} (it has {list(array.dims)}); pass the "
                f"result of {made_by}."
            )
    if origin is not None:
        recorded = {**(arrays[0].attrs if arrays else {}), **checked.attrs}
        _check_origin(name, recorded, origin, made_by=made_by)
    return value


def _check_origin(
    name: str, attrs: Mapping[str, Any], expected: Mapping[str, Any], *, made_by: str
) -> None:
    differ = [
        f"{key} {attrs[key]!r} (the result) vs {want!r} (this model)"
        for key, want in expected.items()
        if key in attrs and attrs[key] != want
    ]
    if differ:
        raise ValueError(
            f"{name} was computed on another model than this one ({'; '.join(differ)}); "
            f"compute it for this model with {made_by}."
        )


def origin(name: str, value: Any, expected: Mapping[str, Any], *, made_by: str) -> None:
    """Check that a result passed back in was computed on the model described by
    ``expected`` (attr -> this model's value: ``LensModel.origin``). Each attr is compared
    where the result records it, and the message names the attrs that differ with both
    values.

    Raises:
        ValueError: the result records a different value for any of ``expected``.
    """
    _check_origin(name, value.attrs, expected, made_by=made_by)


def labels(
    name: str, value: Labelled, expected: Mapping[str, Sequence[Any]], *, made_by: str
) -> Labelled:
    """``value`` read by label: each dim of ``expected`` selected in the order its labels
    give (a ``sortby``, ``isel`` or ``transpose`` of the input is undone) and moved last,
    in that order, after the dims ``expected`` does not name.

    Raises:
        ValueError: a dim of ``expected`` that ``value`` lacks, or labels missing, unknown
            or repeated along one (named, with the fix).
    """
    for dim, wanted in expected.items():
        if dim not in value.dims:
            raise ValueError(
                f"{name} has no {dim!r} dim (it has {list(value.dims)}); pass the result of "
                f"{made_by}."
            )
        given = list(value[dim].values)
        wanted = list(wanted)
        missing = [label for label in wanted if label not in given]
        unknown = [label for label in given if label not in wanted]
        repeated = len(given) != len(set(given))
        if missing or unknown or repeated:
            parts = [
                f"missing {_few(missing)}" if missing else "",
                f"unknown {_few(unknown)}" if unknown else "",
                "some repeated" if repeated else "",
            ]
            raise ValueError(
                f"{name}'s {dim!r} labels do not match this model's "
                f"({'; '.join(p for p in parts if p)}); pass every {dim} of this model, as "
                f"{made_by} returned them."
            )
    selected = value.sel({dim: list(wanted) for dim, wanted in expected.items()})
    return selected.transpose(..., *expected)


def unique_labels(
    name: str, value: xr.DataArray | xr.Dataset, dim: Hashable, *, because: str
) -> None:
    """Check that ``value``'s labels along ``dim`` (an indexed dim) do not repeat.

    Raises:
        ValueError: they repeat; the message names some, says ``because`` (what a repeat
            would break) and gives the fix.
    """
    index = value.indexes[dim]
    if not index.is_unique:
        repeated = index[index.duplicated()].unique().tolist()[:4]
        raise ValueError(
            f"{name}'s {dim!r} labels repeat ({repeated}), so {because}; keep one of each, "
            f"e.g. {name}.drop_duplicates({dim!r})."
        )


def _few(items: Sequence[Any]) -> str:
    shown = [item.item() if isinstance(item, np.generic) else item for item in items[:4]]
    return f"{shown}{' ...' if len(items) > 4 else ''}"
