"""Per-cluster block masks: which attention and MLP blocks can each kind of input skip?

Follows IG-Pruning (arXiv 2511.02213, github.com/ictnlp/IG-Pruning): texts are embedded with
a sentence encoder and k-means clustered (``lenscape.cluster``); every cluster gets one
hard-concrete gate per block (2 x n_layers: attention and MLP; Louizos et al. 2018). A gate
scales the block's contribution to the residual stream, so a gate of 0 skips the block and
the residual passes through. With the model frozen, gate parameters are fitted to

    loss = L(text) + penalty * (expected share of open gates - keep)^2

where keep = 1 - target_sparsity and L is the next-token NLL or, with ``loss="kl"``, the KL
divergence from the unmasked model's next-token distribution (distillation). Every cluster
and every target sparsity trains in one stacked batch (each row uses its own set's gates),
until the keep probabilities stop moving. The final mask keeps the
round((1 - target_sparsity) x 2L) blocks with the largest gate logits, so every mask meets
its target exactly.

At inference, ``apply_mask(model, masks, clusters=...)`` embeds each new input, routes it to
its nearest centroid and runs it with that cluster's mask. ``mask_comparison`` tests
IG-Pruning's claim on held-out texts: routed per-cluster masks vs one global mask learned on
all texts vs random masks, at equal sparsity.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import _validate, schema
from ..cluster import Clustering
from ..data import PromptSet, as_texts
from ..models import LensModel, in_one_call
from ..sweep import memory
from ..sweep.backend import BeforeFn, Site, standing_edit
from ..sweep.inputs import pad
from ..sweep.options import DEFAULTS
from . import optim
from .optim import MAX_FIT_BATCH, MAX_FIT_STEPS, Fit, Precision, Resume

BETA, GAMMA, ZETA = 2 / 3, -0.1, 1.1  # hard-concrete temperature and stretch
COMPONENTS = schema.BLOCK_COMPONENTS  # ("attn", "mlp")
LOSSES = ("nll", "kl")
STRATEGIES = ("routed", "global", "random")
BINARY_FIX = "pass the binary masks (result['mask']), not the probabilities (result['keep_prob'])"
#: What made the masks ``apply_mask`` and ``masked_loss`` take back (their ``method`` attr).
MASK_METHODS = ("block_masks", "block_mask_estimate", "mask_comparison")
MASKS_MADE_BY = "lsc.block_masks (e.g. result['mask'])"
#: Most target sparsities one fit or comparison takes: each is one more set per cluster in
#: every pass, and the reference compares 5; a mask keeps a whole number of the 2L blocks,
#: so more sparsities than that only repeat masks.
MAX_SPARSITIES = 20
#: Most random masks per sparsity in ``mask_comparison`` (``n_random``): each is one more
#: pass over the held-out texts, and their mean settles within a few (the default is 3).
MAX_RANDOM_MASKS = 100


@contextlib.contextmanager
def _scaled_blocks(
    model: LensModel, row_scale: Callable[[], torch.Tensor], before: BeforeFn | None = None
) -> Iterator[None]:
    """Scale each block's output per row: ``row_scale()`` -> (rows, layer, component); a
    standing edit of the ``attn`` and ``mlp`` sites while the block is active (``before``:
    see ``standing_edit``)."""

    def scale(site: Site, output: torch.Tensor) -> torch.Tensor:
        kind, layer = site
        return (
            output * row_scale()[:, layer, COMPONENTS.index(kind)].to(output.dtype)[:, None, None]
        )

    sites = [(kind, layer) for layer in range(model.spec.n_layers) for kind in COMPONENTS]
    with standing_edit(model, sites, scale, before=before):
        yield


def _read_masks(
    model: LensModel, masks: Any, *, sets: dict[str, Sequence[Any]] | None = None
) -> xr.DataArray:
    """Binary masks passed back in, checked and read by label.

    Args:
        masks: a DataArray of ``block_masks`` (or of ``block_mask_estimate`` or
            ``mask_comparison``) with ``layer`` and ``component`` dims.
        sets: labels of other dims to read by as well, e.g. ``{"cluster": range(k)}``.

    Returns:
        The masks (..., [sets,] layer, component) in the model's order (layers from 0,
        components attn, mlp), whatever their order and transpose.

    Raises:
        TypeError: not a DataArray (a Dataset: the message says to pick ``['mask']``).
        ValueError: masks of another method or from another model, labels that are not
            the model's (named), probabilities or NaN where a binary mask is expected.
    """
    _validate.result(
        "masks",
        masks,
        kind=xr.DataArray,
        made_by=MASKS_MADE_BY,
        origin=model.origin,
        dims=("layer", "component"),
        methods=MASK_METHODS,
    )
    expected = {**(sets or {}), "layer": range(model.spec.n_layers), "component": COMPONENTS}
    read = _validate.labels("masks", masks, expected, made_by=MASKS_MADE_BY)
    _validate.values("masks", read, binary=True, fix=BINARY_FIX)
    return read


def _check_clusters(clusters) -> Clustering:
    if (
        not isinstance(clusters, Clustering)
        or clusters.centroids is None
        or len(clusters.centroids) == 0
    ):
        raise ValueError(
            f"clusters must be a Clustering with centroids (from "
            f"lenscape.cluster.kmeans), got {type(clusters).__name__}; routing "
            "needs the centroids to find each input's nearest cluster."
        )
    return clusters


def _row_texts(model: LensModel, input_ids: torch.Tensor, attention_mask) -> list[str]:
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    return [
        model.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        for ids, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)
    ]


@contextlib.contextmanager
def apply_mask(
    model: LensModel, masks: xr.DataArray | xr.Dataset, *, clusters: Clustering | None = None
) -> Iterator[LensModel]:
    """Run ``model`` with blocks skipped (residual passes) where the mask is 0/False.

    Args:
        masks: one (layer, component) binary mask, e.g. ``masks["mask"].sel(cluster=3)``;
            with ``clusters``, the per-cluster masks (cluster, layer, component) or the
            ``block_masks`` Dataset. Read by label (layers, components and clusters in any
            order, any transpose).
        clusters: route every input: each row of a forward pass that starts a text (more
            than one new token) is decoded, embedded with the clustering's encoder and run
            with its nearest cluster's mask; generation steps keep their row's mask.

    Raises:
        TypeError: not a DataArray or a ``block_masks`` Dataset.
        ValueError: a mask of another method or from another model, labels that are not
            the model's (or the clusters'), probabilities or NaN where a binary mask is
            expected, a per-cluster mask without ``clusters`` (or the reverse), clusters
            without centroids, or clusters whose encoder is the masked model itself.
    """
    _validate.result(
        "masks",
        masks,
        kind=(xr.DataArray, xr.Dataset),
        made_by="lsc.block_masks",
        variables=("mask",),
        dims=("layer", "component"),
        methods=MASK_METHODS,
    )
    mask = masks["mask"] if isinstance(masks, xr.Dataset) else masks
    encoder = getattr(clusters, "encoder", None)
    if getattr(encoder, "hf", None) is model.hf:
        raise ValueError(
            "clusters were embedded with the masked model itself (clusters.encoder is "
            "model), so routing an input would run the masked model again for every "
            "input, without end; cluster with encoder='minilm' or with another model."
        )
    if clusters is None:
        if set(mask.dims) != {"layer", "component"}:
            raise ValueError(
                f"The mask has dims {mask.dims}; apply_mask needs (layer, "
                "component). Pick one cluster, e.g. masks['mask'].sel(cluster=0), "
                "or route inputs with apply_mask(model, masks, clusters=clusters)."
            )
        values = _read_masks(model, mask).values
        scale = torch.as_tensor(values.astype(np.float32)).to(model.device)[None]
        with _scaled_blocks(model, lambda: scale):
            yield model
        return
    clusters = _check_clusters(clusters)
    if set(mask.dims) != {"cluster", "layer", "component"}:
        raise ValueError(
            f"Routing needs one mask per cluster ({clusters.k}); the mask has dims "
            f"{dict(mask.sizes)}. Pass the block_masks result learned with these "
            "clusters."
        )
    routed = _read_masks(model, mask, sets={"cluster": range(clusters.k)}).values
    per_cluster = torch.as_tensor(routed.astype(np.float32)).to(model.device)
    current: dict[str, torch.Tensor] = {}

    def route(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        if input_ids.shape[1] > 1 or "scale" not in current:
            texts = _row_texts(model, input_ids, attention_mask)
            current["clusters"] = torch.as_tensor(clusters.route(texts))
            current["scale"] = per_cluster[current["clusters"].to(model.device)]

    with _scaled_blocks(model, lambda: current["scale"], before=route):
        yield model


def _encode(model: LensModel, prompts: PromptSet) -> list[list[int]]:
    return [model.tokenizer(text)["input_ids"] for text in as_texts(prompts, with_target=True)]


def _row_loss(
    model: LensModel, rows: list[list[int]], current: dict, *, loss: str = "nll"
) -> torch.Tensor:
    """Mean next-token loss of each row (rows,) under ``current["scale"]`` (real tokens only).

    ``loss="nll"``: negative log-likelihood of the text; ``"kl"``: KL(unmasked || masked)
    of the next-token distributions (the unmasked pass runs without gradients).
    """
    tokens = pad(rows, model.tokenizer.pad_token_id, "right").to(model.device)
    ids, mask = tokens.input_ids, tokens.attention_mask
    logp = torch.log_softmax(
        model.hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1
    )
    if loss == "nll":
        per_token = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    else:
        scale = current["scale"]
        current["scale"] = torch.ones_like(scale)
        with torch.no_grad():
            teacher = torch.log_softmax(
                model.hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1
            )
        current["scale"] = scale
        per_token = (teacher.exp() * (teacher - logp)).sum(-1)
    weight = mask[:, 1:].float()
    return (per_token * weight).sum(1) / weight.sum(1)


def _open_prob(log_alpha: torch.Tensor) -> torch.Tensor:
    """Probability that a hard-concrete gate is non-zero."""
    return torch.sigmoid(log_alpha - BETA * np.log(-GAMMA / ZETA))


def _sample_gates(u: torch.Tensor, log_alpha: torch.Tensor) -> torch.Tensor:
    """Hard-concrete gates in [0, 1] from uniform noise ``u`` and gate logits, both
    (sets, layer, 2); on the CPU (the noise's device)."""
    s = torch.sigmoid((u.log() - (1 - u).log() + log_alpha.cpu()) / BETA)
    return (s * (ZETA - GAMMA) + GAMMA).clamp(0, 1)


# long: the stacked loss closure and the key a resumed fit is checked against
def _fit_masks(
    model: LensModel,
    items: list[list[int]],
    groups: list[np.ndarray],
    sparsities: Sequence[float],
    options: FitOptions,
    *,
    loss: str,
    seed: int,
    progress: bool,
    checkpoint: Path | None = None,
    time_budget: float | None = None,
):
    """Fit gate logits for every (sparsity, group) pair in one stacked run.

    Args:
        items: token ids per text; groups: per group, the indices of its texts.
        options: the fit's options (checked).
        checkpoint: a folder to keep the fit's state in (``optim.Resume``), or None.
        time_budget: seconds the updates may take (checked), or None.

    Returns:
        ``Fit`` whose params are (sparsity * group, layer, component) gate logits.
    """
    n_groups, batch_size = len(groups), options.batch_size
    keep = torch.tensor([1 - s for s in sparsities]).repeat_interleave(n_groups).to(model.device)
    rng = np.random.default_rng(seed)
    noise = torch.Generator().manual_seed(seed)
    current: dict[str, torch.Tensor] = {}
    per_pass = optim.sets_per_pass(options.rows_per_pass, batch_size)

    def loss_and_grad(log_alpha: torch.Tensor, active: list[int]) -> torch.Tensor:
        u = torch.rand(log_alpha.shape, generator=noise).clamp(1e-6, 1 - 1e-6)
        losses = []
        for first in range(0, len(active), per_pass):
            chunk = active[first : first + per_pass]
            rows = [items[i] for k in chunk for i in rng.choice(groups[k % n_groups], batch_size)]
            gates = _sample_gates(u[chunk], log_alpha[chunk]).to(model.device)
            current["scale"] = gates.repeat_interleave(batch_size, dim=0)
            text_loss = _row_loss(model, rows, current, loss=loss).view(len(chunk), -1).mean(1)
            sparsity_term = (_open_prob(log_alpha[chunk]).mean(dim=(1, 2)) - keep[chunk]) ** 2
            total = text_loss + options.penalty * sparsity_term
            total.sum().backward()
            losses.append(total.detach().cpu())
        return torch.cat(losses)

    start = torch.full((len(keep), model.spec.n_layers, 2), 2.0, device=model.device)
    key = optim.fit_key(
        model,
        (items, [g.tolist() for g in groups]),
        sparsities=list(sparsities),
        loss=loss,
        penalty=options.penalty,
        seed=seed,
        batch_size=options.batch_size,
        rows_per_pass=options.rows_per_pass,
        precision=options.precision,
    )
    bar = tqdm(
        total=options.max_steps,
        disable=not progress,
        desc=f"block masks ({n_groups} groups x {len(sparsities)} sparsities)",
    )
    passes = optim.fit_passes(model.hf, options.precision)
    deadline = None if time_budget is None else optim.clock() + time_budget
    with _scaled_blocks(model, lambda: current["scale"]), passes:
        fit = optim.fit_until_still(
            start,
            loss_and_grad,
            watch=_open_prob,
            lr=options.lr,
            grad_clip=None,
            max_steps=options.max_steps,
            window=options.window,
            tol=options.tol,
            on_step=bar.update,
            resume=None if checkpoint is None else _resume(checkpoint, key, rng, noise),
            deadline=deadline,
        )
    bar.close()
    return fit


def _budget_attrs(fit: Fit, options: FitOptions, time_budget: float | None) -> dict[str, Any]:
    """Why the mask fit stopped (``stopped``, ``optim.STOPS``) and, with a budget,
    ``time_budget`` and ``longer_run`` (what a longer run would add; "" if nothing), warning
    (``optim.TimeBudgetWarning``) when the budget stopped it."""
    if time_budget is None:
        return {"stopped": fit.stopped}
    note = optim.longer_run(fit, max_steps=options.max_steps, tol=options.tol, sets="mask sets")
    if note:
        warnings.warn(f"The block-mask fit {note}", optim.TimeBudgetWarning, stacklevel=3)
    return {"stopped": fit.stopped, "time_budget": time_budget, "longer_run": note}


def _resume(
    checkpoint: Path, key: dict[str, Any], rng: np.random.Generator, noise: torch.Generator
) -> Resume:
    """Where the mask fit keeps its state in ``checkpoint`` under ``key``, with the random
    state it draws from: the minibatch ``rng`` and the gate ``noise``."""

    def set_state(state: dict[str, Any]) -> None:
        rng.bit_generator.state = state["rng"]
        noise.set_state(state["noise"])

    return Resume(
        checkpoint / "block_masks.pt",
        key,
        lambda: {"rng": rng.bit_generator.state, "noise": noise.get_state()},
        set_state,
    )


def _binary_masks(log_alpha: torch.Tensor, keep: float) -> torch.Tensor:
    """(sets, layer, 2) logits -> bool masks keeping exactly round(keep * 2L) blocks each."""
    sets, n_layers, _ = log_alpha.shape
    n_keep = round(keep * 2 * n_layers)
    order = log_alpha.cpu().reshape(sets, -1).argsort(dim=1, descending=True)
    kept = torch.zeros(sets, 2 * n_layers, dtype=torch.bool)
    kept.scatter_(1, order[:, :n_keep], True)
    return kept.view(sets, n_layers, 2)


def _check_sparsities(
    target_sparsity: float | Sequence[float], name: str = "target_sparsity"
) -> list[float]:
    try:
        values = [float(s) for s in np.atleast_1d(np.asarray(target_sparsity, dtype=float))]
    except (TypeError, ValueError):  # not numbers
        values = []
    if not values or any(not 0 < s < 1 for s in values):  # NaN fails too
        raise ValueError(
            f"{name} must lie in (0, 1), got {target_sparsity}; "
            "e.g. 0.3 (skip 30% of blocks) or [0.1, 0.3, 0.5]."
        )
    if len(set(values)) < len(values) or len(values) > MAX_SPARSITIES:
        raise ValueError(
            f"{name} must hold at most MAX_SPARSITIES={MAX_SPARSITIES} different sparsities, "
            f"each once (every one is one more set per cluster in every pass), got "
            f"{len(values)}: {values[:4]}{' ...' if len(values) > 4 else ''}."
        )
    return values


@dataclass(frozen=True)
class FitOptions:
    """The mask fit's options, each with its default written once: ``block_masks``' signature
    names ``FIT_DEFAULTS`` and ``mask_comparison`` starts from it. Checked by ``_FIT_CHECKS``.

    Attributes:
        lr: Adam learning rate on the gate logits.
        penalty: weight of the sparsity term.
        max_steps: most Adam updates.
        window, tol: a set stops once its keep probabilities move less than ``tol`` (mean
            absolute change) over ``window`` updates.
        rows_per_pass: rows per forward pass.
        batch_size: texts per cluster per update.
        precision: ``"float32"`` or ``"bfloat16"`` (the passes under bfloat16 autocast).
    """

    lr: float = 0.25
    penalty: float = 10.0
    max_steps: int = 300
    window: int = 20
    tol: float = 0.005
    rows_per_pass: int = 32
    batch_size: int = 4
    precision: Precision = "float32"


FIT_DEFAULTS = FitOptions()

#: The mask fit's options and their checks (``_validate``), by name; ``mask_comparison``
#: calls ``batch_size`` ``train_batch_size`` (its own ``batch_size`` is the evaluation's).
_FIT_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "lr": lambda name, value: _validate.number(name, value, above=0),
    "penalty": lambda name, value: _validate.number(name, value, low=0),
    "tol": lambda name, value: _validate.number(name, value, low=0),
    "max_steps": lambda name, value: _validate.integer(name, value, low=1, high=MAX_FIT_STEPS),
    "window": _validate.positive_int,
    "batch_size": lambda name, value: _validate.integer(name, value, low=1, high=MAX_FIT_BATCH),
    "train_batch_size": lambda name, value: _validate.integer(
        name, value, low=1, high=MAX_FIT_BATCH
    ),
    "rows_per_pass": _validate.positive_int,
    "precision": lambda name, value: optim.check_precision(value),
}


def _fit_options(given: dict[str, Any], *, caller: str) -> FitOptions:
    """``FIT_DEFAULTS`` with the ``given`` options (any subset of ``_FIT_CHECKS``, by the
    names the ``caller`` takes) in their place, each checked once, up front.

    Raises:
        TypeError: an unknown option, or a value of the wrong type.
        ValueError: a value out of range (a zero count, a NaN rate ...).
    """
    unknown = sorted(set(given) - set(_FIT_CHECKS))
    if unknown:
        raise TypeError(
            f"{caller} got unknown fit option(s) {unknown}; the fit takes {sorted(_FIT_CHECKS)}."
        )
    for name, value in given.items():
        _FIT_CHECKS[name](name, value)
    return replace(
        FIT_DEFAULTS,
        **{("batch_size" if name == "train_batch_size" else name): v for name, v in given.items()},
    )


def _members(clusters: Clustering, n_prompts: int) -> list[np.ndarray]:
    """Per cluster, the indices of its prompts among ``n_prompts``: the clustering's labels
    read by their ``prompt`` labels (0 .. n - 1), not by position.

    Raises:
        ValueError: a clustering of another number of prompts, prompt labels that are not
            0 .. n - 1, or an empty cluster.
    """
    if clusters.labels.sizes.get("prompt") != n_prompts:
        raise ValueError(
            f"The clustering has {clusters.labels.sizes.get('prompt')} prompts but "
            f"{n_prompts} were given; pass the prompts that were clustered."
        )
    labels = _validate.labels(
        "clusters.labels",
        clusters.labels,
        {"prompt": range(n_prompts)},
        made_by="lenscape.cluster.kmeans",
    ).values
    members = [np.flatnonzero(labels == c) for c in range(clusters.k)]
    empty = [c for c, m in enumerate(members) if len(m) == 0]
    if empty:
        raise ValueError(f"Cluster(s) {empty} have no prompts; re-cluster with a smaller k.")
    return members


def _masks_plan(
    model: LensModel, items: list[list[int]], n_sets: int, options: FitOptions, *, loss: str
) -> memory.Estimate:
    """The memory plan of a mask fit: a pass stacks the rows of as many (cluster, sparsity)
    sets as ``rows_per_pass`` allows and keeps its graph (the scaled block outputs too) and
    the next-token log-probabilities of every position (float32, twice over with
    ``loss="kl"``: the unmasked model's too)."""
    spec = model.spec
    dtype = torch.bfloat16 if options.precision == "bfloat16" else None  # the fit's autocast
    e = memory.element_bytes(dtype or model.dtype)
    width = max(len(item) for item in items)
    teacher = 3 * 4 * spec.vocab_size if loss == "kl" else 0  # per position

    def need(rows: int) -> memory.Need:
        positions = rows * width
        logits = memory.loss_logits(model, positions, dtype=dtype) + positions * teacher
        return memory.Need(
            activations=memory.gradient_pass(model, rows, width, dtype=dtype) + logits,
            buffers=2 * spec.n_layers * rows * width * spec.d_model * e,
            optimizer=n_sets * spec.n_layers * 2 * 4 * 4,  # gate logits and Adam
        )

    plan = optim.fit_plan(
        model,
        "block_masks",
        need,
        n_prompts=len(items),
        width=width,
        n_sets=n_sets,
        batch_size=options.batch_size,
        rows_per_pass=options.rows_per_pass,
    )
    autocast = options.precision == "bfloat16"
    return memory.fit_ways(plan, batch_size=options.batch_size, autocast=autocast)


@memory.estimator("block_masks")
def _masks_estimate(
    model: LensModel, prompts: PromptSet, options: dict[str, Any]
) -> memory.Estimate:
    """``lsc.estimate`` of ``block_masks(model, prompts, **options)`` (``clusters=`` given).

    Raises:
        TypeError: an option ``block_masks`` does not take, or no ``clusters``; as
            ``block_masks``' checks.
    """
    given = inspect.signature(block_masks).bind(model, prompts, **options)
    given.apply_defaults()
    arguments = given.arguments
    fit = _fit_options(
        {name: arguments[name] for name in ("rows_per_pass", "batch_size", "precision")},
        caller="block_masks",
    )
    n_sets = _check_clusters(arguments["clusters"]).k * len(
        _check_sparsities(arguments["target_sparsity"])
    )
    return _masks_plan(model, _encode(model, prompts), n_sets, fit, loss=arguments["loss"])


# long: the fit's options, checked once and recorded in attrs
@in_one_call
def block_masks(
    model: LensModel,
    prompts: PromptSet,
    *,
    clusters: Clustering,
    target_sparsity: float | Sequence[float] = 0.3,
    loss: str = "nll",
    max_steps: int = FIT_DEFAULTS.max_steps,
    window: int = FIT_DEFAULTS.window,
    tol: float = FIT_DEFAULTS.tol,
    lr: float = FIT_DEFAULTS.lr,
    penalty: float = FIT_DEFAULTS.penalty,
    seed: int = 0,
    batch_size: int = FIT_DEFAULTS.batch_size,
    rows_per_pass: int = FIT_DEFAULTS.rows_per_pass,
    precision: Precision = FIT_DEFAULTS.precision,
    checkpoint: str | Path | None = None,
    time_budget: float | None = None,
    progress: bool = DEFAULTS.progress,
) -> xr.Dataset:
    """Learn one block mask per cluster (and per target sparsity), to convergence.

    Args:
        model: a ``LensModel`` (frozen).
        prompts: the texts that were clustered (same order as ``clusters.labels``); keep
            held-out texts out of both (``lenscape.cluster.split``).
        clusters: from ``lenscape.cluster.kmeans``.
        target_sparsity: share of the 2 x n_layers blocks to skip, in (0, 1); a list (of at
            most ``MAX_SPARSITIES``) trains every sparsity in the same stacked batch and adds
            a ``target_sparsity`` dim.
        loss: ``"nll"`` (next-token NLL) or ``"kl"`` (distil the unmasked model).
        max_steps: most Adam updates (at most ``optim.MAX_FIT_STEPS``); a (cluster,
            sparsity) set stops earlier once its keep probabilities move less than ``tol``
            (mean absolute change) over ``window`` updates.
        lr: Adam learning rate; penalty: weight of the sparsity term.
        seed: seeds gate noise and minibatches (same seed -> same masks).
        batch_size: texts per cluster per update (at most ``optim.MAX_FIT_BATCH``);
            rows_per_pass: rows per forward pass.
        precision: ``"float32"`` or ``"bfloat16"`` (the fit's passes under bfloat16
            autocast; gate logits, Adam and the final ranking stay float32).
        checkpoint: a folder where the fit keeps its state every ``window`` updates; a
            fit interrupted and started again with the same folder and arguments continues
            from its last check. None keeps nothing. Other files in the folder are ignored.
        time_budget: seconds the fit's updates may take (wall time), or None for no
            budget. When it is spent, the sets still moving stop, not converged (attrs
            ``stopped == "time budget"``; a ``TimeBudgetWarning`` and the ``longer_run``
            attr say what a longer run would add); the masks are the top blocks of the gate
            logits reached. A fit that ends within its budget is the same as without one.
            Not part of the checkpoint's key: with ``checkpoint``, a fit stopped by its
            budget continues from there when called again (with any budget).

    Returns:
        Dataset over ([target_sparsity,] cluster, layer, component): ``mask`` (bool, True =
        kept) and ``keep_prob`` (probability that the gate is open); ``steps`` over
        ([target_sparsity,] cluster); settings, ``converged`` and ``stopped`` (``"still"``,
        ``"max_steps"`` or ``"time budget"``) in attrs.

    Raises:
        TypeError, ValueError: an option of the wrong type or out of range.
        ValueError: a ``checkpoint`` folder holding the state of another fit (other model
            weights, texts, clusters or settings: each difference is named) or a damaged
            state file; the message names the file and says to use a new folder or delete
            it.
        MemoryError: the fit needs more memory than is available (``lsc.estimate``), before
            anything is allocated; the message says what to change.
    """
    sparsities = _check_sparsities(target_sparsity)
    if loss not in LOSSES:
        raise ValueError(f"Unknown loss {loss!r}; choose one of {list(LOSSES)}.")
    options = _fit_options(
        dict(
            lr=lr,
            penalty=penalty,
            max_steps=max_steps,
            window=window,
            tol=tol,
            rows_per_pass=rows_per_pass,
            batch_size=batch_size,
            precision=precision,
        ),
        caller="block_masks",
    )
    seed = _validate.seed("seed", seed)
    progress = _validate.flag("progress", progress)
    time_budget = optim.check_time_budget(time_budget)
    _validate.not_empty("prompts", prompts, fix="pass the texts that were clustered")
    folder = optim.checkpoint_folder(checkpoint)
    clusters = _check_clusters(clusters)
    members = _members(clusters, len(prompts))
    items = _encode(model, prompts)
    memory.check(_masks_plan(model, items, len(members) * len(sparsities), options, loss=loss))
    fit = _fit_masks(
        model,
        items,
        members,
        sparsities,
        options,
        loss=loss,
        seed=seed,
        progress=progress,
        checkpoint=folder,
        time_budget=time_budget,
    )
    k = clusters.k
    attrs = model.provenance(
        "block_masks",
        metric=loss,
        prompt_set=prompts.name,
        n_prompts=len(prompts),
        k=k,
        loss=loss,
        max_steps=max_steps,
        window=window,
        tol=tol,
        lr=lr,
        penalty=penalty,
        seed=seed,
        batch_size=batch_size,
        precision=precision,
        steps=int(fit.steps.max()),
        converged=int(fit.converged.all()),
        **_budget_attrs(fit, options, time_budget),
    )
    parts = [
        _learned_masks(
            model,
            fit.params[i * k : (i + 1) * k],
            fit.steps[i * k : (i + 1) * k],
            {**attrs, "target_sparsity": sparsity},
        )
        for i, sparsity in enumerate(sparsities)
    ]
    return _by_sparsity(parts, target_sparsity, sparsities)


def _learned_masks(
    model: LensModel, log_alpha: torch.Tensor, steps: torch.Tensor, attrs: dict[str, Any]
) -> xr.Dataset:
    """``block_masks``' result at one sparsity (``attrs["target_sparsity"]``).

    Args:
        log_alpha: (cluster, layer, component) fitted gate logits.
        steps: (cluster,) updates each cluster's set took.
    """
    dims, coords = ("cluster", "layer", "component"), {"component": list(COMPONENTS)}
    mask = schema.make(
        _binary_masks(log_alpha, 1 - attrs["target_sparsity"]).numpy(),
        dims=dims,
        coords=coords,
        attrs={**attrs, "long_name": "Block kept", "units": "bool"},
        n_layers=model.spec.n_layers,
    )
    prob = schema.make(
        _open_prob(log_alpha).cpu().numpy(),
        dims=dims,
        coords=coords,
        attrs={**attrs, "long_name": "Probability the gate is open", "units": "probability"},
        n_layers=model.spec.n_layers,
    )
    updates = schema.make(
        steps.numpy(),
        dims=("cluster",),
        attrs={**attrs, "long_name": "Adam updates", "units": "steps"},
    )
    return xr.Dataset({"mask": mask, "keep_prob": prob, "steps": updates}, attrs=attrs)


def _by_sparsity(
    parts: list[xr.Dataset], target_sparsity: float | Sequence[float], sparsities: list[float]
) -> xr.Dataset:
    """The one part when ``target_sparsity`` was one number, else the parts (one per
    sparsity) along a ``target_sparsity`` dim."""
    if np.isscalar(target_sparsity):
        return parts[0]
    return xr.concat(parts, dim="target_sparsity", combine_attrs="drop_conflicts").assign_coords(
        target_sparsity=sparsities
    )


@in_one_call
def block_mask_estimate(
    model: LensModel,
    prompts: PromptSet,
    *,
    clusters: Clustering,
    target_sparsity: float | Sequence[float] = 0.3,
    batch_size: int = 8,
    progress: bool = DEFAULTS.progress,
) -> xr.Dataset:
    """An instant estimate of ``block_masks``: each block's removal cost to first order.

    In the spirit of attribution patching: with every block's gate at 1, one forward and
    backward pass per batch gives dL/dg for every block, and the loss change of skipping a
    block alone (g: 1 -> 0) is about -dL/dg. Per cluster, the cost is averaged over the
    cluster's texts, and the mask keeps the round((1 - sparsity) x 2L) blocks that cost the
    most to skip, as ``block_masks`` keeps the blocks with the largest gate logits. Seconds
    instead of hours; how far it agrees with the learned masks is measured, not assumed
    (``benchmarks/block_masks.py`` reports the overlap).

    Args:
        model: a ``LensModel`` (frozen).
        prompts: the clustered texts (same order as ``clusters.labels``).
        clusters: from ``lenscape.cluster.kmeans``.
        target_sparsity: share of blocks to skip, in (0, 1), or a list.
        batch_size: texts per forward and backward pass.
        progress: show a progress bar.

    Returns:
        Dataset over ([target_sparsity,] cluster, layer, component): ``mask`` (bool, True =
        kept) and ``removal_cost`` (estimated increase of the mean next-token NLL, in nats,
        when the block alone is skipped).
    """
    sparsities = _check_sparsities(target_sparsity)
    batch_size = _validate.positive_int("batch_size", batch_size)
    progress = _validate.flag("progress", progress)
    clusters = _check_clusters(clusters)
    members = _members(clusters, len(prompts))
    items = _encode(model, prompts)
    spec = model.spec
    grads = torch.zeros(len(items), spec.n_layers, 2)
    current: dict[str, torch.Tensor] = {}
    batches = range(0, len(items), batch_size)
    with _scaled_blocks(model, lambda: current["scale"]):
        for start in tqdm(batches, disable=not progress, desc="block mask estimate"):
            rows = items[start : start + batch_size]
            scale = torch.ones(len(rows), spec.n_layers, 2, device=model.device)
            current["scale"] = scale.requires_grad_(True)
            loss = _row_loss(model, rows, current).sum()
            grads[start : start + len(rows)] = torch.autograd.grad(loss, scale)[0].cpu()
    cost = torch.stack([-grads[torch.as_tensor(m)].mean(0) for m in members])
    attrs = model.provenance(
        "block_mask_estimate",
        metric="nll",
        prompt_set=prompts.name,
        n_prompts=len(prompts),
        k=clusters.k,
        estimate="first-order removal cost -dL/dg at g = 1 (gradient, one pass)",
    )
    dims, coords = ("cluster", "layer", "component"), {"component": list(COMPONENTS)}
    parts = []
    for sparsity in sparsities:
        part_attrs = {**attrs, "target_sparsity": sparsity}
        mask = schema.make(
            _binary_masks(cost, 1 - sparsity).numpy(),
            dims=dims,
            coords=coords,
            attrs={**part_attrs, "long_name": "Block kept (estimate)", "units": "bool"},
            n_layers=spec.n_layers,
        )
        removal = schema.make(
            cost.numpy(),
            dims=dims,
            coords=coords,
            attrs={**part_attrs, "long_name": "Estimated cost of skipping", "units": "nats"},
            n_layers=spec.n_layers,
        )
        parts.append(xr.Dataset({"mask": mask, "removal_cost": removal}, attrs=part_attrs))
    return _by_sparsity(parts, target_sparsity, sparsities)


@torch.no_grad()
def _losses_per_row(
    model: LensModel,
    items: list[list[int]],
    row_masks: torch.Tensor,
    batch_size: int,
    *,
    bar: str | None = None,
) -> torch.Tensor:
    """Mean NLL of ``items[i]`` under ``row_masks[i]`` (rows, layer, 2) -> (rows,); with
    ``bar``, a progress bar of that name over the batches."""
    current: dict[str, torch.Tensor] = {}
    out = []
    batches = range(0, len(items), batch_size)
    with _scaled_blocks(model, lambda: current["scale"]):
        for start in tqdm(batches, disable=bar is None, desc=bar):
            current["scale"] = row_masks[start : start + batch_size].to(model.device)
            out.append(_row_loss(model, items[start : start + batch_size], current).cpu())
    return torch.cat(out)


@torch.no_grad()
@in_one_call
def masked_loss(
    model: LensModel,
    prompts: PromptSet,
    masks: torch.Tensor | xr.DataArray,
    *,
    batch_size: int = 16,
) -> torch.Tensor:
    """Mean NLL of ``prompts`` under each of several masks (sets, layer, component) -> (sets,).

    Args:
        masks: binary masks: a tensor or array (sets, layer, component) in the model's
            order (components attn, mlp), or a DataArray of ``block_masks`` (e.g.
            ``result["mask"]``), read by its ``layer`` and ``component`` labels (any order,
            any transpose), whose other dims (``cluster`` ...) are the sets, flattened in
            the order given.

    Returns:
        (sets,) the mean over ``prompts`` of each text's mean next-token NLL, in nats.

    Raises:
        TypeError: masks that are not numbers (a Dataset: pass ``result['mask']``).
        ValueError: probabilities or NaN where a binary mask is expected, a mask of another
            shape, of another method or from another model, labels that are not the
            model's, no prompts.
    """
    batch_size = _validate.positive_int("batch_size", batch_size)
    _validate.not_empty("prompts", prompts, fix="pass at least one text")
    if isinstance(masks, (xr.DataArray, xr.Dataset)):
        values = _read_masks(model, masks).values
    else:
        values = _validate.values("masks", masks, binary=True, fix=BINARY_FIX)
    shape = np.shape(values)
    if len(shape) < 2 or shape[-2:] != (model.spec.n_layers, 2):
        raise ValueError(
            f"masks must have shape (sets, {model.spec.n_layers}, 2) (layer, component: "
            f"attn, mlp of {model.name}), got {shape}."
        )
    masks = torch.as_tensor(values, dtype=torch.float32).reshape(-1, model.spec.n_layers, 2)
    items = _encode(model, prompts)
    rows = masks.repeat_interleave(len(items), dim=0)
    losses = _losses_per_row(model, items * len(masks), rows, batch_size)
    return losses.view(len(masks), len(items)).mean(1)


# long: the options checked before the fit; the steps after it are helpers
@in_one_call
def mask_comparison(
    model: LensModel,
    train: PromptSet,
    held_out: PromptSet,
    *,
    clusters: Clustering,
    sparsities: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5),
    n_random: int = 3,
    loss: str = "nll",
    seed: int = 0,
    batch_size: int = 16,
    checkpoint: str | Path | None = None,
    time_budget: float | None = None,
    progress: bool = DEFAULTS.progress,
    **fit_options,
) -> xr.Dataset:
    """IG-Pruning's claim on held-out texts: routed per-cluster masks vs one global mask vs
    random masks, at equal sparsity.

    One stacked fit learns, for every sparsity, a mask per cluster (on its training texts)
    and a global mask (on all training texts). Each held-out text is routed to its nearest
    centroid. The score is the held-out perplexity relative to the unmasked model,
    exp(mean masked NLL - mean unmasked NLL), over all held-out texts.

    Args:
        train: the clustered texts (same order as ``clusters.labels``).
        held_out: texts never used for clustering or training (``lenscape.cluster.split``).
        clusters: from ``lenscape.cluster.kmeans`` on ``train``.
        sparsities: target sparsities, each in (0, 1) (at most ``MAX_SPARSITIES``).
        n_random: random masks per sparsity (same number of kept blocks), averaged (at
            most ``MAX_RANDOM_MASKS``).
        loss: training loss, ``"nll"`` or ``"kl"``.
        fit_options: passed to the fit (``max_steps``, ``window``, ``tol``, ``lr``,
            ``penalty``, ``rows_per_pass``, ``precision``; ``batch_size`` is the evaluation
            batch, use ``train_batch_size``); the rest keep ``FIT_DEFAULTS``.
        checkpoint: a folder where the fit keeps its state (as in ``block_masks``).
        time_budget: seconds the fit's updates may take, or None (as in ``block_masks``;
            the held-out scoring after the fit is not counted).

    Returns:
        Dataset: ``ppl_ratio`` (strategy, target_sparsity) with strategies routed, global,
        random; ``loss_routed``/``loss_global`` (target_sparsity, cluster) mean held-out NLL
        of the texts routed to each cluster and ``n_held_out`` (cluster,); the masks
        ``routed_mask`` (target_sparsity, cluster, layer, component) and ``global_mask``
        (target_sparsity, layer, component); the unmasked held-out NLL, ``converged`` and
        ``stopped`` (with a budget, ``time_budget`` and ``longer_run``) in attrs.
    """
    sparsities = _check_sparsities(sparsities, "sparsities")
    n_random = _validate.integer("n_random", n_random, low=1, high=MAX_RANDOM_MASKS)
    _validate.choice("loss", loss, LOSSES)
    seed = _validate.seed("seed", seed)
    batch_size = _validate.positive_int("batch_size", batch_size)
    progress = _validate.flag("progress", progress)
    folder = optim.checkpoint_folder(checkpoint)
    time_budget = optim.check_time_budget(time_budget)
    options = _fit_options(fit_options, caller="mask_comparison")
    clusters = _check_clusters(clusters)
    if len(held_out) < clusters.k:
        raise ValueError(
            f"{len(held_out)} held-out texts for {clusters.k} clusters: hold out "
            "at least one text per cluster, e.g. lenscape.cluster.split(prompts, "
            "held_out=0.25)."
        )
    fit = _fit_masks(
        model,
        _encode(model, train),
        [*_members(clusters, len(train)), np.arange(len(train))],  # each cluster, then all
        sparsities,
        options,
        loss=loss,
        seed=seed,
        progress=progress,
        checkpoint=folder,
        time_budget=time_budget,
    )
    routes = torch.as_tensor(clusters.route(held_out))
    items = _encode(model, held_out)
    base = _losses_per_row(model, items, torch.ones(len(items), model.spec.n_layers, 2), batch_size)
    masks, ratio, by_cluster = _compare_strategies(
        model,
        fit,
        items,
        routes,
        base,
        sparsities,
        n_random=n_random,
        seed=seed,
        batch_size=batch_size,
        progress=progress,
    )
    attrs = {
        "method": "mask_comparison",
        "model": model.name,
        "k": clusters.k,
        "loss": loss,
        "n_train": len(train),
        "n_held_out": len(held_out),
        "n_random": n_random,
        "seed": seed,
        "loss_unmasked": float(base.mean()),
        "steps": int(fit.steps.max()),
        "converged": int(fit.converged.all()),
        **_budget_attrs(fit, options, time_budget),
        **{f"fit_{name}": value for name, value in asdict(options).items()},
    }
    return _comparison_result(model, sparsities, masks, ratio, by_cluster, routes, attrs)


def _compare_strategies(
    model: LensModel,
    fit: Fit,
    items: list[list[int]],
    routes: torch.Tensor,
    base: torch.Tensor,
    sparsities: list[float],
    *,
    n_random: int,
    seed: int,
    batch_size: int,
    progress: bool,
) -> tuple[list[torch.Tensor], np.ndarray, np.ndarray]:
    """Per sparsity, the held-out texts under routed, global and ``n_random`` random masks.

    Args:
        fit: params (sparsity x (cluster + 1), layer, component): per sparsity, each
            cluster's gate logits, then the global mask's.
        items: the held-out texts' token ids; routes: (texts,) each one's cluster.
        base: (texts,) their unmasked NLL; progress: show a bar per sparsity.

    Returns:
        Per sparsity, the masks (cluster + 1, layer, component) as floats; ``ppl_ratio``
        (strategy, target_sparsity); routed and global mean NLL per cluster (2,
        target_sparsity, cluster).
    """
    k = len(fit.params) // len(sparsities) - 1
    rng = np.random.default_rng(seed)
    masks: list[torch.Tensor] = []
    ratio = np.zeros((len(STRATEGIES), len(sparsities)))
    by_cluster = np.full((2, len(sparsities), k), np.nan)
    for i, sparsity in enumerate(sparsities):
        masks.append(
            _binary_masks(fit.params[i * (k + 1) : (i + 1) * (k + 1)], 1 - sparsity).float()
        )
        randoms = _random_masks(int(masks[i][0].sum()), n_random, model.spec.n_layers, rng)
        bar = f"held-out texts, sparsity {sparsity}" if progress else None
        losses = _strategy_losses(model, items, masks[i], randoms, routes, batch_size, bar)
        ratio[:, i], by_cluster[:, i] = _held_out_scores(losses, base, routes, k)
    return masks, ratio, by_cluster


def _random_masks(n_keep: int, n: int, n_layers: int, rng: np.random.Generator) -> torch.Tensor:
    """(n, layer, component) float masks, each keeping ``n_keep`` blocks drawn from ``rng``."""
    randoms = torch.zeros(n, n_layers * 2)
    for r in range(n):
        randoms[r, rng.choice(n_layers * 2, n_keep, replace=False)] = 1
    return randoms.view(n, n_layers, 2)


def _strategy_losses(
    model: LensModel,
    items: list[list[int]],
    masks: torch.Tensor,
    randoms: torch.Tensor,
    routes: torch.Tensor,
    batch_size: int,
    bar: str | None,
) -> torch.Tensor:
    """Each held-out text's NLL under each strategy's mask.

    Args:
        masks: (cluster + 1, layer, component): the per-cluster masks, then the global one.
        randoms: (n_random, layer, component) random masks.
        routes: (texts,) each text's cluster.
        bar: the name of a progress bar over the passes, or None for none.

    Returns:
        (2 + n_random, texts): routed (its cluster's mask), global, each random mask.
    """
    k, n = len(masks) - 1, len(items)
    row_sets = [
        masks[:k][routes],
        masks[k].expand(n, -1, -1),
        *[random.expand(n, -1, -1) for random in randoms],
    ]
    losses = _losses_per_row(model, items * len(row_sets), torch.cat(row_sets), batch_size, bar=bar)
    return losses.view(len(row_sets), n)


def _held_out_scores(
    losses: torch.Tensor, base: torch.Tensor, routes: torch.Tensor, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Scores of one sparsity from ``_strategy_losses``, the unmasked NLL ``base`` (texts,)
    and each text's cluster ``routes`` (texts,) among ``k``.

    Returns:
        (strategy,) held-out perplexity over the unmasked one: routed, global, the mean of
        the random masks'; (2, cluster) mean NLL of the texts routed to each cluster under
        the routed and the global mask (NaN where no text is routed there).
    """
    ratio = np.array(
        [
            float(torch.exp(losses[0].mean() - base.mean())),
            float(torch.exp(losses[1].mean() - base.mean())),
            float(torch.exp(losses[2:].mean(1) - base.mean()).mean()),
        ]
    )
    by_cluster = np.full((2, k), np.nan)
    for c in range(k):
        rows = routes == c
        if rows.any():
            by_cluster[0, c] = float(losses[0][rows].mean())
            by_cluster[1, c] = float(losses[1][rows].mean())
    return ratio, by_cluster


def _comparison_result(
    model: LensModel,
    sparsities: list[float],
    masks: list[torch.Tensor],
    ratio: np.ndarray,
    by_cluster: np.ndarray,
    routes: torch.Tensor,
    attrs: dict[str, Any],
) -> xr.Dataset:
    """``mask_comparison``'s Dataset.

    Args:
        masks: per sparsity, (cluster + 1, layer, component): per-cluster masks, then global.
        ratio: (strategy, target_sparsity); by_cluster: (2, target_sparsity, cluster),
            routed then global; routes: (held-out texts,) each text's cluster.
    """
    k, n_layers = len(masks[0]) - 1, model.spec.n_layers
    coords = {
        "strategy": list(STRATEGIES),
        "target_sparsity": sparsities,
        "cluster": np.arange(k),
        "layer": np.arange(n_layers),
        "component": list(COMPONENTS),
    }
    return xr.Dataset(
        {
            "ppl_ratio": (
                ("strategy", "target_sparsity"),
                ratio,
                {"long_name": "Held-out perplexity / unmasked perplexity", "units": "ratio"},
            ),
            "loss_routed": (
                ("target_sparsity", "cluster"),
                by_cluster[0],
                {"long_name": "Held-out NLL, routed mask", "units": "nats"},
            ),
            "loss_global": (
                ("target_sparsity", "cluster"),
                by_cluster[1],
                {"long_name": "Held-out NLL, global mask", "units": "nats"},
            ),
            "n_held_out": (("cluster",), np.bincount(routes.numpy(), minlength=k)),
            "routed_mask": (
                ("target_sparsity", "cluster", "layer", "component"),
                torch.stack([m[:k] for m in masks]).bool().numpy(),
                {"long_name": "Block kept, per-cluster mask", "units": "bool", "model": model.name},
            ),
            "global_mask": (
                ("target_sparsity", "layer", "component"),
                torch.stack([m[k] for m in masks]).bool().numpy(),
                {"long_name": "Block kept, global mask", "units": "bool", "model": model.name},
            ),
        },
        coords=coords,
        attrs=attrs,
    )
