"""Distributed capture on dask.distributed: prompt batches scored on a cluster's workers.

``capture_to(..., client=client)`` (or ``lsc.ablation(..., store=path, client=client)``)
registers a worker plugin that loads the model once per worker, from the model's
``recipe`` (``lsc.load``'s arguments, or ``models.tiny``'s), sends the plan built on the
client, as data (``plan.PlanData``: options, prompts and pre-pass results, such as the
means of mean-ablation and the ranking of ``refine=k``), to every worker once, and submits
one task per prompt batch. Each worker rebuilds the plan from that data once per run,
without redoing the pre-pass. Each task scores its batch
and writes it into the zarr store itself, so results never travel back through the
scheduler, and the store opens as one DataArray when all are done. A failing task
cancels the rest, waits for the batches already running to end (so the store no longer
changes once the error reaches you) and raises on the client with the worker's message;
batches that finished stay in the store and a later call with the same arguments resumes.

Where it runs:

- one machine, CPUs: ``Client(LocalCluster(n_workers=4, threads_per_worker=1))``; dask
  starts each worker with one BLAS/OpenMP thread, so use about one worker per core;
- one machine, several GPUs: ``Client(dask_cuda.LocalCUDACluster())`` starts one worker
  per GPU, each seeing only its own GPU as ``cuda``; load the model with
  ``lsc.load(name, device="cuda")`` and every worker puts its copy on its own GPU;
- a cluster: ``Client("tcp://scheduler:8786")`` with workers started by ``dask worker``
  (one per GPU, ``--nthreads 1``); the store path must be on a filesystem every worker
  can write (the same path on each), and the model must load there (bundled models need
  ``lenscape install-models`` on each worker, a local folder must exist on each).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import uuid
from pathlib import Path
from typing import Any

import cloudpickle
from distributed import WorkerPlugin, as_completed
from tqdm.auto import tqdm

from ..models import LensModel
from .plan import Plan, PlanData, R, write_batch

#: Per worker process: recipe key -> (model, lock). The lock keeps one batch at a time on
#: a model even when a worker runs several threads.
_MODELS: dict[str, tuple[LensModel, threading.Lock]] = {}
#: Per worker process: the last plan built on each model, with the run it belongs to.
_PLANS: dict[str, tuple[str, Plan[Any]]] = {}
#: Per worker process: runs stopped after a failure; their batches no longer write.
_ABORTED: set[str] = set()


class ModelPlugin(WorkerPlugin):
    """Loads a model once on each worker (also on workers that join later)."""

    def __init__(self, key: str, recipe):
        self.key, self.recipe = key, recipe

    def setup(self, worker) -> None:
        if self.key not in _MODELS:
            _MODELS[self.key] = (self.recipe(), threading.Lock())


def _score_batch(key: str, run: str, data: PlanData[Any], number: int, path: str) -> int:
    """Task: score batch ``number`` of run ``run`` on this worker's model and write it to
    ``path``; the plan is built from ``data`` on the first batch of the run."""
    model, lock = _MODELS[key]
    with lock:
        if run in _ABORTED:
            return number
        if key not in _PLANS or _PLANS[key][0] != run:
            _PLANS[key] = (run, data.build(model))
        write_batch(_PLANS[key][1], number, Path(path))
    return number


async def _abort(key: str, run: str) -> None:
    """On a worker: stop run ``run`` and return once its batch in flight (if any) ended."""
    _ABORTED.add(run)
    if key in _MODELS:
        lock = _MODELS[key][1]
        await asyncio.to_thread(lock.acquire)  # off the event loop: heartbeats go on
        lock.release()


def run_batches(
    client: Any, data: PlanData[R], plan: Plan[R], todo: list[int], path: Path, *, progress: bool
) -> None:
    """Score batches ``todo`` of ``plan`` (whose data is ``data``) on ``client``'s workers,
    writing into ``path``.

    Raises:
        RuntimeError: a worker failed (its error message included); finished batches stay.
    """
    model = plan.inputs.model
    key = hashlib.sha256(cloudpickle.dumps(model.recipe)).hexdigest()[:16]
    client.register_plugin(ModelPlugin(key, model.recipe), name=f"lenscape-model-{key}")
    shipped = client.scatter(data, broadcast=True)
    run = uuid.uuid4().hex[:8]
    futures = [
        client.submit(
            _score_batch,
            key,
            run,
            shipped,
            number,
            str(path),
            key=f"lenscape-{data.options.method}-{run}-batch-{number}",
        )
        for number in todo
    ]
    with tqdm(
        total=len(futures),
        disable=not progress,
        desc=f"{plan.desc} on {len(client.scheduler_info()['workers'])} workers",
    ) as bar:
        for future in as_completed(futures):
            if future.status == "error":
                error = future.exception()
                client.cancel(futures)
                client.run(_abort, key, run)
                raise RuntimeError(
                    f"A dask worker failed on a batch of '{path.name}': "
                    f"{type(error).__name__}: {error} -- Batches finished before the failure "
                    f"stay in '{path}'; fix the cause and call again with the same arguments "
                    "to resume."
                ) from error
            bar.update()
