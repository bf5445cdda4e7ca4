"""The models of the scale ladder: SmolLM2-135M with its real weights, and random-weight
models with the shapes of published configs (``shapes/*.json``).

A model built from a published config with random weights has the real memory and FLOP
profile of that model (its numbers mean nothing, its costs are real). Each JSON file holds
the published Hugging Face config with the vocabulary cut to the bundled tokenizer's
(49,152) and says what it changed, where it came from and the dtype the ladder runs it in.
Weights are drawn seeded, directly in that dtype on the target device (never a float32
copy first: Llama-3-8B's shape is about 15 GB in bfloat16): the model is laid out on the
meta device, given storage on the target device, then filled (matrices normal with the
config's ``initializer_range``, norm weights 1, rotary frequencies recomputed).
"""

from __future__ import annotations

import json
from pathlib import Path

import lenscape as lsc

SHAPES = Path(__file__).resolve().parent / "shapes"
#: The bundled model with real weights: the ladder's first rung.
REAL = "smollm2-135m"


def names() -> list[str]:
    """Every model the ladder can build: the bundled one, then the shapes by file name."""
    return [REAL, *sorted(path.stem for path in SHAPES.glob("*.json"))]


def shape(name: str) -> dict:
    """The JSON record of shape ``name`` (``config``, ``dtype``, ``source``, ``changed``).

    Raises:
        ValueError: no such shape.
    """
    path = SHAPES / f"{name}.json"
    if not path.exists():
        raise ValueError(f"No shape {name!r}; choose one of {names()}.")
    return json.loads(path.read_text())


def parameters(name: str) -> int:
    """Parameters of model ``name``, counted on the meta device (nothing allocated)."""
    import torch
    import transformers

    config = (
        transformers.AutoConfig.from_pretrained(lsc.models.bundled_folder(REAL))
        if name == REAL
        else transformers.AutoConfig.for_model(**shape(name)["config"])
    )
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in hf.parameters())


def build(name: str, *, device: str = "cpu", dtype: str | None = None, seed: int = 0):
    """Model ``name`` as a ``LensModel`` on ``device``.

    Args:
        name: ``REAL`` (loaded with its weights) or a shape's file name.
        device: where to build it; "meta" gives a shape's sizes and dtype with no memory
            behind them (for ``lsc.estimate``; no pass can run on it).
        dtype: None: float32 for ``REAL``, the shape's own dtype otherwise.
        seed: seeds a shape's random weights.

    Returns:
        The model; a shape's is named ``<name>-shape`` and skips the layout self-check (the
        layout is the Llama one the bundled model checks).

    Raises:
        ValueError: an unknown name.
    """
    import torch
    import transformers

    if name == REAL:
        return lsc.load(REAL, device=device, dtype=dtype)
    record = shape(name)
    dtype = dtype or record["dtype"]
    config = transformers.AutoConfig.for_model(**record["config"])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if device == "meta":  # the shapes alone: nothing allocated, no pass can run
        tokenizer = lsc.models.tokenizer_for(REAL)
        return lsc.from_hf(
            hf, tokenizer, name=record["name"], device=device, dtype=dtype, check=False
        )
    hf = hf.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for parameter in hf.parameters():
            if parameter.dim() == 1:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, config.initializer_range, generator=generator)
        for module in hf.modules():
            if hasattr(module, "inv_freq"):  # rotary frequencies: buffers, left empty
                with torch.device(device):
                    fresh = type(module)(module.config)
                for buffer, value in zip(module.buffers(), fresh.buffers(), strict=True):
                    buffer.copy_(value)
    hf.tie_weights()
    tokenizer = lsc.models.tokenizer_for(REAL)
    return lsc.from_hf(hf, tokenizer, name=record["name"], device=device, dtype=dtype, check=False)
