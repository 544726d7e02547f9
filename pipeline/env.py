"""Facts about this machine and environment, each defined once.

Cache keys, manifests, reports and `forge doctor` read these functions so they always agree:
where forge keeps its files (``forge_home``, ``cache_root``), what of the CPU changes numbers
(``cpu_model``, ``cpu_flags``), which tool versions are installed (``TOOLS``, ``tool_version``), which GPUs
there are (``gpus``, ``gpu_sm``), how much memory a piece of work peaked at (``PeakRss``), free disk space
(``free_bytes``), and how a file or directory is published without a reader ever seeing half of it
(``atomic_write``, ``publish_dir``).
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


def forge_home() -> Path:
    """``$FORGE_HOME`` (an empty value counts as unset), else ``~/.cache/forge``; always absolute."""
    raw = os.environ.get("FORGE_HOME", "").strip()
    home = Path(raw).expanduser() if raw else Path.home() / ".cache" / "forge"
    return home.absolute()


def cache_root() -> Path:
    """The artifact cache: ``$FORGE_CACHE`` (an empty value counts as unset), else ``forge_home()/artifacts``."""
    raw = os.environ.get("FORGE_CACHE", "").strip()
    return Path(raw).expanduser().absolute() if raw else forge_home() / "artifacts"


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
