"""Per-prompt capture methods as plans: independent prompt batches plus a labelling step.

Every per-prompt method (ablation, activation and attribution patching, direct logit
attribution) is built by a *planner* registered here under its public name. ``make_plan``
first checks the options every method shares (``check_options``); the planner checks its
own (``level``, ``kind`` ...) and the prompts (``_inputs.prepare``), does any work that
needs the whole prompt list (the mean activations of mean-ablation) and returns a ``Plan``:

- ``score(batch, step)`` -> (rows, n_columns) float tensor: the method's numbers for one
  batch of prompts, independent of every other batch (``step()`` is called
  ``steps_per_batch`` times, for progress bars);
- ``finish(values, index)`` -> the labelled, validated DataArray (or Dataset) for the prompts
  ``index`` given their (len(index), n_columns) values.

``execute`` runs a plan in memory, or hands it to ``streaming`` (zarr store, resume, dask
workers). Because batches are independent and deterministic, all three give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import _validate
from . import metrics
from ._backend import BACKENDS
from ._inputs import PADDING_SIDES, Batch, Inputs

#: What a planner returns a result as: a DataArray, or a Dataset of several.
Result = Any


@dataclass
class Plan:
    """A capture split into independent prompt batches.

    Attributes:
        method: the public name it was planned under (e.g. "ablation").
        inputs: validated, tokenized inputs; ``inputs.batches()`` are the units of work.
        n_columns: numbers per prompt (e.g. n_layers * n_heads).
        score: ``(Batch, step) -> (rows, n_columns)`` tensor; calls ``step()``
            ``steps_per_batch`` times.
        finish: ``(values (k, n_columns) array, index (k,) prompt positions or None for all)
            -> Result``, labels and provenance included.
        desc: progress bar label.
        steps_per_batch: progress steps in one batch (e.g. layers of an exact sweep).
    """

    method: str
    inputs: Inputs
    n_columns: int
    score: Callable[[Batch, Callable[[], Any]], torch.Tensor]
    finish: Callable[[Any, Sequence[int] | None], Result]
    desc: str
    steps_per_batch: int = 1


#: public method name -> planner ``(model, prompts, *, progress, **options) -> Plan``.
PLANNERS: dict[str, Callable[..., Plan]] = {}


def planner(name: str):
    """Register a planner under the public method ``name``."""

    def register(fn):
        PLANNERS[name] = fn
        return fn

    return register


#: Options shared by the per-prompt methods -> what None does (None: None is not allowed).
COUNT_OPTIONS = {
    "batch_size": "pick one from free memory",
    "variants_per_pass": "as many as fit in memory",
    "refine": "measure every component exactly",
    "steps": "the estimator's default",
}
#: Options shared by the per-prompt methods -> their allowed values.
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


def make_plan(method: str, model, prompts, *, progress: bool = False, **options) -> Plan:
    """Build the plan of the registered method ``method``: shared options are checked by
    ``check_options``, the method's own and the prompts by its planner.

    Raises:
        TypeError, ValueError: a bad option or prompt (the message names it).
    """
    check_options(options)
    return PLANNERS[method](model, prompts, progress=progress, **options)


def run_in_memory(plan: Plan, *, progress: bool) -> Result:
    """Score every batch into one (prompt, n_columns) buffer and label it."""
    inputs = plan.inputs
    values = torch.full((len(inputs.prompts), plan.n_columns), float("nan"))
    with tqdm(
        total=inputs.n_batches() * plan.steps_per_batch, disable=not progress, desc=plan.desc
    ) as bar:
        for batch in inputs.batches():
            values[batch.index] = plan.score(batch, bar.update).float().cpu()
    return plan.finish(values, None)


def execute(
    method: str, model, prompts, *, store=None, client=None, progress: bool = True, **options
) -> Result:
    """Run ``method`` in memory, or stream it to ``store`` (optionally on dask ``client``)."""
    if client is not None and store is None:
        raise ValueError(
            "client= distributes batches whose results land in one zarr store; "
            "pass store='results.zarr' too."
        )
    if store is not None:
        from .streaming import capture_to

        return capture_to(
            store, method, model, prompts, client=client, progress=progress, **options
        )
    return run_in_memory(
        make_plan(method, model, prompts, progress=progress, **options), progress=progress
    )


def nan_values(n_prompts: int, n_columns: int) -> np.ndarray:
    """A (n_prompts, n_columns) all-NaN float32 array that takes no memory (a broadcast view)."""
    return np.broadcast_to(np.float32("nan"), (n_prompts, n_columns))
