"""RelP probe: which relevance rules make attribution patching agree with exact patching.

A research script (not yet a RESULTS.md section). For each prompt family it compares exact
activation patching (heads and blocks, cached under ``--cache``) with gradient estimates of
it, per component type (heads, attention blocks, MLP blocks): Pearson r over every
(prompt x component) cell and the overlap of the exact and estimated top-10 components by
|prompt-mean effect|, with each estimate's CPU time relative to ``lsc.attribution_patching``
with ``estimator="atp"`` measured in the same process (``--timing-rounds``: the fastest of
several interleaved rounds on a few prompts).

Estimates: lenscape's own ``atp`` and ``ig:2``, and local ones computed here: score = sum
over real positions of (clean - corrupt activation) . c, with c the gradient of the metric
on the corrupt run (or at points ``a`` of the straight path from the corrupt to the clean
residual stream entering block 0, averaged) under a set of relevance rules
(``lenscape.sweep.relevance``; the clean pass is the reference of the secant rules). A
variant is ``RULES@POINTS``: ``relp@0`` is RelP, ``secant@0`` the secant rules,
``none@0`` reproduces AtP, ``relp@0/0.5`` is RelP along a 2-point integration path,
``relp@0.5`` takes the coefficients at the midpoint of the path (one extra forward pass for
the corrupt activations). A ``+mlp0`` suffix measures the layer-0 MLP block exactly instead
(one extra forward pass, its clean output patched in at every position). ``mix:A&B`` takes
heads and attention blocks from variant A and MLP blocks from variant B (its time is the
sum of both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch
import xarray as xr

import lenscape as lsc
from lenscape.capture.faithfulness import agreement
from lenscape.sweep import metrics
from lenscape.sweep.backend import Site, get_backend
from lenscape.sweep.inputs import Inputs, tokenize
from lenscape.sweep.relevance import RULE_SETS, relevance_rules

INPUT_SITE: Site = ("resid_pre", 0)
TYPES = ("head", "attn", "mlp")
DEFAULT_VARIANTS = (
    "atp,ig:2,none@0,relp@0,relp-ah@0,attnlrp@0,ah@0,secant@0,relp@0.5,relp-ah@0.5,none@0.5,"
    "relp@0/0.5,mix:none@0&relp-ah@0,none@0+mlp0,relp@0+mlp0,relp-ah@0+mlp0,secant@0+mlp0"
)


def usable(model: lsc.LensModel, prompts) -> lsc.data.PromptSet:
    """The pairs this model's tokenizer keeps aligned (clean and corrupt texts of equal
    token length, single-token target and distractor), in order."""
    tokenizer = model.tokenizer

    def pieces(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    kept = [
        p
        for p in prompts
        if len(tokenizer(p.text)["input_ids"]) == len(tokenizer(p.corrupt)["input_ids"])
        and pieces(p.target) == 1
        and pieces(p.distractor) == 1
    ]
    return lsc.data.from_records(kept, name=f"{prompts.name}-aligned")


def exact(model: lsc.LensModel, family: str, prompts, level: str, cache: Path) -> xr.DataArray:
    """Exact activation patching at ``level``, read from ``cache`` when computed before."""
    path = cache / f"{model.name}_{family}_{len(prompts)}_{level}.nc"
    if path.exists():
        return lsc.open(path).load()
    start = time.perf_counter()
    result = lsc.activation_patching(model, prompts, level=level, progress=False)
    print(f"  exact {level} patching: {time.perf_counter() - start:.0f} s (cached to {path})")
    lsc.save(result, path)
    return result


def batch_scores(
    model: lsc.LensModel,
    batch,
    sites: list[Site],
    rules: str,
    points: tuple[float, ...],
    exact: tuple[Site, ...] = (),
) -> dict[Site, torch.Tensor]:
    """Per site, (clean - corrupt) . mean_k c(a_k) summed over real positions: (batch, head)
    for "z" sites, (batch,) for blocks; the block sites in ``exact`` are measured exactly
    instead (one forward pass each, the clean activation patched in at every position).
    The clean pass is the reference of rules that need one (the secant rules)."""
    assert batch.corrupt is not None
    runner = get_backend(model, "nnsight")
    interpolated = any(a > 0 for a in points)
    with contextlib.ExitStack() as stack:
        relevance = None if rules == "none" else stack.enter_context(relevance_rules(model, rules))
        with torch.no_grad():
            reference = relevance is not None and relevance.rules.needs_reference
            with relevance.reference() if reference else contextlib.nullcontext():
                clean = runner.run(
                    batch.clean, sites=[INPUT_SITE, *sites] if interpolated else sites
                )
            corrupt = None if 0 in points else runner.run(batch.corrupt, sites=sites)
            patched = {
                site: runner.run(batch.corrupt, sites=[site], edit=lambda s, v: clean.acts[s])
                for site in exact
            }
        start = clean.acts.get(INPUT_SITE)
        grads: dict[Site, torch.Tensor] = {}
        for a in points:

            def path(site: Site, value: torch.Tensor, a: float = a) -> torch.Tensor:
                assert start is not None
                return value + a * (start - value) if site == INPUT_SITE else value

            run = runner.run(
                batch.corrupt,
                sites=[INPUT_SITE, *sites] if a > 0 else sites,
                edit=path if a > 0 else None,
                grad=True,
            )
            value = metrics.compute("logit_diff", run.logits, batch.target, batch.distractor)
            found = torch.autograd.grad(value.sum(), [run.acts[s] for s in sites])
            if a == 0:
                corrupt = run
            for site, grad in zip(sites, found, strict=True):
                grads[site] = grads.get(site, 0) + grad.detach().double() / len(points)
    assert corrupt is not None
    mask = batch.corrupt.attention_mask.double()
    scores = {}
    for site in sites:
        product = (clean.acts[site].double() - corrupt.acts[site].detach().double()) * grads[site]
        equation = "bphd,bp->bh" if site[0] == "z" else "bpd,bp->b"
        scores[site] = torch.einsum(equation, product, mask)
    base = metrics.compute("logit_diff", corrupt.logits, batch.target, batch.distractor)
    for site, run in patched.items():
        value = metrics.compute("logit_diff", run.logits, batch.target, batch.distractor)
        scores[site] = (value - base.detach()).double()
    return scores


def local_estimate(
    model: lsc.LensModel,
    prompts,
    *,
    rules: str,
    points: tuple[float, ...],
    batch_size: int,
    exact: tuple[Site, ...] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """(clean - corrupt) . mean_k c(a_k), summed over real positions, for every head and block.

    Args:
        rules: a name in ``RULE_SETS``, or "none" for the plain gradient.
        points: path positions a_k in [0, 1) where the coefficients are taken.
        exact: block sites measured exactly instead (``batch_scores``).

    Returns:
        heads (prompt, layer, head) and blocks (prompt, layer, 2: attn, mlp), float64.
    """
    inputs = Inputs(
        model,
        tokenize(model, prompts, needs_corrupt=True, needs_distractor=True),
        "logit_diff",
        "head",
        "nnsight",
        batch_size,
        "right",
    )
    layers = range(model.spec.n_layers)
    sites: list[Site] = [(kind, layer) for layer in layers for kind in ("z", "attn", "mlp")]
    heads, blocks = [], []
    for batch in inputs.batches():
        scores = batch_scores(model, batch, sites, rules, points, exact)
        heads.append(torch.stack([scores[("z", layer)] for layer in layers], 1))
        blocks.append(
            torch.stack(
                [torch.stack([scores[("attn", lay)], scores[("mlp", lay)]], 1) for lay in layers],
                1,
            )
        )
    return torch.cat(heads).numpy(), torch.cat(blocks).numpy()


Maps = dict[str, xr.DataArray]


def estimate(
    model: lsc.LensModel,
    prompts,
    variant: str,
    exact_heads: xr.DataArray,
    exact_blocks: xr.DataArray,
    batch_size: int,
    done: dict[str, tuple[Maps, float]],
) -> tuple[Maps, float]:
    """One variant's estimate per component type and its CPU time in seconds (kept in
    ``done``, which a ``mix:`` variant reads its parts from). CPU time (of the process, all
    threads) rather than wall time: on a shared machine it moves far less with the load."""
    if variant in done:
        return done[variant]
    if variant.startswith("mix:"):
        first, second = variant[4:].split("&")
        a, a_time = estimate(model, prompts, first, exact_heads, exact_blocks, batch_size, done)
        b, b_time = estimate(model, prompts, second, exact_heads, exact_blocks, batch_size, done)
        return {"head": a["head"], "attn": a["attn"], "mlp": b["mlp"]}, a_time + b_time
    start = time.process_time()
    if variant in ("atp", "ig:2"):
        name, _, steps = variant.partition(":")
        result = lsc.attribution_patching(
            model,
            prompts,
            level="all",
            estimator=name,
            steps=int(steps) if steps else None,
            batch_size=batch_size,
            progress=False,
        )
        heads, blocks = result["heads"], result["blocks"]
    else:
        variant, _, exact = variant.partition("+")
        rules, _, where = variant.partition("@")
        points = tuple(float(a) for a in where.split("/")) if where else (0.0,)
        head_values, block_values = local_estimate(
            model,
            prompts,
            rules=rules,
            points=points,
            batch_size=batch_size,
            exact=(("mlp", 0),) if exact == "mlp0" else (),
        )
        heads = exact_heads.copy(data=head_values)
        blocks = exact_blocks.copy(data=block_values)
    seconds = time.process_time() - start
    done[variant] = (
        {
            "head": heads,
            "attn": blocks.sel(component="attn", drop=True),
            "mlp": blocks.sel(component="mlp", drop=True),
        },
        seconds,
    )
    return done[variant]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--families", default="factual,ioi")
    parser.add_argument("--prompts", type=int, default=None, help="first N of each family")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/relp_cache"))
    parser.add_argument(
        "--timing-rounds",
        type=int,
        default=0,
        help="then time every variant this many rounds, interleaved with atp (min per variant)",
    )
    parser.add_argument("--timing-prompts", type=int, default=16, help="prompts per timing run")
    parser.add_argument("--json", type=Path, default=None, help="append result rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.cache.mkdir(parents=True, exist_ok=True)
    model = lsc.load(args.model, device="cpu")
    variants = args.variants.split(",")
    known = (*RULE_SETS, "none", "atp", "ig:2")
    unknown = [v for v in variants if not v.startswith("mix:") and v.split("@")[0] not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; rule sets are {list(RULE_SETS)}")
    print(f"{model.name}; {args.threads} thread(s); variants {variants}")
    for family in args.families.split(","):
        prompts = usable(model, lsc.data.prompts(family))
        prompts = prompts[: args.prompts] if args.prompts else prompts
        print(f"\n{family}: {len(prompts)} prompts (of {len(lsc.data.prompts(family))})")
        exact_heads = exact(model, family, prompts, "head", args.cache)
        exact_blocks = exact(model, family, prompts, "block", args.cache)
        truth = {
            "head": exact_heads,
            "attn": exact_blocks.sel(component="attn", drop=True),
            "mlp": exact_blocks.sel(component="mlp", drop=True),
        }
        atp_seconds = None
        done: dict[str, tuple[Maps, float]] = {}
        print(f"  {'variant':24s} " + "  ".join(f"{t:>4s} r  top10" for t in TYPES) + "  time")
        for variant in variants:
            maps, seconds = estimate(
                model, prompts, variant, exact_heads, exact_blocks, args.batch_size, done
            )
            atp_seconds = seconds if variant == "atp" else atp_seconds
            cells = []
            for kind in TYPES:
                stats = agreement(truth[kind], maps[kind], top_k=10)
                cells.append(f"{stats['pearson_cells']:7.3f} {stats['top_overlap']:5.2f}")
            ratio = f"{seconds / atp_seconds:.2f}x" if atp_seconds else "-"
            print(f"  {variant:24s} " + "  ".join(cells) + f"  {seconds:6.1f} s {ratio}")
            if args.json:
                row = {"model": model.name, "family": family, "prompts": len(prompts)}
                row |= {"variant": variant, "seconds": seconds, "cells": cells}
                with args.json.open("a") as out:
                    out.write(json.dumps(row) + "\n")
        if args.timing_rounds:
            timing(model, prompts[: args.timing_prompts], variants, args)


def timing(model: lsc.LensModel, prompts, variants: list[str], args) -> None:
    """CPU time of each variant relative to atp: the fastest of ``args.timing_rounds``
    rounds, each round running every variant once in turn (so a change in machine load hits
    all of them alike)."""
    times: dict[str, list[float]] = {}
    heads = xr.DataArray(np.zeros((len(prompts), model.spec.n_layers, model.spec.n_heads)))
    blocks = xr.DataArray(
        np.zeros((len(prompts), model.spec.n_layers, 2)),
        dims=("prompt", "layer", "component"),
        coords={"component": ["attn", "mlp"]},
    )
    for _ in range(args.timing_rounds):
        done: dict[str, tuple[Maps, float]] = {}
        for variant in ["atp", *(v for v in variants if v != "atp")]:
            _, seconds = estimate(model, prompts, variant, heads, blocks, args.batch_size, done)
            times.setdefault(variant, []).append(seconds)
    best = {variant: min(values) for variant, values in times.items()}
    print(f"  timing: {len(prompts)} prompts, fastest of {args.timing_rounds} rounds")
    for variant, seconds in best.items():
        print(f"    {variant:24s} {seconds:6.1f} s {seconds / best['atp']:.2f}x")


if __name__ == "__main__":
    main()
