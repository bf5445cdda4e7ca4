"""Fine-tune a copy of a model briefly on CPU, to get a second checkpoint for change maps."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import _validate
from ..data import Prompt, as_texts
from ..models import LensModel, from_hf, in_one_call
from ..store import as_path
from ..sweep.options import DEFAULTS

#: Most optimizer steps (``steps``): a brief fine-tune to get a second checkpoint runs 200
#: by default; 10,000 full-model AdamW steps already take hours on a CPU, and longer
#: training belongs in a training library, not in an interpretability toolkit.
MAX_STEPS = 10_000


@in_one_call
def finetune(
    model: LensModel,
    prompts: Iterable[Prompt | str],
    *,
    steps: int = 200,
    lr: float = 1e-4,
    batch_size: int = 8,
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = DEFAULTS.progress,
) -> LensModel:
    """AdamW on a deep copy of ``model`` (never the input) over ``text + target`` sequences.

    Args:
        prompts: a ``PromptSet`` (e.g. ``lsc.data.task("math")``), Prompts or strings.
        steps: optimizer steps (at most ``MAX_STEPS``); minibatches are drawn with ``seed``
            (deterministic).
        out_dir: if given, ``save_pretrained`` the tuned model and tokenizer there.

    Returns:
        The tuned ``LensModel`` (named ``"<name>+finetuned"``).

    Raises:
        TypeError, ValueError: ``steps`` not an integer from 1 to ``MAX_STEPS``,
            ``batch_size`` not a positive integer, ``lr`` not a number >= 0, an empty prompt
            list, or a text longer than the model's context.
    """
    texts = as_texts(prompts, with_target=True)
    if not texts:
        raise ValueError("The prompt list is empty; pass the texts to fine-tune on.")
    steps = _validate.integer("steps", steps, low=1, high=MAX_STEPS)
    _validate.positive_int("batch_size", batch_size)
    _validate.number("lr", lr, low=0)
    seed = _validate.seed("seed", seed)
    progress = _validate.flag("progress", progress)
    out_dir = None if out_dir is None else as_path(out_dir, argument="out_dir")
    model.check_context([len(model.tokenizer(t)["input_ids"]) for t in texts], what="text + target")
    torch.manual_seed(seed)
    hf = copy.deepcopy(model.hf).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(hf.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    tok = model.tokenizer
    for _ in tqdm(range(steps), disable=not progress, desc="fine-tuning"):
        picks = torch.randint(len(texts), (batch_size,), generator=generator).tolist()
        batch = tok([texts[i] for i in picks], return_tensors="pt", padding=True).to(model.device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = hf(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tuned = from_hf(hf, tok, name=f"{model.name}+finetuned", device=model.device, dtype=model.dtype)
    if out_dir is not None:
        hf.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
    return tuned
