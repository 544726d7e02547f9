"""Which tools are installed, at which version (``TOOLS``, ``tool_version``), and whether a module can be imported
(``has_module``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util


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
