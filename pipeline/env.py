"""Facts about this machine and environment, each defined once.

Cache keys, manifests, reports and `forge doctor` read these functions so they always agree:
where forge keeps its files (``forge_home``, ``cache_root``, ``history_db``), which commit of forge runs
(``source_commit``), what of the CPU changes numbers (``cpu_model``, ``cpu_flags``, ``cpu_isa_class``), which
tool versions are installed (``TOOLS``, ``tool_version``), which GPUs there are (``gpus``, ``gpu_sm``), how much
memory a piece of work peaked at (``PeakRss``), free disk space (``free_bytes``), and how a file or directory is
published without a reader ever seeing half of it (``atomic_write``, ``publish_dir``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import threading
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Callable


def forge_home() -> Path:
    """``$FORGE_HOME`` (an empty value counts as unset), else ``~/.cache/forge``; always absolute."""
    raw = os.environ.get("FORGE_HOME", "").strip()
    home = Path(raw).expanduser() if raw else Path.home() / ".cache" / "forge"
    return home.absolute()


def remote_cache_url() -> str | None:
    """``$FORGE_CACHE`` when it is an object-store URL (``s3://bucket/prefix``, ``gs://...``, ``az://...``): the
    shared cache many machines build into; None when the cache is a local directory."""
    raw = os.environ.get("FORGE_CACHE", "").strip()
    return raw if "://" in raw else None


def cache_root() -> Path:
    """The local artifact cache: ``$FORGE_CACHE`` (an empty value counts as unset), else ``forge_home()/artifacts``.
    With a remote ``FORGE_CACHE`` (:func:`remote_cache_url`) it is ``forge_home()/artifacts``, the read-through
    layer in front of the shared store."""
    raw = os.environ.get("FORGE_CACHE", "").strip()
    if not raw or "://" in raw:
        return forge_home() / "artifacts"
    return Path(raw).expanduser().absolute()


def history_db() -> Path:
    """The run-history database: ``$FORGE_HISTORY`` (an empty value counts as unset), else
    ``forge_home()/history.sqlite``."""
    raw = os.environ.get("FORGE_HISTORY", "").strip()
    return Path(raw).expanduser().absolute() if raw else forge_home() / "history.sqlite"


def source_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the forge checkout this code runs from; (None, None) outside a git work tree."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


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


def free_bytes(path: Path) -> int | None:
    """Free space for an unprivileged writer on the file system holding ``path`` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


# ---------------------------------------------------------------- tool versions
# label -> the distributions that provide it, the first installed one wins (NVIDIA publishes TensorRT as
# tensorrt, tensorrt-cu12 or tensorrt-cu13; ONNX Runtime as onnxruntime or onnxruntime-gpu). A name that is not
# a label is looked up as a distribution.
TOOLS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "gguf": ("gguf",),
    "modelopt": ("nvidia-modelopt",),
    "onnx": ("onnx",),
    "onnxscript": ("onnxscript",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "onnxruntime_genai": ("onnxruntime-genai", "onnxruntime-genai-cuda"),
    "tensorrt": ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt_cu13_libs", "tensorrt-cu12-libs"),
    "tensorrt_llm": ("tensorrt-llm", "tensorrt_llm"),
    "polygraphy": ("polygraphy",),
    "tritonclient": ("tritonclient",),
    "pytriton": ("nvidia-pytriton",),
    "nvidia_ml_py": ("nvidia-ml-py",),
    "llama_cpp_python": ("llama-cpp-python",),
    "requests": ("requests",),
    "forge": ("forge-engine",),
}
_LABEL_OF = {d: label for label, dists in TOOLS.items() for d in dists} | {label: label for label in TOOLS}


def tool_label(name: str) -> str:
    """The TOOLS label of a label or distribution name (``tensorrt-cu12`` -> ``tensorrt``); else the name."""
    return _LABEL_OF.get(name, _LABEL_OF.get(name.replace("_", "-"), name))


def tool_version(name: str) -> str | None:
    """Installed version of a TOOLS label (or a distribution name); None when absent."""
    for dist in TOOLS.get(tool_label(name), (name,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def tool_versions(names) -> dict[str, str | None]:
    return {tool_label(n): tool_version(n) for n in names}


def has_module(name: str) -> bool:
    """Whether ``import name`` would find a module (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------- GPUs
def nvml_sm(nvml, handle) -> int | None:
    """The compute capability NVML reports for a device handle as one number (9.0 -> 90); None if it cannot say."""
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except Exception:
        return None
    return int(major) * 10 + int(minor)


def _nvml_gpus(nvml) -> list[dict]:
    nvml.nvmlInit()
    try:
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                        "sm": nvml_sm(nvml, h)})
        return out
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _torch_gpus() -> list[dict]:
    if not has_module("torch"):
        return []
    try:
        import torch
        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            out.append({"index": i, "name": torch.cuda.get_device_name(i), "sm": major * 10 + minor})
        return out
    except Exception:       # a broken CUDA install is "no GPU" here; forge doctor says why
        return []


def gpus(nvml=None) -> list[dict]:
    """``[{index, name, sm}]`` (sm 90 = compute capability 9.0): NVML first (no CUDA context, sees every GPU of
    the driver), torch as the fallback where NVML is missing; [] without a GPU. ``nvml`` is for tests."""
    try:
        if nvml is None:
            import pynvml as nvml
        return _nvml_gpus(nvml)
    except Exception:
        return _torch_gpus()


def gpu_sm() -> int | None:
    """Compute capability of the first GPU (e.g. 90), None without one."""
    found = gpus()
    return found[0]["sm"] if found else None


# ---------------------------------------------------------------- memory
class PeakRss:
    """Peak resident memory of this process and its children while a block runs (sampled in a thread).

    ``with PeakRss() as m: ...`` then ``m.peak`` (bytes, at least the value at entry and exit) and
    ``m.start`` (bytes at entry)."""

    def __init__(self, interval: float = 0.2, children: bool = True):
        import psutil
        self._psutil = psutil
        self._proc = psutil.Process()
        self.interval, self.children = interval, children
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def rss(self) -> int:
        try:
            total = self._proc.memory_info().rss
            for c in (self._proc.children(recursive=True) if self.children else ()):
                with contextlib.suppress(self._psutil.Error):
                    total += c.memory_info().rss
            return total
        except self._psutil.Error:
            return 0

    def _sample(self) -> None:
        self.peak = max(self.peak, self.rss())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "PeakRss":
        self.start = self.rss()
        self.peak = max(self.peak, self.start)
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._t is not None:
            self._t.join()
        self._sample()

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def process_peak_rss_bytes() -> int:
    """The highest RSS this process has had since it started (the kernel's ru_maxrss)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------- publishing files
@contextlib.contextmanager
def _beside(dest: Path):
    """A temp name beside ``dest`` to write to; on success it is renamed over ``dest``, always cleaned up."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write ``path`` through a temp file beside it and a rename: a reader sees the old or the new file, never
    half of one (and a crash leaves at most a stray ``.<name>.*.tmp``)."""
    with _beside(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())    # the rename must not publish a file whose bytes are still in flight
    return Path(path)


def atomic_copy(src: Path, dest: Path) -> Path:
    """Copy a file to ``dest`` through a temp file beside it and a rename."""
    with _beside(dest) as tmp:
        shutil.copy2(src, tmp)
    return Path(dest)


def atomic_symlink(dest: Path, target: str) -> Path:
    """Point the link ``dest`` at ``target`` (replacing what was there) through a temp link and a rename."""
    with _beside(dest) as tmp:
        tmp.symlink_to(target)
    return Path(dest)


def publish_dir(tmp: Path, final: Path) -> bool:
    """Rename a finished temp directory to ``final`` (same file system). False when another process published
    ``final`` first (then ``tmp`` is removed and theirs is kept)."""
    try:
        os.rename(tmp, final)
        return True
    except OSError:
        if not Path(final).is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
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
# ---------------------------------------------------------------- CUDA for ONNX Runtime
# The libraries onnxruntime-gpu's CUDA provider loads (1.31.1 is built against CUDA 13) and, for each, a C entry
# point that returns its version without a GPU context. NVIDIA's pip wheels (nvidia-*-cu13, which PyTorch cu130
# installs) ship them under site-packages/nvidia/*/lib.
CUDA_LIBRARIES = {
    "cudart": ("libcudart.so.13", "cudaRuntimeGetVersion"),
    "cublas": ("libcublas.so.13", "cublasGetProperty"),
    "cublasLt": ("libcublasLt.so.13", "cublasLtGetVersion"),
    "curand": ("libcurand.so.10", "curandGetVersion"),
    "cudnn": ("libcudnn.so.9", "cudnnGetVersion"),
}


def nvidia_lib_dirs() -> list[str]:
    """``site-packages/nvidia/*/lib`` folders of the installed NVIDIA wheels (what LD_LIBRARY_PATH needs for
    onnxruntime-gpu when no system CUDA toolkit is installed)."""
    import site
    import sys
    roots = [Path(p) for p in (*sys.path, *site.getsitepackages()) if p]
    seen: list[str] = []
    for root in roots:
        for lib in sorted((root / "nvidia").glob("*/lib")) if (root / "nvidia").is_dir() else []:
            if str(lib) not in seen:
                seen.append(str(lib))
    return seen


_PRELOADED: dict | None = None


def preload_cuda(ort_module=None, lib_dirs: Callable[[], list[str]] | None = None,
                 load: Callable[[str], object] | None = None) -> dict:
    """Make the CUDA/cuDNN libraries of NVIDIA's wheels loadable for onnxruntime-gpu's CUDA provider, with no
    LD_LIBRARY_PATH: ORT's own ``onnxruntime.preload_dlls()`` (it loads them from the site-packages holding
    onnxruntime), then each library in :data:`CUDA_LIBRARIES` still missing from another ``nvidia/*/lib`` folder
    (:func:`nvidia_lib_dirs`: e.g. PyTorch's wheels in another site-packages). A library loaded by full path
    satisfies a later dlopen of its soname. Once per process; returns what it did (``forge doctor`` shows it)."""
    global _PRELOADED
    if _PRELOADED is not None and ort_module is None:
        return _PRELOADED
    import ctypes
    import io
    load = load or (lambda path: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
    res: dict = {"ort_preload_dlls": None, "loaded": {}}
    try:
        ort = ort_module
        if ort is None:
            import onnxruntime as ort
        if hasattr(ort, "preload_dlls") and "CUDAExecutionProvider" in ort.get_available_providers():
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):      # it prints each library it could not load
                ort.preload_dlls(cuda=True, cudnn=True)
            res["ort_preload_dlls"] = buf.getvalue().strip() or "ok"
    except Exception as e:  # noqa: BLE001 - what failed is reported, the fallback below still runs
        res["ort_preload_dlls"] = f"failed: {e}"
    dirs = (lib_dirs or nvidia_lib_dirs)()
    for name, (soname, _) in CUDA_LIBRARIES.items():
        where = _loaded_path(soname)
        if where is None:
            for d in dirs:
                f = Path(d) / soname
                if f.is_file():
                    try:
                        load(str(f))
                        where = str(f)
                        break
                    except OSError:
                        continue
        res["loaded"][name] = where
    if ort_module is None:
        _PRELOADED = res
    return res


def _loaded_path(soname: str) -> str | None:
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if line.rstrip().endswith("/" + soname) or f"/{soname}" in line:
                return line.split()[-1]
    except OSError:
        pass
    return None


def _cuda_version_int(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def cuda_library_versions() -> dict[str, dict]:
    """Each CUDA library onnxruntime-gpu needs: found (dlopen by soname, which finds what preload_cuda loaded), its
    path and version."""
    import ctypes
    out: dict[str, dict] = {}
    for name, (soname, fn) in CUDA_LIBRARIES.items():
        try:
            lib = ctypes.CDLL(soname)
        except OSError as e:
            out[name] = {"soname": soname, "found": False, "error": str(e).split(":")[-1].strip()}
            continue
        info: dict = {"soname": soname, "found": True, "path": _loaded_path(soname)}
        try:
            if name == "cublas":        # cublasGetProperty(MAJOR_VERSION=0 / MINOR=1 / PATCH=2, int*)
                parts = []
                for prop in (0, 1, 2):
                    v = ctypes.c_int()
                    lib.cublasGetProperty(prop, ctypes.byref(v))
                    parts.append(str(v.value))
                info["version"] = ".".join(parts)
            elif name in ("cublasLt", "cudnn"):   # size_t fn(void): e.g. 130100 / 91000
                getattr(lib, fn).restype = ctypes.c_size_t
                v = int(getattr(lib, fn)())
                info["version"] = (f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if name == "cublasLt"
                                   else f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v >= 10000
                                   else f"{v // 1000}.{(v % 1000) // 100}.{v % 100}")
            else:                       # int fn(int*): cudart 13000 -> 13.0; curand 10400 -> 10.4.0
                v = ctypes.c_int()
                getattr(lib, fn)(ctypes.byref(v))
                info["version"] = _cuda_version_int(v.value) if name == "cudart" else \
                    f"{v.value // 1000}.{(v.value % 1000) // 100}.{v.value % 100}"
        except (AttributeError, OSError) as e:
            info["version"] = None
            info["error"] = str(e)
        out[name] = info
    return out


def ort_cuda_status() -> dict:
    """Whether onnxruntime here can run the CUDA provider: its version and build, the providers it offers, the
    CUDA libraries it would load, and (``problem``) why not when it cannot."""
    try:
        import onnxruntime as ort
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return {"onnxruntime": None, "providers": [], "cuda_provider": False,
                "problem": f"onnxruntime cannot be imported ({e})"}
    providers = list(ort.get_available_providers())
    st = {"onnxruntime": ort.__version__, "module": str(Path(ort.__file__).parent),
          "build_info": getattr(ort, "get_build_info", lambda: None)(), "device": ort.get_device(),
          "providers": providers, "cuda_provider": "CUDAExecutionProvider" in providers, "problem": None}
    if not st["cuda_provider"]:
        st["problem"] = ("this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu built for this "
                         "machine's CUDA; the CPU wheel and the GPU wheel both provide the `onnxruntime` module)")
        return st
    st["preloaded"] = preload_cuda()
    st["libraries"] = libs = cuda_library_versions()
    missing = [v["soname"] for v in libs.values() if not v["found"] and v["soname"] != "libcudnn.so.9"]
    if missing:
        st["problem"] = (f"CUDAExecutionProvider cannot load {', '.join(missing)}: no NVIDIA wheel here ships them "
                         "(nvidia/*/lib folders found: " + (":".join(nvidia_lib_dirs()) or "none") + "); "
                         "`python -m pipeline.gpu_setup install` installs them")
    elif cuda_device() is None:
        st["problem"] = "no CUDA GPU visible"
    else:
        st["session_providers"] = used = _cuda_session_probe()
        if "CUDAExecutionProvider" not in used:
            st["problem"] = f"a session asked for CUDAExecutionProvider got only {used} (see ORT's log above)"
    return st


def _cuda_session_probe() -> list[str]:
    """Providers a one-node session actually got when CUDA was asked for (ORT falls back to CPU with a log line
    when the CUDA provider library cannot load)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    try:
        s = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        return list(s.get_providers())
    except Exception as e:  # noqa: BLE001
        return [f"error: {e}"]


@lru_cache(maxsize=1)
def cuda_device() -> dict | None:
    """The first CUDA GPU (``gpus()``: name, compute capability ``sm``); None without one."""
    found = gpus()
    return {"name": found[0]["name"], "sm": found[0]["sm"]} if found else None


def cuda_hardware():
    """Cache-key hardware of a CUDA stage: the GPU's architecture and name (``cuda:sm_90:NVIDIA H200``)."""
    from .hardware import Hardware
    d = cuda_device()
    return Hardware.cuda(d["sm"], d["name"]) if d else Hardware.cuda(None, None)
