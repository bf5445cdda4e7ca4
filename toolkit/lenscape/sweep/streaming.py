"""Streaming capture: results go to a zarr store batch by batch, and interrupted runs resume.

``stream(path, planner, model, prompts, options)`` writes the layout of the whole result to
``path`` (coords, attrs, NaN data) with the settings that identify the run, plans the method
(``plan``), then scores the prompt batches that are not done yet and writes each as soon
as it is scored. Memory holds one batch, never the whole result. A run killed at any
moment is resumed by running it again with the same arguments: finished batches are
kept, unfinished ones recomputed, so the final store equals an uninterrupted run's. A
store made by another method, model, prompt list or settings is refused.

One process writes a store at a time: ``stream`` holds ``store.writer_lock`` from before it
reads the store until the last batch is written, so a second writer fails at once with a
message naming the first. A killed run's lock is released by the operating system, so
running again resumes it.

With ``client=`` (a ``dask.distributed.Client``) batches are scored on the cluster's
workers instead (``distributed``), writing into the same store.

``execute`` is what every per-prompt method calls: in memory, or ``stream`` when given
``store=``. ``lsc.capture_to`` (``to_store``) streams a method given by name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any, cast

from tqdm.auto import tqdm

from .. import store
from ..data import Prompts, as_prompt_set
from ..models import LensModel
from .inputs import fingerprint
from .options import DEFAULTS
from .plan import (
    CaptureOptions,
    PlanData,
    Planner,
    R,
    batch_slice,
    nan_values,
    not_yet_correct,
    run_in_memory,
    write_batch,
)

#: Options that change how a run is cut up, not its numbers (batch_size is checked apart:
#: the store's prompt chunks follow it).
SPEED_OPTIONS = ("variants_per_pass", "batch_size")


def execute(
    planner: Planner[R],
    model: LensModel,
    prompts: Prompts,
    options: CaptureOptions,
    *,
    store: str | Path | None,
    client: Any,
    progress: bool,
) -> R:
    """Run a per-prompt method in memory, or stream it to ``store`` (optionally on dask
    ``client``): ``planner(model, prompts, options)`` says what to compute.

    Raises:
        ValueError: ``client`` without ``store``; the rest as ``stream`` and the planner.
    """
    if client is not None and store is None:
        raise ValueError(
            "client= distributes batches whose results land in one zarr store; "
            "pass store='results.zarr' too."
        )
    if store is None:
        return run_in_memory(planner(model, prompts, options, progress=progress), progress=progress)
    return stream(store, planner, model, prompts, options, client=client, progress=progress)


def settings_of(options: CaptureOptions, model: LensModel, prompts: Prompts) -> dict[str, Any]:
    """What identifies a run: a store is only resumed by a run with equal settings.

    Returns:
        ``{"method", "model", "n_prompts", "prompts_sha256", "options"}``, ``options`` being
        every option of the method but ``SPEED_OPTIONS``, by name: the keys existing stores
        hold, so they still resume.
    """
    prompt_set = as_prompt_set(prompts)
    return {
        "method": options.method,
        "model": model.name,
        "n_prompts": len(prompt_set),
        "prompts_sha256": fingerprint(prompt_set),
        "options": {
            name: value
            for name, value in sorted(dataclasses.asdict(options).items())
            if name not in SPEED_OPTIONS
        },
    }


def _check_same(path: Path, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    flat = {**{k: v for k, v in stored.items() if k != "options"}, **stored["options"]}
    asked = {**{k: v for k, v in wanted.items() if k != "options"}, **wanted["options"]}
    differ = [
        f"{key}: store {flat.get(key)!r}, now {asked.get(key)!r}"
        for key in sorted(set(flat) | set(asked))
        if flat.get(key) != asked.get(key)
    ]
    if differ:
        raise ValueError(
            f"The store '{path}' holds a different capture, so it cannot be resumed "
            f"({'; '.join(differ)}). Use the same arguments to resume, a new path, "
            "or overwrite=True to start over."
        )


def stream(
    path: str | Path,
    planner: Planner[R],
    model: LensModel,
    prompts: Prompts,
    options: CaptureOptions,
    *,
    client: Any = DEFAULTS.client,
    overwrite: bool = False,
    progress: bool = DEFAULTS.progress,
    batch_size_given: bool = True,
) -> R:
    """Run a planned method into the zarr store ``path``, batch by batch, resumably.

    Args:
        path: a ``.zarr`` path. New: created. Existing with the same settings: resumed.
        planner, options: the method and its checked options; the store's prompt chunks
            follow ``options.batch_size`` (None: the stored one when resuming).
        client: a ``dask.distributed.Client``: batches are scored on its workers.
        overwrite: replace an existing store instead of resuming it.
        batch_size_given: False: ``options.batch_size`` is only the default of a new store;
            a resumed store keeps its own (``capture_to`` called without ``batch_size``).

    Returns:
        The stored result (lazily loaded, dask-backed, when dask is installed).

    Raises:
        TypeError, ValueError: bad path (not ``.zarr``, missing folder, read-only), a store
            made with other settings, a model workers cannot load, the planner's errors.
        store.StoreError: another process is writing ``path``.
        RuntimeError: a dask worker failed; batches finished before it stay in the store.
    """
    if client is not None and model.recipe is None:
        raise ValueError(
            "Distributed capture needs a model that workers can load themselves: "
            "use lsc.load(...) (or models.tiny), or save this one with "
            "model.hf.save_pretrained(folder) and model.tokenizer.save_pretrained("
            "folder), then lsc.load(folder)."
        )
    path = store.check_writable(path)
    settings = settings_of(options, model, prompts)
    with store.writer_lock(path):
        return _stream_locked(
            path,
            planner,
            model,
            prompts,
            options,
            settings,
            client=client,
            overwrite=overwrite,
            progress=progress,
            batch_size_given=batch_size_given,
        )


def _stream_locked(
    path: Path,
    planner: Planner[R],
    model: LensModel,
    prompts: Prompts,
    options: CaptureOptions,
    settings: dict[str, Any],
    *,
    client: Any,
    overwrite: bool,
    progress: bool,
    batch_size_given: bool,
) -> R:
    """``stream`` once ``path`` is locked: resume or create the store, write the batches
    that are not done, and return the stored result."""
    resume = path.exists() and not overwrite
    done = None
    if resume:
        stored, done = store.progress(path)
        stored_batch = stored.pop("batch_size")
        _check_same(path, stored, settings)
        if options.batch_size is None or not batch_size_given:
            options = dataclasses.replace(options, batch_size=stored_batch)
        elif options.batch_size != stored_batch:
            raise ValueError(
                f"The store '{path}' was written in batches of {stored_batch} "
                f"prompts; resume it with batch_size={stored_batch} (or None)."
            )
        store.remove_partial_files(path)
    plan = planner(model, prompts, options, progress=progress)
    settings["batch_size"] = plan.inputs.batch_size
    if not resume:
        n_prompts = len(plan.inputs.prompts)
        template = plan.finish(
            nan_values(n_prompts, plan.n_columns), not_yet_correct(n_prompts), None
        )
        store.create(template, path, chunk=plan.inputs.batch_size, settings=settings)
    todo = [
        number
        for number in range(plan.inputs.n_batches())
        if done is None or not done[batch_slice(plan, number)].all()
    ]
    if client is not None:
        # dask.distributed is optional (the "dask" extra): import it only when asked for.
        try:
            from .distributed import run_batches
        except ImportError as err:
            raise ValueError(
                "client= needs dask.distributed; install it with pip install 'lenscape[dask]'."
            ) from err
        data = PlanData.of(planner, options, plan)
        run_batches(client, data, plan, todo, path, progress=progress)
    else:
        with tqdm(
            total=len(todo) * plan.steps_per_batch,
            disable=not progress,
            desc=f"{plan.desc} -> {path.name}",
        ) as bar:
            for number in todo:
                write_batch(plan, number, path, bar.update)
    # The store holds what plan.finish returns: an R again.
    return cast(R, store.open_result(path, lazy=importlib.util.find_spec("dask") is not None))
