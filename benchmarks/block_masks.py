"""Per-cluster block masks on the bundled model: time for F1, learned vs random masks.

Clusters the built-in mixed corpus (all-MiniLM-L6-v2 embeddings, k-means, K=8), learns one
mask per cluster at the default settings, then for each cluster compares the loss on that
cluster's texts with its learned mask against random masks skipping the same number of
blocks (mean of 5). Target: F1 for one model <= 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import lenscape as lsc
from lenscape import cluster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    model = lsc.load(args.model, device="cpu")
    prompts = lsc.data.prompts("mixed")
    start = time.perf_counter()
    clusters = cluster.kmeans(cluster.embed(prompts), args.k, prompts=prompts)
    kw = {} if args.steps is None else {"steps": args.steps}
    masks = lsc.block_masks(model, prompts, clusters=clusters, progress=False, **kw)
    took = time.perf_counter() - start
    print(f"{model.name}: K={args.k}, {masks.attrs['steps']} steps, target sparsity "
          f"{masks.attrs['target_sparsity']}: clustering + masks {took:.0f} s")
    rng = np.random.default_rng(0)
    print("cluster | main kind | kept blocks | loss, no mask | learned mask | random masks "
          "(mean of 5)")
    wins = 0
    for c in range(clusters.k):
        members = clusters.members(prompts, c)
        learned = masks["mask"].sel(cluster=c).values.astype(np.float32)
        kept = int(learned.sum())
        randoms = np.zeros((5, *learned.shape), dtype=np.float32)
        for r in range(5):
            randoms[r].flat[rng.choice(learned.size, kept, replace=False)] = 1
        sets = np.concatenate([np.ones_like(learned)[None], learned[None], randoms])
        losses = lsc.masked_loss(model, members, torch.as_tensor(sets)).numpy()
        kind = max(set(members.categories), key=members.categories.count)
        wins += losses[1] < losses[2:].mean()
        print(f"{c} | {kind} | {kept}/{learned.size} | {losses[0]:.3f} | {losses[1]:.3f} | "
              f"{losses[2:].mean():.3f}")
    print(f"learned mask beats random masks in {wins}/{clusters.k} clusters")


if __name__ == "__main__":
    main()
