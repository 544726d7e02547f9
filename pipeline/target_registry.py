"""The target registry: what a build target (``build.target``) is, in one place per target.

A :class:`Target` declares its name, the model of its ``build.<name>`` recipe section, the quantizers it offers
(``quantize.algo`` -> the options model ``quantize.options`` is validated against and handed to the quantizer),
and its flow: the stage classes in order, each of which says the hardware it needs (``Stage.hardware``,
pipeline/hardware.py). The recipe schema (pipeline/recipe.py), the flows (``pipeline.stages.flow_for``) and the
messages that list targets ask this module.

This module imports no target code: the built-in targets (``pipeline/targets/<name>.py``) and the installed plug-ins
(entry-point group ``forge.targets``) are imported the first time the registry is read, so the recipe schema can
ask it without an import loop; a test adds one with ``register(Target(...))``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from dataclasses import dataclass, field
from typing import Callable, Mapping

# the built-in targets, in the order messages list them (a recipe dumps only the section of the target it builds)
BUILTIN = ("onnxruntime", "tensorrt_llm", "tensorrt")
DEFAULT = "onnxruntime"
ENTRY_POINT_GROUP = "forge.targets"


@dataclass(frozen=True)
class Quantizer:
    """What one ``quantize.algo`` of a target reads: its options model, and the quantize-section keys it uses."""
    options: type                          # a pydantic model: the schema of quantize.options for this algo
    section_keys: tuple[str, ...] = ()     # quantize.alpha / quantize.block_size


@dataclass(frozen=True)
class Target:
    name: str
    section: type                          # pydantic model of build.<name>
    quantizers: Mapping[str, Quantizer]    # quantize.algo -> its quantizer ("none" included: nothing quantized)
    flow: tuple[type, ...]                 # Stage subclasses, in run order
    summary: str = ""
    kv_cache: bool = False                 # reads quantize.kv_cache (a quantized KV cache)
    qat: bool = False                      # offers quantize.method: qat
    # quantize.<key> that stands for quantize.options.<option> of this target's quantizers (block_size)
    section_options: Mapping[str, str] = field(default_factory=dict)
    # validate.thresholds keys gating a metric only this target's stages produce (refused for the other targets)
    thresholds: tuple[str, ...] = ()
    # what export.attention auto means for the ONNX graph this target exports ("gqa" / "standard")
    onnx_attention: str = "gqa"
    # rules across sections for a recipe that builds this target: recipe -> problems, each starting with its key
    checks: Callable[[object], list[str]] | None = None
    # a key this target reads under another spelling: quantize.<key> -> its home, quantize.options.<opt> -> its home
    moved_section_keys: Mapping[str, str] = field(default_factory=dict)
    moved_options: Mapping[str, str] = field(default_factory=dict)
    # what `forge plan` shows after the stage table: (recipe, model facts or None, console) -> None
    plan_notes: Callable[[object, object, object], None] | None = None

    @property
    def algos(self) -> tuple[str, ...]:
        return tuple(self.quantizers)

    def quantize_options(self, quantize):
        """The options model of ``quantize.algo`` filled from the recipe's quantize section (``quantize.options``,
        plus the section keys that stand for an option): what the quantizer receives. The recipe schema has
        already refused what does not validate (pipeline/recipe.py quantize_problems)."""
        qz = self.quantizers[quantize.algo]
        opts = dict(quantize.options)
        for key, opt in self.section_options.items():
            if key in qz.section_keys and getattr(quantize, key) is not None:
                opts[opt] = getattr(quantize, key)
        return qz.options.model_validate(opts)

    def stages(self) -> list:
        return [c() for c in self.flow]

    def hardware(self, recipe) -> dict:
        """Each stage's hardware for ``recipe`` (pipeline/hardware.py), by stage name."""
        return {s.name: s.hardware(recipe) for s in self.stages()}


_TARGETS: dict[str, Target] = {}
_loaded = False


def _load_builtins() -> None:
    """The built-in targets, then the plug-ins installed under the ``forge.targets`` entry-point group (a package
    declares ``[project.entry-points."forge.targets"] name = "its_module"``; importing the module registers it)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for name in BUILTIN:
            importlib.import_module(f"pipeline.targets.{name}")
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()
            except Exception as e:      # a broken plug-in names itself rather than failing in forge's code
                from .errors import ForgeError
                raise ForgeError(f"build-target plug-in '{ep.name}' (entry point {ENTRY_POINT_GROUP}: {ep.value}) "
                                 f"failed to load: {type(e).__name__}: {e}; fix or uninstall it") from e


def register(target: Target) -> Target:
    """Add (or replace, by name) a target; returns it. Built-in targets register themselves on import."""
    if not target.name.isidentifier():
        raise ValueError(f"target name {target.name!r}: must be an identifier (it is a recipe key, build.<name>)")
    if "none" not in target.quantizers:
        raise ValueError(f"target {target.name!r}: its quantizers must include 'none' (nothing quantized)")
    _load_builtins()
    _TARGETS[target.name] = target
    return target


def unregister(name: str) -> None:
    _TARGETS.pop(name, None)


def names() -> tuple[str, ...]:
    """Registered target names: the built-ins in BUILTIN order (whichever was imported first), then the others."""
    _load_builtins()
    return tuple(sorted(_TARGETS, key=lambda n: (BUILTIN.index(n) if n in BUILTIN else len(BUILTIN),)))


def all_targets() -> tuple[Target, ...]:
    return tuple(_TARGETS[n] for n in names())


def get(name: str) -> Target:
    """The target called ``name``; KeyError naming the registered ones otherwise."""
    _load_builtins()
    try:
        return _TARGETS[name]
    except KeyError:
        raise KeyError(f"unknown build.target {name!r} (targets: {', '.join(names())})") from None


def quantization_algos() -> tuple[str, ...]:
    """Every quantize.algo some registered target offers (the recipe schema's choices), in first-seen order."""
    return tuple(dict.fromkeys(a for t in all_targets() for a in t.quantizers))
