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
