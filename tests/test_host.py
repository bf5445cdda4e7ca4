"""The one description of the machine (models/host.py), used by every provenance."""

from __future__ import annotations

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
