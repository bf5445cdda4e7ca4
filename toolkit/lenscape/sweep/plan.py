"""Per-prompt methods as plans: independent prompt batches plus a labelling step.

A method's planner (``plan_ablation(call: Call) -> Plan``) turns the tokenised prompts
(``inputs.Tokens``) and the call's checked ``Options`` into a ``Plan``: it checks the
method's own options (``kind``, ``estimator`` ...), does the work that needs the whole
prompt list (the mean activations of mean-ablation) and returns

- ``score(batch, step)`` -> ``Scores``: the method's numbers for one batch of prompts,
  (rows, n_columns), and whether the model answers each prompt correctly, independent of
  every other batch (``step()`` is called ``steps_per_batch`` times, for progress bars);
- ``finish(values, correct, index)`` -> the labelled, validated DataArray (or Dataset) for
  the prompts ``index`` given their (len(index), n_columns) values and (len(index),) flags.

Wrong answers are data: every result carries a boolean ``correct`` coord on ``prompt``,
True where the model's own top prediction at the read position of the clean, unedited
prompt is the target token. Each method reads it from a clean pass it already makes. A
call with a prompt that has no target (the logit lens of a plain text, attention patterns
of texts) has no ``correct``, and its ``correct_note`` attr says why: a flag there would
be made up (``result.prompt_coords``).

A plan runs in memory (``run_in_memory``), into a zarr store (``streaming``) or on dask
workers (``distributed``), the last two one ``write_batch`` at a time. Because batches are
independent and deterministic, all three give the same numbers.

**A plan is data.** The work a planner does over the whole prompt list (the pre-pass: the
mean activations of mean-ablation, the ranking pass of ``refine=k``) is kept in the plan's
``prepass`` (CPU tensors and plain values). ``PlanData`` holds what a plan is built from
(the planner, by reference, the options with the resolved batch size, the tokens) and that
pre-pass: it pickles, and ``PlanData.build(model)`` rebuilds the same plan on any process
without tokenising again or redoing the pre-pass (planners take it back in ``Call.prepass``).
Distributed capture builds the plan once on the client and sends its ``PlanData`` to the
workers.

Imports go one way: ``plan`` <- ``distributed`` <- ``streaming`` <- ``registry`` (``run``,
which every method calls) <- the methods in ``lenscape.capture``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import store
from ..models.lens_model import LensModel
from .inputs import Batch, Inputs, Tokens
from .options import Options
from .result import components, to_dataarray

#: What a plan's ``finish`` returns: a DataArray, or a Dataset of several.
Result = xr.DataArray | xr.Dataset
#: The result type of one plan (``xr.DataArray`` for all but ``attribution_patching``).
R = TypeVar("R", bound=Result)


@dataclass
class Scores:
    """What a plan's ``score`` returns for one batch of prompts.

    Attributes:
        values: (rows, n_columns) the method's numbers.
        correct: (rows,) bool: the model's top prediction at the read position of the
            clean, unedited prompt is the target (``top_is_target``).
    """

    values: torch.Tensor
    correct: torch.Tensor


def top_is_target(clean_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(rows,) bool: the top token of the clean logits (rows, vocab) is the target (rows,)."""
    return clean_logits.argmax(-1) == target


@dataclass
class Plan(Generic[R]):
    """A capture split into independent prompt batches, whose result is an ``R``.

    Attributes:
        inputs: validated, tokenized inputs; ``inputs.batches()`` are the units of work.
        n_columns: numbers per prompt (e.g. n_layers * n_heads).
        score: ``(Batch, step) -> Scores``; calls ``step()`` ``steps_per_batch`` times.
        finish: ``(values (k, n_columns) array, correct (k,) bool array, index (k,) prompt
            positions or None for all) -> R``, labels and provenance included.
        desc: progress bar label.
        steps_per_batch: progress steps in one batch (e.g. layers of an exact sweep).
        prepass: what the planner computed over the whole prompt list (name -> CPU
            tensors or plain values); given back to the planner, it skips that work.
    """

    inputs: Inputs
    n_columns: int
    score: Callable[[Batch, Callable[[], Any]], Scores]
    finish: Callable[[Any, Any, Sequence[int] | None], R]
    desc: str
    steps_per_batch: int = 1
    prepass: dict[str, Any] = field(default_factory=dict)


@dataclass
class Call:
    """What a planner is given.

    Attributes:
        model: the model the plan runs on.
        tokens: the prompts, tokenised once per call.
        options: the call's checked options.
        progress: show progress bars for the pre-pass.
        prepass: a plan's own pre-pass results (``Plan.prepass``): what is there is not
            computed again; what the planner computes is kept there.
    """

    model: LensModel
    tokens: Tokens
    options: Options
    progress: bool = False
    prepass: dict[str, Any] = field(default_factory=dict)


#: A method's planner: ``(Call) -> Plan[R]``.
Planner = Callable[[Call], Plan[R]]


def once(prepass: dict[str, Any], name: str, compute: Callable[[], Any]) -> Any:
    """``prepass[name]``, computed by ``compute()`` and kept there when it is missing."""
    if name not in prepass:
        prepass[name] = compute()
    return prepass[name]


@dataclass(frozen=True)
class PlanData(Generic[R]):
    """A built plan as data: picklable, rebuilt on another process without its pre-pass.

    Attributes:
        planner: the method's planner (a module-level function, pickled by reference).
        options: its options, with the batch size the plan resolved.
        tokens: the tokenised prompts the plan was built for.
        prepass: the plan's pre-pass results (``Plan.prepass``).
    """

    planner: Planner[R]
    options: Options
    tokens: Tokens
    prepass: dict[str, Any]

    @classmethod
    def of(cls, planner: Planner[R], options: Options, plan: Plan[R]) -> PlanData[R]:
        """The data of ``plan``, built by ``planner`` from ``options``."""
        resolved = options.replace(batch_size=plan.inputs.batch_size)
        return cls(planner, resolved, plan.inputs.tokens, plan.prepass)

    def build(self, model: LensModel, *, progress: bool = False) -> Plan[R]:
        """The plan on ``model`` (a copy of the one it was built on), pre-pass reused."""
        return self.planner(Call(model, self.tokens, self.options, progress, dict(self.prepass)))


def run_in_memory(plan: Plan[R], *, progress: bool) -> R:
    """Score every batch into one (prompt, n_columns) buffer and label it."""
    inputs = plan.inputs
    values = torch.full((len(inputs.tokens), plan.n_columns), float("nan"))
    correct = torch.zeros(len(inputs.tokens), dtype=torch.bool)
    with tqdm(
        total=inputs.n_batches() * plan.steps_per_batch, disable=not progress, desc=plan.desc
    ) as bar:
        for batch in inputs.batches():
            scores = plan.score(batch, bar.update)
            values[batch.index] = scores.values.float().cpu()
            correct[batch.index] = scores.correct.cpu()
    return plan.finish(values, correct.numpy(), None)


def batch_slice(plan: Plan, number: int) -> slice:
    """The prompt positions of batch ``number`` of ``plan``."""
    size = plan.inputs.batch_size
    return slice(number * size, min((number + 1) * size, len(plan.inputs.tokens)))


def write_batch(plan: Plan, number: int, path: Path, step=lambda *_: None) -> None:
    """Score batch ``number`` of ``plan`` and write it (then its done flags) to the zarr
    store ``path`` made by ``store.create``."""
    batch = plan.inputs.batch(number)
    scores = plan.score(batch, step)
    store.write_part(
        plan.finish(scores.values, scores.correct.cpu().numpy(), batch.index.tolist()),
        path,
        start=batch_slice(plan, number).start,
    )


def nan_values(n_prompts: int, n_columns: int) -> np.ndarray:
    """A (n_prompts, n_columns) all-NaN float32 array that takes no memory (a broadcast view)."""
    return np.broadcast_to(np.float32("nan"), (n_prompts, n_columns))


def not_yet_correct(n_prompts: int) -> np.ndarray:
    """(n_prompts,) all-False flags for a result's layout before any prompt is scored."""
    return np.broadcast_to(np.False_, (n_prompts,))


def one_level_plan(
    inputs: Inputs,
    score: Callable[[Batch, Callable], Scores],
    *,
    desc: str,
    method: str,
    effect: str,
    steps_per_batch: int = 1,
    prepass: dict[str, Any] | None = None,
    **params: Any,
) -> Plan[xr.DataArray]:
    """A plan measuring every component of ``inputs.level`` (in each position cell of
    ``inputs.positions``) whose result is
    ``to_dataarray`` of its scores (``method``, ``effect`` and ``params`` as there)."""
    return Plan(
        inputs,
        len(components(inputs)) * inputs.n_cells,
        score,
        lambda values, correct, index: to_dataarray(
            inputs, values, correct=correct, method=method, effect=effect, index=index, **params
        ),
        desc=desc,
        steps_per_batch=steps_per_batch,
        prepass={} if prepass is None else prepass,
    )
