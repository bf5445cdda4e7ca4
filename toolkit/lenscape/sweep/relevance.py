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
the other run as reference; integrated gradients taken operation by operation).

- **RMSNorm** (every norm of the supported families: input, post-attention, final, Qwen 3's
  and Gemma 3's q_norm/k_norm, Gemma's pre/post-feedforward norms): ``"held"`` holds the
  scale 1/rms(x) constant (stop-gradient on the variance: the LN-rule of Ali et al. 2022 as
  RelP and lxt implement it), so the norm is linear in x and conserves relevance;
  ``"secant"`` averages the norm's Jacobian along the segment (4-point Gauss-Legendre). The module's
  own output stays in the graph (the gradient at the norm's input gets a correction term),
  so an activation kept at a norm's output (Gemma's attention and MLP sites) keeps its
  gradient.
- **MLP non-linearity** (SiLU, GELU, GELU-tanh): ``"identity"``, the identity rule of
  AttnLRP (its Eq. 9; RelP's Identity-rule): relevance passes unchanged, the coefficient at
  the input is act(x) / x times the one at the output (sigmoid(x) for SiLU, Phi(x) for
  GELU); ``"secant"``: (act(x1) - act(x0)) / (x1 - x0), the derivative at the midpoint where
  the two are within ``SECANT_TOLERANCE``.
- **gate x up product**: ``"half"``, the uniform rule of AttnLRP (Eq. 7; RelP's Half-rule):
  each factor gets half of the product's relevance (the gradient into the product is
  halved); ``"secant"``: each factor's coefficient is the other factor's midpoint, which
  splits a change of the product exactly (a1 b1 - a0 b0 = b_mid da + a_mid db).
- **attention**: ``"ah"`` holds the attention probabilities constant (the AH-rule of Ali et
  al. 2022, CP-LRP in lxt: no gradient into queries and keys); ``"uniform"`` is AttnLRP's
  uniform rule on QK^T and on probabilities x V (lxt 2.1 ``efficient/patches.py``: gradients
  into queries and keys divided by 4, into values by 2); ``"secant"`` splits QK^T and
  probabilities x V at their midpoints and averages the softmax's Jacobian along the
  segment between the two runs' scores (4-point Gauss-Legendre; AtP* (Kramar et al. 2024) fixes the
  same saturation of the softmax by recomputing it); ``"gradient"`` leaves attention as it
  is (RelP's released default).

Linear layers, the embedding, rotary embeddings and residual additions keep their gradient
(LRP's 0-rule is Gradient x Input on a linear map; a linear map is its own secant).

Supported: every model whose ``Computation`` (``lenscape.models.layouts``) the rules cover:
RMSNorms (any offset, wherever they sit: input norms, post-norms, QK-norms per head or over
the whole projection), a gated MLP with separate gate, up and down projections, softmax
attention without logit soft-capping (Llama, Mistral, Qwen 2 and 3, Gemma 3, OLMo 2). The
rest is refused before any pass with the mathematical reason (``check_covered``):
LayerNorm's centring, attention soft-capping, routed experts, a fused or absent gate x up
product. Rules act on modules, so the residual topology and fused q/k/v projections do not
matter to them. On direct calls of ``model.hf``
and the nnsight backend (module hooks, and an attention function registered with
transformers' ``AttentionInterface`` around the model's own) and on the TransformerLens
backend (its bridge computes norms and attention in its own code: hooks on its norm
modules and attention hook points; it calls the copied HF MLP modules, hooked as on
``model.hf``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from collections.abc import Callable, Iterator
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
        product: one of ``PRODUCT_RULES``.
        attention: one of ``ATTENTION_RULES``.
    """

    norm: str = "held"
    activation: str = "identity"
    product: str = "half"
    attention: str = "gradient"

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

    @property
    def needs_reference(self) -> bool:
        """Whether a rule linearises towards a reference run (a secant rule)."""
        return "secant" in (self.norm, self.activation, self.product, self.attention)


#: Named rule sets: ``"relp"``, the rules of RelP's released code (LN-, identity and half
#: rules, attention's own gradient); ``"relp-ah"`` adds the AH-rule; ``"attnlrp"`` is lxt's
#: AttnLRP (uniform rule in attention); ``"ah"`` is the AH-rule alone; ``"secant"`` is every
#: secant rule (a reference pass first).
RULE_SETS: dict[str, Rules] = {
    "relp": Rules(),
    "relp-ah": Rules(attention="ah"),
    "attnlrp": Rules(attention="uniform"),
    "ah": Rules(norm="gradient", activation="gradient", product="gradient", attention="ah"),
    "secant": Rules(norm="secant", activation="secant", product="secant", attention="secant"),
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


def _rms_norm_vjp(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor):
    """J(x)^T grad for y = weight * x / rms(x): w r g - (r^3 / d) x sum_i(g_i w_i x_i), in
    ``weight``'s dtype; ``grad`` (..., d) may have leading dims ``x`` broadcasts to."""
    scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    weighted = grad * weight
    inner = torch.linalg.vecdot(weighted, x)[..., None]
    return weighted.mul_(scale).addcmul_(x, scale**3 / x.shape[-1] * inner, value=-1)


def _rule_vjp(
    x: torch.Tensor, x1: torch.Tensor | None, weight: torch.Tensor, eps: float, grad: torch.Tensor
) -> torch.Tensor:
    """The norm rule's input gradient: with ``x1`` None the scale held constant (w r g),
    else J averaged along the segment x -> x1 (Gauss-Legendre)."""
    if x1 is None:
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * grad * weight
    change = x1 - x
    return sum(
        w * _rms_norm_vjp(x + t * change, weight, eps, grad)
        for t, w in zip(_NODES, _WEIGHTS, strict=True)
    )


class _NormRule(torch.autograd.Function):
    """Forward: the RMSNorm output ``y`` unchanged. Backward: ``y`` keeps its gradient g (so
    the norm's own backward runs) and its input ``x`` gets the correction that turns the
    norm's true gradient J(x)^T g into the rule's: with ``x1`` None the scale held constant
    (w r g), else J averaged along the segment x -> x1 (Gauss-Legendre)."""

    @staticmethod
    def forward(
        ctx: Any,
        y: torch.Tensor,
        x: torch.Tensor,
        x1: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, x1, weight)
        ctx.eps = eps
        return y.view_as(y)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        x, x1, weight = ctx.saved_tensors
        wide = x.to(weight.dtype)
        g = grad.to(weight.dtype)
        true = _rms_norm_vjp(wide, weight, ctx.eps, g)
        rule = _rule_vjp(wide, x1, weight, ctx.eps, g)
        return grad, (rule - true).to(x.dtype), None, None, None


class _SecantSoftmax(torch.autograd.Function):
    """Forward: ``p0``. Backward: the softmax's Jacobian averaged along the segment of
    scores from this run's to the reference's (Gauss-Legendre): sum_k w_k p_k (g - p_k . g),
    with p_k = softmax((1 - t_k) s0 + t_k s1), the normalised p0^(1 - t_k) p1^t_k, so the
    scores themselves (and the mask in them) are not needed."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(p0, p1)
        return p0.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        p0, p1 = ctx.saved_tensors
        tiny = torch.finfo(p0.dtype).tiny
        log0, log1 = p0.clamp_min(tiny).log(), p1.clamp_min(tiny).log()
        total = torch.zeros_like(grad)
        for t, weight in zip(_NODES, _WEIGHTS, strict=True):
            p = torch.softmax((1 - t) * log0 + t * log1, dim=-1)
            total = total + weight * p * (grad - (p * grad).sum(-1, keepdim=True))
        return total, None, None


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
        try:
            fits = torch.broadcast_shapes(value.shape, like.shape) == like.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"The reference pass had shape {tuple(value.shape)} where this pass has "
                f"{tuple(like.shape)}: record the reference on the same batch of prompts."
            )
        return value

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
    raise ValueError(
        f"The relevance rules know no closed form for the MLP activation {name}; supported: "
        "SiLU, GELU and GELU-tanh."
    )


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The precision a rule computes in: float32, or the model's own if wider (as HF norms)."""
    return torch.promote_types(dtype, torch.float32)


def _norm_parameters(norm: torch.nn.Module, offset: float) -> tuple[float, torch.Tensor]:
    """An RMSNorm's epsilon and effective weight (offset + weight), in ``_wide`` precision."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor):
        raise ValueError(f"{type(norm).__name__} is not an RMSNorm with a weight and an epsilon.")
    return float(eps), offset + weight.detach().to(_wide(weight.dtype))


def _check_formula(name: str, module: torch.nn.Module, expected: Callable) -> None:
    """Refuse a module whose output is not what the rule's formula assumes.

    Raises:
        ValueError: ``module(x)`` differs from ``expected(x)`` on a random input.
    """
    weight = next(module.parameters(), None)
    like = weight if weight is not None else torch.empty(0)
    width = weight.shape[-1] if weight is not None else 8
    x = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(0)).to(like)
    tolerance = max(1e-3, 8 * torch.finfo(x.dtype).eps)
    with torch.no_grad():
        actual = type(module).forward(module, x).float()
        if not torch.allclose(actual, expected(x).float(), rtol=tolerance, atol=tolerance):
            raise ValueError(
                f"{name} ({type(module).__name__}) does not compute the formula the relevance "
                "rules assume; this model's family is not supported."
            )


def _check_rms_norm(norm: torch.nn.Module, offset: float) -> None:
    """Refuse a norm that does not compute (offset + weight) * x / rms(x).

    Raises:
        ValueError: it has no weight and epsilon, or computes another formula.
    """
    eps, weight = _norm_parameters(norm, offset)
    _check_formula(
        "RMSNorm",
        norm,
        lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x),
    )


#: Norms ``norm_input_gradient`` has checked -> whether they compute an RMSNorm.
_RMS_NORMS: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


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
#: RMSNorms of ``model.hf`` under a norm rule -> (their weight offset, the block's state).
_HELD_NORMS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[float, Relevance]] = (
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


def _norm_rule(
    y: torch.Tensor, x: torch.Tensor, norm: torch.nn.Module, offset: float, state: Relevance
):
    """``y`` = the RMSNorm ``norm`` of ``x`` with the block's norm rule on its gradient.

    ``state.rules.norm`` is "held" or "secant"; the secant reads the reference input kept
    for ``norm``.
    """
    eps, weight = _norm_parameters(norm, offset)
    x1 = None
    if state.rules.norm == "secant":
        x1 = state._recorded(norm, "x", like=x).to(weight.dtype)
    return _NormRule.apply(y, x, x1, weight, eps)


def _norm_hook(norm: torch.nn.Module, offset: float, state: Relevance) -> Callable:
    """The norm rule as a forward hook on a module computing the RMSNorm ``norm``
    (``norm`` itself, or a TransformerLens bridge wrapping it)."""

    def hook(module, args, output):
        if module not in _LIVE:
            return None
        if state._recording:
            if state.rules.norm == "secant":
                state._record(norm, "x", args[0])
            return None
        if not output.requires_grad:
            return None
        return _norm_rule(output, args[0], norm, offset, state)

    return hook


def norm_input_gradient(
    norm: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, *, offset: float = 0.0
) -> torch.Tensor:
    """The input gradient of the RMSNorm ``norm`` at ``x`` for a batch of output gradients,
    without autograd: J(x)^T grad, or inside a ``relevance_rules`` block holding ``norm``,
    its norm rule's. For code that takes many gradients through one norm, such as edge
    attribution's per-receiver q/k/v inputs (twice as fast as a batched vector-Jacobian
    product of the recomputed norm, measured on a Llama-3-8B shape).

    Args:
        norm: an RMSNorm module of a model ((offset + weight) times x / rms(x)).
        x: its input, (..., d).
        grad: gradients of its output, (n, ..., d) or (..., d).
        offset: the gain's offset the model's description gives (Gemma: 1); a rule in
            force on ``norm`` brings its own.

    Returns:
        (n, ..., d) gradients in the norm's wide precision (float32 for a half-precision
        model); for a norm that is not (offset + weight) * x / rms(x) (checked once on a
        random input), taken by autograd through its ``forward``, in ``x``'s dtype.
    """
    entry = _HELD_NORMS.get(norm)
    offset, state = entry if entry is not None else (offset, None)
    if state is None and norm not in _RMS_NORMS:
        try:
            _check_rms_norm(norm, offset)
            _RMS_NORMS[norm] = True
        except ValueError:
            _RMS_NORMS[norm] = False
    if state is None and not _RMS_NORMS[norm]:  # another norm: a batched autograd product
        inputs = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = norm.forward(inputs)  # ``forward``: no hooks run
        batched = grad.dim() > x.dim()
        return torch.autograd.grad(out, inputs, grad, is_grads_batched=batched)[0]
    eps, weight = _norm_parameters(norm, offset)
    wide = x.detach().to(weight.dtype)
    if state is None:
        return _rms_norm_vjp(wide, weight, eps, grad)
    x1 = None
    if state.rules.norm == "secant":
        x1 = state._recorded(norm, "x", like=x).to(weight.dtype)
    return _rule_vjp(wide, x1, weight, eps, grad)


def _activation_hook(act: torch.nn.Module, state: Relevance) -> Callable:
    """The activation rule as a forward hook on an MLP's activation (it also keeps the
    output the product's secant rule needs)."""
    ratio, derivative = _activation_functions(act)
    rules = state.rules

    def hook(module, args, output):
        if module not in _LIVE:
            return None
        x = args[0]
        if state._recording:
            if rules.activation == "secant":
                state._record(module, "x", x)
            if "secant" in (rules.activation, rules.product):
                state._record(module, "out", output)
            return None
        if not output.requires_grad:
            return None
        new = output
        if rules.activation == "identity":
            new = _Rerouted.apply(output, x, ratio(x.detach()))
        elif rules.activation == "secant":
            x1 = state._recorded(module, "x", like=x)
            out1 = state._recorded(module, "out", like=x)
            change = x1 - x.detach()
            close = change.abs() <= SECANT_TOLERANCE
            secant = (out1 - output.detach()) / torch.where(close, 1.0, change)
            slope = torch.where(close, derivative((x.detach() + x1) / 2), secant)
            new = _Rerouted.apply(output, x, slope)
        if rules.product == "secant":
            state._keep(module, "out", new)
        return new

    return hook


def _up_hook(state: Relevance) -> Callable:
    """Keeps the up projection's output for the product's secant rule."""

    def hook(module, args, output):
        if module not in _LIVE:
            return None
        if state._recording:
            state._record(module, "out", output)
        elif output.requires_grad:
            state._keep(module, "out", output)
        return None

    return hook


def _product_hook(act: torch.nn.Module, up: torch.nn.Module, state: Relevance) -> Callable:
    """The product rule as a forward pre-hook on the down projection, whose input is
    act(gate) * up."""

    def hook(module, args):
        if module not in _LIVE or state._recording or not args[0].requires_grad:
            return None
        if state.rules.product == "half":
            return (_ScaledGradient.apply(args[0], 0.5), *args[1:])
        a, b = state._kept(act, "out"), state._kept(up, "out")
        a_mid = (a.detach() + state._recorded(act, "out", like=a)) / 2
        b_mid = (b.detach() + state._recorded(up, "out", like=b)) / 2
        return (_Product.apply(args[0], a, b, a_mid, b_mid), *args[1:])

    return hook


def _install_mlp(mlp: torch.nn.Module, state: Relevance, installed: _Installed) -> None:
    """Hook the activation and product rules into a gated MLP."""
    act, up, down = (mlp.get_submodule(n) for n in ("act_fn", "up_proj", "down_proj"))
    rules = state.rules
    if rules.activation != "gradient" or rules.product == "secant":
        installed.hook(act, _activation_hook(act, state))
    if rules.product == "secant":
        installed.hook(up, _up_hook(state))
    if rules.product != "gradient":
        installed.hook(down, _product_hook(act, up, state), pre=True)


# ----------------------------------------------------------------------------- attention


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, kv_heads, pos, d) -> (batch, kv_heads * groups, pos, d), each head repeated."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _secant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    p0: torch.Tensor,
    p1: torch.Tensor,
    scaling: float,
    groups: int,
) -> torch.Tensor:
    """An attention output whose gradient follows the secant rule (its value is not the
    output's: use its gradient only).

    Args:
        q: (batch, heads, pos, d) queries of this pass; k, v: (batch, kv_heads, pos, d).
        reference: the reference pass's (q, k, v), same shapes.
        p0, p1: (batch, heads, query, key) attention probabilities of this pass and of the
            reference pass.
        scaling: the factor of QK^T; groups: query heads per key/value head.

    Returns:
        (batch, heads, pos, d).
    """
    q1, k1, v1 = reference
    p0 = p0.detach()  # a TransformerLens pattern comes with its graph: it must carry none
    keys, values = _repeat_kv(k, groups), _repeat_kv(v, groups)
    keys1, values1 = _repeat_kv(k1, groups), _repeat_kv(v1, groups)
    q_mid = (q.detach() + q1) / 2
    keys_mid = (keys.detach() + keys1) / 2
    values_mid = (values.detach() + values1) / 2
    # scores = q k^T: a change splits exactly at the midpoints (dq k_mid + q_mid dk).
    scores = (q @ keys_mid.transpose(-1, -2) + q_mid @ keys.transpose(-1, -2)) * scaling
    probabilities = _SecantSoftmax.apply(scores.to(p0.dtype), p0, p1).to(q.dtype)
    p_half = ((p0 + p1) / 2).to(q.dtype)
    return probabilities @ values_mid + p_half @ values


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
    not under the rules (a copy made inside a block) it is ``base`` itself."""
    entry = _ACTIVE_ATTENTION.get(module)
    if entry is None:
        function = _base_attention(module, base)
        return function(module, query, key, value, attention_mask, *args, **kwargs)
    rule, function, state = entry
    if rule != "secant":
        query, key, value = _attention_rule_inputs(rule, query, key, value)
        return function(module, query, key, value, attention_mask, *args, **kwargs)
    output, weights = function(module, query, key, value, attention_mask, *args, **kwargs)
    if state._recording:
        for tag, tensor in (("q", query), ("k", key), ("v", value)):
            state._record(module, tag, tensor)
    if state._recording or not (query.requires_grad or key.requires_grad or value.requires_grad):
        return output, weights
    hf_attention: Any = module
    scaling = float(kwargs.get("scaling") or hf_attention.head_dim**-0.5)
    groups = int(hf_attention.num_key_value_groups)
    reference = (
        state._recorded(module, "q", like=query),
        state._recorded(module, "k", like=key),
        state._recorded(module, "v", like=value),
    )
    mask = _additive_mask(attention_mask, query.shape[-2], key.shape[-2], query)
    with torch.no_grad():
        p0 = _probabilities(query, key, groups, scaling, mask)
        p1 = _probabilities(reference[0], reference[1], groups, scaling, mask)
    surrogate = _secant_attention(query, key, value, reference, p0, p1, scaling, groups)
    surrogate = surrogate.transpose(1, 2)
    return output.detach() + (surrogate - surrogate.detach()), weights


def _probabilities(q, k, groups: int, scaling: float, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) in float32 (batch, heads, query, key)."""
    scores = q @ _repeat_kv(k, groups).transpose(-1, -2) * scaling + mask
    return torch.softmax(scores.float(), dim=-1)


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
    offset = spec.layout.norm_offset
    norms = [m for m in hf.modules() if type(m).__name__.endswith("RMSNorm")]
    mlps = [model.module(spec.computation.mlp, layer) for layer in range(spec.n_layers)]
    attention_path = spec.layout.o_proj.rsplit(".", 1)[0]
    attentions = [model.module(attention_path, layer) for layer in range(spec.n_layers)]
    for norm in norms:
        _check_rms_norm(norm, offset)
    for mlp in mlps:
        for part in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not hasattr(mlp, part):
                raise ValueError(f"The MLP {type(mlp).__name__} has no {part}: not a gated MLP.")
        _check_activation(mlp.get_submodule("act_fn"))
    if any(getattr(a, "attn_logit_softcapping", None) for a in attentions):
        raise ValueError("The attention rules do not cover attention logit soft-capping.")
    if rules.norm != "gradient":
        for norm in norms:
            installed.hook(norm, _norm_hook(norm, offset, state))
            _HELD_NORMS[norm] = (offset, state)
    for mlp in mlps:
        _install_mlp(mlp, state, installed)
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
    bridge: torch.nn.Module, state: Relevance, offset: float, installed: _Installed
) -> None:
    """Hook the rules into a TransformerLens bridge's passes. The bridge computes norms and
    attention in its own code: the norm rule is a forward hook on each norm bridge (the
    same correction as on ``model.hf``; TransformerLens's own ``hook_scale`` would change the
    forward's rounding), the AH-rule detaches ``hook_pattern``, the uniform rule scales the
    gradients at the q, k and v projections' outputs (which reach attention through maps
    that are linear under the rules), and the secant rule rebuilds the heads' outputs at
    ``o.hook_in`` from the queries, keys, values and probabilities its hook points show. It
    calls the copied HF MLP modules, hooked as on ``model.hf``."""
    rules = state.rules
    if rules.norm != "gradient":
        for module in bridge.modules():
            norm = getattr(module, "original_component", None)
            if isinstance(norm, torch.nn.Module) and type(norm).__name__.endswith("RMSNorm"):
                installed.hook(module, _norm_hook(norm, offset, state))
    for block in bridge.blocks:  # type: ignore[union-attr]
        attention = block.attn
        if rules.attention == "ah":
            installed.hook(attention.hook_pattern, _detach_hook)
        elif rules.attention == "uniform":
            for name, factor in (("q", 0.25), ("k", 0.25), ("v", 0.5)):
                installed.hook(attention.get_submodule(f"{name}.hook_out"), _scaled_hook(factor))
        elif rules.attention == "secant":
            _install_bridge_secant(attention, state, installed)
        _install_mlp(block.mlp.original_component, state, installed)


def _install_bridge_secant(attention: Any, state: Relevance, installed: _Installed) -> None:
    """The secant attention rule on a TransformerLens attention bridge: keep (or record)
    the rotated queries and keys, the values and the probabilities, and replace the heads'
    outputs at ``o.hook_in`` by a value-preserving surrogate carrying the rule's gradient."""
    hf_attention = attention.original_component
    heads, d_head = hf_attention.config.num_attention_heads, hf_attention.head_dim
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
        reference = (
            state._recorded(attention, "q", like=q),
            state._recorded(attention, "k", like=k),
            values(state._recorded(attention, "v", like=v)),
        )
        p1 = state._recorded(attention, "p", like=p0)
        scaling = getattr(hf_attention, "scaling", d_head**-0.5)
        surrogate = _secant_attention(
            q, k, values(v), reference, p0.float(), p1.float(), scaling, groups
        )
        surrogate = surrogate.transpose(1, 2).reshape(*z.shape[:2], heads * d_head)
        return (z.detach() + (surrogate - surrogate.detach()), *args[1:])

    for tag, point in (
        ("q", attention.hook_rot_q),
        ("k", attention.hook_rot_k),
        ("v", attention.get_submodule("v.hook_out")),
        ("p", attention.hook_pattern),
    ):
        installed.hook(point, keeper(tag))
    installed.hook(attention.get_submodule("o.hook_in"), rebuild, pre=True)


def _detach_hook(module, args, output):
    """A forward hook that passes no gradient back through ``module``'s output."""
    return output.detach() if module in _LIVE else None


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
    check_covered(model)
    if isinstance(rules, str):
        if rules not in RULE_SETS:
            raise ValueError(f"Unknown rule set {rules!r}; choose one of {list(RULE_SETS)}.")
        rules = RULE_SETS[rules]
    if model in _ACTIVE_MODELS:
        raise ValueError(f"Relevance rules are already active on {model.name}; blocks do not nest.")
    bridge = None
    if backend == TransformerLensBackend.name:
        runner = get_backend(model, backend)  # booted before any hook exists
        assert isinstance(runner, TransformerLensBackend)
        bridge = runner.bridge
    elif backend != "nnsight":
        raise ValueError(f"Unknown backend {backend!r}; choose 'nnsight' or 'transformer_lens'.")
    state = Relevance(rules)
    installed = _Installed()
    _ACTIVE_MODELS.add(model)
    try:
        _install_hf(model, state, installed)
        if bridge is not None:
            _install_bridge(bridge, state, model.spec.layout.norm_offset, installed)
        yield state
    finally:
        _uninstall(model, installed)
        _ACTIVE_MODELS.discard(model)


def _uncovered(model: LensModel) -> list[str]:
    """What in ``model``'s computation no rule covers, one sentence each (empty: none)."""
    c, reasons = model.spec.computation, []
    if c.norm == "layer":
        reasons.append(
            "its norms are LayerNorms, which subtract each position's mean before scaling and "
            "add a bias: the norm rules hold or average an RMSNorm's 1/rms scale and give no "
            "share to the mean the centring removes"
        )
    if c.attn_softcap:
        reasons.append(
            f"its attention logits are soft-capped ({c.attn_softcap:g} tanh(s / "
            f"{c.attn_softcap:g})) before the softmax: the attention rules split q k^T and the "
            "softmax, and no rule passes relevance through the tanh between them"
        )
    if c.n_experts:
        reasons.append(
            f"each MLP sends a token to {c.experts_per_token} of {c.n_experts} experts "
            "weighted by the router's softmax: relevance would have to be split between the "
            "routing weights and the experts' outputs, which no rule does (the product rule "
            "covers one act(gate) x up product)"
        )
        return reasons
    mlp = model.module(c.mlp, 0)
    missing = [
        part for part in ("gate_proj", "up_proj", "down_proj", "act_fn") if not hasattr(mlp, part)
    ]
    if missing and hasattr(mlp, "gate_up_proj"):
        reasons.append(
            "its MLP computes gate and up in one fused projection (gate_up_proj) and splits "
            "them inside its forward: the product rule acts on act(gate) x up through the "
            "separate gate and up projections' outputs, which this MLP never exposes"
        )
    elif missing:
        reasons.append(
            f"its MLP has no act(gate) x up product (no {', '.join(missing)}): the MLP rules "
            "are a gated MLP's"
        )
    return reasons


def check_covered(model: LensModel) -> None:
    """Refuse a model whose computation the rules do not cover, with the reason, before
    any pass.

    Raises:
        ValueError: naming each part no rule covers and what to use instead.
    """
    reasons = _uncovered(model)
    if reasons:
        raise ValueError(
            "Relevance rules support RMSNorm models with a gated MLP and softmax attention; "
            f"{model.name} ({model.spec.architecture}) is not covered: "
            + "; ".join(reasons)
            + ". Use a gradient estimator instead (edges: 'eap' or 'eap-ig'; nodes: 'atp' "
            "or 'ig')."
        )


def unsupported(model: LensModel) -> str | None:
    """Why relevance rules cannot run on ``model`` (its family, or a module whose formula is
    not the one the rules assume), or None when they can: the rules are installed and
    removed again, no pass is run."""
    try:
        with relevance_rules(model, "relp"):
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
