"""Edges by span against plain per-receiver references: every tiny family and SmolLM2.

Each computation of ``lsc.edge_attribution(..., positions="spans")`` and of exact edge
patching by span is set beside a reference of ``tests/_helpers.py`` written with plain hooks
on the Hugging Face modules, the spans' positions found from the tokenizer's character
offsets:

- **EAP and EAP-IG by span** (2 steps) against ``reference_edge_scores_by_span``: per
  receiver the gradient at a zero leaf on its own copy of the residual stream, a k or v
  receiver once per query span (its attention output kept off the gradient outside that
  span); every edge of the graph, on two IOI prompts of different token lengths in one
  left-padded batch. Reported: the largest difference relative to the largest score.
- **Exact edge patching by span**: the edges of largest |EAP score| by span, each patched
  alone on the corrupt run (the receiver reads the clean sender at the edge's span only; a
  k or v receiver only for its query span's queries), as ``edge_patching`` runs them (one
  edge per variant, passes shared), against ``reference_edge_patching_by_span`` (a k or v
  edge by a first patched run whose attention output is taken at the query span's
  positions only). The edges lie at S2, END and "other" (where an IOI pair's clean and
  corrupt runs differ), a third each within a span (q, MLP, logits), through a key or value
  at its own span, and crossing spans, each third the strongest of its kind (random edges
  move the metric by about float32 rounding). Reported: the largest difference, also
  relative to the largest effect.
- **Invariants**: every edge patched gives the other run, none the base run, on the two
  prompts of different lengths: the largest difference relative to |clean - corrupt|.

The tiny families are the random 2-layer models of ``lsc.models.tiny`` (every architecture
of ``TINY_ARCHITECTURES``); SmolLM2-135M (30 layers, 9 query heads on 3 key/value heads) is
the bundled model, its EAP agreement in the ``edges_by_span`` section.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _report
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _helpers import (
    mixed_length_prompts,
    patched_every_and_none_by_span,
    reference_edge_patching_by_span,
    small_tokenizer,
    span_edge_kinds,
    span_edge_labels,
    span_score_errors,
)

import lenscape as lsc
from lenscape import models
from lenscape.capture import edges
from lenscape.capture.edges import patching
from lenscape.capture.edges.graph import SpanGraph

#: Where an IOI pair's clean and corrupt runs differ: the edges patched sit there.
PATCHED_SPANS = ("S2", "END", "other")


def strongest_span_edges(graph, scores, count: int, spans: tuple[str, ...]) -> list[int]:
    """Flat indices of the ``count`` edges at ``spans`` of largest |EAP score|, a third of
    each kind of ``span_edge_kinds``: edges that move the metric well above float32
    rounding."""
    magnitude = np.abs(np.nan_to_num(scores)).ravel()
    return [
        int(i)
        for mask in span_edge_kinds(graph, spans).values()
        for i in sorted(np.flatnonzero(mask), key=lambda i: -magnitude[i])[: count // 3]
    ]


def score_error(model, prompts, estimator: str, steps: int) -> float:
    """The largest difference of EAP (or EAP-IG) by span from the reference, relative to
    the reference's largest score, over ``prompts`` (one left-padded batch)."""
    rows = span_score_errors(model, prompts, estimator, steps)
    assert all(row["compared"] == row["edges"] for row in rows)  # every edge compared
    return max(row["error"] for row in rows)


def patching_error(model, prompt, count: int) -> dict[str, float]:
    """Exact single-edge patching by span of the ``count`` strongest edges against the
    reference: edges, largest effect, largest difference, it relative to the effect, and
    the times (s) of lenscape's and the reference's passes."""
    scores = edges.edge_attribution(model, [prompt], positions="spans", progress=False)
    graph = SpanGraph.of_result(scores)
    chosen = strongest_span_edges(graph, scores.values, count, PATCHED_SPANS)
    t0 = time.perf_counter()
    result = patching._edge_variants(
        model,
        [prompt],
        variants=tuple(("only", (i,)) for i in chosen),
        base="corrupt",
        positions="spans",
        progress=False,
    )
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    labels = [span_edge_labels(graph, i) for i in chosen]
    reference = reference_edge_patching_by_span(model, prompt, labels)
    reference_s = time.perf_counter() - t0
    ours = result["patched"].isel(prompt=0).values.astype(np.float64)
    expected = np.array(list(reference.values()))
    effects = np.abs(expected - float(result["base"].isel(prompt=0)))
    difference = float(np.abs(ours - expected).max())
    return {
        "edges": len(chosen),
        "moving": int((effects > 1e-3 * effects.max()).sum()),
        "effect": float(effects.max()),
        "difference": difference,
        "error": difference / float(effects.max()),
        "ours_s": ours_s,
        "reference_s": reference_s,
    }


def invariants(model, prompts) -> dict[str, float]:
    """|clean - corrupt| and the largest all/none differences relative to it."""
    every, none, other, base = patched_every_and_none_by_span(model, prompts)
    scale = float(np.abs(base - other).max())
    return {
        "scale": scale,
        "every": float(np.abs(every - other).max()) / scale,
        "none": float(np.abs(none - base).max()) / scale,
    }


def mixed_lengths(model, count: int) -> list:
    """IOI prompts of ``count`` different token lengths."""
    return mixed_length_prompts(model, lsc.data.prompts("ioi"), count)


def family_row(architecture: str, tokenizer, count: int) -> list:
    """One tiny family's row: EAP, EAP-IG and exact patching errors, the invariants."""
    model = models.tiny(architecture, n_layers=2, tokenizer=tokenizer)
    prompts = mixed_lengths(model, 2)
    eap, eap_ig = score_error(model, prompts, "eap", 1), score_error(model, prompts, "eap-ig", 2)
    exact = patching_error(model, prompts[0], count)
    kept = invariants(model, prompts)
    print(architecture, f"eap {eap:.2g}", f"eap-ig {eap_ig:.2g}", f"exact {exact['error']:.2g}")
    return [
        architecture,
        f"{eap:.1e}",
        f"{eap_ig:.1e}",
        f"{exact['error']:.1e} ({exact['edges']} edges)",
        f"{kept['every']:.1e}",
        f"{kept['none']:.1e}",
    ]


def smollm2_rows(count: int) -> tuple[list, list]:
    """SmolLM2's patching row and invariants row."""
    model = lsc.load()
    exact = patching_error(model, lsc.data.prompts("ioi")[0], count)
    print(f"SmolLM2 exact: {exact}")
    prompts = mixed_lengths(model, 2)
    kept = invariants(model, prompts)
    print(f"SmolLM2 invariants: {kept}")
    third = exact["edges"] // 3
    lengths = sorted({len(model.tokenizer(p.text)["input_ids"]) for p in prompts})
    return (
        [
            f"{exact['edges']} ({third} within, {third} own-span k/v, {third} crossing)",
            exact["moving"],
            f"{exact['effect']:.4g}",
            f"{exact['difference']:.2g}",
            f"{exact['error']:.2g}",
            f"{exact['ours_s']:.1f} s / {exact['reference_s']:.1f} s",
        ],
        [
            f"{len(prompts)} (token lengths {', '.join(map(str, lengths))})",
            f"{kept['scale']:.4g}",
            f"{kept['every']:.2g}",
            f"{kept['none']:.2g}",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--edges", type=int, default=60, help="edges patched on SmolLM2")
    parser.add_argument("--family-edges", type=int, default=30, help="edges per tiny family")
    parser.add_argument("--families", nargs="+", default=list(models.TINY_ARCHITECTURES))
    args = _report.parse_args(parser, edges=15, families=["llama", "gpt2"])
    tokenizer = small_tokenizer()
    families = [family_row(a, tokenizer, args.family_edges) for a in args.families]
    exact, kept = smollm2_rows(args.edges)
    stamp = _report.stamp()
    tables = [
        "Tiny families (2 layers; largest difference relative to the largest score or effect; "
        "the invariants relative to |clean - corrupt|):",
        _report.table(
            [
                "family",
                "EAP by span",
                "EAP-IG by span (2 steps)",
                "exact edge patching by span",
                "every edge vs the other run",
                "no edge vs the base run",
            ],
            families,
        ),
        f"SmolLM2, exact edge patching by span on IOI prompt 0 ({stamp[0]}, {stamp[1]}):",
        _report.table(
            [
                "edges compared",
                "edges moving the metric > 1e-3 x the largest",
                "largest effect (logits)",
                "largest difference (logits)",
                "largest difference / largest effect",
                "time: lenscape / reference",
            ],
            [exact],
        ),
        "SmolLM2, all/none invariants (one left-padded batch):",
        _report.table(
            [
                "prompts",
                "|clean - corrupt| (logits)",
                "every edge vs the other run",
                "no edge vs the base run",
            ],
            [kept],
        ),
    ]
    intro = (__doc__ or "").split("\n\n", 1)[1].strip()
    _report.emit(
        args,
        _report.section(
            "span_edge_agreement",
            "Edges by span against plain references",
            intro,
            "\n\n".join(tables),
        ),
    )


if __name__ == "__main__":
    main()
