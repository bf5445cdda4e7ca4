"""The estimator options of the patching methods, checked once before any pass:
``estimator``, ``steps`` and ``rules`` (one label such as ``"ig:8"`` or ``"relp:secant"``
parsed by ``parse_estimator``), the relevance rules against the model, and
``attribution_patching``'s ``error``."""

from __future__ import annotations

from collections.abc import Sequence

from ... import _validate
from ...models import LensModel
from ...sweep.backend import site_module
from ...sweep.options import DEFAULTS, MAX_STEPS, Options, integration_points
from ...sweep.relevance import RULE_SETS, unsupported

#: Gradient estimators of a patching effect; see the module docstring.
ESTIMATORS = ("atp", "ig", "relp", "trapezoid")
#: The estimators that integrate along the corrupt -> clean input path.
PATH_ESTIMATORS = ("ig",)
#: The rule set of ``estimator="relp"`` when ``rules`` is not given: RelP's released rules
#: (``sweep/relevance.RULE_SETS``). ``rules="secant-0.9"`` agrees best with exact patching
#: of MLP blocks at about "secant"'s cost (benchmarks/RESULTS.md, sections faithfulness and
#: MLP-block estimator).
DEFAULT_RULES = "relp"
#: Integration points of ``estimator="ig"`` when ``steps`` is not given. Measured on SmolLM2
#: (benchmarks/RESULTS.md, section faithfulness): 2 points raise MLP-block agreement with
#: exact patching most per unit of cost (Pearson r over cells 0.71 -> 0.90 on the factual set,
#: 0.59 -> 0.88 on IOI, for 1.4-1.7x AtP's time); 8 points reach 0.93 / 0.96 at 4-6x.
DEFAULT_IG_STEPS = 2


def _check_estimator(estimator: str, steps: int | None) -> int:
    """Validate ``estimator``/``steps``; return the number of integration points."""
    return integration_points(
        estimator, steps, estimators=ESTIMATORS, paths=PATH_ESTIMATORS, default=DEFAULT_IG_STEPS
    )


def parse_estimator(
    label: str, *, estimators: Sequence[str], paths: Sequence[str], default: int
) -> tuple[str, int, str | None]:
    """An estimator's label -> (estimator, steps, relevance rules): ``NAME`` or
    ``NAME:DETAIL``, DETAIL the integration points of a path estimator (``paths``; without
    it ``default``) or the rules of "relp" (without them ``DEFAULT_RULES``): ``"ig:16"`` ->
    ("ig", 16, None), ``"relp:secant"`` -> ("relp", 1, "secant"), ``"atp"`` -> ("atp", 1,
    None).

    Raises:
        ValueError: an unknown estimator or rule set, a DETAIL where none belongs, steps
            out of 1..``MAX_STEPS``.
    """
    name, _, detail = str(label).partition(":")
    fix = (
        f"use one of {list(estimators)}, '{paths[0]}:N' (N integration points) or "
        f"'relp:RULES' (RULES one of {list(RULE_SETS)})"
    )
    if name not in estimators or (detail and name not in (*paths, "relp")):
        raise ValueError(f"Unknown estimator {label!r}; {fix}.")
    if name == "relp":
        return name, 1, check_rules(name, detail or None)
    if detail and not detail.isdigit():
        raise ValueError(f"Unknown estimator {label!r}; {fix}.")
    steps = integration_points(
        name, int(detail) if detail else None, estimators=estimators, paths=paths, default=default
    )
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(
            f"Estimator {label!r}: steps={steps} must lie in 1..{MAX_STEPS} (each step is a "
            f"forward and a backward pass per batch), e.g. '{paths[0]}:8'."
        )
    return name, steps, None


def with_relevance(labels: Sequence[str], model: LensModel) -> list[str]:
    """``labels`` less the "relp" ones whose rules cannot run on ``model`` (its family, or
    modules of another formula): the default estimators of a report."""
    return [
        label
        for label in labels
        if not label.startswith("relp")
        or unsupported(model, label.partition(":")[2] or DEFAULT_RULES) is None
    ]


def check_rules(estimator: str, rules: str | None, *, relevance: str = "relp") -> str | None:
    """The relevance rule set an estimator runs under: ``rules`` (None: ``DEFAULT_RULES``)
    for the ``relevance`` estimator, None (plain gradients) for the others.

    Raises:
        ValueError: an unknown rule set, or ``rules`` with another estimator.
    """
    if estimator != relevance:
        if rules is not None:
            raise ValueError(
                f"rules={rules!r} chooses the relevance rules of estimator={relevance!r}; "
                f"estimator={estimator!r} takes plain gradients (leave rules=None)."
            )
        return None
    return _validate.choice("rules", DEFAULT_RULES if rules is None else rules, list(RULE_SETS))


def check_relevance(
    model: LensModel, rules: str | None, *, backend: str = DEFAULTS.backend
) -> None:
    """Refuse relevance ``rules`` on a model (and backend) they cannot run on, before any
    pass.

    Raises:
        ValueError: the family or one of its modules is not one the rules support.
    """
    why = None if rules is None else unsupported(model, rules, backend=backend)
    if why is not None:
        raise ValueError(
            f"estimator='relp' (rules={rules!r}) cannot run on {model.name}: {why} "
            "Use estimator='atp' or 'ig' on it."
        )


def check_estimate(model: LensModel, options: Options) -> None:
    """``attribution_patching``'s own options: ``estimator``, ``steps`` and ``rules``
    together, and the rules against the model (``Method.checks``)."""
    _check_estimator(options.estimator, options.steps)
    check_relevance(model, check_rules(options.estimator, options.rules), backend=options.backend)


#: What ``part`` takes: a head's output, query, key, value or attention pattern.
PARTS = ("out", "q", "k", "v", "pattern")


def check_part(model: LensModel, options: Options) -> None:
    """``part`` against ``level``, the model's family and, for "pattern", the estimate,
    before any pass.

    Raises:
        ValueError: an unknown part, a part but "out" at another level than "head", "q",
            "k", "v" or "pattern" on a family that fuses its projections, or "pattern"
            with an estimate other than plain AtP (``capture/patching/pattern`` says why).
    """
    part = options.get("part", "out")
    _validate.choice("part", part, PARTS)
    if part != "out" and options.level != "head":
        raise ValueError(
            f"part={part!r} is a part of a head: it takes level='head', not "
            f"level={options.level!r}."
        )
    if part != "out":
        site_module(model.spec.layout, ("v" if part == "pattern" else part, 0))  # fused: none
    if part == "pattern":
        _check_pattern_estimate(options)


def _check_pattern_estimate(options: Options) -> None:
    """The estimates ``part="pattern"`` takes: AtP at the corrupt run, without its error
    (the gradient with respect to a pattern is grad_z . V, and every other estimate reads
    it where the values differ from the corrupt run's)."""
    chosen = [
        f"{name}={options.get(name)!r}"
        for name, allowed in (("estimator", "atp"), ("error", False))
        if options.get(name, allowed) != allowed
    ]
    if options.get("refine") == "auto":
        chosen.append("refine='auto'")
    if chosen:
        raise ValueError(
            f"part='pattern' is estimated by plain AtP only, not with {', '.join(chosen)}: a "
            "pattern's gradient is the head's output gradient times the values, which the "
            "other estimates and the error estimate read away from the corrupt run. Use "
            "estimator='atp' without error (or refine=k), or lsc.activation_patching(..., "
            "part='pattern') for the exact effect."
        )


def check_positions(options: Options) -> None:
    """``positions`` against ``level`` (the choice itself is a shared option's check).

    Raises:
        ValueError: ``level="resid"`` with ``positions="all"``: patching the whole
            residual stream entering a block replays the clean run (every effect the same).
    """
    if options.get("level") == "resid" and options.get("positions", "all") == "all":
        raise ValueError(
            "level='resid' patches the residual stream entering each block; at every "
            "position at once that is the whole clean run from there on, the same effect "
            "at every layer. Pass positions='each' (a layer x position map) or "
            "positions='spans'."
        )


def _check_attribution(model: LensModel, options: Options) -> None:
    """``attribution_patching``'s own options: the estimate's (``check_estimate``),
    ``positions`` (``check_positions``) and ``error``, which takes one level (a Dataset of
    both would hold two ``error`` coords of different dims)."""
    check_estimate(model, options)
    check_positions(options)
    check_part(model, options)
    if _validate.flag("error", options.error) and options.level == "all":
        raise ValueError(
            "error=True takes level='head' or level='block' (the error coord has the "
            "scores' dims); call once per level for both."
        )
