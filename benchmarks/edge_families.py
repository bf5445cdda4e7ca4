"""Edges on every family, against an independent per-receiver computation; gemma3-270m.

Three parts (``--parts``, default all):

- ``tiny``: on each tiny random family (``lsc.models.tiny``, 2 layers, 2 IOI prompts), every
  edge's EAP, EAP-IG (3 steps), RelP (relp and secant rules, where the rules cover the
  family) and exact single-edge patching against the per-receiver
  references of ``tests/_helpers.py`` (plain forward hooks on the Hugging Face modules, each
  family's q/k/v columns written by hand from its source; autograd through one receiver's
  own copy of the stream), as the largest difference relative to the largest score (for
  patching: to the largest effect); then exact edge patching with every edge patched
  against the other run and with none against the base run.
- ``gemma``: the same on gemma3-270m (bundled; 18 layers, 4 query heads, 1 key/value head,
  post-norms, per-head QK-norm, sliding windows) on a seeded sample of edges (``--receivers``
  receivers of every kind, ``--senders`` upstream senders each), one prompt; and the measured
  consequence of the post-norm convention: a head's outgoing edges all patched together
  (each receiver reads the head's clean share at the clean run's norm scale, the other
  heads at the corrupt one's) against activation patching of the head itself (the norm's
  scale moves for every head of the block).
- ``timing``: seconds of EAP, EAP-IG (5 steps) and exact edge patching (a 5% circuit, and 16
  single edges) on SmolLM2-135M (Llama family) and gemma3-270m, median of ``--repeats``, and
  as a ratio to one plain forward + backward of the same prompts (``edges.forward_backward``),
  for a before/after comparison: run it with ``PYTHONPATH`` at each version of the code, in
  turn (a version that refuses a family says so in its row).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import _report
import numpy as np

import lenscape as lsc
from lenscape.capture.edges import patching as edge_patching
from lenscape.capture.edges.graph import Graph
from lenscape.sweep.relevance import unsupported

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import _helpers as hand
from edges import forward_backward

#: Prompts per batch in the timing part (edge_attribution's default).
BATCH_SIZE = 8

#: Every tiny family but Mistral and Qwen 2, which compute as Llama does.
FAMILIES = tuple(a for a in lsc.models.TINY_ARCHITECTURES if a not in ("mistral", "qwen2"))


def _labels(graph: Graph, flat) -> list[tuple[str, str]]:
    senders, receivers = np.unravel_index(np.asarray(flat), graph.shape)
    return [
        (graph.sender_labels[s], graph.receiver_labels[r])
        for s, r in zip(senders, receivers, strict=True)
    ]


def _relative(ours, reference, scale=None) -> float:
    ours, reference = np.asarray(ours, float), np.asarray(reference, float)
    scale = np.abs(reference).max() if scale is None else scale
    return float(np.abs(ours - reference).max() / scale)


def compare(model, prompts, flat, steps: int, receivers=None) -> dict[str, float]:
    """Largest relative differences of EAP, EAP-IG and exact single-edge patching against
    the references, over ``prompts`` and the edges ``flat`` (indices into the graph)."""
    graph = Graph.of(model)
    labels = _labels(graph, flat)
    eap = lsc.edge_attribution(model, prompts, per_prompt=True, progress=False)
    ig = lsc.edge_attribution(
        model, prompts, estimator="eap-ig", steps=steps, per_prompt=True, progress=False
    )
    exact = edge_patching._edge_variants(
        model,
        prompts,
        variants=tuple(("only", (int(i),)) for i in flat),
        base="corrupt",
        progress=False,
    )
    worst = {"eap": 0.0, f"eap-ig:{steps}": 0.0, "exact": 0.0}
    for i, prompt in enumerate(prompts):
        for name, ours, k in ((f"eap-ig:{steps}", ig, steps), ("eap", eap, 1)):
            ref = hand.reference_edge_scores(model, prompt, steps=k, receivers=receivers)
            got = [float(ours.isel(prompt=i).sel(sender=s, receiver=r)) for s, r in labels]
            worst[name] = max(worst[name], _relative(got, [ref[label] for label in labels]))
        ref = hand.reference_edge_patching(model, prompt, labels)
        expected = np.array([ref[label] for label in labels])
        base = float(exact["base"].isel(prompt=i))
        worst["exact"] = max(
            worst["exact"],
            _relative(exact["patched"].isel(prompt=i), expected, np.abs(expected - base).max()),
        )
    return worst


def compare_relp(model, prompts, flat) -> dict[str, str]:
    """RelP edges (relp and secant rules) against the reference under the same rules, or
    "refused" where the rule set does not cover the model."""
    labels = _labels(Graph.of(model), flat)
    out = {}
    for rules in ("relp", "secant"):
        if unsupported(model, rules) is not None:
            out["relp" if rules == "relp" else "relp:secant"] = "refused"
            continue
        scores = lsc.edge_attribution(
            model, prompts, estimator="relp", rules=rules, per_prompt=True, progress=False
        )
        worst = 0.0
        for i, prompt in enumerate(prompts):
            ref = hand.reference_edge_scores(model, prompt, rules=rules)
            got = [float(scores.isel(prompt=i).sel(sender=s, receiver=r)) for s, r in labels]
            worst = max(worst, _relative(got, [ref[label] for label in labels]))
        out["relp" if rules == "relp" else "relp:secant"] = f"{worst:.1e}"
    return out


def ends(model, prompts) -> float:
    """Largest |every edge patched - other run| and |no edge patched - base run|, relative
    to |clean - corrupt|, over both bases."""
    worst = 0.0
    for base in ("clean", "corrupt"):
        result = edge_patching._edge_variants(
            model, prompts, variants=(("outside", ()), ("only", ())), base=base, progress=False
        )
        every, none = result["patched"].values.T
        scale = float(np.abs(result["base"] - result["other"]).max())
        worst = max(
            worst,
            float(np.abs(every - result["other"].values).max()) / scale,
            float(np.abs(none - result["base"].values).max()) / scale,
        )
    return worst


def tiny_part(prompts, steps: int) -> str:
    tokenizer = hand.small_tokenizer()
    rows = []
    for family in FAMILIES:
        start = time.perf_counter()
        model = lsc.models.tiny(family, n_layers=2, tokenizer=tokenizer)
        graph = Graph.of(model)
        worst = compare(model, prompts, np.flatnonzero(graph.valid), steps)
        relp = compare_relp(model, prompts, np.flatnonzero(graph.valid))
        end = ends(model, prompts)
        print(f"{family}: {worst}, {relp}, ends {end:.1e} ({time.perf_counter() - start:.0f} s)")
        rows.append(
            [
                *_report.stamp(),
                family,
                model.spec.computation.residual,
                int(graph.valid.sum()),
                *(f"{value:.1e}" for value in worst.values()),
                *relp.values(),
                f"{end:.1e}",
            ]
        )
    columns = ["date", "machine", "family", "residual", "edges", "eap", f"eap-ig:{steps}"]
    return _report.table([*columns, "exact", "relp", "relp:secant", "all / none patched"], rows)


def _sample(graph: Graph, n_receivers: int, n_senders: int, seed: int):
    """A seeded sample: ``n_receivers`` receivers (spread over the kinds, the logits
    included), each with up to ``n_senders`` upstream senders; flat edge indices."""
    rng = np.random.default_rng(seed)
    kinds = np.array([kind for kind, _, _ in graph.receivers])
    layers = np.array([layer for _, layer, _ in graph.receivers])
    chosen = [len(graph.receivers) - 1]
    pool = [r for r in range(len(graph.receivers) - 1) if layers[r] >= 2]
    for kind in ("q", "k", "v", "mlp"):
        of_kind = [r for r in pool if kinds[r] == kind]
        chosen += list(rng.choice(of_kind, size=(n_receivers - 1) // 4, replace=False))
    flat = []
    for r in sorted(chosen):
        upstream = np.flatnonzero(graph.valid[:, r])
        picked = rng.choice(upstream, size=min(n_senders, len(upstream)), replace=False)
        flat += [int(s) * graph.shape[1] + int(r) for s in sorted(picked)]
    return np.asarray(sorted(flat)), {graph.receiver_labels[r] for r in chosen}


def _usable(model, prompts, count: int):
    """The first ``count`` prompts whose clean and corrupt texts tokenize to the same length
    in this model's tokenizer."""
    from lenscape.sweep.inputs import tokenize

    kept = []
    for prompt in prompts:
        try:
            tokenize(model, [prompt], needs_corrupt=True, needs_distractor=True)
        except ValueError:
            continue
        kept.append(prompt)
        if len(kept) == count:
            break
    return lsc.data.PromptSet(kept, name="ioi")


def post_norm_consequence(model, prompts) -> dict[str, float]:
    """Each head's outgoing edges patched together (corrupt run, clean shares) against
    activation patching of the head, both as effects on the logit difference."""
    graph = Graph.of(model)
    heads = [
        (s, layer, head) for s, (kind, layer, head) in enumerate(graph.senders) if kind == "head"
    ]
    variants = tuple(
        ("only", tuple(int(i) for i in np.flatnonzero(graph.valid[s]) + s * graph.shape[1]))
        for s, _, _ in heads
    )
    result = edge_patching._edge_variants(
        model, prompts, variants=variants, base="corrupt", progress=False
    )
    edges = (result["patched"] - result["base"]).mean("prompt").values
    patched = lsc.activation_patching(model, prompts, level="head", progress=False)
    node = np.array([float(patched.sel(layer=lay, head=h).mean()) for _, lay, h in heads])
    difference = np.abs(edges - node) / np.abs(node).max()
    return {
        "heads": len(heads),
        "median": float(np.median(difference)),
        "max": float(difference.max()),
        "pearson": float(np.corrcoef(edges, node)[0, 1]),
        "sign": float(np.mean(np.sign(edges) == np.sign(node))),
        "top5": len(set(np.argsort(-np.abs(edges))[:5]) & set(np.argsort(-np.abs(node))[:5])) / 5,
    }


def gemma_part(args) -> str:
    model = lsc.load("gemma3-270m", device="cpu")
    prompts = _usable(model, lsc.data.prompts("ioi"), max(args.gemma_prompts, 4))
    graph = Graph.of(model)
    flat, receivers = _sample(graph, args.receivers, args.senders, args.seed)
    print(f"gemma3-270m: {len(flat)} edges into {len(receivers)} receivers")
    start = time.perf_counter()
    worst = compare(model, prompts[: args.gemma_prompts], flat, args.steps, receivers)
    end = ends(model, prompts[: args.gemma_prompts])
    print(f"gemma3-270m: {worst}, ends {end:.1e} ({time.perf_counter() - start:.0f} s)")
    consequence = post_norm_consequence(model, prompts[:4])
    print(f"post-norm convention: {consequence}")
    row = [
        *_report.stamp(),
        "gemma3-270m",
        f"{len(flat)} of {int(graph.valid.sum())} ({len(receivers)} receivers)",
        *(f"{value:.1e}" for value in worst.values()),
        f"{end:.1e}",
    ]
    columns = ["date", "machine", "model", "edges", "eap", f"eap-ig:{args.steps}", "exact"]
    conv = [
        [
            *_report.stamp(),
            consequence["heads"],
            f"{consequence['median']:.3f}",
            f"{consequence['max']:.3f}",
            f"{consequence['pearson']:.3f}",
            f"{consequence['sign']:.2f}",
            f"{consequence['top5']:.1f}",
        ]
    ]
    return "\n\n".join(
        [
            _report.table([*columns, "all / none patched"], [row]),
            "Post-norm convention on gemma3-270m (4 IOI prompts, mean effect on the logit "
            "difference per head): a head's outgoing edges all patched against activation "
            "patching of the head; |difference| relative to the largest head effect:",
            _report.table(
                ["date", "machine", "heads", "median", "max", "Pearson r", "same sign", "top-5"],
                conv,
            ),
        ]
    )


def _edge_calls(model, prompts, circuit, singles) -> dict:
    """The timed calls: label -> a function of no arguments."""
    return {
        "eap": lambda: lsc.edge_attribution(model, prompts, progress=False),
        "eap-ig:5": lambda: lsc.edge_attribution(
            model, prompts, estimator="eap-ig", steps=5, progress=False
        ),
        "edge_patching (5% circuit)": lambda: lsc.edge_patching(
            model, prompts, circuit, progress=False
        ),
        "16 single edges": lambda: edge_patching._edge_variants(
            model, prompts, variants=singles, progress=False
        ),
    }


def timing_part(args) -> str:
    rows = []
    for name in args.timing_models.split(","):
        model = lsc.load(name, device="cpu")
        prompts = _usable(model, lsc.data.prompts("ioi"), args.timing_prompts)
        try:
            scores = lsc.edge_attribution(model, prompts, progress=False)  # warm up
        except ValueError as refused:  # a version of lenscape without edges on this family
            print(f"{lsc.__file__}: {name} refused: {str(refused)[:120]}")
            rows.append([*_report.stamp(), name, "refused", "-", "-"])
            continue
        forward_backward(model, prompts, BATCH_SIZE)  # warm up
        floor = statistics.median(
            forward_backward(model, prompts, BATCH_SIZE) for _ in range(args.repeats)
        )
        rows.append(
            [*_report.stamp(), name, "one forward + backward (floor)", f"{floor:.2f} s", "1.0x"]
        )
        graph = Graph.of(model)
        circuit = lsc.circuit(scores, fraction=0.05)
        singles = tuple(("only", (int(i),)) for i in np.flatnonzero(graph.valid)[::4000][:16])
        calls = _edge_calls(model, prompts, circuit, singles)
        for label, call in calls.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            print(
                f"{lsc.__file__}: {name} {label} {median:.2f} s (of {[round(t, 2) for t in times]})"
            )
            rows.append(
                [*_report.stamp(), name, label, f"{median:.2f} s", f"{median / floor:.1f}x"]
            )
    return _report.table(["date", "machine", "model", "call", "median", "/ floor"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parts", default="tiny,gemma,timing")
    parser.add_argument("--prompts", type=int, default=2, help="IOI prompts of the tiny part")
    parser.add_argument("--steps", type=int, default=3, help="EAP-IG integration points")
    parser.add_argument("--gemma-prompts", type=int, default=1)
    parser.add_argument("--receivers", type=int, default=29)
    parser.add_argument("--senders", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-prompts", type=int, default=8)
    parser.add_argument("--timing-models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--repeats", type=int, default=3)
    args = _report.parse_args(parser, prompts=1, receivers=5, senders=2, repeats=1)
    parts = args.parts.split(",")
    body = []
    if "tiny" in parts:
        body.append(tiny_part(lsc.data.prompts("ioi")[: args.prompts], args.steps))
    if "gemma" in parts:
        body.append(gemma_part(args))
    if "timing" in parts:
        body.append(timing_part(args))
    intro = (
        "Edge attribution and exact edge patching on every family against an independent "
        "per-receiver computation (tests/_helpers.py): the largest difference relative to "
        "the largest score (exact patching: to the largest effect), all edges of each tiny "
        "model and a seeded sample on gemma3-270m; then the post-norm convention's measured "
        "consequence, and the timings on SmolLM2-135M (Llama family) and gemma3-270m "
        "(`python benchmarks/edge_families.py`)."
    )
    _report.emit(
        args, _report.section("edge_families", "Edges on every family", intro, "\n\n".join(body))
    )


if __name__ == "__main__":
    main()
