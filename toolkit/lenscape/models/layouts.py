"""Architecture layouts: where each family keeps the parts that capture code hooks.

A layout names, relative to the Hugging Face model, the decoder blocks, the ``o_proj``
whose input holds the per-head outputs, the modules whose outputs are the attention and
MLP contributions to the residual stream, the final norm and the unembedding, and maps
parameter names onto lenscape's component vocabulary. ``lenscape.check`` verifies a
layout against the model in hand on load.

To support a new family, add an ``ArchLayout`` to ``ARCHITECTURES`` under its
``config.model_type`` (or pass ``layout=`` to ``lsc.load``/``lsc.from_hf``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class ArchLayout:
    """Where the parts of one architecture family live (paths relative to the HF model).

    Attributes:
        layers: the ModuleList of decoder blocks.
        o_proj: per block, the output projection whose input is the heads' outputs
            concatenated, (batch, pos, n_heads * d_head).
        attn_out / mlp_out: per block, the module whose output is the attention / MLP
            contribution added to the residual stream, (batch, pos, d_model);
            ``attn_out_tuple`` when that module returns a tuple whose first item it is.
            Parallel blocks (GPT-NeoX) add both to the block's input; sequential blocks add
            them one after the other; the sites are the same.
        final_norm / embed / unembed: model-level modules.
        weights: component name -> parameter path within a block. Fused tensors that hold
            several components (GPT-NeoX ``query_key_value``, Phi-3 ``qkv_proj`` and
            ``gate_up_proj``, mixture-of-experts expert banks) are left out, except GPT-2's
            ``c_attn``, split into q/k/v columns (``qkv_split``).
        attn_out_tuple: see ``attn_out``.
        norm_offset: RMSNorm multiplies by (offset + weight) (Gemma: 1).
        layer_norm: the final norm centres (LayerNorm) rather than only scaling (RMSNorm).
        qkv_split: GPT-2 ``Conv1D`` weights, stored (in, out), with q/k/v fused in ``c_attn``.
        post_attn_norm: per block, a norm applied to the attention output before it is added
            to the residual stream (Gemma 2/3 and OLMo 2), or None.
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
_QWEN3 = replace(_LLAMA, weights={**_LLAMA_WEIGHTS, **_QK_NORMS})
# Gemma normalises each block's output before adding it to the residual stream.
_GEMMA2 = replace(
    _LLAMA,
    attn_out="post_attention_layernorm",
    mlp_out="post_feedforward_layernorm",
    attn_out_tuple=False,
    post_attn_norm="post_attention_layernorm",
    weights={
        **_LLAMA_WEIGHTS,
        "pre_feedforward_layernorm": "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm": "post_feedforward_layernorm.weight",
    },
    norm_offset=1.0,
)
_GEMMA3 = replace(_GEMMA2, weights={**_GEMMA2.weights, **_QK_NORMS})
# OLMo 2 has no input norms: it normalises each block's output (RMSNorm, no offset), and
# its q/k norms span all heads at once.
_OLMO2 = replace(
    _GEMMA2,
    norm_offset=0.0,
    weights={
        **_without(_LLAMA_WEIGHTS, "input_layernorm"),
        **_QK_NORMS,
        "post_feedforward_layernorm": "post_feedforward_layernorm.weight",
    },
)
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
)
# Pythia: attention and MLP read the same block input (parallel residual); q/k/v are fused.
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
)
# Phi-3 fuses q/k/v (qkv_proj) and gate/up (gate_up_proj); the module paths are Llama's.
_PHI3 = replace(
    _LLAMA, weights=_without(_LLAMA_WEIGHTS, "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
)
# Mixture of experts: the whole sparse block (router, experts, shared expert) is the MLP
# component; the expert banks are fused 3-d tensors, left out of the weight components.
_QWEN2_MOE = replace(_LLAMA, weights=_without(_LLAMA_WEIGHTS, *_MLP))
_QWEN3_MOE = replace(_QWEN3, weights=_without(_QWEN3.weights, *_MLP))

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
            "self-check on load verifies it (README, section Models)."
        )
    return ARCHITECTURES[model_type]


@dataclass(frozen=True)
class ModelSpec:
    """Shape and layout of a model.

    Attributes:
        architecture: HF ``model_type`` (e.g. "llama", "gemma3_text", "gpt2").
        n_layers, n_heads, n_kv_heads, d_head, d_model, vocab_size: sizes; grouped-query
            models have n_kv_heads < n_heads (per-head quantities are over query heads).
        tied_embeddings: the unembedding shares the embedding matrix.
        layout: module and parameter paths (see ``ArchLayout``).
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
        )
