"""Weight maps on the bundled models: time for F2 (importance, two models) and F3 (change).

F2: ``weight_importance`` of SmolLM2-135M and Gemma-3-270M on 16 factual prompts
(target <= 3 minutes for both). F3: ``weight_change`` between SmolLM2 and a copy fine-tuned
for ``--steps`` steps on the math task (target <= 30 s, excluding the fine-tune).
"""

from __future__ import annotations

import argparse
import time

import lenscape as lsc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    prompts = lsc.data.prompts("factual")[:16]
    total = 0.0
    smol = None
    for name in ("smollm2-135m", "gemma3-270m"):
        model = lsc.load(name, device="cpu")
        smol = smol or model
        start = time.perf_counter()
        ds = lsc.weight_importance(model, prompts, batch_size=8, normalize=True, progress=False)
        took = time.perf_counter() - start
        total += took
        top = ds["per_layer"].dropna("component", how="all").mean("layer").to_series().sort_values(ascending=False)
        print(f"F2 {name}: importance {took:.1f} s; most important on average: "
              f"{', '.join(top.index[:3])}")
    print(f"F2 both models: {total:.1f} s")
    start = time.perf_counter()
    tuned = lsc.finetune(smol, lsc.data.task("math"), steps=args.steps, progress=False)
    print(f"fine-tune {args.steps} steps: {time.perf_counter() - start:.0f} s (not part of F3)")
    start = time.perf_counter()
    relative = lsc.weight_change(smol, tuned)
    fraction = lsc.weight_change(smol, tuned, kind="fraction_changed")
    took = time.perf_counter() - start
    rel = relative["per_layer"]
    print(f"F3 relative + fraction changed: {took:.1f} s; relative change range "
          f"{float(rel.min()):.4f}..{float(rel.max()):.4f}; mean fraction changed "
          f"{float(fraction['per_layer'].mean()):.3f}")


if __name__ == "__main__":
    main()
