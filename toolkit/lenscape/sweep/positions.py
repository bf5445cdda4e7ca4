"""Token positions and named spans as cells of the one sweep core.

A per-prompt node method resolves positions by ``positions=``:

- ``"all"``: one cell per component, every position at once (today's numbers);
- ``"each"``: one cell per token position, counted from each prompt's first token (BOS
  included where the tokenizer adds one), so the padding side changes nothing; cells past a
  prompt's end are not computed (NaN);
- ``"spans"``: one cell per named span of the prompts (``lenscape.data.spans``), in prompt
  order, with ``OTHER`` (the tokens in no named span) last; a span a prompt does not have
  is not computed there.

This module turns spans into token positions once per call (``span_positions``: a token
belongs to a span when their character ranges overlap), orders span names across prompts
(``span_order``) and, for a padded batch, maps every token to its cell (``cell_map``): the
exact sweeps patch or ablate a cell's tokens together, the gradient estimators sum their
per-position terms over it, so the cells of an estimate add up to its all-positions score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..data import Prompt
from ..data.spans import OTHER
from .backend import TokenBatch

#: Per prompt, span name -> its token positions (from 0), in the order the spans start.
SpanPositions = dict[str, list[int]]


def token_labels(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token as the text it decodes to (leading spaces kept, newlines shown as ⏎)."""
    return [tokenizer.decode([i]).replace("\n", "⏎") for i in ids]


def token_ranges(tokenizer: Any, text: str, ids: Sequence[int]) -> list[tuple[int, int]]:
    """The character range of each of ``ids`` (``text`` tokenised with special tokens) in
    ``text``; special tokens (BOS) have an empty range. A fast tokenizer's offsets, else the
    lengths of decoded prefixes."""
    try:
        encoded = tokenizer(text, return_offsets_mapping=True)
        offsets = [tuple(pair) for pair in encoded["offset_mapping"]]
        if len(offsets) == len(ids):
            return [(int(a), int(b)) for a, b in offsets]
    except (NotImplementedError, TypeError, ValueError):
        pass
    special = set(getattr(tokenizer, "all_special_ids", []))
    ranges, done = [], 0
    for k, token in enumerate(ids):
        if token in special:
            ranges.append((done, done))
            continue
        upto = len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True))
        ranges.append((min(done, upto), upto))
        done = upto
    return ranges


def _positions_of(
    spans: dict[str, tuple[int, int]], ranges: list[tuple[int, int]], where: str
) -> SpanPositions:
    """Each span's token positions: the tokens whose character range overlaps it.

    Raises:
        ValueError: a token in two spans, or a span that holds no token.
    """
    held: SpanPositions = {name: [] for name in spans}
    for pos, (start, end) in enumerate(ranges):
        owners = [name for name, (a, b) in spans.items() if end > start and start < b and a < end]
        if len(owners) > 1:
            raise ValueError(
                f"{where}: token {pos} (characters {start}-{end}) overlaps the spans "
                f"{owners}; a token belongs to one span, so move the boundary between them to "
                "a token boundary."
            )
        for name in owners:
            held[name].append(pos)
    empty = [name for name, positions in held.items() if not positions]
    if empty:
        raise ValueError(
            f"{where}: the span(s) {empty} hold no token of the tokenised text; give each span "
            "at least one character of a word."
        )
    return held


def span_positions(
    tokenizer: Any,
    prompt: Prompt,
    index: int,
    clean_ids: Sequence[int],
    corrupt_ids: Sequence[int] | None,
) -> SpanPositions | None:
    """Prompt ``index``'s spans as token positions of its clean text (None: it has no
    spans), checked against its corrupt text's spans when it names them.

    Raises:
        ValueError: a span holding no token or a token in two spans; a corrupt span
            holding other token positions than its clean span (patching reads both texts
            at the same positions).
    """
    if prompt.spans is None:
        return None
    where = f"Prompt {index} ({prompt.text!r:.60})"
    clean = _positions_of(prompt.spans, token_ranges(tokenizer, prompt.text, clean_ids), where)
    if prompt.corrupt_spans is None or corrupt_ids is None:
        return clean
    assert prompt.corrupt is not None  # ``Prompt`` refuses corrupt_spans without it
    corrupt = _positions_of(
        prompt.corrupt_spans,
        token_ranges(tokenizer, prompt.corrupt, corrupt_ids),
        f"{where}, corrupt text",
    )
    for name, positions in clean.items():
        if corrupt[name] != positions:
            raise ValueError(
                f"{where}: span {name!r} covers {len(positions)} token(s) at positions "
                f"{positions} of the clean text but {len(corrupt[name])} at "
                f"{corrupt[name]} of the corrupt one; patching reads both at the same "
                "positions, so reword the corrupt text to tokenize alike there."
            )
    return clean


def span_order(orders: Sequence[Sequence[str]]) -> tuple[list[str], bool]:
    """One order of the span names of many prompts, each listing its own in prompt order,
    and whether every prompt agrees with it: names placed before every name they precede
    in some prompt (ties by first appearance), ``OTHER`` last; when prompts disagree (a
    cycle), the order of first appearance."""
    first: list[str] = list(dict.fromkeys(name for order in orders for name in order))
    before: dict[str, set[str]] = {
        name: set() for name in first
    }  # name -> names that must come before it
    for order in orders:
        for k, name in enumerate(order):
            before[name].update(order[:k])
    placed: list[str] = []
    while len(placed) < len(first):
        ready = [n for n in first if n not in placed and before[n] <= set(placed)]
        if not ready:
            return [*first, OTHER], False
        placed.append(ready[0])
    consistent = all([n for n in placed if n in order] == list(order) for order in orders)
    return [*placed, OTHER], consistent


def n_cells(positions: str, width: int, span_names: Sequence[str] | None) -> int:
    """Cells per component: 1 ("all"), ``width`` ("each") or the number of spans."""
    if positions == "each":
        return width
    if positions == "spans":
        assert span_names is not None  # checked when the inputs are batched
        return len(span_names)
    return 1


def real_positions(mask: torch.Tensor) -> torch.Tensor:
    """(batch, seq) each padded index's position counted from its row's first real token
    (-1 at padding), whatever the padding side."""
    return torch.where(mask.bool(), mask.long().cumsum(-1) - 1, -1)


def cell_map(
    tokens: TokenBatch,
    positions: str,
    n: int,
    spans: Sequence[SpanPositions | None] | None = None,
    span_names: Sequence[str] | None = None,
) -> torch.Tensor:
    """(batch, seq, n) float: 1 where a padded token belongs to a cell, 0 elsewhere (and at
    padding).

    Args:
        tokens: the batch's padded tokens.
        positions: "all", "each" or "spans".
        n: cells per component (``n_cells``).
        spans: for "spans", each row's span positions (``span_positions``).
        span_names: for "spans", the cells' names in order (``span_order``).
    """
    mask = tokens.attention_mask
    where = real_positions(mask)
    if positions == "all":
        return mask.float()[..., None]
    if positions == "each":
        cells = torch.arange(n, device=mask.device)
        return (where[..., None] == cells).float()
    assert spans is not None and span_names is not None  # checked when batched
    index = {name: k for k, name in enumerate(span_names)}
    owner = torch.full_like(where, index[OTHER])
    for row, held in enumerate(spans):
        for name, at in (held or {}).items():
            owner[row, torch.isin(where[row], torch.tensor(at, device=mask.device))] = index[name]
    owner = torch.where(mask.bool(), owner, -1)
    return (owner[..., None] == torch.arange(n, device=mask.device)).float()
