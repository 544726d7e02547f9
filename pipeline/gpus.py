"""Table of data-centre / workstation GPUs the memory planner compares a build against.

Memory is what NVML reports as the board's total (``nvidia-smi`` "MiB" column), not the
marketing number: an "80 GB" H100 SXM shows 81559 MiB, an H200 143771 MiB.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import ForgeError

MiB = 1024**2
GiB = 1024**3

# FP8 tensor cores (FP8 GEMMs and the FP8 KV cache of TensorRT / TensorRT-LLM) start at SM 8.9 (Ada) and 9.0 (Hopper).
# Which algo needs it is its quantizer's declaration (Quantizer.min_sm); the fake-quantized checkpoint itself can be
# produced anywhere (also on CPU).
FP8_MIN_SM = 89


@dataclass(frozen=True)
class GpuSpec:
    name: str                 # canonical short name used on the command line
    full_name: str            # what NVML calls it
    memory_bytes: int         # total board memory as NVML reports it
    sm: tuple[int, int]       # compute capability
    bandwidth_gbs: float      # HBM/GDDR bandwidth, GB/s (for rough decode-speed estimates)
    aliases: tuple[str, ...] = ()

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    @property
    def has_fp8(self) -> bool:
        return self.sm[0] * 10 + self.sm[1] >= FP8_MIN_SM

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sm"] = f"{self.sm[0]}.{self.sm[1]}"
        d["memory_gib"] = round(self.memory_gib, 2)
        d["has_fp8"] = self.has_fp8
        return d


GPUS: dict[str, GpuSpec] = {g.name: g for g in [
    GpuSpec("rtx4090", "NVIDIA GeForce RTX 4090", 24564 * MiB, (8, 9), 1008.0, ("4090", "rtx-4090")),
    GpuSpec("l40s", "NVIDIA L40S", 46068 * MiB, (8, 9), 864.0, ("l40s-48gb",)),
    GpuSpec("a100-80gb", "NVIDIA A100-SXM4-80GB", 81920 * MiB, (8, 0), 2039.0, ("a100", "a100-80g", "a100_80gb")),
    GpuSpec("h100", "NVIDIA H100 80GB HBM3", 81559 * MiB, (9, 0), 3350.0, ("h100-80gb", "h100-sxm")),
    GpuSpec("h200", "NVIDIA H200", 143771 * MiB, (9, 0), 4800.0, ("h200-141gb", "h200-sxm")),
]}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def get_gpu(name: str) -> GpuSpec:
    """Look a GPU up by short name or alias (case-insensitive); a clear error lists the valid names."""
    key = _norm(name)
    for g in GPUS.values():
        if key == g.name or key in {_norm(a) for a in g.aliases}:
            return g
    valid = ", ".join(GPUS)
    raise ForgeError(f"unknown GPU {name!r} (--gpu): valid names are {valid}")


def match_nvml_name(nvml_name: str) -> GpuSpec | None:
    """Best-effort mapping from an NVML device name (e.g. 'NVIDIA H100 80GB HBM3') to a table entry."""
    n = nvml_name.lower()
    if "h200" in n:
        return GPUS["h200"]
    if "h100" in n:
        return GPUS["h100"]
    if "a100" in n and "80" in n:
        return GPUS["a100-80gb"]
    if "l40s" in n:
        return GPUS["l40s"]
    if "4090" in n:
        return GPUS["rtx4090"]
    return None
