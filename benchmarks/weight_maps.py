"""Weight maps on the bundled models: time for F2 (importance, two models) and F3 (change).

F2: ``weight_importance`` of SmolLM2-135M and Gemma-3-270M on 16 factual prompts
(target <= 3 minutes for both). F3: ``weight_change`` between SmolLM2 and a copy fine-tuned
for ``--steps`` steps on the math task (target <= 30 s, excluding the fine-tune). Writes the
``weight_maps`` section of RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import time

import _report

import lenscape as lsc

MODELS = ("smollm2-135m", "gemma3-270m")
AGGREGATIONS = ("sum", "mean")


def top_tensors(ds, n: int = 3) -> str:
    """The n highest cells of a weight map: per-layer tensors and model-level ones."""
    cells = ds["per_layer"].stack(cell=("layer", "component")).dropna("cell")
    ranked = [
        (float(v), f"L{layer} {component}")
        for (layer, component), v in zip(cells["cell"].values, cells.values, strict=True)
    ]
    level = ds["model_level"].dropna("component")
    ranked += [
        (float(v), str(c)) for c, v in zip(level["component"].values, level.values, strict=True)
    ]
    return ", ".join(f"{name} ({value:.2f})" for value, name in sorted(ranked, reverse=True)[:n])


def top_columns(ds, n: int = 3) -> str:
    """The n per-layer components with the highest mean over layers."""
    means = ds["per_layer"].dropna("component", how="all").mean("layer").to_series()
    return ", ".join(f"{c} ({v:.2f})" for c, v in means.sort_values(ascending=False)[:n].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument(
        "--note", default="", help="a sentence about this run (e.g. machine shared)"
    )
    args = _report.parse_args(parser, steps=1, prompts=2)
    prompts = lsc.data.prompts("factual")[: args.prompts]
    batch_size = min(8, len(prompts))
    total, times, tops = 0.0, [], []
    smol = None
    for name in MODELS:
        model = lsc.load(name, device="cpu")
        smol = smol or model
        for aggregation in AGGREGATIONS:
            start = time.perf_counter()
            ds = lsc.weight_importance(
                model,
                prompts,
                batch_size=batch_size,
                normalize=True,
                aggregation=aggregation,
                progress=False,
            )
            took = time.perf_counter() - start
            if aggregation == "sum":
                total += took
                times.append(f"{took:.1f} s")
            cells, columns = top_tensors(ds), top_columns(ds)
            print(
                f"F2 {name} ({aggregation}): {took:.1f} s; top tensors {cells}; "
                f"top components (mean over layers) {columns}"
            )
            tops.append([name, aggregation, cells, columns])
    print(f"F2 both models: {total:.1f} s")
    start = time.perf_counter()
    tuned = lsc.finetune(smol, lsc.data.task("math"), steps=args.steps, progress=False)
    tune_took = time.perf_counter() - start
    print(f"fine-tune {args.steps} steps: {tune_took:.0f} s (not part of F3)")
    start = time.perf_counter()
    relative = lsc.weight_change(smol, tuned)
    fraction = lsc.weight_change(smol, tuned, kind="fraction_changed")
    took = time.perf_counter() - start
    rel = relative["per_layer"]
    changed = float(fraction["per_layer"].mean())
    print(
        f"F3 relative + fraction changed: {took:.1f} s; relative change range "
        f"{float(rel.min()):.4f}..{float(rel.max()):.4f}; mean fraction changed "
        f"{changed:.3f}"
    )
    intro = f"""\
`python benchmarks/weight_maps.py`: F2 = `weight_importance(normalize=True)` (sum of
|w dL/dw| over each tensor's entries, the notebook's default; the timing column) on {len(prompts)}
factual prompts (batch {batch_size}) for each bundled model (model load excluded); F3 =
`weight_change` relative + fraction changed between SmolLM2-135M and a copy fine-tuned
{args.steps} steps on the math task (lr 1e-4; fine-tune excluded). "relative change" is the
per-tensor range of ||W1-W0||/||W0||; "entries changed" the mean share of entries that moved by
more than 1e-3 of their magnitude.

With the mean of |w dL/dw| over a tensor's entries, tensors with few entries of large leverage
outrank the big projections (on 2026-11-22 the norm weights ranked highest in both models and
the projections sat near 0 after min-max scaling, the opposite of the F2 reference). The sum
over entries compares tensors by their total contribution. The table below gives each
model's top 3 under both aggregations, min-max scaled per model (model-level tensors
included; both bundled models tie lm_head to embed, reported as embed)."""
    columns = [
        "date",
        "machine",
        "F2 SmolLM2-135M",
        "F2 Gemma-3-270M",
        "F2 both (target <= 3 min)",
        f"fine-tune {args.steps} steps",
        "F3 (target <= 30 s)",
        "relative change",
        "entries changed",
    ]
    row = [
        *_report.stamp(),
        *times,
        f"{total:.1f} s",
        f"{tune_took:.0f} s",
        f"{took:.1f} s",
        f"{float(rel.min()):.4f}..{float(rel.max()):.4f}",
        f"{changed:.0%}",
    ]
    body = (
        _report.table(columns, [row])
        + "\n\nMost important tensors (F2), by aggregation:\n\n"
        + _report.table(
            ["model", "aggregation", "top 3 tensors", "top 3 components (mean over layers)"], tops
        )
        + (f"\n\n{args.note}" if args.note else "")
    )
    _report.emit(args, _report.section("weight_maps", "Weight maps (issue 6)", intro, body))


if __name__ == "__main__":
    main()
