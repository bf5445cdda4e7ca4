"""Execution of a planned method: in memory, or into a zarr store batch by batch, resumably.

``execute`` is what ``registry.run`` calls for every per-prompt method. Without ``store=``
it scores every batch in memory. With ``store=`` it writes the layout of the whole result
to the store (coords, attrs, NaN data) with the settings that identify the run, plans the
method, then scores the prompt batches that are not done yet and writes each as soon as it
is scored. Memory holds one batch, never the whole result. A run killed at any moment is
resumed by running it again with the same arguments: finished batches are kept, unfinished
ones recomputed, so the final store equals an uninterrupted run's. A store made by another
method, model, prompt list or settings is refused.

One process writes a store at a time: ``execute`` holds ``store.writer_lock`` from before
it reads the store until the last batch is written, so a second writer fails at once with
a message naming the first. A killed run's lock is released by the operating system, so
running again resumes it.

With ``client=`` (a ``dask.distributed.Client``) batches are scored on the cluster's
workers instead (``distributed``), writing into the same store.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any, cast

import numpy as np
from tqdm.auto import tqdm

from .. import _validate
from .. import store as results
from ..models import LensModel
from .inputs import Tokens
from .options import DEFAULTS, Options
from .plan import (
    Call,
    Plan,
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
#: Characters of JSON above which an option is identified by its SHA-256 in a store.
LONG_OPTION = 200


def execute(
    planner: Planner[R],
    model: LensModel,
    tokens: Tokens,
    options: Options,
    *,
    store: str | Path | None = DEFAULTS.store,
    client: Any = DEFAULTS.client,
    overwrite: bool = False,
    progress: bool = DEFAULTS.progress,
    batch_size_given: bool = True,
    ignore: tuple[str, ...] = (),
) -> R:
    """Run a planned method in memory, or stream it to ``store`` (optionally on dask
    ``client``): ``planner(Call(model, tokens, options))`` says what to compute.

    Args:
        store: a ``.zarr`` path. New: created. Existing with the same settings: resumed.
        client: a ``dask.distributed.Client``: batches are scored on its workers.
        overwrite: replace an existing store instead of resuming it.
        batch_size_given: False: ``options.batch_size`` is only the default of a new store;
            a resumed store keeps its own (``capture_to`` called without ``batch_size``).
        ignore: options that do not change what the store holds (``Method.view_options``).

    Returns:
        The result; from a store, lazily loaded (dask-backed, when dask is installed).

    Raises:
        TypeError, ValueError: ``client`` without ``store``, a bad path (not ``.zarr``,
            missing folder, read-only), a store made with other settings, a model workers
            cannot load, the planner's errors.
        store.StoreError: another process is writing ``store``.
        RuntimeError: a dask worker failed; batches finished before it stay in the store.
    """
    progress = _validate.flag("progress", progress)
    if client is not None and store is None:
        raise ValueError(
            "client= distributes batches whose results land in one zarr store; "
            "pass store='results.zarr' too."
        )
    if store is None:
        return run_in_memory(planner(Call(model, tokens, options, progress)), progress=progress)
    if client is not None and model.recipe is None:
        raise ValueError(
            "Distributed capture needs a model that workers can load themselves: "
            "use lsc.load(...) (or models.tiny), or save this one with "
            "model.hf.save_pretrained(folder) and model.tokenizer.save_pretrained("
            "folder), then lsc.load(folder)."
        )
    path = results.check_writable(store)
    settings = settings_of(options, model, tokens, ignore=ignore)
    with results.writer_lock(path):
        resumed = _resumed(path, settings, options, overwrite=overwrite, given=batch_size_given)
        if resumed is not None:
            options, done = resumed
        plan = planner(Call(model, tokens, options, progress))
        todo = _todo(path, plan, settings, done=None if resumed is None else done)
        if client is not None:
            data = PlanData.of(planner, options, plan)
            _distributed(client, data, plan, todo, path, progress=progress)
        else:
            with tqdm(
                total=len(todo) * plan.steps_per_batch,
                disable=not progress,
                desc=f"{plan.desc} -> {path.name}",
            ) as bar:
                for number in todo:
                    write_batch(plan, number, path, bar.update)
    # The store holds what plan.finish returns: an R again.
    return cast(R, results.open_result(path, lazy=importlib.util.find_spec("dask") is not None))


def settings_of(
    options: Options, model: LensModel, tokens: Tokens, *, ignore: tuple[str, ...] = ()
) -> dict[str, Any]:
    """What identifies a run: a store is only resumed by a run with equal settings.

    Returns:
        ``{"method", "model", "layout", "weights_sha256", "dtype", "n_prompts",
        "prompts_sha256", "options"}``: the model by name, layout, weights (as the call
        reads them: ``LensModel.weights_fingerprint``) and dtype, so a model of the same
        name with other weights, or a cast copy, never resumes another's store; ``options``
        being every option of the method but ``SPEED_OPTIONS`` and ``ignore``, by name (an
        option whose JSON is long, such as a list of edges, by its SHA-256).
    """
    return {
        "method": options.method,
        "model": model.name,
        "layout": model.spec.fingerprint,
        "weights_sha256": model.weights_fingerprint,
        "dtype": str(model.dtype).removeprefix("torch."),
        "n_prompts": len(tokens),
        "prompts_sha256": tokens.fingerprint,
        "options": {
            name: _compact(value)
            for name, value in options.items
            if name not in SPEED_OPTIONS and name not in ignore
        },
    }


def _compact(value: Any) -> Any:
    """``value`` as JSON keeps it, or ``"sha256:..."`` of that JSON when it is long."""
    text = json.dumps(value, sort_keys=True, default=str)
    if len(text) <= LONG_OPTION:
        return json.loads(text)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


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


def _resumed(
    path: Path, settings: dict[str, Any], options: Options, *, overwrite: bool, given: bool
) -> tuple[Options, np.ndarray] | None:
    """The options to resume the store at ``path`` with (its batch size) and its (prompt,)
    done flags, or None when there is nothing to resume (no store, or ``overwrite``).

    Raises:
        ValueError: the store holds another capture, or was written in other batches.
    """
    if not path.exists() or overwrite:
        return None
    stored, done = results.progress(path)
    stored_batch = stored.pop("batch_size")
    _check_same(path, stored, settings)
    if options.batch_size is not None and given and options.batch_size != stored_batch:
        raise ValueError(
            f"The store '{path}' was written in batches of {stored_batch} "
            f"prompts; resume it with batch_size={stored_batch} (or None)."
        )
    results.remove_partial_files(path)
    return options.replace(batch_size=stored_batch), done


def _todo(
    path: Path, plan: Plan[Any], settings: dict[str, Any], *, done: np.ndarray | None
) -> list[int]:
    """The batches of ``plan`` not ``done`` (prompt flags of a resumed store); without
    ``done`` the store is created first (its layout: coords, attrs, NaN data)."""
    if done is None:
        n_prompts = len(plan.inputs.tokens)
        template = plan.finish(
            nan_values(n_prompts, plan.n_columns), not_yet_correct(n_prompts), None
        )
        settings = {**settings, "batch_size": plan.inputs.batch_size}
        results.create(template, path, chunk=plan.inputs.batch_size, settings=settings)
        return list(range(plan.inputs.n_batches()))
    return [
        number
        for number in range(plan.inputs.n_batches())
        if not done[batch_slice(plan, number)].all()
    ]


def _distributed(
    client: Any, data: PlanData[Any], plan: Plan[Any], todo: list[int], path: Path, *, progress
) -> None:
    """Score batches ``todo`` of ``plan`` on ``client``'s workers, into ``path``."""
    # dask.distributed is optional (the "dask" extra): import it only when asked for.
    try:
        from .distributed import run_batches
    except ImportError as err:
        raise ValueError(
            "client= needs dask.distributed; install it with pip install 'lenscape[dask]'."
        ) from err
    run_batches(client, data, plan, todo, path, progress=progress)
