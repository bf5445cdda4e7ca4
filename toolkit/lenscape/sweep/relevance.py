"""Relevance propagation rules for one backward pass, active only inside a ``with`` block.

Relevance patching (RelP; Jafari, Eberle, Khakzar and Nanda 2025, arXiv 2508.21258)
replaces attribution patching's local gradient by propagation coefficients: score =
(clean - corrupt activation) . c, where c is the gradient of the metric at the corrupt run
taken through a backward pass whose rules are changed module by module.
``relevance_rules(model)`` makes a plain ``torch.autograd`` backward through the model yield
c: every rule keeps the forward value bit for bit and reshapes only the gradient, so c has
the units and sign of attribution patching's gradient.

Two families of rules, per module type (``Rules`` picks one per type; ``RULE_SETS`` names
sets). The LRP rules are those of RelP and AttnLRP (Achtibat et al. 2024, arXiv
2402.05602), in the Gradient x Input form of the ``efficient`` rules of ``lxt`` 2.1, so x . c
is the relevance a rule gives its input x. The secant rules linearise each operation
between its activations in the corrupt run and in a *reference* run (the clean one, recorded
first inside ``Relevance.reference()``): each operation's coefficient is its average
derivative along the straight segment between the two, so along the whole corrupt -> clean
change the coefficients add up (as DeepLIFT's rescale rule, Shrikumar et al. 2017, with
the other run as reference; integrated gradients taken operation by operation). With
``Rules.reach`` below 1 (the set ``"secant-0.9"``) each segment ends part of the way to the
reference: patching one component moves the operations after it only part of their whole
change, and linearising over the start of it agrees better with exact patching (SmolLM2 and
Gemma-3 blocks, benchmarks/RESULTS.md); the coefficients then no longer add up to the whole
change, but within one MLP they split its change over the shortened segment exactly.

- **Norms**, RMSNorm and LayerNorm (every norm of the supported families: input,
  post-attention, final, QK-norms, Gemma's pre/post-feedforward norms): ``"held"`` holds
  the scale 1/rms(x) (a LayerNorm's 1/std(x)) constant (stop-gradient on the variance: the
  LN-rule of Ali et al. 2022 as RelP and lxt implement it), so the norm is linear in x and
  conserves relevance: a LayerNorm's centring x - mean(x) is linear and keeps its gradient,
  and its bias, a constant, takes its own share (x . c is the relevance of y - bias);
  ``"secant"`` averages the norm's Jacobian along the segment (4-point Gauss-Legendre). The
  module's own output stays in the graph (the gradient at the norm's input gets a
  correction term), so an activation kept at a norm's output (Gemma's attention and MLP
  sites) keeps its gradient.
- **MLP non-linearity** (SiLU, GELU, GELU-tanh, ReLU; of a gated MLP act(gate) or of a plain
  one act(up), as in GPT-2 and GPT-NeoX): ``"identity"``, the identity rule of AttnLRP (its
  Eq. 9; RelP's Identity-rule): relevance passes unchanged, the coefficient at the input is
  act(x) / x times the one at the output (sigmoid(x) for SiLU, Phi(x) for GELU, the step
  for ReLU); ``"secant"``: (act(x1) - act(x0)) / (x1 - x0), the derivative at the midpoint
  where the two are within ``SECANT_TOLERANCE``.
- **gate x up product** (separate gate and up projections, or one fused gate_up_proj whose
  output is [gate | up], Phi-3): ``"half"``, the uniform rule of AttnLRP (Eq. 7; RelP's
  Half-rule): each factor gets half of the product's relevance (the gradient into the
  product is halved); ``"secant"``: each factor's coefficient is the other factor's
  midpoint, which splits a change of the product exactly (a1 b1 - a0 b0 = b_mid da +
  a_mid db).
- **routed experts** (Qwen2-MoE, Qwen3-MoE, Mixtral: the block's output is sum_e w_e
  E_e(x) with w the router's top-k weights, plus a shared expert times its sigmoid gate):
  under ``"half"`` the routing weights and the shared expert's gate are held constant, as
  the AH-rule holds attention probabilities (no gradient reaches the router; all of a
  term's relevance goes to its expert), and each expert's act(gate) x up product gets the
  half rule (half of the gradient at the expert bank's output, which is linear in each
  product once the weights are held); the activation rule inside every expert; a shared
  expert is a gated MLP. Refused under the secant rules (``check_covered``): top-k routing
  is discontinuous between two runs that choose different experts.
- **attention**: ``"ah"`` holds the attention probabilities constant (the AH-rule of Ali et
  al. 2022, CP-LRP in lxt: no gradient into queries and keys); ``"uniform"`` is AttnLRP's
  uniform rule on QK^T and on probabilities x V (lxt 2.1 ``efficient/patches.py``: gradients
  into queries and keys divided by 4, into values by 2); ``"secant"`` splits QK^T and
  probabilities x V at their midpoints and averages the softmax's Jacobian along the
  segment between the two runs' scores (4-point Gauss-Legendre; AtP* (Kramar et al. 2024)
  fixes the same saturation of the softmax by recomputing it); ``"gradient"`` leaves
  attention as it is (RelP's released default). Soft-capped scores c tanh(s / c) (Gemma 2)
  follow the identity rule under ``"uniform"`` (the ratio c tanh(s / c) / s held) and their
  secant between the two runs' scores under ``"secant"``.

Linear layers, the embedding, rotary embeddings and residual additions keep their gradient
(LRP's 0-rule is Gradient x Input on a linear map; a linear map is its own secant); biases
are constants, which take their own share of relevance.

Supported: every model whose ``Computation`` (``lenscape.models.layouts``) the rules cover:
RMSNorms (any offset, wherever they sit: input norms, post-norms, QK-norms per head or over
the whole projection) or LayerNorms, a gated MLP (separate or fused gate and up
projections) or a plain one, routed experts (not under the secant rules), softmax
attention with or without logit soft-capping (Llama, Mistral, Qwen 2 and 3, Gemma 2 and 3,
OLMo 2, GPT-2, GPT-NeoX, Phi-3, Qwen2-MoE, Qwen3-MoE, Mixtral). Gemma 2's final logit
soft-capping belongs to the metric, whose own gradient the backward starts from. Rules act
on modules, so the residual topology (GPT-NeoX's parallel blocks) and fused q/k/v
projections do not matter to them. On direct calls of ``model.hf`` and the nnsight backend
(module hooks, and an attention function registered with transformers'
``AttentionInterface`` around the model's own) and on the TransformerLens backend for
RMSNorm models with separate gated MLPs and uncapped attention (its bridge computes norms
and attention in its own code: hooks on its norm modules and attention hook points; it
calls the copied HF MLP modules, hooked as on ``model.hf``); the rest is refused before
any pass with the reason (``check_covered``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import transformers
from torch.utils.hooks import RemovableHandle

from ..models import LensModel
from .backend import TransformerLensBackend, get_backend

NORM_RULES = ("held", "secant", "gradient")
ACTIVATION_RULES = ("identity", "secant", "gradient")
PRODUCT_RULES = ("half", "secant", "gradient")
ATTENTION_RULES = ("ah", "uniform", "secant", "gradient")
#: Below this |x1 - x0| the activation's secant is its derivative at the midpoint.
SECANT_TOLERANCE = 1e-3
#: Prefix of the attention implementations registered with transformers (one per base).
_ATTENTION_NAME = "lenscape_relevance"
#: Where the secant rules average a Jacobian along a segment: 4-point Gauss-Legendre nodes
#: and weights on [0, 1] (exact for polynomials of degree 7).
_NODES = tuple(
    (1 + x) / 2
    for x in (-0.8611363115940526, -0.3399810435848563, 0.3399810435848563, 0.8611363115940526)
)
_WEIGHTS = (0.1739274225687269, 0.3260725774312731, 0.3260725774312731, 0.1739274225687269)


@dataclass(frozen=True)
class Rules:
    """Which rule each kind of module follows in the backward pass (module docstring).

    Attributes:
        norm: one of ``NORM_RULES``.
        activation: one of ``ACTIVATION_RULES``.
        product: one of ``PRODUCT_RULES`` (also the routing weights' rule in a routed
            block: "half" holds them).
        attention: one of ``ATTENTION_RULES``.
        reach: how much of each operation's corrupt -> reference change the secant rules
            linearise over, in (0, 1]: the segment from the operation's input in this pass
            to that input moved ``reach`` of the way to the reference's (the operation's
            output evaluated there). 1: the whole change, whose coefficients add up to it;
            below 1, the start of it, where a single patched component moves the
            operations after it (a patch moves them only part of the way).
    """

    norm: str = "held"
    activation: str = "identity"
    product: str = "half"
    attention: str = "gradient"
    reach: float = 1.0

    def __post_init__(self) -> None:
        for kind, allowed in (
            ("norm", NORM_RULES),
            ("activation", ACTIVATION_RULES),
            ("product", PRODUCT_RULES),
            ("attention", ATTENTION_RULES),
        ):
            if getattr(self, kind) not in allowed:
                raise ValueError(
                    f"Unknown {kind} rule {getattr(self, kind)!r}; choose one of {list(allowed)}."
                )
        reach = self.reach
        if isinstance(reach, bool) or not isinstance(reach, (int, float)) or not 0 < reach <= 1:
            raise ValueError(f"reach must be a number in (0, 1], got {reach!r}; e.g. 0.9.")
        if reach != 1 and not self.needs_reference:
            raise ValueError(
                f"reach={reach!r} shortens the secant rules' segment, and these rules have "
                "none; use a secant rule (e.g. norm='secant') or leave reach at 1."
            )

    @property
    def needs_reference(self) -> bool:
        """Whether a rule linearises towards a reference run (a secant rule)."""
        return "secant" in (self.norm, self.activation, self.product, self.attention)


#: Named rule sets: ``"relp"``, the rules of RelP's released code (LN-, identity and half
#: rules, attention's own gradient); ``"relp-ah"`` adds the AH-rule; ``"attnlrp"`` is lxt's
#: AttnLRP (uniform rule in attention); ``"ah"`` is the AH-rule alone; ``"secant"`` is every
#: secant rule (a reference pass first); ``"secant-0.9"`` the same over the first 90% of
#: each operation's change (``Rules.reach``), which agrees better with exact patching of
#: single components (benchmarks/RESULTS.md, sections faithfulness and MLP-block estimator).
RULE_SETS: dict[str, Rules] = {
    "relp": Rules(),
    "relp-ah": Rules(attention="ah"),
    "attnlrp": Rules(attention="uniform"),
    "ah": Rules(norm="gradient", activation="gradient", product="gradient", attention="ah"),
    "secant": Rules(norm="secant", activation="secant", product="secant", attention="secant"),
    "secant-0.9": Rules(
        norm="secant", activation="secant", product="secant", attention="secant", reach=0.9
    ),
}


# ----------------------------------------------------------------- gradient-only operations


class _ScaledGradient(torch.autograd.Function):
    """Forward: ``x`` unchanged. Backward: the gradient times ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _Rerouted(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: the gradient goes to ``x`` times ``slope``
    (and none through ``out``'s own graph): ``out`` = slope * x as far as gradients go."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slope)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (slope,) = ctx.saved_tensors
        return None, (grad * slope).to(grad.dtype), None


class _Product(torch.autograd.Function):
    """Forward: ``h`` = a * b unchanged. Backward: ``a`` gets the gradient times
    ``b_coefficient``, ``b`` times ``a_coefficient`` (none through ``h``'s own graph)."""

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        a_coefficient: torch.Tensor,
        b_coefficient: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(a_coefficient, b_coefficient)
        return h.view_as(h)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[None, torch.Tensor, torch.Tensor, None, None]:
        a_coefficient, b_coefficient = ctx.saved_tensors
        return None, grad * b_coefficient, grad * a_coefficient, None, None


class _Norm:
    """One norm module's formula as the rules compute it, in ``_wide`` precision:
    y = gain * c(x) * s(x) + bias, with c the centring x - mean(x) of a LayerNorm (the
    identity for an RMSNorm), s = 1 / sqrt(mean(c(x)^2) + eps) and gain = offset + weight.

    Raises:
        ValueError: the module has no weight and epsilon.
    """

    def __init__(self, module: torch.nn.Module, *, centred: bool, offset: float = 0.0):
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        weight = getattr(module, "weight", None)
        if eps is None or not isinstance(weight, torch.Tensor):
            kind = "a LayerNorm" if centred else "an RMSNorm"
            raise ValueError(f"{type(module).__name__} is not {kind} with a weight and an epsilon.")
        self.module, self.centred, self.eps, self.offset = module, centred, float(eps), offset
        self.weight = offset + weight.detach().to(_wide(weight.dtype))
        bias = getattr(module, "bias", None)
        self.bias = None if bias is None else bias.detach().to(self.weight.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def _centre(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True) if self.centred else x

    def _scale(self, centred: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The formula on x (..., d) (what ``check`` compares the module with)."""
        centred = self._centre(x)
        out = centred * self._scale(centred) * self.weight.to(x)
        return out if self.bias is None else out + self.bias.to(x)

    def check(self) -> None:
        """Refuse a module that does not compute the formula.

        Raises:
            ValueError: its output differs from the formula's on a random input.
        """
        _check_formula(
            "LayerNorm" if self.centred else "RMSNorm", self.module, self, variant=self.offset
        )

    def vjp(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """J(x)^T grad, in ``dtype``: with h = gain * grad centred like x (c(h)) and
        u = c(x), s (h - s^2 u mean(h u)); ``grad`` (..., d) may have leading dims ``x``
        broadcasts to."""
        centred = self._centre(x)
        scale = self._scale(centred)
        weighted = self._centre(grad * self.weight)
        inner = torch.linalg.vecdot(weighted, centred)[..., None]
        return weighted.mul_(scale).addcmul_(centred, scale**3 / x.shape[-1] * inner, value=-1)

    def segment_vjp(
        self,
        x: torch.Tensor,
        change: torch.Tensor,
        nodes: Sequence[float],
        weights: Sequence[float],
        grad: torch.Tensor,
    ) -> torch.Tensor:
        """sum_k weights[k] J(x + nodes[k] change)^T grad, the points' quantities computed
        stacked (one kernel per step for all points, not one per point): with h = c(gain *
        grad), u_k the centred points and s_k their scales, (sum_k w_k s_k) h -
        sum_k w_k s_k^3 mean(h u_k) u_k. ``grad`` (..., d) may have leading dims ``x``
        broadcasts to."""
        shape = (len(nodes), *[1] * grad.dim())
        t = torch.tensor(nodes, dtype=x.dtype, device=x.device).view(shape)
        w = torch.tensor(weights, dtype=x.dtype, device=x.device).view(shape)
        centred = self._centre(x + t * change)  # (points, [1...], ..., d)
        scale = self._scale(centred)
        h = self._centre(grad * self.weight)
        inner = torch.linalg.vecdot(h, centred)[..., None]  # (points, ..., 1)
        coefficients = w * scale**3 / x.shape[-1] * inner
        total = (w * scale).sum(0) * h
        for coefficient, point in zip(coefficients, centred, strict=True):
            total.sub_(coefficient * point)
        return total

    def rule(self, x: torch.Tensor, x1: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
        """The norm rule's input gradient: with ``x1`` None the scale held constant
        (s c(gain * grad): the centring and gain, linear, keep their gradient), else J
        averaged along the segment x -> x1 (Gauss-Legendre)."""
        if x1 is None:
            return self._centre(grad * self.weight) * self._scale(self._centre(x))
        return self.segment_vjp(x, x1 - x, _NODES, _WEIGHTS, grad)

    def correction(
        self, x: torch.Tensor, x1: torch.Tensor | None, grad: torch.Tensor
    ) -> torch.Tensor:
        """``rule`` less the true input gradient J(x)^T grad (the secant's in one stacked
        product: the point x with weight -1 beside the segment's)."""
        if x1 is None:
            return self.rule(x, None, grad) - self.vjp(x, grad)
        return self.segment_vjp(x, x1 - x, (*_NODES, 0.0), (*_WEIGHTS, -1.0), grad)


class _NormRule(torch.autograd.Function):
    """Forward: the norm's output ``y`` unchanged. Backward: ``y`` keeps its gradient g (so
    the norm's own backward runs) and its input ``x`` gets the correction that turns the
    norm's true gradient J(x)^T g into the rule's (``_Norm.rule``; ``x1`` the reference
    input of the secant rule, or None)."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, x: torch.Tensor, x1: torch.Tensor | None, norm: _Norm
    ) -> torch.Tensor:
        ctx.save_for_backward(x, x1)
        ctx.norm = norm
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, x1 = ctx.saved_tensors
        norm: _Norm = ctx.norm
        wide = x.to(norm.dtype)
        g = grad.to(norm.dtype)
        return grad, norm.correction(wide, x1, g).to(x.dtype), None, None


def _averaged_softmax_vjp(grad: torch.Tensor, p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
    """The softmax's Jacobian averaged along the segment of scores from this run's to the
    reference's (Gauss-Legendre), applied to ``grad``: sum_k w_k p_k (g - p_k . g), with
    p_k = softmax((1 - t_k) s0 + t_k s1), the normalised p0^(1 - t_k) p1^t_k, so the scores
    themselves (and the mask in them) are not needed. All (..., key) in ``p0``'s dtype.

    A probability 0 in one run only (underflow) counts as the smallest normal number; one
    0 in both runs (a masked key: causal or padding) stays 0 all along the segment, as it
    is. Clamped there too, it sent ~1e-38 to every masked key, and those subnormal numbers
    made every matrix product of the backward pass 3-5x slower on an Intel CPU
    (SmolLM2 heads, 16 pairs: 10.5 s -> 2.2 s)."""
    tiny = torch.finfo(p0.dtype).tiny
    masked = (p0 == 0) & (p1 == 0)
    log0, log1 = (p.clamp_min(tiny).log().masked_fill(masked, -math.inf) for p in (p0, p1))
    total = torch.zeros_like(grad)
    for t, weight in zip(_NODES, _WEIGHTS, strict=True):
        p = torch.softmax((1 - t) * log0 + t * log1, dim=-1)
        total = total + weight * p * (grad - (p * grad).sum(-1, keepdim=True))
    return total


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, kv_heads * groups, pos, d) -> (batch, kv_heads, pos, d): the gradient of
    ``_repeat_kv``."""
    return x if groups == 1 else x.unflatten(1, (-1, groups)).sum(2)


class _SecantAttention(torch.autograd.Function):
    """Forward: ``value``, the attention's own output ((batch, pos, heads, d) or (batch,
    pos, heads * d)), unchanged. Backward: what the secant attention rule sends to this
    pass's queries, keys and values (q (batch, heads, pos, d); k, v (batch, kv_heads, pos,
    d); q1, k1, v1 the reference pass's, same shapes). A change of the output splits
    exactly at the two runs' midpoints: out = P V_mid + p_half V, with p_half = (p0 + p1)
    / 2 and P = softmax(S), S = (q K_mid^T + q_mid K^T) * scaling (times the soft-cap's
    secant ``slope`` between the runs' scores, or None); P's Jacobian is averaged along
    the segment between the runs' scores (``_averaged_softmax_vjp``). p0, p1 (batch, heads,
    query, key) are the runs' probabilities, in the precision the gradients are taken in."""

    @staticmethod
    def forward(
        ctx: Any,
        value: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q1: torch.Tensor,
        k1: torch.Tensor,
        v1: torch.Tensor,
        p0: torch.Tensor,
        p1: torch.Tensor,
        slope: torch.Tensor | None,
        scaling: float,
        groups: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, q1, k1, v1, p0, p1, slope)
        ctx.scaling, ctx.groups = scaling, groups
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, q1, k1, v1, p0, p1, slope = ctx.saved_tensors
        groups, wide = ctx.groups, p0.dtype
        batch, heads, length, _ = q.shape
        g = grad.reshape(batch, length, heads, -1).transpose(1, 2).to(wide)

        def mid(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return ((a + b) / 2).to(wide)

        d_scores = _averaged_softmax_vjp(
            g @ _repeat_kv(mid(v, v1), groups).transpose(-1, -2), p0, p1
        )
        d_scores = d_scores * (ctx.scaling if slope is None else ctx.scaling * slope)
        dq = d_scores @ _repeat_kv(mid(k, k1), groups)
        dk = _sum_groups(d_scores.transpose(-1, -2) @ mid(q, q1), groups)
        dv = _sum_groups(((p0 + p1) / 2).transpose(-1, -2) @ g, groups)
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 8


# -------------------------------------------------------------- what the hooks of a block share


class Relevance:
    """What ``relevance_rules`` yields: the rules in force, and the reference pass that the
    secant rules linearise towards.

    Attributes:
        rules: the ``Rules`` in force.
    """

    def __init__(self, rules: Rules):
        self.rules = rules
        self._recording = False
        self._reference: dict[tuple[torch.nn.Module, str], torch.Tensor] = {}
        self._current: dict[tuple[torch.nn.Module, str], torch.Tensor] = {}

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Passes inside the block record the reference run (the clean prompts, over the
        same batch and positions as the passes after it); they follow no rule. A later
        reference pass replaces the earlier one."""
        self._recording = True
        self._reference = {}
        try:
            yield
        finally:
            self._recording = False

    def _record(self, module: torch.nn.Module, tag: str, value: torch.Tensor) -> None:
        """Keep ``value`` of ``module`` in the reference pass (detached)."""
        self._reference[(module, tag)] = value.detach()

    def _recorded(self, module: torch.nn.Module, tag: str, like: torch.Tensor) -> torch.Tensor:
        """The reference's value ``tag`` of ``module``, shaped to broadcast against this
        pass's ``like`` (a (batch, pos, d) reference gains a dim before d to meet a
        (batch, pos, n, d) ``like``: per-receiver copies of one input).

        Raises:
            RuntimeError: no reference pass was run (secant rules need one).
            ValueError: the reference pass had other shapes (another batch).
        """
        if (module, tag) not in self._reference:
            raise RuntimeError(
                "The secant rules linearise towards a reference run: run the clean prompts "
                "inside `with relevance.reference():` before the pass you differentiate."
            )
        value = self._reference[(module, tag)]
        while value.dim() < like.dim():
            value = value.unsqueeze(-2)
        # Broadcasts to ``like``'s shape (torch.broadcast_shapes costs more than the rule).
        fits = value.dim() == like.dim() and all(
            a in (1, b) for a, b in zip(value.shape, like.shape, strict=True)
        )
        if not fits:
            raise ValueError(
                f"The reference pass had shape {tuple(value.shape)} where this pass has "
                f"{tuple(like.shape)}: record the reference on the same batch of prompts."
            )
        return value

    def _toward(self, module: torch.nn.Module, tag: str, like: torch.Tensor) -> torch.Tensor:
        """Where an operation's secant segment ends for its input ``tag``: ``like`` (this
        pass's value of that input) moved ``rules.reach`` of the way to the reference's
        (``_recorded``; the reference itself at reach 1)."""
        value = self._recorded(module, tag, like)
        if self.rules.reach == 1:
            return value
        start = like.detach()
        return (start + self.rules.reach * (value - start)).to(value.dtype)

    def _keep(self, module: torch.nn.Module, tag: str, value: torch.Tensor) -> None:
        """Keep ``value`` of ``module`` in this pass, for a later hook of the same pass."""
        self._current[(module, tag)] = value

    def _kept(self, module: torch.nn.Module, tag: str) -> torch.Tensor:
        """A value ``_keep`` kept earlier in this pass."""
        return self._current[(module, tag)]


# ------------------------------------------------------------------- the rules on modules


def _activation_functions(act: torch.nn.Module) -> tuple[Callable, Callable]:
    """act(x) / x and act'(x) in closed form for the activations of the supported families.

    Raises:
        ValueError: an activation without a known closed form.
    """
    name = type(act).__name__
    approximate = getattr(act, "approximate", None)
    if name in ("SiLU", "SiLUActivation"):

        def silu_derivative(x: torch.Tensor) -> torch.Tensor:
            sigmoid = torch.sigmoid(x)
            return sigmoid * (1 + x * (1 - sigmoid))

        return torch.sigmoid, silu_derivative
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation") or (
        name == "GELU" and approximate == "tanh"
    ):
        k = math.sqrt(2.0 / math.pi)

        def tanh_ratio(x: torch.Tensor) -> torch.Tensor:
            return 0.5 * (1.0 + torch.tanh(k * (x + 0.044715 * x**3)))

        def tanh_derivative(x: torch.Tensor) -> torch.Tensor:
            t = torch.tanh(k * (x + 0.044715 * x**3))
            return 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * k * (1 + 3 * 0.044715 * x**2)

        return tanh_ratio, tanh_derivative
    if name in ("GELUActivation", "GELU"):

        def erf_ratio(x: torch.Tensor) -> torch.Tensor:
            return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

        def erf_derivative(x: torch.Tensor) -> torch.Tensor:
            return erf_ratio(x) + x * torch.exp(-0.5 * x**2) / math.sqrt(2.0 * math.pi)

        return erf_ratio, erf_derivative
    if name == "ReLU":

        def step(x: torch.Tensor) -> torch.Tensor:
            return (x > 0).to(x.dtype)

        return step, step
    raise ValueError(
        f"The relevance rules know no closed form for the MLP activation {name}; supported: "
        "SiLU, GELU, GELU-tanh and ReLU."
    )


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The precision a rule computes in: float32, or the model's own if wider (as HF norms)."""
    return torch.promote_types(dtype, torch.float32)


#: Modules that passed a formula check -> the checks they passed ((name, variant, class)
#: keys): a module's formula does not change with its weights, and a rules block checks
#: every module of the model, once per batch of a gradient estimate (0.13 s a block on
#: SmolLM2-135M, 0.014 s with the checks remembered).
_PASSED: weakref.WeakKeyDictionary[torch.nn.Module, set[tuple[str, Hashable, type]]] = (
    weakref.WeakKeyDictionary()
)


def _check_formula(
    name: str,
    module: torch.nn.Module,
    expected: Callable,
    *,
    width: int | None = None,
    variant: Hashable = None,
) -> None:
    """Refuse a module whose output is not what the rule's formula assumes; a module that
    passed the check ``(name, variant)`` once (as the same class) is not checked again.

    Args:
        width: the input's last dim (default: the last dim of the module's first
            parameter, or 8 without one).
        variant: what else ``expected`` depends on beyond ``name`` (a norm's gain offset).

    Raises:
        ValueError: ``module(x)`` differs from ``expected(x)`` on a random input.
    """
    passed, key = _PASSED.setdefault(module, set()), (name, variant, type(module))
    if key in passed:
        return
    weight = next(module.parameters(), None)
    like = weight if weight is not None else torch.empty(0)
    width = width or (weight.shape[-1] if weight is not None else 8)
    x = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(0)).to(like)
    tolerance = max(1e-3, 8 * torch.finfo(x.dtype).eps)
    with torch.no_grad():
        actual = type(module).forward(module, x).float()
        if not torch.allclose(actual, expected(x).float(), rtol=tolerance, atol=tolerance):
            raise ValueError(
                f"{name} ({type(module).__name__}) does not compute the formula the relevance "
                "rules assume; this model's family is not supported."
            )
    passed.add(key)


#: Norms ``norm_input_gradient`` has checked outside a block -> whether they compute an
#: RMSNorm ("rms"), a LayerNorm ("layer") or neither (None).
_NORM_KINDS: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def _check_activation(act: torch.nn.Module) -> None:
    """Refuse an activation whose closed forms (act(x) / x, act'(x)) do not match it."""
    ratio, derivative = _activation_functions(act)
    _check_formula("MLP activation", act, lambda x: x * ratio(x))
    step = 1e-3  # f(x) = f(x - h) + h f'(x - h / 2) up to h^3
    _check_formula(
        "MLP activation derivative",
        act,
        lambda x: type(act).forward(act, x - step) + step * derivative(x - step / 2),
    )


#: Attention modules under the rules -> (their attention rule, the base attention function,
#: the block's ``Relevance``).
_ACTIVE_ATTENTION: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, Callable, Relevance]] = (
    weakref.WeakKeyDictionary()
)
#: Norms of ``model.hf`` under a norm rule -> (their formula, the block's state).
_HELD_NORMS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[_Norm, Relevance]] = (
    weakref.WeakKeyDictionary()
)
#: Models inside a ``relevance_rules`` block (blocks do not nest).
_ACTIVE_MODELS: weakref.WeakSet[LensModel] = weakref.WeakSet()
#: Modules whose rule hooks are live; a deep copy made inside a block keeps the hooks but
#: not the membership, so the hooks do nothing on it.
_LIVE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


@dataclass
class _Installed:
    """What one ``relevance_rules`` block changed, to undo it."""

    handles: list[RemovableHandle] = field(default_factory=list)
    live: list[torch.nn.Module] = field(default_factory=list)
    attentions: list[torch.nn.Module] = field(default_factory=list)
    implementation: str | None = None  # the attention implementation to restore

    def hook(self, module: torch.nn.Module, hook: Callable, *, pre: bool = False) -> None:
        """Register ``hook`` on ``module`` (a forward pre-hook when ``pre``); mark it live."""
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        self.handles.append(register(hook))
        self.live.append(module)
        _LIVE.add(module)


def _norm_hook(norm: _Norm, state: Relevance) -> Callable:
    """The norm rule as a forward hook on a module computing ``norm`` (``norm.module``
    itself, or a TransformerLens bridge wrapping it); the secant reads the reference input
    recorded for ``norm.module``."""

    def hook(module, args, output):
        if module not in _LIVE:
            return None
        if state._recording:
            if state.rules.norm == "secant":
                state._record(norm.module, "x", args[0])
            return None
        if not output.requires_grad:
            return None
        x1 = _reference_input(norm, args[0], state)
        return _NormRule.apply(output, args[0], x1, norm)

    return hook


def _reference_input(norm: _Norm, x: torch.Tensor, state: Relevance) -> torch.Tensor | None:
    """The secant norm rule's reference input for ``norm`` shaped like ``x``, in the
    norm's precision; None under the held rule."""
    if state.rules.norm != "secant":
        return None
    return state._toward(norm.module, "x", like=x).to(norm.dtype)


def _norm_kind(norm: torch.nn.Module, offset: float) -> str | None:
    """Whether ``norm`` computes an RMSNorm with gain ``offset + weight`` ("rms"), a
    LayerNorm ("layer") or neither (None); checked once per module on a random input."""
    if norm not in _NORM_KINDS:
        _NORM_KINDS[norm] = None
        for kind in ("rms", "layer"):
            try:
                _Norm(norm, centred=kind == "layer", offset=offset).check()
            except ValueError:
                continue
            _NORM_KINDS[norm] = kind
            break
    return _NORM_KINDS[norm]


def norm_input_gradient(
    norm: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, *, offset: float = 0.0
) -> torch.Tensor:
    """The input gradient of the norm ``norm`` at ``x`` for a batch of output gradients,
    without autograd: J(x)^T grad, or inside a ``relevance_rules`` block holding ``norm``,
    its norm rule's. For code that takes many gradients through one norm, such as edge
    attribution's per-receiver q/k/v inputs (twice as fast as a batched vector-Jacobian
    product of the recomputed norm, measured on a Llama-3-8B shape).

    Args:
        norm: an RMSNorm ((offset + weight) times x / rms(x)) or a LayerNorm module.
        x: its input, (..., d).
        grad: gradients of its output, (n, ..., d) or (..., d).
        offset: an RMSNorm gain's offset the model's description gives (Gemma: 1); a rule
            in force on ``norm`` brings its own.

    Returns:
        (n, ..., d) gradients in the norm's wide precision (float32 for a half-precision
        model); for a norm that is neither formula (checked once on a random input), taken
        by autograd through its ``forward``, in ``x``'s dtype.
    """
    entry = _HELD_NORMS.get(norm)
    if entry is not None:
        formula, state = entry
        wide = x.detach().to(formula.dtype)
        return formula.rule(wide, _reference_input(formula, x, state), grad)
    kind = _norm_kind(norm, offset)
    if kind is None:  # another norm: a batched autograd product
        inputs = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = norm.forward(inputs)  # ``forward``: no hooks run
        batched = grad.dim() > x.dim()
        return torch.autograd.grad(out, inputs, grad, is_grads_batched=batched)[0]
    formula = _Norm(norm, centred=kind == "layer", offset=offset)
    return formula.vjp(x.detach().to(formula.dtype), grad)


def _secant_slope(
    x0: torch.Tensor,
    x1: torch.Tensor,
    out0: torch.Tensor,
    out1: torch.Tensor,
    derivative: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """An elementwise function's secant between this run's x0 -> out0 and the reference's
    x1 -> out1: (out1 - out0) / (x1 - x0), its derivative at the midpoint where the two
    are within ``SECANT_TOLERANCE``."""
    change = x1 - x0
    close = change.abs() <= SECANT_TOLERANCE
    secant = (out1 - out0) / torch.where(close, 1.0, change)
    return torch.where(close, derivative((x0 + x1) / 2), secant)


def _activation_hook(act: torch.nn.Module, state: Relevance) -> Callable:
    """The activation rule as a forward hook on an MLP's activation (it also keeps the
    output the product's secant rule needs)."""
    ratio, derivative = _activation_functions(act)
    rules = state.rules

    def hook(module, args, output):
        if module not in _LIVE:
            return None
        x = args[0]
        secant = "secant" in (rules.activation, rules.product)
        if state._recording:
            if secant:
                state._record(module, "x", x)
                state._record(module, "out", output)
            return None
        if not output.requires_grad:
            return None
        new = output
        if secant:  # the segment's end: the reference, or the activation part of the way
            x1 = state._toward(module, "x", like=x)
            if rules.reach == 1:
                out1 = state._recorded(module, "out", like=x)
            else:  # ``forward``: no hooks run
                out1 = module.forward(x1)
        if rules.activation == "identity":
            new = _Rerouted.apply(output, x, ratio(x.detach()))
        elif rules.activation == "secant":
            slope = _secant_slope(x.detach(), x1, output.detach(), out1, derivative)
            new = _Rerouted.apply(output, x, slope)
        if rules.product == "secant":
            state._keep(module, "out", new)
            state._keep(module, "end", out1)
        return new

    return hook


def _up_hook(state: Relevance) -> Callable:
    """Keeps the output of the projection that holds ``up`` for the product's secant rule."""

    def hook(module, args, output):
        if module not in _LIVE:
            return None
        if state._recording:
            state._record(module, "out", output)
        elif output.requires_grad:
            state._keep(module, "out", output)
        return None

    return hook


def _product_hook(mlp: _MlpParts, state: Relevance) -> Callable:
    """The product rule as a forward pre-hook on the down projection, whose input is
    act(gate) * up."""
    act, up = mlp.act, mlp.up
    assert up is not None

    def hook(module, args):
        if module not in _LIVE or state._recording or not args[0].requires_grad:
            return None
        if state.rules.product == "half":
            return (_ScaledGradient.apply(args[0], 0.5), *args[1:])
        a, whole = state._kept(act, "out"), state._kept(up, "out")
        b = whole[..., mlp.up_columns]
        a_mid = (a.detach() + state._kept(act, "end")) / 2
        b_mid = (b.detach() + state._toward(up, "out", like=whole)[..., mlp.up_columns]) / 2
        return (_Product.apply(args[0], a, b, a_mid, b_mid), *args[1:])

    return hook


#: Where an MLP keeps its activation module (Llama, GPT-2 and GPT-NeoX, Phi-3).
_ACTIVATIONS = ("act_fn", "act", "activation_fn")
#: The parts of a routed block the routing rules know: its router (``Computation.router``),
#: expert bank, shared expert and the shared expert's sigmoid gate.
_ROUTED_PARTS = ("experts", "shared_expert", "shared_expert_gate")


@dataclass(frozen=True)
class _MlpParts:
    """The modules of one MLP the rules hook: its activation; with a gate, the projection
    whose output holds ``up`` (its columns ``up_columns``: all, or the second half of a
    fused gate_up projection) and the down projection, whose input is act(gate) * up."""

    act: torch.nn.Module
    up: torch.nn.Module | None = None
    down: torch.nn.Module | None = None
    up_columns: slice = field(default_factory=lambda: slice(None))


def _mlp_parts(mlp: torch.nn.Module, d_model: int) -> _MlpParts:
    """Which MLP ``mlp`` is: gated, down(act(gate) * up), with separate gate_proj and
    up_proj or one gate_up_proj whose output is [gate | up] (Phi-3), or not gated,
    down(act(up(x))) (GPT-2, GPT-NeoX), checked against its own forward on a random input.

    Raises:
        ValueError: no activation module, an activation without closed forms, or a forward
            that is none of these.
    """
    act = next((getattr(mlp, n) for n in _ACTIVATIONS if hasattr(mlp, n)), None)
    if not isinstance(act, torch.nn.Module):
        raise ValueError(
            f"The MLP {type(mlp).__name__} has no activation module ({', '.join(_ACTIVATIONS)}) "
            "for the activation rule to hook."
        )
    _check_activation(act)
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return _MlpParts(act, mlp.get_submodule("up_proj"), mlp.get_submodule("down_proj"))
    if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
        fused, down = mlp.get_submodule("gate_up_proj"), mlp.get_submodule("down_proj")
        half = cast(torch.Tensor, fused.weight).shape[0] // 2

        def gated(x: torch.Tensor) -> torch.Tensor:
            both = fused(x)
            return down(act(both[..., :half]) * both[..., half:])

        _check_formula("gated MLP", mlp, gated, width=d_model)
        return _MlpParts(act, fused, down, slice(half, None))
    layers = [m for m in mlp.children() if next(m.parameters(), None) is not None]
    if len(layers) == 2:
        _check_formula("MLP", mlp, lambda x: layers[1](act(layers[0](x))), width=d_model)
        return _MlpParts(act)
    raise ValueError(
        f"The MLP {type(mlp).__name__} is neither down(act(gate) * up) (gate_proj, up_proj "
        "and down_proj, or a fused gate_up_proj) nor down(act(up(x))): no MLP rule covers it."
    )


def _install_mlp(mlp: _MlpParts, state: Relevance, installed: _Installed) -> None:
    """Hook the activation rule, and with a gate the product rule, into an MLP."""
    rules = state.rules
    gated = mlp.up is not None and mlp.down is not None
    if rules.activation != "gradient" or (gated and rules.product == "secant"):
        installed.hook(mlp.act, _activation_hook(mlp.act, state))
    if not gated:
        return
    assert mlp.up is not None and mlp.down is not None
    if rules.product == "secant":
        installed.hook(mlp.up, _up_hook(state))
    if rules.product != "gradient":
        installed.hook(mlp.down, _product_hook(mlp, state), pre=True)


def _routed_parts(
    block: torch.nn.Module, router: str, d_model: int
) -> tuple[torch.nn.Module, list[torch.nn.Module], torch.nn.Module, list[_MlpParts]]:
    """A routed block's parts: (its expert bank, the modules whose outputs are routing
    weights (the router and a shared expert's gate), the experts' activation, its shared
    experts' MLP parts).

    Raises:
        ValueError: a part the routing rules do not know, or an expert bank without an
            activation module of known closed forms.
    """
    unknown = [n for n, _ in block.named_children() if n not in (router, *_ROUTED_PARTS)]
    if unknown or not hasattr(block, "experts"):
        raise ValueError(
            f"The routed block {type(block).__name__} has parts the routing rules do not "
            f"know ({', '.join(unknown) or 'no experts'}); they know {router!r} (the "
            f"router) and {', '.join(_ROUTED_PARTS)}."
        )
    experts = block.get_submodule("experts")
    act = getattr(experts, "act_fn", None)
    if not isinstance(act, torch.nn.Module):
        raise ValueError(f"The experts {type(experts).__name__} have no act_fn module to hook.")
    _check_activation(act)
    weights = [block.get_submodule(router)]
    if hasattr(block, "shared_expert_gate"):
        weights.append(block.get_submodule("shared_expert_gate"))
    shared: list[_MlpParts] = []
    if hasattr(block, "shared_expert"):
        shared.append(_mlp_parts(block.get_submodule("shared_expert"), d_model))
    return experts, weights, act, shared


def _install_routed(
    block: torch.nn.Module, router: str, d_model: int, state: Relevance, installed: _Installed
) -> None:
    """Hook the routing rules into a routed block (the module docstring): under
    the half rule the routing weights are held (no gradient reaches the router or the shared
    expert's gate) and each expert's act(gate) * up product gets half of the gradient at
    the expert bank's output (the bank is linear in each product once the weights are
    held); the activation rule on the experts' activation; the shared experts as MLPs."""
    experts, weights, act, shared = _routed_parts(block, router, d_model)
    rules = state.rules
    if rules.product == "half":
        for module in weights:
            installed.hook(module, _detach_hook)
        installed.hook(experts, _scaled_hook(0.5))
    if rules.activation == "identity":
        installed.hook(act, _activation_hook(act, state))
    for mlp in shared:
        _install_mlp(mlp, state, installed)


# ----------------------------------------------------------------------------- attention


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, kv_heads, pos, d) -> (batch, kv_heads * groups, pos, d), each head repeated."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _additive_mask(mask: torch.Tensor | None, q_len: int, k_len: int, like: torch.Tensor):
    """An attention mask in additive form (0 or the dtype's minimum) from what the model's
    attention function got: additive already (eager), boolean (sdpa: True = attend) or None
    (sdpa's causal shortcut)."""
    if mask is None:
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=like.device)
        mask = causal.tril(k_len - q_len)
    if mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=like.dtype, device=like.device)
        return torch.where(mask, zero, torch.finfo(like.dtype).min)
    return mask[..., :k_len].to(like.dtype)


def _attention_rule_inputs(
    rule: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values as the AH or uniform rule lets gradients reach them."""
    if rule == "ah":  # Ali et al. 2022 AH-rule (lxt cp_wrap_attention_forward)
        return query.detach(), key.detach(), value
    if rule == "uniform":  # AttnLRP uniform rule (lxt 2.1 wrap_attention_forward: 4, 4, 2)
        return (
            _ScaledGradient.apply(query, 0.25),
            _ScaledGradient.apply(key, 0.25),
            _ScaledGradient.apply(value, 0.5),
        )
    return query, key, value


def _relevance_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    base: str,
    **kwargs: Any,
) -> Any:
    """The attention function ``base`` on the same values (so the same outputs), with the
    module's attention rule shaping the gradients into queries, keys and values; on a module
    not under the rules (a copy made inside a block) it is ``base`` itself. Soft-capped
    scores (``softcap``, c tanh(s / c) before the softmax) follow the identity rule under
    the uniform rule (the ratio tanh(s / c) c / s held) and their secant under the secant
    rule; the AH-rule sends nothing through them."""
    entry = _ACTIVE_ATTENTION.get(module)
    if entry is None:
        function = _base_attention(module, base)
        return function(module, query, key, value, attention_mask, *args, **kwargs)
    rule, function, state = entry
    if rule != "secant":
        query, key, value = _attention_rule_inputs(rule, query, key, value)
    output, weights = function(module, query, key, value, attention_mask, *args, **kwargs)
    softcap = kwargs.get("softcap") or None
    if rule == "secant" and state._recording:
        for tag, tensor in (("q", query), ("k", key), ("v", value)):
            state._record(module, tag, tensor)
    plain = rule in ("ah", "gradient") or (rule == "uniform" and softcap is None)
    if plain or state._recording or not any(t.requires_grad for t in (query, key, value)):
        return output, weights
    scaling = float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
    groups = query.shape[1] // key.shape[1]
    mask = _additive_mask(attention_mask, query.shape[-2], key.shape[-2], query)
    if rule == "uniform":
        assert softcap is not None  # uniform without a cap stays plain
        surrogate = _held_cap_attention(query, key, value, mask, scaling, groups, softcap)
        surrogate = surrogate.transpose(1, 2)
        return output.detach() + (surrogate - surrogate.detach()), weights
    q1, k1, v1 = (
        state._toward(module, tag, like=x)
        for tag, x in zip("qkv", (query, key, value), strict=True)
    )
    with torch.no_grad():
        s0, s1 = _scores(query, key, groups, scaling), _scores(q1, k1, groups, scaling)
        p0, p1 = _probabilities(s0, mask, softcap), _probabilities(s1, mask, softcap)
        slope = None if softcap is None else _cap_slope(s0, s1, softcap)
    secant = _SecantAttention.apply(
        output.detach(), query, key, value, q1, k1, v1, p0, p1, slope, scaling, groups
    )
    return secant, weights


def _scores(q: torch.Tensor, k: torch.Tensor, groups: int, scaling: float) -> torch.Tensor:
    """q k^T * scaling in float32: q (batch, heads, query, d), k (batch, kv_heads, key, d)
    -> (batch, heads, query, key)."""
    return (q @ _repeat_kv(k, groups).transpose(-1, -2)).float() * scaling


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Soft-capped scores c tanh(s / c) (``scores`` themselves without a cap)."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def _cap_slope(s0: torch.Tensor, s1: torch.Tensor, softcap: float) -> torch.Tensor:
    """The soft-cap's secant between this run's scores ``s0`` and the reference's ``s1``."""

    def derivative(s: torch.Tensor) -> torch.Tensor:
        return 1 - torch.tanh(s / softcap) ** 2

    return _secant_slope(s0, s1, _cap(s0, softcap), _cap(s1, softcap), derivative)


def _probabilities(scores: torch.Tensor, mask: torch.Tensor, softcap: float | None):
    """softmax(cap(scores) + mask) in float32 (batch, heads, query, key)."""
    return torch.softmax(_cap(scores, softcap) + mask.float(), dim=-1)


def _held_cap_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    groups: int,
    softcap: float,
) -> torch.Tensor:
    """An attention output whose gradient holds the soft-cap's ratio c tanh(s / c) / s (its
    value is the output's up to rounding: use its gradient only); q, k and v as the
    attention rule lets gradients reach them, (batch, heads or kv_heads, pos, d) ->
    (batch, heads, pos, d)."""
    scores = _scores(q, k, groups, scaling)
    with torch.no_grad():
        small = scores.abs() < 1e-6
        ratio = torch.where(small, 1.0, _cap(scores, softcap) / torch.where(small, 1.0, scores))
    probabilities = torch.softmax(scores * ratio + mask.float(), dim=-1).to(v.dtype)
    return probabilities @ _repeat_kv(v, groups)


def _attention_function(base: str) -> str:
    """Register (once) the attention implementation that is ``_relevance_attention`` over
    ``base``, with ``base``'s attention masks; return its name.

    Raises:
        ValueError: a ``base`` with no attention mask function to reuse.
    """
    from transformers.masking_utils import AttentionMaskInterface

    if base not in AttentionMaskInterface._global_mapping:
        raise ValueError(f"The attention rules cannot wrap attn_implementation={base!r}.")
    name = f"{_ATTENTION_NAME}_{base}"
    if name not in transformers.AttentionInterface._global_mapping:
        transformers.AttentionInterface.register(
            name, functools.partial(_relevance_attention, base=base)
        )
        mask = cast(Callable[..., Any], AttentionMaskInterface._global_mapping[base])
        AttentionMaskInterface.register(name, mask)
    return name


def _base_attention(module: torch.nn.Module, base: str) -> Callable:
    """The attention function ``base`` names for ``module``: its family's own eager
    function for "eager", else the registered one."""
    if base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return transformers.AttentionInterface._global_mapping[base]


# --------------------------------------------------------------------- installing the rules


def _install_hf(model: LensModel, state: Relevance, installed: _Installed) -> None:
    """Hook the rules into ``model.hf`` (its direct calls and nnsight passes)."""
    hf, spec, rules = model.hf, model.spec, state.rules
    c = spec.computation
    suffix = "LayerNorm" if c.norm == "layer" else "RMSNorm"
    norms = [
        _Norm(m, centred=c.norm == "layer", offset=c.norm_offset)
        for m in hf.modules()
        if type(m).__name__.endswith(suffix)
    ]
    blocks = [model.module(c.mlp, layer) for layer in range(spec.n_layers)]
    attention_path = spec.layout.o_proj.rsplit(".", 1)[0]
    attentions = [model.module(attention_path, layer) for layer in range(spec.n_layers)]
    for norm in norms:
        norm.check()
    routed = [b for b in blocks if c.router is not None and hasattr(b, "experts")]
    for block in routed:
        _routed_parts(block, c.router or "", spec.d_model)  # refuse before any hook
    mlps = [_mlp_parts(b, spec.d_model) for b in blocks if not any(b is r for r in routed)]
    if rules.norm != "gradient":
        for norm in norms:
            installed.hook(norm.module, _norm_hook(norm, state))
            _HELD_NORMS[norm.module] = (norm, state)
    for mlp in mlps:
        _install_mlp(mlp, state, installed)
    for block in routed:
        _install_routed(block, c.router or "", spec.d_model, state, installed)
    if rules.attention != "gradient":
        previous = hf.config._attn_implementation
        if not hf._can_set_attn_implementation():
            raise ValueError(f"{type(hf).__name__} cannot switch its attention function.")
        for attention in attentions:
            base = _base_attention(attention, previous)
            _ACTIVE_ATTENTION[attention] = (rules.attention, base, state)
            installed.attentions.append(attention)
        installed.implementation = previous
        hf.set_attn_implementation(_attention_function(previous))


def _install_bridge(
    bridge: torch.nn.Module, model: LensModel, state: Relevance, installed: _Installed
) -> None:
    """Hook the rules into a TransformerLens bridge's passes. The bridge computes norms and
    attention in its own code: the norm rule is a forward hook on each norm bridge (the
    same correction as on ``model.hf``; TransformerLens's own ``hook_scale`` would change the
    forward's rounding), the AH-rule detaches ``hook_pattern``, the uniform rule scales the
    gradients at the q, k and v projections' outputs (which reach attention through maps
    that are linear under the rules), and the secant rule rebuilds the heads' outputs at
    ``o.hook_in`` from the queries, keys, values and probabilities its hook points show. It
    calls the copied HF MLP modules, hooked as on ``model.hf``. Only the computations of
    ``_bridge_uncovered``'s complement (RMSNorms, separate gated MLPs, uncapped attention)."""
    rules, offset = state.rules, model.spec.computation.norm_offset
    if rules.norm != "gradient":
        for module in bridge.modules():
            norm = getattr(module, "original_component", None)
            if isinstance(norm, torch.nn.Module) and type(norm).__name__.endswith("RMSNorm"):
                installed.hook(module, _norm_hook(_Norm(norm, centred=False, offset=offset), state))
    for block in bridge.blocks:  # type: ignore[union-attr]
        attention = block.attn
        if rules.attention == "ah":
            installed.hook(attention.hook_pattern, _detach_hook)
        elif rules.attention == "uniform":
            for name, factor in (("q", 0.25), ("k", 0.25), ("v", 0.5)):
                installed.hook(attention.get_submodule(f"{name}.hook_out"), _scaled_hook(factor))
        elif rules.attention == "secant":
            _install_bridge_secant(attention, state, installed)
        mlp = _mlp_parts(block.mlp.original_component, model.spec.d_model)
        _install_mlp(mlp, state, installed)


def _moved_probabilities(
    q1: torch.Tensor,
    k1: torch.Tensor,
    p0: torch.Tensor,
    p1: torch.Tensor,
    groups: int,
    scaling: float,
) -> torch.Tensor:
    """The probabilities at the end of a shortened secant segment (``Rules.reach``), from
    its queries ``q1`` and keys ``k1``, where the pass gives no mask: a key is masked where
    both runs' probabilities ``p0`` and ``p1`` (batch, heads, query, key) are 0."""
    masked = (p0 == 0) & (p1 == 0)
    masked = masked & ~masked.all(-1, keepdim=True)  # a row with no key left stays as is
    scores = _scores(q1, k1, groups, scaling).masked_fill(masked, -math.inf)
    return torch.softmax(scores, dim=-1)


def _install_bridge_secant(attention: Any, state: Relevance, installed: _Installed) -> None:
    """The secant attention rule on a TransformerLens attention bridge: keep (or record)
    the rotated queries and keys, the values and the probabilities, and replace the heads'
    outputs at ``o.hook_in`` by a value-preserving surrogate carrying the rule's gradient."""
    hf_attention = attention.original_component
    d_head = hf_attention.head_dim
    groups = hf_attention.num_key_value_groups

    def keeper(tag: str) -> Callable:
        def hook(module, args, output):
            if module not in _LIVE:
                return None
            if state._recording:
                state._record(attention, tag, output)
            elif output.requires_grad or tag == "p":
                state._keep(attention, tag, output)
            return None

        return hook

    def values(v: torch.Tensor) -> torch.Tensor:  # (batch, pos, kv * d) -> (batch, kv, pos, d)
        return v.view(*v.shape[:2], -1, d_head).transpose(1, 2)

    def rebuild(module, args):
        z = args[0]
        if module not in _LIVE or state._recording or not z.requires_grad:
            return None
        q, k, v, p0 = (state._kept(attention, tag) for tag in ("q", "k", "v", "p"))
        q1, k1 = state._toward(attention, "q", like=q), state._toward(attention, "k", like=k)
        v1 = values(state._toward(attention, "v", like=v))
        # A TransformerLens pattern comes with its graph: it must carry none.
        p0, p1 = p0.detach().float(), state._recorded(attention, "p", like=p0).float()
        scaling = getattr(hf_attention, "scaling", d_head**-0.5)
        if state.rules.reach != 1:
            p1 = _moved_probabilities(q1, k1, p0, p1, groups, scaling)
        secant = _SecantAttention.apply(
            z.detach(), q, k, values(v), q1, k1, v1, p0, p1, None, scaling, groups
        )
        return (secant, *args[1:])

    for tag, point in (
        ("q", attention.hook_rot_q),
        ("k", attention.hook_rot_k),
        ("v", attention.get_submodule("v.hook_out")),
        ("p", attention.hook_pattern),
    ):
        installed.hook(point, keeper(tag))
    installed.hook(attention.get_submodule("o.hook_in"), rebuild, pre=True)


def _detach_hook(module, args, output):
    """A forward hook that passes no gradient back through ``module``'s output (a tensor, or
    each tensor of a tuple: a router's logits, weights and indices)."""
    if module not in _LIVE:
        return None
    if isinstance(output, tuple):
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in output)
    return output.detach()


def _scaled_hook(factor: float) -> Callable:
    """A forward hook that scales the gradient through ``module``'s output by ``factor``."""

    def hook(module, args, output):
        if module not in _LIVE or not output.requires_grad:
            return None
        return _ScaledGradient.apply(output, factor)

    return hook


def _uninstall(model: LensModel, installed: _Installed) -> None:
    """Undo what ``installed`` records (each step safe after a partial install)."""
    for handle in installed.handles:
        handle.remove()
    if installed.implementation is not None:
        model.hf.set_attn_implementation(installed.implementation)
    for attention in installed.attentions:
        _ACTIVE_ATTENTION.pop(attention, None)
    for module in installed.live:
        _LIVE.discard(module)
        _HELD_NORMS.pop(module, None)


@contextlib.contextmanager
def relevance_rules(
    model: LensModel, rules: str | Rules = "relp", *, backend: str = "nnsight"
) -> Iterator[Relevance]:
    """Within the block, a backward pass through ``model`` yields the rules' coefficients.

    Forward outputs are unchanged (every rule keeps values bit for bit); only gradients
    change. Passes of ``model.hf`` itself (direct calls, ``generate``, the nnsight backend)
    follow the rules; with ``backend="transformer_lens"`` the TransformerLens bridge's passes
    do too (it is booted first if need be). On leaving the block, even by an exception, the
    model is as it was (hooks removed, attention implementation restored).

    Usage (relevance patching: the corrupt run's coefficients times clean - corrupt)::

        with relevance_rules(model, "secant") as relevance:
            runner = get_backend(model, "nnsight")
            with relevance.reference():  # secant rules only: the clean run, recorded
                clean = runner.run(batch.clean, sites=sites)
            run = runner.run(batch.corrupt, sites=sites, grad=True)
            grads = torch.autograd.grad(metric(run.logits).sum(), [run.acts[s] for s in sites])

    Args:
        model: a model whose computation the rules cover (``check_covered``).
        rules: a name in ``RULE_SETS`` or a ``Rules``.
        backend: the backend whose passes must follow the rules as well as ``model.hf``'s:
            "nnsight" (which runs ``model.hf``) or "transformer_lens".

    Returns:
        A ``Relevance`` (yielded): the rules in force and the reference pass.

    Raises:
        ValueError: an unsupported family, an unknown rule set or backend, a module whose
            formula is not the one the rules assume, or a block already active on the model.
    """
    if isinstance(rules, str):
        if rules not in RULE_SETS:
            raise ValueError(f"Unknown rule set {rules!r}; choose one of {list(RULE_SETS)}.")
        rules = RULE_SETS[rules]
    if backend not in ("nnsight", TransformerLensBackend.name):
        raise ValueError(f"Unknown backend {backend!r}; choose 'nnsight' or 'transformer_lens'.")
    check_covered(model, rules, backend)
    if model in _ACTIVE_MODELS:
        raise ValueError(f"Relevance rules are already active on {model.name}; blocks do not nest.")
    bridge = None
    if backend == TransformerLensBackend.name:
        runner = get_backend(model, backend)  # booted before any hook exists
        assert isinstance(runner, TransformerLensBackend)
        bridge = runner.bridge
    state = Relevance(rules)
    installed = _Installed()
    _ACTIVE_MODELS.add(model)
    try:
        _install_hf(model, state, installed)
        if bridge is not None:
            _install_bridge(bridge, model, state, installed)
        yield state
    finally:
        _uninstall(model, installed)
        _ACTIVE_MODELS.discard(model)


def _uncovered(model: LensModel, rules: Rules, backend: str) -> list[str]:
    """What in ``model``'s computation no rule of ``rules`` covers on ``backend``, one
    sentence each (empty: none)."""
    c, reasons = model.spec.computation, []
    if c.n_experts and "secant" in (rules.activation, rules.product):
        reasons.append(
            f"each MLP sends a token to {c.experts_per_token} of {c.n_experts} experts chosen "
            "by the router's top-k: the secant rules would linearise the routing weights and "
            "each expert between the two runs, but top-k routing jumps where the runs choose "
            "different experts (no segment to average a Jacobian along) and an expert chosen "
            "in one run only has no output in the other (the held routing of the 'relp' rule "
            "sets covers it)"
        )
    if backend == TransformerLensBackend.name:
        bridge = [
            (c.norm == "layer", "LayerNorms"),
            (bool(c.attn_softcap), "soft-capped attention"),
            (bool(c.n_experts), "routed experts"),
            (not hasattr(model.module(c.mlp, 0), "up_proj"), "an MLP without up_proj"),
        ]
        found = [name for present, name in bridge if present]
        if found:
            reasons.append(
                f"on backend='transformer_lens' the rules hook the bridge's RMSNorms, "
                f"attention hook points and separate gate/up projections, not its "
                f"{', '.join(found)} (use backend='nnsight', which runs the model's own "
                "modules)"
            )
    return reasons


def check_covered(
    model: LensModel, rules: Rules = RULE_SETS["relp"], backend: str = "nnsight"
) -> None:
    """Refuse a model whose computation ``rules`` do not cover on ``backend``, with the
    reason, before any pass.

    Raises:
        ValueError: naming each part no rule covers and what to use instead.
    """
    reasons = _uncovered(model, rules, backend)
    if reasons:
        raise ValueError(
            f"Relevance rules cannot run on {model.name} ({model.spec.architecture}) here; it "
            "is not covered: "
            + "; ".join(reasons)
            + ". Use a gradient estimator instead (edges: 'eap' or 'eap-ig'; nodes: 'atp' "
            "or 'ig')."
        )


def unsupported(
    model: LensModel, rules: str | Rules = "relp", *, backend: str = "nnsight"
) -> str | None:
    """Why ``rules`` cannot run on ``model`` on ``backend`` (its family, or a module whose
    formula is not the one the rules assume), or None when they can: the rules are installed
    and removed again, no pass is run (the TransformerLens bridge is booted if need be)."""
    try:
        with relevance_rules(model, rules, backend=backend):
            return None
    except ValueError as err:
        return str(err)


@contextlib.contextmanager
def rules_or_plain(model: LensModel, rules: str | None, *, backend: str) -> Iterator[Any]:
    """``relevance_rules(model, rules)`` when ``rules`` names a rule set, else a block in
    which backward passes are plain gradients; yields what the block's passes need for their
    clean pass (``clean_pass``)."""
    if rules is None:
        yield None
        return
    with relevance_rules(model, rules, backend=backend) as relevance:
        yield relevance


def clean_pass(relevance: Relevance | None) -> contextlib.AbstractContextManager:
    """The block a gradient estimate runs its clean pass in: the reference pass of secant
    rules (which linearise towards it), or nothing."""
    if relevance is not None and relevance.rules.needs_reference:
        return relevance.reference()
    return contextlib.nullcontext()
