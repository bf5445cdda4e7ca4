"""Can I trust the fast map? Gradient estimates vs exact activation patching, per component type.

For each prompt family (factual recall, IOI) on the bundled model: ``lsc.faithfulness`` with
attribution patching (AtP) and integrated gradients at several step counts, reported per
component type (heads, attention blocks, MLP blocks), with cost ratios to AtP; then
``refine=20`` on all heads: its time against the full exact sweep and how many of the exact
top-20 (by |prompt-mean effect|) it recovers. Writes the ``faithfulness`` section of
RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import time

import _report
import numpy as np

import lenscape as lsc

EXACTNESS = """\
### Exactness (tests)

- Exact zero-ablation of all 270 heads (4 prompts of different lengths, batched) equals a
  plain PyTorch forward-pre-hook loop on the HF model to 1e-5 in float64
  (tests/test_real_model.py). In float32 the two differ by up to 4.1e-5, only through
  reduction order (batched, padded vs single-prompt passes): exactness is checked in float64.
- nnsight vs TransformerLens: agree to 1e-4 (float32) for all four methods on tiny models
  (tests/test_backend.py) and for integrated gradients (tests/test_patching.py).
- AtP and integrated gradients equal exact patching on a model that is linear in the patched
  activation (a tiny GPT-2 whose last block and final norm are linear), and "ig" with
  steps=1 equals AtP; `refine=k` values equal the full sweep's exactly for the refined
  components (tests/test_patching.py)."""

STATS = (
    "pearson_cells",
    "spearman_cells",
    "pearson_means",
    "spearman_means",
    "top_overlap",
    "sign_agreement",
)


def top(values: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-np.abs(values.ravel()), kind="stable")[:k].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=None, help="first N of each family")
    parser.add_argument("--estimators", default="atp,ig:2,ig:4,ig:8")
    parser.add_argument("--refine", type=int, default=20)
    args = _report.parse_args(parser, prompts=4, estimators="atp,ig:2", refine=5)
    model = lsc.load(args.model, device="cpu")
    estimators = args.estimators.split(",")
    agreement_rows, refine_rows = [], []
    for family in ("factual", "ioi"):
        prompts = lsc.data.prompts(family)
        prompts = prompts[: args.prompts] if args.prompts else prompts
        report = lsc.faithfulness(model, prompts, estimators=estimators, progress=False)
        exact_seconds = report.attrs["exact_seconds_head"] + report.attrs["exact_seconds_block"]
        print(
            f"\n{family}: {len(prompts)} prompts; exact patching {exact_seconds:.0f} s "
            f"(heads {report.attrs['exact_seconds_head']:.0f} s)"
        )
        for label in estimators:
            for ctype in report["component_type"].values:
                cell = report.sel(estimator=label, component_type=ctype)
                values = [f"{float(cell[stat]):.3f}" for stat in STATS]
                cost = float(report["cost_vs_atp"].sel(estimator=label))
                seconds = float(report["seconds"].sel(estimator=label))
                print(
                    f"  {label:6s} {ctype:5s} "
                    + " ".join(values)
                    + f"  {seconds:.1f} s ({cost:.1f}x AtP)"
                )
                agreement_rows.append(
                    [
                        *_report.stamp(),
                        family,
                        len(prompts),
                        label,
                        ctype,
                        *values,
                        f"{seconds:.1f} s",
                        f"{cost:.1f}x",
                    ]
                )
        # refine=k on every head, against the full exact head sweep of the same run.
        start = time.perf_counter()
        refined = lsc.activation_patching(
            model, prompts, level="head", refine=args.refine, progress=False
        )
        refine_seconds = time.perf_counter() - start
        full = report["exact_heads"]  # the full exact sweep faithfulness ran
        full_mean = full.mean("prompt").values
        chosen = ~np.isnan(refined.values[0].ravel())
        recovered = len(top(full_mean, args.refine) & set(np.flatnonzero(chosen).tolist()))
        diff = float(
            np.abs(
                refined.values.reshape(len(prompts), -1)[:, chosen]
                - full.values.reshape(len(prompts), -1)[:, chosen]
            ).max()
        )
        speedup = report.attrs["exact_seconds_head"] / refine_seconds
        print(
            f"  refine={args.refine}: {refine_seconds:.1f} s vs full exact "
            f"{report.attrs['exact_seconds_head']:.1f} s ({speedup:.1f}x); recovers "
            f"{recovered}/{args.refine} of the exact top-{args.refine}; max |refined - full| "
            f"{diff:.1e}"
        )
        refine_rows.append(
            [
                *_report.stamp(),
                family,
                len(prompts),
                args.refine,
                f"{refine_seconds:.1f} s",
                f"{report.attrs['exact_seconds_head']:.0f} s",
                f"{speedup:.1f}x",
                f"{recovered}/{args.refine}",
                f"{diff:.1e}",
            ]
        )
    intro = f"""\
`python benchmarks/faithfulness.py`: {model.name}, the built-in factual (85 pairs) and IOI
(60 pairs) families, logit difference, batch 8, CPU float32. `lsc.faithfulness` runs exact
activation patching at head and block level and each estimator (`atp` = attribution
patching; `ig:N` = integrated gradients along the corrupt -> clean input path with N
points, `steps=1` being AtP). Correlations over every (prompt x component) cell and over
prompt means; top-10 overlap of the exact and estimated rankings by |prompt mean|; sign
agreement over cells. Cost is wall time for all heads and blocks at once, and its ratio to AtP
(N integration points cost about N times AtP)."""
    columns = [
        "date",
        "machine",
        "family",
        "prompts",
        "estimator",
        "component type",
        "Pearson r (cells)",
        "Spearman (cells)",
        "Pearson r (means)",
        "Spearman (means)",
        "top-10 overlap",
        "sign agreement",
        "time",
        "cost vs AtP",
    ]
    refine_columns = [
        "date",
        "machine",
        "family",
        "prompts",
        "k",
        "refine=k time",
        "full exact sweep (all heads)",
        "speed-up",
        "exact top-k recovered",
        "max abs(refined - full)",
    ]
    body = (
        _report.table(columns, agreement_rows) + "\n\n### refine=k (activation patching, "
        "all heads)\n\n" + _report.table(refine_columns, refine_rows) + "\n\n" + EXACTNESS
    )
    _report.emit(
        args,
        _report.section(
            "faithfulness",
            "Faithfulness of fast attributions per component type (issue 12)",
            intro,
            body,
        ),
    )


if __name__ == "__main__":
    main()
