"""Next-token loss at every position: how well the model predicts each token of a prompt
from the ones before it (on a repeated sequence, the second copy's loss falls once
induction heads copy it: ``lsc.data.prompts("repeated")``).

``token_loss(model, prompts)`` is (prompt, pos): at position ``pos`` the loss
-log p(next token) of the token at ``pos + 1``, and at the last position of the target
(NaN where a prompt has no target, and past its end); ``token`` labels each position,
``next_token`` the token predicted there.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from .. import schema
from ..data import Prompts
from ..models import LensModel
from ..sweep import memory
from ..sweep.backend import get_backend
from ..sweep.inputs import Batch, batched
from ..sweep.options import UNMEASURED, Options
from ..sweep.plan import Call, Plan, Scores, top_is_target
from ..sweep.positions import real_positions, token_labels
from ..sweep.registry import method, run
from ..sweep.result import prompt_coords, provenance
from .lens import read_out

#: The residual stream entering the final norm, (batch, pos, d_model).
FINAL = ("resid_final", -1)


def plan_token_loss(call: Call) -> Plan[xr.DataArray]:
    """``token_loss`` as a plan: one clean pass per batch, every position read out."""
    model, tokens, options = call.model, call.tokens, call.options
    inputs = batched(model, tokens, options.replace(metric="logit"), level="head")
    runner, width = get_backend(model, options.backend), tokens.width

    def next_ids(prompt: int) -> list[int]:
        ids, target = tokens.clean_ids[prompt], int(tokens.target[prompt])
        return [*ids[1:], target]  # -1: no target

    def score(batch: Batch, step) -> Scores:
        with torch.no_grad():
            result = runner.run(batch.clean, sites=[FINAL])
            where = real_positions(batch.clean.attention_mask)
            losses = torch.full((len(batch.index), width), float("nan"))
            for row, prompt in enumerate(batch.index.tolist()):
                real = where[row] >= 0
                logits = read_out(model, result.acts[FINAL][row, real])  # (n, vocab)
                logprobs = torch.log_softmax(logits.float(), -1)
                following = torch.tensor(next_ids(prompt), device=logprobs.device)
                known = following >= 0
                picked = logprobs[torch.arange(len(following)), following.clamp_min(0)]
                losses[row, : len(following)] = torch.where(known, -picked, float("nan")).cpu()
        step()
        return Scores(losses, top_is_target(result.logits, batch.target).cpu())

    def finish(values, correct, index) -> xr.DataArray:
        coords = prompt_coords(inputs, index, correct)
        rows = coords["prompt"].tolist()
        labels = np.full((len(rows), width), "", dtype=object)
        following = np.full((len(rows), width), "", dtype=object)
        for i, prompt in enumerate(rows):
            ids = tokens.clean_ids[prompt]
            labels[i, : len(ids)] = token_labels(model.tokenizer, ids)
            known = [t for t in next_ids(prompt) if t >= 0]
            following[i, : len(known)] = token_labels(model.tokenizer, known)
        coords |= {
            "pos": np.arange(width),
            "token": (("prompt", "pos"), labels.astype(str)),
            "next_token": (("prompt", "pos"), following.astype(str)),
        }
        attrs = {
            "long_name": "next-token loss",
            "units": "nats",
            **provenance(inputs, "token_loss"),
            "metric": "loss",
        }
        values = np.asarray(values, dtype=np.float32)
        return schema.make(values, dims=("prompt", "pos"), coords=coords, attrs=attrs)

    return Plan(inputs, width, score, finish, desc="token loss")


def token_loss_memory(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """Footprint of ``token_loss``: a pass and one prompt's logits at every position."""
    logits = work.width * model.spec.vocab_size * 4 * 2
    pass_bytes = memory.forward_pass(model, work.rows, work.width)
    return memory.Need(activations=pass_bytes, buffers=logits)


@method(plan_token_loss, shared=UNMEASURED, needs_target=False, memory=token_loss_memory)
def token_loss(model: LensModel, prompts: Prompts, **shared) -> xr.DataArray:
    """Next-token loss at every position of each prompt (module docstring).

    Args:
        prompts: prompts (the target, where given, is the last position's next token).

    Returns:
        DataArray (prompt, pos) in nats, coords ``token`` and ``next_token`` (prompt, pos).
    """
    return run(token_loss, locals())
