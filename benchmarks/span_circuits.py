"""Circuits by span against position-agnostic circuits: faithfulness at equal edge counts.

On both bundled models (SmolLM2-135M: 30 layers, 9 query heads on 3 key/value heads;
Gemma-3-270M: 18 layers, 4 query heads on 1) and two tasks, IOI pairs (spans IO, S1, S2,
END and "other") and factual recall pairs ("The capital of France is the city of" against
Italy: spans subject, END and "other"): EAP over position-agnostic edges and over edges by
span (``edge_attribution(positions="spans")``), each turned into circuits of the same edge
counts (``lsc.circuit``'s pruning to paths, by span through (component, span) nodes) and
patched exactly (``circuit_faithfulness``: the clean run with every edge outside the
circuit reading the corrupt run; by span, an edge outside reads it only at its span, a key
or value edge only for its query span's queries).
Faithfulness f = (m(C) - m(empty)) / (m(full) - m(empty)), the prompt-mean logit difference.
The same prompts score and patch. Reported: each curve, its CPR over the counts measured,
and the smallest edge count whose faithfulness reaches 0.9, with that circuit's size as
PEAP counts it: token-level edges, a position-agnostic edge standing for one edge at
every position (every key-query pair for a key or value), an edge by span for those of its
span only (``receiver_weights``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _report
import numpy as np

import lenscape as lsc
from lenscape.capture import edges

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _helpers import span_positions_by_rule

COUNTS = (25, 50, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 51200)
MODELS = ("smollm2-135m", "gemma3-270m")
TASKS = ("ioi", "factual")


def curve(model, prompts, scores, counts, total: int):
    """Faithfulness, kept edges and PEAP's token-level size of the circuit of each count."""
    fractions = [count / total for count in counts]
    report = edges.circuit_faithfulness(
        model, prompts, scores, fractions=fractions, n_random=0, batch_size=8, progress=False
    )
    sizes = token_edges(model, prompts, scores, fractions, report["n_edges"].values)
    return report["faithfulness"].values, report["n_edges"].values, sizes


def receiver_weights(scores, lengths: dict[str, int]) -> np.ndarray:
    """How many token-level edges each edge of ``scores`` stands for on one prompt whose
    spans hold ``lengths`` tokens (PEAP's circuit size, ``calculate_circuit_size`` in
    technion-cs-nlp/PEAP: a position-agnostic edge acts at every position). Into a q, MLP
    or logits receiver: one per position of the edge's span (every position when
    position-agnostic); into a k or v receiver, one per (key, query) pair it joins: keys at
    the span, queries at the query span, n (n + 1) / 2 pairs where the two are one span (or
    the whole prompt). Shape: that of ``scores`` (span, sender, receiver), or (receiver,)
    broadcast over senders when position-agnostic."""
    kv = np.isin(scores["receiver_kind"].values, ("k", "v"))
    if "span" not in scores.dims:
        n = sum(lengths.values())
        return np.where(kv, n * (n + 1) / 2, n)[None, :]
    query = scores["query_span"].values
    rows = []
    for span in scores["span"].values:
        n = lengths.get(str(span), 0)
        keys = np.asarray([lengths.get(str(q), 0) for q in query], dtype=float)
        pairs = np.where(query == span, n * (n + 1) / 2, n * keys)
        rows.append(np.where(kv, pairs, n))
    return np.asarray(rows)[:, None, :]


def token_edges(model, prompts, scores, fractions, n_edges) -> list[float]:
    """PEAP's size of each circuit ``lsc.circuit(scores, fraction=f)`` (the circuits
    ``circuit_faithfulness`` patches, which kept ``n_edges``: checked): its token-level
    edges (``receiver_weights``), the mean over ``prompts``."""
    lengths = [
        {span: len(at) for span, at in span_positions_by_rule(model.tokenizer, p).items()}
        for p in prompts
    ]
    weight = np.mean([receiver_weights(scores, held) for held in lengths], axis=0)
    sizes = []
    for fraction, patched in zip(fractions, n_edges, strict=True):
        try:
            kept = lsc.mask_rules.kept(lsc.circuit(scores, fraction=fraction)).values
        except ValueError:  # no top edge on a path: the empty circuit
            kept = np.zeros(scores.shape, dtype=bool)
        assert int(kept.sum()) == int(patched), (fraction, int(kept.sum()), int(patched))
        sizes.append(float((kept * np.broadcast_to(weight, kept.shape)).sum()))
    return sizes


def log_area(values, counts) -> float:
    """The area under faithfulness over log edge count, divided by its span (CPR here)."""
    logs = np.log(counts)
    return float(np.sum(np.diff(logs) * (values[1:] + values[:-1]) / 2) / (logs[-1] - logs[0]))


def first_at(values, counts, level=0.9) -> str:
    """The first of ``counts`` whose faithfulness reaches ``level``."""
    reached = [count for value, count in zip(values, counts, strict=True) if value >= level]
    return f"{reached[0]:,.0f}" if reached else f"> {counts[-1]:,.0f}"


def one_model_task(model, name: str, task: str, count: int) -> list[list]:
    """The two rows (position-agnostic, by span) of one model and task."""
    prompts = lsc.data.prompts(task)[:count]
    rows, shared = [], None
    for positions in ("all", "spans"):
        t0 = time.perf_counter()
        scores = edges.edge_attribution(model, prompts, positions=positions, batch_size=8)
        total = int(np.isfinite(scores.values).sum())
        counts = [count for count in COUNTS if count <= total]
        values, kept, sizes = curve(model, prompts, scores, counts, total)
        took = time.perf_counter() - t0
        label = "position-agnostic" if positions == "all" else "by span"
        print(name, task, label, total, list(np.round(values, 3)), list(kept), f"{took:.0f} s")
        shared = shared or len(counts)  # CPR over the counts both graphs hold
        cpr = log_area(values[:shared], counts[:shared])
        rows.append(
            [
                *_report.stamp(),
                name,
                f"{task} ({len(prompts)})",
                label,
                f"{total:,}",
                first_at(values, counts),
                first_at(values, sizes),
                f"{cpr:.3f}",
                " / ".join(f"{v:.2f}" for v in values),
                f"{took:.0f} s",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--task", nargs="+", default=list(TASKS), choices=list(TASKS))
    args = _report.parse_args(parser, prompts=4, model=["smollm2-135m"], task=["ioi"])
    rows = []
    for name in args.model:
        model = lsc.load(name)
        for task in args.task:
            rows += one_model_task(model, name, task, args.prompts)
    intro = (__doc__ or "").split("\n\n", 1)[1].strip()
    body = "\n\n".join(
        [
            f"{args.prompts} prompts per task; edge counts {', '.join(map(str, COUNTS))} up "
            "to the graph's size (each pruned to paths, so a circuit may keep fewer); CPR "
            "here is the area under the curve over log edge count, divided by its span, "
            "over the counts the position-agnostic graph holds (so both rows of a model and "
            "task cover the same range).",
            _report.table(
                [
                    "date",
                    "machine",
                    "model",
                    "task (prompts)",
                    "circuits",
                    "edges in the graph",
                    "first count with f >= 0.9",
                    "its size in token-level edges (PEAP's count)",
                    "CPR (log count, the counts both graphs hold)",
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
