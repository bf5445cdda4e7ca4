"""The options the per-prompt methods share: each declared once, with its default, its
check and its description.

- ``DEFAULTS`` is the one place a shared option's default is written. Public signatures stay
  explicit and typed for a notebook user (``help(lsc.ablation)`` and the editor show
  ``batch_size: int | None = 8``) by naming it: ``batch_size: int | None =
  DEFAULTS.batch_size``; ``tests/test_options.py`` checks that every public function with a
  shared option takes its default from here.
- ``check_options`` is the one check of the counts and choices among them.
- ``DESCRIPTIONS`` is the one place a shared option is described: ``describe`` adds the
  descriptions of the shared options a method takes to its docstring's ``Args``.
- ``Options`` holds one call's options (every argument but the model, the prompts and
  ``RUN_ARGUMENTS``), checked when it is built, before any model run or store is touched.

Imports go one way: ``options`` <- ``inputs`` <- ``plan`` <- ``streaming`` <- ``registry``
<- the methods in ``lenscape.capture``.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .. import _validate
from . import metrics
from .backend import BACKENDS


@dataclass(frozen=True)
class SharedDefaults:
    """The defaults of the shared options (their meaning: ``DESCRIPTIONS``)."""

    level: str = "head"
    positions: str = "all"
    metric: str = "logit_diff"
    batch_size: int | None = 8
    backend: str = "nnsight"
    padding_side: str = "right"
    variants_per_pass: int | None = None
    store: str | Path | None = None
    client: Any = None
    progress: bool = True


DEFAULTS = SharedDefaults()

#: What each argument the methods share means: a method's docstring gets these (``describe``)
#: for the arguments its own ``Args`` does not describe.
DESCRIPTIONS = {
    "model": "a ``LensModel`` from ``lsc.load``.",
    "prompts": "a ``PromptSet`` (or ``Prompt``s / dicts) with single-token targets.",
    "level": '"head" -> dims (prompt, layer, head); "block" -> (prompt, layer, component) '
    "with attn and mlp.",
    "positions": '"all": every position at once; "each": a ``pos`` dim, one cell per token '
    "position from each prompt's first token (BOS included), with a ``token`` coord "
    '(prompt, pos) and NaN past a prompt\'s end; "spans": a ``span`` dim, one cell per named '
    'span of the prompts (``Prompt(spans=...)``) in prompt order and "other" (tokens in '
    "none) last, with a ``span_text`` coord (prompt, span). Exact methods replace a cell's "
    "tokens together; gradient estimates sum their per-position terms, so cells add up to "
    "the all-positions score.",
    "metric": '"logit_diff", "logprob", "loss" or "logit": what a change is measured on.',
    "batch_size": "prompts per forward pass; None: the largest the method's memory estimate "
    "(``lsc.estimate``) fits in the available memory (CPU: up to 8, GPU: up to 256). A run "
    "that cannot fit is refused (``MemoryError``) before it allocates.",
    "backend": '"nnsight" or "transformer_lens": the hook library that reads and edits '
    "activations.",
    "padding_side": '"right" or "left"; results do not depend on it.',
    "variants_per_pass": "edited copies of a batch per pass (default: one block's components, "
    "fewer if they do not fit in memory).",
    "store": "a ``.zarr`` path: stream per-prompt results there batch by batch and resume an "
    "interrupted run with the same arguments; returns the stored result, lazily.",
    "client": "a ``dask.distributed.Client``: score batches on its workers (needs ``store``).",
    "overwrite": "replace an existing ``store`` instead of resuming it.",
    "progress": "show a progress bar.",
}

#: Arguments that say where and how a call runs, not what it computes: never part of
#: ``Options`` (a store is resumed whatever they are).
RUN_ARGUMENTS = ("store", "client", "overwrite", "progress")
#: The shared options every method that batches prompts takes (``signature``) ...
BATCHING = ("metric", "batch_size", "backend", "padding_side")
#: ... with a ``level`` ...
LEVELLED = ("level", *BATCHING)
#: ... and exact sweeps, which stack edited copies of a batch.
EXACT = (*LEVELLED, "variants_per_pass")
#: The node methods that resolve token positions (``sweep/positions``): estimates ...
POSITIONAL = (*LEVELLED, "positions")
#: ... and exact sweeps.
POSITIONAL_EXACT = (*EXACT, "positions")
#: What ``positions`` takes (``sweep/positions``).
POSITIONS = ("all", "each", "spans")
#: Methods that read the model without a metric (the logit lens, attention patterns).
UNMEASURED = ("batch_size", "backend", "padding_side")
#: Where every registered method runs: it takes these last.
PLACE = ("store", "client", "progress")


def signature(
    function: Any, shared: Sequence[str], defaults: Mapping[str, Any] | None = None
) -> inspect.Signature:
    """``function``'s signature with the ``shared`` options (then ``PLACE``) in place of its
    ``**shared`` catch-all: keyword-only, with their defaults (``DEFAULTS``, or the method's
    own ``defaults``) and types (the annotations of ``SharedDefaults``). What ``help()``, the
    editor and ``capture_to`` see.

    Raises:
        ValueError: an option of ``shared`` that is not a shared one.
    """
    unknown = sorted(set(shared) - set(DESCRIPTIONS) | set(shared) & set(PLACE))
    if unknown:
        raise ValueError(f"{unknown} are not shared options; declare them in the signature.")
    types = {field.name: field.type for field in fields(SharedDefaults)}
    own = [
        p
        for p in inspect.signature(function).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    added = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=(defaults or {}).get(name, getattr(DEFAULTS, name)),
            annotation=types[name],
        )
        for name in (*shared, *PLACE)
    ]
    return inspect.signature(function).replace(parameters=[*own, *added])


PADDING_SIDES = ("right", "left")
#: Count options -> what None does.
COUNT_OPTIONS = {
    "batch_size": "pick the largest that fits in memory",
    "variants_per_pass": "as many as fit in memory",
    "steps": "the estimator's default",
}
#: The most integration points ``steps`` may ask for: each is a forward and a backward pass
#: per batch, and a left Riemann sum's error falls as 1/steps (8 points already agree with
#: exact patching to r 0.93-0.96, benchmarks/RESULTS.md), so more is a typo, not a finer
#: estimate.
MAX_STEPS = 512
#: Choice options -> their allowed values.
CHOICE_OPTIONS = {
    "metric": metrics.METRICS,
    "backend": BACKENDS,
    "padding_side": PADDING_SIDES,
    "positions": POSITIONS,
}


def integration_points(
    estimator: Any,
    steps: int | None,
    *,
    estimators: Sequence[str],
    paths: Sequence[str],
    default: int,
) -> int:
    """How many points a gradient estimator takes: ``steps`` (None: ``default``) for one
    that integrates along a path (``paths``), 1 for the others (a gradient at the corrupt
    run, plain or under relevance rules).

    Raises:
        ValueError: an unknown estimator (a report's label such as ``"ig:8"`` or
            ``"relp:secant"`` is told how to spell it here), or ``steps`` other than 1 with a
            one-point one.
    """
    name, _, detail = str(estimator).partition(":")
    # the labels parse_estimator (capture/patching.py) reads: a path's points, relp's rules
    spelled = None
    if name in paths and detail.isdigit():
        spelled = f"steps={detail}"
    elif name == "relp" and name in estimators and detail and not detail.isdigit():
        spelled = f"rules={detail!r}"
    if spelled:
        raise ValueError(
            f"estimator={estimator!r} is a label (as lsc.faithfulness reports name "
            f"estimators); here pass the name and its detail apart: estimator={name!r}, "
            f"{spelled}."
        )
    _validate.choice("estimator", estimator, estimators)
    if steps is None:
        return default if estimator in paths else 1
    if estimator not in paths and steps != 1:
        raise ValueError(
            f"estimator={estimator!r} takes the gradient at the corrupt run alone; "
            f"steps={steps} needs estimator={paths[0]!r} (or leave steps=None)."
        )
    return steps


def check_options(options: Mapping[str, Any]) -> None:
    """Check the options the per-prompt methods share, whichever method gets them.

    Raises:
        TypeError: a count that is not an integer (e.g. ``variants_per_pass=2.5``).
        ValueError: a count below 1, ``steps`` above ``MAX_STEPS``, or an unknown
            ``metric``/``backend``/``padding_side``.
    """
    for name, none_means in COUNT_OPTIONS.items():
        if name in options:
            _validate.positive_int(name, options[name], none_means=none_means)
    steps = options.get("steps")
    if steps is not None and steps > MAX_STEPS:
        raise ValueError(
            f"steps={steps} integration points would take {steps} forward and backward "
            f"passes per batch; use at most {MAX_STEPS} (8 to 32 are plenty)."
        )
    for name, choices in CHOICE_OPTIONS.items():
        if name in options:
            _validate.choice(name, options[name], choices)


@dataclass(frozen=True)
class Options:
    """One call's options: the method's name and every option by name, checked.

    Read an option as an attribute (``options.level``); ``replace`` makes a changed copy.
    It pickles (plans travel to dask workers with it).

    Raises:
        TypeError, ValueError: as ``check_options``, when built.
    """

    method: str
    items: tuple[tuple[str, Any], ...]

    def __post_init__(self) -> None:
        check_options(dict(self.items))

    @classmethod
    def of(cls, method: str, values: Mapping[str, Any]) -> Options:
        return cls(method, tuple(sorted(values.items())))

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields; ``items`` itself is missing while
        # unpickling, when the lookup must fail like any missing attribute.
        if name.startswith("__") or name == "items":
            raise AttributeError(name)
        for key, value in self.items:
            if key == name:
                return value
        raise AttributeError(f"the options of {self.method} have no {name!r}")

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.items).get(name, default)

    def asdict(self) -> dict[str, Any]:
        return dict(self.items)

    def replace(self, **changes: Any) -> Options:
        return Options.of(self.method, {**self.asdict(), **changes})


def describe(doc: str | None, parameters: Iterable[str]) -> str:
    """``doc`` (a Google-style docstring) with its ``Args:`` section completed and put in
    the order of ``parameters``: an argument ``doc`` does not describe gets its line from
    ``DESCRIPTIONS`` (the section is made before ``Returns:`` when there is none)."""
    doc = inspect.cleandoc(doc or "")
    head, marker, tail = doc.partition("\nArgs:\n")
    if not marker:
        head, returns, rest = doc.partition("\nReturns:")
        tail = "\n" + ("Returns:" + rest if returns else "")
    args_block, _, rest = tail.partition("\n\n")
    entries: dict[str, list[str]] = {}  # "name" or "a, b" -> its lines
    for line in args_block.splitlines():
        if line.startswith("    ") and not line.startswith("     ") and ":" in line:
            entries[line.split(":")[0].strip()] = [line]
        elif entries:
            entries[next(reversed(entries))].append(line)
    by_name = {name.strip(): key for key in entries for name in key.split(",")}
    lines: list[str] = []
    for name in parameters:
        if name in by_name and by_name[name] in entries:
            lines += entries.pop(by_name[name])
        elif name in DESCRIPTIONS and name not in by_name:
            lines.append(
                textwrap.fill(
                    f"{name}: {DESCRIPTIONS[name]}",
                    width=88,
                    initial_indent="    ",
                    subsequent_indent="        ",
                )
            )
    lines += [line for rest_lines in entries.values() for line in rest_lines]
    section = "\nArgs:\n" + "\n".join(lines) if lines else ""
    return head + section + ("\n\n" + rest.strip("\n") if rest.strip() else "")
