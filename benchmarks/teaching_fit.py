"""Notebook 03's live fit: candidate teaching settings, measured and compared.

For each ``--setting`` on the math task of the bundled model: the wall time of
``lsc.head_gating`` (with ``--val`` held-out items, as the notebook), the agreement of its
roles (threshold 0.5) with the recorded reference fit's, per seed (every (live, recorded)
pair) and as Always maps (the role in every one of the k live seeds against that in k
recorded seeds, every k of them), and the role-set causal check on the held-out items
(``lsc.gating_check``, ``--random`` sets): defined or not, passing or not. The scale the
issue asks for: how well the recorded seeds agree among themselves (seed with seed; k seeds'
Always with k other seeds' Always), and chance (each recorded seed's roles shuffled over its
heads).

A setting is ``seeds:items:batch:most updates per stage`` and optional tags: ``bfloat16``
(the precision; float32 without it), ``lr0.3`` (the learning rate; the reference's 1.0
without it), ``half`` (``init="half"``: every gate starts at 0.5; the reference's uniform
start without it) and ``first`` (the first training and held-out items, as before
2026-11-26: all of them additions; without it ``PromptSet.sample``, every kind of sum in
proportion).

Each finished setting is appended to ``--progress`` (JSON lines, with the fitted scores;
``teaching_fit_data/progress.jsonl`` is committed) and skipped when the script runs again,
so an interrupted run resumes and the report is redrawn without refitting. Writes the
``teaching_fit`` section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import _report
import numpy as np
import torch
import xarray as xr

import lenscape as lsc
from lenscape import aggregate

MODEL, TASK = "smollm2-135m", "math"
ROLES = ("facilitation", "interference")
#: The notebook's default first, then the notebook's earlier default and the best candidates
#: of earlier rounds (RESULTS.md), which drew the first items, and the reference protocol's
#: batch of 32 at the same budget.
DEFAULT_SETTINGS = (
    "3:64:8:60:lr0.3:half",
    "3:64:8:60",
    "3:64:8:60:first",
    "3:64:8:100:bfloat16:first",
    "3:128:8:80:bfloat16:first",
    "3:64:32:20:first",
)
#: Finished settings, committed: running the script again only reports them.
PROGRESS = Path(__file__).resolve().parent / "teaching_fit_data" / "progress.jsonl"


def seed_roles(ds):
    """Per seed and head: the role at threshold 0.5 (``aggregate.roles`` codes)."""
    return aggregate.roles(ds["facilitation"] >= 0.5, ds["interference"] >= 0.5)


def share(agreement) -> str:
    return (
        f"{float(agreement):.0%} ({agreement.attrs['lowest']:.0%}-{agreement.attrs['highest']:.0%})"
    )


def parse_setting(text: str) -> dict:
    """A setting's ``head_gating`` options, with ``n_train`` and ``first`` (see above)."""
    numbers, tags = text.split(":")[:4], text.split(":")[4:]
    seeds, train, batch, steps = (int(p) for p in numbers)
    options = dict(seeds=seeds, n_train=train, batch_size=batch, max_steps=steps, first=False)
    for tag in tags:
        if tag == "bfloat16":
            options["precision"] = tag
        elif tag.startswith("lr"):
            options["lr"] = float(tag[2:])
        elif tag == "half":
            options["init"] = tag
        elif tag == "first":
            options["first"] = True
        else:
            raise ValueError(f"unknown tag {tag!r} in setting {text!r}")
    return options


def measure(model, setting: str, recorded, *, n_val: int, n_random: int) -> dict:
    """Fit one setting and check it; returns a JSON-able row."""
    options = parse_setting(setting)
    n_train = options.pop("n_train")
    train, held_out = lsc.data.task(TASK), lsc.data.task(TASK, split="validation")
    if options.pop("first"):
        train, held_out = train[:n_train], held_out[:n_val]
    else:
        train, held_out = train.sample(n_train), held_out.sample(n_val)
    start = time.perf_counter()
    fit = lsc.head_gating(model, train, validation=held_out, progress=False, **options)
    took = time.perf_counter() - start
    check = lsc.gating_check(model, fit, held_out, n_random=n_random, progress=False)
    verdicts = {}
    for role in check["role"].values:
        row = check.sel(role=role)
        reason = str(row["reason"].values)
        size = int(row["set_size"])
        verdicts[str(role)] = (
            f"undefined ({reason})"
            if reason
            else f"{'pass' if bool(row['passes']) else 'FAIL'} ({size} heads)"
        )
    return {
        "setting": setting,
        "fit_s": took,
        "updates": max(int(fit[f"steps_{s}"].max()) for s in ("stage0", "plus", "minus")),
        "converged": bool(fit.attrs["converged"]),
        "check": verdicts,
        # the fitted scores (seed, layer, head) with their labels: agreements without refitting
        "layer": fit["layer"].values.tolist(),
        "head": fit["head"].values.tolist(),
        **{role: fit[role].transpose("seed", "layer", "head").values.tolist() for role in ROLES},
    }


def as_fit(row: dict):
    """A stored row's scores as a labelled Dataset (seed, layer, head). Rows written before
    the labels were stored hold ``head_gating``'s own labels: layers and heads from 0."""
    scores = {role: np.array(row[role]) for role in ROLES}
    n_seeds, n_layers, n_heads = scores[ROLES[0]].shape
    coords = {
        "seed": np.arange(n_seeds),
        "layer": row.get("layer", list(range(n_layers))),
        "head": row.get("head", list(range(n_heads))),
    }
    return xr.Dataset({r: (("seed", "layer", "head"), v) for r, v in scores.items()}, coords=coords)


def shared(a, b) -> float:
    """The share of heads two role maps give the same role, matched by layer and head label."""
    if dict(a.sizes) != dict(b.sizes):
        raise ValueError(f"role maps of different shapes: {dict(a.sizes)} and {dict(b.sizes)}")
    b = b.sel({dim: a[dim].values for dim in a.dims}).transpose(*a.dims)
    return float((a.values == b.values).mean())


def always_roles(ds):
    """Per head: the role that holds in every seed of ``ds`` (threshold 0.5)."""
    return aggregate.roles(
        aggregate.always(ds["facilitation"]), aggregate.always(ds["interference"])
    )


def subset_agreement(live, recorded) -> tuple[float, float, float]:
    """Always over ``live``'s k seeds against Always over every k seeds of ``recorded``:
    the mean, least and most shared role (as the notebook's picture is an Always map)."""
    k, mine = live.sizes["seed"], always_roles(live)
    shares = [
        shared(always_roles(recorded.isel(seed=list(subset))), mine)
        for subset in itertools.combinations(range(recorded.sizes["seed"]), k)
    ]
    return float(np.mean(shares)), min(shares), max(shares)


def recorded_subsets_agreement(recorded, k: int) -> tuple[float, float, float]:
    """The scale for ``subset_agreement``: Always over k recorded seeds against Always over
    k other recorded seeds, every such disjoint pair."""
    seeds = range(recorded.sizes["seed"])
    shares = [
        shared(always_roles(recorded.isel(seed=list(a))), always_roles(recorded.isel(seed=list(b))))
        for a in itertools.combinations(seeds, k)
        for b in itertools.combinations([s for s in seeds if s not in a], k)
    ]
    return float(np.mean(shares)), min(shares), max(shares)


def span(values: tuple[float, float, float]) -> str:
    return f"{values[0]:.0%} ({values[1]:.0%}-{values[2]:.0%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--setting", action="append", default=None, help="seeds:items:batch:steps[:tags]"
    )
    parser.add_argument("--val", type=int, default=8, help="held-out items (the notebook's 8)")
    parser.add_argument("--random", type=int, default=200, help="random sets per role in the check")
    parser.add_argument("--progress", type=Path, default=PROGRESS)
    args = _report.parse_args(parser, setting=["1:4:2:2"], val=2, random=20)
    torch.set_num_threads(2)
    settings = args.setting or list(DEFAULT_SETTINGS)
    recorded = lsc.recorded("head_roles", model=MODEL, task=TASK)
    model = lsc.load(MODEL, device="cpu")
    args.progress.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if args.progress.exists() and not args.quick:
        for line in args.progress.read_text().splitlines():
            row = json.loads(line)
            done[row["setting"]] = row
    for setting in settings:
        if setting in done:
            print(f"{setting}: done before (in {args.progress})")
            continue
        row = measure(model, setting, recorded, n_val=args.val, n_random=args.random)
        print(json.dumps(row))
        done[setting] = row
        if not args.quick:
            with args.progress.open("a") as f:
                f.write(json.dumps(row) + "\n")
    roles = seed_roles(recorded)
    shuffled = np.random.default_rng(0).permuted(
        roles.values.reshape(roles.sizes["seed"], -1), axis=1
    )
    chance = aggregate.agreement(roles.copy(data=shuffled.reshape(roles.shape)), roles)
    rows, scales = [], {}
    for setting in settings:
        row, live = done[setting], as_fit(done[setting])
        k = live.sizes["seed"]
        if 2 * k <= recorded.sizes["seed"] and k not in scales:
            scales[k] = span(recorded_subsets_agreement(recorded, k))
        rows.append(
            [
                *_report.stamp(),
                f"`{setting}`",
                f"{row['fit_s']:.0f} s",
                f"{row['updates']}{'' if row['converged'] else ' (cap)'}",
                share(aggregate.agreement(seed_roles(live), roles)),
                span(subset_agreement(live, recorded)),
                row["check"].get("facilitating", "-"),
                row["check"].get("interfering", "-"),
            ]
        )
    scale_text = "; ".join(f"{k} seeds: {v}" for k, v in sorted(scales.items()))
    intro = f"""\
`python benchmarks/teaching_fit.py`: candidate settings for notebook 03's live fit on
{MODEL}, task {TASK}; a setting is `seeds:training items:batch:most updates per stage`
and tags that change the reference protocol: `bfloat16` (precision; float32 without it),
`lr0.3` (learning rate; 1.0 without it), `half` (every gate starts at 0.5; uniform in
(0, 1) per seed without it), `first` (the first training and held-out items, all of them
additions; without it a sample with every kind of sum in proportion,
`PromptSet.sample`); {args.val} held-out items, the causal check with {args.random}
random sets per role. Two agreements with the recorded reference fit
({recorded.sizes["seed"]} seeds), each a mean with the least and most agreeing pair:
*per seed*, the share of heads whose role (threshold 0.5) is the same in a live seed and a
recorded seed, over every pair; *Always*, the share of heads whose Always role (the role in
every seed, as the notebook's F4 map draws it) over the k live seeds is the same as over k
recorded seeds, over every k recorded seeds. For scale: recorded seeds among themselves,
per seed {share(aggregate.agreement(roles))}; Always over k recorded seeds against k other
recorded seeds, {scale_text}; chance (roles shuffled over the heads) {float(chance):.0%}."""
    body = _report.table(
        [
            "date",
            "machine",
            "setting",
            "fit time",
            "updates (max)",
            "per-seed agreement",
            "Always agreement",
            "facilitating check",
            "interfering check",
        ],
        rows,
    )
    _report.emit(args, _report.section("teaching_fit", "Notebook 03's teaching fit", intro, body))


if __name__ == "__main__":
    main()
