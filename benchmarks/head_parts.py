"""The parts of a head by position on the bundled model, against two independent computations.

lenscape's ``activation_patching(part="q" | "k" | "v" | "pattern", positions="each")`` on
IOI pairs of one length, against (a) plain hooks written in the tests (``tests/test_parts.py``:
a forward hook on the query/key/value projection, or, for the pattern, an attention function
of our own that swaps one head's weights at one query position; one unpadded forward per cell)
and (b) TransformerLens 4.3's ``generic_activation_patch`` with the setters of its
``get_act_patch_attn_head_{q,k,v,pattern}_by_pos`` on a ``TransformerBridge``. Both
references run on a few layers to bound their time (one forward per cell). SmolLM2 has 9
query heads on 3 key/value heads: keys and values are patched per key/value head (the
TransformerLens sweep is given the 3 key/value heads as its index, where its named k/v
functions would walk the 9 query heads, TransformerLens #980).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("TQDM_DISABLE", "1")  # read at import: TransformerLens' bars

import _report
from positions import ids_of, largest_gap, one_length

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_parts import hand_part_patching, hand_pattern_patching

import lenscape as lsc
from lenscape.sweep.backend import get_backend

#: part -> (TransformerLens patch setter, hook name, index axes after "layer").
SETTERS = {
    "q": ("layer_pos_head_vector_patch_setter", "q", ("pos", "head")),
    "k": ("layer_pos_head_vector_patch_setter", "k", ("pos", "head")),
    "v": ("layer_pos_head_vector_patch_setter", "v", ("pos", "head")),
    "pattern": ("layer_head_pos_pattern_patch_setter", "pattern", ("head", "dest_pos")),
}


def transformer_lens_part(model, prompts, part, layers):
    """(prompt, len(layers), heads, pos) effects of TransformerLens's sweep of ``part`` on
    ``layers`` (heads: the key/value heads for "k" and "v")."""
    import pandas as pd
    from transformer_lens import patching

    bridge = get_backend(model, "transformer_lens").bridge
    pairs = [ids_of(model, p) for p in prompts]
    clean = torch.cat([c for c, _, _, _ in pairs])
    corrupt = torch.cat([k for _, k, _, _ in pairs])
    target = torch.tensor([t for _, _, t, _ in pairs])
    other = torch.tensor([o for _, _, _, o in pairs])
    rows = torch.arange(len(prompts))
    spec = model.spec
    heads = spec.n_kv_heads if part in ("k", "v") else spec.n_heads
    width = clean.shape[1]

    def metric(logits):
        return logits[rows, -1, target] - logits[rows, -1, other]

    setter, name, axes = SETTERS[part]
    ranges = {"pos": range(width), "dest_pos": range(width), "head": range(heads)}
    names = ["layer", *[{"head": "head_index"}.get(a, a) for a in axes]]
    index = pd.DataFrame(list(itertools.product(layers, *[ranges[a] for a in axes])), columns=names)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean)
        base = metric(bridge(corrupt))
        got = patching.generic_activation_patch(
            bridge,
            corrupt,
            cache,
            metric,
            patch_setter=getattr(patching, setter),
            activation_name=name,
            index_df=index,
            reduce="none",
        )
    values = np.moveaxis((got.values - base).numpy(), -1, 0)  # batch first
    values = values.reshape(len(prompts), len(layers), *[len(ranges[a]) for a in axes])
    return values if part == "pattern" else values.transpose(0, 1, 3, 2)  # (.., head, pos)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=1, help="pairs of one length")
    parser.add_argument("--parts", default="q,k,v,pattern", help="comma-separated")
    args = _report.parse_args(parser, model="tiny", prompts=1)
    model = lsc.models.tiny("llama", n_layers=3) if args.model == "tiny" else lsc.load(args.model)
    same = one_length(model, args.prompts)
    n = model.spec.n_layers
    layers = sorted({0, n // 2, n - 1})
    rows = []
    for part in args.parts.split(","):
        ours = lsc.activation_patching(model, same, part=part, positions="each", progress=False)
        ours = ours.sel(layer=layers).transpose("prompt", "layer", ..., "pos").values
        hand = hand_pattern_patching if part == "pattern" else hand_part_patching
        extra = () if part == "pattern" else (part,)
        plain = np.stack([hand(model, p, *extra, layers=layers) for p in same])
        theirs = transformer_lens_part(model, same, part, layers)
        head_dim = "kv_head" if part in ("k", "v") else "head"
        for reference, values in (("plain hooks", plain), ("TransformerLens", theirs)):
            gap, scale = largest_gap(ours, values)
            rows.append([part, head_dim, reference, f"{gap:.1e}", f"{scale:.3g}"])
            print("  ", rows[-1], flush=True)
    body = (
        f"{same.name} ({len(same)} pairs), layers {layers}; largest |difference| over the "
        "cells both compute, and the largest |effect| of the reference (logit difference):\n\n"
        + _report.table(
            [
                "date",
                "machine",
                "model",
                "part",
                "per",
                "reference",
                "max abs diff",
                "max abs effect",
            ],
            [[*_report.stamp(), model.name, *row] for row in rows],
        )
    )
    _report.emit(
        args,
        _report.section(
            "head_parts",
            "The parts of a head by position, against plain hooks and TransformerLens",
            __doc__.split("\n\n", 1)[1],
            body,
        ),
    )


if __name__ == "__main__":
    main()
