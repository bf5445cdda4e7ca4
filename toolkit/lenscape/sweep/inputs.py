"""Prompt checks, tokenisation and batching for capture methods.

``tokenize`` turns user input (a ``PromptSet``, Prompts or dicts) into ``Tokens``: checked
prompts plus, per prompt, clean (and corrupt) token ids, the target and distractor token
ids and the prompt list's fingerprint. A call tokenises once; a method that runs others
(the faithfulness report) hands its ``Tokens`` on. ``batched`` cuts them into an ``Inputs``
for one method's passes; ``Inputs.batches`` pads prompt batches on either side, and
positions count real tokens only, so results do not depend on padding. The options shared
by all methods (``batch_size``, ``metric`` ...) are checked before, in
``options.check_options``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..data import Prompt, PromptSet, as_prompt_set
from ..models import LensModel
from . import memory
from .backend import TokenBatch
from .options import Options
from .positions import SpanPositions, cell_map, n_cells, span_order, span_positions


@dataclass
class Batch:
    """One batch of prompts.

    Attributes:
        index: (batch,) positions of these prompts in the prompt list.
        clean: the clean prompts' tokens; ``corrupt`` the corrupt ones (or None).
        target, distractor: (batch,) token ids (distractor is -1 when absent).
        cells: (batch, seq, n_cells) float, 1 where a padded token belongs to a position
            cell (``positions.cell_map``), or None for ``positions="all"``.
    """

    index: torch.Tensor
    clean: TokenBatch
    corrupt: TokenBatch | None
    target: torch.Tensor
    distractor: torch.Tensor
    cells: torch.Tensor | None = None


@dataclass(frozen=True)
class Tokens:
    """Prompts checked against a model and tokenised, once per call (``tokenize``).

    Attributes:
        prompts: the prompts as a ``PromptSet``.
        clean_ids: per prompt, the clean text's token ids.
        corrupt_ids: per prompt, the corrupt text's token ids (as long as the clean ones),
            or None when the method runs no corrupt prompt.
        target, distractor: (prompt,) token ids; -1 where a prompt has none (a distractor
            where the metric needs none; a target only for methods that take texts alone).
        fingerprint: SHA-256 of the prompt list (``fingerprint``).
        model: the name of the model whose tokenizer made the ids.
        spans: per prompt, its spans' token positions (``positions.span_positions``; None
            for a prompt without spans), or None when no prompt has spans.
        span_names: the spans in one order across prompts, ``"other"`` last
            (``positions.span_order``), or None; ``span_order_agrees``: whether every
            prompt has its spans in that order.
    """

    prompts: PromptSet
    clean_ids: list[list[int]]
    corrupt_ids: list[list[int]] | None
    target: torch.Tensor
    distractor: torch.Tensor
    fingerprint: str
    model: str
    spans: list[SpanPositions | None] | None = None
    span_names: tuple[str, ...] | None = None
    span_order_agrees: bool = True

    def __len__(self) -> int:
        return len(self.clean_ids)

    def __iter__(self) -> Iterator[Prompt]:
        """The prompts: ``Tokens`` are prompts too, and a method given them as its prompts
        reuses the ids (``tokenize``)."""
        return iter(self.prompts)

    @property
    def width(self) -> int:
        """Tokens in the longest clean prompt."""
        return max(len(ids) for ids in self.clean_ids)


@dataclass
class Inputs:
    """Tokenised prompts cut into batches for one method's passes (``batched``).

    Attributes:
        model: the model the passes run on.
        tokens: the prompts, tokenised once per call.
        metric, level, backend, padding_side: the run's options.
        batch_size: prompts per pass (resolved: never None).
        positions: "all", "each" or "spans" (``sweep/positions``): the cells each
            component is measured in.
        part: at level "head", the part of each head measured: "out" (its output before
            the output projection), "q" (its query), "k" or "v" (the key or value of each
            key/value head) or "pattern" (its attention pattern).
    """

    model: LensModel
    tokens: Tokens
    metric: str
    level: str
    backend: str
    batch_size: int
    padding_side: str
    positions: str = "all"
    part: str = "out"

    @property
    def n_cells(self) -> int:
        """Cells per component (``positions.n_cells``)."""
        return n_cells(self.positions, self.tokens.width, self.tokens.span_names)

    def valid_cells(self) -> torch.Tensor:
        """(n_prompts, n_cells) bool: the cells a prompt has (a position before its end, a
        span holding some of its tokens); the others are not computed."""
        tokens = self.tokens
        if self.positions == "each":
            lengths = torch.tensor([len(ids) for ids in tokens.clean_ids])
            return torch.arange(self.n_cells)[None, :] < lengths[:, None]
        if self.positions == "spans":
            assert tokens.spans is not None and tokens.span_names is not None  # ``batched``
            valid = torch.zeros(len(tokens), self.n_cells, dtype=torch.bool)
            for row, (held, ids) in enumerate(zip(tokens.spans, tokens.clean_ids, strict=True)):
                held = held or {}
                for k, name in enumerate(tokens.span_names[:-1]):
                    valid[row, k] = bool(held.get(name))
                valid[row, -1] = sum(len(at) for at in held.values()) < len(ids)
            return valid
        return torch.ones(len(tokens), 1, dtype=torch.bool)

    @property
    def prompts(self) -> PromptSet:
        return self.tokens.prompts

    @property
    def fingerprint(self) -> str:
        return self.tokens.fingerprint

    def batch(self, number: int) -> Batch:
        """Batch ``number``: prompts ``[number * batch_size, (number + 1) * batch_size)``,
        padded on ``padding_side``, on the model's device."""
        tokens, pad_id = self.tokens, self.model.tokenizer.pad_token_id
        start = number * self.batch_size
        rows = list(range(start, min(start + self.batch_size, len(tokens))))
        device = self.model.device
        corrupt = (
            None
            if tokens.corrupt_ids is None
            else pad([tokens.corrupt_ids[i] for i in rows], pad_id, self.padding_side).to(device)
        )
        clean = pad([tokens.clean_ids[i] for i in rows], pad_id, self.padding_side).to(device)
        cells = None
        if self.positions != "all":
            spans = None if tokens.spans is None else [tokens.spans[i] for i in rows]
            cells = cell_map(clean, self.positions, self.n_cells, spans, tokens.span_names)
        return Batch(
            index=torch.tensor(rows),
            clean=clean,
            corrupt=corrupt,
            target=tokens.target[rows].to(device),
            distractor=tokens.distractor[rows].to(device),
            cells=cells,
        )

    def batches(self) -> Iterator[Batch]:
        """Every batch, in prompt order."""
        return (self.batch(number) for number in range(self.n_batches()))

    def n_batches(self) -> int:
        return -(-len(self.tokens) // self.batch_size)


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
    """SHA-256 (16 hex chars) of a prompt list: texts, targets, distractors, corrupt texts,
    categories and (where any prompt has them) spans, in order. Results carry it in attrs;
    stores check it before resuming."""
    records: list[list[Any]] = [
        [p.text, p.target, p.distractor, p.corrupt, p.category] for p in prompts
    ]
    if any(p.spans is not None for p in prompts):  # prompts without spans keep their prints
        for record, p in zip(records, prompts, strict=True):
            record.append([p.spans, p.corrupt_spans])
    return hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]


def tokenize(
    model: LensModel,
    prompts: Any,
    *,
    needs_corrupt: bool,
    needs_distractor: bool,
    needs_target: bool = True,
) -> Tokens:
    """Check the prompts against the model and tokenise them: once per call.

    Args:
        prompts: a ``PromptSet``, ``Prompt``s or dicts (``data.as_prompt_set``), or the
            ``Tokens`` of an earlier call on this model (returned as they are when they hold
            what this call needs).
        needs_corrupt: tokenise the corrupt texts (each must have as many tokens as its
            clean text).
        needs_distractor: every prompt must have a single-token distractor (the logit
            difference).
        needs_target: every prompt must have a single-token target; False: an empty target
            is allowed and becomes -1 (methods that follow the model's own prediction).

    Raises:
        TypeError: prompts that are not a list of prompts (``data.as_prompt_set``).
        ValueError: empty prompt list, empty or multi-token targets, texts longer than the
            model's context, missing distractors/corrupt prompts, clean/corrupt token counts
            that differ, ``Tokens`` made on another model.
    """
    if isinstance(prompts, Tokens):
        return _reuse(model, prompts, needs_corrupt=needs_corrupt)
    prompt_set = as_prompt_set(prompts)
    if len(prompt_set) == 0:
        raise ValueError(
            "The prompt list is empty; pass at least one prompt (e.g. lsc.data.prompts('factual'))."
        )
    tokenizer = model.tokenizer
    target, distractor = [], []
    for i, p in enumerate(prompt_set):
        optional = not needs_target and not p.target
        target.append(-1 if optional else _single_token(tokenizer, p.target, "target", i))
        if needs_distractor and p.distractor is None:
            raise ValueError(
                f"Prompt {i} has no distractor, which metric='logit_diff' needs; "
                "add one or use metric='logprob'."
            )
        distractor.append(
            -1 if p.distractor is None else _single_token(tokenizer, p.distractor, "distractor", i)
        )
    clean_ids = [tokenizer(p.text)["input_ids"] for p in prompt_set]
    model.check_context([len(ids) for ids in clean_ids], what="text")
    corrupt_ids = _corrupt_ids(tokenizer, prompt_set, clean_ids) if needs_corrupt else None
    spans, names, agrees = _spans(tokenizer, prompt_set, clean_ids, corrupt_ids)
    return Tokens(
        prompt_set,
        clean_ids,
        corrupt_ids,
        torch.tensor(target),
        torch.tensor(distractor),
        fingerprint(prompt_set),
        model.name,
        spans,
        names,
        agrees,
    )


def _spans(
    tokenizer: Any,
    prompts: PromptSet,
    clean_ids: list[list[int]],
    corrupt_ids: list[list[int]] | None,
) -> tuple[list[SpanPositions | None] | None, tuple[str, ...] | None, bool]:
    """The prompts' spans as token positions, their names in one order and whether every
    prompt agrees with it (``Tokens``); (None, None, True) when no prompt has spans."""
    if all(p.spans is None for p in prompts):
        return None, None, True
    spans = [
        span_positions(tokenizer, p, i, ids, None if corrupt_ids is None else corrupt_ids[i])
        for i, (p, ids) in enumerate(zip(prompts, clean_ids, strict=True))
    ]
    names, agrees = span_order([list(held) for held in spans if held is not None])
    return spans, tuple(names), agrees


def _corrupt_ids(tokenizer: Any, prompts: PromptSet, clean_ids: list[list[int]]) -> list[list[int]]:
    """Per prompt, the corrupt text's token ids, as many as the clean text's.

    Raises:
        ValueError: a prompt without a corrupt text, or one of another token length.
    """
    corrupt_ids = []
    for i, (p, ids) in enumerate(zip(prompts, clean_ids, strict=True)):
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
    return corrupt_ids


def _reuse(model: LensModel, tokens: Tokens, *, needs_corrupt: bool) -> Tokens:
    """``tokens`` of an earlier call, checked to serve this one."""
    if tokens.model != model.name:
        raise ValueError(
            f"These prompts were tokenised for the model {tokens.model!r}, not for "
            f"{model.name!r}; pass the prompts themselves."
        )
    if needs_corrupt and tokens.corrupt_ids is None:
        raise ValueError(
            "These tokenised prompts hold no corrupt texts, which this method needs; pass "
            "the prompts themselves."
        )
    return tokens


def plan_memory(model: LensModel, tokens: Tokens, options: Options) -> memory.Estimate:
    """The memory plan of running the method ``options.method`` over ``tokens``: its
    registered footprint (``memory.FOOTPRINTS``) at the batch size ``options`` ask for (a
    batch holds at most every prompt once: a larger one is planned as the prompts), or
    with ``batch_size=None`` the largest that fits (``memory.plan``)."""
    footprint = memory.FOOTPRINTS.get(options.method, memory.one_gradient_pass)
    width, n_prompts = tokens.width, len(tokens)
    n_spans = None if tokens.span_names is None else len(tokens.span_names)
    return memory.plan(
        model,
        options.method,
        lambda rows: footprint(model, options, memory.Work(rows, width, n_prompts, n_spans)),
        n_prompts=n_prompts,
        width=width,
        batch_size=options.get("batch_size"),
        max_rows=n_prompts,
    )


def batched(
    model: LensModel, tokens: Tokens, options: Options, *, level: str | None = None
) -> Inputs:
    """``tokens`` cut into batches for one method's passes, as ``options`` say (checked).

    The method's memory plan (``plan_memory``) is made first: ``batch_size=None`` becomes
    the largest batch that fits, and a run that cannot fit is refused here, before anything
    is allocated.

    Args:
        level: the level these passes measure, when not ``options.level`` (a method with
            no level, or both levels of ``attribution_patching(level="all")``).

    Raises:
        MemoryError: the run needs more memory than is available (``memory.check``).
    """
    positions = options.get("positions", "all")
    if positions == "spans":
        check_spans(tokens)
    estimate = plan_memory(model, tokens, options)
    memory.check(estimate)
    return Inputs(
        model,
        tokens,
        options.metric,
        level or options.get("level", "head"),
        options.backend,
        estimate.batch_size,
        options.padding_side,
        positions,
        options.get("part", "out"),
    )


def check_spans(tokens: Tokens) -> None:
    """Refuse ``positions="spans"`` on prompts of which some name no span.

    Raises:
        ValueError: naming the prompts without spans and how to give them.
    """
    missing = [i for i, held in enumerate(tokens.spans or [None] * len(tokens)) if held is None]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ValueError(
            f"positions='spans' reads one cell per named span, but prompt(s) {shown} of "
            f"{len(tokens)} name no spans; give every prompt spans (Prompt(..., spans={{'IO': "
            "'Mary'}}), or the 'spans' key of lsc.data.from_records), use a built-in set "
            "(lsc.data.prompts('ioi') carries them) or positions='each'."
        )
