"""Which GPUs there are (``gpus``, ``gpu_sm``, ``cuda_device``, ``cuda_hardware``): NVML first, torch as the fallback.
Every NVML call of forge goes through the ``nvml`` object passed in (tests inject a fake with the same function
names) and, where a missing function or an unsupported query is an answer, through :func:`nvml_call`."""

from __future__ import annotations

import contextlib
from functools import lru_cache

from .tools import has_module


def nvml_call(nvml, fn: str, *args):
    """``nvml.<fn>(*args)``; None when the function is missing or NVML says not supported / no permission (a str
    for bytes: older pynvml returns names as bytes)."""
    f = getattr(nvml, fn, None)
    if f is None:
        return None
    try:
        r = f(*args)
    except getattr(nvml, "NVMLError", Exception):
        return None
    return r.decode() if isinstance(r, bytes) else r


def nvml_sm(nvml, handle) -> int | None:
    """The compute capability NVML reports for a device handle as one number (9.0 -> 90); None if it cannot say."""
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except Exception:
        return None
    return int(major) * 10 + int(minor)


@contextlib.contextmanager
def nvml_handles(nvml):
    """The one place forge starts NVML: ``nvmlInit`` for the block, the device handles in index order, and
    ``nvmlShutdown`` after it, whatever the block raises. NVML's own errors (cannot start) propagate."""
    nvml.nvmlInit()
    try:
        yield [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def nvml_driver(nvml) -> dict:
    """``{driver, cuda_driver}`` inside :func:`nvml_handles` (cuda_driver "13.0", from the driver's CUDA version)."""
    cuda = nvml_call(nvml, "nvmlSystemGetCudaDriverVersion_v2") or nvml_call(nvml, "nvmlSystemGetCudaDriverVersion")
    return {"driver": nvml_call(nvml, "nvmlSystemGetDriverVersion"),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None}


def _nvml_gpus(nvml) -> list[dict]:
    with nvml_handles(nvml) as handles:
        return [{"index": i, "name": nvml_call(nvml, "nvmlDeviceGetName", h), "sm": nvml_sm(nvml, h)}
                for i, h in enumerate(handles)]


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


@lru_cache(maxsize=1)
def cuda_device() -> dict | None:
    """The first CUDA GPU (``gpus()``: name, compute capability ``sm``); None without one."""
    found = gpus()
    return {"name": found[0]["name"], "sm": found[0]["sm"]} if found else None


def cuda_hardware():
    """Cache-key hardware of a CUDA stage: the GPU's architecture and name (``cuda:sm_90:NVIDIA H200``)."""
    from ..hardware import Hardware
    d = cuda_device()
    return Hardware.cuda(d["sm"], d["name"]) if d else Hardware.cuda(None, None)
