"""The ``LensModel`` type alone, in a leaf module (it imports only ``layouts``).

``loader`` builds one; the self-check and ``parts`` only name the type. What a result needs
to know of the model it was measured on (its provenance attrs, its context length) is asked
of the model itself, so the layers below (``schema``, ``_validate``) never name the type:
no import circle, not even a type-only one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from .layouts import ModelSpec

#: Values of each parameter that ``weights_fingerprint`` hashes, evenly spaced through it.
FINGERPRINT_SAMPLE = 256


def weights_fingerprint(module: torch.nn.Module) -> str:
    """SHA-256 (64 hex digits) of a module's weights, cheap enough to take on every load.

    For every parameter, in the module's order: its name and shape, ``FINGERPRINT_SAMPLE``
    evenly spaced values, and the sum of the bit patterns of all its values (an integer sum
    modulo 2**32: exact in any order, so the same on every device and thread count, and
    changed by a change to any one value). Values are read as float32, so the same weights
    give the same fingerprint whatever the device; another dtype's rounding gives another.

    Args:
        module: the model (e.g. ``LensModel.hf``).

    Returns:
        The hex digest.
    """
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in module.named_parameters():
            values = param.detach().reshape(-1)
            step = max(1, values.numel() // FINGERPRINT_SAMPLE)
            sample = values[::step][:FINGERPRINT_SAMPLE].float().cpu().numpy().astype("<f4")
            digest.update(f"{name}{tuple(param.shape)}:{_bit_sum(values)}:".encode())
            digest.update(sample.tobytes())
    return digest.hexdigest()


def _bit_sum(values: torch.Tensor) -> int:
    """Sum modulo 2**32 (as a signed 32-bit integer) of the float32 bit patterns of
    ``values`` (1-D). A bfloat16 value's float32 pattern is its own 16 bits shifted up by
    16, so its sum is taken on the 16-bit patterns, with no float32 copy; on a CPU by
    numpy, whose integer sums are about 8 times faster than torch's (together: 18 s -> about
    2 s on a Llama-3-8B shape in bfloat16, one thread)."""
    if values.dtype == torch.bfloat16:
        patterns, shift = values.view(torch.int16), 16
    else:
        patterns, shift = values.float().view(torch.int32), 0
    if patterns.device.type == "cpu":
        total = int(patterns.numpy().sum(dtype=np.int32))  # wraps: exact modulo 2**32
    else:
        total = int(patterns.sum(dtype=torch.int32))
    return ((total << shift) + 2**31) % 2**32 - 2**31


#: A public function's type, kept by ``in_one_call``.
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(eq=False)  # identity semantics: the capture seam keeps per-model state by model
class LensModel:
    """A causal LM ready for capture.

    Attributes:
        hf: the Hugging Face ``PreTrainedModel`` (eval mode, parameters frozen).
        tokenizer: its tokenizer (a pad token is always set).
        spec: sizes and layout.
        name: bundled name, HF id or folder it came from.
        device, dtype (read-only): where and in which precision it runs, read from the
            parameters each time (a ``model.hf.to(torch.bfloat16)`` is seen at once).
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
    recipe: Callable[[], LensModel] | None = field(default=None, repr=False)
    layout_checked: bool = False
    #: ``weights_fingerprint`` with the parameters' (address, version) it was taken at,
    #: kept only inside a call (``one_call``).
    _weights: tuple[tuple[tuple[int, int], ...], str] | None = field(
        default=None, init=False, repr=False
    )
    #: ``dtype`` as first read inside a call, kept until the call ends (``one_call``).
    _dtype: torch.dtype | None = field(default=None, init=False, repr=False)
    #: How many ``one_call`` blocks are open (calls nest: a report runs its parts).
    _calls: int = field(default=0, init=False, repr=False)

    def module(self, path: str, layer: int | None = None) -> torch.nn.Module:
        """The submodule at ``path`` (relative to block ``layer`` when given)."""
        if layer is not None:
            path = f"{self.spec.layout.layers}.{layer}.{path}"
        return self.hf.get_submodule(path)

    @property
    def device(self) -> torch.device:
        """The device of the parameters (of the first one; ``lsc.load`` puts all on one)."""
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The floating-point dtype holding most of the parameters' values: read anew
        outside a call (a cast is seen at once), once per call inside one (``one_call``;
        a pass reads it hundreds of times, and walking the parameters costs about 3 ms on
        SmolLM2-135M each time)."""
        if self._calls and self._dtype is not None:
            return self._dtype
        counts: dict[torch.dtype, int] = {}
        for param in self.hf.parameters():
            if param.is_floating_point():
                counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
        dtype = max(counts, key=counts.__getitem__) if counts else torch.float32
        if self._calls:
            self._dtype = dtype
        return dtype

    @property
    def weights_fingerprint(self) -> str:
        """SHA-256 of the weights (``weights_fingerprint``): the same for the same weights
        loaded again, another for a model of the same name and layout with other weights
        (values are read as float32: a cast that rounds any value changes it; stores and
        checkpoints record ``dtype`` beside it).

        Outside a call it is taken anew on every read, so any change is seen, writes
        through ``param.data`` too (they move no version counter). Inside a call
        (``one_call``: every public function runs in one) it is taken once when first read
        and kept while no parameter is replaced or changed in place by a tracked write; so
        each call hashes the weights once: about 0.03 s on SmolLM2-135M and 1.9 s on a
        Llama-3-8B shape in bfloat16 (one CPU thread; benchmarks/RESULTS.md "Model identity").
        """
        if self._calls == 0:
            return weights_fingerprint(self.hf)
        params = list(self.hf.parameters())
        if any(p.is_inference() for p in params):  # made under inference_mode: no versions
            return weights_fingerprint(self.hf)
        state = tuple((p.data_ptr(), p._version) for p in params)
        if self._weights is None or self._weights[0] != state:
            self._weights = (state, weights_fingerprint(self.hf))
        return self._weights[1]

    @contextlib.contextmanager
    def one_call(self) -> Iterator[LensModel]:
        """The block one public call runs in: the weights are hashed once, at the first
        read of ``weights_fingerprint`` inside the outermost block, and kept for the
        call's results, stores and checkpoints (a call that edits its own weights in
        place by a tracked write, as ``finetune``'s optimizer, gets a new hash); ``dtype``
        is read once too."""
        if self._calls == 0:
            self._weights, self._dtype = None, None
        self._calls += 1
        try:
            yield self
        finally:
            self._calls -= 1

    @property
    def origin(self) -> dict[str, str]:
        """What a result records of the model it was computed on, checked when the result is
        passed back in (``_validate.result``'s ``origin``): name, layout and weights
        fingerprints, under their attr names."""
        return {
            "model": self.name,
            "layout_fingerprint": self.spec.fingerprint,
            "weights_fingerprint": self.weights_fingerprint,
        }

    def provenance(self, method: str, *, backend: str = "torch", **params: Any) -> dict[str, Any]:
        """Attrs naming what produced a result (``schema.PROVENANCE_ATTRS`` and ``params``):
        ``method``, ``model``, ``architecture``, ``layout_fingerprint``
        (``ModelSpec.fingerprint``, checked when the result is passed back in),
        ``weights_fingerprint`` (SHA-256 of the weights: tells apart models of the same
        name and layout), ``layout_checked`` (whether the layout self-check passed: a model
        loaded with ``check=False`` may be measured at the wrong places), ``backend`` and
        ``dtype`` (e.g. "float32"), then ``params`` (scalars). ``schema.make`` adds
        ``lenscape_version`` and ``schema_version``."""
        return {
            "method": method,
            "model": self.name,
            "architecture": self.spec.architecture,
            "layout_fingerprint": self.spec.fingerprint,
            "weights_fingerprint": self.weights_fingerprint,
            "layout_checked": bool(self.layout_checked),
            "backend": backend,
            "dtype": str(self.dtype).removeprefix("torch."),
            **params,
        }

    @property
    def context_length(self) -> int | None:
        """The most positions the model attends over (from its HF config), or None."""
        config = self.hf.config
        for key in ("max_position_embeddings", "n_positions", "n_ctx"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def check_context(self, token_counts: Sequence[int], *, what: str = "prompt") -> None:
        """Refuse prompts longer than the context (GPT-2's position embedding would raise an
        IndexError; rotary models would run past their trained positions silently).

        Args:
            token_counts: tokens per prompt, in prompt order.
            what: what was tokenized, for the message (e.g. "text", "corrupt text").

        Raises:
            ValueError: the first prompt longer than the context, with its index.
        """
        limit = self.context_length
        if limit is None:
            return
        for index, count in enumerate(token_counts):
            if count > limit:
                raise ValueError(
                    f"Prompt {index}: the {what} is {count} tokens long, more than "
                    f"the {limit} positions model {self.name!r} was trained on; "
                    "shorten it or split it into several prompts."
                )

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"LensModel({self.name!r}, {s.architecture}, {s.n_layers} layers x {s.n_heads} "
            f"heads ({s.n_kv_heads} KV), d_model {s.d_model}, {self.device}, {self.dtype})"
        )


def in_one_call(function: F) -> F:
    """Run ``function`` inside ``LensModel.one_call`` of every ``LensModel`` among its
    arguments: a public function that takes models hashes each model's weights once per
    call, however often its parts read the fingerprint."""

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        models = [value for value in (*args, *kwargs.values()) if isinstance(value, LensModel)]
        with contextlib.ExitStack() as stack:
            for model in dict.fromkeys(models):  # each model once (identity)
                stack.enter_context(model.one_call())
            return function(*args, **kwargs)

    return wrapped  # type: ignore[return-value]
