"""Recorded results: reference-protocol fits that take hours, computed once and shipped.

Some figures need fits that take hours on a laptop CPU (F4's 10 seeds of causal head gating
per task, F1's converged per-cluster block masks). They are run once, resumably, by
``benchmarks/record.py``, and the results ship inside the package as small netCDF files with
their provenance in attrs (command, commit, date, machine, torch threads, wall time, updates
per stage and whether every stage converged). A notebook loads them at once::

    roles = lsc.recorded("head_roles", model="smollm2-135m", task="math")

A recording is resumable: each unit of work (one seed of one task; one model's masks) is
one file, written atomically when it finishes, and a restarted run skips the files that
exist. Within a unit, the fit keeps its state in a hidden ``.<unit>.fit-state`` folder
beside it (``optim.Resume``, every convergence check), so a killed run also continues the
unit it was in, with the same numbers (the unit's ``resumed`` attr says so and its
``wall_time`` is then the last run's); the folder is removed once the unit is written.

Next to the units, each recording keeps a *checkpoint*: the result of the first few
updates of its fit (head roles: seed 0 on the first items; block masks: the per-cluster
masks on the recorded clusters), which ``tests/test_recordings.py`` recomputes, so the shipped data
cannot drift from the code that made it. A checkpoint names the CPU kind and torch thread
count it was computed with (``models.host.describe_machine().kind``): on that kind the rerun
agrees to float rounding; on another (another vendor's math library, another vector
extension) Adam's first updates amplify rounding, and the test compares with tolerances
measured across CPUs.

Every file carries a SHA-256 of its contents (``content_sha256`` attr, ``store.content_sha256``)
taken when it was written, and its values have known ranges (``VALUE_RANGES``: gates and
shares in [0, 1], masks 0/1, finite losses ...); ``recorded`` checks both on every load, so
a changed or damaged file is refused, naming it, instead of being read out.

Layout: ``recorded_data/<name>/<model>/<task>/seed<N>.nc`` and ``.../checkpoint.nc`` for
head roles; ``recorded_data/<name>/<model>/k<K>.nc`` and ``.../checkpoint.nc`` for block
masks. Other files in these folders (notes, copies) are ignored.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import _validate, cluster, data, schema, store
from ..data import PromptSet
from ..models import LensModel, in_one_call
from ..models.host import describe_machine
from .gating import check_seeds, gating_check, head_gating
from .masks import block_masks, mask_comparison

RECORDED_DIR = Path(__file__).resolve().parent / "recorded_data"
NAMES = ("head_roles", "head_roles_check", "block_masks")

# F4: the reference protocol (head_gating's defaults, shared/FACTS.md); only these change.
HEAD_ROLES_SEEDS = 10
HEAD_ROLES_TASKS = ("math", "syntax")
# The checkpoints (what tests/test_recordings.py recomputes on every CI run): this many updates
# per stage of seed 0 on the first items, all of them in each update (F4), or of every
# cluster's mask with one text per cluster per update (F1). Measured with 2 threads against
# a 1-thread recording (rounding like another CPU's): F1's keep probabilities move by 5e-6;
# F4's gates by 0.001 at 16 math items, by 0.005 at 32 syntax items but past the cross-CPU
# tolerances at 16 (its plus/minus stages then hinge on rounding).
CHECKPOINT_STEPS = 3
CHECKPOINT_ITEMS = {"math": 16, "syntax": 32}
CHECKPOINT_MASKS_BATCH = 1
CHECK_RANDOM_SETS = 200  # random role-sized head sets per role in the recorded check

# F1: K clusters of the mixed corpus, the sparsity the figure draws; routed vs global vs
# random masks on held-out texts (mask_comparison). Block masks' defaults otherwise.
BLOCK_MASKS_K = 8
BLOCK_MASKS_SPARSITY = 0.3
BLOCK_MASKS_HELD_OUT = 0.25
BLOCK_MASKS_RANDOM = 20
# The update cap of the recorded fit: block_masks' default of 300 left a K=4 fit unconverged.
BLOCK_MASKS_MAX_STEPS = 800

#: The attr holding a recorded file's ``store.content_sha256`` (of everything else in it).
CHECKSUM_ATTR = "content_sha256"


class Range(NamedTuple):
    """What a recorded variable may hold: numbers in [low, high] (``binary``: only 0/1),
    NaN ("not computed") only where ``nan``, +inf only where ``inf``."""

    low: float
    high: float
    binary: bool = False
    nan: bool = False
    inf: bool = False


_SHARE, _FLAG, _AT_LEAST_0 = Range(0, 1), Range(0, 1, binary=True), Range(0, math.inf)
#: NaN where a check's role cannot be compared (no head has the role), or where no held-out
#: text is routed to a cluster.
_LOSS_OR_NONE = Range(0, math.inf, nan=True)

#: The range of every number a recording holds, by variable (data and coords). A variable
#: without one is refused, when written and when read, so none is left unchecked.
VALUE_RANGES: dict[str, Range] = {
    **dict.fromkeys(
        ("gate", "gate_plus", "gate_minus", "facilitation", "interference", "irrelevance"),
        _SHARE,
    ),
    **dict.fromkeys(("keep_prob", "depth", "target_sparsity"), _SHARE),
    **dict.fromkeys(("mask", "routed_mask", "global_mask", "in_set", "passes", "all_pass"), _FLAG),
    **dict.fromkeys(("val_loss", "val_loss_plus", "val_loss_minus", "loss_intact"), _AT_LEAST_0),
    **dict.fromkeys(
        ("loss_off", "random_p5", "random_p50", "random_p95", "loss_random_off"), _LOSS_OR_NONE
    ),
    **dict.fromkeys(("loss_routed", "loss_global"), _LOSS_OR_NONE),
    "ppl_ratio": _AT_LEAST_0,
    "percentile": Range(0, 100, nan=True),
    # Gate movement over the last window: inf where no window was completed yet.
    **dict.fromkeys(("movement_stage0", "movement_plus", "movement_minus"), Range(0, 1, inf=True)),
    **dict.fromkeys(
        ("steps", "steps_stage0", "steps_plus", "steps_minus", "n_held_out", "set_size"),
        _AT_LEAST_0,
    ),
    **dict.fromkeys(("seed", "layer", "head", "cluster", "draw"), _AT_LEAST_0),
}


def _available(root: Path) -> list[str]:
    """Folders under ``root`` holding at least one finished unit (a ``.nc`` file at any
    depth; a recording still in progress has only its hidden fit state)."""
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and any(p.glob("**/[!.]*.nc"))
    )


def _unit_paths(
    name: str, model: str, task: str | None, root: str | Path | None = None
) -> tuple[Path, list[Path]]:
    """The folder of a recording under ``root`` (default ``RECORDED_DIR``) and its finished
    unit files; TypeError for an argument of the wrong type, ValueError listing what exists."""
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"No recorded result has name={name!r}; recorded results: {list(NAMES)}.")
    _validate.text("model", model, example="'smollm2-135m'")
    if task is not None:
        _validate.text("task", task, example="'math' (or None for block masks)")
    base = RECORDED_DIR if root is None else store.as_path(root, argument="root")
    if not (root is None or base.is_dir()):
        raise ValueError(
            f"root={str(root)!r} is not a folder; pass the folder that holds the recordings "
            "(its head_roles/ or block_masks/), or None for the ones shipped with lenscape."
        )
    where = "" if root is None else f" under root={str(root)!r}"
    top = base / ("head_roles" if name == "head_roles_check" else name)
    models = _available(top)
    if model not in models:
        raise ValueError(
            f"No recorded {name!r} for model {model!r}{where}; recorded for: "
            f"{models or 'none yet'}. Record one with `python benchmarks/record.py "
            f"{name} --model {model}`."
        )
    folder = top / model
    if name in ("head_roles", "head_roles_check"):
        tasks = _available(folder)
        if task not in tasks:
            raise ValueError(
                f"Recorded head roles of {model!r} exist for tasks {tasks}; got task={task!r}."
            )
        folder = folder / task
        units = _numbered(folder, "seed")
        if name == "head_roles_check":
            units = [folder / "check.nc"] if (folder / "check.nc").exists() else []
    else:
        if task is not None:
            raise ValueError(f"Recorded block masks have no task; drop task={task!r}.")
        units = _numbered(folder, "k")
    if not units:
        raise ValueError(f"The recording {folder} has no finished unit yet.")
    return folder, units


def _numbered(folder: Path, prefix: str) -> list[Path]:
    """The unit files ``<prefix><N>.nc`` in ``folder`` (``seed3.nc``, ``k8.nc``), by N;
    other files (``seed3 copy.nc``, ``seedX.nc``, notes) are not units."""
    units = {}
    for path in folder.glob(f"{prefix}*.nc"):
        match = re.fullmatch(rf"{prefix}(0|[1-9][0-9]*)\.nc", path.name)
        if match:
            units[int(match[1])] = path
    return [units[n] for n in sorted(units)]


def _repair(path: Path) -> str:
    """What to do about a damaged recorded file: reinstall a shipped one, re-record others."""
    if path.is_relative_to(RECORDED_DIR):
        return (
            "reinstall lenscape (pip install --force-reinstall --no-deps lenscape) to restore "
            "the recordings it ships"
        )
    return (
        "delete it and record it again with `python benchmarks/record.py` (its --root option "
        "names your folder)"
    )


def _check_values(ds: xr.Dataset, path: Path) -> None:
    """Refuse a recording with a number outside its variable's ``VALUE_RANGES``, or with a
    number variable that has no range.

    Args:
        ds: the recorded Dataset; path: its file, for the message.

    Raises:
        ValueError: a value out of range (NaN, inf, a gate above 1 ...), naming the file,
            the variable and the fix; or a variable without a range.
    """
    for name, var in ds.variables.items():
        if var.dtype.kind in "OUST":
            continue
        if name not in VALUE_RANGES:
            raise ValueError(
                f"{path} holds {name!r}, a variable lenscape's recordings do not have; it was "
                "written by other code or another lenscape version: re-record it (or give "
                "the variable its range in lenscape.fits.recordings.VALUE_RANGES)."
            )
        rule = VALUE_RANGES[str(name)]
        values = np.asarray(var.values, dtype=np.float64)
        allowed = (np.isnan(values) & rule.nan) | (np.isposinf(values) & rule.inf)
        _validate.values(
            f"{name!r} in the recorded file {path}",
            values[~allowed],
            low=rule.low,
            high=rule.high,
            binary=rule.binary,
            fix=f"the file is damaged or was not written by lenscape's recorder: {_repair(path)}",
        )


def _open(path: Path) -> xr.Dataset:
    """One recorded file, refused if it does not read, if another lenscape schema wrote
    it, if its contents differ from its checksum or if a value is out of range."""
    try:
        ds = store.open_result(path)
    except store.StoreError as err:
        raise ValueError(f"The recorded file {path} cannot be read: {_repair(path)}.") from err
    if not isinstance(ds, xr.Dataset):
        raise ValueError(f"{path} holds one array, not a recorded Dataset: {_repair(path)}.")
    found = ds.attrs.get("schema_version")
    if found != schema.SCHEMA_VERSION:
        raise ValueError(
            f"{path} was recorded with lenscape schema version {found}; this lenscape reads "
            f"version {schema.SCHEMA_VERSION}. Re-record it with `python benchmarks/record.py` "
            f"or use the lenscape version that wrote it ({ds.attrs.get('lenscape_version')})."
        )
    recorded_sum = ds.attrs.pop(CHECKSUM_ATTR, None)
    if recorded_sum is None:
        raise ValueError(
            f"{path} carries no checksum ({CHECKSUM_ATTR} attr), so whether it holds what "
            f"was recorded cannot be checked; {_repair(path)}."
        )
    actual = store.content_sha256(ds)
    if actual != recorded_sum:
        raise ValueError(
            f"{path} does not hold what was recorded: its contents hash to "
            f"{actual[:12]}…, the recording's checksum is {str(recorded_sum)[:12]}… (the "
            f"file was changed or damaged after it was written); {_repair(path)}."
        )
    _check_values(ds, path)
    return ds


@in_one_call
def recorded(
    name: str,
    *,
    model: str = "smollm2-135m",
    task: str | None = None,
    root: str | Path | None = None,
) -> xr.Dataset:
    """Load a recorded reference-protocol result by name.

    Args:
        name: ``"head_roles"`` (F4: ``head_gating`` over seeds), ``"head_roles_check"``
            (``gating_check`` of the recorded seeds on the validation split) or
            ``"block_masks"`` (F1: ``mask_comparison`` at K clusters).
        model: the bundled model's name, e.g. ``"smollm2-135m"``.
        task: for head roles, ``"math"`` or ``"syntax"``.
        root: another folder of recordings (default: the ones shipped in the package).

    Returns:
        For head roles, the ``head_gating`` Dataset over the recorded seeds (seed, layer,
        head), with per-seed provenance (``wall_time``, ``torch_threads`` ... over seed) and,
        in attrs, ``n_seeds_recorded`` of ``n_seeds_planned`` and whether every seed's
        stages converged. For the check, the ``gating_check`` Dataset (its ``n_seeds``
        attr says how many seeds it judged). For block masks, the ``mask_comparison``
        Dataset. Attrs name the
        command, commit, date and machine of the recording.

    Raises:
        TypeError: a model or task that is not a string, a root that is not a path.
        ValueError: an unknown name, model or task (the message lists what exists), a root
            that is not a folder, a file written under another schema version (the
            message names the version it needs), or a damaged file: one that does not
            read, whose contents no longer match the checksum taken when it was recorded,
            with a value outside its range, or a seed file renamed (each message names the
            file and says to reinstall lenscape, or to record it again).
    """
    folder, units = _unit_paths(name, model, task, root)
    if name != "head_roles":
        return _open(units[-1])
    seeds = [_open(path) for path in units]
    for path, ds in zip(units, seeds, strict=True):
        if ds["seed"].values.tolist() != [int(path.stem.removeprefix("seed"))]:
            raise ValueError(
                f"{path} holds seed(s) {ds['seed'].values.tolist()}, not the seed its name "
                f"says: it was renamed or copied over; {_repair(path)}."
            )
    per_seed = ("wall_time", "torch_threads", "commit", "date", "machine", "command", "resumed")
    combined = xr.concat(seeds, dim="seed", combine_attrs="override")
    for key in per_seed:
        # Units recorded before fits could resume lack "resumed": they ran in one go.
        combined[key] = (
            "seed",
            [ds.attrs[key] if key != "resumed" else ds.attrs.get(key, 0) for ds in seeds],
        )
    attrs = {k: v for k, v in seeds[0].attrs.items() if k not in per_seed}
    attrs.update(
        n_seeds=len(seeds),
        n_seeds_recorded=len(seeds),
        n_seeds_planned=HEAD_ROLES_SEEDS,
        converged=int(all(ds.attrs["converged"] for ds in seeds)),
        steps_stage0=max(int(ds.attrs["steps_stage0"]) for ds in seeds),
        steps_plus=max(int(ds.attrs["steps_plus"]) for ds in seeds),
        steps_minus=max(int(ds.attrs["steps_minus"]) for ds in seeds),
        recorded_in=str(folder.relative_to(folder.parents[2])),  # head_roles/<model>/<task>
    )
    for variable in combined.data_vars.values():
        variable.attrs.update({k: v for k, v in attrs.items() if k in variable.attrs})
    combined.attrs = attrs
    return combined


def _write(ds: xr.Dataset, path: Path) -> None:
    """Write ``ds`` to ``path`` atomically (an interrupted write leaves no half file), with
    the schema version and the checksum that ``recorded`` checks; values out of their
    ``VALUE_RANGES`` are refused before anything is written."""
    ds.attrs.update(schema_version=schema.SCHEMA_VERSION, lenscape_version=schema.package_version())
    ds.attrs.pop(CHECKSUM_ATTR, None)
    _check_values(ds, path)
    ds.attrs[CHECKSUM_ATTR] = store.content_sha256(ds)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.partial.nc")  # hidden from the unit globs
    partial.unlink(missing_ok=True)
    store.save(ds, partial)
    os.replace(partial, path)


def _fit_state(unit: Path) -> Path:
    """The hidden folder where the fit of ``unit`` keeps its state until the unit is written."""
    return unit.with_name(f".{unit.stem}.fit-state")


def _with_machine(point: xr.Dataset) -> xr.Dataset:
    """A checkpoint with the torch thread count and CPU kind it was computed at (attrs)."""
    return point.assign_attrs(torch_threads=torch.get_num_threads(), cpu=describe_machine().kind)


def head_roles_checkpoint(model: LensModel, task: str, *, precision: str) -> xr.Dataset:
    """The first ``CHECKPOINT_STEPS`` updates per stage of seed 0 on the first
    ``CHECKPOINT_ITEMS[task]`` training items, all of them in each update: what
    ``tests/test_recordings.py`` recomputes.

    The torch thread count and CPU kind are recorded (attrs ``torch_threads``, ``cpu``): CPU
    matmuls split their reductions by thread and by vector extension, so a fit is
    bit-identical only on the same kind at the same count (measured: 1 vs 2 threads differ
    by up to 0.02 in a gate after 3 updates, an AMD AVX2 vs an Intel AVX512 CPU by up to
    0.21 in a G+ gate, since Adam's first updates move every logit by about lr whatever
    the gradient's size)."""
    point = head_gating(
        model,
        data.task(task)[: CHECKPOINT_ITEMS[task]],
        seeds=[0],
        batch_size=CHECKPOINT_ITEMS[task],  # every item in every update
        max_steps=CHECKPOINT_STEPS,
        validation=data.task(task, split="validation")[:8],
        precision=precision,  # type: ignore[arg-type]
        progress=False,
    )
    return _with_machine(point)


@in_one_call
def record_head_roles(
    model: LensModel,
    tasks: Sequence[str] = HEAD_ROLES_TASKS,
    *,
    seeds: Sequence[int] = range(HEAD_ROLES_SEEDS),
    precision: str = "float32",
    provenance: Mapping[str, Any],
    root: Path | None = None,
    on_unit: Callable[[Path], None] | None = None,
) -> list[Path]:
    """Record F4's head roles: every (task, seed) not yet on disk, one seed at a time.

    Seeds alternate between tasks (seed 0 of every task first), so an interrupted recording
    leaves every task with about as many seeds. Each seed is ``head_gating`` at the reference
    protocol (its defaults), on the task's training split with the validation split held out.

    Args:
        model: the bundled model (its name names the folder).
        tasks: task names; seeds: seeds to record.
        precision: passed to ``head_gating``.
        provenance: attrs every file carries: ``command``, ``commit``, ``date``, ``machine``.
        root: where the ``head_roles`` folder lives (the package's data by default).
        on_unit: called with each file as it lands (e.g. to commit it).

    Returns:
        The files written by this call.

    Raises:
        TypeError, ValueError: ``seeds`` not a list of distinct seeds >= 0, or more than
            ``gating.MAX_SEEDS`` of them (each is a whole fit per task).
    """
    seeds = check_seeds(list(seeds))
    written = []
    for task in tasks:
        folder = (root or RECORDED_DIR) / "head_roles" / model.name / task
        point = folder / "checkpoint.nc"
        if not point.exists():
            _write(head_roles_checkpoint(model, task, precision=precision), point)
    todo = [(s, t) for s in seeds for t in tasks]
    bar = tqdm(todo, desc="recording head roles (seed, task)")
    for seed, task in bar:
        path = (root or RECORDED_DIR) / "head_roles" / model.name / task / f"seed{seed}.nc"
        if path.exists():
            continue
        bar.set_postfix(task=task, seed=seed)
        resumed = _fit_state(path).exists()
        start = time.perf_counter()
        ds = head_gating(
            model,
            data.task(task),
            seeds=[seed],
            validation=data.task(task, split="validation"),
            precision=precision,  # type: ignore[arg-type]
            checkpoint=_fit_state(path),
            progress=False,
        )
        ds.attrs.update(
            provenance,
            task=task,
            wall_time=round(time.perf_counter() - start, 1),
            resumed=int(resumed),
            torch_threads=torch.get_num_threads(),
        )
        _write(ds, path)
        shutil.rmtree(_fit_state(path))
        written.append(path)
        if on_unit is not None:
            on_unit(path)
    return written


@in_one_call
def record_head_roles_check(
    model: LensModel,
    task: str,
    *,
    n_random: int = CHECK_RANDOM_SETS,
    provenance: Mapping[str, Any],
    root: Path | None = None,
) -> Path:
    """Record ``gating_check`` of every recorded seed of ``task`` on its validation split;
    recomputed when seeds were added since the last check."""
    path = (root or RECORDED_DIR) / "head_roles" / model.name / task / "check.nc"
    roles = recorded("head_roles", model=model.name, task=task, root=root)
    if path.exists() and _open(path).attrs["n_seeds"] == roles.sizes["seed"]:
        return path
    start = time.perf_counter()
    check = gating_check(model, roles, data.task(task, split="validation"), n_random=n_random)
    check.attrs.update(
        provenance,
        task=task,
        wall_time=round(time.perf_counter() - start, 1),
        torch_threads=torch.get_num_threads(),
    )
    path.unlink(missing_ok=True)
    _write(check, path)
    return path


def f1_split(k: int = BLOCK_MASKS_K) -> tuple[PromptSet, PromptSet, cluster.Clustering]:
    """F1's texts as the ``block_masks`` recording split and clustered them (so a figure of
    the recording can name its clusters: ``Clustering.names``).

    Args:
        k: clusters (the recording's ``k`` attr).

    Returns:
        (training texts, held-out texts, ``k`` clusters of the training texts).
    """
    train, held_out = cluster.split(data.prompts("mixed"), held_out=BLOCK_MASKS_HELD_OUT)
    return train, held_out, cluster.kmeans(cluster.embed(train), k, prompts=train)


def block_masks_checkpoint(model: LensModel, *, precision: str) -> xr.Dataset:
    """The first ``CHECKPOINT_STEPS`` updates of F1's per-cluster masks (``block_masks`` on
    the recorded clusters at the recorded sparsity, ``CHECKPOINT_MASKS_BATCH`` texts per
    cluster per update): what ``tests/test_recordings.py`` recomputes. Its ``keep_prob``
    moves with any change to the fit; the torch thread count and CPU kind are recorded as in
    ``head_roles_checkpoint``."""
    train, _, clusters = f1_split()
    point = block_masks(
        model,
        train,
        clusters=clusters,
        target_sparsity=BLOCK_MASKS_SPARSITY,
        max_steps=CHECKPOINT_STEPS,
        batch_size=CHECKPOINT_MASKS_BATCH,
        precision=precision,  # type: ignore[arg-type]
        progress=False,
    )
    return _with_machine(point)


@in_one_call
def record_block_masks(
    model: LensModel,
    *,
    k: int = BLOCK_MASKS_K,
    sparsity: float = BLOCK_MASKS_SPARSITY,
    precision: str = "float32",
    provenance: Mapping[str, Any],
    root: Path | None = None,
    **fit_options: Any,
) -> Path:
    """Record F1 for one model: K clusters of the mixed corpus, per-cluster masks vs one
    global mask vs random masks at ``sparsity``, on held-out texts (``mask_comparison``)."""
    path = (root or RECORDED_DIR) / "block_masks" / model.name / f"k{k}.nc"
    point = path.with_name("checkpoint.nc")
    if not point.exists():
        _write(block_masks_checkpoint(model, precision=precision), point)
    if path.exists():
        return path
    train, held_out, clusters = f1_split(k)
    resumed = _fit_state(path).exists()
    start = time.perf_counter()
    ds = mask_comparison(
        model,
        train,
        held_out,
        clusters=clusters,
        sparsities=[sparsity],
        n_random=BLOCK_MASKS_RANDOM,
        precision=precision,
        checkpoint=_fit_state(path),
        **{"max_steps": BLOCK_MASKS_MAX_STEPS, **fit_options},
    )
    ds.attrs.update(
        provenance,
        wall_time=round(time.perf_counter() - start, 1),
        resumed=int(resumed),
        torch_threads=torch.get_num_threads(),
    )
    _write(ds, path)
    shutil.rmtree(_fit_state(path))
    return path
