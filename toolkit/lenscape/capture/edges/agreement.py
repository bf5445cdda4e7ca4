"""How far to trust edge scores: each estimator against exact single-edge patching.

A composite method: it runs ``edge_attribution`` per estimator and ``_edge_variants`` (each
sampled edge patched alone) on the same tokenised prompts; with ``store=`` each part keeps
its own resumable store in that folder. Each statistic carries a percentile-bootstrap
interval over prompts, as the faithfulness report's do
(``capture.faithfulness.agreement_variables``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from ... import _validate, bootstrap
from ...data import Prompts
from ...models import LensModel
from ...schema import RECEIVER_KINDS
from ...sweep.inputs import Tokens, tokenize
from ...sweep.options import BATCHING
from ...sweep.registry import check_part, method, part_store
from ..faithfulness import agreement_variables
from ..patching import parse_estimator, with_relevance
from .graph import Graph, SpanGraph, span_graph_of
from .patching import _edge_variants
from .scores import DEFAULT_IG_STEPS, ESTIMATORS, PATH_ESTIMATORS, edge_attribution

#: The estimators compared when none are named (RelP under the secant rules over the first
#: 90% of each change, which agreed with exact edge patching better than the full secant on
#: SmolLM2's q, k and MLP receivers: benchmarks/RESULTS.md, section edges).
DEFAULT_ESTIMATORS = ("eap", "eap-ig", "relp", "relp:secant-0.9")
#: Most edges sampled per kind of draw: each is one forward pass per batch.
MAX_SAMPLE = 2000


def _sample_edges(
    graph: Graph | SpanGraph, scores: list[xr.DataArray], n_top: int, n_random: int, seed: int
) -> np.ndarray:
    """Flat indices (in ``graph``'s grid, increasing) of the edges to patch: the ``n_top``
    of each of ``scores`` (prompt, sender, receiver; aligned to ``graph``) by |prompt-mean
    score| and ``n_random`` real edges drawn from ``seed``, each once."""
    valid = np.flatnonzero(graph.valid)
    chosen: set[int] = set()
    for result in scores:
        magnitude = np.abs(np.nan_to_num(result.mean("prompt").values)).ravel()
        chosen |= set(np.argsort(-magnitude[valid], kind="stable")[:n_top].tolist())
    rng = np.random.default_rng(seed)
    chosen |= set(rng.choice(len(valid), size=min(n_random, len(valid)), replace=False).tolist())
    return valid[sorted(chosen)]


def _parts(estimators: list[str], steps: int) -> dict[str, tuple[str, int, str | None]]:
    """Estimator label ("eap", "eap-ig", "relp:secant" ...: ``patching.parse_estimator``;
    "eap-ig" without its steps takes ``steps``) -> (estimator, steps, rules)."""
    return {
        label: parse_estimator(label, estimators=ESTIMATORS, paths=PATH_ESTIMATORS, default=steps)
        for label in estimators
    }


def _scores(
    model: LensModel,
    tokens: Tokens,
    parts: dict[str, tuple[str, int, str | None]],
    store: str | Path | None,
    shared: dict[str, Any],
) -> dict[str, xr.DataArray]:
    """Per-prompt edge scores of each estimator (``_parts``), each in its own part of
    ``store``."""
    return {
        label: edge_attribution(
            model,
            tokens,
            estimator=name,
            steps=points,
            rules=rules,
            per_prompt=True,
            store=part_store(store, label.replace(":", "-")),
            **shared,
        ).load()
        for label, (name, points, rules) in parts.items()
    }


def _compared_maps(
    graph: Graph | SpanGraph,
    edges: np.ndarray,
    effects: np.ndarray,
    scores: dict[str, xr.DataArray],
) -> tuple[xr.DataArray, xr.DataArray]:
    """The sampled edges' exact ``effects`` (prompt, edge) and each estimator's ``scores``
    of them (estimator, prompt, edge), with ``sender``, ``receiver`` and ``receiver_kind``
    coords on ``edge`` (and ``span`` by span)."""
    *spans, senders, receivers = np.unravel_index(edges, graph.shape)
    edge_coords = {
        "sender": ("edge", np.asarray(graph.sender_labels)[senders]),
        "receiver": ("edge", np.asarray(graph.receiver_labels)[receivers]),
        "receiver_kind": ("edge", np.asarray([graph.receivers[r][0] for r in receivers])),
    }
    if isinstance(graph, SpanGraph):
        edge_coords["span"] = ("edge", np.asarray(graph.spans)[spans[0]])
    exact = xr.DataArray(effects, dims=("prompt", "edge"), coords=edge_coords)
    estimate = xr.concat(
        [
            xr.DataArray(
                result.values.reshape(result.sizes["prompt"], -1)[:, edges].astype(np.float64),
                dims=("prompt", "edge"),
            )
            for result in scores.values()
        ],
        dim="estimator",
    ).assign_coords({**edge_coords, "estimator": list(scores)})
    return exact, estimate


def _checked(
    estimators: Any, steps: Any, n_top: Any, n_random: Any, top_k: Any, seed: Any, ci: Any
) -> tuple[list[str], int, int, int, int, int, float]:
    """``edge_agreement``'s own options, checked.

    Raises:
        TypeError, ValueError: as ``edge_agreement`` says.
    """
    estimators = _validate.strings("estimators", estimators, example="('eap', 'relp:secant')")
    for label in estimators:
        parse_estimator(label, estimators=ESTIMATORS, paths=PATH_ESTIMATORS, default=1)
    if len(set(estimators)) < len(estimators):
        raise ValueError(f"estimators names one twice: {estimators}; name each once.")
    n_top = _validate.integer("n_top", n_top, low=0, high=MAX_SAMPLE)
    n_random = _validate.integer("n_random", n_random, low=0, high=MAX_SAMPLE)
    if n_top == 0 and n_random == 0:
        raise ValueError("n_top=0 and n_random=0 sample no edge; sample at least one.")
    return (
        estimators,
        _validate.positive_int("steps", steps),
        n_top,
        n_random,
        _validate.positive_int("top_k", top_k),
        _validate.seed("seed", seed),
        bootstrap.check_ci(ci),
    )


@method(
    None,
    needs_corrupt=True,
    store="a folder: one .zarr store per part",
    shared=(*BATCHING, "positions"),
)
def edge_agreement(
    model: LensModel,
    prompts: Prompts,
    *,
    estimators: Sequence[str] | None = None,
    steps: int = DEFAULT_IG_STEPS,
    n_top: int = 20,
    n_random: int = 20,
    top_k: int = 5,
    seed: int = 0,
    ci: float = 0.95,
    **shared,
) -> xr.Dataset:
    """How far to trust edge scores: each estimator vs exact single-edge patching.

    The sample: each estimator's ``n_top`` edges by |prompt-mean score| and ``n_random``
    valid edges drawn at random. Each is patched alone, exactly (the corrupt run with that
    one receiver reading its sender from the clean run; effect = m(patched) - m(corrupt),
    the quantity EAP estimates), and compared per receiver kind with the statistics of
    ``lsc.faithfulness`` (``capture.faithfulness.agreement``).

    Args:
        estimators: labels of ``lsc.edge_attribution`` estimators: "eap", "eap-ig" (with
            ``steps`` points) or "eap-ig:N", "relp" (RelP's rules) or "relp:RULES" (e.g.
            "relp:secant"). None: ``DEFAULT_ESTIMATORS``, less the "relp" ones on a model
            the relevance rules do not support.
        n_top, n_random: edges sampled from the top of each estimator and at random (each
            at most ``MAX_SAMPLE``).
        top_k: size of the top sets compared per receiver kind (NaN where a kind has
            ``top_k`` sampled edges or fewer).
        seed: seeds the random sample and the bootstrap of the intervals.
        ci: the share of the bootstrap resamples between each statistic's bounds (a
            percentile bootstrap over prompts).
        positions: "all", or "spans": edges between (component, span) nodes, each
            sampled edge patched alone at its span (a k or v receiver for its query span's
            queries only) against the estimators by span (``edge_attribution``).
        store: a folder: each part (the scores of each estimator, the single-edge effects)
            streams into its own ``.zarr`` store there, and an interrupted run resumes.

    Returns:
        Dataset with (estimator, receiver_kind) ``pearson_cells``, ``spearman_cells``,
        ``pearson_means``, ``spearman_means``, ``top_overlap``, ``sign_agreement``; each
        one's interval ``<statistic>_interval`` (estimator, receiver_kind, bound: low,
        high);
        (receiver_kind,) ``n_edges`` sampled; and the maps compared: ``exact``
        (prompt, edge) and ``estimate`` (estimator, prompt, edge), with ``sender`` and
        ``receiver`` coords on ``edge``.

    Raises:
        TypeError: estimators that are not a list of strings, counts or a seed that are
            not integers.
        ValueError: an unknown or repeated estimator, ``steps`` or ``top_k`` below 1, a
            negative count or seed, ``n_top=0`` with ``n_random=0`` (no edge sampled).
    """
    if estimators is None:
        estimators = with_relevance(DEFAULT_ESTIMATORS, model)
    estimators, steps, n_top, n_random, top_k, seed, ci = _checked(
        estimators, steps, n_top, n_random, top_k, seed, ci
    )
    store = shared.pop("store")
    parts = _parts(estimators, steps)
    for name, points, rules in parts.values():  # every part's options, before any runs
        check_part(edge_attribution, model, estimator=name, steps=points, rules=rules, **shared)
    check_part(_edge_variants, model, variants=(), base="corrupt", **shared)
    tokens = tokenize(
        model, prompts, needs_corrupt=True, needs_distractor=shared["metric"] == "logit_diff"
    )
    scores = _scores(model, tokens, parts, store, shared)
    graph: Graph | SpanGraph = Graph.of(model)
    if shared.get("positions") == "spans" and tokens.span_names is not None:
        graph = span_graph_of(Graph.of(model), tokens.span_names)
    edges = _sample_edges(graph, list(scores.values()), n_top, n_random, seed)
    effects = _edge_variants(
        model,
        tokens,
        variants=tuple(("only", (int(edge),)) for edge in edges),
        base="corrupt",
        store=part_store(store, "single_edges"),
        **shared,
    )
    exact, estimate = _compared_maps(
        graph,
        edges,
        (effects["patched"] - effects["base"]).astype(np.float64).values,
        scores,
    )
    attrs = {**effects.attrs, "method": "edge_agreement", "steps": steps, "top_k": top_k}
    return _report(exact, estimate, list(estimators), top_k, ci, {**attrs, "seed": seed})


def _report(
    exact: xr.DataArray,
    estimate: xr.DataArray,
    estimators: list[str],
    top_k: int,
    ci: float,
    attrs: dict[str, Any],
) -> xr.Dataset:
    """``edge_agreement``'s Dataset from the exact and estimated maps of the sample: each
    estimator compared with the exact effects per receiver kind.

    Args:
        exact: (prompt, edge); estimate: (estimator, prompt, edge); both with a
            ``receiver_kind`` coord on ``edge``.
    """
    kinds = [kind for kind in RECEIVER_KINDS if (exact["receiver_kind"] == kind).any()]
    pairs = {
        (name, kind): (
            exact.where(exact["receiver_kind"] == kind, drop=True),
            estimate.sel(estimator=name, drop=True).where(
                exact["receiver_kind"] == kind, drop=True
            ),
        )
        for name in estimators
        for kind in kinds
    }
    variables = agreement_variables(
        pairs, ("estimator", "receiver_kind"), top_k=top_k, ci=ci, seed=attrs["seed"]
    )
    return xr.Dataset(
        {
            **variables,
            "n_edges": (
                ("receiver_kind",),
                [int((exact["receiver_kind"] == kind).sum()) for kind in kinds],
            ),
            "exact": exact,
            "estimate": estimate,
        },
        coords={"estimator": estimators, "receiver_kind": kinds, "bound": ["low", "high"]},
        attrs=attrs,
    )
