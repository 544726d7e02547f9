"""What an ONNX Runtime engine needs where it is served, and what `forge doctor` checks for it (the onnxruntime
target's ``deploy`` and ``doctor``: pipeline/targets/onnxruntime.py; the shapes: pipeline/deploy.py).

A CPU engine is bound to the machine architecture and the ONNX Runtime release that optimised it; its numbers were
measured on one CPU ISA class, and ONNX Runtime's int8 kernels compute other numbers on another
(pipeline/host/cpu.py), which is a warning, not a refusal. A CUDA-provider engine needs an NVIDIA GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..deploy import Deploy, finding, machine_problems, obj, recipe_name
from .export import META_FILE


def hardware(info: dict, env: dict) -> dict:
    target = info.get("target")
    if isinstance(target, str) and target.startswith("cuda:"):
        # build.onnxruntime.provider: cuda -- "cuda:sm_90:NVIDIA H200" (pipeline.host.gpu.cuda_hardware)
        _, sm, name = (target.split(":", 2) + ["", ""])[:3]
        return {"kind": "gpu", "provider": "cuda", "machine": env["machine"], "gpu": name,
                "sm": int(sm[3:]) if sm[3:].isdigit() else None}
    from ..host.cpu import cpu_facts
    # the CPU the engine's evaluation (and so its validation) was measured on; this machine's when not recorded
    measured = (info.get("metrics") or {}).get("measured_on") or cpu_facts()
    return {"kind": "cpu", "machine": env["machine"], "validated_isa_class": measured["isa_class"],
            "validated_cpu_model": measured.get("cpu_model"), "validated_isa_flags": measured.get("isa_flags")}


def problems(m: dict, env: dict) -> list[str]:
    out = []
    rname = recipe_name(m)
    # an ORT-optimised graph (level extended/all) is bound to the ORT release and CPU architecture
    built, now = obj(m.get("tools")).get("onnxruntime"), env.get("tools", {}).get("onnxruntime")
    if isinstance(built, str) and isinstance(now, str) and built.split(".")[:2] != now.split(".")[:2]:
        out.append(f"onnxruntime {now} here, but the engine was optimised with onnxruntime {built}; install "
                   f"onnxruntime=={built} or rebuild (`forge build {rname} --force build`)")
    out += machine_problems(m, env)
    hw = obj(m.get("hardware"))
    if hw.get("provider") == "cuda" and not env.get("gpu_sms"):
        out.append("no NVIDIA GPU found here; the engine was built and validated for ONNX Runtime's CUDA "
                   f"provider on {hw.get('gpu') or 'a GPU'}: deploy it on a GPU machine with onnxruntime-gpu")
    return out


def warnings(m: dict, env: dict) -> list[str]:
    """A CPU engine validated on another ISA class runs here, but ONNX Runtime's int8 kernels may compute other
    numbers; the warning says whether the engine's quantization is known to lose accuracy here."""
    hw = obj(m.get("hardware"))
    if hw.get("kind") != "cpu":
        return []
    built, here = hw.get("validated_isa_class"), env.get("cpu_isa_class")
    rname = recipe_name(m)
    if not built:
        return [f"manifest.json does not record the CPU ISA class the engine was validated on (packaged before forge "
                f"recorded it); this CPU is {here}: run `forge build {rname}` here to validate it on this CPU"]
    if built == here:
        return []
    from .quantize import isa_accuracy_risk
    quant = obj(m.get("quantization")) or obj(obj(obj(m.get("recipe")).get("resolved")).get("quantize"))
    risk = isa_accuracy_risk(quant, here)
    why = (f"its int8 method is known to lose accuracy here: {risk}" if risk else
           "its int8 method is not known to lose accuracy here, but its numbers were not measured on this class")
    return [f"the engine was validated on {built} ({hw.get('validated_cpu_model') or 'unknown CPU'}), this CPU is "
            f"{here}: ONNX Runtime's int8 kernels differ between the two, {why}; run `forge build {rname}` here "
            f"to evaluate and validate it on this CPU"]


DEPLOY = Deploy(bound_tools=(), hardware=hardware, problems=problems, warnings=warnings)


# ---------------------------------------------------------------- forge doctor
def engine_quantizations(root: Path) -> dict[str, dict]:
    """Where `make engine` / `forge build --report-dir` linked engines (``out/<recipe>/engine``): their
    quantization as recorded in the engine's own metadata."""
    out = {}
    for meta in sorted(root.glob("out/*/engine/" + META_FILE)):
        try:
            q = json.loads(meta.read_text()).get("quantization")
        except (OSError, ValueError):
            continue
        if q:
            out[f"engine {meta.parent}"] = q
    return out


def isa_findings(isa_class: str | None, quantizations: dict[str, dict]) -> list[dict]:
    """The CPU's ISA class (pipeline/host/cpu.py) against the INT8 methods of recipes / built engines
    (``quantizations``: label -> quantize section or engine quantization metadata)."""
    from .quantize import isa_accuracy_risk
    out = []
    for label, q in quantizations.items() if isa_class else ():
        risk = isa_accuracy_risk(q, isa_class)
        if risk:
            out.append(finding("warning", f"{label}: its INT8 method is known to lose accuracy on this CPU "
                                          f"({isa_class}): {risk}",
                               "use the default INT8 method (drop quantize.options.method / weight_type / "
                               "reduce_range overrides) and rebuild; `forge build RECIPE` validates it on this CPU"))
    return out


def ort_cuda_findings(st: dict, have_gpu: bool) -> list[dict]:
    """The CUDA provider of onnxruntime (build.onnxruntime.provider: cuda): why it cannot run here and the fix (which
    CUDA libraries forge loaded, from where, is in the report's ``onnxruntime_cuda.preloaded``)."""
    setup = "python -m pipeline.gpu_setup install (what `make setup` runs on a GPU machine)"
    if st.get("problem") is None:
        return []
    if not st.get("cuda_provider"):
        if not have_gpu:
            return [finding("info", "onnxruntime has no CUDAExecutionProvider: the *-cuda-* recipes stop at build "
                                    "(exit 3) here", "finish them on a GPU machine (make setup there installs "
                                                     "onnxruntime-gpu)")]
        return [finding("warning", f"onnxruntime {st.get('onnxruntime')} has no CUDAExecutionProvider on this GPU "
                                   "machine: the *-cuda-* recipes cannot build", setup)]
    return [finding("error", f"onnxruntime's CUDAExecutionProvider cannot run: {st['problem']}", setup)]


def doctor(facts: dict) -> list[dict]:
    """`forge doctor` for the onnxruntime target: the INT8 methods of its shipped recipes (``facts["recipes"]``) and
    of the engines linked under ./out against this CPU's ISA class (``facts["quantizations"]`` replaces both), and
    the CUDA provider (``facts["ort_cuda"]``)."""
    quantizations = facts.get("quantizations")
    if quantizations is None:
        quantizations = {f"recipe {r.name}": r.quantize.model_dump() for r in facts.get("recipes", ())
                         if r.quantize.algo != "none"}
        quantizations.update(engine_quantizations(Path.cwd()))
    isa = obj(facts["host"].get("cpu_isa")).get("class")
    return (ort_pin_findings(facts.get("versions") or {}) + isa_findings(isa, quantizations)
            + ort_cuda_findings(facts["ort_cuda"], bool(facts["gpus"])))


def ort_pin_findings(versions: dict, pyproject: Path | None = None) -> list[dict]:
    """The installed onnxruntime against pyproject's pin (one version for CPU and GPU: ``gpu_setup.ort_cpu_pin``).
    Its version enters every onnxruntime stage's cache key: another one builds other engines than a fresh clone."""
    from ..gpu_setup import ROOT, ort_cpu_pin
    pyproject = pyproject or ROOT / "pyproject.toml"
    now = versions.get("onnxruntime")
    if not now or not pyproject.exists():     # not installed (REQUIRED says so) / an installed forge, no checkout
        return []
    pin = ort_cpu_pin(pyproject)
    if now == pin:
        return []
    return [finding("warning", f"onnxruntime {now} is installed but pyproject.toml pins {pin}: engines built here "
                                f"are keyed (and may compute) differently from a fresh clone's",
                     "make setup (it installs the pinned onnxruntime; on a GPU machine onnxruntime-gpu of the same "
                     "version)")]
