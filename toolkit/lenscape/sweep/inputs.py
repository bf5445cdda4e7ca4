"""Prompt checks and tokenization for capture methods.

``prepare`` turns user input (a ``PromptSet``, Prompts or dicts) into an ``Inputs``:
checked prompts plus, per prompt, clean (and corrupt) token ids and the target and
distractor token ids. The options shared by all methods (``batch_size``, ``metric`` ...)
are checked before, in ``options.check_options``. ``Inputs.batches`` pads prompt batches on
either side; positions count real tokens only, so results do not depend on padding.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _validate
from ..data import PromptSet, as_prompt_set
from ..models import LensModel
from . import memory
from .backend import TokenBatch

LEVELS = ("head", "block")
PADDING_SIDES = ("right", "left")


@dataclass
class Batch:
    """One batch of prompts.

    Attributes:
        index: (batch,) positions of these prompts in the prompt list.
        clean: the clean prompts' tokens; ``corrupt`` the corrupt ones (or None).
        target, distractor: (batch,) token ids (distractor is -1 when absent).
    """

    index: torch.Tensor
    clean: TokenBatch
    corrupt: TokenBatch | None
    target: torch.Tensor
    distractor: torch.Tensor


@dataclass
class Inputs:
    """Validated capture inputs; see ``prepare``."""

    model: LensModel
    prompts: PromptSet
    clean_ids: list[list[int]]
    corrupt_ids: list[list[int]] | None
    target: torch.Tensor
    distractor: torch.Tensor
    metric: str
    level: str
    backend: str
    batch_size: int
    padding_side: str
    fingerprint: str

    def batch(self, number: int) -> Batch:
        """Batch ``number``: prompts ``[number * batch_size, (number + 1) * batch_size)``,
        padded on ``padding_side``, on the model's device."""
        pad_id = self.model.tokenizer.pad_token_id
        start = number * self.batch_size
        rows = list(range(start, min(start + self.batch_size, len(self.clean_ids))))
        corrupt = (
            None
            if self.corrupt_ids is None
            else pad([self.corrupt_ids[i] for i in rows], pad_id, self.padding_side)
        )
        return Batch(
            index=torch.tensor(rows),
            clean=pad([self.clean_ids[i] for i in rows], pad_id, self.padding_side).to(
                self.model.device
            ),
            corrupt=None if corrupt is None else corrupt.to(self.model.device),
            target=self.target[rows].to(self.model.device),
            distractor=self.distractor[rows].to(self.model.device),
        )

    def batches(self) -> Iterator[Batch]:
        """Every batch, in prompt order."""
        return (self.batch(number) for number in range(self.n_batches()))

    def n_batches(self) -> int:
        return -(-len(self.clean_ids) // self.batch_size)


def pad(sequences: Sequence[Sequence[int]], pad_id: int, side: str) -> TokenBatch:
    """Pad token id lists into a ``TokenBatch`` (batch, max_len)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        cols = slice(0, len(seq)) if side == "right" else slice(width - len(seq), width)
        ids[row, cols] = torch.tensor(seq, dtype=torch.long)
        mask[row, cols] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    read_pos = torch.full((len(sequences),), width - 1) if side == "left" else mask.sum(-1) - 1
    return TokenBatch(ids, mask, positions, read_pos)


def _single_token(tokenizer: Any, text: str, what: str, index: int) -> int:
    if not text.strip():
        raise ValueError(
            f"Prompt {index}: the {what} {text!r} is empty; capture methods score "
            f"one {what} token, so give the expected next word with its leading "
            "space, e.g. ' Paris'."
        )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        spaced = " " + text.strip()
        one = spaced != text and len(tokenizer(spaced, add_special_tokens=False)["input_ids"]) == 1
        fix = (
            f"with a leading space, {spaced!r} is one token"
            if one
            else f"use a word that is one token, or its first token {tokenizer.decode(ids[:1])!r}"
        )
        raise ValueError(
            f"Prompt {index}: {what} {text!r} tokenizes to {len(ids)} tokens "
            f"{pieces}; targets must be single tokens: {fix}."
        )
    return ids[0]


def fingerprint(prompts: PromptSet) -> str:
    """SHA-256 (16 hex chars) of a prompt list: texts, targets, distractors, corrupt texts
    and categories, in order. Results carry it in attrs; stores check it before resuming."""
    records = [[p.text, p.target, p.distractor, p.corrupt, p.category] for p in prompts]
    return hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]


def prepare(
    model: LensModel,
    prompts: Any,
    *,
    metric: str,
    level: str,
    backend: str,
    batch_size: int | None,
    padding_side: str,
    needs_corrupt: bool,
    levels: Sequence[str] = LEVELS,
    grad: bool = False,
) -> Inputs:
    """Check the prompts against the model and tokenize them.

    The shared options (``metric``, ``backend``, ``padding_side``, ``batch_size``) arrive
    checked by ``options.check_options``; ``level`` is checked here against ``levels``,
    which differ per method.

    Args:
        batch_size: prompts per pass; None picks one from free memory (``memory``), using
            ``grad`` to tell whether passes keep activations for a backward pass.

    Raises:
        TypeError: prompts that are not a list of prompts (``data.as_prompt_set``).
        ValueError: empty prompt list, unknown level, empty or multi-token targets, texts
            longer than the model's context, missing distractors/corrupt prompts,
            clean/corrupt token counts that differ.
    """
    _validate.choice("level", level, levels)
    prompt_set = as_prompt_set(prompts)
    if len(prompt_set) == 0:
        raise ValueError(
            "The prompt list is empty; pass at least one prompt (e.g. lsc.data.prompts('factual'))."
        )
    tokenizer = model.tokenizer
    target, distractor = [], []
    for i, p in enumerate(prompt_set):
        target.append(_single_token(tokenizer, p.target, "target", i))
        if metric == "logit_diff" and p.distractor is None:
            raise ValueError(
                f"Prompt {i} has no distractor, which metric='logit_diff' needs; "
                "add one or use metric='logprob'."
            )
        distractor.append(
            -1 if p.distractor is None else _single_token(tokenizer, p.distractor, "distractor", i)
        )
    clean_ids = [tokenizer(p.text)["input_ids"] for p in prompt_set]
    model.check_context([len(ids) for ids in clean_ids], what="text")
    corrupt_ids = None
    if needs_corrupt:
        corrupt_ids = []
        for i, (p, ids) in enumerate(zip(prompt_set, clean_ids, strict=True)):
            if p.corrupt is None:
                raise ValueError(
                    f"Prompt {i} has no corrupt counterpart, which this method "
                    "needs; add `corrupt=` or use lsc.ablation instead."
                )
            cids = tokenizer(p.corrupt)["input_ids"]
            if len(cids) != len(ids):
                raise ValueError(
                    f"Prompt {i}: clean ({len(ids)} tokens) and corrupt "
                    f"({len(cids)} tokens) differ in length; patching needs "
                    f"aligned positions. Reword {p.corrupt!r} to match {p.text!r}."
                )
            corrupt_ids.append(cids)
    if batch_size is None:
        width = max(len(ids) for ids in clean_ids)
        batch_size = memory.auto_batch_size(model, width=width, grad=grad)
    return Inputs(
        model,
        prompt_set,
        clean_ids,
        corrupt_ids,
        torch.tensor(target),
        torch.tensor(distractor),
        metric,
        level,
        backend,
        batch_size,
        padding_side,
        fingerprint(prompt_set),
    )
