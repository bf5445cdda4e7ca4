"""The gallery docs/figures/: the reference figures and two teaching views, drawn from data.

``make figures`` (``python docs/figures.py``) draws each figure and writes it as a PNG into
docs/figures/, with ``sources.json`` saying, per figure, where its numbers come from and a
checksum of them (``store.content_sha256`` of the data drawn). Nothing is typed in:

- F1 and F4 come from the shipped reference-protocol recordings (``lsc.recorded``; F1's
  clusters named by the kind of text they hold, from the recording's own split,
  ``fits.recordings.f1_split``);
- F2, F3, the circuit (with each edge's stability), the error map and the agreement chart
  come from runs on the bundled models, cached
  under out/figures-cache/ (ignored by git): the first ``make figures`` computes them (about
  half an hour on a shared 2-core CPU, most of it F3's fine-tune), later ones redraw in a
  minute. ``--fresh`` recomputes them.

``tests/test_figures.py`` redraws the recorded figures and checks their checksums against
``sources.json``, so the gallery cannot drift from the recordings.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import altair as alt
import xarray as xr

import lenscape as lsc
from lenscape import aggregate, store
from lenscape.fits.recordings import f1_split

ROOT = Path(__file__).resolve().parents[1]
GALLERY = ROOT / "docs" / "figures"
CACHE = ROOT / "out" / "figures-cache"
SOURCES = "sources.json"
#: The F1 sparsity drawn (the recording's) and the F4 models and tasks.
SHOWN = 0.3
F1_MODELS = ("smollm2-135m", "gemma3-270m")
F4_MODEL, F4_TASKS = "smollm2-135m", ("math", "syntax")
F4_COLORS = ["#000000", "#1a9850", "#ffd700", "#d73027"]  # black -> green -> yellow -> red
#: Prompts of the cached runs (the notebooks' default settings).
N_PROMPTS, FINETUNE_STEPS, IG_STEPS, CIRCUIT_EDGES, RESAMPLES = 16, 200, 5, 60, 200
#: The factual prompt causal tracing draws: "The Eiffel Tower is located in the city of" (its
#: subject three tokens, as in ROME's figure).
TRACED = 24

Drawn = tuple[xr.DataArray | xr.Dataset, Any]


def _cached(path: Path, compute: Callable[[], Any]) -> Any:
    """The result saved at ``path``, computed and saved first when it is not there."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        lsc.save(compute(), path)
    return lsc.open(path)


def f1(cache: Path) -> Drawn:
    """F1: the recorded per-cluster block masks of both models, each on its own layer axis."""
    masks = {}
    for name in F1_MODELS:
        mask = lsc.recorded("block_masks", model=name)["routed_mask"].sel(target_sparsity=SHOWN)
        depth = lsc.schema.depth_coord(mask.sizes["layer"])
        masks[name] = mask.astype(float).assign_coords(depth=("layer", depth))
    grid = lsc.aggregate.combine_models(masks).sel(component=["mlp", "attn"])
    k = grid.sizes["cluster"]
    grid = grid.assign_coords(kind=f1_split(k)[2].names())
    chart = lsc.heatmap(
        grid,
        x="layer",
        y="cluster",
        facet_row="component",
        facet_col="model",
        independent=True,
        labels=("skipped", "kept"),
        tick_labels={"cluster": "kind"},
        title=f"F1 (recorded): learned block masks across {k} clusters (target sparsity {SHOWN})",
    )
    return grid, chart


def f4(cache: Path) -> Drawn:
    """F4: the recorded head facilitation by task, Always (min over seeds) vs Any (max)."""
    recorded = {task: lsc.recorded("head_roles", model=F4_MODEL, task=task) for task in F4_TASKS}
    panels = xr.concat(
        [
            xr.concat(
                [
                    aggregate.always_score(ds["facilitation"]),
                    aggregate.any_score(ds["facilitation"]),
                ],
                dim="aggregation",
            ).assign_coords(aggregation=["Always", "Any"])
            for ds in recorded.values()
        ],
        dim="task",
    ).assign_coords(task=[task.capitalize() for task in recorded])
    panels = panels.assign_attrs(long_name="Facilitation (G-)", units="score")
    seeds = " / ".join(f"{task} {ds.sizes['seed']}" for task, ds in recorded.items())
    chart = lsc.heatmap(
        panels,
        x="head",
        y="layer",
        facet_row="task",
        facet_col="aggregation",
        color=F4_COLORS,
        title=f"F4 (recorded): head facilitation by task, Always vs Any ({F4_MODEL}, "
        f"seeds {seeds})",
    )
    return panels, chart


def f2(cache: Path) -> Drawn:
    """F2: per-matrix weight importance (sum of |w dL/dw|, min-max per model), two models."""
    prompts = lsc.data.prompts("factual")[:N_PROMPTS]
    maps = {
        name: _cached(
            cache / f"importance_{name}.nc",
            lambda name=name: lsc.weight_importance(lsc.load(name), prompts, aggregation="sum"),
        )
        for name in F1_MODELS
    }
    grid = lsc.weight_grid(maps)
    chart = lsc.heatmap(
        grid,
        x="component",
        y="layer",
        facet_col="model",
        independent=True,
        color="viridis",
        title=f"F2: weight importance (sum of |w dL/dw| per matrix, min-max per model; "
        f"{N_PROMPTS} factual prompts)",
    )
    return grid, chart


def f3(cache: Path) -> Drawn:
    """F3: relative change per projection after a short fine-tune on the math task."""

    def change() -> xr.Dataset:
        base = lsc.load(F4_MODEL)
        return lsc.weight_change(
            base, lsc.finetune(base, lsc.data.task("math"), steps=FINETUNE_STEPS)
        )

    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"]
    rel = _cached(cache / "weight_change.nc", change)["per_layer"].sel(component=projections)
    chart = lsc.heatmap(
        rel,
        x="component",
        y="layer",
        center=float(rel.mean()),
        title=f"F3: relative change ||W_tuned - W_base|| / ||W_base|| ({F4_MODEL}, "
        f"{FINETUNE_STEPS} fine-tuning steps on the math task)",
    )
    return rel, chart


def circuit(cache: Path) -> Drawn:
    """A circuit of the indirect-object task (EAP-IG edge scores, SmolLM2), each edge's
    opacity its inclusion frequency over bootstrap resamples of the prompts."""
    prompts = lsc.data.prompts("ioi").sample(N_PROMPTS, seed=0)
    per_prompt = lsc.edge_attribution(
        lsc.load(F4_MODEL),
        prompts,
        estimator="eap-ig",
        steps=IG_STEPS,
        per_prompt=True,
        store=cache / "ioi_eap_ig_per_prompt.zarr",
        progress=False,
    )
    scores = per_prompt.mean("prompt", keep_attrs=True)
    picked = lsc.circuit(scores, edges=CIRCUIT_EDGES)
    stability = lsc.circuit_stability(per_prompt, edges=CIRCUIT_EDGES, n_resamples=RESAMPLES)
    drawn = xr.Dataset({"circuit": picked, "stability": stability})
    return drawn, lsc.circuit_graph(scores, picked, stability=stability)


def error_map(cache: Path) -> Drawn:
    """A fast map with its per-cell error estimate: attribution patching of every head,
    mean over prompts, the heads whose error estimate reaches their score hatched."""
    prompts = lsc.data.prompts("factual").sample(N_PROMPTS, seed=0)
    estimate = _cached(
        cache / "factual_atp_error.nc",
        lambda: lsc.attribution_patching(
            lsc.load(F4_MODEL), prompts, level="head", error=True, progress=False
        ),
    )
    pooled = aggregate.mean(estimate).sel(bound="mean")
    chart = lsc.heatmap(
        pooled,
        x="head",
        y="layer",
        title=f"Attribution patching and its error estimate ({F4_MODEL}, mean over "
        f"{N_PROMPTS} factual prompts)",
    )
    return pooled, chart


def agreement(cache: Path) -> Drawn:
    """Can I trust the fast map? Attribution patching and IG against exact patching."""
    report = lsc.faithfulness(
        lsc.load(F4_MODEL),
        lsc.data.prompts("factual"),
        estimators=("atp", "ig"),
        store=cache / "factual_faithfulness",
        progress=False,
    )
    return report, lsc.agreement_chart(report)


def ioi_by_span(cache: Path) -> Drawn:
    """Where in the prompt the indirect-object heads act: exact patching of every head at
    each named span (IO, S1, S2, END, other), mean over two pairs of each of the five IOI
    templates (their lengths differ; spans line them up)."""
    prompts = lsc.data.prompts("ioi").sample(10, seed=0)
    per_prompt = lsc.activation_patching(
        lsc.load(F4_MODEL),
        prompts,
        level="head",
        positions="spans",
        store=cache / "ioi_heads_by_span.zarr",
        progress=False,
    )
    pooled = per_prompt.mean("prompt", keep_attrs=True)
    chart = lsc.heatmap(
        pooled,
        x="head",
        y="layer",
        facet_col="span",
        scale="auto",
        title=f"Exact patching of each head at each span ({F4_MODEL}, mean over "
        f"{len(prompts)} IOI pairs, 2 of each of 5 templates)",
    )
    return pooled, chart


def causal_trace(cache: Path) -> Drawn:
    """ROME's causal tracing of factual recall: the indirect effect of restoring the
    residual stream, a 10-layer window of MLP outputs or of attention outputs at one
    (layer, token), on one factual prompt the model answers right."""
    model = lsc.load(F4_MODEL)
    prompt = lsc.data.prompts("factual")[TRACED]
    traces = {
        kind: _cached(
            cache / f"causal_trace_{kind}.nc",
            lambda kind=kind: lsc.causal_trace(model, [prompt], kind=kind, progress=False),
        ).isel(prompt=0)
        for kind in ("resid", "mlp", "attn")
    }
    names = {
        "resid": "residual stream",
        "mlp": "MLP, 10-layer window",
        "attn": "attention, 10-layer window",
    }
    largest = max(float(abs(trace).max()) for trace in traces.values())
    panels = [  # one colour domain: a colour means the same effect in every panel
        lsc.heatmap(trace, x="pos", y="layer", domain=(-largest, largest), title=f"{names[kind]}")
        for kind, trace in traces.items()
    ]
    config = panels[0].config  # one config for the row: Vega-Lite keeps it at the top
    for panel in panels:  # a concatenated panel holds neither config nor usermeta
        panel.config = panel.usermeta = alt.Undefined
    chart = alt.hconcat(*panels, config=config).properties(
        title=f"Causal tracing of {prompt.text!r} -> {prompt.target!r} ({F4_MODEL}; subject "
        "noised, one cell restored; indirect effect on p(answer))"
    )
    drawn = xr.Dataset({kind: trace.drop_vars("role") for kind, trace in traces.items()})
    return drawn, chart


#: Figure name -> (how it is drawn, where its numbers come from).
FIGURES: dict[str, tuple[Callable[[Path], Drawn], str]] = {
    "f1_block_masks": (f1, 'lsc.recorded("block_masks", model=...) for smollm2-135m, gemma3-270m'),
    "f4_head_roles": (f4, 'lsc.recorded("head_roles", model="smollm2-135m", task=...)'),
    "f2_weight_importance": (f2, "lsc.weight_importance on 16 factual prompts (cached run)"),
    "f3_weight_change": (f3, "lsc.weight_change after lsc.finetune, 200 steps (cached run)"),
    "circuit": (
        circuit,
        "lsc.edge_attribution (EAP-IG, 5 steps) on 16 IOI prompts (prompts('ioi').sample(16, "
        "seed=0), cached run); lsc.circuit_stability, 200 resamples (seed 0)",
    ),
    "error_map": (
        error_map,
        "lsc.attribution_patching(error=True) on 16 factual prompts (prompts('factual')"
        ".sample(16, seed=0), cached run); lsc.aggregate.mean",
    ),
    "agreement": (agreement, "lsc.faithfulness on the factual prompts (cached run)"),
    "ioi_by_span": (
        ioi_by_span,
        "lsc.activation_patching(level='head', positions='spans') on 10 IOI pairs "
        "(prompts('ioi').sample(10, seed=0): 2 of each template; cached run); mean over prompts",
    ),
    "causal_trace": (
        causal_trace,
        "lsc.causal_trace (kind resid, mlp, attn; ROME's protocol: noise 3, 10 samples, "
        "seed 0) on one factual prompt (cached run)",
    ),
}


def data_sha256(data: xr.DataArray | xr.Dataset) -> str:
    """The checksum of the numbers a figure draws (``store.content_sha256``)."""
    dataset = data.to_dataset(name="figure_data") if isinstance(data, xr.DataArray) else data
    return store.content_sha256(dataset)


def draw(name: str, out: Path, cache: Path) -> dict[str, str]:
    """Draw figure ``name`` into ``out``; returns its ``sources.json`` entry."""
    make, source = FIGURES[name]
    data, chart = make(cache)
    path = lsc.export(chart, out / f"{name}.png")
    return {"file": path.name, "source": source, "data_sha256": data_sha256(data)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GALLERY, help="folder to write into")
    parser.add_argument("--cache", type=Path, default=CACHE, help="folder of the cached runs")
    parser.add_argument("--only", nargs="+", choices=list(FIGURES), help="draw only these")
    parser.add_argument("--fresh", action="store_true", help="recompute the cached runs")
    args = parser.parse_args(argv)
    if args.fresh:
        shutil.rmtree(args.cache, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    listing = args.out / SOURCES
    sources = json.loads(listing.read_text()) if listing.exists() else {}
    for name in args.only or FIGURES:
        sources[name] = draw(name, args.out, args.cache)
        print(f"{args.out / sources[name]['file']}  <- {sources[name]['source']}")
    ordered = {name: sources[name] for name in FIGURES if name in sources}
    listing.write_text(json.dumps(ordered, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
