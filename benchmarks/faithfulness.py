"""Can I trust the fast map? Gradient estimates vs exact activation patching, per component type.

For each bundled model and prompt family (factual recall, IOI): ``lsc.faithfulness`` with
attribution patching (AtP), integrated gradients and relevance patching (RelP) under several
rule sets, reported per component type (heads, attention blocks, MLP blocks), with cost
ratios to AtP; then, on the first model, ``refine=20`` on all heads: its time against the
full exact sweep and how many of the exact top-20 (by |prompt-mean effect|) it recovers.
Writes the ``faithfulness`` section of RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import time

import _report
import numpy as np

import lenscape as lsc

EXACTNESS = """\
### Exactness (tests)

- Exact zero-ablation of all 270 heads (2 prompts of 8 and 9 tokens: one batched, padded
  sweep) equals a plain PyTorch forward-pre-hook loop on the HF model, one unpadded pass per
  prompt and head, to 1e-5 in float64 for every head of layers 0, 15 and 29
  (tests/test_real_model.py; every head of each tiny family in tests/test_family_matrix.py).
  In float32 the two differ by up to 4.1e-5, only through
  reduction order (batched, padded vs single-prompt passes): exactness is checked in float64.
- nnsight vs TransformerLens: agree to 1e-4 (float32) for all four methods on tiny models
  (tests/test_backend.py) and for integrated gradients (tests/test_patching.py).
- AtP and integrated gradients equal exact patching on a model that is linear in the patched
  activation (a tiny GPT-2 whose last block and final norm are linear), and "ig" with
  steps=1 equals AtP; `refine=k` values equal the full sweep's exactly for the refined
  components (tests/test_patching.py).
- RelP equals an independent computation (plain HF hooks and a backward under the same rules)
  for every head and block, under RelP's rules and the secant rules; the two backends agree;
  a head's RelP edges summed over receivers equal its RelP score (tests/test_patching.py,
  tests/test_edges.py). The rules keep every forward output bit for bit, leave the model as it
  was, conserve relevance where they promise it (RelP-AH is exact for a patch to zero), and the
  secant rules split a gated MLP's change exactly (tests/test_relevance.py)."""

STATS = (
    "pearson_cells",
    "spearman_cells",
    "pearson_means",
    "spearman_means",
    "top_overlap",
    "sign_agreement",
)


INTRO = """\
`python benchmarks/faithfulness.py`: SmolLM2-135M and Gemma-3-270M, the built-in factual (85
pairs) and IOI (60 pairs) families (the pairs each model's tokenizer aligns: same token count
clean and corrupt, single-token answers), logit difference, batch 8, CPU float32.
`lsc.faithfulness` runs exact activation patching at head and block level and each
estimator: `atp` = attribution patching; `ig:N` = integrated gradients along the corrupt ->
clean input path with N points; `relp:RULES` = relevance patching (RelP, arXiv
2508.21258: the corrupt run's gradient taken through a backward pass with changed rules,
`sweep/relevance.py`): `relp` RelP's own rules (RMSNorm scale held, identity rule through
SiLU/GELU, half rule through gate x up), `relp-ah` with attention probabilities held,
`secant` every operation linearised between the corrupt and the clean run (a clean reference
pass). Correlations over every (prompt x component) cell (with its 95% percentile-bootstrap
interval over prompts) and over prompt means; top-10 overlap of the exact and estimated
rankings by |prompt mean|; sign agreement over cells. Cost is wall time for all heads and
blocks at once, and its ratio to AtP."""

COLUMNS = [
    "date",
    "machine",
    "model",
    "family",
    "pairs",
    "estimator",
    "component type",
    "Pearson r (cells)",
    "95% interval",
    "Spearman (cells)",
    "Pearson r (means)",
    "Spearman (means)",
    "top-10 overlap",
    "sign agreement",
    "time",
    "cost vs AtP",
]
REFINE_COLUMNS = [
    "date",
    "machine",
    "model",
    "family",
    "pairs",
    "k",
    "refine=k time",
    "full exact sweep (all heads)",
    "speed-up",
    "exact top-k recovered",
    "max abs(refined - full)",
]


def top(values: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-np.abs(values.ravel()), kind="stable")[:k].tolist())


def aligned_pairs(model, prompts):
    """The pairs ``model``'s tokenizer can patch: single-token target and distractor, and a
    corrupt text of as many tokens as the clean one (Gemma's tokenizer splits some pairs
    SmolLM2's keeps aligned)."""
    tokenizer = model.tokenizer

    def count(text: str, special: bool = True) -> int:
        return len(tokenizer(text, add_special_tokens=special)["input_ids"])

    kept = [
        p
        for p in prompts
        if count(p.text) == count(p.corrupt)
        and count(p.target, False) == 1
        and count(p.distractor, False) == 1
    ]
    return lsc.data.PromptSet(kept, name=prompts.name)


def agreement_rows(model, family, prompts, report, estimators) -> list[list]:
    """Rows of the agreement table for one report, printed as they are made."""
    rows = []
    for label in estimators:
        for ctype in report["component_type"].values:
            cell = report.sel(estimator=label, component_type=ctype)
            values = [f"{float(cell[stat]):.3f}" for stat in STATS]
            low, high = (
                float(cell["pearson_cells_interval"].sel(bound=b)) for b in ("low", "high")
            )
            cost = float(report["cost_vs_atp"].sel(estimator=label))
            seconds = float(report["seconds"].sel(estimator=label))
            print(f"  {label:12s} {ctype:5s} " + " ".join(values) + f"  {cost:.2f}x AtP")
            rows.append(
                [
                    *_report.stamp(),
                    model.name,
                    family,
                    len(prompts),
                    label,
                    ctype,
                    values[0],
                    f"[{low:.3f}, {high:.3f}]",
                    *values[1:],
                    f"{seconds:.1f} s",
                    f"{cost:.2f}x",
                ]
            )
    return rows


def refine_row(model, family, prompts, report, k) -> list:
    """``refine=k`` on every head against the full exact head sweep ``report`` ran."""
    start = time.perf_counter()
    refined = lsc.activation_patching(model, prompts, level="head", refine=k, progress=False)
    refine_seconds = time.perf_counter() - start
    full = report["exact_heads"]
    chosen = ~np.isnan(refined.values[0].ravel())
    recovered = len(top(full.mean("prompt").values, k) & set(np.flatnonzero(chosen).tolist()))
    flat = (len(prompts), -1)
    diff = float(
        np.abs(refined.values.reshape(flat)[:, chosen] - full.values.reshape(flat)[:, chosen]).max()
    )
    speedup = report.attrs["exact_seconds_head"] / refine_seconds
    print(f"  refine={k}: {refine_seconds:.1f} s ({speedup:.1f}x); recovers {recovered}/{k}")
    return [
        *_report.stamp(),
        model.name,
        family,
        len(prompts),
        k,
        f"{refine_seconds:.1f} s",
        f"{report.attrs['exact_seconds_head']:.0f} s",
        f"{speedup:.1f}x",
        f"{recovered}/{k}",
        f"{diff:.1e}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--prompts", type=int, default=None, help="first N of each family")
    parser.add_argument("--estimators", default="atp,ig:2,ig:8,relp,relp:relp-ah,relp:secant")
    parser.add_argument("--refine", type=int, default=20)
    args = _report.parse_args(
        parser, models="smollm2-135m", prompts=4, estimators="atp,ig:2,relp:secant", refine=5
    )
    estimators = args.estimators.split(",")
    rows, refine_rows = [], []
    for index, name in enumerate(args.models.split(",")):
        model = lsc.load(name, device="cpu")
        for family in ("factual", "ioi"):
            prompts = lsc.data.prompts(family)
            prompts = aligned_pairs(model, prompts[: args.prompts] if args.prompts else prompts)
            report = lsc.faithfulness(model, prompts, estimators=estimators, progress=False)
            print(f"\n{model.name} {family}: {len(prompts)} aligned pairs")
            labels = list(report["estimator"].values)
            rows += agreement_rows(model, family, prompts, report, labels)
            if index == 0:  # refine on the first model only: it is an exact sweep again
                refine_rows.append(refine_row(model, family, prompts, report, args.refine))
        del model
    _report.emit(
        args,
        _report.section(
            "faithfulness",
            "Faithfulness of fast attributions per component type (issues 12, 35)",
            INTRO,
            _report.table(COLUMNS, rows)
            + "\n\n### refine=k (activation patching, all heads)\n\n"
            + _report.table(REFINE_COLUMNS, refine_rows)
            + "\n\n"
            + EXACTNESS,
        ),
    )


if __name__ == "__main__":
    main()
