"""Overhead of attribution patching over a bare forward + forward + backward.

time(lsc.attribution_patching(level="all"): every head and block, one batch)
  / time(bare HF: clean forward (no grad) + corrupt forward + backward of the same metric)

The bare baseline does the same autograd work lenscape does: weights frozen, gradient
taken from the embeddings on. It is timed twice: as HF runs by default (logits at every
position) and with ``logits_to_keep`` at the read position, which lenscape uses; the second
is the like-for-like ratio. Target: <= 1.3 on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lenscape as lsc
from lenscape.capture import metrics
from lenscape.capture._inputs import pad


def bare_step(model, prompts, keep_read_only: bool) -> None:
    tok, hf = model.tokenizer, model.hf
    clean = pad([tok(p.text)["input_ids"] for p in prompts], tok.pad_token_id, "right")
    corrupt = pad([tok(p.corrupt)["input_ids"] for p in prompts], tok.pad_token_id, "right")
    target = torch.tensor([tok(p.target, add_special_tokens=False)["input_ids"][0] for p in prompts])
    distractor = torch.tensor([tok(p.distractor, add_special_tokens=False)["input_ids"][0]
                               for p in prompts])
    keep = {"logits_to_keep": corrupt.read_pos[:, None]} if keep_read_only else {}
    with torch.no_grad():
        hf(input_ids=clean.input_ids, attention_mask=clean.attention_mask, **keep)
    embeds = hf.get_input_embeddings()(corrupt.input_ids).detach().requires_grad_(True)
    logits = hf(inputs_embeds=embeds, attention_mask=corrupt.attention_mask, **keep).logits
    read = logits[:, 0] if keep_read_only else logits[torch.arange(len(prompts)), corrupt.read_pos]
    value = metrics.compute("logit_diff", read, target, distractor)
    value.sum().backward()


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = lsc.load(args.model, device=args.device)
    prompts = lsc.data.prompts("factual")[:args.prompts]
    bare_default = median_time(lambda: bare_step(model, prompts, False), args.repeats)
    bare = median_time(lambda: bare_step(model, prompts, True), args.repeats)
    print(f"model {model.name}, {len(prompts)} prompts in one batch, device {model.device}, "
          f"median of {args.repeats}")
    print(f"bare HF forward + forward + backward: {bare_default:.3f} s (all-position logits), "
          f"{bare:.3f} s (read-position logits, like lenscape)")
    for backend in ("nnsight", "transformer_lens"):
        took = median_time(lambda: lsc.attribution_patching(
            model, prompts, level="all", batch_size=len(prompts), backend=backend,
            progress=False), args.repeats)
        print(f"attribution patching, all {model.spec.n_layers * model.spec.n_heads} heads + "
              f"{2 * model.spec.n_layers} blocks, {backend}: {took:.3f} s -> ratio {took / bare:.2f} "
              f"(vs HF default {took / bare_default:.2f})")


if __name__ == "__main__":
    main()
