"""Build targets (``build.target``): one module per target, and the registry they register with
(pipeline/target_registry.py; docs/architecture.md, "Adding a build target")."""

from ..quantizer import Quantizer
from ..target_registry import Target, all_targets, get, names, quantization_algos, register, unregister

__all__ = ["Quantizer", "Target", "all_targets", "get", "names", "quantization_algos", "register", "unregister"]
