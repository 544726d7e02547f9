"""The target registry: what a build target (``build.target``) is, in one place per target.

A :class:`Target` declares its name, the model of its ``build.<name>`` recipe section, the quantizers it offers
(``quantize.algo`` -> the options model ``quantize.options`` is validated against and handed to the quantizer),
its flow: the stage classes in order, each of which says the hardware it needs (``Stage.hardware``,
pipeline/hardware.py), and what its engine needs where it is deployed and what `forge doctor` checks for it
(pipeline/deploy.py). The recipe schema (pipeline/recipe/), the flows (``pipeline.stages.flow_for``), the
manifest and verify-deploy (pipeline/triton/manifest.py), `forge doctor` and the messages that list targets ask
this module.

This module imports no target code: the built-in targets (``pipeline/targets/<name>.py``) and the installed plug-ins
(entry-point group ``forge.targets``) are imported the first time the registry is read, so the recipe schema can
ask it without an import loop; a test adds one with ``register(Target(...))``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .deploy import Deploy
from .quantizer import Quantizer

# the built-in targets, in the order messages list them (a recipe dumps only the section of the target it builds)
BUILTIN = ("onnxruntime", "tensorrt_llm", "tensorrt")
DEFAULT = "onnxruntime"
ENTRY_POINT_GROUP = "forge.targets"


@dataclass(frozen=True)
class Candidate:
    """One format `forge search` builds for a recipe of this target: ``--set`` overrides applied on top of the
    searched recipe (and the user's --set), e.g. ``quantize.algo=int4_wo``. Each candidate is built, gated by the
    searched recipe's validate section and measured like any recipe (pipeline/search.py)."""
    name: str                              # short, a recipe-name part: fp32, int8, int4, cuda-fp16
    overrides: tuple[str, ...]
    summary: str = ""


@dataclass(frozen=True)
class Target:
    name: str
    section: type                          # pydantic model of build.<name>
    # quantize.algo -> its quantizer (pipeline/quantizer.py; "none" included: nothing quantized): the target's one
    # algo table
    quantizers: Mapping[str, Quantizer]
    flow: tuple[type, ...]                 # Stage subclasses, in run order
    summary: str = ""
    kv_cache: bool = False                 # reads quantize.kv_cache (a quantized KV cache)
    qat: bool = False                      # offers quantize.method: qat
    # validate.thresholds keys gating a metric only this target's stages produce (refused for the other targets)
    thresholds: tuple[str, ...] = ()
    # what export.attention auto means for the ONNX graph this target exports ("gqa" / "standard")
    onnx_attention: str = "gqa"
    # validate.reference: simulated -- its evaluate can score against a fake-quantized torch model of the same grid
    simulated_reference: bool = False
    # rules across sections for a recipe that builds this target: recipe -> problems, each starting with its key
    checks: Callable[[object], list[str]] | None = None
    # a key this target reads under another spelling: quantize.<key> -> its home, quantize.options.<opt> -> its home
    # (an option a quantizer's section_keys stand for is refused under quantize.options without being listed here)
    moved_section_keys: Mapping[str, str] = field(default_factory=dict)
    moved_options: Mapping[str, str] = field(default_factory=dict)
    # quantize.algo of another target -> what to use instead here, added to the refusal
    algo_hints: Mapping[str, str] = field(default_factory=dict)
    # what `forge plan` shows after the stage table: (recipe, model facts or None, console) -> None
    plan_notes: Callable[[object, object, object], None] | None = None
    # what its packaged engine (manifest "engine": the target's name) is bound to and needs where it is deployed
    deploy: Deploy = field(default_factory=Deploy)
    # what `forge doctor` checks on this host for this target: facts -> findings (pipeline/doctor.py run_doctor
    # says which facts; pipeline.deploy.finding makes one)
    doctor: Callable[[dict], list[dict]] | None = None
    # the ranks one engine of a recipe runs as, (tp, pp): `forge doctor --recipe` places them on this host's GPUs
    ranks: Callable[[object], tuple[int, int]] | None = None
    # the formats `forge search RECIPE` builds and measures for a recipe of this target (pipeline/search.py); one
    # this host cannot run (a CUDA provider, a GPU stage) is listed as skipped with its plan's reason
    candidates: tuple[Candidate, ...] = ()

    @property
    def algos(self) -> tuple[str, ...]:
        return tuple(self.quantizers)

    def quantizer(self, quantize) -> Quantizer:
        """The quantizer of a recipe's quantize section (method none quantizes nothing: "none")."""
        return self.quantizers["none" if quantize.method == "none" else quantize.algo]

    def quantize_options(self, quantize):
        """The typed options of a recipe's quantize section (:meth:`Quantizer.options_of`): what the quantizer
        receives. The recipe has refused what does not validate (pipeline/recipe/rules.py quantize_problems)."""
        return self.quantizers[quantize.algo].options_of(quantize)

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
