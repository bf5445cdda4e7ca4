"""The machine a result, a recording or a timing was made on, described in one place.

``describe_machine()`` reads the CPU (model, vendor, cores, widest vector extension), the
vector extension torch dispatches to, the RAM and the GPU once per process, and every
provenance string lenscape writes comes from it: ``str(machine)`` is the ``machine`` attr
of recordings and the machine line of benchmarks/RESULTS.md ("AMD EPYC, 2-core CPU (AVX2),
24 GiB RAM"), ``machine.short`` the ``machine`` column of its tables ("2-core CPU (AVX2),
24 GiB") and ``machine.kind`` the CPU kind a recording's checkpoint names ("AuthenticAMD
AVX2": a fit is bit-reproducible only on the same kind, at the same torch thread count).

``measure_speed(model)`` times how fast this machine runs a loaded model (one forward and
backward pass of a fixed batch, about a second): notebooks size their live work from it,
so that a slower CPU does less within the same wall time (``Speed.affordable``).
"""

from __future__ import annotations

import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import _validate

if TYPE_CHECKING:  # the type alone: lens_model is a leaf, imported at run time by the loader
    from .lens_model import LensModel

#: Vector extensions that change CPU timings most, best first (/proc/cpuinfo flag -> name).
VECTOR_FLAGS = {
    "amx_bf16": "AMX-BF16",
    "avx512_bf16": "AVX512-BF16",
    "avx512f": "AVX512",
    "avx2": "AVX2",
}


@dataclass(frozen=True)
class Machine:
    """A machine, as provenance describes it.

    Attributes:
        cpu: the CPU model ("AMD EPYC"; the platform's name where /proc/cpuinfo is absent).
        vendor: the CPU vendor ("AuthenticAMD", "GenuineIntel"; "unknown" where unread).
        cores: logical cores.
        vector: the widest vector extension the CPU has (a value of ``VECTOR_FLAGS``), or
            None: float32 matmul speed and whether bfloat16 runs on hardware depend on it.
        torch_isa: the vector extension torch dispatches to ("AVX2", "AVX512", ...): with the
            vendor, what a fit's float rounding depends on.
        ram_gib: total RAM in GiB, or None where unread.
        gpu: the CUDA device's name, or None.
    """

    cpu: str
    vendor: str
    cores: int
    vector: str | None
    torch_isa: str
    ram_gib: int | None
    gpu: str | None

    @property
    def _cores(self) -> str:
        return f"{self.cores}-core CPU" + (f" ({self.vector})" if self.vector else "")

    @property
    def _ram(self) -> str:
        return f"{self.ram_gib} GiB" if self.ram_gib is not None else "unknown"

    def __str__(self) -> str:
        """The one-line description: "AMD EPYC, 2-core CPU (AVX2), 24 GiB RAM[, GPU X]"."""
        gpu = f", GPU {self.gpu}" if self.gpu else ""
        return f"{self.cpu}, {self._cores}, {self._ram} RAM{gpu}"

    @property
    def short(self) -> str:
        """The short form for a table's ``machine`` column: "2-core CPU (AVX2), 24 GiB"."""
        return f"{self._cores}, {self._ram}" + (f", {self.gpu}" if self.gpu else "")

    @property
    def kind(self) -> str:
        """The CPU kind a fit's rounding depends on: "AuthenticAMD AVX2"."""
        return f"{self.vendor} {self.torch_isa}"


def _fields(text: str) -> dict[str, str]:
    """The first value of each ``key : value`` line of a /proc file."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def read_machine(cpuinfo: Path, meminfo: Path) -> Machine:
    """Describe this machine from its /proc files (torch and the OS for the rest).

    Args:
        cpuinfo: the ``/proc/cpuinfo`` to read (another path in tests).
        meminfo: the ``/proc/meminfo`` to read.

    Returns:
        The ``Machine``; what a file does not say is "unknown" or None.
    """
    cpu, memory = _fields(_read(cpuinfo)), _fields(_read(meminfo))
    flags = set(cpu.get("flags", "").split())
    ram_kib = memory.get("MemTotal", "").split()
    return Machine(
        cpu=cpu.get("model name") or platform.processor() or platform.machine(),
        vendor=cpu.get("vendor_id", "unknown"),
        cores=os.cpu_count() or 1,
        vector=next((name for flag, name in VECTOR_FLAGS.items() if flag in flags), None),
        torch_isa=torch.backends.cpu.get_cpu_capability(),
        ram_gib=round(int(ram_kib[0]) / 2**20) if ram_kib else None,
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )


@functools.cache
def describe_machine() -> Machine:
    """This machine, read once per process: the one description every provenance uses.

    Returns:
        The ``Machine`` (``str()`` for the one-line description, ``.short``, ``.kind``).
    """
    return read_machine(Path("/proc/cpuinfo"), Path("/proc/meminfo"))


#: The speed probe's batch: rows x tokens of fixed token ids, the size of a fit's minibatch
#: of short prompts (FACTS.md: SmolLM2's forward and backward of 8 x 32 tokens takes 2 to 3 s
#: on 2 cores).
PROBE_ROWS, PROBE_TOKENS = 8, 32
#: Most passes one probe times: enough for a stable median within ``seconds``; more only
#: adds time on a fast machine.
MAX_PROBE_PASSES = 20


@dataclass(frozen=True)
class Speed:
    """How fast this machine runs a model: one probe pass, from ``measure_speed``.

    Attributes:
        seconds: the median wall time of one probe pass (forward and backward of
            ``PROBE_ROWS`` x ``PROBE_TOKENS`` tokens through the whole model).
        passes: how many passes were timed (after one warm-up pass).
        threads: torch's thread count during the probe.
        model: the model's name.
    """

    seconds: float
    passes: int
    threads: int
    model: str

    def affordable(self, budget: float, passes_each: float, *, most: int, least: int = 1) -> int:
        """How many units of work fit in ``budget`` seconds at this speed.

        Args:
            budget: wall seconds for the work.
            passes_each: what one unit costs, in probe passes (measured once beside the
                probe: the ratio of their times hardly depends on the machine).
            most: the count wanted (the setting's own); least: the count never gone below.

        Returns:
            ``floor(budget / (passes_each x seconds))``, clipped to [``least``, ``most``].
        """
        if not (budget > 0 and passes_each > 0 and 1 <= least <= most):
            raise ValueError(
                f"affordable needs budget > 0, passes_each > 0 and 1 <= least <= most, got "
                f"budget={budget!r}, passes_each={passes_each!r}, least={least!r}, most={most!r}."
            )
        return max(least, min(most, math.floor(budget / (passes_each * self.seconds))))

    def __str__(self) -> str:
        """One line: '0.84 s per probe pass (smollm2-135m, 8 x 32 tokens forward and
        backward, 2 torch threads)'."""
        return (
            f"{self.seconds:.2f} s per probe pass ({self.model}, {PROBE_ROWS} x {PROBE_TOKENS} "
            f"tokens forward and backward, {self.threads} torch threads)"
        )


def measure_speed(
    model: LensModel, *, seconds: float = 1.0, clock: Callable[[], float] = time.perf_counter
) -> Speed:
    """Time how fast this machine runs ``model``: forward and backward passes of a fixed batch.

    The batch is ``PROBE_ROWS`` x ``PROBE_TOKENS`` fixed token ids; the backward goes to the
    input embeddings (the weights stay frozen), as a gate fit's does to its gates. One
    warm-up pass, then passes until ``seconds`` have gone by (at least 3, at most
    ``MAX_PROBE_PASSES``); the median is kept, so one pass slowed by another program does
    not decide it.

    Args:
        model: a loaded ``LensModel`` (its device and dtype are the ones timed).
        seconds: about how long to time, after the warm-up (> 0).
        clock: the clock (seconds); tests pass a fake one.

    Returns:
        The ``Speed``.

    Raises:
        TypeError, ValueError: ``seconds`` not a finite number > 0.
    """
    seconds = _validate.number("seconds", seconds, above=0)
    hf = model.hf
    n = PROBE_ROWS * PROBE_TOKENS
    ids = (torch.arange(n) * 7919 % hf.config.vocab_size).view(PROBE_ROWS, PROBE_TOKENS)
    ids = ids.to(model.device)
    embeds = hf.get_input_embeddings()(ids).detach().requires_grad_(True)

    def one_pass() -> float:
        began = clock()
        logits = hf(inputs_embeds=embeds).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten()
        )
        torch.autograd.grad(loss, embeds)
        if embeds.device.type == "cuda":
            torch.cuda.synchronize(embeds.device)
        return clock() - began

    one_pass()  # warm-up: first-call allocations and kernel selection
    times: list[float] = []
    while len(times) < MAX_PROBE_PASSES and (len(times) < 3 or sum(times) < seconds):
        times.append(one_pass())
    return Speed(statistics.median(times), len(times), torch.get_num_threads(), model.name)
