"""How well attribution patching (gradient) tracks exact activation patching, per head.

Prints Pearson r over all (prompt, layer, head) cells, over prompt-mean head scores, and
the wall time of each method, on the bundled model and the whole factual set.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import lenscape as lsc


def pearson(a, b) -> float:
    return float(np.corrcoef(np.ravel(a), np.ravel(b))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--level", default="head")
    args = parser.parse_args()
    model = lsc.load(args.model, device="cpu")
    prompts = lsc.data.prompts("factual")
    prompts = prompts[:args.prompts] if args.prompts else prompts
    start = time.perf_counter()
    approx = lsc.attribution_patching(model, prompts, level=args.level, progress=False)
    t_approx = time.perf_counter() - start
    start = time.perf_counter()
    exact = lsc.activation_patching(model, prompts, level=args.level, progress=False)
    t_exact = time.perf_counter() - start
    print(f"{model.name}, {len(prompts)} factual prompts, level={args.level}")
    print(f"attribution patching {t_approx:.1f} s, exact activation patching {t_exact:.1f} s "
          f"({t_exact / t_approx:.0f}x)")
    print(f"Pearson r, all prompt x component cells: {pearson(approx, exact):.3f}")
    print(f"Pearson r, prompt-mean per component:    "
          f"{pearson(approx.mean('prompt'), exact.mean('prompt')):.3f}")
    big = np.abs(exact.values) > 0.5
    print(f"cells with |exact| > 0.5: {int(big.sum())}; r there: "
          f"{pearson(approx.values[big], exact.values[big]):.3f}")


if __name__ == "__main__":
    main()
