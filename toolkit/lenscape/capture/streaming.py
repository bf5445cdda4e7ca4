"""Streaming capture: results go to a zarr store batch by batch, and interrupted runs resume.

``capture_to(path, method, model, prompts, ...)`` plans the method (``_plan``), writes the
layout of the whole result to ``path`` (coords, attrs, NaN data) with the settings that
identify the run, then scores the prompt batches that are not done yet and writes each
as soon as it is scored. Memory holds one batch, never the whole result. A run killed at
any moment is resumed by calling ``capture_to`` again with the same arguments: finished
batches are kept, unfinished ones recomputed, so the final store equals an uninterrupted
run's. A store made by another method, model, prompt list or settings is refused.

One process writes a store at a time: ``capture_to`` holds ``store.writer_lock`` from before
it reads the store until the last batch is written, so a second writer fails at once with
a message naming the first. A killed run's lock is released by the operating system, so
calling ``capture_to`` again resumes it.

With ``client=`` (a ``dask.distributed.Client``) batches are scored on the cluster's
workers instead (``distributed``), writing into the same store.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .. import store
from ._inputs import _as_prompt_set, fingerprint
from ._plan import PLANNERS, Plan, Result, check_options, make_plan, nan_values

#: Options that change how a run is cut up, not its numbers (batch_size is checked apart:
#: the store's prompt chunks follow it).
SPEED_OPTIONS = ("variants_per_pass", "batch_size")


def _method_name(method: Any) -> str:
    name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
    if name not in PLANNERS:
        raise ValueError(
            f"capture_to cannot stream {name!r}; it streams the per-prompt methods "
            f"{sorted(PLANNERS)} (pass the function or its name)."
        )
    return name


def settings_of(method: str, model, prompts, options: dict[str, Any]) -> dict[str, Any]:
    """What identifies a run (options completed with the method's defaults): a store is
    only resumed by a run with equal settings.

    Raises:
        ValueError: an option the method does not have.
    """
    params = inspect.signature(PLANNERS[method]).parameters
    known = {
        name: p.default
        for name, p in params.items()
        if p.kind is p.KEYWORD_ONLY and name != "progress"
    }
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{method} has no option(s) {unknown}; its options are {sorted(known)}.")
    prompt_set = _as_prompt_set(prompts)
    return {
        "method": method,
        "model": model.name,
        "n_prompts": len(prompt_set),
        "prompts_sha256": fingerprint(prompt_set),
        "options": {
            name: options.get(name, default)
            for name, default in sorted(known.items())
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


def batch_slice(plan: Plan, number: int) -> slice:
    size = plan.inputs.batch_size
    return slice(number * size, min((number + 1) * size, len(plan.inputs.prompts)))


def write_batch(plan: Plan, number: int, path: Path, step=lambda *_: None) -> None:
    """Score batch ``number`` of ``plan`` and write it (then its done flags) to ``path``."""
    batch = plan.inputs.batch(number)
    values = plan.score(batch, step)
    store.write_part(
        plan.finish(values, batch.index.tolist()), path, start=batch_slice(plan, number).start
    )


def capture_to(
    path: str | Path,
    method: Any,
    model,
    prompts,
    *,
    client=None,
    overwrite: bool = False,
    progress: bool = True,
    **options,
) -> Result:
    """Run a per-prompt capture method into a zarr store, batch by batch, resumably.

    Args:
        path: a ``.zarr`` path. New: created. Existing with the same settings: resumed.
        method: ``lsc.ablation``, ``lsc.activation_patching``, ``lsc.attribution_patching``,
            ``lsc.direct_logit_attribution`` or the name of one.
        model, prompts: as for the method.
        client: a ``dask.distributed.Client``: batches are scored on its workers (each
            loads the model once) and written to ``path`` from there.
        overwrite: replace an existing store instead of resuming it.
        progress: progress bar.
        **options: the method's options (``level``, ``metric``, ``batch_size`` ...). The
            store's prompt chunks follow ``batch_size``; resuming needs the same one.

    Returns:
        The stored result (lazily loaded, dask-backed, when dask is installed).

    Raises:
        TypeError, ValueError: unknown method, bad path (not ``.zarr``, missing folder,
            read-only), a store made with other settings, or the method's own argument errors.
        store.StoreError: another process is writing ``path``.
        RuntimeError: a dask worker failed; batches finished before it stay in the store.
    """
    name = _method_name(method)
    check_options(options)
    if client is not None and model.recipe is None:
        raise ValueError(
            "Distributed capture needs a model that workers can load themselves: "
            "use lsc.load(...) (or models.tiny), or save this one with "
            "model.hf.save_pretrained(folder) and model.tokenizer.save_pretrained("
            "folder), then lsc.load(folder)."
        )
    path = store.check_writable(path)
    settings = settings_of(name, model, prompts, options)
    with store.writer_lock(path):
        return _capture_locked(
            path,
            name,
            model,
            prompts,
            settings,
            client=client,
            overwrite=overwrite,
            progress=progress,
            options=options,
        )


def _capture_locked(
    path: Path,
    name: str,
    model,
    prompts,
    settings: dict[str, Any],
    *,
    client,
    overwrite: bool,
    progress: bool,
    options: dict[str, Any],
) -> Result:
    """``capture_to`` once ``path`` is locked: resume or create the store, write the batches
    that are not done, and return the stored result."""
    resume = path.exists() and not overwrite
    done = None
    if resume:
        stored, done = store.progress(path)
        stored_batch = stored.pop("batch_size")
        _check_same(path, stored, settings)
        if options.get("batch_size") is None:
            options["batch_size"] = stored_batch
        elif options["batch_size"] != stored_batch:
            raise ValueError(
                f"The store '{path}' was written in batches of {stored_batch} "
                f"prompts; resume it with batch_size={stored_batch} (or None)."
            )
        store.remove_partial_files(path)
    plan = make_plan(name, model, prompts, progress=progress, **options)
    settings["batch_size"] = plan.inputs.batch_size
    if not resume:
        template = plan.finish(nan_values(len(plan.inputs.prompts), plan.n_columns), None)
        store.create(template, path, chunk=plan.inputs.batch_size, settings=settings)
    todo = [
        number
        for number in range(plan.inputs.n_batches())
        if done is None or not done[batch_slice(plan, number)].all()
    ]
    if client is not None:
        try:
            from .distributed import run_batches
        except ImportError as err:
            raise ValueError(
                "client= needs dask.distributed; install it with pip install 'lenscape[dask]'."
            ) from err
        run_batches(client, plan, options, todo, path, progress=progress)
    else:
        with tqdm(
            total=len(todo) * plan.steps_per_batch,
            disable=not progress,
            desc=f"{plan.desc} -> {path.name}",
        ) as bar:
            for number in todo:
                write_batch(plan, number, path, bar.update)
    return store.open_result(path, lazy=importlib.util.find_spec("dask") is not None)
