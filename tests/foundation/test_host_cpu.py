"""The CPU's ISA class follows MLAS's kernel dispatch (microsoft/onnxruntime onnxruntime/core/mlas/lib/platform.cpp,
see pipeline/host/cpu.py), read from CPUID registers: captured here from real / emulated CPUs."""

import pytest

from pipeline.host import cpu
from pipeline.host.cpu import ISA_CLASSES, U8S8_SATURATING, _arm_class, _x86_class, _x86_flags_from_cpuid

# CPUID (eax, ebx, ecx, edx) of leaves 1, 7.0, 7.1 and XCR0, captured with cpuid-native
SAPPHIRE_RAPIDS = {"1": (0xA0671, 0x20800, 0xFFFA3203, 0x1F8BFBFF), "7.0": (0x2, 0xF1BF2FFB, 0x1A415F46, 0x23C14010),
                   "7.1": (0x1C30, 0, 0, 0x84000), "xcr0": 0x600E7}        # this project's machine (AMX)
QEMU_HASWELL = {"1": (0x306C4, 0x800, 0xFED83203, 0x78BFBFD), "7.0": (0, 0x3A9, 0, 0), "7.1": (0, 0, 0, 0),
                "xcr0": 0x7}                                                # qemu-x86_64 -cpu Haswell (TCG)


def regs(base, **over):
    r = dict(base)
    r.update(over)
    return r


def cls(r):
    return _x86_class(_x86_flags_from_cpuid(r))


def test_captured_cpus():
    assert cls(SAPPHIRE_RAPIDS) == "x86_64-amx"
    assert _x86_flags_from_cpuid(SAPPHIRE_RAPIDS) >= {"avx2", "fma", "avx_vnni", "avx512_vnni", "amx_int8"}
    assert cls(QEMU_HASWELL) == "x86_64-avx2"
    assert _x86_flags_from_cpuid(QEMU_HASWELL) == {"avx", "fma", "avx2"}


def test_each_mlas_branch():
    a, b, c, d = SAPPHIRE_RAPIDS["7.0"]
    no_amx = (a, b, c, d & ~(3 << 24))
    # AMX bits without the OS enabling tile state (XCR0 bits 17/18): MLAS does not use AMX
    assert cls(regs(SAPPHIRE_RAPIDS, xcr0=0xE7)) == "x86_64-avx512vnni"
    assert cls(regs(SAPPHIRE_RAPIDS, **{"7.0": no_amx})) == "x86_64-avx512vnni"
    # AVX-512 without VNNI (Skylake-SP): MlasGemmU8S8KernelAvx512Core, which saturates
    skx = (a, b, c & ~(1 << 11), d & ~(3 << 24))
    assert cls(regs(SAPPHIRE_RAPIDS, **{"7.0": skx, "7.1": (0, 0, 0, 0)})) == "x86_64-avx512"
    # no AVX-512 state saved by the OS: the 256-bit branches; AVX-VNNI (CPUID.7.1:EAX bit 4) is exact
    assert cls(regs(SAPPHIRE_RAPIDS, xcr0=0x7)) == "x86_64-avxvnni"
    assert cls(regs(SAPPHIRE_RAPIDS, xcr0=0x7, **{"7.1": (0, 0, 0, 0)})) == "x86_64-avx2"
    # no AVX2/FMA, or AVX not enabled by the OS: the SSE kernels
    assert cls(regs(QEMU_HASWELL, **{"7.0": (0, 0x3A9 & ~(1 << 5), 0, 0)})) == "x86_64-sse2"
    assert cls(regs(QEMU_HASWELL, xcr0=0x3)) == "x86_64-sse2"


def test_saturating_classes_are_exactly_the_vpmaddubsw_ones():
    assert U8S8_SATURATING == {"x86_64-avx2", "x86_64-avx512"}
    assert U8S8_SATURATING <= set(ISA_CLASSES)


def test_arm_classes():
    assert _arm_class(frozenset({"asimd"})) == "aarch64"
    assert _arm_class(frozenset({"asimd", "asimddp"})) == "aarch64-dotprod"
    assert _arm_class(frozenset({"asimd", "asimddp", "i8mm"})) == "aarch64-i8mm"


def test_this_machine():
    isa = cpu.cpu_isa()
    assert isa["class"] in ISA_CLASSES or isa["source"] == "platform"
    facts = cpu.cpu_facts()
    assert facts["isa_class"] == cpu.cpu_isa_class() == isa["class"] and facts["cpu_model"]
    if cpu.platform.machine() == "x86_64":
        assert isa["source"] == "cpuid", "cpuid-native is a dependency on x86-64 (pyproject.toml)"


def test_proc_cpuinfo_is_only_the_fallback(monkeypatch):
    """Without cpuid-native the flags come from /proc/cpuinfo (and say so): the doctor warns about it."""
    if cpu.platform.machine() != "x86_64":
        pytest.skip("x86-64 only")
    cpu.cpu_isa.cache_clear()
    monkeypatch.setattr(cpu, "_x86_cpuid", lambda: None)
    try:
        isa = cpu.cpu_isa()
        assert isa["source"] == "/proc/cpuinfo"
        assert set(isa["flags"]) <= cpu.ISA_FLAG_NAMES
    finally:
        cpu.cpu_isa.cache_clear()


def test_isa_dependent_stages_name_the_class_in_their_key():
    """build (ORT's optimised graph) and evaluate (measured numbers) are keyed by the ISA class; the quantized file
    is the same for every CPU; validate / package follow evaluate through its digest."""
    from pipeline.recipe import resolve
    from pipeline.stages import flow_for

    r = resolve("smollm2-135m-int8")
    hw = {s.name: s.hardware(r) for s in flow_for("onnxruntime")}
    isa = f"cpu:{cpu.cpu_isa_class()}"
    assert hw["build"] == hw["evaluate"] == isa
    assert hw["quantize"] == f"cpu:{cpu.platform.machine()}"
    assert hw["validate"] == hw["package"] == "any"


def test_plan_shows_the_hardware(monkeypatch, tmp_path):
    import json

    from typer.testing import CliRunner

    from pipeline.cli import app
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(app, ["plan", "smollm2-135m-int8", "--json"])
    assert res.exit_code == 0, res.output
    stages = {s["name"]: s for s in json.loads(res.output)["stages"]}
    assert stages["evaluate"]["hardware"] == stages["build"]["hardware"] == f"cpu:{cpu.cpu_isa_class()}"
    res = CliRunner().invoke(app, ["plan", "smollm2-135m-int8"])
    assert f"cpu:{cpu.cpu_isa_class()}" in res.output
