"""Can I trust the fast map? Agreement of gradient estimates with exact activation patching.

Attribution patching is a first-order estimate: it is close to exact patching where the
model is nearly linear between the clean and corrupt activations and can be far off where
it is not (on GPT-2, r 0.98 for attention outputs but 0.20 for MLP outputs, RelP arXiv
2508.21258). One agreement figure over all components hides that, so ``faithfulness`` runs
exact activation patching and each estimator on the same prompts and reports agreement per
component type (heads, attention blocks, MLP blocks), with the cost of each. Each statistic
carries a percentile-bootstrap interval over prompts (``lenscape.bootstrap``: the prompts
resampled, every statistic recomputed on each resample), so a difference between estimators
can be told from the noise of a small prompt set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from .. import _validate, bootstrap, schema
from ..data import Prompts
from ..models import LensModel
from ..sweep.inputs import Tokens, tokenize
from ..sweep.options import BATCHING
from ..sweep.registry import check_part, method, part_store
from .patching import (
    DEFAULT_IG_STEPS,
    ESTIMATORS,
    PATH_ESTIMATORS,
    activation_patching,
    attribution_patching,
    parse_estimator,
    with_relevance,
)

#: The estimators a report compares when none are named: plain gradients, integrated
#: gradients, RelP with its own rules and with the secant rules over the first 90% of each
#: operation's change, the best on MLP blocks (benchmarks/RESULTS.md, section faithfulness,
#: measures each).
DEFAULT_ESTIMATORS = ("atp", "ig", "relp", "relp:secant-0.9")
#: Component types compared: per-head outputs, attention blocks, MLP blocks.
COMPONENT_TYPES = ("head", "attn", "mlp")
#: Why a statistic can be NaN, recorded in the report's attrs: undefined, never perfect.
UNDEFINED = {
    "top_overlap": "NaN where top_k >= the number of components of the type: the top k "
    "would be every component, so the overlap would be 1.0 whatever the estimate",
    "correlation": "NaN where the exact or the estimated map is constant over the cells "
    "compared (or fewer than 2 cells): a correlation is undefined",
    "sign_agreement": "NaN where every exact effect is 0: no sign to agree with",
}
#: Resamples and seed of the statistics' intervals (``agreement_bounds``).
INTERVAL_RESAMPLES = bootstrap.DEFAULT_RESAMPLES
INTERVAL_SEED = 0


def _rows(exact: xr.DataArray, estimate: xr.DataArray) -> tuple[np.ndarray, np.ndarray]:
    """The two maps as float64 (prompt, cells), prompts in label order and the estimate's
    cells matched to the exact map's by label.

    Raises:
        ValueError: labels that differ between the two maps (named).
    """
    if "prompt" in exact.indexes:
        exact = exact.isel(prompt=np.argsort(exact.indexes["prompt"].to_numpy(), kind="stable"))
    exact = exact.transpose("prompt", ...)
    labels = {str(d): exact.indexes[d].to_numpy() for d in exact.dims if d in exact.indexes}
    matched = _validate.labels("estimate", estimate, labels, made_by="the same prompts")
    estimate = matched.transpose(*exact.dims)
    n = exact.sizes["prompt"]
    return (
        exact.values.astype(np.float64).reshape(n, -1),
        np.asarray(estimate.values, dtype=np.float64).reshape(n, -1),
    )


def _statistics_of(x: np.ndarray, y: np.ndarray, top_k: int) -> dict[str, np.ndarray]:
    """Every statistic of ``agreement`` for a stack of map pairs at once.

    Args:
        x, y: (samples, prompt, cells): the exact and estimated maps of each sample (the
            data itself, or one bootstrap resample of its prompts per row).

    Returns:
        Per statistic, (samples,).
    """
    samples = x.shape[0]
    finite = np.isfinite(x) & np.isfinite(y)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_x, mean_y = (np.where(finite, m, 0.0).sum(1) / finite.sum(1) for m in (x, y))
    cells = x.reshape(samples, -1), y.reshape(samples, -1)
    nonzero = finite & (x != 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        signs = (nonzero & (np.sign(x) == np.sign(y))).sum((1, 2)) / nonzero.sum((1, 2))
    return {
        "pearson_cells": bootstrap.pearson(*cells),
        "spearman_cells": bootstrap.spearman(*cells),
        "pearson_means": bootstrap.pearson(mean_x, mean_y),
        "spearman_means": bootstrap.spearman(mean_x, mean_y),
        "top_overlap": bootstrap.top_overlap(mean_x, mean_y, top_k),
        "sign_agreement": np.where(nonzero.any((1, 2)), signs, np.nan),
    }


def agreement(exact: xr.DataArray, estimate: xr.DataArray, *, top_k: int = 10) -> dict[str, float]:
    """Agreement of ``estimate`` with ``exact``, both with a ``prompt`` dim and the same
    labels (read by label, in any order or transpose).

    Returns:
        ``pearson_cells``/``spearman_cells``: correlation over every (prompt, component)
        cell; ``pearson_means``/``spearman_means``: over prompt-mean components;
        ``top_overlap``: share of the exact top-k components (by |prompt mean|) that are in
        the estimate's top-k, NaN when ``top_k`` is not below the number of components
        (every component would be in both sets); ``sign_agreement``: share of cells with a
        nonzero exact effect whose estimate has the same sign. Cells NaN (not computed) in
        either map are left out. NaN means undefined (``UNDEFINED`` says when), never a
        perfect score.
    """
    top_k = _validate.positive_int("top_k", top_k)
    x, y = _rows(exact, estimate)
    return {stat: float(v[0]) for stat, v in _statistics_of(x[None], y[None], top_k).items()}


def agreement_bounds(
    exact: xr.DataArray,
    estimate: xr.DataArray,
    *,
    top_k: int = 10,
    ci: float = 0.95,
    n_resamples: int = INTERVAL_RESAMPLES,
    seed: int = INTERVAL_SEED,
) -> dict[str, tuple[float, float]]:
    """The percentile-bootstrap interval over prompts of each statistic of ``agreement``:
    the prompts resampled with replacement ``n_resamples`` times (one seeded draw over the
    prompts in label order), every statistic recomputed on each resample (in blocks of at
    most ``bootstrap.BLOCK_VALUES`` numbers), the middle ``ci`` of its values.

    Returns:
        Per statistic, ``(low, high)``; NaN where the statistic itself is undefined or
        there is only one prompt (a bootstrap of one prompt has no spread).

    Raises:
        TypeError, ValueError: an option of the wrong type or out of range (named).
    """
    top_k = _validate.positive_int("top_k", top_k)
    ci, n_resamples, seed = bootstrap.check(ci, n_resamples, seed)
    x, y = _rows(exact, estimate)
    point = _statistics_of(x[None], y[None], top_k)
    drawn = bootstrap.draw(x.shape[0], n_resamples=n_resamples, seed=seed)
    step = max(1, bootstrap.BLOCK_VALUES // x.size)
    parts = [
        _statistics_of(x[d], y[d], top_k) for d in np.split(drawn, range(step, len(drawn), step))
    ]
    bounds = {}
    for stat, value in point.items():
        low, high = bootstrap.percentiles(np.concatenate([p[stat] for p in parts]), ci)
        defined = np.isfinite(value[0]) and x.shape[0] > 1
        bounds[stat] = (float(low), float(high)) if defined else (np.nan, np.nan)
    return bounds


def _by_type(heads: xr.DataArray, blocks: xr.DataArray) -> dict[str, xr.DataArray]:
    return {
        "head": heads,
        "attn": blocks.sel(component="attn", drop=True),
        "mlp": blocks.sel(component="mlp", drop=True),
    }


def _timed(
    method: Callable[..., Any], model: LensModel, tokens: Tokens, path: Path | None, **options
) -> tuple[Any, float]:
    """``method(model, tokens, store=path, **options)``, loaded, and its seconds; NaN seconds
    when it resumed a store that existed (only part of its work was timed)."""
    resumed = path is not None and path.exists()
    start = time.perf_counter()
    result = method(model, tokens, store=path, **options).load()
    return result, float("nan") if resumed else time.perf_counter() - start


def _exact_maps(
    model: LensModel, tokens: Tokens, options: dict[str, Any], store: Any
) -> tuple[dict[str, xr.DataArray], dict[str, float]]:
    """Exact activation patching at head and block level: the maps and their seconds."""
    maps, seconds = {}, {}
    for level in ("head", "block"):
        path = part_store(store, f"exact_{level}")
        maps[level], seconds[level] = _timed(
            activation_patching, model, tokens, path, level=level, **options
        )
    return maps, seconds


def _estimates(
    model: LensModel,
    tokens: Tokens,
    parsed: dict[str, tuple[str, int, str | None]],
    shared: dict[str, Any],
    store: Any,
) -> tuple[dict[str, xr.Dataset], dict[str, float]]:
    """Each estimator's ``attribution_patching(level="all")`` (its own part of ``store``)
    and its seconds."""
    estimates, seconds = {}, {}
    for label, (name, steps, rules) in parsed.items():
        path = part_store(store, label.replace(":", "-"))
        estimates[label], seconds[label] = _timed(
            attribution_patching,
            model,
            tokens,
            path,
            level="all",
            estimator=name,
            steps=steps,
            rules=rules,
            **shared,
        )
    return estimates, seconds


def _parsed(estimators: Any) -> dict[str, tuple[str, int, str | None]]:
    """Label -> (estimator, steps, rules); labels name the step count and the rules ("ig"
    -> "ig:2", "relp" -> "relp:relp"), so a report says what it measured."""
    estimators = _validate.strings("estimators", estimators, example="('atp', 'ig:8')")
    parsed = {}
    for given in estimators:
        name, steps, rules = parse_estimator(
            given, estimators=ESTIMATORS, paths=PATH_ESTIMATORS, default=DEFAULT_IG_STEPS
        )
        label = f"{name}:{rules or steps}" if name in (*PATH_ESTIMATORS, "relp") else name
        parsed[label] = (name, steps, rules)
    return parsed


def agreement_variables(
    pairs: Mapping[tuple[str, str], tuple[xr.DataArray, xr.DataArray]],
    dims: tuple[str, str],
    *,
    top_k: int,
    ci: float,
    seed: int = INTERVAL_SEED,
) -> dict[str, Any]:
    """A report's agreement variables: each statistic of ``agreement`` and its interval
    (``agreement_bounds``) for every pair of maps compared.

    Args:
        pairs: (estimator, kind) -> (exact, estimate) maps, every combination of the labels
            of ``dims``, in row order (the first label's kinds, then the next's).
        dims: the names of the two label dims, e.g. ("estimator", "component_type").
        top_k, ci, seed: as ``agreement_bounds`` takes them.

    Returns:
        Per statistic, ``dims`` values with the ``undefined`` note, and ``<statistic>_interval``
        (``dims`` + ``bound``: low, high) with the attrs that say how it was made.
    """
    shape = tuple(len(dict.fromkeys(key[i] for key in pairs)) for i in (0, 1))
    points: dict[str, list[float]] = {}
    bounds: dict[str, list[tuple[float, float]]] = {}
    for exact, estimate in pairs.values():
        for stat, point in agreement(exact, estimate, top_k=top_k).items():
            points.setdefault(stat, []).append(point)
        for stat, pair in agreement_bounds(exact, estimate, top_k=top_k, ci=ci, seed=seed).items():
            bounds.setdefault(stat, []).append(pair)
    made = bootstrap.attrs("prompt", ci, INTERVAL_RESAMPLES, seed)
    variables: dict[str, Any] = {}
    for stat, values in points.items():
        undefined = UNDEFINED[stat if stat in ("top_overlap", "sign_agreement") else "correlation"]
        variables[stat] = (dims, np.reshape(values, shape), {"undefined": undefined})
        variables[f"{stat}_interval"] = (
            (*dims, "bound"),
            np.reshape(bounds[stat], (*shape, 2)),
            {
                "long_name": f"{bootstrap.percent(ci)} interval of {stat}",
                **made,
                "undefined": undefined,
            },
        )
    return variables


def _check_parts(
    model: LensModel, parsed: dict[str, tuple[str, int, str | None]], shared: dict[str, Any]
) -> None:
    """Every part's options checked (``registry.check_part``) before the first part runs:
    exact patching at both levels and each estimator's ``attribution_patching``."""
    for level in ("head", "block"):
        check_part(activation_patching, model, level=level, **shared)
    for name, steps, rules in parsed.values():
        check_part(
            attribution_patching,
            model,
            level="all",
            estimator=name,
            steps=steps,
            rules=rules,
            **shared,
        )


def _costs(
    parsed: dict[str, tuple[str, int, str | None]],
    seconds: dict[str, float],
    exact_seconds: float,
) -> dict[str, Any]:
    """(estimator,) cost variables: seconds, passes per batch and the ratios."""
    labels = list(parsed)
    times = np.asarray([seconds[label] for label in labels])
    steps = np.asarray([parsed[label][1] for label in labels])
    # "trapezoid" takes the gradient at its clean pass too.
    clean_backward = np.asarray([parsed[label][0] == "trapezoid" for label in labels], int)
    return {
        "seconds": (("estimator",), times),
        "forward_passes": (("estimator",), 1 + steps),  # one clean pass, one per path point
        "backward_passes": (("estimator",), steps + clean_backward),
        "cost_vs_atp": (
            ("estimator",),
            times / times[labels.index("atp")] if "atp" in labels else np.full(len(labels), np.nan),
        ),
        "speedup_vs_exact": (("estimator",), exact_seconds / times),
    }


@method(
    None,
    needs_corrupt=True,
    shared=(*BATCHING, "positions"),
    store="a folder: one .zarr store per part",
)
def faithfulness(
    model: LensModel,
    prompts: Prompts,
    *,
    estimators: Sequence[str] | None = None,
    top_k: int = 10,
    ci: float = 0.95,
    **shared,
) -> xr.Dataset:
    """Agreement of each estimator with exact activation patching, per component type.

    Runs exact activation patching at head and block level and ``attribution_patching``
    (level "all") with each estimator, on the same prompts (tokenised once) and metric.
    With ``positions`` "each" or "spans" both are resolved by position and the statistics
    compare (component, position) cells (cells a prompt lacks are left out).

    Args:
        prompts: clean/corrupt pairs (e.g. ``lsc.data.prompts("factual")`` or ``("ioi")``).
        estimators: labels of ``lsc.attribution_patching`` estimators: "atp", "ig"
            (``DEFAULT_IG_STEPS`` steps) or "ig:N", "relp" (RelP's rules) or "relp:RULES"
            (e.g. "relp:secant"), "trapezoid" (AtP plus its trapezoid correction, one
            backward pass more); the report labels them "atp", "ig:N", "relp:RULES" and
            "trapezoid".
            None: ``DEFAULT_ESTIMATORS`` ("atp", "ig", "relp", "relp:secant-0.9"), less the
            "relp" ones on a model the relevance rules do not support.
        top_k: size of the top sets compared by ``top_overlap``; a type with ``top_k`` or
            fewer components gets NaN there (the overlap would be 1.0 for any estimate).
        ci: the share of the bootstrap resamples between each statistic's bounds (a
            percentile bootstrap over prompts, ``INTERVAL_RESAMPLES`` resamples).
        store: a folder: each part (exact patching per level, each estimator) streams into
            its own ``.zarr`` store there and an interrupted run resumes; a part resumed
            from a store is not timed (its ``seconds`` are NaN).

    Returns:
        Dataset with
        - (estimator, component_type): ``pearson_cells``, ``spearman_cells``,
          ``pearson_means``, ``spearman_means``, ``top_overlap``, ``sign_agreement`` (NaN
          where undefined; each variable's ``undefined`` attr says when);
        - (estimator, component_type, bound): each statistic's interval,
          ``<statistic>_interval`` with ``bound`` = ("low", "high") (NaN where the
          statistic is undefined or there is one prompt; attrs ``interval``, ``ci``,
          ``n_resamples``, ``interval_seed``);
        - (component_type,): ``n_components`` and ``top_k_used`` (the k of
          ``top_overlap``, NaN where it is undefined);
        - (estimator,): ``seconds``, ``forward_passes`` and ``backward_passes`` per batch,
          ``cost_vs_atp`` (seconds / the "atp" estimator's seconds, NaN without it),
          ``speedup_vs_exact`` (exact head + block seconds / seconds);
        - the maps compared: ``exact_heads`` (prompt, layer, head), ``estimate_heads``
          (estimator, prompt, layer, head), ``exact_blocks`` (prompt, layer, component),
          ``estimate_blocks`` (estimator, prompt, layer, component);
        - attrs: model, metric, prompt set and fingerprint, backend, top_k, exact seconds.
    """
    if estimators is None:
        estimators = with_relevance(DEFAULT_ESTIMATORS, model)
    parsed = _parsed(estimators)
    top_k = _validate.positive_int("top_k", top_k)
    ci = bootstrap.check_ci(ci)
    store, metric = shared.pop("store"), shared["metric"]
    _check_parts(model, parsed, shared)
    tokens = tokenize(model, prompts, needs_corrupt=True, needs_distractor=metric == "logit_diff")
    exact, exact_seconds = _exact_maps(model, tokens, shared, store)
    estimates, seconds = _estimates(model, tokens, parsed, shared, store)
    exact_types = _by_type(exact["head"], exact["block"])
    pairs = {
        (label, ctype): (exact_types[ctype], estimate_type)
        for label, estimate in estimates.items()
        for ctype, estimate_type in _by_type(estimate["heads"], estimate["blocks"]).items()
    }
    data = agreement_variables(pairs, ("estimator", "component_type"), top_k=top_k, ci=ci)
    sizes = np.array(
        [m.isel(prompt=0).size for m in _by_type(exact["head"], exact["block"]).values()]
    )
    data["n_components"] = (("component_type",), sizes)
    data["top_k_used"] = (
        ("component_type",),
        np.where(top_k < sizes, float(top_k), np.nan),
        {"undefined": UNDEFINED["top_overlap"]},
    )
    data |= _costs(parsed, seconds, sum(exact_seconds.values()))
    data["exact_heads"], data["exact_blocks"] = exact["head"], exact["block"]
    for level, variable in (("heads", "estimate_heads"), ("blocks", "estimate_blocks")):
        data[variable] = xr.concat(
            [e[level] for e in estimates.values()], dim="estimator", combine_attrs="drop_conflicts"
        )
    return xr.Dataset(
        data,
        coords={
            "estimator": list(parsed),
            "component_type": list(COMPONENT_TYPES),
            "bound": ["low", "high"],
        },
        attrs=_report_attrs(exact["head"], shared=shared, top_k=top_k, exact_seconds=exact_seconds),
    )


def _report_attrs(
    first: xr.DataArray, *, shared: dict[str, Any], top_k: int, exact_seconds: dict
) -> dict[str, Any]:
    """The report's attrs: what was measured on what, from the first exact map's."""
    keep = (
        "model",
        "layout_fingerprint",
        "weights_fingerprint",
        "layout_checked",
        "dtype",
        "prompt_set",
        "n_prompts",
        "prompts_sha256",
        "lenscape_version",
    )
    return {
        "long_name": "Agreement of gradient estimates with exact activation patching",
        "method": "faithfulness",
        "metric": shared["metric"],
        "backend": shared["backend"],
        "top_k": top_k,
        "exact_seconds_head": exact_seconds["head"],
        "exact_seconds_block": exact_seconds["block"],
        "schema_version": schema.SCHEMA_VERSION,
        **{key: first.attrs[key] for key in keep},
    }
