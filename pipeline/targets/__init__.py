"""Build targets (``build.target``): one module per target, and the registry they register with
(pipeline/targets/registry.py; docs/architecture.md, "Adding a build target")."""

from .registry import Quantizer, Target, all_targets, get, names, quantization_algos, register, unregister

__all__ = ["Quantizer", "Target", "all_targets", "get", "names", "quantization_algos", "register", "unregister"]
