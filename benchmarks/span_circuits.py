"""Circuits by span against position-agnostic circuits: faithfulness at equal edge counts.

On the bundled SmolLM2-135M and IOI pairs (spans IO, S1, S2, END and "other"): EAP over
position-agnostic edges and over edges by span (``edge_attribution(positions="spans")``),
each turned into circuits of the same edge counts (``lsc.circuit``'s pruning to paths, by
span through (component, span) nodes) and patched exactly (``circuit_faithfulness``: the
clean run with every edge outside the circuit reading the corrupt run; by span, an edge
outside reads it only at its span, a key or value edge only for its query span's queries).
Faithfulness f = (m(C) - m(empty)) / (m(full) - m(empty)), the prompt-mean logit difference.
The same prompts score and patch. Reported: each curve, its CPR over the counts measured,
and the smallest edge count whose faithfulness reaches 0.9.
"""

from __future__ import annotations

import argparse
import time

import _report
import numpy as np

import lenscape as lsc
from lenscape.capture import edges

COUNTS = (25, 50, 100, 200, 400, 800, 1600, 3200, 6400, 12800)


def curve(model, prompts, scores, counts, total: int):
    fractions = [count / total for count in counts]
    report = edges.circuit_faithfulness(
        model, prompts, scores, fractions=fractions, n_random=0, batch_size=8, progress=False
    )
    return report["faithfulness"].values, report["n_edges"].values


def first_at(values, counts, level=0.9) -> str:
    reached = [count for value, count in zip(values, counts, strict=True) if value >= level]
    return f"{reached[0]:,}" if reached else f"> {counts[-1]:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    args = _report.parse_args(parser, prompts=4)
    model = lsc.load()
    prompts = lsc.data.prompts("ioi")[: args.prompts]
    rows, curves = [], {}
    for positions in ("all", "spans"):
        t0 = time.perf_counter()
        scores = edges.edge_attribution(model, prompts, positions=positions, batch_size=8)
        total = int(np.isfinite(scores.values).sum())
        counts = [count for count in COUNTS if count <= total]
        values, kept = curve(model, prompts, scores, counts, total)
        took = time.perf_counter() - t0
        curves[positions] = values
        label = "position-agnostic" if positions == "all" else "by span"
        print(label, total, list(np.round(values, 3)), list(kept), f"{took:.0f} s")
        span = np.log(counts[-1]) - np.log(counts[0])
        logs = np.log(counts)
        cpr = float(np.sum(np.diff(logs) * (values[1:] + values[:-1]) / 2) / span)
        rows.append(
            [
                *_report.stamp(),
                label,
                f"{total:,}",
                first_at(values, counts),
                f"{cpr:.3f}",
                " / ".join(f"{v:.2f}" for v in values),
                f"{took:.0f} s",
            ]
        )
    intro = (__doc__ or "").split("\n\n", 1)[1].strip()
    body = "\n\n".join(
        [
            f"SmolLM2, {args.prompts} IOI prompts; edge counts {', '.join(map(str, COUNTS))} "
            "(each pruned to paths, so a circuit may keep fewer); CPR here is the area under "
            "the curve over log edge count, divided by its span.",
            _report.table(
                [
                    "date",
                    "machine",
                    "circuits",
                    "edges in the graph",
                    "first count with f >= 0.9",
                    "CPR (log count)",
                    "faithfulness at each count",
                    "time (scores and curve)",
                ],
                rows,
            ),
        ]
    )
    _report.emit(
        args,
        _report.section("span_circuits", "Circuits by span against position-agnostic", intro, body),
    )


if __name__ == "__main__":
    main()
