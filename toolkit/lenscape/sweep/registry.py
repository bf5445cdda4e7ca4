"""One table of the per-prompt methods, and ``run``: the one path every call takes.

A method is registered once, where it is written, by decorating its public function::

    @method(plan_ablation)
    def ablation(model, prompts, *, level=DEFAULTS.level, kind="zero", ...,
                 store=DEFAULTS.store, client=DEFAULTS.client, progress=DEFAULTS.progress):
        \"\"\"Exact ablation ... Args: its own options (``kind``); the shared ones
        (``DESCRIPTIONS``) are added to the docstring by the decorator.\"\"\"
        return run(ablation, locals())

The signature is the one statement of the method's options: ``run`` reads them from the
call (``locals()``), splits off where it runs (``RUN_ARGUMENTS``: ``store``, ``client``,
``overwrite``, ``progress``), checks the rest into ``Options``, tokenises the prompts once
(``inputs.tokenize``) and hands them to ``streaming.execute`` (in memory, into a resumable
zarr store, or on dask workers). ``METHODS`` is what the public API (``lenscape.capture``
exports every registered method), ``capture_to`` and the docs' method list are derived from.

A *composite* method (the faithfulness report, edge agreement) runs other registered methods
and combines them: it is registered with ``method(None)``, tokenises once and passes the
``Tokens`` to its parts, and with ``store=`` keeps each part in its own resumable store in
the folder ``store`` (``part_store``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from .. import _validate
from ..models import LensModel, in_one_call
from ..store import as_path
from . import memory
from .inputs import Tokens, plan_memory, tokenize
from .options import BATCHING, RUN_ARGUMENTS, Options, describe, signature
from .plan import Planner, Result
from .streaming import execute

#: A registered public function's type: ``method`` keeps it.
F = TypeVar("F", bound=Callable[..., Any])


def _no_view(result: Result, options: Options, prompts: Any) -> Any:
    return result


@dataclass(frozen=True)
class Method:
    """A registered per-prompt method.

    Attributes:
        name: its public name (the function's).
        function: the public function; its signature holds the options and their defaults.
        planner: turns tokens and options into a ``Plan``; None for a composite method.
        levels: the ``level`` values it takes (empty: it has no ``level`` option).
        needs_corrupt: whether it runs the corrupt prompts, or ``(options, prompts) ->
            bool`` saying so (``prompts`` as ``read_prompts`` made them).
        needs_target: whether every prompt needs a target token (the logit lens follows the
            model's own prediction where a prompt has none).
        read_prompts: ``(prompts, options) -> prompts`` before tokenising (e.g. one text ->
            a list of one prompt).
        view: ``(result, options, prompts) -> returned``: what the call returns made from
            the plan's per-prompt result (e.g. the mean over prompts).
        view_options: options that only change ``view``, not the result a store holds (a
            store is resumed whatever they are).
        streams: why the method cannot stream when it cannot (it then refuses ``store=``);
            empty when it can.
        store: what its ``store=`` holds, for the docs.
        public: exported by ``lenscape`` (False: a building block of other methods).
        memory: its footprint, ``(model, options, memory.Work) -> memory.Need``: what one
            batch holds beyond the weights, which picks ``batch_size=None`` and refuses a
            run that cannot fit (``inputs.batched``); ``lsc.estimate`` reports it.
        shared_defaults: the shared options whose default differs for this method
            (``method(defaults=)``).
        checks: ``(model, options) -> None``: the method's own checks of its options,
            against each other and the model (raising ``ValueError``/``TypeError``), run
            with the shared ones (``check``) before the prompts are tokenised; a composite
            method runs those of its parts (``check_part``) before its first part runs.
    """

    name: str
    function: Callable[..., Any]
    planner: Planner[Any] | None
    levels: tuple[str, ...] = ()
    needs_corrupt: bool | Callable[[Options, Any], bool] = False
    needs_target: bool = True
    read_prompts: Callable[[Any, Options], Any] = lambda prompts, options: prompts
    view: Callable[[Result, Options, Any], Any] = _no_view
    view_options: tuple[str, ...] = ()
    streams: str = ""
    store: str = "one .zarr store"
    public: bool = True
    memory: memory.Footprint = memory.one_gradient_pass
    checks: Callable[[LensModel, Options], None] | None = None
    shared_defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def options(self) -> list[str]:
        """The method's option names: its keyword-only parameters (the shared ones included)
        but ``RUN_ARGUMENTS``."""
        return [
            name
            for name, parameter in inspect.signature(self.function).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name not in RUN_ARGUMENTS
        ]

    @property
    def defaults(self) -> dict[str, Any]:
        """Option -> default, from the public signature."""
        parameters = inspect.signature(self.function).parameters
        return {name: parameters[name].default for name in self.options}


#: Public name -> method, in registration order.
METHODS: dict[str, Method] = {}


def method(
    planner: Planner[Any] | None,
    *,
    shared: Sequence[str] = BATCHING,
    defaults: Mapping[str, Any] | None = None,
    **settings: Any,
) -> Callable[[F], F]:
    """Register the decorated public function as a method (``Method`` fields ``settings``).

    ``defaults`` gives a shared option another default for this method, where the shared
    one would mean nothing there (causal tracing restores one position cell at a time:
    ``positions="each"``).

    The function declares its own options and takes the shared ones as ``**shared``; the
    registered function (a ``functools.wraps`` wrapper) has the whole signature
    (``options.signature``: its own options, then ``shared``, then ``store``, ``client``,
    ``progress``), binds each call to it (an unknown option is a ``TypeError``, a missing one
    gets its default) and has its docstring's ``Args:`` completed from ``DESCRIPTIONS``.
    """

    def register(function: F) -> F:
        name = function.__name__
        if name in METHODS and METHODS[name].function.__module__ != function.__module__:
            raise ValueError(f"Two methods are named {name!r}; give the new one another name.")
        full = signature(function, shared, defaults or {})

        @functools.wraps(function)
        @in_one_call  # the weights hashed once per call, parts of a report included
        def bound(*args: Any, **kwargs: Any) -> Any:
            call = full.bind(*args, **kwargs)
            call.apply_defaults()
            return function(*call.args, **call.kwargs)

        bound.__signature__ = full  # type: ignore[attr-defined]
        bound.__doc__ = describe(function.__doc__, full.parameters)
        spec = METHODS[name] = Method(
            name, bound, planner, shared_defaults=dict(defaults or {}), **settings
        )
        if planner is not None:
            memory.FOOTPRINTS[name] = spec.memory
            memory.ESTIMATES[name] = functools.partial(_estimate, spec)
        return cast(F, bound)

    return register


def run(function: Callable[..., Any], arguments: dict[str, Any], **place: Any) -> Any:
    """Run the registered method ``function`` with the arguments of one call.

    Args:
        function: the public function (registered with ``method``).
        arguments: its arguments by name (its ``locals()`` on entry): ``model``, ``prompts``,
            its options and any of ``RUN_ARGUMENTS``.
        place: more of ``RUN_ARGUMENTS`` (``capture_to``'s ``overwrite``) and
            ``batch_size_given`` (False: a resumed store keeps its own batch size).

    Returns:
        What the method's ``view`` makes of the result.

    Raises:
        TypeError, ValueError: bad options or prompts, before any model run or store write.
    """
    spec = METHODS[function.__name__]
    if spec.planner is None:
        raise TypeError(f"{spec.name} runs other methods: call it, not registry.run.")
    given = {**arguments, **arguments.get("shared", {})}
    given.pop("shared", None)
    model, prompts = given.pop("model"), given.pop("prompts")
    place = {name: given.pop(name) for name in RUN_ARGUMENTS if name in given} | place
    options = check(spec, model, given)
    if place.get("store") is not None and spec.streams:
        raise ValueError(f"{spec.name} cannot stream into a store: {spec.streams}")
    tokens = prepare(spec, model, spec.read_prompts(prompts, options), options)
    result = execute(spec.planner, model, tokens, options, ignore=spec.view_options, **place)
    return spec.view(result, options, prompts)


def _estimate(spec: Method, model: Any, prompts: Any, given: dict[str, Any]) -> memory.Estimate:
    """``lsc.estimate`` of the per-prompt method ``spec``: its options checked and its prompts
    tokenised as a call would, then its footprint planned (``inputs.plan_memory``); where
    the call would run (``RUN_ARGUMENTS``) is taken and does not change the plan.

    Raises:
        TypeError: an option ``spec`` does not take; as ``check`` and ``prepare``.
    """
    options = check_part(spec.function, model, **given)
    tokens = prepare(spec, model, spec.read_prompts(prompts, options), options)
    return plan_memory(model, tokens, options)


def check(spec: Method, model: Any, given: dict[str, Any]) -> Options:
    """The call's options, checked: the shared ones (``Options``) and ``level``.

    Raises:
        TypeError: ``model`` is not a ``LensModel``; ValueError: an unknown level.
    """
    if not isinstance(model, LensModel):
        raise TypeError(
            f"model must be a LensModel (from lsc.load), got {type(model).__name__}; "
            "e.g. model = lsc.load('smollm2-135m')."
        )
    options = Options.of(spec.name, given)
    if spec.levels:
        _validate.choice("level", options.level, spec.levels)
    if spec.checks is not None:
        spec.checks(model, options)
    return options


def check_part(function: Callable[..., Any], model: Any, **options: Any) -> Options:
    """The options of a call of the registered ``function`` checked as the call would check
    them (its defaults where not given; where it would run, ``RUN_ARGUMENTS``, is set
    aside): a composite checks every part this way before it runs the first.

    Raises:
        TypeError: an option ``function`` does not take; as ``check``.
    """
    spec = METHODS[function.__name__]
    unknown = sorted(set(options) - set(spec.options) - set(RUN_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"{spec.name} takes no option(s) {unknown}; its options are {spec.options}."
        )
    chosen = {name: value for name, value in options.items() if name not in RUN_ARGUMENTS}
    return check(spec, model, {**spec.defaults, **chosen})


def prepare(spec: Method, model: LensModel, prompts: Any, options: Options) -> Tokens:
    """The prompts of one call to ``spec``, tokenised (or the ``Tokens`` a composite
    method passes on, checked)."""
    return tokenize(
        model,
        prompts,
        needs_corrupt=spec.needs_corrupt(options, prompts)
        if callable(spec.needs_corrupt)
        else spec.needs_corrupt,
        needs_distractor=options.get("metric") == "logit_diff",
        needs_target=spec.needs_target,
    )


def part_store(store: str | Path | None, part: str) -> Path | None:
    """Where a composite method keeps its part ``part``: ``<store>/<part>.zarr``, the folder
    ``store`` made when missing; None without a store.

    Raises:
        ValueError: ``store`` is a file or its parent folder is missing.
    """
    if store is None:
        return None
    folder = as_path(store, argument="store")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"store={str(store)!r} is a file; give a folder for the report's parts.")
    if not folder.parent.is_dir():
        raise ValueError(
            f"The folder '{folder.parent}' for the store '{folder.name}' does not exist; "
            "create it first or choose another path."
        )
    folder.mkdir(exist_ok=True)
    return folder / f"{part}.zarr"


def listing(methods: Iterable[Method] | None = None) -> list[dict[str, str]]:
    """One row per registered method for the docs: name, module, levels, what ``store=``
    holds."""
    return [
        {
            "method": spec.name,
            "module": spec.function.__module__.removeprefix("lenscape."),
            "levels": ", ".join(spec.levels) or "-",
            "store=": "no: " + spec.streams if spec.streams else spec.store,
        }
        for spec in (METHODS.values() if methods is None else methods)
    ]
