"""The ``LensModel`` type alone, in a leaf module.

``models`` builds one; the self-check, ``_parts``, ``schema`` and ``_validate`` only name the
type. Keeping it here (importing nothing of lenscape but ``_layouts``) means none of them
imports ``models``, so there is no import circle, not even a type-only one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._layouts import ModelSpec


@dataclass(eq=False)  # identity semantics: the capture seam keeps per-model state by model
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
        layout_checked: whether the layout self-check (``lsc.check``) passed on this
            model; results record it in their ``layout_checked`` attr.
    """

    hf: Any
    tokenizer: Any
    spec: ModelSpec
    name: str
    device: torch.device
    dtype: torch.dtype
    recipe: Callable[[], LensModel] | None = field(default=None, repr=False)
    layout_checked: bool = False

    def module(self, path: str, layer: int | None = None) -> torch.nn.Module:
        """The submodule at ``path`` (relative to block ``layer`` when given)."""
        if layer is not None:
            path = f"{self.spec.layout.layers}.{layer}.{path}"
        return self.hf.get_submodule(path)

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"LensModel({self.name!r}, {s.architecture}, {s.n_layers} layers x {s.n_heads} "
            f"heads ({s.n_kv_heads} KV), d_model {s.d_model}, {self.device}, {self.dtype})"
        )
