"""What the patching methods hold in memory per batch: their footprints for the memory
plan (``sweep/memory``), registered with their methods."""

from __future__ import annotations

from ...models import LensModel
from ...sweep import memory
from ...sweep.options import Options
from .checks import ESTIMATORS, _check_estimator, check_rules
from .estimates import _at_both_ends
from .exact import _cache_width, _site_width


def _estimate_need(
    model: LensModel,
    work: memory.Work,
    level: str,
    points: int,
    error: bool = False,
    *,
    both_ends: bool = False,
) -> memory.Need:
    """What a gradient estimate of one batch holds: the clean pass's sites (and the input
    site with ``points`` > 1), then the graph of a pass with a backward and the sites'
    gradients (``both_ends``: the clean and corrupt rows in one stacked pass,
    ``_gradients_at_both_ends``), then float32 products over the sites
    (``_gradient_effects``; with ``error`` two more: the other end's gradient or the coarse
    rule's sum, and the error terms)."""
    tokens = work.rows * work.width
    width = _site_width(model, level) + (model.spec.d_model if points > 1 else 0)
    sites = tokens * width * memory.element_bytes(model.dtype)
    stacked = 2 if both_ends else 1
    backward = memory.Need(
        activations=memory.gradient_pass(model, stacked * work.rows, work.width),
        buffers=2 * stacked * sites,
    )
    products = memory.Need(buffers=2 * sites + (5 if error else 3) * tokens * width * 4)
    return memory.largest(backward, products)


def _sweep_need(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """What an exact sweep of one batch holds: the residual stream entering every block
    (kept by the unedited pass; by position, its keys and values too) and a pass of
    ``variants_per_pass`` stacked copies (by default one block's components, as many as
    memory allows)."""
    spec, e = model.spec, memory.element_bytes(model.dtype)
    # One block's components (in each position cell): a pass of a sparse sweep (refine)
    # packs as many rows.
    per_layer = {"head": spec.n_heads, "block": 2, "resid": 1}[options.get("level", "head")]
    wanted = per_layer * _cells_bound(options, work)
    copies = options.get("variants_per_pass") or memory.auto_variants_per_pass(
        model, rows=work.rows, width=work.width, wanted=wanted
    )
    resid = work.rows * work.width * spec.d_model * e
    stacked = memory.forward_pass(model, copies * work.rows, work.width)
    # By position: the unedited run's keys and values, and a pass's copy of their prefix
    # for its stacked rows.
    positional = _cells_bound(options, work) > 1
    cache = (1 + copies) * work.rows * work.width * _cache_width(model) * e if positional else 0
    return memory.Need(activations=stacked, buffers=(spec.n_layers + copies) * resid + cache)


def _cells_bound(options: Options, work: memory.Work) -> int:
    """At most how many position cells a component has: 1 for ``positions="all"``, else
    the tokens of the longest prompt (a span holds at least one token), or for "spans"
    the prompts' spans where the plan knows them."""
    positions = options.get("positions", "all")
    if positions == "spans" and work.n_spans is not None:
        return work.n_spans
    return 1 if positions == "all" else work.width


def _pattern_need(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """With ``part="pattern"``: the clean run's attention patterns of every block (batch,
    n_heads, pos, pos) and the corrupt run's values (``capture/patching/pattern``); else
    nothing."""
    if options.get("part", "out") != "pattern":
        return memory.Need()
    spec, e = model.spec, memory.element_bytes(model.dtype)
    patterns = spec.n_heads * work.width
    values = spec.n_kv_heads * spec.d_head
    return memory.Need(buffers=spec.n_layers * work.rows * work.width * (patterns + values) * e)


def _result_need(model: LensModel, level: str, work: memory.Work, cells: int = 1) -> memory.Need:
    """The (prompt, component[, cell]) float32 result of every prompt, held in memory."""
    spec = model.spec
    columns = {"head": spec.n_heads, "block": 2, "resid": 1, "all": spec.n_heads + 2}[level]
    return memory.Need(buffers=work.n_prompts * spec.n_layers * columns * cells * 4)


def ablation_memory(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """Footprint of ``ablation``: its exact sweep, or its ranking pass (``refine``) when
    that holds more. Options a call did not give are taken at their defaults."""
    level = options.get("level", "head")
    need = _sweep_need(model, options, work)
    if options.get("refine") is not None:
        auto = options.get("refine") == "auto"
        need = memory.largest(need, _estimate_need(model, work, level, 1, auto))
    return need + _result_need(model, level, work, _cells_bound(options, work))


def activation_patching_memory(
    model: LensModel, options: Options, work: memory.Work
) -> memory.Need:
    """Footprint of ``activation_patching``: its exact sweep with the clean run's sites
    kept, or its ranking pass (``refine``) when that holds more. Options a call did not give
    are taken at their defaults. (refine="auto" also keeps each batch's fixed passes for its
    second sweep, outside this footprint, in at most a quarter of the memory left:
    ``_FixedPasses``.)"""
    e, level = memory.element_bytes(model.dtype), options.get("level", "head")
    clean = work.rows * work.width * _site_width(model, level) * e
    need = _sweep_need(model, options, work) + memory.Need(buffers=clean)
    if options.get("refine") is not None:
        estimator = options.get("estimator", ESTIMATORS[0])
        points = _check_estimator(estimator, options.get("steps"))
        auto = options.get("refine") == "auto"
        stacked = _at_both_ends(points, check_rules(estimator, options.get("rules")), auto)
        estimate = _estimate_need(model, work, level, points, auto, both_ends=stacked)
        need = memory.largest(need, estimate)
    need = need + _pattern_need(model, options, work)
    return need + _result_need(model, level, work, _cells_bound(options, work))


def attribution_patching_memory(
    model: LensModel, options: Options, work: memory.Work
) -> memory.Need:
    """Footprint of ``attribution_patching``: one gradient estimate per batch (and the error
    estimates beside the result, with ``error``). Options a call did not give are taken at
    their defaults."""
    level = options.get("level", "head")
    estimator = options.get("estimator", ESTIMATORS[0])
    points = _check_estimator(estimator, options.get("steps"))
    error = bool(options.get("error", False))
    both = error or estimator == "trapezoid"
    stacked = _at_both_ends(points, check_rules(estimator, options.get("rules")), both)
    need = _estimate_need(model, work, level, points, both, both_ends=stacked)
    need = need + _pattern_need(model, options, work)
    need = need + _result_need(model, level, work, _cells_bound(options, work))
    return need + _result_need(model, level, work, _cells_bound(options, work)) if error else need
