"""The hardware a stage's output is bound to, as one typed value: it is the ``hardware`` component of the stage's
cache key (its text, unchanged from when it was a plain string), the resources the stage asks of a Ray cluster,
and the hint when no node can run it.

Kinds (text -> what a Ray task of the stage asks for):

- ``any``                         -> 1 CPU
- ``cpu:x86_64``       (CPU)      -> 1 CPU: the output is the same on every CPU of the architecture
- ``cpu:x86_64-avx2``  (CPU_ISA)  -> 1 CPU and a sliver of ``isa:x86_64-avx2``: numbers differ per ISA class, so
  the stage runs only on nodes of the class the driver keys it with (``python -m pipeline.ray_executor
  --node-resources`` prints what a node advertises)
- ``sm90`` / ``sm-unspecified`` (GPU_ARCH: TensorRT, TensorRT-LLM) -> its GPUs and ``sm_90`` per GPU; unspecified
  cannot be placed: ``setting`` names the recipe key that says which architecture
- ``cuda:sm_90:NVIDIA H200`` / ``cuda:unavailable`` (CUDA: ONNX Runtime's CUDA provider) -> its GPUs and ``sm_90``
"""

from __future__ import annotations

ANY, CPU, CPU_ISA, GPU_ARCH, CUDA = "any", "cpu", "cpu-isa", "gpu-arch", "cuda"
ISA_RESOURCE_PREFIX = "isa:"
ISA_RESOURCE_AMOUNT = 0.001     # a marker, not a capacity: every task on the node may hold one at once (1000)


class Hardware(str):
    """A str (the cache-key text) with the fields it was made from. Build one with the constructors below."""
    kind: str
    isa: str | None          # CPU_ISA: the ISA class, e.g. x86_64-avx2
    sm: int | None           # GPU_ARCH / CUDA: compute capability, e.g. 90 (None: not known)
    gpu_name: str | None     # CUDA: the GPU's name
    setting: str | None      # GPU_ARCH: the recipe key that names the architecture (for hints)

    def __new__(cls, text: str, kind: str, *, isa: str | None = None, sm: int | None = None,
                gpu_name: str | None = None, setting: str | None = None):
        self = super().__new__(cls, text)
        self.kind, self.isa, self.sm, self.gpu_name, self.setting = kind, isa, sm, gpu_name, setting
        return self

    def __reduce__(self):       # pickled for Ray tasks with its fields
        return (_rebuild, (str(self), self.kind, self.isa, self.sm, self.gpu_name, self.setting))

    # ------------------------------------------------------------ constructors
    @classmethod
    def any(cls) -> "Hardware":
        return cls(ANY, ANY)

    @classmethod
    def cpu(cls, machine: str) -> "Hardware":
        return cls(f"cpu:{machine}", CPU)

    @classmethod
    def cpu_isa(cls, isa_class: str) -> "Hardware":
        return cls(f"cpu:{isa_class}", CPU_ISA, isa=isa_class)

    @classmethod
    def gpu_arch(cls, sm: int | None, setting: str) -> "Hardware":
        return cls(f"sm{sm}" if sm else "sm-unspecified", GPU_ARCH, sm=sm or None, setting=setting)

    @classmethod
    def cuda(cls, sm: int | None, gpu_name: str | None) -> "Hardware":
        if sm is None:
            return cls("cuda:unavailable", CUDA)
        return cls(f"cuda:sm_{sm}:{gpu_name}", CUDA, sm=sm, gpu_name=gpu_name)

    # ------------------------------------------------------------ what it asks of a cluster
    @property
    def on_gpu(self) -> bool:
        return self.kind in (GPU_ARCH, CUDA)

    def custom_resources(self, gpus: int) -> dict[str, float]:
        """Ray custom resources a task bound to this hardware asks for (besides CPU/GPU)."""
        if self.kind == CPU_ISA:
            return {isa_resource(self.isa): ISA_RESOURCE_AMOUNT}
        if self.on_gpu and self.sm:
            return {sm_resource(self.sm): float(max(gpus, 1))}
        return {}

    def unplaceable(self, recipe_name: str) -> str | None:
        """Why no node can be chosen for it, whatever the cluster has (None when one can)."""
        if self.kind == GPU_ARCH and not self.sm:
            return (f"{recipe_name}: {self.setting} is not set, so no one can say which GPU architecture the engine "
                    f"is for and which node may build it: set it (e.g. --set {self.setting}=90 for H100/H200)")
        if self.kind == CUDA and not self.sm:
            return (f"{recipe_name}: this machine (the Ray driver) has no CUDA GPU, and a CUDA ONNX Runtime stage is "
                    "keyed by the GPU it runs on (cuda:sm_90:NVIDIA H200): run `forge build --executor ray` from a "
                    "node with the GPU the engine is for (build.onnxruntime.provider: cuda reads no GPU setting)")
        return None


def _rebuild(text, kind, isa, sm, gpu_name, setting) -> Hardware:
    return Hardware(text, kind, isa=isa, sm=sm, gpu_name=gpu_name, setting=setting)


def isa_resource(isa_class: str) -> str:
    return f"{ISA_RESOURCE_PREFIX}{isa_class}"


def sm_resource(sm: int) -> str:
    return f"sm_{sm}"
