"""Direct logit attribution (DLA).

Each head's (or block's) contribution to the residual stream at the read position is
pushed through the final norm, with the norm's scale frozen at its value on the clean
run, and dotted with the unembedding direction of the metric (``W_U[target] -
W_U[distractor]`` for "logit_diff", ``W_U[target]`` for "logit"). With the scale frozen
the map is linear, so the block scores plus the embedding's add up to the metric (less
any unembedding bias). Gemma's post-attention norm is frozen the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import xarray as xr

from ..data import Prompts
from ..models import LensModel
from ..models.parts import head_outputs, norm_weight, rms_scale
from ..sweep import memory
from ..sweep.backend import get_backend
from ..sweep.inputs import Batch, Inputs, batched
from ..sweep.options import LEVELLED, Options
from ..sweep.plan import Call, Plan, Scores, one_level_plan, top_is_target
from ..sweep.registry import method, run
from ..sweep.result import LEVELS, components

DLA_METRICS = ("logit_diff", "logit")


def _scorer(inputs: Inputs) -> Callable[[Batch, Callable], Scores]:
    """``score(batch, step)``: each component's direct logit share at the read position,
    (rows, n_components), and whether the model answers each prompt correctly."""
    model, level, metric = inputs.model, inputs.level, inputs.metric
    spec, layout = model.spec, model.spec.layout
    runner = get_backend(model, inputs.backend)
    sites = [*list(dict.fromkeys(site for site, _ in components(inputs))), ("resid_final", -1)]
    final_norm = model.hf.get_submodule(layout.final_norm)
    unembed = model.hf.get_submodule(layout.unembed).weight.float()

    def score(batch, step) -> Scores:
        with torch.no_grad():
            run = runner.run(batch.clean, sites=sites)
            acts = run.acts
            rows = torch.arange(len(batch.index), device=model.device)
            at_read = {site: value[rows, batch.clean.read_pos] for site, value in acts.items()}
            resid = at_read[("resid_final", -1)].float()
            direction = unembed[batch.target]
            if metric == "logit_diff":
                direction = direction - unembed[batch.distractor]
            if layout.layer_norm:
                scale = torch.rsqrt(resid.var(-1, unbiased=False, keepdim=True) + final_norm.eps)
            else:
                scale = rms_scale(resid, final_norm)
            # (batch, d_model): contribution . effective_direction == its logit share.
            effective = direction * norm_weight(final_norm, layout.norm_offset) * scale
            columns = []
            for layer in range(spec.n_layers):
                if level == "head":
                    parts = head_outputs(model, layer, at_read[("z", layer)])
                else:
                    parts = torch.stack([at_read[("attn", layer)], at_read[("mlp", layer)]], 1)
                parts = parts.float()
                if layout.layer_norm:  # LayerNorm also removes each part's mean
                    parts = parts - parts.mean(-1, keepdim=True)
                columns.append(torch.einsum("bcd,bd->bc", parts, effective))
        step()
        return Scores(torch.cat(columns, dim=1).cpu(), top_is_target(run.logits, batch.target))

    return score


def plan_direct_logit_attribution(call: Call) -> Plan[xr.DataArray]:
    """``direct_logit_attribution`` as a plan: one clean forward pass per batch. It has no
    pre-pass: ``prepass`` is accepted like every planner's and stays empty."""
    model, tokens, options = call.model, call.tokens, call.options
    metric = options.metric
    if metric not in DLA_METRICS:
        raise ValueError(
            f"direct_logit_attribution supports metric in {list(DLA_METRICS)}, "
            f"got {metric!r}; for log-probabilities use lsc.attribution_patching."
        )
    inputs = batched(model, tokens, options)
    return one_level_plan(
        inputs,
        _scorer(inputs),
        desc="direct logit attribution",
        method="direct_logit_attribution",
        effect="Direct contribution to",
    )


def direct_logit_attribution_memory(
    model: LensModel, options: Options, work: memory.Work
) -> memory.Need:
    """Footprint of ``direct_logit_attribution``: a pass without gradients keeping every
    component's output and the final residual stream, and a float32 copy of the
    unembedding for a half-precision model."""
    spec, e = model.spec, memory.element_bytes(model.dtype)
    head = options.get("level", "head") == "head"
    width = spec.n_heads * spec.d_head if head else 2 * spec.d_model
    kept = work.rows * work.width * (spec.n_layers * width + spec.d_model) * e
    unembed = spec.vocab_size * spec.d_model * 4 if e < 4 else 0
    return memory.Need(
        activations=memory.forward_pass(model, work.rows, work.width), buffers=kept + unembed
    )


@method(
    plan_direct_logit_attribution,
    levels=LEVELS,
    shared=LEVELLED,
    memory=direct_logit_attribution_memory,
)
def direct_logit_attribution(model: LensModel, prompts: Prompts, **shared) -> xr.DataArray:
    """Direct effect of each head or block on the metric's logits, per prompt.

    Args:
        metric: "logit_diff" or "logit" (DLA is linear in the logits, so log-prob and
            loss are not defined for it).

    Returns:
        DataArray (prompt, layer, head) or (prompt, layer, component), in logits.
    """
    return run(direct_logit_attribution, locals())
