"""What a build target's engine needs on the host that serves it: asked by the package's manifest
(pipeline/triton/manifest.py), `forge verify-deploy` and `forge doctor`, which never name a target.

A target declares ``Target.deploy`` (pipeline/target_registry.py): the tools its engine is bound to, the hardware
record the manifest keeps, what a host it is deployed to must have, and what may differ there without making it
unfit. ``Target.doctor`` says what `forge doctor` checks on this host for it, as :func:`finding` dicts.

``info`` is what the package stage hands the manifest (pipeline/stages/package.py ``manifest_info``: ``target`` is
``"cpu"``, ``"sm90"`` or the CUDA hardware text, ``gpu_sm``, ``metrics``); ``m`` a written manifest; ``env`` this
machine (pipeline/triton/manifest.py ``current_env``: tools, GPUs and their SMs, machine, CPU ISA class).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import ForgeError

SEVERITIES = ("error", "warning", "info")


def finding(severity: str, message: str, fix: str = "") -> dict:
    """One `forge doctor` finding: a problem of this host, how bad, and its fix."""
    if severity not in SEVERITIES:
        raise ValueError(f"finding severity {severity!r}: one of {', '.join(SEVERITIES)}")
    return {"severity": severity, "message": message, "fix": fix}


def needs_tool(label: str, without: str, fix: str) -> Callable[[dict], list[dict]]:
    """A ``Target.doctor`` check: the tool ``label`` (pipeline.host.tools) is installed, else a finding saying what
    stops without it (a warning on a GPU host, where it is needed; info elsewhere) and how to install it."""
    def doctor(facts: dict) -> list[dict]:
        if facts["versions"].get(label):
            return []
        return [finding("warning" if facts["gpus"] else "info", f"{label} is not installed: {without}", fix)]
    return doctor


def obj(x) -> dict:
    """``x`` when it is a mapping, else {} (a manifest is read from a file anyone may have edited)."""
    return x if isinstance(x, dict) else {}


def recipe_name(m: dict) -> str:
    """The recipe a manifest names ("RECIPE" when it does not say), for the commands a message gives."""
    name = obj(obj(m).get("recipe")).get("name")
    return name if isinstance(name, str) else "RECIPE"


def rebuild_hint(m: dict) -> str:
    """The command that packages the repository again (the recipe named in the manifest, where it says)."""
    return f"rebuild it with `forge build {recipe_name(m)} --force package`"


def machine_hardware(info: dict, env: dict) -> dict:
    """A CPU engine: bound to the machine architecture it was built on."""
    return {"kind": "cpu", "machine": env["machine"]}


def machine_problems(m: dict, env: dict) -> list[str]:
    """An engine built on another CPU architecture (x86_64, aarch64) does not run here."""
    arch = obj(m.get("hardware")).get("machine")
    if arch and env.get("machine") and arch != env["machine"]:
        return [f"the engine was built on {arch}, this machine is {env['machine']}; rebuild it here"]
    return []


def nothing(m: dict, env: dict) -> list[str]:
    return []


@dataclass(frozen=True)
class Deploy:
    """What a target's packaged engine is bound to and needs where it is deployed."""
    # tools whose exact version the engine is bound to (pipeline.host.tools labels): verify-deploy refuses another
    bound_tools: tuple[str, ...] = ()
    # (info, env) -> the manifest's "hardware" record: what the engine needs (cpu + machine, gpu + SM, ...)
    hardware: Callable[[dict, dict], dict] = machine_hardware
    # (manifest, env) -> why this host cannot serve the engine, each with its fix ([] = it can)
    problems: Callable[[dict, dict], list[str]] = machine_problems
    # (manifest, env) -> what may differ here without making it unfit (numbers measured on another CPU, ...)
    warnings: Callable[[dict, dict], list[str]] = nothing


def gpu_sm_of(info: dict) -> int | None:
    """The GPU SM an engine was built for: ``gpu_sm``, or the package stage's ``target`` "sm90"."""
    if info.get("gpu_sm") is not None:
        return int(info["gpu_sm"])
    target = info.get("target")
    if isinstance(target, str) and target.lower().startswith("sm") and target[2:].isdigit():
        return int(target[2:])
    return None


def gpu_arch(bound_tools: tuple[str, ...], sm_key: str) -> Deploy:
    """An engine built for one GPU architecture (TensorRT, TensorRT-LLM): it runs only on a GPU of that SM, and
    ``sm_key`` is the recipe key that builds it for another (``build.<target>.gpu_sm``)."""
    def hardware(info: dict, env: dict) -> dict:
        sm = gpu_sm_of(info)
        if sm is None:
            raise ForgeError(f"the manifest of a GPU engine needs the GPU SM it was built for: set {sm_key} "
                             "(e.g. 90) or build on the GPU; an engine only runs on that architecture")
        return {"kind": "gpu", "sm": sm}

    def problems(m: dict, env: dict) -> list[str]:
        sm = obj(m.get("hardware")).get("sm")
        sms = env.get("gpu_sms") or []
        if not sms:
            return [f"no NVIDIA GPU found here; the {m.get('engine')} engine needs a GPU with SM {sm}"]
        if sm not in sms:
            return [f"the engine was built for SM {sm}, this machine's GPUs are SM {sms}; rebuild it here with "
                    f"`forge build {recipe_name(m)} --set {sm_key}={sms[0]}`"]
        return []
    return Deploy(bound_tools=tuple(bound_tools), hardware=hardware, problems=problems)
