"""``refine``: exact measurement of only some cells, chosen by a gradient estimate.

``refine=k`` measures the k components whose prompt-mean estimate is largest in absolute
value (``_refined_columns``); ``refine="auto"`` (``_auto_refinement``) estimates every cell
and its error, measures the cells that could be off by more than ``tol`` (``auto_cells``),
raises each component's margin to what those measurements show (``calibrated_margins``) and
measures the cells the ranking of the ``top`` components still needs (``ranking_cells``).
``_exact_plan`` is the plan of an exact sweep of the chosen cells. The rules are pure NumPy
so benchmarks replay them offline."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from ... import _validate
from ...models import LensModel
from ...sweep import memory
from ...sweep.inputs import Batch, Inputs
from ...sweep.options import Options
from ...sweep.plan import Call, Plan, Scores, once, one_level_plan
from .estimates import with_error
from .exact import _FixedPasses, _sweep_scorer, variants_of

#: ``refine="auto"``: the components whose ranking it keeps exact, the tolerance (a share
#: of the largest |estimate|) when ``tol`` is not given, and how many error estimates a
#: cell's value may be off (``auto_cells``). A factor 2 leaves room for error estimates that
#: come out low (benchmarks/error_estimates.py measures how often they do).
AUTO_TOP = 10
AUTO_TOL = 0.05
AUTO_MARGIN = 2.0
#: How refine="auto" picks its cells, for its results' attrs.
AUTO_RULE = (
    "first the cells where margin * error > tol are measured; each component's margin is "
    "then raised to the largest actual / estimated error among its measured cells, and its "
    "other cells where that margin * error > tol are measured; so is every other cell of a "
    "component whose membership of the top components by |prompt-mean| is still in doubt "
    "(neither surely in nor surely out with |mean| +- the mean of margin * error over its "
    "cells not measured, measured ones exact); lenscape.capture.patching.auto_cells, "
    "calibrated_margins, ranking_cells"
)
#: ``estimate(batch)`` -> ((rows, width) gradient estimates, (rows,) bool whether the model
#: answers each clean prompt correctly, or None when the estimate does not run them).
Estimate = Callable[[Batch], tuple[torch.Tensor, "torch.Tensor | None"]]
#: ``scorer_for(cells, correct)`` -> ``_sweep_scorer``'s score of those cells.
ScorerFor = Callable[
    ["torch.Tensor | None", "torch.Tensor | None"], Callable[[Batch, Callable], Scores]
]


def _check_refine(model: LensModel, options: Options) -> None:
    """``refine`` against the number of components of ``options.level``, and ``tol`` and
    ``top``, which only refine="auto" reads."""
    refine = options.refine
    spec = model.spec
    per_layer = {"head": spec.n_heads, "block": 2, "resid": 1}[options.level]
    # By position the columns are known once the prompts are (``_refined_columns``).
    by_position = options.get("positions", "all") != "all"
    n_components = None if by_position else spec.n_layers * per_layer
    if isinstance(refine, str):
        if refine != "auto":
            raise ValueError(
                f"refine must be a positive integer, 'auto' or None, got {refine!r}; e.g. "
                "refine=10 (the 10 largest estimates) or refine='auto'."
            )
    elif refine is not None and _validate.positive_int("refine", refine) > (n_components or refine):
        raise ValueError(
            f"refine must be an integer from 1 to {n_components} (the number of "
            f"components at level={options.level!r}), got {refine!r}; None measures all."
        )
    if options.tol is not None:
        _validate.number("tol", options.tol, above=0)
    _validate.positive_int("top", options.top)
    chosen = [
        f"{name}={options.get(name)!r}"
        for name, default in (("tol", None), ("top", AUTO_TOP))
        if options.get(name) != default
    ]
    if refine != "auto" and chosen:
        raise ValueError(
            f"{', '.join(chosen)} choose(s) what refine='auto' measures exactly; with "
            f"refine={refine!r} they would change nothing. Pass refine='auto' or leave them "
            "at their defaults."
        )


def _estimates(
    inputs: Inputs, estimate: Estimate, progress: bool, desc: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """``estimate`` of every batch: (n_prompts, width) float64 in prompt-list order, and
    (n_prompts,) bool whether the model answers each clean prompt correctly (None when the
    estimate does not tell)."""
    values: torch.Tensor | None = None
    correct: torch.Tensor | None = torch.zeros(len(inputs.tokens), dtype=torch.bool)
    for batch in tqdm(inputs.batches(), total=inputs.n_batches(), disable=not progress, desc=desc):
        part, right = estimate(batch)
        if values is None:
            values = torch.full(
                (len(inputs.tokens), part.shape[1]), float("nan"), dtype=torch.float64
            )
        values[batch.index] = part.double()
        if right is None or correct is None:
            correct = None
        else:
            correct[batch.index.cpu()] = right.cpu()
    assert values is not None  # a call has at least one prompt
    return values.numpy(), None if correct is None else correct.numpy()


def _refined_columns(inputs: Inputs, estimate: Estimate, k: int, progress: bool) -> list[int]:
    """Positions (in ``variants_of(inputs)``) of the ``k`` columns (components, or
    components in a position cell) whose prompt-mean estimate is largest in absolute value,
    in column order."""
    n_components = len(variants_of(inputs))
    k = _validate.positive_int("refine", k)
    if k > n_components:
        raise ValueError(
            f"refine must be an integer from 1 to {n_components} (the number of "
            f"components at level={inputs.level!r}), got {k!r}; None measures all."
        )
    # Summed over the prompts that have a position cell (NaN: one past a prompt's end).
    total = np.nansum(_estimates(inputs, estimate, progress, "ranking components")[0], 0)
    order = np.argsort(-np.abs(total), kind="stable")
    return sorted(int(c) for c in order[:k])


def error_bounds(errors: np.ndarray, margin: float | np.ndarray = AUTO_MARGIN) -> np.ndarray:
    """How far refine="auto" lets each estimate be off: ``margin`` (a number, or one per
    component) times its error estimate; a NaN error (not computed) counts as unbounded."""
    return np.where(np.isnan(errors), np.inf, margin * np.abs(errors))


def calibrated_margins(
    estimates: np.ndarray,
    errors: np.ndarray,
    exact: np.ndarray,
    measured: np.ndarray,
    margin: float = AUTO_MARGIN,
) -> np.ndarray:
    """Each component's margin once some of its cells are measured: the larger of
    ``margin`` and the largest ratio of actual to estimated error among its measured cells.
    Where an error estimate undershot, it often undershoots on the component's other
    prompts too (the same downstream nonlinearity): of the cells beyond tol that
    ``auto_cells`` left on 24 held-out pairs of SmolLM2 and gemma3-270m (each family,
    heads and blocks), these margins catch half (70 of 140; 1-19 of 4-33 per setting),
    before the ranking stage measures more.

    Args:
        estimates, errors, exact: (prompt, component); ``exact`` read where ``measured``.
        measured: (prompt, component) bool.

    Returns:
        (component,) margins, at least ``margin``.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.abs(exact - estimates) / np.abs(errors)
    ratios = np.where(measured & np.isfinite(ratios), ratios, 0.0)
    return np.maximum(margin, ratios.max(0, initial=0.0))


def auto_cells(
    estimates: np.ndarray,
    errors: np.ndarray,
    *,
    tol: float | None = None,
    margin: float = AUTO_MARGIN,
) -> tuple[np.ndarray, float]:
    """The cells refine="auto" measures first: those whose estimate could be off by more
    than ``tol`` (margin * error > tol; a NaN error always).

    Args:
        estimates, errors: (prompt, component) the fast estimates and their error estimates.
        tol: tolerance in the estimates' units; None: ``AUTO_TOL`` times the largest
            |estimate|.

    Returns:
        ((prompt, component) bool, the tolerance used).
    """
    finite = np.abs(estimates[np.isfinite(estimates)])
    largest = float(finite.max()) if finite.size else 0.0
    tol = AUTO_TOL * largest if tol is None else float(tol)
    return error_bounds(errors, margin) > tol, tol


def ranking_cells(
    values: np.ndarray, bounds: np.ndarray, measured: np.ndarray, *, top: int = AUTO_TOP
) -> np.ndarray:
    """The cells refine="auto" measures second: the cells not yet measured of every
    component whose membership of the ``top`` components by |prompt-mean| is in doubt.

    With b the prompt-mean of the bounds of the cells not yet measured (measured ones are
    exact), a component's |mean| lies in [|mean| - b, |mean| + b]; it is surely in the top
    when fewer than ``top`` others could reach its lower end, surely out when ``top`` others
    surely exceed its upper end, and in doubt otherwise.

    Args:
        values: (prompt, component) exact where ``measured``, the estimates elsewhere.
        bounds: (prompt, component) ``error_bounds`` of the estimates.
        measured: (prompt, component) bool, the cells measured so far.
        top: how many components the ranking must get right (at most the number of them).

    Returns:
        (prompt, component) bool.
    """
    # Position cells a prompt does not have are NaN in ``values``: means over the others.
    missing = np.isnan(values)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a column no prompt has: NaN
        spread = np.nanmean(np.where(missing, np.nan, np.where(measured, 0.0, bounds)), 0)
        mean = np.abs(np.nanmean(values, 0))
    spread, mean = np.nan_to_num(spread), np.nan_to_num(mean)
    low, high = np.maximum(mean - spread, 0.0), mean + spread
    top = min(top, len(mean))
    # (component, other): whether the other could reach / surely exceeds the component.
    could_reach = high[None, :] >= low[:, None]
    np.fill_diagonal(could_reach, False)
    surely_in = could_reach.sum(1) < top
    surely_out = (low[None, :] > high[:, None]).sum(1) >= top
    in_doubt = ~(surely_in | surely_out)
    return in_doubt[None, :] & ~measured & ~missing


def _measured(
    inputs: Inputs,
    scorer_for: ScorerFor,
    cells: np.ndarray,
    correct: np.ndarray | None,
    progress: bool,
) -> np.ndarray:
    """Exact values of ``cells`` ((prompt, component) bool), NaN elsewhere: one sweep over
    the batches that hold any (``scorer_for(cells, correct)``, ``_sweep_scorer``'s score;
    ``correct`` as there)."""
    values = np.full(cells.shape, np.nan)
    if not cells.any():
        return values
    score = scorer_for(
        torch.as_tensor(cells), None if correct is None else torch.as_tensor(correct)
    )
    batches = [b for b in inputs.batches() if cells[b.index.cpu().numpy()].any()]
    for batch in tqdm(batches, disable=not progress, desc="measuring beyond tol"):
        values[batch.index.cpu().numpy()] = score(batch, lambda: None).values.double().numpy()
    return values


def _auto_refinement(
    inputs: Inputs,
    estimate: Estimate,
    scorer_for: ScorerFor,
    tol: float | None,
    top: int,
    progress: bool,
) -> dict[str, Any]:
    """The pre-pass of ``refine="auto"``: every cell's estimate and error estimate
    ((prompt, component) float32, ``estimate`` giving both side by side); the cells off by
    more than tol (``auto_cells``), measured here (``scorer_for``), and their exact values
    (NaN elsewhere); then the cells the plan's sweep measures (``cells``): those off by more
    than tol under the margins those measurements calibrate (``calibrated_margins``;
    ``beyond``) and those the ranking needs (``ranking_cells``); the tolerance used; and
    whether the model answers each clean prompt correctly, when the estimate tells (then the
    sweeps skip the full unembedding)."""
    n = len(variants_of(inputs))
    values, correct = _estimates(inputs, estimate, progress, "estimating errors")
    estimates, errors = values[:, :n], values[:, n:]
    # A position cell a prompt does not have (NaN estimate) is never measured.
    errors = np.where(np.isnan(estimates), 0.0, errors)
    first, tol_used = auto_cells(estimates, errors, tol=tol)
    exact = _measured(inputs, scorer_for, first, correct, progress)
    bounds = error_bounds(errors, calibrated_margins(estimates, errors, exact, first))
    beyond = (bounds > tol_used) & ~first
    known = np.where(first, exact, estimates)
    second = ranking_cells(known, bounds, first, top=top)
    return {
        "estimates": estimates.astype(np.float32),
        "errors": errors.astype(np.float32),
        "first": first,
        "exact": exact.astype(np.float32),
        "beyond": beyond,
        "cells": second | beyond,
        "tol": tol_used,
        "correct": correct,
    }


def _refined_cells(
    call: Call,
    inputs: Inputs,
    estimate_with: Callable[[bool], Estimate],
    scorer_for: ScorerFor,
    ranking: tuple[str, int, str],
) -> tuple[torch.Tensor | None, dict[str, Any] | None, dict[str, Any]]:
    """The cells the plan's sweep measures ((prompt, component) bool; None: all), the
    pre-pass of refine="auto" (``_auto_refinement``; None otherwise), and the attrs
    recording it; the pre-pass is kept in the plan's ``prepass``.

    Args:
        estimate_with: ``(error) -> estimate(batch)``, the gradient estimate that picks
            cells (``Estimate``): (rows, n_components), then with ``error`` (rows,
            n_components) error estimates.
        scorer_for: ``(cells, correct) -> score``, the exact sweep of those cells.
        ranking: that estimate's (estimator, steps, ``ERROR_METHODS`` name), for attrs.
    """
    options, prepass, progress = call.options, call.prepass, call.progress
    refine, (estimator, points, _) = options.refine, ranking
    n_components = len(variants_of(inputs))
    if refine is None:
        return None, None, {}
    params: dict[str, Any] = {"refine_estimator": estimator, "refine_steps": points}
    if refine != "auto":
        columns = once(
            prepass,
            "columns",
            lambda: _refined_columns(inputs, estimate_with(False), refine, progress),
        )
        cells = torch.zeros(len(inputs.tokens), n_components, dtype=torch.bool)
        cells[:, columns] = True
        return cells, None, {"refined_k": refine, **params}
    top = min(int(options.top), n_components)
    auto = once(
        prepass,
        "auto",
        lambda: _auto_refinement(
            inputs, estimate_with(True), scorer_for, options.tol, top, progress
        ),
    )
    n_first, n_second = int(auto["first"].sum()), int(auto["cells"].sum())
    n_beyond = int(auto["beyond"].sum())
    return (
        torch.as_tensor(auto["cells"]),
        auto,
        {
            "refine": "auto",
            "refine_top": top,
            "refine_tol": auto["tol"],
            "refine_margin": AUTO_MARGIN,
            "refine_measured": n_first + n_second,
            "refine_measured_for_tol": n_first + n_beyond,
            "refine_measured_for_top": n_second - n_beyond,
            "refine_cells": int(auto["cells"].size),
            "refine_rule": AUTO_RULE,
            **params,
        },
    )


def _with_estimates(finish: Callable, auto: dict[str, Any], error_name: str) -> Callable:
    """``finish`` of a refine="auto" plan: the pre-pass's exact values where it measured,
    the sweep's where the sweep did, the estimates (and their error estimates, as
    ``with_error``) elsewhere, and the coord ``measured``."""

    def finished(values, correct, index):
        rows = slice(None) if index is None else np.asarray(index, dtype=np.int64)
        first, second = auto["first"][rows], auto["cells"][rows]
        filled = np.where(
            second,
            np.asarray(values, dtype=np.float32),
            np.where(first, auto["exact"][rows], auto["estimates"][rows]),
        )
        measured = first | second
        result = with_error(
            finish(filled, correct, index),
            np.where(measured, 0.0, auto["errors"][rows]),
            error_name,
        )
        return result.assign_coords(measured=(result.dims, measured.reshape(result.shape)))

    return finished


def _exact_plan(
    call: Call,
    inputs: Inputs,
    sweep: tuple[str, Callable],
    estimate_with: Callable[[bool, _FixedPasses | None], Estimate],
    *,
    ranking: tuple[str, int, str],
    desc: str,
    method: str,
    effect: str,
    **params: Any,
) -> Plan[xr.DataArray]:
    """The plan of an exact sweep (one progress step per block), of the cells ``refine``
    picks (``_refined_cells``: ``estimate_with`` and ``ranking`` as there).

    Args:
        sweep: ``_sweep_scorer``'s (source, replacement_for).
        estimate_with: ``(error, kept) -> estimate(batch)``; with refine="auto" its passes
            may fill ``kept``, the sweeps' fixed passes (``_FixedPasses``).
    """
    source, replacement_for = sweep
    # refine="auto" sweeps twice over batches: its fixed passes are kept in a quarter of
    # the memory left (beside the plan's own share).
    kept = None
    if call.options.refine == "auto":
        kept = _FixedPasses(memory.available_bytes(inputs.model.device) // 4)

    def scorer_for(
        cells: torch.Tensor | None, correct: torch.Tensor | None
    ) -> Callable[[Batch, Callable], Scores]:
        return _sweep_scorer(
            inputs,
            source=source,
            replacement_for=replacement_for,
            variants_per_pass=call.options.variants_per_pass,
            cells=cells,
            correct=correct,
            kept=kept,
        )

    cells, auto, refined = _refined_cells(
        call, inputs, lambda error: estimate_with(error, kept), scorer_for, ranking
    )
    known = None if auto is None else auto["correct"]  # the estimate's clean pass, if it told
    score = scorer_for(cells, None if known is None else torch.as_tensor(known))
    plan = one_level_plan(
        inputs,
        score,
        desc=desc,
        method=method,
        effect=effect,
        steps_per_batch=call.model.spec.n_layers,
        prepass=call.prepass,
        **params,
        **refined,
    )
    if auto is None:
        return plan
    return dataclasses.replace(plan, finish=_with_estimates(plan.finish, auto, ranking[2]))
