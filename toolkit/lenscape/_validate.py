"""Argument checks shared by every public function: one helper per kind of input.

Public functions check their inputs here, up front, before any model run or file write,
so a bad value fails with a message that names the argument, the value and the fix
instead of a wrong number or an error from deep inside torch, transformers or zarr.
A value of the wrong type raises ``TypeError``; a value of the right type outside its
allowed range raises ``ValueError``.

- ``positive_int``: counts and sizes (``batch_size``, ``variants_per_pass``, ``steps``);
- ``number``: real-valued options with a closed range (``threshold``, ``lambda_``);
- ``choice``: one of a fixed set of strings (``metric``, ``level``, ``backend``);
- ``context_lengths``: tokenized prompts against the model's maximum positions.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from .models import LensModel


def _shown(value: Any) -> str:
    """``value`` for a message: its repr, plus its type where the repr hides it."""
    text = repr(value)
    return (
        text
        if isinstance(value, (str, int, float)) and not isinstance(value, bool)
        else f"{text} ({type(value).__name__})"
    )


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


def number(name: str, value: Any, *, low: float | None = None, high: float | None = None) -> float:
    """Check that ``value`` is a finite real number in ``[low, high]``.

    Returns:
        ``float(value)``.

    Raises:
        TypeError: not a real number (a string such as "0.5", None, a bool ...).
        ValueError: NaN, infinite, or outside ``[low, high]``.
    """
    bounds = (
        f" in [{low}, {high}]"
        if low is not None and high is not None
        else f" >= {low}"
        if low is not None
        else f" <= {high}"
        if high is not None
        else ""
    )
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
    ):
        raise ValueError(f"{name} must be a finite number{bounds}, got {value!r}.")
    return real


def choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """Check that ``value`` is one of ``choices``.

    Raises:
        ValueError: anything else (the message lists the choices).
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"Unknown {name} {value!r}; choose one of {list(choices)}.")
    return value


def context_length(model: LensModel) -> int | None:
    """The most positions ``model`` can attend over (from its HF config), or None if unknown."""
    config = model.hf.config
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def context_lengths(model: LensModel, token_counts: Sequence[int], *, what: str = "prompt") -> None:
    """Refuse prompts longer than the model's context (GPT-2's position embedding would
    raise an IndexError; rotary models would run past their trained positions silently).

    Args:
        token_counts: tokens per prompt, in prompt order (what one row of a pass holds).
        what: what was tokenized, for the message (e.g. "text", "corrupt text").

    Raises:
        ValueError: the first prompt longer than the context, with its index.
    """
    limit = context_length(model)
    if limit is None:
        return
    for index, count in enumerate(token_counts):
        if count > limit:
            raise ValueError(
                f"Prompt {index}: the {what} is {count} tokens long, more than "
                f"the {limit} positions model {model.name!r} was trained on; "
                "shorten it or split it into several prompts."
            )
