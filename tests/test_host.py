"""The one description of the machine (models/host.py), used by every provenance."""

from __future__ import annotations

import pytest
import torch

from lenscape.models import host


def test_a_machine_reads_as_one_line_a_short_form_and_a_cpu_kind(tmp_path):
    cpuinfo, meminfo = tmp_path / "cpuinfo", tmp_path / "meminfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu sse2 avx avx2 fma\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\n"
    )
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\n")
    machine = host.read_machine(cpuinfo, meminfo)
    cores = f"{machine.cores}-core CPU (AVX2)"
    assert str(machine).startswith(f"AMD EPYC, {cores}, 23 GiB RAM")
    assert machine.short.startswith(f"{cores}, 23 GiB")
    assert machine.kind == f"AuthenticAMD {machine.torch_isa}"


def test_the_machine_names_its_widest_vector_extension(tmp_path):
    """CPU timings depend on AVX2 vs AVX512 vs bfloat16 units, so the description names them."""
    cpuinfo, absent = tmp_path / "cpuinfo", tmp_path / "absent"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16\n")
    assert host.read_machine(cpuinfo, absent).vector == "AVX512-BF16"
    cpuinfo.write_text("flags\t\t: fpu sse2\n")
    bare = host.read_machine(cpuinfo, absent)
    assert bare.vector is None and bare.ram_gib is None and bare.vendor == "unknown"
    assert "-core CPU, unknown RAM" in str(bare)


def test_every_provenance_uses_the_one_description():
    assert host.describe_machine() is host.describe_machine()  # read once per process
    assert str(host.describe_machine()).count(",") >= 2


# --------------------------------------------------- how fast this machine runs a model (issue 43)


def test_the_speed_probe_times_forward_and_backward_passes_and_keeps_the_median(tiny_llama):
    """A fake clock: every pass reads it twice; pass i takes i seconds after a 100-s warm-up
    (which is not kept). Passes run until 5 s have gone by (1 + 2 + 3 = 6 > 5): median 2."""
    readings = iter([0.0, 100.0, 0.0, 1.0, 0.0, 2.0, 0.0, 3.0])
    calls = []
    # The instance's own forward, if any (nnsight's controller once a backend has booted on
    # this session model): put back afterwards, or the next nnsight pass never sees the
    # model's output.
    own = vars(tiny_llama.hf).get("forward")
    forward = tiny_llama.hf.forward

    def counted(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(out.logits.requires_grad)  # the pass keeps a graph for the backward
        return out

    tiny_llama.hf.forward = counted
    try:
        speed = host.measure_speed(tiny_llama, seconds=5, clock=lambda: next(readings))
    finally:
        if own is None:
            del tiny_llama.hf.forward
        else:
            tiny_llama.hf.forward = own
    assert (speed.seconds, speed.passes, speed.model) == (2.0, 3, tiny_llama.name)
    assert calls == [True] * 4 and speed.threads == torch.get_num_threads()
    assert str(speed).startswith("2.00 s per probe pass (")
    assert "8 x 32 tokens forward and backward" in str(speed)


def test_the_probe_measures_the_real_model_within_its_pass_ceiling(tiny_llama):
    speed = host.measure_speed(tiny_llama, seconds=0.01)
    assert 3 <= speed.passes <= host.MAX_PROBE_PASSES and 0 < speed.seconds < 5
    assert not any(p.grad is not None for p in tiny_llama.hf.parameters())  # weights untouched
    for bad, error in ((0, ValueError), (float("nan"), ValueError), ("1", TypeError)):
        with pytest.raises(error, match="seconds must be"):
            host.measure_speed(tiny_llama, seconds=bad)


def test_affordable_work_scales_with_speed_within_its_bounds():
    """At 0.5 s per probe pass, a unit of 4 passes takes 2 s: 60 s afford 30 units; half as
    fast, 15; never more than the setting asks, never fewer than its least."""
    fast = host.Speed(seconds=0.5, passes=3, threads=2, model="m")
    slow = host.Speed(seconds=1.0, passes=3, threads=1, model="m")
    assert fast.affordable(60, 4, most=100) == 30
    assert slow.affordable(60, 4, most=100) == 15
    assert fast.affordable(60, 4, most=20) == 20
    assert slow.affordable(1, 4, most=20, least=5) == 5
    with pytest.raises(ValueError, match="affordable needs budget > 0"):
        fast.affordable(-1, 4, most=20)
    with pytest.raises(ValueError, match="1 <= least <= most"):
        fast.affordable(60, 4, most=2, least=3)
