"""Architecture layouts: each family's parts and what its blocks compute.

A layout names, relative to the Hugging Face model, the decoder blocks, the ``o_proj``
whose input holds the per-head outputs, the modules whose outputs are the attention and
MLP contributions to the residual stream, the final norm and the unembedding, and maps
parameter names onto lenscape's component vocabulary. It also describes the family's
computation: whether a block's MLP reads the block's input (parallel residual) or the
stream after its attention (sequential), where the norms sit and their formula, the
q/k/v projections (separate, or fused and in which column order), QK-norm, and learned
position embeddings. The config of the model in hand adds what varies within a family
(``ModelSpec.from_config`` resolves both into a ``Computation``): the parallel-residual
flag, soft-capping, sliding-window layers, routed experts, the rotary share.

Every reader of a model's computation reads ``ModelSpec.computation`` and never names a
family: the edge graph (which receiver reads which sender), the edge hooks (each
receiver's own copy of its input, rebuilt through the described norm and projection rows),
the per-head outputs (``models.parts``), the relevance rules (what they cover) and the
self-check (``lenscape.check``), which verifies on load every identity these rely on.

To support a new family, add an ``ArchLayout`` to ``ARCHITECTURES`` under its
``config.model_type`` (or pass ``layout=`` to ``lsc.load``/``lsc.from_hf``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

#: Residual topologies: each block's MLP reads the stream after the block's attention
#: ("sequential") or the block's input, as its attention does ("parallel": GPT-NeoX, GPT-J).
RESIDUALS = ("sequential", "parallel")
#: Column orders of a fused q/k/v projection: "blocks" = [q heads | k heads | v heads]
#: (GPT-2 ``c_attn``, Phi-3 ``qkv_proj``); "per_head" = per head [q | k | v] (GPT-NeoX
#: ``query_key_value``, as many key/value heads as query heads).
QKV_ORDERS = ("blocks", "per_head")
#: Where a QK-norm normalises: "head" (each head's d_head values: Qwen 3, Gemma 3; applied
#: by the attention after the projection, head by head) or "projection" (the whole q or k
#: projection, every head at once: OLMo 2).
QK_NORMS = ("head", "projection")
#: Position information: "rotary" (inside attention, on q and k) or "learned" (a
#: position embedding added to the token embedding before block 0: GPT-2).
POSITIONS = ("rotary", "learned")


@dataclass(frozen=True)
class ArchLayout:
    """Where the parts of one architecture family live and what its blocks compute (paths
    relative to the HF model; per-block paths relative to a block).

    Attributes:
        layers: the ModuleList of decoder blocks.
        o_proj: per block, the output projection whose input is the heads' outputs
            concatenated, (batch, pos, n_heads * d_head).
        attn_out / mlp_out: per block, the module whose output is the attention / MLP
            contribution added to the residual stream, (batch, pos, d_model);
            ``attn_out_tuple`` when that module returns a tuple whose first item it is.
            With post-norms (Gemma 2/3, OLMo 2) they are those norms.
        final_norm / embed / unembed: model-level modules.
        weights: component name -> parameter path within a block. Fused tensors that hold
            several components (GPT-NeoX ``query_key_value``, Phi-3 ``qkv_proj`` and
            ``gate_up_proj``, mixture-of-experts expert banks) are left out, except GPT-2's
            ``c_attn``, split into q/k/v columns (``qkv_split``).
        attn_out_tuple: see ``attn_out``.
        norm_offset: every RMSNorm of the family multiplies by (offset + weight) (Gemma: 1).
        layer_norm: every norm of the family is a LayerNorm (centres, scales, adds a bias)
            rather than an RMSNorm (GPT-2, GPT-NeoX).
        qkv_split: GPT-2's weight components q/k/v are column blocks of ``c_attn`` (for the
            weight maps).
        post_attn_norm: per block, a norm applied to the attention output before it is added
            to the residual stream (Gemma 2/3 and OLMo 2), or None.
        attn_norm: per block, the norm q, k and v read the residual stream through (None:
            they read it as it is, OLMo 2).
        mlp_norm: per block, the MLP's input norm (None: the MLP reads the stream as it is).
        mlp: per block, the MLP module; mixture-of-experts families: the whole routed block
            (router, experts, shared expert), one node of the edge graph.
        post_mlp_norm: per block, a norm applied to the MLP output before it is added to the
            residual stream, or None.
        qkv: per block, the q, k and v projections (three paths), or one fused projection
            (one path) whose columns ``qkv_order`` orders.
        qkv_order: a fused projection's column order, one of ``QKV_ORDERS``.
        transposed: linear weights are stored (in, out) (GPT-2's ``Conv1D``), not (out, in).
        qk_norm: None, or where the QK-norm normalises (``QK_NORMS``).
        q_norm / k_norm: per block, the QK-norm modules (with ``qk_norm``).
        parallel_residual: True, False, or the name of the config flag that says
            (GPT-NeoX: ``"use_parallel_residual"``).
        position: one of ``POSITIONS``.
        position_embed: the learned position embedding module (with ``position="learned"``):
            its output is part of the ``embed`` sender.
        router: with routed experts, the router's path within ``mlp`` (checked on load).
    """

    layers: str
    o_proj: str
    attn_out: str
    mlp_out: str
    final_norm: str
    embed: str
    unembed: str
    weights: dict[str, str] = field(default_factory=dict)
    attn_out_tuple: bool = True
    norm_offset: float = 0.0
    layer_norm: bool = False
    qkv_split: bool = False
    post_attn_norm: str | None = None
    attn_norm: str | None = "input_layernorm"
    mlp_norm: str | None = "post_attention_layernorm"
    mlp: str = "mlp"
    post_mlp_norm: str | None = None
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    qkv_order: str = "blocks"
    transposed: bool = False
    qk_norm: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None
    parallel_residual: bool | str = False
    position: str = "rotary"
    position_embed: str | None = None
    router: str | None = None

    def __post_init__(self) -> None:
        _check_description(self)


def _check_description(layout: ArchLayout) -> None:
    """Refuse a description that is incomplete or names an unknown choice.

    Raises:
        ValueError: naming the field and how to fill it.
    """
    problems = []
    if len(layout.qkv) not in (1, 3):
        problems.append(
            f"qkv={layout.qkv!r} must name the q, k and v projections (three paths) or one "
            "fused projection (one path)"
        )
    if layout.qkv_order not in QKV_ORDERS:
        problems.append(f"qkv_order={layout.qkv_order!r} is not one of {list(QKV_ORDERS)}")
    if layout.qk_norm is not None and (
        layout.qk_norm not in QK_NORMS or not (layout.q_norm and layout.k_norm)
    ):
        problems.append(
            f"qk_norm={layout.qk_norm!r} must be one of {list(QK_NORMS)} with the q_norm and "
            "k_norm paths given"
        )
    if layout.qk_norm == "projection" and len(layout.qkv) != 3:
        problems.append("a projection-wide QK-norm needs separate q, k and v projections")
    if layout.position not in POSITIONS:
        problems.append(f"position={layout.position!r} is not one of {list(POSITIONS)}")
    if (layout.position == "learned") != (layout.position_embed is not None):
        problems.append(
            "learned positions need position_embed (the module whose output is added to the "
            "token embeddings), and only they"
        )
    if problems:
        raise ValueError(
            "This lsc.ArchLayout does not describe a computation lenscape can follow: "
            + "; ".join(problems)
            + ". See lsc.ArchLayout's docstring for each field."
        )


def _without(weights: dict[str, str], *components: str) -> dict[str, str]:
    return {name: path for name, path in weights.items() if name not in components}


_MLP = ("gate_proj", "up_proj", "down_proj")
_LLAMA_WEIGHTS = {
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
}
_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
_LLAMA = ArchLayout(
    layers="model.layers",
    o_proj="self_attn.o_proj",
    attn_out="self_attn",
    mlp_out="mlp",
    final_norm="model.norm",
    embed="model.embed_tokens",
    unembed="lm_head",
    weights=_LLAMA_WEIGHTS,
)
# Qwen 3 normalises each head's q and k (RMSNorm over d_head) before rotary embedding.
_QWEN3 = replace(
    _LLAMA,
    weights={**_LLAMA_WEIGHTS, **_QK_NORMS},
    qk_norm="head",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
)
# Gemma normalises each block's output before adding it to the residual stream (post-norms),
# and its MLP reads the stream through its own pre-feedforward norm; RMSNorms scale by
# (1 + weight).
_GEMMA2 = replace(
    _LLAMA,
    attn_out="post_attention_layernorm",
    mlp_out="post_feedforward_layernorm",
    attn_out_tuple=False,
    post_attn_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    weights={
        **_LLAMA_WEIGHTS,
        "pre_feedforward_layernorm": "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm": "post_feedforward_layernorm.weight",
    },
    norm_offset=1.0,
)
_GEMMA3 = replace(
    _GEMMA2,
    weights={**_GEMMA2.weights, **_QK_NORMS},
    qk_norm="head",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
)
# OLMo 2 has no input norms: attention and MLP read the stream as it is, and each block's
# outputs are normalised (RMSNorm, no offset); its q/k norms span all heads at once.
_OLMO2 = replace(
    _GEMMA2,
    norm_offset=0.0,
    attn_norm=None,
    mlp_norm=None,
    qk_norm="projection",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    weights={
        **_without(_LLAMA_WEIGHTS, "input_layernorm"),
        **_QK_NORMS,
        "post_feedforward_layernorm": "post_feedforward_layernorm.weight",
    },
)
# GPT-2: LayerNorms, learned positions added to the token embeddings, Conv1D weights
# stored (in, out), q/k/v fused in c_attn as [q | k | v].
_GPT2 = ArchLayout(
    layers="transformer.h",
    o_proj="attn.c_proj",
    attn_out="attn",
    mlp_out="mlp",
    final_norm="transformer.ln_f",
    embed="transformer.wte",
    unembed="lm_head",
    weights={
        "q_proj": "attn.c_attn.weight",
        "k_proj": "attn.c_attn.weight",
        "v_proj": "attn.c_attn.weight",
        "o_proj": "attn.c_proj.weight",
        "up_proj": "mlp.c_fc.weight",
        "down_proj": "mlp.c_proj.weight",
        "input_layernorm": "ln_1.weight",
        "post_attention_layernorm": "ln_2.weight",
    },
    layer_norm=True,
    qkv_split=True,
    attn_norm="ln_1",
    mlp_norm="ln_2",
    qkv=("attn.c_attn",),
    transposed=True,
    position="learned",
    position_embed="transformer.wpe",
)
# Pythia: attention and MLP read the same block input when the config's
# use_parallel_residual is set; q/k/v fused per head (interleaved); LayerNorms.
_GPT_NEOX = ArchLayout(
    layers="gpt_neox.layers",
    o_proj="attention.dense",
    attn_out="attention",
    mlp_out="mlp",
    final_norm="gpt_neox.final_layer_norm",
    embed="gpt_neox.embed_in",
    unembed="lm_head",
    weights={
        "o_proj": "attention.dense.weight",
        "up_proj": "mlp.dense_h_to_4h.weight",
        "down_proj": "mlp.dense_4h_to_h.weight",
        "input_layernorm": "input_layernorm.weight",
        "post_attention_layernorm": "post_attention_layernorm.weight",
    },
    layer_norm=True,
    qkv=("attention.query_key_value",),
    qkv_order="per_head",
    parallel_residual="use_parallel_residual",
)
# Phi-3 fuses q/k/v (qkv_proj, [q | k | v]) and gate/up (gate_up_proj, inside the MLP
# node); the module paths are Llama's.
_PHI3 = replace(
    _LLAMA,
    weights=_without(_LLAMA_WEIGHTS, "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
    qkv=("self_attn.qkv_proj",),
)
# Mixture of experts: the whole sparse block (router, experts, shared expert) is the MLP
# node; the expert banks are fused 3-d tensors, left out of the weight components.
_QWEN2_MOE = replace(_LLAMA, weights=_without(_LLAMA_WEIGHTS, *_MLP), router="gate")
_QWEN3_MOE = replace(_QWEN3, weights=_without(_QWEN3.weights, *_MLP), router="gate")

#: HF ``config.model_type`` -> layout. Extend here to support a new family.
ARCHITECTURES: dict[str, ArchLayout] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _QWEN3,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA3,
    "olmo2": _OLMO2,
    "gpt2": _GPT2,
    "gpt_neox": _GPT_NEOX,
    "phi3": _PHI3,
    "qwen2_moe": _QWEN2_MOE,
    "qwen3_moe": _QWEN3_MOE,
    "mixtral": _QWEN2_MOE,
}


def resolve_layout(config: Any, layout: ArchLayout | str | None = None) -> ArchLayout:
    """The layout for a model config: ``layout`` when given, else by ``config.model_type``.

    Args:
        config: a Hugging Face ``PretrainedConfig``.
        layout: an ``ArchLayout``, the name of a known family whose layout to reuse (a
            key of ``ARCHITECTURES``), or None.

    Raises:
        ValueError: no layout for this family, or an unknown family name.
        TypeError: ``layout`` is neither an ``ArchLayout``, a string nor None.
    """
    if isinstance(layout, ArchLayout):
        return layout
    if isinstance(layout, str):
        if layout not in ARCHITECTURES:
            raise ValueError(
                f"layout={layout!r} is not a known family; pass one of "
                f"{sorted(ARCHITECTURES)} or an lsc.ArchLayout(...)."
            )
        return ARCHITECTURES[layout]
    if layout is not None:
        raise TypeError(
            f"layout must be an lsc.ArchLayout, a family name or None, got {type(layout).__name__}."
        )
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"Unsupported architecture '{model_type}'. lenscape has layouts for "
            f"{sorted(ARCHITECTURES)}; for another family pass layout=lsc.ArchLayout(...) "
            "naming where its blocks, o_proj, attention and MLP outputs, final norm and "
            "unembedding live (or layout='llama' if it is built like one of these), and the "
            "self-check on load verifies it (docs/site/how-to/own-model.md)."
        )
    return ARCHITECTURES[model_type]


@dataclass(frozen=True)
class Computation:
    """What one model's blocks compute: its family's ``ArchLayout`` resolved against its
    config. The edge graph, the edge hooks, the per-head outputs, the relevance rules and
    the self-check read this, never a family name.

    Senders and receivers (``lenscape.capture.edges``) and who owns each bias:

    - the ``embed`` sender is the residual stream entering block 0: the token embedding,
      with learned positions (``position == "learned"``) added, as the model scales it;
    - a q, k or v receiver reads its own copy of the residual stream through
      ``attn_norm`` (its bias, a LayerNorm's, included) and its head's rows of the
      projection (their bias included), then, with ``qk_norm == "projection"``, the
      QK-norm over the whole projection computed from that copy (so one receiver's copy
      carries every head's rows through the norm's scale; its own head's values are kept);
      a per-head QK-norm, rotary embedding, soft-capping and sliding windows are applied
      by the model after that, head by head;
    - a head's sender output is its slice of the ``o_proj`` input times its columns of
      W_O. ``o_proj``'s bias is a constant of the residual stream, no sender's (equal in
      every run, so no edge carries it). With a post-norm (``post_attn_norm``) the sender is
      linearised at the run's own scale: each head's output times the norm's per-position
      scale (1 / rms, or 1 / std after centring each head's output for a LayerNorm) and
      gain, both computed from the whole attention output of that run, so the heads sum
      exactly to the block's normalised output (the bias's normalised share, if any, split
      equally among the heads; a LayerNorm's own bias stays a constant);
    - the MLP sender is the MLP module's output (through ``post_mlp_norm``), its biases
      included; with routed experts the whole routed block (router, experts, shared
      expert) is the node; its receiver is the input of ``mlp_norm`` (or of the MLP),
      which reads the block's input (parallel residual) or the stream after the block's
      attention (sequential);
    - the ``logits`` receiver is the final norm's input; the final norm's and the
      unembedding's biases and the final soft-capping belong to it.

    Attributes:
        residual: one of ``RESIDUALS``.
        norm: "layer" (LayerNorm: centre, scale, gain, bias) or "rms" (RMSNorm: scale,
            gain ``norm_offset + weight``), for every norm of the model.
        norm_offset, attn_norm, mlp_norm, post_attn_norm, post_mlp_norm, mlp, qkv,
            qkv_order, transposed, qk_norm, q_norm, k_norm, position, position_embed,
            router: as in ``ArchLayout``.
        rotary_fraction: the share of each head's dims rotary embedding turns (None:
            learned positions).
        attn_softcap / final_softcap: tanh soft-capping of attention logits / of the output
            logits (c * tanh(x / c)), or None.
        sliding_window: the window of sliding-window layers, or None.
        sliding_layers: the layers that attend within ``sliding_window``.
        n_experts / experts_per_token: routed experts per MoE block and how many each token
            uses, or None.
    """

    residual: str
    norm: str
    norm_offset: float
    attn_norm: str | None
    mlp_norm: str | None
    post_attn_norm: str | None
    post_mlp_norm: str | None
    mlp: str
    qkv: tuple[str, ...]
    qkv_order: str
    transposed: bool
    qk_norm: str | None
    q_norm: str | None
    k_norm: str | None
    position: str
    position_embed: str | None
    router: str | None
    rotary_fraction: float | None
    attn_softcap: float | None
    final_softcap: float | None
    sliding_window: int | None
    sliding_layers: tuple[int, ...]
    n_experts: int | None
    experts_per_token: int | None

    @property
    def parallel(self) -> bool:
        """A block's MLP reads the block's input (not its own heads' outputs)."""
        return self.residual == "parallel"

    @property
    def fused(self) -> bool:
        """q, k and v come out of one projection."""
        return len(self.qkv) == 1

    @classmethod
    def of(cls, layout: ArchLayout, config: Any) -> Computation:
        """``layout`` resolved against a Hugging Face ``config``.

        Raises:
            ValueError: ``layout.parallel_residual`` names a flag the config lacks.
        """
        parallel = layout.parallel_residual
        if isinstance(parallel, str):
            if not hasattr(config, parallel):
                raise ValueError(
                    f"The layout reads the residual topology from config.{parallel}, which "
                    f"this {type(config).__name__} lacks; pass "
                    "lsc.ArchLayout(..., parallel_residual=True or False)."
                )
            parallel = bool(getattr(config, parallel))
        rope = getattr(config, "rope_parameters", None) or {}
        rotary = None
        if layout.position == "rotary":
            rotary = float(
                rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
            )
        window, sliding = _sliding(config)
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        return cls(
            residual="parallel" if parallel else "sequential",
            norm="layer" if layout.layer_norm else "rms",
            norm_offset=layout.norm_offset,
            attn_norm=layout.attn_norm,
            mlp_norm=layout.mlp_norm,
            post_attn_norm=layout.post_attn_norm,
            post_mlp_norm=layout.post_mlp_norm,
            mlp=layout.mlp,
            qkv=tuple(layout.qkv),
            qkv_order=layout.qkv_order,
            transposed=layout.transposed,
            qk_norm=layout.qk_norm,
            q_norm=layout.q_norm,
            k_norm=layout.k_norm,
            position=layout.position,
            position_embed=layout.position_embed,
            router=layout.router if experts else None,
            rotary_fraction=rotary,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) or None,
            final_softcap=getattr(config, "final_logit_softcapping", None) or None,
            sliding_window=window,
            sliding_layers=sliding,
            n_experts=int(experts) if experts else None,
            experts_per_token=getattr(config, "num_experts_per_tok", None) if experts else None,
        )

    def describe(self) -> str:
        """One line per feature, e.g. "residual: parallel" (for messages and docs)."""
        parts = {
            "residual": self.residual,
            "norms": (
                "LayerNorm"
                if self.norm == "layer"
                else f"RMSNorm (gain {self.norm_offset:g} + weight)"
                if self.norm_offset
                else "RMSNorm"
            ),
            "q/k/v input norm": self.attn_norm or "none",
            "MLP input norm": self.mlp_norm or "none",
            "post-norms": ", ".join(p for p in (self.post_attn_norm, self.post_mlp_norm) if p)
            or "none",
            "q/k/v": f"fused {self.qkv[0]} ({self.qkv_order})" if self.fused else "separate",
            "QK-norm": self.qk_norm or "none",
            "positions": self.position
            + (f" ({self.rotary_fraction:g} of each head)" if self.rotary_fraction else ""),
            "soft-capping": ", ".join(
                f"{name} {cap:g}"
                for name, cap in (("attention", self.attn_softcap), ("logits", self.final_softcap))
                if cap
            )
            or "none",
            "sliding windows": f"{self.sliding_window} on layers {list(self.sliding_layers)}"
            if self.sliding_layers
            else "none",
            "experts": f"{self.experts_per_token} of {self.n_experts} routed"
            if self.n_experts
            else "none",
        }
        return "\n".join(f"{name}: {value}" for name, value in parts.items())


def _sliding(config: Any) -> tuple[int | None, tuple[int, ...]]:
    """(window, layers attending within it) from a config's ``layer_types`` or
    ``sliding_window``."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None, ()
    types = getattr(config, "layer_types", None)
    if types is not None:
        layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    elif getattr(config, "use_sliding_window", True):
        layers = tuple(range(config.num_hidden_layers))
    else:
        layers = ()
    return (int(window), layers) if layers else (None, ())


@dataclass(frozen=True)
class ModelSpec:
    """Shape and layout of a model.

    Attributes:
        architecture: HF ``model_type`` (e.g. "llama", "gemma3_text", "gpt2").
        n_layers, n_heads, n_kv_heads, d_head, d_model, vocab_size: sizes; grouped-query
            models have n_kv_heads < n_heads (per-head quantities are over query heads).
        tied_embeddings: the unembedding shares the embedding matrix.
        layout: module and parameter paths (see ``ArchLayout``).
        computation: what the blocks compute, the layout resolved against the config
            (see ``Computation``).
    """

    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    vocab_size: int
    tied_embeddings: bool
    layout: ArchLayout = field(repr=False)
    computation: Computation = field(repr=False)

    @property
    def fingerprint(self) -> str:
        """The architecture and sizes as one string, e.g. "llama/L30/H9/KV3/D64/d576/V49152".

        Results record it (``layout_fingerprint`` attr), so a result passed back in is
        checked against the model it is used with, not only by name.
        """
        return (
            f"{self.architecture}/L{self.n_layers}/H{self.n_heads}/KV{self.n_kv_heads}"
            f"/D{self.d_head}/d{self.d_model}/V{self.vocab_size}"
        )

    @classmethod
    def from_config(cls, config: Any, layout: ArchLayout | str | None = None) -> ModelSpec:
        """Sizes from a Hugging Face config (its ``attribute_map`` covers GPT-2's names)."""
        layout = resolve_layout(config, layout)
        n_heads = config.num_attention_heads
        d_head = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        return cls(
            config.model_type,
            config.num_hidden_layers,
            n_heads,
            getattr(config, "num_key_value_heads", None) or n_heads,
            d_head,
            config.hidden_size,
            config.vocab_size,
            bool(getattr(config, "tie_word_embeddings", False)),
            layout,
            Computation.of(layout, config),
        )
