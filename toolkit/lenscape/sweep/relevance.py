"""Relevance propagation rules for one backward pass, active only inside a ``with`` block.

Relevance patching (RelP; Jafari, Eberle, Khakzar and Nanda 2025, arXiv 2508.21258)
replaces attribution patching's local gradient by the coefficients of Layer-wise Relevance
Propagation (LRP): score = (clean - corrupt activation) . c, where c is the gradient of the
metric at the corrupt run taken through a backward pass whose rules are changed module by
module. ``relevance_rules(model)`` makes a plain ``torch.autograd`` backward through the
model yield c: every rule keeps the forward value bit for bit and reshapes only the
gradient, in the Gradient x Input form of AttnLRP (Achtibat et al. 2024, arXiv 2402.05602;
the ``efficient`` rules of ``lxt`` 2.1), so that x . c is the relevance a rule assigns to
its input x. Same units and sign as attribution patching.

The rules, per module type (``Rules`` picks which are on; ``RULE_SETS`` names sets):

- **RMSNorm** (every norm of the supported families: the input and post-attention norms,
  the final norm, Qwen 3's and Gemma 3's q_norm/k_norm, Gemma's pre/post-feedforward
  norms): the scale 1/rms(x) is held constant (stop-gradient on the variance), the LN-rule
  of Ali et al. 2022 as RelP and lxt implement it, so the norm is linear in x and conserves
  relevance. The module's own output stays in the graph (the gradient at the norm's input
  gets a correction term), so an activation kept at a norm's output (Gemma's attention and
  MLP sites) still has its gradient.
- **MLP non-linearity** (SiLU, GELU, GELU-tanh): the identity rule of AttnLRP (its Eq. 9;
  RelP's "Identity-rule"): relevance passes unchanged, so the coefficient at the input is
  act(x) / x times the one at the output (sigmoid(x) for SiLU, Phi(x) for GELU).
- **gate x up product**: the uniform rule of AttnLRP (Eq. 7; RelP's "Half-rule"): each
  factor gets half of the product's relevance (the gradient into the product is halved).
- **attention**, one of ``ATTENTION_RULES``: ``"ah"`` holds the attention probabilities
  constant (the AH-rule of Ali et al. 2022, CP-LRP in lxt: no gradient into queries and
  keys), ``"uniform"`` is AttnLRP's uniform rule on QK^T and on probabilities x V (lxt 2.1
  ``efficient/patches.py``: gradients into queries and keys divided by 4, into values by 2),
  ``"gradient"`` leaves attention's gradient as it is (RelP's released default).

Linear layers, the embedding, rotary embeddings and residual additions keep their gradient
(LRP's 0-rule is Gradient x Input on a linear map).

Supported: ``SUPPORTED_ARCHITECTURES`` (Llama, Mistral, Qwen 2 and 3, Gemma 3), on the
nnsight backend and on direct calls of ``model.hf`` (module hooks and an attention function
registered with transformers' ``AttentionInterface``), and on the TransformerLens backend
(hook points on its bridge; see ``relevance_rules``).
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

#: HF ``model_type`` of the families whose modules the rules are checked against.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ATTENTION_RULES = ("ah", "uniform", "gradient")
#: Prefix of the attention implementations registered with transformers (one per base).
_ATTENTION_NAME = "lenscape_relevance"


@dataclass(frozen=True)
class Rules:
    """Which rule each kind of module follows in the backward pass (module docstring).

    Attributes:
        norm: hold each RMSNorm's scale constant (else its plain gradient).
        activation: the identity rule through the MLP non-linearity.
        product: the uniform (half) rule through the gate x up product.
        attention: one of ``ATTENTION_RULES``.
    """

    norm: bool = True
    activation: bool = True
    product: bool = True
    attention: str = "gradient"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_RULES:
            raise ValueError(
                f"Unknown attention rule {self.attention!r}; choose one of {list(ATTENTION_RULES)}."
            )


#: Named rule sets: ``"relp"``, the rules of RelP's released code (LN-, identity and half
#: rules, attention's own gradient); ``"relp-ah"`` adds the AH-rule; ``"attnlrp"`` is lxt's
#: AttnLRP (uniform rule in attention); ``"ah"`` is the AH-rule alone.
RULE_SETS: dict[str, Rules] = {
    "relp": Rules(),
    "relp-ah": Rules(attention="ah"),
    "attnlrp": Rules(attention="uniform"),
    "ah": Rules(norm=False, activation=False, product=False, attention="ah"),
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


class _HeldScale(torch.autograd.Function):
    """Forward: the RMSNorm output ``y`` unchanged. Backward: ``y`` keeps its gradient g
    (so the norm's own backward runs), and its input ``x`` gets the correction that turns
    the norm's true gradient into the one with the scale r = 1/rms(x) held constant:
    w r g - (true gradient) = (r^3 / d) x sum_i(g_i w_i x_i)."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, scale, weight)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, scale, weight = ctx.saved_tensors
        wide = x.to(scale.dtype)
        inner = (grad.to(scale.dtype) * weight * wide).sum(-1, keepdim=True)
        correction = scale**3 / x.shape[-1] * wide * inner
        return grad, correction.to(x.dtype), None, None


# ------------------------------------------------------------------- the rules on modules


def _slope_function(act: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """act(x) / x in closed form (no division) for the activations of the supported families.

    Raises:
        ValueError: an activation without a known closed form.
    """
    name = type(act).__name__
    approximate = getattr(act, "approximate", None)
    if name in ("SiLU", "SiLUActivation"):
        return torch.sigmoid
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh") or (
        name == "GELU" and approximate == "tanh"
    ):
        return lambda x: 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name in ("GELUActivation", "GELU"):
        return lambda x: 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    raise ValueError(
        f"The identity rule has no slope for the MLP activation {name}; supported: SiLU, "
        "GELU and GELU-tanh."
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


@dataclass
class _Installed:
    """What one ``relevance_rules`` block changed, to undo it."""

    handles: list[RemovableHandle] = field(default_factory=list)
    live: list[torch.nn.Module] = field(default_factory=list)
    attentions: list[torch.nn.Module] = field(default_factory=list)
    implementation: str | None = None  # the attention implementation to restore


#: Attention modules under the rules -> (their attention rule, the base attention function).
_ACTIVE_ATTENTION: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, Callable]] = (
    weakref.WeakKeyDictionary()
)
#: Models inside a ``relevance_rules`` block (blocks do not nest).
_ACTIVE_MODELS: weakref.WeakSet[LensModel] = weakref.WeakSet()
#: Modules whose rule hooks are live; a deep copy made inside a block keeps the hooks but
#: not the membership, so the hooks do nothing on it.
_LIVE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _attention_rule_inputs(
    rule: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values as the attention rule lets gradients reach them."""
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
    *args: Any,
    base: str,
    **kwargs: Any,
) -> Any:
    """The attention function ``base`` on the same values, with the module's attention rule
    shaping the gradients into queries, keys and values; on a module not under the rules (a
    copy made inside a block) it is ``base`` itself."""
    entry = _ACTIVE_ATTENTION.get(module)
    if entry is None:
        return _base_attention(module, base)(module, query, key, value, *args, **kwargs)
    rule, function = entry
    query, key, value = _attention_rule_inputs(rule, query, key, value)
    return function(module, query, key, value, *args, **kwargs)


def _attention_function(base: str) -> str:
    """Register (once) the attention implementation that is ``_relevance_attention`` over
    ``base``, with ``base``'s attention masks; return its name."""
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


def _install_hf(model: LensModel, rules: Rules, installed: _Installed) -> None:
    """Hook the rules into ``model.hf`` (its direct calls and nnsight passes)."""
    hf, spec = model.hf, model.spec
    offset = spec.layout.norm_offset
    norms = [m for m in hf.modules() if type(m).__name__.endswith("RMSNorm")]
    mlps = [model.module("mlp", layer) for layer in range(spec.n_layers)]
    attentions = [
        model.module(spec.layout.o_proj.rsplit(".", 1)[0], layer) for layer in range(spec.n_layers)
    ]
    for norm in norms:
        eps, weight = _norm_parameters(norm, offset)
        _check_formula(
            "RMSNorm",
            norm,
            lambda x, eps=eps, weight=weight: (
                x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x)
            ),
        )
    for mlp in mlps:
        for part in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not hasattr(mlp, part):
                raise ValueError(f"The MLP {type(mlp).__name__} has no {part}: not a gated MLP.")
        slope = _slope_function(mlp.get_submodule("act_fn"))
        _check_formula("MLP activation", mlp.get_submodule("act_fn"), lambda x, s=slope: x * s(x))
    if rules.norm:
        for norm in norms:
            installed.handles.append(norm.register_forward_hook(_held_scale_hook(norm, offset)))
    live = list(norms)
    for mlp in mlps:
        live += _install_mlp(mlp, rules, installed)
    if rules.attention != "gradient":
        previous = hf.config._attn_implementation
        if not hf._can_set_attn_implementation():
            raise ValueError(f"{type(hf).__name__} cannot switch its attention function.")
        for attention in attentions:
            _ACTIVE_ATTENTION[attention] = (rules.attention, _base_attention(attention, previous))
            installed.attentions.append(attention)
        installed.implementation = previous
        hf.set_attn_implementation(_attention_function(previous))
    installed.live.extend(live)
    _LIVE.update(live)


def _install_mlp(
    mlp: torch.nn.Module, rules: Rules, installed: _Installed
) -> list[torch.nn.Module]:
    """Hook the identity and half rules into a gated MLP; return the hooked modules."""
    act, down = mlp.get_submodule("act_fn"), mlp.get_submodule("down_proj")
    if rules.activation:
        installed.handles.append(act.register_forward_hook(_identity_hook(_slope_function(act))))
    if rules.product:
        installed.handles.append(down.register_forward_pre_hook(_half_hook))
    return [act, down]


def _held_scale_hook(norm: torch.nn.Module, offset: float):
    """The held-scale rule as a forward hook on a module computing the RMSNorm ``norm``
    (``norm`` itself, or a TransformerLens bridge wrapping it)."""

    def hook(module, args, output):
        if module not in _LIVE or not output.requires_grad:
            return None
        x = args[0]
        eps, weight = _norm_parameters(norm, offset)
        wide = x.detach().to(_wide(x.dtype))
        scale = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps).to(weight.dtype)
        return _HeldScale.apply(output, x, scale, weight)

    return hook


def _identity_hook(slope: Callable[[torch.Tensor], torch.Tensor]):
    """The identity rule as a forward hook on an MLP activation: slope(x) = act(x) / x."""

    def hook(module, args, output):
        if module not in _LIVE or not output.requires_grad:
            return None
        x = args[0]
        return _Rerouted.apply(output, x, slope(x.detach()))

    return hook


def _half_hook(module, args):
    """The uniform rule on gate x up, as a forward pre-hook on the down projection."""
    if module not in _LIVE or not args[0].requires_grad:
        return None
    return (_ScaledGradient.apply(args[0], 0.5), *args[1:])


def _detach_hook(module, args, output):
    """A forward hook that passes no gradient back through ``module``'s output."""
    return output.detach() if module in _LIVE else None


def _scaled_hook(factor: float):
    """A forward hook that scales the gradient through ``module``'s output by ``factor``."""

    def hook(module, args, output):
        if module not in _LIVE or not output.requires_grad:
            return None
        return _ScaledGradient.apply(output, factor)

    return hook


def _install_bridge(
    bridge: torch.nn.Module, rules: Rules, offset: float, installed: _Installed
) -> None:
    """Hook the rules into a TransformerLens bridge's passes. The bridge computes norms and
    attention in its own code: the held-scale rule is a forward hook on each norm bridge
    (the same correction as on ``model.hf``; TransformerLens's own ``hook_scale`` would
    change the forward's rounding), the AH-rule detaches ``hook_pattern``, and the uniform
    rule scales the gradients at the q, k and v projections' outputs (which reach attention
    through maps that are linear under the rules). It calls the copied HF MLP modules, so
    the MLP rules are the same module hooks as on ``model.hf``."""
    points: dict[str, dict[str, float | None]] = {
        "ah": {"hook_pattern": None},
        "uniform": {"q.hook_out": 0.25, "k.hook_out": 0.25, "v.hook_out": 0.5},
        "gradient": {},
    }
    attention_points = points[rules.attention]
    live: list[torch.nn.Module] = []
    if rules.norm:
        for module in bridge.modules():
            norm = getattr(module, "original_component", None)
            if isinstance(norm, torch.nn.Module) and type(norm).__name__.endswith("RMSNorm"):
                hook = _held_scale_hook(norm, offset)
                installed.handles.append(module.register_forward_hook(hook))
                live.append(module)
    for block in bridge.blocks:  # type: ignore[union-attr]
        for path, factor in attention_points.items():
            point = block.attn.get_submodule(path)
            hook = _detach_hook if factor is None else _scaled_hook(factor)
            installed.handles.append(point.register_forward_hook(hook))
            live.append(point)
        live += _install_mlp(block.mlp.original_component, rules, installed)
    installed.live.extend(live)
    _LIVE.update(live)


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


@contextlib.contextmanager
def relevance_rules(
    model: LensModel, rules: str | Rules = "relp", *, backend: str = "nnsight"
) -> Iterator[Rules]:
    """Within the block, a backward pass through ``model`` yields LRP coefficients.

    Forward outputs are unchanged (every rule keeps values bit for bit); only gradients
    change. Passes of ``model.hf`` itself (direct calls, ``generate``, the nnsight backend)
    follow the rules; with ``backend="transformer_lens"`` the TransformerLens bridge's passes
    do too (it is booted first if need be). On leaving the block, even by an exception, the
    model is as it was (hooks removed, attention implementation restored).

    Usage (RelP: the corrupt run's coefficients times clean - corrupt)::

        with relevance_rules(model):
            run = get_backend(model, "nnsight").run(corrupt, sites=sites, grad=True)
            grads = torch.autograd.grad(metric(run.logits).sum(), [run.acts[s] for s in sites])

    Args:
        model: a model of a family in ``SUPPORTED_ARCHITECTURES``.
        rules: a name in ``RULE_SETS`` or a ``Rules``.
        backend: the backend whose passes must follow the rules as well as ``model.hf``'s:
            "nnsight" (which runs ``model.hf``) or "transformer_lens".

    Returns:
        The ``Rules`` in force (yielded).

    Raises:
        ValueError: an unsupported family, unknown rule set or backend, or a module whose
            formula is not the one the rules assume.
    """
    if model.spec.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Relevance rules support {list(SUPPORTED_ARCHITECTURES)}; "
            f"{model.spec.architecture!r} ({model.name}) is not one of them."
        )
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
    installed = _Installed()
    _ACTIVE_MODELS.add(model)
    try:
        _install_hf(model, rules, installed)
        if bridge is not None:
            _install_bridge(bridge, rules, model.spec.layout.norm_offset, installed)
        yield rules
    finally:
        _uninstall(model, installed)
        _ACTIVE_MODELS.discard(model)
