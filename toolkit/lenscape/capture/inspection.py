"""Prompt inspector: what the model actually answers, prompt by prompt.

``lsc.inspect_prompts(model, prompts)`` runs each clean (and corrupt) prompt once and tabulates,
per prompt, the texts, the target and distractor, the model's top next tokens with their
probabilities on both sides, the target's probability and the metric. Look at it before
reading attributions: a head "carrying" a fact the model gets wrong explains nothing.
The result is an ``Inspection``: its ``data`` is a tidy ``xarray.Dataset`` over
(prompt, rank); in a notebook it shows as a compact HTML table that flags the prompts the
model gets wrong (its top next token is not the target) and counts those it gets right.
Capture results carry the same flag as their ``correct`` coord.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
import torch
import xarray as xr

from .. import _validate
from ..data import Prompt, PromptSet, as_prompt_set
from ..models import LensModel
from ..sweep import memory, metrics
from ..sweep.backend import get_backend
from ..sweep.inputs import Batch, Inputs, Tokens, batched
from ..sweep.options import Options
from ..sweep.plan import Call, Plan, Scores, top_is_target
from ..sweep.registry import method, run
from ..sweep.result import prompt_coords, provenance
from .attention import token_labels


class Inspection:
    """Per-prompt answers of a model; shows as a compact table in notebooks.

    Attributes:
        data: Dataset over (prompt, rank): ``text``, ``corrupt``, ``target``,
            ``distractor``, ``category`` (prompt,); ``clean_token``, ``clean_prob``,
            ``corrupt_token``, ``corrupt_prob`` (prompt, rank), the top next tokens by
            probability; ``target_prob`` (prompt,), the target's probability on the clean
            prompt; ``correct`` (prompt,) bool, the model's top next token on the clean
            prompt is the target; ``clean_metric`` and ``corrupt_metric`` (prompt,) in the
            metric's units.
    """

    def __init__(self, data: xr.Dataset):
        self.data = data

    def to_dataframe(self) -> pd.DataFrame:
        """One row per prompt; the top tokens as "' Paris' 0.41, ' Rome' 0.12, ..."."""
        ds = self.data
        table: dict[str, Any] = {
            name: ds[name].values
            for name in ("category", "text", "target", "correct", "target_prob", "clean_metric")
        }
        table["clean_top"] = [_top(ds, "clean", i) for i in range(ds.sizes["prompt"])]
        if "corrupt_token" in ds:
            table |= {
                "corrupt": ds["corrupt"].values,
                "distractor": ds["distractor"].values,
                "corrupt_metric": ds["corrupt_metric"].values,
                "corrupt_top": [_top(ds, "corrupt", i) for i in range(ds.sizes["prompt"])],
            }
        return pd.DataFrame(table, index=pd.Index(ds["prompt"].values, name="prompt"))

    def __repr__(self) -> str:
        return self.to_dataframe().to_string(max_colwidth=48)

    def _repr_html_(self) -> str:
        ds = self.data
        metric = ds.attrs["metric"]
        corrupt = "corrupt_token" in ds
        head = [
            "#",
            "answer",
            "clean prompt → target",
            "top next tokens (clean)",
            "p(target)",
            metric,
        ]
        if corrupt:
            head += ["corrupt prompt → distractor", "top next tokens (corrupt)", metric]
        rows = []
        for i in range(ds.sizes["prompt"]):
            right = bool(ds["correct"].values[i])
            cells = [
                str(ds["prompt"].values[i]),
                "✓ right" if right else "<b style='color:#b2182b'>✗ wrong</b>",
                f"{_e(ds['text'].values[i])} <b>→ {_e(ds['target'].values[i])!s}</b>",
                _top_html(ds, "clean", i, ds["target"].values[i]),
                f"{ds['target_prob'].values[i]:.2f}",
                f"{ds['clean_metric'].values[i]:.2f}",
            ]
            if corrupt:
                cells += [
                    f"{_e(ds['corrupt'].values[i])} <b>→ {_e(ds['distractor'].values[i])}</b>",
                    _top_html(ds, "corrupt", i, ds["distractor"].values[i]),
                    f"{ds['corrupt_metric'].values[i]:.2f}",
                ]
            shade = "" if right else " style='background:#fde0dd'"
            rows.append(
                f"<tr{shade}>"
                + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells)
                + "</tr>"
            )
        caption = (
            f"{ds.attrs['model']}: right on {int(ds['correct'].sum())} of {ds.sizes['prompt']} "
            f"prompts (its top next token is the target; the others are marked wrong), "
            f"metric {metric} ({ds.attrs['units']}); bold: the expected token"
        )
        return (
            f"<table style='font-size:12px'><caption>{_e(caption)}</caption><thead><tr>"
            + "".join(f"<th style='text-align:left'>{h}</th>" for h in head)
            + "</tr></thead><tbody>"
            + "".join(rows)
            + "</tbody></table>"
        )


def _e(text: Any) -> str:
    return html.escape(str(text))


def _top(ds: xr.Dataset, side: str, i: int) -> str:
    return ", ".join(
        f"{t!r} {p:.2f}"
        for t, p in zip(ds[f"{side}_token"].values[i], ds[f"{side}_prob"].values[i], strict=True)
    )


def _top_html(ds: xr.Dataset, side: str, i: int, expected: str) -> str:
    parts = []
    for token, prob in zip(
        ds[f"{side}_token"].values[i], ds[f"{side}_prob"].values[i], strict=True
    ):
        text = f"{_e(repr(str(token)))}&nbsp;{prob:.2f}"
        parts.append(f"<b>{text}</b>" if token == expected else text)
    return " · ".join(parts)


def _all_corrupt(options: Options, prompts: Any) -> bool:
    """Whether every prompt has a corrupt text (then both sides are inspected)."""
    if isinstance(prompts, Tokens):
        return prompts.corrupt_ids is not None
    return all(p.corrupt is not None for p in as_prompt_set(prompts))


def _side(model: LensModel, inputs: Inputs, batch: Batch, side: str, top_k: int) -> Scores:
    """(batch, 2 top_k + 2) of one side's pass: top ids, top probs, p(target), metric; and
    whether its top token is the target."""
    with torch.no_grad():
        logits = get_backend(model, inputs.backend).run(getattr(batch, side)).logits.float()
    probs = torch.softmax(logits, dim=-1)
    top = probs.topk(top_k, dim=-1)
    # the same metric on both sides (as patching measures it): on the corrupt prompt a
    # logit difference should be negative, a target log-prob low
    value = metrics.compute(inputs.metric, logits, batch.target, batch.distractor)
    chosen = probs[torch.arange(len(batch.index)), batch.target]
    values = torch.cat([top.indices.float(), top.values, chosen[:, None], value[:, None]], 1)
    return Scores(values.cpu(), top_is_target(logits, batch.target).cpu())


def plan_inspect(call: Call) -> Plan[xr.Dataset]:
    """``inspect_prompts`` as a plan: one clean (and one corrupt) pass per batch."""
    model, tokens, options = call.model, call.tokens, call.options
    top_k = _validate.positive_int("top_k", options.top_k)
    inputs = batched(model, tokens, options, level="head")
    sides = ("clean", "corrupt") if tokens.corrupt_ids is not None else ("clean",)
    width = 2 * top_k + 2

    def score(batch: Batch, step) -> Scores:
        parts = [_side(model, inputs, batch, side, top_k) for side in sides]
        step()
        return Scores(torch.cat([part.values for part in parts], 1), parts[0].correct)

    def finish(values, correct, index) -> xr.Dataset:
        values = np.asarray(values, dtype=np.float32)
        return _table(inputs, values, correct, index, sides, top_k)

    return Plan(inputs, width * len(sides), score, finish, desc="inspecting prompts")


def _table(
    inputs: Inputs, values: np.ndarray, correct: Any, index: Any, sides: tuple, top_k: int
) -> xr.Dataset:
    """The Dataset over (prompt, rank) of the plan's values for prompts ``index``."""
    coords = prompt_coords(inputs, index, correct)
    prompts = [inputs.prompts[int(i)] for i in coords["prompt"]]
    tokenizer, metric = inputs.model.tokenizer, inputs.metric
    dims = ("prompt", "rank")
    data: dict[str, tuple[Any, ...]] = {
        "target": ("prompt", [p.target for p in prompts]),
        "distractor": ("prompt", [p.distractor or "" for p in prompts]),
        "corrupt": ("prompt", [p.corrupt or "" for p in prompts]),
    }
    for number, side in enumerate(sides):
        part = values[:, number * (2 * top_k + 2) : (number + 1) * (2 * top_k + 2)]
        ids = part[:, :top_k]
        labels = np.full(ids.shape, "", dtype=object)
        known = np.isfinite(ids)
        labels[known] = token_labels(tokenizer, ids[known].astype(np.int64).tolist())
        data[f"{side}_token"] = (dims, labels.astype(str))
        data[f"{side}_prob"] = (dims, part[:, top_k : 2 * top_k])
        data[f"{side}_metric"] = ("prompt", part[:, -1])
        if side == "clean":
            data["target_prob"] = ("prompt", part[:, -2])
    ds = xr.Dataset(
        data,
        coords={**coords, "rank": np.arange(1, top_k + 1)},
    )
    ds["clean_metric"].attrs = {
        "long_name": f"{metrics.LONG_NAMES[metric]}, clean prompt",
        "units": metrics.UNITS[metric],
    }
    ds.attrs = {
        **provenance(inputs, "inspect_prompts"),
        "units": metrics.UNITS[metric],
        "metric_long_name": metrics.LONG_NAMES[metric],
    }
    return ds


def _as_inspection(result: xr.Dataset, options: Options, prompts: Any) -> Inspection:
    return Inspection(result.load())


def inspect_memory(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """Footprint of ``inspect_prompts``: a pass without gradients per side and float32
    probabilities at the read positions."""
    probabilities = 3 * work.rows * model.spec.vocab_size * 4
    return memory.Need(
        activations=memory.forward_pass(model, work.rows, work.width), buffers=probabilities
    )


@method(plan_inspect, memory=inspect_memory, needs_corrupt=_all_corrupt, view=_as_inspection)
def inspect_prompts(
    model: LensModel,
    prompts: PromptSet | Iterable[Prompt | dict[str, Any]],
    *,
    top_k: int = 5,
    **shared,
) -> Inspection:
    """The model's answers on each prompt: top next tokens, target probability, metric.

    Args:
        prompts: a ``PromptSet``, ``Prompt``s or dicts (as for capture methods); corrupt
            prompts are run when every prompt has one.
        top_k: how many of the most probable next tokens to list.

    Returns:
        An ``Inspection`` (its ``data``: Dataset over (prompt, rank)).

    Raises:
        ValueError: bad options or prompts, with the same messages as the capture methods.
    """
    return run(inspect_prompts, locals())
