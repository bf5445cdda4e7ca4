"""The machine a result, a recording or a timing was made on, described in one place.

``describe_machine()`` reads the CPU (model, vendor, cores, widest vector extension), the
vector extension torch dispatches to, the RAM and the GPU once per process, and every
provenance string lenscape writes comes from it: ``str(machine)`` is the ``machine`` attr
of recordings and the machine line of benchmarks/RESULTS.md ("AMD EPYC, 2-core CPU (AVX2),
24 GiB RAM"), ``machine.short`` the ``machine`` column of its tables ("2-core CPU (AVX2),
24 GiB") and ``machine.kind`` the CPU kind a recording's checkpoint names ("AuthenticAMD
AVX2": a fit is bit-reproducible only on the same kind, at the same torch thread count).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

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
