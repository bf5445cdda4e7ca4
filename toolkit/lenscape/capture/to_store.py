"""``capture_to``: a per-prompt method, passed or named, streamed into a zarr store.

``capture_to(path, lsc.ablation, model, prompts, level="block")`` is the same run as
``lsc.ablation(model, prompts, level="block", store=path)``: the options it is given are
completed from the public function's signature (``registry.Method.defaults``), then
``registry.run`` writes, resumes and (with ``client=``) distributes the batches. Every
method in ``registry.METHODS`` that can stream can be named.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..data import Prompts
from ..models import LensModel
from ..sweep.options import DEFAULTS
from ..sweep.plan import Result
from ..sweep.registry import METHODS, Method, run


def _method(method: Any) -> Method:
    name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
    streamable = sorted(n for n, spec in METHODS.items() if spec.planner and not spec.streams)
    if name not in streamable:
        raise ValueError(
            f"capture_to cannot stream {name!r}; it streams the per-prompt methods "
            f"{streamable} (pass the function or its name)."
        )
    return METHODS[name]


def capture_to(
    path: str | Path,
    method: Callable[..., Any] | str,
    model: LensModel,
    prompts: Prompts,
    *,
    client: Any = DEFAULTS.client,
    overwrite: bool = False,
    progress: bool = DEFAULTS.progress,
    **options: Any,
) -> Result:
    """Run a per-prompt capture method into a zarr store, batch by batch, resumably.

    Args:
        path: a ``.zarr`` path. New: created. Existing with the same settings: resumed.
        method: a streaming method (``lsc.ablation``, ``lsc.edge_attribution`` ...: every
            method of ``lenscape.sweep.registry.METHODS`` with a planner) or its name.
        model, prompts: as for the method.
        client: a ``dask.distributed.Client``: batches are scored on its workers (each
            loads the model once) and written to ``path`` from there.
        overwrite: replace an existing store instead of resuming it.
        progress: progress bar.
        **options: the method's options (``level``, ``metric``, ``batch_size`` ...). The
            store's prompt chunks follow ``batch_size``; resuming needs the same one (left
            out or None: the store's).

    Returns:
        What the method returns with ``store=path``.

    Raises:
        TypeError, ValueError: unknown method or option, bad path (not ``.zarr``, missing
            folder, read-only), a store made with other settings, or the method's own
            argument errors.
        store.StoreError: another process is writing ``path``.
        RuntimeError: a dask worker failed; batches finished before it stay in the store.
    """
    spec = _method(method)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ValueError(
            f"{spec.name} has no option(s) {unknown}; its options are {sorted(spec.options)}."
        )
    arguments = {"model": model, "prompts": prompts, **spec.defaults, **options}
    return run(
        spec.function,
        arguments,
        store=path,
        client=client,
        overwrite=overwrite,
        progress=progress,
        batch_size_given="batch_size" in options,
    )
