"""Weight-level maps: how important each weight matrix is, and how much it changed.

Each parameter tensor maps to a cell: per-layer tensors to (layer, component) with the
component vocabulary of ``lenscape.schema`` (GPT-2's fused ``c_attn`` is split into q/k/v
columns), model-level tensors to ``embed``, ``lm_head`` and ``final_norm``. Results are a
Dataset with two variables so the picture can show the model-level cells as a strip:

- ``per_layer`` (layer, component) over the architecture's per-layer tensors;
- ``model_level`` (component,) over ``embed``, ``lm_head``, ``final_norm``.

Both share one ``component`` axis (each is NaN on the other's components): draw them with
``ds["per_layer"].dropna("component", how="all")`` and likewise for ``model_level``.

With tied embeddings the shared matrix is reported once, under ``embed``; ``lm_head`` is NaN
and the attr ``tied_embeddings`` is True.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import _validate, schema
from ..data import Prompt, as_texts
from ..models import LensModel, in_one_call
from ..sweep import memory
from ..sweep.options import DEFAULTS

IMPORTANCE_KINDS = ("grad_x_weight", "fisher")
#: How a tensor's per-entry scores become one cell: their sum (the tensor's total
#: contribution), that sum as a share of the whole model's, or their mean (per entry).
AGGREGATIONS = ("sum", "share", "mean")
CHANGE_KINDS = ("relative", "fraction_changed")
#: What made the maps ``weight_grid`` draws (their ``method`` attr).
MAP_METHODS = ("weight_importance", "weight_change")


def _model(obj) -> LensModel:
    if not isinstance(obj, LensModel):
        raise ValueError(
            f"Expected a LensModel from lsc.load or lsc.from_hf, got {type(obj).__name__}."
        )
    return obj


def _tensors(
    model: LensModel,
) -> Iterator[tuple[int | None, str, torch.nn.Parameter, slice | None]]:
    """(layer or None, component, parameter, column slice for fused q/k/v or None)."""
    spec, layout = model.spec, model.spec.layout
    for layer in range(spec.n_layers):
        for component, path in layout.weights.items():
            param = model.hf.get_parameter(f"{layout.layers}.{layer}.{path}")
            cols = None
            if layout.qkv_split and component in ("q_proj", "k_proj", "v_proj"):
                width = param.shape[1] // 3
                i = ("q_proj", "k_proj", "v_proj").index(component)
                cols = slice(i * width, (i + 1) * width)
            yield layer, component, param, cols
    yield None, "embed", model.hf.get_submodule(layout.embed).weight, None
    if not spec.tied_embeddings:
        yield None, "lm_head", model.hf.get_submodule(layout.unembed).weight, None
    yield None, "final_norm", model.hf.get_submodule(layout.final_norm).weight, None


def _view(tensor: torch.Tensor, cols: slice | None) -> torch.Tensor:
    return tensor if cols is None else tensor[:, cols]


def _to_dataset(
    model: LensModel, values: dict[tuple[int | None, str], float], method: str, **params: Any
) -> xr.Dataset:
    """Per-tensor ``values`` as ``per_layer`` (layer, component) and ``model_level``
    (component,), with provenance attrs and ``params``."""
    spec = model.spec
    # One component axis for both variables (per-layer tensors, then model-level ones), so
    # the Dataset never re-aligns them; each variable is NaN on the other's components.
    components = [c for c in schema.WEIGHT_COMPONENTS if c in spec.layout.weights]
    components += list(schema.MODEL_COMPONENTS)
    per_layer = np.full((spec.n_layers, len(components)), np.nan)
    model_level = np.full(len(components), np.nan)
    for (layer, component), value in values.items():
        if layer is None:
            model_level[components.index(component)] = value
        else:
            per_layer[layer, components.index(component)] = value
    attrs = model.provenance(method, tied_embeddings=spec.tied_embeddings, **params)
    coords = {"component": components}
    return xr.Dataset(
        {
            "per_layer": schema.make(
                per_layer,
                dims=("layer", "component"),
                coords=coords,
                attrs=attrs,
                n_layers=spec.n_layers,
            ),
            "model_level": schema.make(
                model_level, dims=("component",), coords=coords, attrs=attrs
            ),
        },
        attrs=attrs,
    )


def min_max(ds: xr.Dataset) -> xr.Dataset:
    """Scale both variables of a weight map jointly into [0, 1] (per model)."""
    lo = min(float(ds[v].min()) for v in ds.data_vars)
    hi = max(float(ds[v].max()) for v in ds.data_vars)
    out = (ds - lo) / (hi - lo if hi > lo else 1.0)
    for name in ds.data_vars:
        out[name].attrs = {
            **ds[name].attrs,
            "normalization": "min-max per model",
            "units": "relative (0-1)",
        }
    out.attrs = {**ds.attrs, "normalization": "min-max per model"}
    return out


def _importance_plan(model: LensModel, texts: list[str], batch_size: int) -> memory.Estimate:
    """The memory plan of ``weight_importance``: a pass that keeps its graph for the
    weights' gradients (each linear layer's input too) with float32 next-token
    log-probabilities at every position, and the largest parameter's gradient (both uses of
    a tied matrix added up) with its float32 scoring temporaries: one parameter's gradient
    is held at a time."""
    spec = model.spec
    e = memory.element_bytes(model.dtype)
    width = max(len(model.tokenizer(text)["input_ids"]) for text in texts)
    largest = max(param.numel() for _, _, param, _ in _tensors(model))
    per_layer = 3 * spec.d_model + memory.d_ff(model)  # the linear layers' saved inputs

    def need(rows: int) -> memory.Need:
        tokens = rows * width
        return memory.Need(
            activations=memory.gradient_pass(model, rows, width)
            + tokens * spec.n_layers * per_layer * e
            + memory.loss_logits(model, tokens),
            buffers=largest * (e + 2 * 4 + (2 * 4 if e < 4 else 0)),
        )

    plan = memory.plan(
        model,
        "weight_importance",
        need,
        n_prompts=len(texts),
        width=width,
        batch_size=batch_size,
        max_rows=len(texts),  # a batch of texts holds each once
    )
    # the texts go through batch_size at a time: their number does not change the memory
    ways = (f"shorter texts (the longest has {width} tokens)",)
    return dataclasses.replace(plan, ways=ways)


@memory.estimator("weight_importance")
def _importance_estimate(
    model: LensModel, prompts: Iterable[Prompt | str], options: dict[str, Any]
) -> memory.Estimate:
    """``lsc.estimate`` of ``weight_importance(model, prompts, **options)``.

    Raises:
        TypeError: an option ``weight_importance`` does not take; as its checks.
    """
    given = inspect.signature(weight_importance).bind(_model(model), prompts, **options)
    given.apply_defaults()
    batch_size = _validate.positive_int("batch_size", given.arguments["batch_size"])
    return _importance_plan(model, _texts(model, prompts), batch_size)


def _texts(model: LensModel, prompts: Iterable[Prompt | str]) -> list[str]:
    """Each prompt's text + target, checked to be there and to fit the context.

    Raises:
        ValueError: no prompts, or a text longer than the model's context.
    """
    texts = as_texts(prompts, with_target=True)
    if not texts:
        raise ValueError("The prompt list is empty; pass at least one prompt.")
    model.check_context([len(model.tokenizer(t)["input_ids"]) for t in texts], what="text + target")
    return texts


# long: the gradient loop restores requires_grad in a finally; per-aggregation labels
@in_one_call
def weight_importance(
    model: LensModel,
    prompts: Iterable[Prompt | str],
    *,
    kind: str = "grad_x_weight",
    aggregation: str = "sum",
    batch_size: int = 8,
    normalize: bool = False,
    progress: bool = DEFAULTS.progress,
) -> xr.Dataset:
    """Per-tensor importance from gradients of the language-model loss.

    The loss is the mean next-token NLL over each prompt's text + target (every token). Per
    entry, "grad_x_weight" scores |w * dL/dw| and "fisher" scores (dL/dw)^2, averaged over
    batches. ``aggregation`` turns a tensor's entries into one cell: "sum" compares tensors
    by their total contribution (what the F2 reference shows: big MLP matrices high, norms
    near 0), "share" divides that by the model's total over all tensors, and "mean" is the
    per-entry average, which favours small tensors (norm weights rank highest).

    Args:
        prompts: a ``PromptSet``, Prompts or plain strings.
        kind: per-entry score, one of ``IMPORTANCE_KINDS``.
        aggregation: one of ``AGGREGATIONS``.
        normalize: min-max scale the whole map into [0, 1].

    Returns:
        Dataset with ``per_layer`` (layer, component) and ``model_level`` (component,).

    Raises:
        ValueError: an unknown kind or aggregation, no prompts, a text beyond the context.
        MemoryError: the run needs more memory than is available (``lsc.estimate``), before
            anything is allocated; the message says what to change.
    """
    model = _model(model)
    _validate.choice("importance kind", kind, IMPORTANCE_KINDS)
    _validate.choice("aggregation", aggregation, AGGREGATIONS)
    batch_size = _validate.positive_int("batch_size", batch_size)
    normalize = _validate.flag("normalize", normalize)
    progress = _validate.flag("progress", progress)
    texts = _texts(model, prompts)
    memory.check(_importance_plan(model, texts, batch_size))
    tensors = list(_tensors(model))
    totals = {(layer, comp): 0.0 for layer, comp, _, _ in tensors}
    cells: dict[torch.nn.Parameter, list[tuple[tuple[int | None, str], slice | None]]] = {}
    for layer, comp, param, cols in tensors:
        cells.setdefault(param, []).append(((layer, comp), cols))
    seen: set[torch.nn.Parameter] = set()

    def add_entries(param: torch.nn.Parameter) -> None:
        # Runs as soon as the parameter's gradient is complete, then frees it: the
        # backward never holds more than one parameter's gradient (not a second model).
        assert param.grad is not None
        for key, cols in cells[param]:
            grad = _view(param.grad, cols).float()
            weight = _view(param, cols).detach().float()
            entries = (weight * grad).abs() if kind == "grad_x_weight" else grad.pow(2)
            totals[key] += float(entries.mean() if aggregation == "mean" else entries.sum())
        param.grad = None
        seen.add(param)

    tok = model.tokenizer
    n_batches = 0
    handles = []
    try:
        for param in cells:
            param.requires_grad_(True)
            handles.append(param.register_post_accumulate_grad_hook(add_entries))
        for start in tqdm(
            range(0, len(texts), batch_size), disable=not progress, desc="weight importance"
        ):
            batch = tok(texts[start : start + batch_size], return_tensors="pt", padding=True).to(
                model.device
            )
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            seen.clear()
            model.hf(**batch, labels=labels).loss.backward()
            missed = [cells[param][0][0][1] for param in cells if param not in seen]
            assert not missed, f"no gradient reached {missed}"
            n_batches += 1
    finally:
        for handle in handles:
            handle.remove()
        model.hf.zero_grad(set_to_none=True)
        model.hf.requires_grad_(False)
    values = {key: value / n_batches for key, value in totals.items()}
    if aggregation == "share":
        whole = sum(values.values())
        values = {key: value / whole for key, value in values.items()}
    score = "|w dL/dw|" if kind == "grad_x_weight" else "(dL/dw)^2"
    long_name, units = {
        "sum": (f"Importance, sum of {score}", "loss units"),
        "share": (f"Importance, share of the model's total {score}", "share"),
        "mean": (f"Importance, mean {score} per entry", "loss units"),
    }[aggregation]
    ds = _to_dataset(
        model,
        values,
        "weight_importance",
        long_name=long_name,
        units=units,
        metric="loss",
        kind=kind,
        aggregation=aggregation,
        n_prompts=len(texts),
        batch_size=batch_size,
    )
    return min_max(ds) if normalize else ds


def weight_grid(maps: dict[str, xr.Dataset]) -> xr.DataArray:
    """The F2 picture: several models' weight maps in one (model, layer, component) grid.

    Columns are the per-layer tensors of any model, then ``lm_head`` as one model-level
    cell at each model's last layer (with tied embeddings, the shared embedding matrix,
    which is the unembedding too). Each model is min-max scaled over its drawn cells, so the
    cells span one shared [0, 1] scale. Cells a model does not have (a component of another
    architecture, layers past its depth, the rows of the ``lm_head`` column other than the
    last) carry a NaN ``drawn`` coord, which ``lenscape.heatmap`` leaves out instead of
    drawing them as missing data.

    Args:
        maps: model name -> ``weight_importance`` or ``weight_change`` result (unscaled),
            read by label (layers and components in any order, any transpose).

    Returns:
        DataArray (model, layer, component) in [0, 1] with coords ``depth`` (model, layer)
        and ``drawn`` (model, layer, component): 1.0 where a cell is drawn, else NaN.

    Raises:
        TypeError: ``maps`` not a dict of Datasets.
        ValueError: no maps, a map of another method, without ``per_layer`` and
            ``model_level``, or whose layers are not 0 .. n - 1 each once.
    """
    maps = _read_maps(maps)
    layer_components = [
        c
        for c in schema.WEIGHT_COMPONENTS
        if any(
            c in ds["per_layer"].dropna("component", how="all")["component"] for ds in maps.values()
        )
    ]
    components = [*layer_components, "lm_head"]
    n_layers = max(ds.sizes["layer"] for ds in maps.values())
    values = np.full((len(maps), n_layers, len(components)), np.nan)
    drawn = np.full_like(values, np.nan)
    depth = np.full((len(maps), n_layers), np.nan)
    for m, ds in enumerate(maps.values()):
        per_layer = ds["per_layer"]
        own = [
            c
            for c in layer_components
            if c in per_layer["component"].values
            and bool(per_layer.sel(component=c).notnull().any())
        ]
        layers = per_layer.sizes["layer"]
        for c in own:
            values[m, :layers, components.index(c)] = per_layer.sel(component=c).values
        head = ds["model_level"].sel(component="lm_head")
        head = head if bool(head.notnull()) else ds["model_level"].sel(component="embed")
        values[m, layers - 1, -1] = float(head)
        drawn[m, :layers, [components.index(c) for c in own]] = 1.0
        drawn[m, layers - 1, -1] = 1.0
        values[m] = np.where(np.isnan(drawn[m]), np.nan, values[m])
        lo, hi = np.nanmin(values[m]), np.nanmax(values[m])
        values[m] = (values[m] - lo) / (hi - lo if hi > lo else 1.0)
        depth[m, :layers] = np.arange(layers) / max(layers - 1, 1)
    first = next(iter(maps.values()))["per_layer"]
    attrs = {
        **first.attrs,
        "model": ", ".join(maps),
        "normalization": "min-max per model",
        "units": "relative (0-1)",
        "long_name": first.attrs.get("long_name", "value") + " (min-max per model)",
    }
    return xr.DataArray(
        values,
        dims=("model", "layer", "component"),
        coords={
            "model": list(maps),
            "layer": np.arange(n_layers),
            "component": components,
            "depth": (("model", "layer"), depth),
            "drawn": (("model", "layer", "component"), drawn),
        },
        attrs=attrs,
    )


def _read_maps(maps: object) -> dict[str, xr.Dataset]:
    """The weight maps passed to ``weight_grid``, checked and read by label: each one's
    ``per_layer`` (layer, component) with its layers 0 .. n - 1 in order.

    Raises:
        TypeError: not a dict of Datasets. ValueError: see ``weight_grid``.
    """
    if not isinstance(maps, Mapping):
        raise TypeError(
            f"maps must be a dict {{model name: weight map}}, got {type(maps).__name__}; "
            "pass e.g. {'smollm2-135m': lsc.weight_importance(model, prompts)}."
        )
    if not maps:
        raise ValueError("No weight maps to draw; pass {model name: weight_importance(...)}.")
    made_by = "lsc.weight_importance or lsc.weight_change"
    read = {}
    for name, ds in maps.items():
        argument = f"maps[{name!r}]"
        _validate.result(
            argument,
            ds,
            kind=xr.Dataset,
            made_by=made_by,
            variables=("per_layer", "model_level"),
            dims=("component",),
            methods=MAP_METHODS,
        )
        layers = range(ds["per_layer"].sizes.get("layer", 0))
        by_label = _validate.labels(argument, ds, {"layer": layers}, made_by=made_by)
        read[name] = cast(xr.Dataset, by_label.transpose(..., "layer", "component"))
    return read


@torch.no_grad()
@in_one_call
def weight_change(
    base: LensModel, tuned: LensModel, *, kind: str = "relative", tol: float = 1e-3
) -> xr.Dataset:
    """Per-tensor change between two checkpoints of one architecture.

    "relative": ||W1 - W0||_F / ||W0||_F; "fraction_changed": share of entries with
    |w1 - w0| > tol * max(|w0|, |w1|). A tensor that is all zero in ``base`` has no
    relative change: 0 where it stayed zero, NaN where it changed, named in the attr
    ``undefined`` (its fraction_changed is defined).

    Raises:
        ValueError: unknown kind, tol <= 0, different architectures or shapes (naming the
            first mismatching tensor).
    """
    base, tuned = _model(base), _model(tuned)
    _validate.choice("change kind", kind, CHANGE_KINDS)
    tol = _validate.number("tol", tol, above=0)
    if base.spec.architecture != tuned.spec.architecture:
        raise ValueError(
            f"The models differ in architecture ({base.spec.architecture} vs "
            f"{tuned.spec.architecture}); compare checkpoints of one model."
        )
    values, undefined = {}, []
    for (layer, comp, p0, cols), (_, _, p1, _) in zip(_tensors(base), _tensors(tuned), strict=True):
        w0, w1 = _view(p0, cols).float(), _view(p1, cols).float().to(p0.device)
        where = comp if layer is None else f"layer {layer} {comp}"
        if w0.shape != w1.shape:
            raise ValueError(
                f"Tensor shapes differ at {where}: {tuple(w0.shape)} vs "
                f"{tuple(w1.shape)}; compare checkpoints of one model."
            )
        diff = (w1 - w0).abs()
        if kind == "relative":
            base_norm, change = float(w0.norm()), float(diff.norm())
            if base_norm > 0:
                values[layer, comp] = change / base_norm
            elif change > 0:  # changed from all zero: no relative change exists
                values[layer, comp] = float("nan")
                undefined.append(where)
            else:
                values[layer, comp] = 0.0
        else:
            values[layer, comp] = float(
                (diff > tol * torch.maximum(w0.abs(), w1.abs())).float().mean()
            )
    long_name = (
        "Relative change ||W1 - W0|| / ||W0||"
        if kind == "relative"
        else f"Fraction of entries changed (tol {tol})"
    )
    return _to_dataset(
        base,
        values,
        "weight_change",
        long_name=long_name,
        units="ratio" if kind == "relative" else "fraction",
        metric=kind,
        kind=kind,
        tol=tol,
        tuned_model=tuned.name,
        **(
            {
                "undefined": f"{', '.join(undefined)}: all zero in the base model and "
                "changed, so no relative change exists (NaN); kind='fraction_changed' "
                "measures them"
            }
            if undefined
            else {}
        ),
    )
