"""Causal attributions: exact ablation and activation patching, and attribution patching.

Exact methods change one component (a head's output before ``o_proj``, or an attention
or MLP block's contribution to the residual stream) and re-run the model:

- ``ablation``: replace it with zeros or its mean over the prompt set's real tokens, on
  the clean prompt; score = metric(ablated) - metric(clean).
- ``activation_patching``: run the corrupt prompt with the component's clean activation
  patched in (clean -> corrupt, "denoising"); score = metric(patched) - metric(corrupt).

Exact sweeps reuse the unedited run: it is run once per batch and keeps the residual
stream entering every block; a component of block ``l`` is then measured by running only
blocks ``l..L-1`` from that residual stream (about half the model on average). The
variants of one block are stacked in the batch dimension (``variants_per_pass`` copies of
the batch per pass, each copy editing one component), so one pass measures many components.

``attribution_patching`` estimates ``activation_patching`` from gradients, for every
component at once:

- ``estimator="atp"`` (attribution patching, first order): score = sum over positions of
  grad_corrupt(metric) . (clean - corrupt activation); 2 forward passes + 1 backward pass.
- ``estimator="ig"`` (integrated gradients along the input path, as in EAP-IG, Hanna et al.
  2024, arXiv 2403.17806): the gradient is averaged over ``steps`` points of the straight
  line from the corrupt to the clean residual stream entering block 0,
  x(a) = corrupt + a (clean - corrupt), a = k / steps for k = 0..steps-1 (left Riemann sum),
  score = sum_pos mean_k grad_x(a_k)(metric) . (clean - corrupt activation). ``steps=1`` is
  exactly ``"atp"``; each further step costs one forward + backward pass.

**Error estimates** (``attribution_patching(..., error=True)``: a coord ``error``, >= 0,
the scores' dims and units). Each estimate is a quadrature of the metric's gradient along
a path from the corrupt to the clean activation; its error is estimated from the same
quadrature's next term, never from exact patching:

- "atp" (and "ig" with 1 step): AtP is the left rule, one point. The trapezoid rule adds
  1/2 (g_clean - g_corrupt) . delta, with g_clean the gradient at the path's other end (the
  clean run), and is exact where the metric is quadratic in the activations; so
  error = |1/2 sum_pos (g_clean - g_corrupt) . (clean - corrupt activation)|, zero where
  the metric is linear in the component (its gradient is the same at both ends). Cost:
  one backward pass more (the clean pass keeps its graph).
- "ig" with n >= 2 points: the left rule's error halves with its step (Richardson), so
  the n-point rule's error is about |IG_n - IG_coarse|, IG_coarse the left rule on the
  even points a_0, a_2, ... of the same path (each weighted by the width it covers). Free.
- "relp": the trapezoid correction with both ends' coefficients under the rules (one
  backward pass more); for rules that linearise towards the clean run ("secant") both ends
  give the same coefficients, so there the error is |secant - atp|: exact patching of one
  component moves each operation only part of the corrupt -> clean segment, between the
  tangent at the corrupt end (AtP) and the whole segment's secant (one forward and one
  backward pass more).

The gradient at the clean run stands in for the gradient at the end of the one-component
path (the corrupt run with that component patched): the error estimate is a first-order
guess, not a bound. ``benchmarks/error_estimates.py`` measures how well it predicts the
error against exact patching.

``refine=k`` on the exact methods ranks every component with a gradient estimate and runs
the exact sweep on the k components whose prompt-mean estimate is largest in absolute
value; the others are NaN ("not computed"). ``refine="auto"`` estimates every cell and its
error, measures exactly the cells whose estimate could be wrong by more than ``tol``
(``auto_cells``), then, with those exact values in hand, the other cells of every component
whose membership of the ``top`` components is still in doubt (``ranking_cells``); the others
keep the estimate, and a coord ``measured`` says which is which. A pass stacks only the
prompts a component is measured on.

One module per job (the public methods thin, every sweep on one core):

- ``checks``: the estimator options (``parse_estimator``, ``check_rules`` ...);
- ``exact``: the exact sweep core (``_sweep_scorer``: resumed passes, stacked variants,
  packing, the fixed passes refine="auto"'s sweeps share);
- ``estimates``: the gradient estimates and their error estimates (``ERROR_METHODS``,
  ``with_error``);
- ``refine``: ``refine=k`` and ``refine="auto"`` (``auto_cells``, ``calibrated_margins``,
  ``ranking_cells``) and the plan of an exact sweep of chosen cells (``_exact_plan``);
- ``needs``: the memory footprints;
- ``ablation``, ``activation``, ``attribution``: the three public methods and their
  planners.
"""

from .ablation import ABLATION_KINDS, ablation, plan_ablation
from .activation import activation_patching, plan_activation_patching
from .attribution import attribution_patching, plan_attribution_patching
from .checks import (
    DEFAULT_IG_STEPS,
    DEFAULT_RULES,
    ESTIMATORS,
    PATH_ESTIMATORS,
    check_relevance,
    check_rules,
    parse_estimator,
    with_relevance,
)
from .estimates import ERROR_METHODS, error_method, with_error
from .refine import (
    AUTO_MARGIN,
    AUTO_TOL,
    AUTO_TOP,
    auto_cells,
    calibrated_margins,
    error_bounds,
    ranking_cells,
)

__all__ = [
    "ABLATION_KINDS",
    "AUTO_MARGIN",
    "AUTO_TOL",
    "AUTO_TOP",
    "DEFAULT_IG_STEPS",
    "DEFAULT_RULES",
    "ERROR_METHODS",
    "ESTIMATORS",
    "PATH_ESTIMATORS",
    "ablation",
    "activation_patching",
    "attribution_patching",
    "auto_cells",
    "calibrated_margins",
    "check_relevance",
    "check_rules",
    "error_bounds",
    "error_method",
    "parse_estimator",
    "plan_ablation",
    "plan_activation_patching",
    "plan_attribution_patching",
    "ranking_cells",
    "with_error",
    "with_relevance",
]
