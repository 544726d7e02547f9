"""The stage contract: what enters a stage's cache key, what it needs, and how it runs."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path

from ..host.gpu import gpu_sm
from ..host.tools import has_module, tool_label, tool_version
from ..hardware import Hardware
from ..modelinfo import ModelInfo
from ..recipe import Recipe

__all__ = ["Stage", "GpuStage", "StageContext", "has_module", "payload_bytes", "cpu_hardware"]


def payload_bytes(path: Path) -> int:
    """Bytes of the files under a committed payload."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def cpu_hardware() -> Hardware:
    """Hardware of a CPU stage whose output is the same on every CPU of this architecture."""
    return Hardware.cpu(platform.machine())


def cpu_isa_hardware() -> Hardware:
    """Hardware of a CPU stage whose output or measured numbers depend on the instruction set ONNX Runtime's
    kernels use here (``cpu:x86_64-avx2``, ``cpu:x86_64-amx``, ...): results never cross ISA classes."""
    from ..host.cpu import cpu_isa_class
    return Hardware.cpu_isa(cpu_isa_class())


@dataclass
class StageContext:
    recipe: Recipe
    home: Path                         # FORGE_HOME: data, converted models
    out: Path                          # payload dir to fill (a temp dir until committed)
    inputs: dict[str, Path]            # upstream stage name -> committed payload dir
    upstream_metrics: dict[str, dict]  # upstream stage name -> its metrics
    info: ModelInfo | None = None
    extra: dict = field(default_factory=dict)


class Stage:
    name: str = ""
    version: str = "1"                  # bump when the implementation changes its output
    needs: tuple[str, ...] = ()         # upstream stages whose payloads this reads
    tools: tuple[str, ...] = ()         # tools (pipeline.host.tools.TOOLS labels) whose versions enter the key
    hands_off: bool = False             # its payload leaves the cache (a package): inputs verified in full first
    section: str = ""                   # the recipe section that is its whole config, e.g. "build.onnxruntime"
    out_link: str = ""                  # forge build links out/<recipe>/<out_link> to its payload (engine, triton_repo)

    def config(self, r: Recipe) -> dict:
        """The slice of the resolved recipe that determines this stage's output (``section``, by default)."""
        node = r
        for part in self.section.split(".") if self.section else ():
            node = getattr(node, part)
        return node.model_dump() if self.section else {}

    def data(self, r: Recipe, home: Path) -> dict:
        """Digests of the data sets this stage reads."""
        return {}

    def hardware(self, r: Recipe) -> Hardware:
        """What the output is bound to (pipeline/hardware.py): the key's hardware, the Ray request, the hints."""
        return Hardware.any()

    def missing(self, r: Recipe) -> str | None:
        """What this machine lacks to run the stage (None when it can run here)."""
        return None

    def gpus(self, r: Recipe) -> int:
        """GPUs one run of the stage takes (0 for a CPU stage); a stage bound to a GPU architecture takes one."""
        return 1 if self.hardware(r).on_gpu else 0

    def ray_resources(self, r: Recipe) -> dict:
        """What one run asks of a Ray cluster (--executor ray): one CPU; its GPUs; and the custom resources its
        hardware names (``sm_90`` per GPU, ``isa:x86_64-avx2`` for an ISA-keyed CPU stage: pipeline/hardware.py),
        which nodes advertise with ``ray start --resources`` (``python -m pipeline.ray_executor --node-resources``)."""
        n = self.gpus(r)
        return {"num_cpus": 1, "num_gpus": n, "resources": self.hardware(r).custom_resources(n)}

    def output_bytes(self, r: Recipe, info: ModelInfo | None, inputs: dict[str, Path]) -> int | None:
        """About how many bytes the payload takes (checked against free space before the stage runs); None = unknown."""
        return None

    def finish_hint(self, r: Recipe) -> str:
        return f"forge build {r.name} --from {self.name}  (on a machine that has it)"

    def plan_problems(self, r: Recipe, info: ModelInfo | None) -> list[str]:
        """Plan-time checks that need model facts; each names the recipe key."""
        return []

    def run(self, ctx: StageContext) -> dict:
        raise NotImplementedError

    def components(self, r: Recipe, home: Path, upstream: dict[str, str]) -> dict:
        return {
            "stage": self.name,
            "impl_version": self.version,
            "config": self.config(r),
            "upstream": {k: upstream[k] for k in self.needs},
            "data": self.data(r, home),
            "tools": {tool_label(t): tool_version(t) or "absent" for t in self.tools},
            "hardware": self.hardware(r),
        }


class GpuStage(Stage):
    """A stage that needs an NVIDIA GPU and a Python module (``module``); its output is bound to the GPU
    architecture it targets: the recipe's SM setting (``gpu_sm_setting``) or this machine's first GPU."""
    module: str = ""
    install_hint: str = ""

    gpu_sm_key: str = ""                # the recipe key gpu_sm_setting reads (named by every hint)

    def gpu_sm_setting(self, r: Recipe) -> int | None:
        return None

    def hardware(self, r: Recipe) -> Hardware:
        return Hardware.gpu_arch(self.gpu_sm_setting(r) or gpu_sm(), self.gpu_sm_key)

    def missing(self, r: Recipe) -> str | None:
        if not has_module(self.module):
            return f"{self.module} is not installed ({self.install_hint})"
        if gpu_sm() is None:
            return "no CUDA GPU visible"
        return None
