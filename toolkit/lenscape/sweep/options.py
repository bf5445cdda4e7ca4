"""The options the per-prompt methods share: each declared once, with its default and its check.

``DEFAULTS`` is the one place a shared option's default is written. Public signatures stay
explicit and typed for a notebook user (``help(lsc.ablation)`` and the editor show
``batch_size: int | None = 8``) by naming it: ``batch_size: int | None = DEFAULTS.batch_size``;
``tests/test_options.py`` checks that every public function with a shared option takes its
default from here. ``check_options`` is the one check of the counts and choices among them,
run when a method's ``CaptureOptions`` is built (before any model run or store is touched).

Imports go one way: ``options`` <- ``plan`` <- ``distributed`` <- ``streaming`` <- the
methods in ``lenscape.capture``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from .. import _validate
from . import metrics
from .backend import BACKENDS
from .inputs import PADDING_SIDES


@dataclass(frozen=True)
class SharedDefaults:
    """The defaults of the shared options (meaning: ``lsc.ablation``'s docstring).

    Attributes:
        level: "head" (per head) or "block" (attention and MLP per layer).
        metric: what a change is measured on (``metrics.METRICS``).
        batch_size: prompts per forward pass; None picks one from free memory.
        backend: the hook library that reads and edits activations (``BACKENDS``).
        padding_side: "right" or "left"; results do not depend on it.
        variants_per_pass: edited copies of a prompt per pass; None: as many as fit.
        store: a ``.zarr`` path to stream results to and resume from; None: in memory.
        client: a ``dask.distributed.Client`` to score batches on; None: this process.
        progress: show a progress bar.
    """

    level: str = "head"
    metric: str = "logit_diff"
    batch_size: int | None = 8
    backend: str = "nnsight"
    padding_side: str = "right"
    variants_per_pass: int | None = None
    store: str | Path | None = None
    client: Any = None
    progress: bool = True


DEFAULTS = SharedDefaults()

#: Count options -> what None does.
COUNT_OPTIONS = {
    "batch_size": "pick one from free memory",
    "variants_per_pass": "as many as fit in memory",
    "refine": "measure every component exactly",
    "steps": "the estimator's default",
}
#: Choice options -> their allowed values.
CHOICE_OPTIONS = {"metric": metrics.METRICS, "backend": BACKENDS, "padding_side": PADDING_SIDES}


def check_options(options: dict[str, Any]) -> None:
    """Check the options the per-prompt methods share, whichever method gets them.

    Raises:
        TypeError: a count that is not an integer (e.g. ``variants_per_pass=2.5``).
        ValueError: a count below 1, or an unknown ``metric``/``backend``/``padding_side``.
    """
    for name, none_means in COUNT_OPTIONS.items():
        if name in options:
            _validate.positive_int(name, options[name], none_means=none_means)
    for name, choices in CHOICE_OPTIONS.items():
        if name in options:
            _validate.choice(name, options[name], choices)


@dataclass(frozen=True)
class CaptureOptions:
    """The options every per-prompt method has; each method's subclass adds its own.

    Fields have no defaults (those are ``DEFAULTS``, named by the public signature), so an
    option a public function forgets to pass is a TypeError on its first call instead of a
    silently ignored argument. Creating the options runs ``check_options``.

    Attributes:
        method: the public name of the method these options belong to (class constant).
        level, metric, batch_size, backend, padding_side: as in ``lsc.ablation``.

    Raises:
        TypeError, ValueError: as ``check_options``.
    """

    method: ClassVar[str]

    level: str
    metric: str
    batch_size: int | None
    backend: str
    padding_side: str

    def __post_init__(self) -> None:
        check_options(asdict(self))
