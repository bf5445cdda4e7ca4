"""Cost of edge attribution on the bundled model: EAP and EAP-IG vs one forward + backward.

On SmolLM2-135M (30 layers, 9 query heads, 3 key/value heads: 301 senders, 481 receivers,
about 72,000 edges) with the indirect-object prompts: the time of ``lsc.edge_attribution``
with EAP and with EAP-IG (``--steps`` points), each as a ratio to one plain forward +
backward of the same batches (the attribution-patching floor is 2 forward + 1 backward;
EAP-IG needs 1 forward + ``steps`` forward/backward); then the memory of the dense scores:
the (sender, receiver) float64 result, the per-batch float32 buffers (sender outputs and
receiver gradients, (batch, pos, n, d_model)), and the same numbers computed on paper for a
1B-parameter shape (Llama-3.2-1B: 16 layers, 32 query heads, 8 key/value heads, d_model
2048). Then how good the circuits are: faithfulness curves over edge budgets with CPR and
CMD for EAP, EAP-IG and random circuits of the same sizes (``lsc.circuit_faithfulness``),
and the agreement of each estimator with exact single-edge patching per receiver kind
(``lsc.edge_agreement``). Last, the peer: TransformerLens 4.3's edge attribution
(``attribution_patch(granularity="edge")``) refuses grouped-query attention, so both run on
the largest model both can: SmolLM2-135M's shape with as many key/value heads as query heads
(random weights, seeded), on the same prompts and metric. Writes the ``edges`` section of
RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import time

import _report

import lenscape as lsc


def edge_counts(n_layers: int, n_heads: int, n_kv: int) -> tuple[int, int, int]:
    """(senders, receivers, edges) of a model shape."""
    senders = 1 + n_layers * (n_heads + 1)
    receivers = n_layers * (n_heads + 2 * n_kv + 1) + 1
    edges = 0
    for layer in range(n_layers):
        upstream = 1 + layer * (n_heads + 1)
        edges += upstream * (n_heads + 2 * n_kv) + (upstream + n_heads)
    return senders, receivers, edges + senders


def buffer_mib(n_layers, n_heads, n_kv, d_model, tokens) -> tuple[float, float]:
    """(dense score matrix float64, per-batch sender + gradient buffers float32) in MiB."""
    senders, receivers, _ = edge_counts(n_layers, n_heads, n_kv)
    dense = senders * receivers * 8 / 2**20
    buffers = tokens * d_model * (2 * senders + receivers) * 4 / 2**20
    return dense, buffers


def forward_backward(model, prompts, batch_size: int) -> float:
    """Seconds of one plain Hugging Face forward and backward of ``prompts`` in batches (the
    gradient of the read position's logits from the embeddings): the unit of edge costs."""
    import torch

    tok = model.tokenizer
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        texts = [p.text for p in prompts[first : first + batch_size]]
        batch = tok(texts, return_tensors="pt", padding=True)
        with torch.enable_grad():
            embeds = model.hf.get_input_embeddings()(batch["input_ids"]).requires_grad_(True)
            logits = model.hf(inputs_embeds=embeds, attention_mask=batch["attention_mask"])
            logits.logits[:, -1].sum().backward()
    return time.perf_counter() - start


def peer_timing(model, prompts, batch_size: int) -> tuple[float, float, int]:
    """Seconds of lenscape's EAP and of TransformerLens's edge attribution on an MHA model of
    ``model``'s shape (TransformerLens takes one clean/corrupt pair per call), and its edges."""
    import copy

    import torch
    import transformers
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis import attribution_patching as tl

    config = copy.deepcopy(model.hf.config)
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    mha = lsc.models.from_hf(hf, model.tokenizer, name="smollm2-shape-mha", check=False)
    lsc.edge_attribution(mha, prompts[:1], progress=False)  # boot the backend
    start = time.perf_counter()
    ours = lsc.edge_attribution(mha, prompts, batch_size=batch_size, progress=False)
    lenscape_time = time.perf_counter() - start
    bridge = TransformerBridge.boot_transformers(
        "smollm2-shape-mha", hf_model=copy.deepcopy(hf), tokenizer=model.tokenizer, device="cpu"
    ).requires_grad_(True)
    tok = model.tokenizer
    start = time.perf_counter()
    for prompt in prompts:
        target = tok(prompt.target, add_special_tokens=False)["input_ids"][0]
        distractor = tok(prompt.distractor, add_special_tokens=False)["input_ids"][0]

        def metric(logits, target=target, distractor=distractor):
            return logits[0, -1, target] - logits[0, -1, distractor]

        tl.attribution_patch(
            bridge,
            torch.tensor([tok(prompt.text)["input_ids"]]),
            torch.tensor([tok(prompt.corrupt)["input_ids"]]),
            metric,
            tl.EdgeAttributionConfig(granularity="edge"),
        )
    return lenscape_time, time.perf_counter() - start, int(ours.notnull().sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--random", type=int, default=3, help="random circuits per budget")
    parser.add_argument("--top", type=int, default=40, help="top edges of each estimator checked")
    parser.add_argument("--sample", type=int, default=120, help="random edges checked")
    parser.add_argument("--peer-prompts", type=int, default=4, help="prompts of the peer timing")
    args = _report.parse_args(parser, prompts=4, random=1, top=3, sample=5, peer_prompts=2)
    model = lsc.load("smollm2-135m", device="cpu")
    prompts = lsc.data.prompts("ioi")[: args.prompts]
    spec = model.spec

    forward_backward(model, prompts, args.batch_size)  # warm up
    lsc.edge_attribution(model, prompts[:1], progress=False)  # boot the nnsight backend
    floor = forward_backward(model, prompts, args.batch_size)
    timings, scores = {}, {}
    estimators = {
        "eap": ("eap", None, None),
        f"eap-ig:{args.steps}": ("eap-ig", args.steps, None),
        "relp": ("relp", None, "relp"),
        "relp:secant": ("relp", None, "secant"),
    }
    for label, (estimator, steps, rules) in estimators.items():
        start = time.perf_counter()
        scores[label] = lsc.edge_attribution(
            model,
            prompts,
            estimator=estimator,
            steps=steps,
            rules=rules,
            batch_size=args.batch_size,
            progress=False,
        )
        timings[label] = time.perf_counter() - start
        print(f"{label}: {timings[label]:.1f} s = {timings[label] / floor:.1f}x F+B")
    width = max(len(model.tokenizer(p.text)["input_ids"]) for p in prompts)
    tokens = args.batch_size * width
    shapes = {
        "SmolLM2-135M": (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.d_model),
        "1B shape (Llama-3.2-1B, on paper)": (16, 32, 8, 2048),
    }
    rows = [
        [
            *_report.stamp(),
            f"{len(prompts)} IOI prompts, batch {args.batch_size}",
            f"{floor:.1f} s",
            *(f"{seconds:.1f} s ({seconds / floor:.1f}x)" for seconds in timings.values()),
        ]
    ]
    memory = []
    for name, (layers, heads, kv, d_model) in shapes.items():
        senders, receivers, n_edges = edge_counts(layers, heads, kv)
        dense, buffers = buffer_mib(layers, heads, kv, d_model, tokens)
        memory.append(
            [name, f"{senders} x {receivers}", f"{n_edges:,}", f"{dense:.1f}", f"{buffers:.0f}"]
        )
    budgets = (
        (0.001, 0.01, 0.05, 0.2, 1.0)
        if args.quick
        else lsc.capture.edges.patching.DEFAULT_FRACTIONS
    )
    curves = {
        name: lsc.circuit_faithfulness(
            model, prompts, result, fractions=budgets, n_random=args.random, progress=False
        )
        for name, result in scores.items()
    }
    faith_rows = [
        [label, f"{float(result.cpr):.3f}", f"{float(result.cmd):.3f}"]
        + [f"{v:.2f}" for v in result["faithfulness"].values]
        for label, result in curves.items()
    ]
    random = curves["eap"]
    faith_rows.append(
        [
            f"random (mean of {args.random})",
            f"{float(random.random_cpr):.3f}",
            f"{float(random.random_cmd):.3f}",
        ]
        + [f"{v:.2f}" for v in random["random_faithfulness"].mean("seed").values]
    )
    print(_report.table(["circuit", "CPR", "CMD", *map(str, budgets)], faith_rows))
    agreement = lsc.edge_agreement(
        model,
        prompts,
        estimators=list(estimators),
        steps=args.steps,
        n_top=args.top,
        n_random=args.sample,
        batch_size=args.batch_size,
        progress=False,
    )
    agree_rows = []
    for estimator in agreement["estimator"].values:
        for kind in agreement["receiver_kind"].values:
            cell = agreement.sel(estimator=estimator, receiver_kind=kind)
            low, high = (
                float(cell["pearson_cells_interval"].sel(bound=b)) for b in ("low", "high")
            )
            agree_rows.append(
                [
                    str(estimator),
                    str(kind),
                    int(cell["n_edges"]),
                    f"{float(cell['pearson_cells']):.3f}",
                    f"[{low:.3f}, {high:.3f}]",
                    f"{float(cell['top_overlap']):.2f}",
                    f"{float(cell['sign_agreement']):.2f}",
                ]
            )
    sampled = (
        f"{agreement.sizes['edge']} edges: the {args.top} top of each estimator and "
        f"{args.sample} at random"
    )
    agree_columns = ["estimator", "receiver", "edges", "Pearson r", "95% interval", "top-5", "sign"]
    print(sampled + "\n" + _report.table(agree_columns, agree_rows))
    peer_prompts = prompts[: args.peer_prompts]
    ours, theirs, n_mha_edges = peer_timing(model, peer_prompts, args.batch_size)
    print(f"peer: lenscape EAP {ours:.1f} s, TransformerLens {theirs:.1f} s")
    peer_rows = [
        [
            *_report.stamp(),
            f"SmolLM2-135M shape, 9 key/value heads (MHA), {n_mha_edges:,} edges",
            f"{len(peer_prompts)} IOI prompts",
            f"{ours:.1f} s",
            f"{theirs:.1f} s ({theirs / ours:.1f}x)",
        ]
    ]
    body = "\n\n".join(
        [
            _report.table(
                ["date", "machine", "prompts", "1 forward + backward", *estimators],
                rows,
            ),
            _report.table(
                [
                    "model",
                    "senders x receivers",
                    "edges",
                    "dense scores (MiB, float64)",
                    f"batch buffers (MiB, {tokens} tokens)",
                ],
                memory,
            ),
            "Faithfulness (share of the clean - corrupt logit difference kept by the circuit "
            "alone, exact edge patching) at each edge budget:",
            _report.table(["circuit", "CPR", "CMD", *map(str, budgets)], faith_rows),
            "Agreement with exact single-edge patching, per receiver kind (Pearson r over "
            f"prompt x edge cells with its 95% bootstrap interval over prompts; {sampled}):",
            _report.table(agree_columns, agree_rows),
            "Beside the peer (TransformerLens 4.3 refuses grouped-query attention, so both run "
            "an MHA model of SmolLM2's shape; TransformerLens takes one prompt pair per call, "
            "lenscape batches):",
            _report.table(
                ["date", "machine", "model", "prompts", "lenscape EAP", "TransformerLens EAP"],
                peer_rows,
            ),
        ]
    )
    intro = (
        "Time of `lsc.edge_attribution` for every edge with each estimator (EAP, EAP-IG, "
        "RelP under its own rules and under the secant rules), as a ratio to one plain "
        "forward + backward of the same batches, and the memory of the dense edge scores. "
        "Memory grows with senders x receivers, about (layers x heads)^2. Then each "
        "estimator's circuits judged by exact edge patching, and each estimator against exact "
        "single-edge patching."
    )
    _report.emit(args, _report.section("edges", "Edge attribution cost", intro, body))


if __name__ == "__main__":
    main()
