"""Memory plans: what a call will hold at its peak, which batch size fits, and refusing a
run that cannot fit before it allocates anything.

Every method states its *footprint*: what one pass of ``rows`` prompts of ``width`` tokens
holds beyond the loaded weights (``Need``: activations, method buffers, optimizer state),
from the model's shapes and dtype, the prompts' token counts and its options. The
per-prompt methods register theirs with ``@method(planner, memory=...)`` (``FOOTPRINTS``);
``plan`` turns a footprint into an ``Estimate`` (with ``batch_size=None``: the largest batch
whose need fits ``BUDGET_SHARE`` of the available memory), ``check`` refuses an estimate
whose need exceeds the available memory with a message that names the estimate, the memory
available and the ways out. ``estimate`` (``lsc.estimate``) plans any method by name,
without running it: the per-prompt methods, the learned fits and weight importance each
register a whole-call estimate (``ESTIMATES``, ``estimator``).

The byte counts follow the tensors a pass holds, checked against measured peaks
(``benchmarks/scale_ladder.py``: the peak resident memory of a fresh process on CPU,
``torch.cuda.max_memory_allocated`` on a GPU; numbers in benchmarks/RESULTS.md):

- a pass with a backward keeps, per token and layer, about 3 hidden-MLP-width and 8
  residual-width activations (``gradient_pass``), plus float32 copies inside the norms of a
  half-precision model; its backward runs within that;
- a pass without gradients holds one block's activations at a time (``forward_pass``);
- both hold float32 logits at the read positions.

Available memory is CUDA's free memory on a GPU, the host's ``MemAvailable`` on CPU, capped
by the environment variable ``LENSCAPE_MEMORY_LIMIT`` (e.g. ``12GiB``) when it is set:
lenscape then plans as if the machine had only that much (a machine shared with other jobs;
tests pretend to have 1 GiB).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from ..models import LensModel

#: Share of the available memory an automatically chosen batch may plan for: the rest is
#: left to the allocator, caches and everything else on the machine.
BUDGET_SHARE = {"cuda": 0.8, "cpu": 0.5}
#: Largest automatic batch: on CPU bigger batches barely speed up the matrix products and
#: only delay the progress bar; on a GPU they fill the device.
MAX_BATCH = {"cuda": 256, "cpu": 8}
#: The environment variable that caps the memory lenscape plans for.
LIMIT_VARIABLE = "LENSCAPE_MEMORY_LIMIT"
GIB = 2**30
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6}
_UNITS |= {"gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """A size such as "12GiB", "512 MiB", "2e9" or "8G" in bytes.

    Raises:
        ValueError: text that is not a positive size.
    """
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match[2].lower() if match else ""
    try:
        value = float(match[1]) if match else math.nan
    except ValueError:
        value = math.nan
    if not value > 0 or unit not in _UNITS:
        raise ValueError(
            f"{LIMIT_VARIABLE}={text!r} is not a memory size; write e.g. 12GiB, 512MiB or 8e9."
        )
    return int(value * _UNITS[unit])


def free_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_bytes(device: torch.device) -> int:
    """The memory a run on ``device`` may use: ``free_bytes``, capped by
    ``LENSCAPE_MEMORY_LIMIT`` when set.

    Raises:
        ValueError: a ``LENSCAPE_MEMORY_LIMIT`` that is not a size.
    """
    free = free_bytes(device)
    limit = os.environ.get(LIMIT_VARIABLE)
    return free if not limit else min(free, parse_bytes(limit))


def element_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def weight_bytes(model: LensModel) -> int:
    """Bytes of the model's parameters and buffers (a tied matrix once)."""
    tensors = {id(t): t for t in (*model.hf.parameters(), *model.hf.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def d_ff(model: LensModel) -> int:
    """The width of the MLP's hidden layer (4 d_model where the config names none)."""
    config = model.hf.config
    return (
        getattr(config, "intermediate_size", None)
        or getattr(config, "n_inner", None)
        or 4 * model.spec.d_model
    )


def _eager_attention(model: LensModel) -> bool:
    return getattr(model.hf.config, "_attn_implementation", None) == "eager"


def forward_pass(
    model: LensModel, rows: int, width: int, *, dtype: torch.dtype | None = None
) -> int:
    """Bytes of one forward pass without gradients over ``rows`` x ``width`` tokens: one
    block's activations at a time (the MLP's hidden layer a few times over, the attention
    pattern with eager attention) and float32 logits at the read positions.

    Args:
        dtype: the dtype the pass computes in (default: the model's).
    """
    e = element_bytes(dtype or model.dtype)
    spec = model.spec
    per_token = (4 * d_ff(model) + 12 * spec.d_model) * e
    if _eager_attention(model):
        per_token += 2 * spec.n_heads * width * e
    return rows * width * per_token + 2 * rows * spec.vocab_size * 4


def gradient_pass(
    model: LensModel, rows: int, width: int, *, dtype: torch.dtype | None = None
) -> int:
    """Bytes of one forward pass that keeps its graph, and its backward, over ``rows`` x
    ``width`` tokens: per token and layer what the backward needs (about 3 MLP-hidden-width
    and 8 residual-width activations; float32 copies in the norms of a half-precision
    model; the attention pattern with eager attention), plus float32 logits at the read
    positions.

    Args:
        dtype: the dtype the pass computes in (default: the model's).
    """
    e = element_bytes(dtype or model.dtype)
    spec = model.spec
    per_layer = (3 * d_ff(model) + 8 * spec.d_model) * e
    if e < 4:
        per_layer += 2 * spec.d_model * 4
    if _eager_attention(model):
        per_layer += 2 * spec.n_heads * width * e
    return rows * width * spec.n_layers * per_layer + 2 * rows * spec.vocab_size * 4


def loss_logits(model: LensModel, positions: int, *, dtype: torch.dtype | None = None) -> int:
    """Bytes of a next-token loss over ``positions`` positions that is differentiated: the
    logits, their float32 log-probabilities and gradient (and a float32 copy of
    half-precision logits).

    Args:
        dtype: the dtype the pass computes in (default: the model's).
    """
    e = element_bytes(dtype or model.dtype)
    return positions * model.spec.vocab_size * (e + 2 * 4 + (4 if e < 4 else 0))


@dataclass(frozen=True)
class Work:
    """What one call runs: ``n_prompts`` prompts of at most ``width`` tokens, ``rows`` per
    pass; ``n_spans``: the cells of ``positions="spans"`` (named spans and "other"), or
    None when not known (planned as at most ``width``)."""

    rows: int
    width: int
    n_prompts: int
    n_spans: int | None = None


@dataclass(frozen=True)
class Need:
    """Bytes a run needs beyond the loaded weights, by kind.

    Attributes:
        activations: what the model's passes hold (their backward included).
        buffers: what the method keeps besides (kept activations, EAP's sender and gradient
            buffers and score block, the result).
        optimizer: parameters, gradients and optimizer state of a fit.
    """

    activations: int = 0
    buffers: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.activations + self.buffers + self.optimizer

    def __add__(self, other: Need) -> Need:
        return Need(
            self.activations + other.activations,
            self.buffers + other.buffers,
            self.optimizer + other.optimizer,
        )


def largest(*needs: Need) -> Need:
    """The need of a run whose phases (``needs``) run one after the other: the largest."""
    return max(needs, key=lambda need: need.total)


#: A per-prompt method's footprint: ``(model, options, work) -> Need`` of one batch.
Footprint = Callable[["LensModel", Any, Work], Need]
#: Method name -> its footprint (registered by ``registry.method``).
FOOTPRINTS: dict[str, Footprint] = {}


def one_gradient_pass(model: LensModel, options: Any, work: Work) -> Need:
    """The footprint of a method that states none: one pass with a backward per batch."""
    return Need(activations=gradient_pass(model, work.rows, work.width))


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f} GiB"


@dataclass(frozen=True)
class Estimate:
    """The memory plan of one call (``estimate``, ``plan``).

    Attributes:
        method, model, device, dtype: what runs where.
        n_prompts, width: the prompts and the tokens of the longest.
        batch_size: prompts (or rows) per pass the run uses, as asked (a resumed store
            checks it).
        batch_option: the option that sets it ("batch_size", "rows_per_pass").
        chosen: whether the batch was chosen from memory (the option was None).
        weights: bytes of the loaded weights.
        activations, buffers, optimizer: bytes the run needs beyond them (``Need``).
        available: bytes available for the run (``available_bytes``).
        largest_fitting: the largest batch whose need fits ``available`` (0: none).
        need_one: bytes needed with a batch of one.
        rows: rows the largest pass holds, what the need is planned for: ``batch_size``,
            or the prompts when the batch asks for more than there are.
        ways: the method's own ways out of a refusal, between the smaller batch and the
            other device, in words naming its options; empty: those of a per-prompt method
            (fewer or shorter prompts per call, or ``store=``). A fit's are ``fit_ways``.
    """

    method: str
    model: str
    device: str
    dtype: str
    n_prompts: int
    width: int
    batch_size: int
    batch_option: str
    chosen: bool
    weights: int
    activations: int
    buffers: int
    optimizer: int
    available: int
    largest_fitting: int
    need_one: int
    rows: int
    ways: tuple[str, ...] = ()

    @property
    def needed(self) -> int:
        """Bytes beyond the loaded weights."""
        return self.activations + self.buffers + self.optimizer

    @property
    def peak(self) -> int:
        """Predicted peak: weights + what the run needs."""
        return self.weights + self.needed

    @property
    def fits(self) -> bool:
        return self.needed <= self.available

    def __str__(self) -> str:
        how = "chosen from memory" if self.chosen else "given"
        if self.rows < self.batch_size:
            how += f"; a pass holds the {self.rows} prompts"
        return (
            f"{self.method} on {self.model} ({self.device}, {self.dtype}), "
            f"{self.n_prompts} prompts of up to {self.width} tokens, "
            f"{self.batch_option}={self.batch_size} ({how}): peak {_gib(self.peak)} = weights "
            f"{_gib(self.weights)} + activations {_gib(self.activations)} + method buffers "
            f"{_gib(self.buffers)} + optimizer state {_gib(self.optimizer)}; "
            f"{_gib(self.available)} available"
        )

    def refusal(self) -> str:
        """Why the run cannot fit and the ways out."""
        option = self.batch_option
        if self.largest_fitting >= 1:
            smaller = f"{option}={self.largest_fitting} fits"
        else:
            smaller = f"even {option}=1 needs {_gib(self.need_one)}"
        own = self.ways or (
            f"fewer or shorter prompts per call (the longest has {self.width} tokens), or "
            "store='results.zarr' to stream per-prompt results to disk batch by batch",
        )
        ways = [
            f"a smaller batch: {smaller}",
            "bfloat16: lsc.load(..., dtype='bfloat16') halves the weights and activations"
            if self.dtype == "float32"
            else "a smaller dtype or a smaller model",
            *own,
            "another device with more free memory (lsc.load(..., device='cuda'), or a GPU "
            "with more memory)",
        ]
        return (
            f"{self.method} cannot fit: it needs an estimated {_gib(self.needed)} beyond the "
            f"loaded weights ({_gib(self.activations)} activations, {_gib(self.buffers)} "
            f"method buffers, {_gib(self.optimizer)} optimizer state; peak {_gib(self.peak)} "
            f"with the {_gib(self.weights)} of weights) for {self.n_prompts} prompts of up to "
            f"{self.width} tokens with {option}={self.batch_size} on {self.model} "
            f"({self.device}, {self.dtype}), but only {_gib(self.available)} is available on "
            f"{self.device}. Nothing was run. Ways out:\n"
            + "\n".join(f"- {way}" for way in ways)
            + "\n(lsc.estimate(model, method, prompts, ...) plans a call without running it.)"
        )


def plan(
    model: LensModel,
    method: str,
    need: Callable[[int], Need],
    *,
    n_prompts: int,
    width: int,
    batch_size: int | None,
    batch_option: str = "batch_size",
    max_batch: int | None = None,
    max_rows: int | None = None,
) -> Estimate:
    """The memory plan of a call: its batch size and what it needs at its peak.

    Args:
        method: the method's name (for messages).
        need: rows per pass -> what the run needs beyond the weights (its footprint).
        n_prompts, width: the prompts and the tokens of the longest.
        batch_size: the batch the caller asked for; None: the largest of at most
            ``max_batch`` (default: ``n_prompts`` and ``MAX_BATCH`` of the device) whose need
            fits ``BUDGET_SHARE`` of the available memory (at least 1).
        batch_option: the option that sets the batch (for messages).
        max_rows: the most rows a pass holds whatever the batch asks: a batch of prompts
            holds each prompt once, so pass ``n_prompts`` and a larger ``batch_size`` is
            planned (and checked) as that many, never as more than the run holds. None:
            ``batch_size`` rows (a fit's gate sets draw their items again to fill a batch).

    Returns:
        The ``Estimate``; ``check`` refuses it when it cannot fit.
    """
    device = model.device
    available = available_bytes(device)
    cap = max(1, max_batch or min(n_prompts, MAX_BATCH.get(device.type, MAX_BATCH["cpu"])))
    budget = available * BUDGET_SHARE.get(device.type, BUDGET_SHARE["cpu"])
    rows = batch_size or max(1, _largest_within(need, budget, cap))
    held = rows if max_rows is None else min(rows, max_rows)
    chosen_need = need(held)
    return Estimate(
        method,
        model.name,
        str(device),
        str(model.dtype).removeprefix("torch."),
        n_prompts,
        width,
        rows,
        batch_option,
        batch_size is None,
        weight_bytes(model),
        chosen_need.activations,
        chosen_need.buffers,
        chosen_need.optimizer,
        available,
        _largest_within(need, available, max(held, cap)),
        need(1).total,
        held,
    )


def _largest_within(need: Callable[[int], Need], budget: float, cap: int) -> int:
    """The largest batch in 1..``cap`` whose need fits ``budget`` (needs grow with the
    batch), or 0."""
    low, high = 0, cap
    while low < high:
        middle = (low + high + 1) // 2
        if need(middle).total <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def fit_ways(estimate: Estimate, *, batch_size: int, autocast: bool) -> Estimate:
    """``estimate`` of a learned fit (``head_gating``, ``block_masks``) with the fit's own
    ways out of a refusal: it streams nothing (no ``store=``); a pass stacks whole gate sets
    of ``batch_size`` items each, so below that many rows ``rows_per_pass`` alone cannot
    help; ``precision='bfloat16'`` runs the passes of a float32 model under autocast.

    Args:
        batch_size: the fit's items per gate set per update.
        autocast: the fit already runs under bfloat16 autocast.
    """
    halves = estimate.dtype == "float32" and not autocast
    ways = (
        f"fewer items per gate set per update: a pass holds at least batch_size={batch_size} "
        "rows whatever rows_per_pass says (a smaller batch_size changes the fit's minibatches)",
        *(("precision='bfloat16': the fit's passes under bfloat16 autocast",) if halves else ()),
        f"shorter texts (the longest has {estimate.width} tokens)",
    )
    return dataclasses.replace(estimate, ways=ways)


def check(estimate: Estimate) -> None:
    """Refuse a run that cannot fit, before it allocates.

    Raises:
        MemoryError: the estimate needs more than the memory available; the message gives
            the estimate, the memory available and the ways out (``Estimate.refusal``).
    """
    if not estimate.fits:
        raise MemoryError(estimate.refusal())


#: A whole-call estimate: ``(model, prompts, options) -> Estimate``.
Estimator = Callable[["LensModel", Any, dict[str, Any]], Estimate]
#: Method name -> its whole-call estimate (``estimator``; every per-prompt method through
#: ``registry.method``).
ESTIMATES: dict[str, Estimator] = {}
E = TypeVar("E", bound=Estimator)


def estimator(name: str) -> Callable[[E], E]:
    """Register the decorated ``(model, prompts, options) -> Estimate`` as how ``estimate``
    plans the method ``name``."""

    def register(function: E) -> E:
        ESTIMATES[name] = function
        return function

    return register


def _method_name(method: Any) -> str:
    """``method`` as ``ESTIMATES`` knows it: a name as it is, a lenscape function
    (``lsc.ablation``, ``lsc.head_gating``) by its name.

    Raises:
        TypeError: neither a name nor a function.
        ValueError: a name or function with no estimate (the message lists those with one).
    """
    known = sorted(name for name in ESTIMATES if not name.startswith("_"))
    how = (
        "method= takes the name of a method with one or its function (e.g. 'ablation' or "
        f"lsc.ablation): {known}. A method that runs others (faithfulness, edge_agreement) is "
        "estimated by its parts"
    )
    if isinstance(method, str):
        if method not in ESTIMATES:
            raise ValueError(f"No memory estimate for {method!r}; {how}.")
        return method
    if not callable(method) or isinstance(method, type):
        raise TypeError(
            f"method must be a method's name or its function, e.g. 'ablation' or lsc.ablation, "
            f"got {method!r} ({type(method).__name__}); those with an estimate: {known}."
        )
    name = getattr(method, "__name__", "")
    if name not in ESTIMATES or not str(getattr(method, "__module__", "")).startswith("lenscape"):
        raise ValueError(f"No memory estimate for the function {name or method!r}; {how}.")
    return name


def estimate(model: LensModel, method: Any, prompts: Any, **options: Any) -> Estimate:
    """Plan a call's memory without running it: the predicted peak and the batch size.

    ``lsc.estimate(model, "edge_attribution", prompts, batch_size=None)`` says what
    ``lsc.edge_attribution(model, prompts, batch_size=None)`` would hold at its peak, split
    into the loaded weights, the passes' activations, the method's buffers and a fit's
    optimizer state, and which batch size it would use; a run whose estimate cannot fit is
    refused with the same numbers (``check``).

    Args:
        model: a ``LensModel``.
        method: a method by name or by its function: a per-prompt method ("ablation" or
            ``lsc.ablation``, ...), ``head_gating``, ``block_masks`` or ``weight_importance``.
        prompts: the prompts the call would take.
        **options: the call's options (defaults: the method's own).

    Returns:
        An ``Estimate`` (``peak``, ``needed``, ``batch_size``, ``available``, ``fits``;
        ``str()`` gives a summary).

    Raises:
        ValueError: a method with no estimate, or options and prompts the method refuses.
        TypeError: a method that is neither a name nor a function, an option the method
            does not take, or a model that is not a ``LensModel``.
    """
    return ESTIMATES[_method_name(method)](model, prompts, options)


def auto_variants_per_pass(model: LensModel, *, rows: int, width: int, wanted: int) -> int:
    """Copies of a ``rows``-prompt batch that one pass without gradients stacks (1 ..
    ``wanted``): as many as fit ``BUDGET_SHARE`` of the available memory, each copy a
    forward pass of its own plus the residual stream it resumes from."""
    device = model.device
    budget = available_bytes(device) * BUDGET_SHARE.get(device.type, BUDGET_SHARE["cpu"])
    resumed = rows * width * model.spec.d_model * element_bytes(model.dtype)
    per_copy = forward_pass(model, rows, width) + resumed
    return max(1, min(wanted, int(budget // per_copy)))
