"""What a night records about where it ran, and how a finished build becomes a history ``Run``.

Machine facts come from ``pipeline/host/`` (CPU model, flags, ISA class, forge's git commit) and
``pipeline/doctor.py`` (tool versions, GPUs via NVML). ``machine_class`` is what a baseline must share
with tonight: numbers from another CPU ISA class or another GPU are not comparable.
"""

from __future__ import annotations

import os
import platform
import time
from datetime import datetime, timedelta, timezone

from ..host import cpu, paths, tools
from .store import Run, flatten_metrics


def cpu_isa() -> str:
    """The CPU's ISA class, as every cache key and report names it (``host.cpu.cpu_isa_class``, its one home)."""
    return cpu.cpu_isa_class()


def gpus() -> tuple[dict, list[dict]]:
    """(driver facts, [{name, sm, memory_gib}]) via NVML; empty where there is no NVIDIA driver."""
    try:
        import pynvml

        from ..doctor import collect_gpus
        drv, found = collect_gpus(pynvml)
    except Exception:   # no pynvml, no driver, no permission: a CPU machine
        return {}, []
    return drv, [{"name": g.get("name"), "sm": g.get("sm"),
                  "memory_gib": round((g.get("memory_total_bytes") or 0) / 2**30, 1)} for g in found]


def tool_versions() -> dict[str, str | None]:
    return {"python": platform.python_version(), **tools.tool_versions(tools.TOOLS)}


def machine_facts() -> dict:
    drv, gpu_list = gpus()
    return {"cpu_model": cpu.cpu_model(), "cpu_isa": cpu_isa(), "arch": platform.machine(),
            "logical_cpus": os.cpu_count(), "os": platform.platform(), "gpus": gpu_list,
            "gpu_driver": drv.get("driver"), "cuda_driver": drv.get("cuda_driver"), "tools": tool_versions()}


def machine_class(facts: dict) -> str:
    names = [g.get("name") or "?" for g in facts.get("gpus") or []]
    gpu = f" + {len(names)}x {names[0]}" if names and len(set(names)) == 1 else (" + " + ", ".join(names) if names else "")
    return f"{facts.get('cpu_isa') or facts.get('arch')}{gpu}"


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def parse_utc(ts: str) -> datetime:
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def night_from_report(report: dict, recipe_dict: dict, facts: dict, report_path: str | None = None) -> Run:
    """A not-yet-stored Run from ``report.build_report``'s dict (the same shape a stored night has)."""
    finished = report.get("finished") or utc_now()
    wall = report.get("wall_s")
    try:
        started = (parse_utc(finished) - timedelta(seconds=float(wall or 0))).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (ValueError, TypeError):
        started = finished
    commit, dirty = paths.source_commit()
    stages, metrics, gates = [], {}, []
    for st in report["stages"]:
        stages.append({k: st.get(k) for k in ("name", "status", "key", "duration_s", "peak_rss_mb", "message",
                                              "components")})
        m = st.get("metrics") or {}
        if m:
            metrics[st["name"]] = {n: (v if v is not None else t) for n, v, t in flatten_metrics(m)}
        gates += [dict(g, stage=st["name"]) for g in m.get("gates", []) if isinstance(g, dict)]
    return Run(None, report["recipe"], report["recipe_hash"], report.get("target", ""), report["status"], started,
               finished, wall, recipe_dict, machine_class(facts), facts, commit, dirty, report_path, stages,
               metrics, gates)
