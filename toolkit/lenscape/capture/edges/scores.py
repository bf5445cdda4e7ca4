"""Edge scores: EAP and EAP-IG for every edge, as a plan over prompt batches.

Scores (denoising sign, as ``lsc.attribution_patching`` and TransformerLens 4.3's
``attribution_patch``): EAP (Syed et al. 2023)
``score(s -> r) = sum_pos (clean_s - corrupt_s) . d metric / d(input of r)`` at the corrupt
run; positive: the edge carries the clean answer. EAP-IG (Hanna et al. 2024, arXiv
2403.17806) averages the gradient over ``steps`` points ``a_k = k / steps`` of the straight
path from the corrupt to the clean embeddings (left Riemann sum); ``steps=1`` is EAP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from ... import _validate, schema
from ...data import Prompts
from ...models import LensModel
from ...sweep.inputs import Batch, Inputs, Tokens, batched
from ...sweep.metrics import LONG_NAMES, UNITS
from ...sweep.options import DEFAULTS, Options
from ...sweep.plan import Plan, Scores, top_is_target
from ...sweep.registry import method, run
from ...sweep.result import prompt_coords, provenance
from .graph import Graph
from .hooks import Pass, check_supported, metric_of, run_pass, unedited

ESTIMATORS = ("eap", "eap-ig")
#: Integration points of ``estimator="eap-ig"`` when ``steps`` is not given.
DEFAULT_IG_STEPS = 5


def _zero_leaves(graph: Graph, shape: tuple[int, int, int], like: torch.Tensor) -> dict:
    rows, width, d_model = shape
    leaves: dict[tuple[str, int], torch.Tensor] = {}
    for layer in range(graph.n_layers):
        leaves[("attn", layer)] = like.new_zeros((rows, width, graph.per_layer - 1, d_model))
        leaves[("mlp", layer)] = like.new_zeros((rows, width, d_model))
    leaves[("logits", -1)] = like.new_zeros((rows, width, d_model))
    return {key: leaf.requires_grad_(True) for key, leaf in leaves.items()}


def _batch_scores(inputs: Inputs, batch: Batch, steps: int) -> Scores:
    """Edge scores of one batch, (batch, n_senders * n_receivers) float32 (0 off the graph),
    and whether the model answers each clean prompt correctly."""
    assert batch.corrupt is not None
    model, graph = inputs.model, Graph.of(inputs.model)
    clean, clean_logits = unedited(inputs, batch.clean)
    clean_embed = clean[:, :, 0]
    gradient: torch.Tensor | None = None
    corrupt: torch.Tensor | None = None
    for k in range(steps):

        def interpolate(out: torch.Tensor, alpha: float = k / steps) -> torch.Tensor:
            return out + alpha * (clean_embed - out)

        rows, width, d_model = clean_embed.shape
        state = Pass(
            graph,
            deltas=_zero_leaves(graph, (rows, width, d_model), clean_embed),
            embed_path=None if k == 0 else interpolate,
        )
        logits = run_pass(model, inputs.backend, batch.corrupt, state, grad=True)
        leaves = list(state.deltas.values())
        grads = torch.autograd.grad(metric_of(inputs, logits, batch).sum(), leaves)
        stacked = torch.cat(
            [g.float() if g.dim() == 4 else g.float()[:, :, None] for g in grads], dim=2
        )
        gradient = stacked if gradient is None else gradient + stacked
        if k == 0:
            corrupt = state.senders
    assert gradient is not None and corrupt is not None
    mask = batch.corrupt.attention_mask.float()[:, :, None, None]
    diff = (clean.float() - corrupt.float()) * mask
    scores = torch.einsum("bpsd,bprd->bsr", diff, gradient / steps)
    scores = scores * torch.from_numpy(graph.valid).to(scores.device)
    return Scores(scores.flatten(1).cpu(), top_is_target(clean_logits, batch.target).cpu())


def check_steps(estimator: str, steps: int | None) -> int:
    """The integration points of ``estimator`` (``steps`` checked; None: its default).

    Raises:
        ValueError: an unknown estimator, or ``steps`` other than 1 with "eap".
    """
    _validate.choice("estimator", estimator, ESTIMATORS)
    if steps is None:
        return 1 if estimator == "eap" else DEFAULT_IG_STEPS
    if estimator == "eap" and steps != 1:
        raise ValueError(
            f"estimator='eap' takes the gradient at the corrupt run alone; steps={steps} "
            "needs estimator='eap-ig' (or leave steps=None)."
        )
    return steps


def edge_result(
    inputs: Inputs, graph: Graph, values: Any, index: Any, correct: Any, attrs: dict[str, Any]
) -> xr.DataArray:
    """(prompt, sender, receiver) DataArray of (k, n_senders * n_receivers) ``values`` for
    the prompts ``index``, NaN where no edge exists."""
    n_senders, n_receivers = graph.shape
    values = np.asarray(values, dtype=np.float32).reshape(-1, n_senders, n_receivers)
    values = np.where(graph.valid, values, np.float32("nan"))
    return schema.make(
        values,
        dims=("prompt", "sender", "receiver"),
        coords={**graph.coords(), **prompt_coords(inputs, index, correct)},
        attrs=attrs,
    )


def plan_edge_attribution(
    model: LensModel,
    tokens: Tokens,
    options: Options,
    *,
    progress: bool,
    prepass: dict[str, Any] | None = None,
) -> Plan[xr.DataArray]:
    """``edge_attribution`` as a plan: per batch, one unedited clean pass and ``steps``
    corrupt passes with a backward each. No pre-pass."""
    points = check_steps(options.estimator, options.steps)
    check_supported(model, options.backend)
    inputs = batched(model, tokens, options, level="head", grad=True)
    graph = Graph.of(model)
    effect = "EAP" if options.estimator == "eap" else f"EAP-IG ({points} steps)"
    attrs = {
        "long_name": f"{effect} edge score (clean -> corrupt) of {LONG_NAMES[options.metric]}",
        "units": UNITS[options.metric],
        **provenance(inputs, "edge_attribution", estimator=options.estimator, steps=points),
    }

    def score(batch: Batch, step) -> Scores:
        scores = _batch_scores(inputs, batch, points)
        step()
        return scores

    return Plan(
        inputs,
        graph.valid.size,
        score,
        lambda values, correct, index: edge_result(inputs, graph, values, index, correct, attrs),
        desc="edge attribution" if options.estimator == "eap" else f"EAP-IG ({points} steps)",
    )


def _prompt_mean(scores: xr.DataArray, options: Options, prompts: Any) -> xr.DataArray:
    """The view ``edge_attribution`` returns: per prompt, or the mean over prompts
    (float64, as (sender, receiver))."""
    if options.per_prompt:
        return scores
    return scores.load().astype(np.float64).mean("prompt", skipna=False, keep_attrs=True)


@method(
    plan_edge_attribution,
    needs_corrupt=True,
    view=_prompt_mean,
    view_options=("per_prompt",),
)
def edge_attribution(
    model: LensModel,
    prompts: Prompts,
    *,
    estimator: str = "eap",
    steps: int | None = None,
    metric: str = DEFAULTS.metric,
    batch_size: int | None = DEFAULTS.batch_size,
    backend: str = DEFAULTS.backend,
    padding_side: str = DEFAULTS.padding_side,
    per_prompt: bool = False,
    store: str | Path | None = DEFAULTS.store,
    client: Any = DEFAULTS.client,
    progress: bool = DEFAULTS.progress,
) -> xr.DataArray:
    """Score every edge sender -> receiver with EAP or EAP-IG (see ``lenscape.capture.edges``).

    Args:
        model: a ``LensModel`` (Llama, Mistral or Qwen family; grouped-query attention is
            exact: k and v receivers are key/value heads).
        prompts: prompts with a ``corrupt`` text of the same token length and single-token
            targets (and distractors for ``metric="logit_diff"``).
        estimator: "eap" (gradient at the corrupt run) or "eap-ig" (integrated gradients
            along the corrupt -> clean embedding path).
        steps: integration points of "eap-ig" (default 5, at most
            ``options.MAX_STEPS``); "eap" takes 1.
        backend: "nnsight" (TransformerLens cannot express per-receiver inputs: an error
            says so).
        per_prompt: keep the ``prompt`` dim (with its ``correct`` flags, so
            ``lsc.aggregate.correct_only`` can drop wrong answers) instead of averaging
            over prompts. A ``store`` always holds the per-prompt scores.

    Returns:
        DataArray (sender, receiver), or (prompt, sender, receiver) with ``per_prompt``;
        coords ``sender_kind`` (embed, head, mlp), ``sender_layer``, ``sender_head`` and
        ``receiver_kind`` (q, k, v, mlp, logits), ``receiver_layer``, ``receiver_head``
        (-1 where there is none; the logits' layer is ``n_layers``). NaN where no edge
        exists (the receiver is upstream of the sender).

    Raises:
        ValueError: unknown estimator, steps < 1 (or > 1 with "eap"), a corrupt prompt of
            another token length, an unsupported architecture, backend="transformer_lens".
    """
    per_prompt = _validate.flag("per_prompt", per_prompt)
    return run(edge_attribution, locals())
