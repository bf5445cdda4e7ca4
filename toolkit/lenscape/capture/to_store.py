"""``capture_to``: a per-prompt method, passed or named, streamed into a zarr store.

``capture_to(path, lsc.ablation, model, prompts, level="block")`` is the same run as
``lsc.ablation(model, prompts, level="block", store=path)``: the options it is given are
completed from the public function's signature (where the defaults live, see ``plan``),
then ``streaming.stream`` writes, resumes and (with ``client=``) distributes the batches.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, NamedTuple

from ..data import Prompts
from ..models import LensModel
from ..sweep.options import DEFAULTS, CaptureOptions
from ..sweep.plan import Planner, Result
from ..sweep.streaming import stream
from . import logit, patching


class Method(NamedTuple):
    """A per-prompt method as ``capture_to`` streams it."""

    function: Callable[..., Any]  # the public function; its signature holds the defaults
    options: type[CaptureOptions]
    planner: Planner[Any]


#: Public name -> method: what ``capture_to`` streams.
METHODS: dict[str, Method] = {
    method.function.__name__: method
    for method in [
        Method(patching.ablation, patching.AblationOptions, patching.plan_ablation),
        Method(
            patching.activation_patching,
            patching.ActivationPatchingOptions,
            patching.plan_activation_patching,
        ),
        Method(
            patching.attribution_patching,
            patching.AttributionPatchingOptions,
            patching.plan_attribution_patching,
        ),
        Method(
            logit.direct_logit_attribution,
            logit.DirectLogitAttributionOptions,
            logit.plan_direct_logit_attribution,
        ),
    ]
}


def _method_name(method: Any) -> str:
    name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
    if name not in METHODS:
        raise ValueError(
            f"capture_to cannot stream {name!r}; it streams the per-prompt methods "
            f"{sorted(METHODS)} (pass the function or its name)."
        )
    return name


def options_for(name: str, given: dict[str, Any]) -> CaptureOptions:
    """The options of method ``name``: ``given``, completed with the public function's defaults.

    Raises:
        ValueError: an option the method does not have (the message lists its options).
        TypeError, ValueError: a shared option out of range (``options.check_options``).
    """
    method = METHODS[name]
    known = [field.name for field in fields(method.options)]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"{name} has no option(s) {unknown}; its options are {sorted(known)}.")
    defaults = inspect.signature(method.function).parameters
    return method.options(
        **{option: given.get(option, defaults[option].default) for option in known}
    )


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
        method: ``lsc.ablation``, ``lsc.activation_patching``, ``lsc.attribution_patching``,
            ``lsc.direct_logit_attribution`` or the name of one.
        model, prompts: as for the method.
        client: a ``dask.distributed.Client``: batches are scored on its workers (each
            loads the model once) and written to ``path`` from there.
        overwrite: replace an existing store instead of resuming it.
        progress: progress bar.
        **options: the method's options (``level``, ``metric``, ``batch_size`` ...). The
            store's prompt chunks follow ``batch_size``; resuming needs the same one (left
            out or None: the store's).

    Returns:
        The stored result (lazily loaded, dask-backed, when dask is installed).

    Raises:
        TypeError, ValueError: unknown method or option, bad path (not ``.zarr``, missing
            folder, read-only), a store made with other settings, or the method's own
            argument errors.
        store.StoreError: another process is writing ``path``.
        RuntimeError: a dask worker failed; batches finished before it stay in the store.
    """
    name = _method_name(method)
    return stream(
        path,
        METHODS[name].planner,
        model,
        prompts,
        options_for(name, options),
        client=client,
        overwrite=overwrite,
        progress=progress,
        batch_size_given="batch_size" in options,
    )
