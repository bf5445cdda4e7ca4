"""Can I trust the fast map? Agreement of gradient estimates with exact activation patching.

Attribution patching is a first-order estimate: it is close to exact patching where the
model is nearly linear between the clean and corrupt activations and can be far off where
it is not (on GPT-2, r 0.98 for attention outputs but 0.20 for MLP outputs, RelP arXiv
2508.21258). One agreement figure over all components hides that, so ``faithfulness`` runs
exact activation patching and each estimator on the same prompts and reports agreement per
component type (heads, attention blocks, MLP blocks), with the cost of each.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from .. import _validate, schema
from ..data import Prompts
from ..models import LensModel
from ..sweep.options import DEFAULTS
from .patching import (
    DEFAULT_IG_STEPS,
    ESTIMATORS,
    MAX_IG_STEPS,
    activation_patching,
    attribution_patching,
)

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


def parse_estimator(label: str) -> tuple[str, int]:
    """``"atp"`` -> ("atp", 1); ``"ig"`` -> ("ig", DEFAULT_IG_STEPS); ``"ig:16"`` -> ("ig", 16)."""
    name, _, steps = str(label).partition(":")
    if name not in ESTIMATORS or (steps and not steps.isdigit()) or (name == "atp" and steps):
        raise ValueError(
            f"Unknown estimator {label!r}; use 'atp', 'ig' or 'ig:N' (N integration steps)."
        )
    if not steps:
        return name, 1 if name == "atp" else DEFAULT_IG_STEPS
    if not 1 <= int(steps) <= MAX_IG_STEPS:
        raise ValueError(
            f"Estimator {label!r}: steps={int(steps)} must lie in 1..{MAX_IG_STEPS} "
            "(each step is a forward and a backward pass per batch), e.g. 'ig:8'."
        )
    return name, int(steps)


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    if a.size < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    return _pearson(
        pd.Series(np.ravel(a)).rank().to_numpy(), pd.Series(np.ravel(b)).rank().to_numpy()
    )


def _top(values: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-np.abs(np.ravel(values)), kind="stable")[:k].tolist())


def agreement(exact: xr.DataArray, estimate: xr.DataArray, *, top_k: int = 10) -> dict[str, float]:
    """Agreement of ``estimate`` with ``exact``, both with a ``prompt`` dim and the same shape.

    Returns:
        ``pearson_cells``/``spearman_cells``: correlation over every (prompt, component)
        cell; ``pearson_means``/``spearman_means``: over prompt-mean components;
        ``top_overlap``: share of the exact top-k components (by |prompt mean|) that are in
        the estimate's top-k, NaN when ``top_k`` is not below the number of components
        (every component would be in both sets); ``sign_agreement``: share of cells with a
        nonzero exact effect whose estimate has the same sign. NaN means undefined
        (``UNDEFINED`` says when), never a perfect score.
    """
    top_k = _validate.positive_int("top_k", top_k)
    exact, estimate = xr.align(exact, estimate, join="exact")
    x, y = exact.values, estimate.values
    x_mean, y_mean = exact.mean("prompt").values, estimate.mean("prompt").values
    nonzero = x != 0
    return {
        "pearson_cells": _pearson(x, y),
        "spearman_cells": _spearman(x, y),
        "pearson_means": _pearson(x_mean, y_mean),
        "spearman_means": _spearman(x_mean, y_mean),
        "top_overlap": len(_top(x_mean, top_k) & _top(y_mean, top_k)) / top_k
        if top_k < x_mean.size
        else float("nan"),
        "sign_agreement": float((np.sign(x[nonzero]) == np.sign(y[nonzero])).mean())
        if nonzero.any()
        else float("nan"),
    }


def _by_type(heads: xr.DataArray, blocks: xr.DataArray) -> dict[str, xr.DataArray]:
    return {
        "head": heads,
        "attn": blocks.sel(component="attn", drop=True),
        "mlp": blocks.sel(component="mlp", drop=True),
    }


def faithfulness(
    model: LensModel,
    prompts: Prompts,
    *,
    estimators: Sequence[str] = ("atp", "ig"),
    metric: str = DEFAULTS.metric,
    batch_size: int | None = DEFAULTS.batch_size,
    backend: str = DEFAULTS.backend,
    top_k: int = 10,
    progress: bool = DEFAULTS.progress,
) -> xr.Dataset:
    """Agreement of each estimator with exact activation patching, per component type.

    Runs exact activation patching at head and block level and ``attribution_patching``
    (level "all") with each estimator, on the same prompts and metric.

    Args:
        model: a ``LensModel``.
        prompts: clean/corrupt pairs (e.g. ``lsc.data.prompts("factual")`` or ``("ioi")``).
        estimators: "atp", "ig" (``DEFAULT_IG_STEPS`` steps) or "ig:N"; the report labels
            them "atp" and "ig:N".
        top_k: size of the top sets compared by ``top_overlap``; a type with ``top_k`` or
            fewer components gets NaN there (the overlap would be 1.0 for any estimate).
        metric, batch_size, backend, progress: as in ``lsc.activation_patching``.

    Returns:
        Dataset with
        - (estimator, component_type): ``pearson_cells``, ``spearman_cells``,
          ``pearson_means``, ``spearman_means``, ``top_overlap``, ``sign_agreement`` (NaN
          where undefined; each variable's ``undefined`` attr says when);
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
    estimators = _validate.strings("estimators", estimators, example="('atp', 'ig:8')")
    top_k = _validate.positive_int("top_k", top_k)
    progress = _validate.flag("progress", progress)
    # Labels name the step count ("ig" -> "ig:2"), so a report says what it measured.
    parsed = {}
    for given in estimators:
        name, steps = parse_estimator(given)
        parsed[name if name == "atp" else f"{name}:{steps}"] = (name, steps)
    labels = list(parsed)
    options: dict[str, Any] = dict(
        metric=metric, batch_size=batch_size, backend=backend, progress=progress
    )

    exact, exact_seconds = {}, {}
    for level in ("head", "block"):
        start = time.perf_counter()
        exact[level] = activation_patching(model, prompts, level=level, **options)
        exact_seconds[level] = time.perf_counter() - start
    exact_types = _by_type(exact["head"], exact["block"])

    stats: dict[str, list[float]] = {}  # stat -> one value per (estimator, component type)
    costs: dict[str, list[float]] = {"seconds": [], "forward_passes": [], "backward_passes": []}
    head_maps, block_maps = [], []
    for label in labels:
        name, steps = parsed[label]
        start = time.perf_counter()
        estimate = attribution_patching(
            model, prompts, level="all", estimator=name, steps=steps, **options
        )
        costs["seconds"].append(time.perf_counter() - start)
        costs["forward_passes"].append(1 + steps)  # one clean pass, one per path point
        costs["backward_passes"].append(steps)
        head_maps.append(estimate["heads"])
        block_maps.append(estimate["blocks"])
        for ctype, estimate_type in _by_type(estimate["heads"], estimate["blocks"]).items():
            for stat, value in agreement(exact_types[ctype], estimate_type, top_k=top_k).items():
                stats.setdefault(stat, []).append(value)
    # stats[stat] is estimator-major: [e0/head, e0/attn, e0/mlp, e1/head, ...]
    data: dict[str, Any] = {
        stat: (
            ("estimator", "component_type"),
            np.asarray(values).reshape(len(labels), len(COMPONENT_TYPES)),
            {
                "undefined": UNDEFINED[
                    stat if stat in ("top_overlap", "sign_agreement") else "correlation"
                ]
            },
        )
        for stat, values in stats.items()
    }
    sizes = np.array([exact_types[ctype].isel(prompt=0).size for ctype in COMPONENT_TYPES])
    data["n_components"] = (("component_type",), sizes)
    data["top_k_used"] = (
        ("component_type",),
        np.where(top_k < sizes, float(top_k), np.nan),
        {"undefined": UNDEFINED["top_overlap"]},
    )
    data.update({cost: (("estimator",), np.asarray(values)) for cost, values in costs.items()})
    seconds = np.asarray(costs["seconds"])
    data["cost_vs_atp"] = (
        ("estimator",),
        seconds / seconds[labels.index("atp")] if "atp" in labels else np.full(len(labels), np.nan),
    )
    data["speedup_vs_exact"] = (("estimator",), sum(exact_seconds.values()) / seconds)
    data["exact_heads"], data["exact_blocks"] = exact["head"], exact["block"]
    data["estimate_heads"] = xr.concat(head_maps, dim="estimator", combine_attrs="drop_conflicts")
    data["estimate_blocks"] = xr.concat(block_maps, dim="estimator", combine_attrs="drop_conflicts")
    first = exact["head"]
    return xr.Dataset(
        data,
        coords={"estimator": labels, "component_type": list(COMPONENT_TYPES)},
        attrs={
            "long_name": "Agreement of gradient estimates with exact activation patching",
            "method": "faithfulness",
            "metric": metric,
            "model": first.attrs["model"],
            "layout_fingerprint": first.attrs["layout_fingerprint"],
            "layout_checked": first.attrs["layout_checked"],
            "backend": backend,
            "dtype": first.attrs["dtype"],
            "prompt_set": first.attrs["prompt_set"],
            "n_prompts": first.attrs["n_prompts"],
            "prompts_sha256": first.attrs["prompts_sha256"],
            "top_k": top_k,
            "exact_seconds_head": exact_seconds["head"],
            "exact_seconds_block": exact_seconds["block"],
            "lenscape_version": first.attrs["lenscape_version"],
            "schema_version": schema.SCHEMA_VERSION,
        },
    )
