"""The exact sweep core: a component replaced, the model re-run from the block it edits.

``_sweep_scorer`` measures (prompt, component) cells of one batch. The unedited run is made
once per batch and keeps the residual stream entering every block; a component of block
``l`` is then measured by resuming the pass at ``l`` (about half the model on average). The
variants of one block are stacked in the batch dimension (``variants_per_pass`` copies of
the batch per pass, each copy editing one component; ``_packed`` cuts the pieces into the
cheapest passes), so one pass measures many components; refine="auto"'s sweeps share each
batch's fixed passes (``_FixedPasses``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ...models import LensModel
from ...sweep import memory, metrics
from ...sweep.backend import Site, TokenBatch, get_backend, has_standing_edits, prefix_cache
from ...sweep.inputs import Batch, Inputs
from ...sweep.plan import Scores, top_is_target
from ...sweep.result import components

#: One column of a result: (site, head or None, cell or None): the component and the
#: position cell it is replaced in (``sweep/positions``; None: every position).
Variant = tuple[Site, "int | None", "int | None"]
#: A variant and the batch rows (a 1-D index tensor) an exact pass edits it on.
Piece = tuple[Variant, torch.Tensor]


def variants_of(inputs: Inputs) -> list[Variant]:
    """The columns of a result measured on ``inputs``: each component of
    ``components(inputs)`` in each of its ``inputs.n_cells`` position cells, cells last
    (cell None with ``positions="all"``)."""
    if inputs.positions == "all":
        return [(site, head, None) for site, head in components(inputs)]
    cells = range(inputs.n_cells)
    return [(site, head, cell) for site, head in components(inputs) for cell in cells]


def _sites(variants: list[Variant]) -> list[Site]:
    return list(dict.fromkeys(site for site, _, _ in variants))


def _index(head: int | None, rows: slice | torch.Tensor = slice(None)) -> tuple:
    """Index (rows, pos[, head]) into a site activation; ``rows`` a slice or 1-D indices."""
    return (rows, slice(None)) if head is None else (rows, slice(None), head)


def _stacked_edit(
    pieces: list[Piece], replacement, cells: torch.Tensor | None = None, cut: int = 0
):
    """Edit for a stacked pass: the rows of piece ``i`` (stacked in order) get its
    variant replaced, at every position (cell None) or at the positions of its cell.

    ``replacement(site, head, rows)`` -> tensor broadcastable to (len(rows), pos[, d]) for
    the batch rows ``rows`` (full width: one with a pos dim is cut to columns ``cut..``,
    those a pass over a suffix of the columns runs); ``cells``: the batch's (batch, seq,
    n_cells) cell map (``Batch.cells``), needed when a variant has a cell.
    """

    def edit(site: Site, value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        start = 0
        for (variant_site, head, cell), rows in pieces:
            if variant_site == site:
                stacked = _index(head, slice(start, start + len(rows)))
                new = replacement(site, head, rows)
                if cut and isinstance(new, torch.Tensor) and new.ndim >= 2:
                    new = new[:, cut:]
                if cell is not None:
                    assert cells is not None  # see Args
                    old = value[stacked]
                    at = cells[rows, cut:, cell].bool()
                    at = at.reshape(len(rows), -1, *[1] * (old.ndim - 2))
                    new = torch.where(at, torch.as_tensor(new, dtype=old.dtype).to(old), old)
                value[stacked] = new
            start += len(rows)
        return value

    return edit


def _site_means(inputs: Inputs, sites: list[Site], progress: bool) -> dict[Site, torch.Tensor]:
    """Mean activation of each site over all real tokens of all prompts: z (n_heads, d_head),
    blocks (d_model,)."""
    backend = get_backend(inputs.model, inputs.backend)
    sums: dict[Site, torch.Tensor] = {}
    count = 0
    for batch in tqdm(
        inputs.batches(), total=inputs.n_batches(), disable=not progress, desc="mean activations"
    ):
        with torch.no_grad():
            run = backend.run(batch.clean, sites=sites)
        mask = batch.clean.attention_mask.bool()
        count += int(mask.sum())
        for site in sites:
            total = run.acts[site][mask].double().sum(0)
            sums[site] = sums[site] + total if site in sums else total
    return {site: (total / count).to(inputs.model.dtype) for site, total in sums.items()}


def _layer_groups(variants: list[Variant], columns: list[int]) -> list[tuple[int, list[int]]]:
    """``columns`` of ``variants`` grouped by the block they edit: [(layer, [column, ...])]."""
    groups: dict[int, list[int]] = {}
    for column in columns:
        (_, layer), _, _ = variants[column]
        groups.setdefault(layer, []).append(column)
    return sorted(groups.items())


def _piece_starts(
    pieces: list[Piece], cells: torch.Tensor | None, read_pos: torch.Tensor
) -> list[int]:
    """The first column each piece edits: 0 for a piece with no cell (every position),
    else the first token of its cell over its rows (``cells``: ``Batch.cells``), at most
    its rows' first read position (``read_pos``: (batch,))."""
    starts = []
    for (_, _, cell), rows in pieces:
        if cell is None or cells is None:
            starts.append(0)
            continue
        at = cells[rows, :, cell].bool()
        first = torch.where(at.any(1), at.float().argmax(1), at.shape[1])
        starts.append(int(torch.minimum(first, read_pos[rows]).min()))
    return starts


def _edited_metric(
    backend: Any,
    metric: str,
    batch: Batch,
    source: str,
    pieces: list[Piece],
    unedited: Any,
    replacement: Callable,
    cut: int = 0,
    config: Any = None,
) -> torch.Tensor:
    """(sum of len(rows),) metric of one stacked pass: for each piece (variant, rows), the
    rows ``rows`` of ``batch``'s ``source`` tokens with the variant replaced, stacked in
    order and resumed from the unedited run's residual stream at the first piece's block
    (pieces in block order: the rows of a later block's piece run the blocks before it
    unedited).

    With ``cut`` > 0 (no piece edits a column before it) and the unedited run's keys and
    values kept (``unedited.cache``; ``config``: the HF model's config), the pass runs only
    the columns from ``cut`` on: the model is causal, so every earlier column is the
    unedited run's, at every block."""
    (_, layer), _, _ = pieces[0][0]
    stacked = torch.cat([rows for _, rows in pieces])
    tokens = getattr(batch, source).select(stacked)
    resume = None if layer == 0 else (layer, unedited.acts[("resid_pre", layer)][stacked])
    target, distractor = batch.target[stacked], batch.distractor[stacked]
    read = metrics.read_ids(metric, target, distractor)
    width = tokens.input_ids.shape[1]
    cache = None
    if cut and unedited.cache is not None:
        cache = prefix_cache(config, unedited.cache, stacked, cut, width)
    cut = cut if cache is not None else 0
    run = backend.run(
        tokens,
        sites=_sites([variant for variant, _ in pieces]),
        edit=_stacked_edit(pieces, replacement, batch.cells, cut),
        resume=resume,
        vocab=read,
        past=None if cache is None else (cut, cache),
    )
    return metrics.compute_read(metric, run.logits, target, distractor, read)


# What a stacked pass costs beside its rows' compute, in token-blocks (one token through
# one block): each block it runs has a fixed cost (hooks, kernel launches) of about
# BLOCK_OVERHEAD_TOKENS tokens, and the pass itself (tracing, final norm, unembedding)
# about PASS_OVERHEAD_BLOCKS blocks' worth. Measured on SmolLM2 and gemma3-270m, 2-core
# CPU, float32: 5-6 ms a block whatever the rows, against 0.06-0.12 ms a token-block.
BLOCK_OVERHEAD_TOKENS = 64
PASS_OVERHEAD_BLOCKS = 2


def _packed(
    pieces: list[tuple[Any, torch.Tensor]],
    budget: int,
    *,
    layers: Sequence[int],
    n_layers: int,
    width: int,
    starts: Sequence[int] | None = None,
) -> Iterator[list[tuple[Any, torch.Tensor]]]:
    """``pieces`` (anything, rows), in block order, cut into passes of at most ``budget``
    stacked rows (a piece larger than ``budget`` gets a pass of its own) at the least
    estimated cost.

    A pass resumes at its first piece's block ``l`` and runs every row through blocks
    ``l..n_layers-1``, so a row of a later block's piece runs blocks it need not: packing
    a block-17 piece after a block-1 piece costs it 16 blocks. A pass costs
    (n_layers - l) * (BLOCK_OVERHEAD_TOKENS + width * rows) + PASS_OVERHEAD_BLOCKS *
    BLOCK_OVERHEAD_TOKENS token-blocks; the cut is the cheapest one (dynamic programming
    over the cut points). A full sweep's pieces (every row of every component) fill one
    pass per block as before; sparse cells (refine) no longer run early blocks for rows
    of late ones. With ``starts``, a pass runs only the columns from its pieces' first
    start on, so ``width`` is ``width - min(starts)`` for it: a pass of late position
    cells is cheaper apart from early ones.

    Args:
        layers: (len(pieces),) the block each piece edits.
        width: tokens per row.
        starts: (len(pieces),) the first column each piece edits; None: 0 for all.
    """
    n = len(pieces)
    sizes = [len(rows) for _, rows in pieces]
    starts = [0] * n if starts is None else starts
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of the first j pieces
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        rows, first = 0, width
        for i in range(j - 1, -1, -1):  # the last pass holds pieces i..j-1
            rows += sizes[i]
            first = min(first, starts[i])
            if rows > budget and i < j - 1:
                break
            blocks = n_layers - layers[i]
            cost = blocks * (BLOCK_OVERHEAD_TOKENS + (width - first) * rows)
            cost += PASS_OVERHEAD_BLOCKS * BLOCK_OVERHEAD_TOKENS
            if best[i] + cost < best[j]:
                best[j], cut[j] = best[i] + cost, i
    ends = [n]
    while ends[-1]:
        ends.append(cut[ends[-1]])
    for start, end in itertools.pairwise(reversed(ends)):
        yield pieces[start:end]


def _write_changes(
    effects: torch.Tensor, chunk: list[tuple[int, torch.Tensor]], changes: torch.Tensor
) -> None:
    """Write one stacked pass's ``changes`` (its rows in ``chunk``'s order) into ``effects``
    (rows, n_components) at each piece's (rows, column)."""
    start = 0
    for column, rows in chunk:
        effects[rows.cpu(), column] = changes[start : start + len(rows)].float().cpu()
        start += len(rows)


def _unedited(
    backend: Any,
    metric: str,
    batch: Batch,
    tokens: TokenBatch,
    sites: list[Site],
    read: torch.Tensor | None,
    keep_cache: bool = False,
) -> tuple[Any, torch.Tensor]:
    """The unedited pass over ``tokens`` keeping ``sites`` (and its keys and values, with
    ``keep_cache``), unembedding the ids ``read`` only (all when None), and its metric
    (rows,)."""
    run = backend.run(tokens, sites=sites, vocab=read, keep_cache=keep_cache)
    value = metrics.compute_read(metric, run.logits, batch.target, batch.distractor, read)
    return run, metrics.check_finite(value, batch.index, metric)


class _FixedPasses:
    """Each batch's fixed passes of an exact sweep (its unedited run with the residual
    stream entering every block, that run's metric, and the replacement), kept for the
    sweeps of the same call that measure other cells of the batch (refine="auto"'s two
    stages), up to ``budget`` bytes; filled by the first sweep over a batch, or by
    activation patching's estimate, whose clean and corrupt passes are these (measured:
    they were a third of refine="auto"'s time on gemma3-270m heads). A pickled copy (a
    plan sent to another process) keeps none."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.entries: dict[tuple, tuple] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"budget": self.budget, "used": 0, "entries": {}}

    def get(self, key: tuple) -> tuple | None:
        return self.entries.get(key)

    def put(self, key: tuple, passes: tuple, size: int) -> None:
        """Keep ``passes`` of ``size`` bytes if the budget allows."""
        if self.used + size <= self.budget:
            self.entries[key] = passes
            self.used += size


def _fixed_key(batch: Batch, read: torch.Tensor | None, decides_correct: bool) -> tuple:
    """What ``_FixedPasses`` keys a batch's passes by: its prompts, whether its passes
    unembed every token (``read`` None) or only the ids the metric reads, and whether they
    hold the clean logits that decide whether the model answers each prompt."""
    return tuple(batch.index.tolist()), read is None, decides_correct


def _blocks_done(groups: list[tuple[int, list[int]]], layers: list[int], index: int) -> int:
    """How many blocks of ``groups`` (``_layer_groups``) a sweep has finished once its
    pieces (in block order, editing blocks ``layers``) up to piece ``index`` are measured."""
    layer = layers[index]
    last_of_block = index + 1 == len(layers) or layers[index + 1] != layer
    return sum(1 for block, _ in groups if block < layer) + int(last_of_block)


def _batch_passes(
    inputs: Inputs,
    backend: Any,
    batch: Batch,
    source: str,
    resid_sites: list[Site],
    read: torch.Tensor | None,
    replacement_for: Callable,
    kept: _FixedPasses | None,
    key: tuple,
) -> tuple:
    """A batch's fixed passes (unedited run, its metric, the replacement and the clean
    logits, as ``_sweep_scorer`` documents them), from ``kept`` or made (and kept there).

    By position, the unedited run also keeps its keys and values, so the edited passes
    skip the columns before a cell; not under a standing edit, which may read every
    column of a pass."""
    passes = None if kept is None else kept.get(key)
    if passes is not None:
        return passes
    model, tokens = inputs.model, getattr(batch, source)
    suffix = inputs.positions != "all" and backend.runs_suffix and not has_standing_edits(model)
    unedited, base = _unedited(
        backend, inputs.metric, batch, tokens, resid_sites, read, keep_cache=suffix
    )
    replacement, clean_logits = replacement_for(batch, read is None)
    if kept is not None:
        width = _site_width(model, inputs.level) + (_cache_width(model) if suffix else 0)
        resid = sum(a.numel() * a.element_size() for a in unedited.acts.values())
        size = resid + tokens.input_ids.numel() * width * memory.element_bytes(model.dtype)
        kept.put(key, (unedited, base, replacement, clean_logits), size)
    return unedited, base, replacement, clean_logits


# long: one closure per sweep: fixed passes (made or kept), packing, progress steps
def _sweep_scorer(
    inputs: Inputs,
    *,
    source: str,
    replacement_for,
    variants_per_pass: int | None,
    cells: torch.Tensor | None = None,
    correct: torch.Tensor | None = None,
    kept: _FixedPasses | None = None,
) -> Callable[[Batch, Callable], Scores]:
    """``score(batch, step)``: metric change when each component is replaced (in each of
    its position cells), (rows, n_columns), and whether the model answers each clean
    prompt correctly.

    Args:
        source: which tokens the edited passes run on, "clean" or "corrupt".
        replacement_for: ``(batch, whole_vocab) -> (replacement(site, head, rows), clean
            logits)``: ``replacement`` gives the new value of a component for the batch
            rows ``rows`` (a 1-D index tensor); the clean logits (rows, vocab) at the read
            position come from a clean pass it makes (unembedding every token only when
            ``whole_vocab``), or are None when ``source`` is "clean" (the unedited pass is
            the clean one) or not ``whole_vocab``.
        variants_per_pass: a pass stacks at most this many copies of the batch's rows;
            None: as many as a block has components, or fewer if they do not fit the
            memory budget.
            The pieces (component, rows measured) go in block order, so a pass whose
            pieces span blocks resumes at its first piece's block.
        cells: (n_prompts, n_columns) bool, the cells to measure (prompts in prompt-list
            order, columns in ``variants_of(inputs)`` order); the others are NaN, as are
            the position cells a prompt does not have (``Inputs.valid_cells``). A pass
            stacks only the rows a column is measured on. None: every cell.
        correct: (n_prompts,) bool, known from an earlier pass (refine="auto"'s estimate):
            then every pass unembeds only what the metric reads (``metrics.read_ids``) and
            a batch with no cell to measure makes no pass. None: from the sweep's passes.
        kept: each batch's unedited and replacement passes, shared with the call's other
            sweeps (they keep the residual stream entering every block), or None.
    """
    model, metric = inputs.model, inputs.metric
    backend = get_backend(model, inputs.backend)
    variants = variants_of(inputs)
    valid = inputs.valid_cells().repeat(1, len(variants) // inputs.n_cells)
    cells = valid if cells is None else cells & valid
    columns = [c for c in range(len(variants)) if cells[:, c].any()]
    groups = _layer_groups(variants, columns)
    # A pass holds as many rows as a full sweep's pass over one block would.
    per_block = max(len(group) for _, group in _layer_groups(variants, list(range(len(variants)))))
    if kept is None:
        resid_sites = [("resid_pre", layer) for layer, _ in groups if layer > 0]
    else:  # another sweep may resume anywhere
        resid_sites = [("resid_pre", layer) for layer in range(1, model.spec.n_layers)]
    config = model.hf.config

    def score(batch: Batch, step) -> Scores:
        tokens = getattr(batch, source)
        rows = len(batch.index)
        wanted = cells[batch.index]  # (rows, n_components): the cells to measure
        effects = torch.full((rows, len(variants)), float("nan"))
        if correct is not None and not wanted.any():  # nothing to measure: no pass
            for _ in range(model.spec.n_layers):
                step()
            return Scores(effects, correct[batch.index.cpu()])
        on_device = wanted.to(batch.target.device)
        per_pass = variants_per_pass or memory.auto_variants_per_pass(
            model,
            rows=rows,
            width=tokens.input_ids.shape[1],
            wanted=per_block,
        )
        # (component, rows measured), in block order.
        pieces = [(c, on_device[:, c].nonzero()[:, 0]) for _, group in groups for c in group]
        pieces = [(c, chosen) for c, chosen in pieces if len(chosen)]
        read = None if correct is None else metrics.read_ids(metric, batch.target, batch.distractor)
        key = _fixed_key(batch, read, correct is None)
        with torch.no_grad():
            unedited, base, replacement, clean_logits = _batch_passes(
                inputs, backend, batch, source, resid_sites, read, replacement_for, kept, key
            )
            if correct is None:
                clean = unedited.logits if clean_logits is None else clean_logits
                right = top_is_target(clean, batch.target)
            done = 0  # progress: one step per block, once its last piece is measured
            start_of: dict[int, int] = {}
            if unedited.cache is not None:  # each block's pieces by their first column
                found = [(variants[c], chosen) for c, chosen in pieces]
                starts = _piece_starts(found, batch.cells, tokens.read_pos)
                start_of = {c: start for (c, _), start in zip(pieces, starts, strict=True)}
                pieces.sort(key=lambda piece: (variants[piece[0]][0][1], start_of[piece[0]]))
            layers = [variants[c][0][1] for c, _ in pieces]
            starts = [start_of.get(c, 0) for c, _ in pieces]
            width, measured = tokens.input_ids.shape[1], 0
            for chunk in _packed(
                pieces,
                per_pass * rows,
                layers=layers,
                n_layers=model.spec.n_layers,
                width=width,
                starts=starts,
            ):
                edited = [(variants[c], chosen) for c, chosen in chunk]
                cut = min(start_of.get(c, 0) for c, _ in chunk)
                value = _edited_metric(
                    backend, metric, batch, source, edited, unedited, replacement, cut, config
                )
                _write_changes(effects, chunk, value - base[torch.cat([r for _, r in chunk])])
                measured += len(chunk)
                finished = _blocks_done(groups, layers, measured - 1)
                for _ in range(finished - done):
                    step()
                done = finished
            for _ in range(model.spec.n_layers - done):  # blocks with nothing left to measure
                step()
        metrics.check_finite(torch.where(wanted, effects, 0.0), batch.index, metric)
        return Scores(effects, right if correct is None else correct[batch.index.cpu()])

    return score


def _cache_width(model: LensModel) -> int:
    """Numbers per token of a pass's keys and values over every layer (kept by an exact
    sweep by position)."""
    spec = model.spec
    return 2 * spec.n_layers * spec.n_kv_heads * spec.d_head


def _site_width(model: LensModel, level: str) -> int:
    """Numbers per token of every site a ``level`` sweep or estimate reads (z: n_heads x
    d_head per layer; blocks: the attention and MLP outputs, 2 x d_model per layer; the
    residual stream: d_model per layer)."""
    spec = model.spec
    per_layer = {
        "head": spec.n_heads * spec.d_head,
        "block": 2 * spec.d_model,
        "resid": spec.d_model,
    }
    heads_and_blocks = per_layer["head"] + per_layer["block"]
    return spec.n_layers * (heads_and_blocks if level == "all" else per_layer[level])
