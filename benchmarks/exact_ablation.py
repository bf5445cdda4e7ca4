"""Exact per-head zero-ablation of every head: lenscape against two baselines.

All three compute metric(head zeroed) - metric(clean) (logit difference at the last token)
for every head of the bundled model on the same prompts, in one run each:

- lenscape: ``lsc.ablation(kind="zero", level="head")``; the clean run is done once and
  keeps the residual stream entering every block, each block's heads are then stacked in
  the batch and only blocks l..L-1 are re-run.
- plain loop: one HF forward of the whole prompt batch per head, a forward-pre-hook on
  that layer's ``o_proj`` zeroing the head's slice. Timed as HF runs by default (logits at
  every position) and with ``logits_to_keep`` at the last token (what lenscape unembeds).
- TransformerLens: ``transformer_lens.patching.get_act_patch_attn_head_out_all_pos`` on a
  ``TransformerBridge`` with a cache of zeros as the "clean" activations (so patching
  means zeroing), per-prompt results (``reduce="none"``).

The prompts all have the same token count: the TransformerLens utility passes no
attention mask, so padding would change its numbers. Target: lenscape >= 2x faster than
each baseline with the same numbers.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import numpy as np
import torch

os.environ.setdefault("TQDM_DISABLE", "1")  # read at import: TransformerLens' per-head bar

import _report

import lenscape as lsc
from lenscape.sweep.backend import get_backend


def same_length_prompts(model, n: int):
    """The first ``n`` factual prompts of the most common token length."""
    factual = lsc.data.prompts("factual")
    lengths = [len(model.tokenizer(p.text)["input_ids"]) for p in factual]
    common = collections.Counter(lengths).most_common(1)[0][0]
    chosen = [p for p, n_tok in zip(factual, lengths, strict=True) if n_tok == common][:n]
    return lsc.data.PromptSet(chosen, name=f"factual-{len(chosen)}x{common}tok")


def token_ids(model, prompts):
    tok = model.tokenizer
    ids = torch.tensor([tok(p.text)["input_ids"] for p in prompts])
    target = torch.tensor(
        [tok(p.target, add_special_tokens=False)["input_ids"][0] for p in prompts]
    )
    distractor = torch.tensor(
        [tok(p.distractor, add_special_tokens=False)["input_ids"][0] for p in prompts]
    )
    return ids, target, distractor


def plain_loop(model, prompts, *, read_only: bool) -> np.ndarray:
    """(prompt, layer, head) by one HF forward per head with an o_proj pre-hook."""
    spec, hf = model.spec, model.hf
    ids, target, distractor = token_ids(model, prompts)
    rows = torch.arange(len(prompts))
    keep = {"logits_to_keep": 1} if read_only else {}

    def logit_diff() -> torch.Tensor:
        logits = hf(input_ids=ids, **keep).logits[:, -1]
        return logits[rows, target] - logits[rows, distractor]

    out = np.zeros((len(prompts), spec.n_layers, spec.n_heads))
    with torch.no_grad():
        base = logit_diff()
        for layer in range(spec.n_layers):
            o_proj = model.module(spec.layout.o_proj, layer)
            for head in range(spec.n_heads):

                def zero_head(module, args, head=head):
                    z = args[0].clone()
                    z[..., head * spec.d_head : (head + 1) * spec.d_head] = 0
                    return (z, *args[1:])

                handle = o_proj.register_forward_pre_hook(zero_head)
                try:
                    out[:, layer, head] = (logit_diff() - base).numpy()
                finally:
                    handle.remove()
    return out


def transformer_lens_utility(model, prompts) -> np.ndarray:
    """(prompt, layer, head) from TransformerLens' per-head patching utility."""
    from transformer_lens import patching

    spec = model.spec
    bridge = get_backend(model, "transformer_lens").bridge
    ids, target, distractor = token_ids(model, prompts)
    rows = torch.arange(len(prompts))
    zeros = {
        f"blocks.{layer}.attn.hook_z": torch.zeros(
            len(prompts), ids.shape[1], spec.n_heads, spec.d_head
        )
        for layer in range(spec.n_layers)
    }

    def logit_diff(logits):
        return logits[rows, -1, target] - logits[rows, -1, distractor]

    with torch.no_grad():
        base = logit_diff(bridge(ids))
        patched = patching.get_act_patch_attn_head_out_all_pos(
            bridge, ids, zeros, logit_diff, reduce="none"
        )
    # (layer, head, batch) -> (batch, layer, head)
    values = patched.values.reshape(spec.n_layers, spec.n_heads, len(prompts))
    return (values - base).permute(2, 0, 1).numpy()


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = _report.parse_args(parser, model="tiny", prompts=4)
    model = (
        lsc.models.tiny("llama", n_layers=4)
        if args.model == "tiny"
        else lsc.load(args.model, device=args.device)
    )
    prompts = same_length_prompts(model, args.prompts)
    get_backend(model, "transformer_lens")  # boot outside the timing
    ours, t_ours = timed(
        lambda: (
            lsc.ablation(
                model, prompts, kind="zero", level="head", batch_size=len(prompts), progress=False
            ).values
        )
    )
    runs = [
        (
            "plain loop, one HF forward per head (default: logits at every position)",
            lambda: plain_loop(model, prompts, read_only=False),
        ),
        (
            "plain loop, one HF forward per head (logits at the last token only)",
            lambda: plain_loop(model, prompts, read_only=True),
        ),
        (
            "TransformerLens `get_act_patch_attn_head_out_all_pos`",
            lambda: transformer_lens_utility(model, prompts),
        ),
    ]
    n_heads = model.spec.n_layers * model.spec.n_heads
    print(f"{model.name}, {n_heads} heads, {prompts.name}, device {model.device}")
    print(f"  lenscape: {t_ours:.1f} s")
    rows = [
        [
            *_report.stamp(),
            model.name,
            prompts.name,
            "lenscape `ablation(kind='zero')`",
            f"{t_ours:.1f} s",
            "1.00",
            "0",
        ]
    ]
    for name, fn in runs:
        values, took = timed(fn)
        diff = np.abs(values - ours).max()
        print(
            f"  {name}: {took:.1f} s, {took / t_ours:.2f}x lenscape's time, max |diff| {diff:.1e}"
        )
        rows.append(
            [
                *_report.stamp(),
                model.name,
                prompts.name,
                name,
                f"{took:.1f} s",
                f"{took / t_ours:.2f}",
                f"{diff:.1e}",
            ]
        )
    body = _report.table(
        [
            "date",
            "machine",
            "model",
            "prompts",
            "method",
            "time",
            "time / lenscape",
            "max abs diff vs lenscape (logits)",
        ],
        rows,
    )
    _report.emit(
        args,
        _report.section(
            "exact_ablation",
            "Exact per-head zero-ablation (issue 7)",
            __doc__.split("\n\n", 1)[1],
            body,
        ),
    )


if __name__ == "__main__":
    main()
