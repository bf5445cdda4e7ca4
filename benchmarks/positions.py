"""Where in the prompt: exact patching by position and by span, against two independent
computations, and what it costs.

On the bundled model and IOI pairs:

- **Agreement, by position** (prompts of one length, as TransformerLens needs): lenscape's
  ``activation_patching(level="resid" | "block" | "head", positions="each")`` against
  (a) a plain-hook computation written here from the Hugging Face modules (a pre-hook on
  block ``l`` or on its ``o_proj``, one unpadded forward per cell and prompt; heads on a
  few layers, to bound its time) and (b) TransformerLens 4.3's own
  ``get_act_patch_resid_pre``, ``get_act_patch_block_every`` and
  ``get_act_patch_attn_head_out_by_pos`` on a ``TransformerBridge`` (per prompt,
  ``reduce="none"``, minus the corrupt run's metric). Heads are SmolLM2's 9 query heads on
  3 KV heads: the per-head output is the o_proj input, so grouped-query attention needs no
  special case and nothing is copied out per query head.
- **Agreement, by span** (prompts of different lengths from every template, in one call):
  heads patched at all of a span's tokens together against the plain hooks, and each
  estimator's span cells against its all-positions score (they add up).
- **Speed, alone**: resid x position and head x position exact patching, lenscape against
  those TransformerLens functions on the same prompts (goal >= 3x); AtP by position
  against AtP over all positions, median of interleaved rounds (goal <= 1.1x).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("TQDM_DISABLE", "1")  # read at import: TransformerLens' bars

import _report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _helpers import span_positions_by_rule

import lenscape as lsc
from lenscape.sweep.backend import get_backend


def one_length(model, n: int) -> lsc.data.PromptSet:
    """The first ``n`` IOI pairs of the most common token length."""
    by_length: dict[int, list] = {}
    for p in lsc.data.prompts("ioi"):
        by_length.setdefault(len(model.tokenizer(p.text)["input_ids"]), []).append(p)
    chosen = max(by_length.values(), key=len)[:n]
    width = len(model.tokenizer(chosen[0].text)["input_ids"])
    return lsc.data.PromptSet(chosen, name=f"ioi-{len(chosen)}x{width}tok")


def every_template(n: int) -> lsc.data.PromptSet:
    """``n`` IOI pairs spread over the templates (their lengths differ)."""
    return lsc.data.prompts("ioi").sample(n, seed=0)


def ids_of(model, prompt):
    tok = model.tokenizer
    clean = torch.tensor([tok(prompt.text)["input_ids"]])
    corrupt = torch.tensor([tok(prompt.corrupt)["input_ids"]])
    target, other = (
        tok(t, add_special_tokens=False)["input_ids"][0] for t in (prompt.target, prompt.distractor)
    )
    return clean, corrupt, target, other


def plain_patching(model, prompt, level, cells, layers):
    """(len(layers), [head,] len(cells)) exact patching by hand: a pre-hook on block ``l``
    (level "resid") or on its ``o_proj`` (level "head") writes the clean run's values at a
    cell's positions into the corrupt run; effect = logit difference change."""
    spec, hf = model.spec, model.hf
    clean_ids, corrupt_ids, target, other = ids_of(model, prompt)
    blocks = hf.model.layers

    def module(layer):
        return blocks[layer] if level == "resid" else blocks[layer].self_attn.o_proj

    def first_input(args, kwargs):
        return args[0] if args else kwargs["hidden_states"]

    def run(ids, layer=None, edit=None):
        handles, seen = [], {}
        for at in layers:

            def hook(mod, args, kwargs, at=at):
                value = first_input(args, kwargs)
                seen[at] = value.detach().clone()
                if at != layer or edit is None:
                    return None
                value = edit(value.clone())
                if args:
                    return (value, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": value}

            handles.append(module(at).register_forward_pre_hook(hook, with_kwargs=True))
        try:
            with torch.no_grad():
                logits = hf(ids).logits[0, -1]
        finally:
            for handle in handles:
                handle.remove()
        return float(logits[target] - logits[other]), seen

    _, clean = run(clean_ids)
    base, _ = run(corrupt_ids)
    parts = [None] if level == "resid" else list(range(spec.n_heads))
    out = np.full((len(layers), len(parts), len(cells)), np.nan)
    for i, layer in enumerate(layers):
        for k, head in enumerate(parts):
            cols = (
                slice(None) if head is None else slice(head * spec.d_head, (head + 1) * spec.d_head)
            )
            for c, positions in enumerate(cells):
                if not positions:
                    continue

                def edit(value, at=positions, cols=cols, layer=layer):
                    value[0, at, cols] = clean[layer][0, at, cols]
                    return value

                out[i, k, c] = run(corrupt_ids, layer, edit)[0] - base
    return out[:, 0] if level == "resid" else out


#: The named functions' (patch setter, activation) in transformer_lens/patching.py.
SUBSET_SWEEPS = {
    "get_act_patch_attn_head_out_by_pos": ("layer_pos_head_vector_patch_setter", "z"),
    "get_act_patch_attn_out": ("layer_pos_patch_setter", "attn_out"),
    "get_act_patch_mlp_out": ("layer_pos_patch_setter", "mlp_out"),
}


def transformer_lens(model, prompts, function, layers=None, heads=False):
    """(prompt, *axes) effects from ``transformer_lens.patching.<function>``; with
    ``layers``, only those layers' cells (its ``index_df``): (prompt, len(layers), pos[,
    head])."""
    import pandas as pd
    from transformer_lens import patching

    bridge = get_backend(model, "transformer_lens").bridge
    pairs = [ids_of(model, p) for p in prompts]
    clean = torch.cat([c for c, _, _, _ in pairs])
    corrupt = torch.cat([k for _, k, _, _ in pairs])
    target = torch.tensor([t for _, _, t, _ in pairs])
    other = torch.tensor([o for _, _, _, o in pairs])
    rows = torch.arange(len(prompts))

    def metric(logits):
        return logits[rows, -1, target] - logits[rows, -1, other]

    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean)
        base = metric(bridge(corrupt))
        extra = {}
        if layers is not None:
            axes = [layers, range(clean.shape[1])] + ([range(model.spec.n_heads)] if heads else [])
            names = ["layer", "pos"] + (["head"] if heads else [])
            extra["index_df"] = pd.DataFrame(list(itertools.product(*axes)), columns=names)
        if layers is None:
            got = getattr(patching, function)(bridge, corrupt, cache, metric, reduce="none")
        else:  # the generic sweep the named function is a partial of, on chosen cells
            setter, name = SUBSET_SWEEPS[function]
            got = patching.generic_activation_patch(
                bridge,
                corrupt,
                cache,
                metric,
                patch_setter=getattr(patching, setter),
                activation_name=name,
                reduce="none",
                **extra,
            )
    values = np.moveaxis((got.values - base).numpy(), -1, 0)  # batch first
    if layers is not None:
        shape = [len(layers), clean.shape[1]] + ([model.spec.n_heads] if heads else [])
        values = values.reshape(len(prompts), *shape)
    return values


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def largest_gap(ours, theirs) -> tuple[float, float]:
    """(largest |difference|, largest |reference|) over the cells both compute."""
    ours, theirs = np.asarray(ours, dtype=float), np.asarray(theirs, dtype=float)
    both = np.isfinite(ours) & np.isfinite(theirs)
    return float(np.abs(ours - theirs)[both].max()), float(np.abs(theirs)[both].max())


def span_cells(model, prompt, names):
    """Each span's token positions by the rule (characters overlap), in ``names``' order."""
    held = span_positions_by_rule(model.tokenizer, prompt)
    return [held.get(name, []) for name in names]


def agreement_rows(model, same, mixed, plain_layers) -> tuple[list[list], dict]:
    """The agreement table's rows and the timed exact runs (name -> seconds, result)."""
    rows, runs = [], {}
    for level in ("resid", "block", "head"):
        runs[level] = timed(
            lambda level=level: lsc.activation_patching(
                model, same, level=level, positions="each", batch_size=len(same), progress=False
            )
        )[::-1]
    resid, heads = runs["resid"][1], runs["head"][1]
    width = resid.sizes["pos"]
    cells = [[pos] for pos in range(width)]
    plain_resid = np.stack(
        [plain_patching(model, p, "resid", cells, range(model.spec.n_layers)) for p in same]
    )
    gap = largest_gap(resid.values, plain_resid)
    rows.append(["resid x pos", "plain hooks (every layer)", same.name, *gap])
    plain_heads = np.stack([plain_patching(model, p, "head", cells, plain_layers) for p in same])
    ours = heads.sel(layer=list(plain_layers)).transpose("prompt", "layer", "head", "pos").values
    rows.append(
        [
            "head x pos",
            f"plain hooks (layers {list(plain_layers)})",
            same.name,
            *largest_gap(ours, plain_heads),
        ]
    )
    tl_times = {}
    theirs, tl_times["resid"] = timed(
        lambda: transformer_lens(model, same, "get_act_patch_resid_pre")
    )
    rows.append(
        [
            "resid x pos",
            "TransformerLens `get_act_patch_resid_pre`",
            same.name,
            *largest_gap(resid.values, theirs),
        ]
    )
    layers = list(plain_layers)
    theirs, tl_times["head_subset"] = timed(
        lambda: transformer_lens(
            model, same, "get_act_patch_attn_head_out_by_pos", layers, heads=True
        )
    )
    ours = heads.sel(layer=layers).transpose("prompt", "layer", "pos", "head").values
    rows.append(
        [
            "head x pos",
            f"TransformerLens `get_act_patch_attn_head_out_by_pos` (layers {layers})",
            same.name,
            *largest_gap(ours, theirs),
        ]
    )
    blocks = runs["block"][1]
    for component, function in (
        ("attn", "get_act_patch_attn_out"),
        ("mlp", "get_act_patch_mlp_out"),
    ):
        theirs = transformer_lens(model, same, function, layers)
        ours = blocks.sel(component=component, layer=layers).values
        rows.append(
            [
                f"{component} x pos",
                f"TransformerLens `{function}` (layers {layers})",
                same.name,
                *largest_gap(ours, theirs),
            ]
        )
    by_span = lsc.activation_patching(model, mixed, level="head", positions="spans", progress=False)
    names = list(by_span["span"].values)
    plain_spans = [
        plain_patching(model, p, "head", span_cells(model, p, names), plain_layers) for p in mixed
    ]
    ours = by_span.sel(layer=list(plain_layers)).values
    rows.append(
        [
            "head x span",
            f"plain hooks (layers {list(plain_layers)})",
            mixed.name,
            *largest_gap(ours, np.stack(plain_spans)),
        ]
    )
    return rows, {"runs": runs, "tl": tl_times}


def atp_ratio(model, prompts, rounds: int) -> tuple[float, float, float]:
    """Median seconds of AtP over all positions and by position (interleaved), and the
    largest |sum over positions - all positions| relative to the largest score."""
    times = {"all": [], "each": []}
    for _ in range(rounds):
        for positions in ("all", "each"):
            result, took = timed(
                lambda positions=positions: lsc.attribution_patching(
                    model, prompts, level="all", positions=positions, progress=False
                )
            )
            times[positions].append(took)
            if positions == "all":
                whole = result
            else:
                each = result
    gap = max(
        float(np.abs(each[name].sum("pos") - whole[name]).max() / np.abs(whole[name]).max())
        for name in ("heads", "blocks")
    )
    return statistics.median(times["all"]), statistics.median(times["each"]), gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=4, help="pairs of one length")
    parser.add_argument("--mixed", type=int, default=5, help="pairs of several lengths")
    parser.add_argument("--rounds", type=int, default=5)
    args = _report.parse_args(parser, model="tiny", prompts=2, mixed=3, rounds=1)
    tiny = args.model == "tiny"
    model = lsc.models.tiny("llama", n_layers=3) if tiny else lsc.load(args.model)
    get_backend(model, "transformer_lens")  # boot outside the timing
    same, mixed = one_length(model, args.prompts), every_template(args.mixed)
    lsc.attribution_patching(model, same[:1], progress=False)  # warm the nnsight backend
    n = model.spec.n_layers
    plain_layers = sorted({0, n // 2, n - 1})
    rows, timing = agreement_rows(model, same, mixed, plain_layers)
    print(f"{model.name}: {same.name}, {mixed.name}")
    table = [
        [*_report.stamp(), model.name, *row[:3], f"{row[3]:.1e}", f"{row[4]:.3g}"] for row in rows
    ]
    for row in table:
        print("  ", row)
    n_layers, n_heads = model.spec.n_layers, model.spec.n_heads
    width = timing["runs"]["resid"][1].sizes["pos"]
    ours_resid, ours_heads = timing["runs"]["resid"][0], timing["runs"]["head"][0]
    # TransformerLens's cost is one forward pass of the batch per cell, whichever cell: its
    # head sweep is timed on the layers above and scaled to every layer.
    cells = n_layers * width * n_heads
    subset = len(plain_layers) * width * n_heads
    tl_heads = timing["tl"]["head_subset"] * cells / subset
    speed = [
        [
            *_report.stamp(),
            model.name,
            same.name,
            f"resid x pos ({n_layers * width} cells)",
            f"{ours_resid:.1f} s",
            f"{timing['tl']['resid']:.1f} s (measured)",
            f"{timing['tl']['resid'] / ours_resid:.1f}x",
        ],
        [
            *_report.stamp(),
            model.name,
            same.name,
            f"head x pos ({cells} cells)",
            f"{ours_heads:.1f} s",
            f"{tl_heads:.1f} s ({timing['tl']['head_subset']:.1f} s measured on {subset} "
            "cells, scaled)",
            f"{tl_heads / ours_heads:.1f}x",
        ],
    ]
    for row in speed:
        print("  ", row)
    t_all, t_each, gap = atp_ratio(model, mixed, args.rounds)
    print(
        f"  AtP all {t_all:.2f} s, by position {t_each:.2f} s ({t_each / t_all:.2f}x), "
        f"sums {gap:.1e}"
    )
    body = "\n\n".join(
        [
            "Agreement (largest |difference| over the cells both compute, and the largest "
            "|effect| of the reference, logit difference):",
            _report.table(
                [
                    "date",
                    "machine",
                    "model",
                    "cells",
                    "reference",
                    "prompts",
                    "max abs diff",
                    "max abs effect",
                ],
                table,
            ),
            "Speed (the same prompts, one batch; TransformerLens runs one forward pass of the "
            "batch per cell):",
            _report.table(
                [
                    "date",
                    "machine",
                    "model",
                    "prompts",
                    "cells",
                    "lenscape",
                    "TransformerLens",
                    "speed-up",
                ],
                speed,
            ),
            "AtP by position against AtP over all positions (level='all', median of "
            f"{args.rounds} interleaved rounds):",
            _report.table(
                [
                    "date",
                    "machine",
                    "model",
                    "prompts",
                    "AtP all positions",
                    "AtP by position",
                    "ratio",
                    "max |sum over pos - all| / max |score|",
                ],
                [
                    [
                        *_report.stamp(),
                        model.name,
                        mixed.name,
                        f"{t_all:.2f} s",
                        f"{t_each:.2f} s",
                        f"{t_each / t_all:.2f}x",
                        f"{gap:.1e}",
                    ]
                ],
            ),
        ]
    )
    _report.emit(
        args,
        _report.section(
            "positions",
            "Where in the prompt: patching by position and span",
            __doc__.split("\n\n", 1)[1],
            body,
        ),
    )


if __name__ == "__main__":
    main()
