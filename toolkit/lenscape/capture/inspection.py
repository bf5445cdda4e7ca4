"""Prompt inspector: what the model actually answers, prompt by prompt.

``lsc.inspect(model, prompts)`` runs each clean (and corrupt) prompt once and tabulates,
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
from ..data import Prompt, PromptSet
from ..models import LensModel
from ..sweep import metrics
from ..sweep.backend import get_backend
from ..sweep.inputs import prepare
from ..sweep.options import DEFAULTS, check_options
from ..sweep.plan import top_is_target
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


def inspect(
    model: LensModel,
    prompts: PromptSet | Iterable[Prompt | dict[str, Any]],
    *,
    metric: str = DEFAULTS.metric,
    top_k: int = 5,
    batch_size: int | None = DEFAULTS.batch_size,
    backend: str = DEFAULTS.backend,
) -> Inspection:
    """The model's answers on each prompt: top next tokens, target probability, metric.

    Args:
        model: a loaded model (``lsc.load``).
        prompts: a ``PromptSet``, ``Prompt``s or dicts (as for capture methods); corrupt
            prompts are run when every prompt has one.
        metric: "logit_diff", "logprob", "loss" or "logit" (as in ``lsc.ablation``).
        top_k: how many of the most probable next tokens to list.
        batch_size: prompts per forward pass (None: from free memory).
        backend: "nnsight" or "transformer_lens".

    Returns:
        An ``Inspection`` (its ``data``: Dataset over (prompt, rank)).

    Raises:
        ValueError: bad options or prompts, with the same messages as the capture methods.
    """
    _validate.positive_int("top_k", top_k)
    check_options({"metric": metric, "backend": backend, "batch_size": batch_size})
    inputs = prepare(
        model,
        prompts,
        metric=metric,
        level="head",
        backend=backend,
        batch_size=batch_size,
        padding_side="right",
        needs_corrupt=False,
    )
    prompt_set = inputs.prompts
    corrupt = all(p.corrupt is not None for p in prompt_set)
    if corrupt:
        inputs = prepare(
            model,
            prompt_set,
            metric=metric,
            level="head",
            backend=backend,
            batch_size=inputs.batch_size,
            padding_side="right",
            needs_corrupt=True,
        )
    runner = get_backend(model, backend)
    sides = ("clean", "corrupt") if corrupt else ("clean",)
    found: dict[str, list[torch.Tensor]] = {}
    for batch in inputs.batches():
        for side in sides:
            with torch.no_grad():
                logits = runner.run(getattr(batch, side)).logits.float()
            probs = torch.softmax(logits, dim=-1)
            top = probs.topk(top_k, dim=-1)
            # the same metric on both sides (as patching measures it): on the corrupt
            # prompt a logit difference should be negative, a target log-prob low
            value = metrics.compute(metric, logits, batch.target, batch.distractor)
            parts = {
                f"{side}_ids": top.indices,
                f"{side}_prob": top.values,
                f"{side}_metric": value,
            }
            if side == "clean":
                parts["target_prob"] = probs[torch.arange(len(batch.index)), batch.target]
                parts["correct"] = top_is_target(logits, batch.target)
            for key, part in parts.items():
                found.setdefault(key, []).append(part.cpu())
    joined = {k: torch.cat(v).numpy() for k, v in found.items()}
    tok = model.tokenizer
    dims = ("prompt", "rank")
    data: dict[str, tuple[Any, ...]] = {
        "text": ("prompt", prompt_set.texts),
        "target": ("prompt", [p.target for p in prompt_set]),
        "distractor": ("prompt", [p.distractor or "" for p in prompt_set]),
        "corrupt": ("prompt", [p.corrupt or "" for p in prompt_set]),
        "category": ("prompt", prompt_set.categories),
        "target_prob": ("prompt", joined["target_prob"]),
        "correct": ("prompt", joined["correct"]),
    }
    for side in sides:
        data[f"{side}_token"] = (
            dims,
            np.array([token_labels(tok, ids) for ids in joined[f"{side}_ids"]]),
        )
        data[f"{side}_prob"] = (dims, joined[f"{side}_prob"])
        data[f"{side}_metric"] = ("prompt", joined[f"{side}_metric"])
    ds = xr.Dataset(
        data, coords={"prompt": np.arange(len(prompt_set)), "rank": np.arange(1, top_k + 1)}
    )
    ds.attrs = {
        "model": model.name,
        "metric": metric,
        "units": metrics.UNITS[metric],
        "backend": backend,
        "prompt_set": prompt_set.name,
        "method": "inspect",
        "metric_long_name": metrics.LONG_NAMES[metric],
    }
    ds["clean_metric"].attrs = {
        "long_name": f"{metrics.LONG_NAMES[metric]}, clean prompt",
        "units": metrics.UNITS[metric],
    }
    return Inspection(ds)
