"""Per-cluster block masks (IG-Pruning) on the bundled models: routed vs global vs random on
held-out texts, and the time it takes.

For each model: split the mixed corpus (25% of each kind held out, never clustered or
trained on), cluster the rest (all-MiniLM-L6-v2, k-means K=8), and run
``lsc.mask_comparison``: one stacked fit learns a mask per cluster and a global mask for every
target sparsity until the keep probabilities stop moving; each held-out text is routed to
its nearest centroid. Reports the held-out perplexity relative to the unmasked model per
strategy and sparsity, and routed vs global per cluster at sparsity 0.3. Target: <= 10
minutes per model. Writes the ``block_masks`` section of RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import time

import _report

import lenscape as lsc
from lenscape import cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--sparsities", default="0.1,0.2,0.3,0.4,0.5")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--loss", default="nll", choices=("nll", "kl"))
    parser.add_argument(
        "--note",
        default="",
        help="a sentence about this run (e.g. machine shared, settings reduced)",
    )
    parser.add_argument(
        "--texts", type=int, default=None, help="use N texts spread evenly over the corpus"
    )
    args = _report.parse_args(
        parser, k=2, max_steps=2, texts=32, sparsities="0.3", models="smollm2-135m"
    )
    sparsities = [float(s) for s in args.sparsities.split(",")]
    prompts = lsc.data.prompts("mixed")
    if args.texts:
        prompts = prompts[:: max(1, len(prompts) // args.texts)][: args.texts]
    train, held_out = cluster.split(prompts, held_out=0.25, seed=0)
    clusters = cluster.kmeans(cluster.embed(train), args.k, prompts=train)
    summary, ratios, per_cluster, projections = [], [], [], []
    full_sets = 5 * (8 + 1)  # the full setting: 5 sparsities x (K=8 clusters + the global mask)
    sets = len(sparsities) * (args.k + 1)
    shown = 0.3 if 0.3 in sparsities else sparsities[0]
    for name in args.models.split(","):
        model = lsc.load(name, device="cpu")
        start = time.perf_counter()
        result = lsc.mask_comparison(
            model,
            train,
            held_out,
            clusters=clusters,
            sparsities=sparsities,
            loss=args.loss,
            max_steps=args.max_steps,
            progress=False,
        )
        took = time.perf_counter() - start
        a = result.attrs
        print(
            f"{name}: {took:.0f} s, {a['steps']} updates, converged {a['converged']}, "
            f"unmasked held-out NLL {a['loss_unmasked']:.3f}"
        )
        summary.append(
            [
                *_report.stamp(),
                name,
                f"{took:.0f} s",
                str(a["steps"]),
                "yes" if a["converged"] else "no",
                f"{a['loss_unmasked']:.3f}",
            ]
        )
        projections.append(
            f"{name}: {sets} stacked masks took {took:.0f} s for {a['steps']} updates; at the "
            f"same updates, the full setting's {full_sets} masks would take about "
            f"{took * full_sets / sets / 60:.0f} min on this machine (time grows with the "
            "rows per update, one batch per mask)."
        )
        for strategy in result["strategy"].values:
            values = result["ppl_ratio"].sel(strategy=strategy).values
            print(
                f"  {strategy}: "
                + ", ".join(f"{s:g}: {v:.2f}" for s, v in zip(sparsities, values, strict=True))
            )
            ratios.append([name, str(strategy), *(f"{v:.2f}" for v in values)])
        for c in range(args.k):
            routed = float(result["loss_routed"].sel(target_sparsity=shown, cluster=c))
            global_ = float(result["loss_global"].sel(target_sparsity=shown, cluster=c))
            kinds = clusters.members(train, c).categories
            kind = max(set(kinds), key=kinds.count)
            per_cluster.append(
                [
                    name,
                    c,
                    kind,
                    int(result["n_held_out"].sel(cluster=c)),
                    f"{routed:.3f}",
                    f"{global_:.3f}",
                    "routed" if routed < global_ else "global",
                ]
            )
    intro = f"""\
`python benchmarks/block_masks.py`: the mixed corpus ({len(prompts)} texts), {len(held_out)} held
out (25% of each kind; never clustered or trained on), {len(train)} clustered with
all-MiniLM-L6-v2 + k-means K={args.k}. `lsc.mask_comparison` with loss {args.loss}: one stacked fit
of a mask per cluster plus a global mask per sparsity ({args.sparsities}), each until its keep
probabilities move less than 0.005 over 20 updates, at most {args.max_steps} updates. Score:
held-out perplexity / unmasked perplexity (routed = each text with its nearest cluster's mask;
random = 3 random masks with as many kept blocks, averaged). Target: <= 10 min per model."""
    body = "\n\n".join(
        [
            _report.table(
                [
                    "date",
                    "machine",
                    "model",
                    "time",
                    "updates",
                    "converged",
                    "unmasked held-out NLL",
                ],
                summary,
            ),
            "Held-out perplexity ratio by target sparsity:",
            _report.table(["model", "strategy", *[f"{s:g}" for s in sparsities]], ratios),
            f"Routed vs global at sparsity {shown}, per cluster (mean held-out NLL of the texts "
            "routed to it):",
            _report.table(
                ["model", "cluster", "main kind", "held-out texts", "routed", "global", "better"],
                per_cluster,
            ),
            *projections,
            *([args.note] if args.note else []),
        ]
    )
    _report.emit(args, _report.section("block_masks", "Block masks (issues 4, 11)", intro, body))


if __name__ == "__main__":
    main()
