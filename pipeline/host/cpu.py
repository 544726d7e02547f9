"""What of the CPU changes numbers: its name (``cpu_model``), flags (``cpu_flags``) and ISA class
(``cpu_isa_class``, ``cpu_facts``)."""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (Linux); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


def cpu_model() -> str:
    """The CPU's name: CPUID's brand string on x86 (what the CPU running this process says it is, also under an
    emulator), else /proc/cpuinfo's model name."""
    regs = _x86_cpuid()
    if regs is not None and regs.get("brand"):
        return regs["brand"]
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """CPU feature flags as the kernel reports them (x86 ``flags``, Arm ``Features``)."""
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


# ------------------------------------------------------------------------------------------ ISA class
#
# ONNX Runtime's CPU kernels (MLAS) choose their int8 GEMM kernels from CPUID when the library loads, and those
# kernels do not all compute the same numbers: on AVX2 and AVX-512 without VNNI, u8 x s8 products are summed in
# pairs into saturating 16-bit lanes (vpmaddubsw), so full-range int8 weights lose accuracy; with VNNI or AMX
# the sums are exact 32-bit. The FP32 kernels differ too (FMA3 vs AVX-512F), in the last bits. The ISA class
# names the branch MLAS takes, checked exactly as MLAS checks it (CPU bit and OS support in XCR0):
#   microsoft/onnxruntime onnxruntime/core/mlas/lib/platform.cpp @ 0112bef28c2dad7e501228b204adbde008f7d994,
#   MLAS_PLATFORM::MLAS_PLATFORM():
#     x86_64-sse2       no AVX2/FMA: MlasGemmU8X8DispatchSse (16-bit widening, exact)
#     x86_64-avx2       CPUID.1:ECX.FMA + CPUID.7.0:EBX.AVX2, XCR0 & 0x6: MlasGemmU8S8KernelAvx2 (saturates)
#     x86_64-avxvnni    + CPUID.7.1:EAX.AVX-VNNI (bit 4): MlasGemmU8S8KernelAvxVnni (exact)
#     x86_64-avx512     + AVX512F/BW/DQ/VL (EBX 0xC0030000), XCR0 & 0xE0: MlasGemmU8S8KernelAvx512Core (saturates)
#     x86_64-avx512vnni + CPUID.7.0:ECX.AVX512_VNNI (bit 11): MlasGemmU8S8KernelAvx512Vnni (exact)
#     x86_64-amx        + CPUID.7.0:EDX.AMX-TILE/AMX-INT8 (bits 24, 25), XCR0 & XTILE: MlasGemmU8S8DispatchAmx
#   aarch64 (MLAS reads HWCAP, which the kernel lists as /proc/cpuinfo Features):
#     aarch64-i8mm (ummla/smmla; signed int8 activations for MatMulNBits), aarch64-dotprod (udot/sdot), aarch64
# CPUID is read through the cpuid-native package, not /proc/cpuinfo: an emulator (qemu-user) reports the CPU it
# emulates through CPUID, which is what ONNX Runtime sees, while /proc/cpuinfo shows the host's flags.

ISA_CLASSES = ("x86_64-sse2", "x86_64-avx2", "x86_64-avxvnni", "x86_64-avx512", "x86_64-avx512vnni", "x86_64-amx",
               "aarch64", "aarch64-dotprod", "aarch64-i8mm")
# classes whose MLAS u8 x s8 kernel sums in saturating 16-bit lanes (no VNNI / AMX)
U8S8_SATURATING = frozenset({"x86_64-avx2", "x86_64-avx512"})


def _bit(reg: int, n: int) -> bool:
    return bool((reg >> n) & 1)


@lru_cache(maxsize=1)
def _x86_cpuid() -> dict | None:
    """Raw CPUID leaves 1, 7.0, 7.1, XCR0 and the brand string; None off x86 or without cpuid-native."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return None
    try:
        import cpuid_native
    except ImportError:
        return None

    def leaf(n: int, sub: int = 0) -> tuple[int, int, int, int]:
        _, a, b, c, d = cpuid_native.get_cpuid_count(n, sub)
        return a, b, c, d

    max_leaf = leaf(0)[0]
    out = {"1": leaf(1), "7.0": leaf(7, 0) if max_leaf >= 7 else (0, 0, 0, 0),
           "7.1": leaf(7, 1) if max_leaf >= 7 else (0, 0, 0, 0)}
    osxsave = _bit(out["1"][2], 27)
    out["xcr0"] = cpuid_native.xgetbv(0) if osxsave else 0
    brand = ""
    if leaf(0x80000000)[0] >= 0x80000004:
        import struct
        brand = b"".join(struct.pack("<4I", *leaf(0x80000002 + i)) for i in range(3)).split(b"\0")[0]
        brand = brand.decode("ascii", "replace").strip()
    out["brand"] = brand
    return out


def _x86_flags_from_cpuid(regs: dict) -> frozenset[str]:
    """The features MLAS tests, usable ones only (CPU bit and the OS saving the registers), named as Linux names
    them in /proc/cpuinfo."""
    _, _, ecx1, _ = regs["1"]
    _, ebx7, ecx7, edx7 = regs["7.0"]
    eax71, _, _, edx71 = regs["7.1"]
    xcr0 = regs["xcr0"]
    f = set()
    if _bit(ecx1, 27) and _bit(ecx1, 28) and (xcr0 & 0x6) == 0x6:
        f.add("avx")
        if _bit(ecx1, 12):
            f.add("fma")
        if _bit(ebx7, 5):
            f.add("avx2")
        if _bit(eax71, 4):
            f.add("avx_vnni")
        if _bit(edx71, 4):
            f.add("avx_vnni_int8")
        if (xcr0 & 0xE0) == 0xE0:
            for name, bit in (("avx512f", 16), ("avx512dq", 17), ("avx512bw", 30), ("avx512vl", 31)):
                if _bit(ebx7, bit):
                    f.add(name)
            if _bit(ecx7, 11):
                f.add("avx512_vnni")
        if (xcr0 & 0x60000) == 0x60000:
            for name, bit in (("amx_tile", 24), ("amx_int8", 25)):
                if _bit(edx7, bit):
                    f.add(name)
    return frozenset(f)


def _x86_class(f: frozenset[str]) -> str:
    """The MLAS branch for usable x86 features ``f`` (same order of checks as platform.cpp)."""
    if not {"avx2", "fma"} <= f:
        return "x86_64-sse2"
    cls = "x86_64-avxvnni" if "avx_vnni" in f else "x86_64-avx2"
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= f:
        cls = "x86_64-avx512vnni" if "avx512_vnni" in f else "x86_64-avx512"
    if {"amx_tile", "amx_int8"} <= f:
        cls = "x86_64-amx"
    return cls


def _arm_class(f: frozenset[str]) -> str:
    if "i8mm" in f:
        return "aarch64-i8mm"
    if "asimddp" in f:
        return "aarch64-dotprod"
    return "aarch64"


ISA_FLAG_NAMES = frozenset({"avx", "fma", "avx2", "avx_vnni", "avx_vnni_int8", "avx512f", "avx512dq", "avx512bw",
                            "avx512vl", "avx512_vnni", "amx_tile", "amx_int8", "asimddp", "i8mm", "svei8mm"})


@lru_cache(maxsize=1)
def cpu_isa() -> dict:
    """``{"class", "flags", "source"}``: the ISA class (see ``ISA_CLASSES``), the CPU features it was derived from,
    and where they were read (``cpuid`` or ``/proc/cpuinfo``, the fallback where cpuid-native is missing)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        regs = _x86_cpuid()
        if regs is not None:
            flags, source = _x86_flags_from_cpuid(regs), "cpuid"
        else:
            flags, source = cpu_flags() & ISA_FLAG_NAMES, "/proc/cpuinfo"
        return {"class": _x86_class(flags), "flags": sorted(flags), "source": source}
    if machine in ("aarch64", "arm64"):
        flags = cpu_flags() & ISA_FLAG_NAMES
        return {"class": _arm_class(flags), "flags": sorted(flags), "source": "/proc/cpuinfo"}
    return {"class": machine or "unknown", "flags": [], "source": "platform"}


def cpu_isa_class() -> str:
    """The class of CPU instruction sets that changes ONNX Runtime's numbers here, e.g. ``x86_64-avx2``."""
    return cpu_isa()["class"]


def cpu_facts() -> dict:
    """Machine facts a measurement records: CPU model, ISA class and the flags it came from."""
    isa = cpu_isa()
    return {"cpu_model": cpu_model(), "isa_class": isa["class"], "isa_flags": isa["flags"], "isa_source": isa["source"]}
