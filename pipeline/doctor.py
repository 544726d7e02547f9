"""`forge doctor`: tool versions, host facts and per-GPU checks (via NVML), each problem with its fix.

``run_doctor()`` returns plain data::

    {"versions": {...}, "host": {...}, "gpus": [{...}], "topology": {...} | None, "placement": {...} | None,
     "findings": [{"severity", "message", "fix"}]}

GPU facts come from NVML (``pynvml``, package ``nvidia-ml-py``). Every NVML call goes through the
``nvml`` object passed in, so tests inject a fake with the same function names. On a machine without
an NVIDIA driver the report says so as a finding and still lists versions and host facts.
With two or more GPUs, ``topology`` holds the GPU-to-GPU links (NVML and ``nvidia-smi topo -m``,
:mod:`pipeline.gpu_topology`); given a recipe's ``tp`` / ``pp``, ``placement`` maps its ranks to GPUs, warns when
a TP group crosses a slow link or NUMA nodes and gives each rank's ``numactl`` binding.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from pathlib import Path
from typing import Any, Callable

from . import gpu_topology as topo
from . import target_registry as registry
from .deploy import SEVERITIES, finding as _finding

from .host.cpu import cpu_model
from .host.gpu import nvml_call, nvml_driver, nvml_handles, nvml_sm
from .host.tools import TOOLS, tool_version

# NVML constants (stable in nvml.h); used directly so a fake NVML does not have to define them.
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_CLOCK_SM = 1
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

# tools to report (pipeline.host.tools.TOOLS labels: the first installed distribution of each wins)
REPORTED = ("torch", "transformers", "modelopt", "onnx", "onnxruntime", "onnxruntime_genai", "tensorrt", "tensorrt_llm",
            "tritonclient", "pytriton", "nvidia_ml_py", "llama_cpp_python")
REQUIRED = {
    "torch": "no stage can load a model",
    "transformers": "the source / export / quantize stages cannot load the HF model",
    "modelopt": "the quantize and checkpoint stages (NVIDIA ModelOpt) cannot run",
    "onnx": "the export stage cannot write ONNX",
    "onnxruntime": "the default onnxruntime target cannot build or validate",
}
# tritonserver shipped inside nvidia-pytriton wheels
PYTRITON_TRITONSERVER = {"0.7.0": "2.51.0", "0.6.0": "2.49.0", "0.5.5": "2.47.0"}


def collect_versions() -> dict[str, Any]:
    v: dict[str, Any] = {"python": platform.python_version()}
    for label in REPORTED:
        v[label] = tool_version(label)
    v["torch_cuda"] = None
    if v["torch"] and importlib.util.find_spec("torch"):
        try:
            import torch

            v["torch_cuda"] = torch.version.cuda
            v["torch_cuda_available"] = bool(torch.cuda.is_available())
        except Exception as e:  # a broken torch install is itself a finding
            v["torch_import_error"] = f"{type(e).__name__}: {e}"
    if v["onnxruntime"]:
        try:
            import onnxruntime as ort

            v["onnxruntime_providers"] = list(ort.get_available_providers())
        except Exception as e:
            v["onnxruntime_import_error"] = f"{type(e).__name__}: {e}"
    v["tritonserver"] = _tritonserver_version(v.get("pytriton"))
    v["requests"] = tool_version("requests")
    return v


def _tritonserver_version(pytriton: str | None) -> dict | None:
    exe = shutil.which("tritonserver")
    if exe:
        ver_file = Path(exe).resolve().parent.parent / "TRITON_VERSION"   # NGC containers: /opt/tritonserver
        return {"path": exe, "version": ver_file.read_text().strip() if ver_file.exists() else None}
    spec = importlib.util.find_spec("pytriton") if pytriton else None
    if spec and spec.submodule_search_locations:
        exe2 = Path(list(spec.submodule_search_locations)[0]) / "tritonserver" / "bin" / "tritonserver"
        if exe2.exists():
            return {"path": str(exe2), "version": PYTRITON_TRITONSERVER.get(pytriton),
                    "via": f"nvidia-pytriton {pytriton}"}
    return None


def _cpulist(s: str) -> list[int]:
    out: list[int] = []
    for part in s.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def _compact(cpus: list[int]) -> str:
    cpus = sorted(set(cpus))
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def collect_host() -> dict[str, Any]:
    from .host.cpu import cpu_isa
    nodes = {}
    base = Path("/sys/devices/system/node")
    for d in sorted(base.glob("node[0-9]*")) if base.exists() else []:
        try:
            nodes[int(d.name[4:])] = _compact(_cpulist((d / "cpulist").read_text()))
        except (OSError, ValueError):
            continue
    try:
        import psutil

        vm = psutil.virtual_memory()
        mem = {"total_bytes": vm.total, "available_bytes": vm.available}
    except Exception:
        mem = {}
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = list(range(os.cpu_count() or 1))
    return {
        "os": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_isa": cpu_isa(),
        "logical_cpus": os.cpu_count(),
        "process_cpus": _compact(affinity),
        "process_cpu_count": len(affinity),
        "numa_nodes": nodes,
        "memory": mem,
        "thread_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
                       if os.environ.get(k) is not None},
        "gpu_env": {k: v for k, v in os.environ.items()
                    if k.startswith("NCCL_") or k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")},
    }


def _nvml_default():
    import pynvml

    return pynvml


def _affinity_cpus(nvml, h, ncpu: int) -> list[int] | None:
    words = nvml_call(nvml, "nvmlDeviceGetCpuAffinity", h, max(1, (ncpu + 63) // 64))
    if words is None:
        return None
    cpus = []
    for wi, w in enumerate(words):
        w = int(w)
        for b in range(64):
            if w >> b & 1:
                cpus.append(wi * 64 + b)
    return cpus


def collect_gpus(nvml, topology: dict | None = None) -> tuple[dict, list[dict]]:
    """(driver facts, one dict per GPU). Raises nvml.NVMLError when NVML cannot start. With two or more GPUs and a
    ``topology`` dict given, fills it with :func:`pipeline.gpu_topology.collect_topology`'s result."""
    with nvml_handles(nvml) as handles:
        drv = nvml_driver(nvml)
        gpus = []
        ncpu = os.cpu_count() or 1
        for i, h in enumerate(handles):
            sm = nvml_sm(nvml, h)
            mem = nvml_call(nvml, "nvmlDeviceGetMemoryInfo", h)
            reasons = nvml_call(nvml, "nvmlDeviceGetCurrentClocksEventReasons", h)
            if reasons is None:
                reasons = nvml_call(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", h)
            util = nvml_call(nvml, "nvmlDeviceGetUtilizationRates", h)
            pm = nvml_call(nvml, "nvmlDeviceGetPersistenceMode", h)
            numa = topo.numa_node_of(nvml, h)
            aff = _affinity_cpus(nvml, h, ncpu)
            g = {
                "index": i,
                "name": nvml_call(nvml, "nvmlDeviceGetName", h),
                "sm": f"{sm // 10}.{sm % 10}" if sm is not None else None,
                "memory_total_bytes": getattr(mem, "total", None),
                "memory_used_bytes": getattr(mem, "used", None),
                "pcie": {
                    "gen_current": nvml_call(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", h),
                    "gen_max": nvml_call(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h),
                    "gen_gpu_max": nvml_call(nvml, "nvmlDeviceGetGpuMaxPcieLinkGeneration", h),
                    "width_current": nvml_call(nvml, "nvmlDeviceGetCurrPcieLinkWidth", h),
                    "width_max": nvml_call(nvml, "nvmlDeviceGetMaxPcieLinkWidth", h),
                },
                "temperature_c": nvml_call(nvml, "nvmlDeviceGetTemperature", h, NVML_TEMPERATURE_GPU),
                "temperature_slowdown_c": nvml_call(nvml, "nvmlDeviceGetTemperatureThreshold", h,
                                                NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                "sm_clock_mhz": nvml_call(nvml, "nvmlDeviceGetClockInfo", h, NVML_CLOCK_SM),
                "sm_clock_max_mhz": nvml_call(nvml, "nvmlDeviceGetMaxClockInfo", h, NVML_CLOCK_SM),
                "throttle_reasons": None if reasons is None else
                [n for bit, n in THROTTLE_BITS.items() if int(reasons) & bit],
                "pstate": nvml_call(nvml, "nvmlDeviceGetPerformanceState", h),
                "utilization_pct": getattr(util, "gpu", None),
                "numa_node": numa,
                "cpu_affinity": _compact(aff) if aff else None,
                "persistence_mode": None if pm is None else bool(pm),
            }
            from .gpus import match_nvml_name

            spec = match_nvml_name(g["name"] or "")
            g["planner_gpu"] = spec.name if spec else None
            gpus.append(g)
        if topology is not None and len(handles) > 1:
            topology.update(topo.collect_topology(nvml, handles))
        return drv, gpus


def _idle(g: dict) -> bool:
    r = g.get("throttle_reasons") or []
    return "gpu_idle" in r or (g.get("utilization_pct") == 0 and (g.get("pstate") or 0) >= 8)


def gpu_findings(g: dict, host: dict) -> list[dict]:
    out: list[dict] = []
    tag = f"GPU{g['index']} ({g.get('name')})"
    p = g["pcie"]
    gc, gm, gg, wc, wm = p["gen_current"], p["gen_max"], p["gen_gpu_max"], p["width_current"], p["width_max"]
    if None not in (gc, gm, wc, wm):
        cap_gen = max(gm, gg or gm)
        if wc < wm or (gc < gm and not _idle(g)):
            out.append(_finding("warning", f"{tag} runs at PCIe Gen{gc} x{wc}, capable of Gen{cap_gen} x{wm}",
                                "check the slot/BIOS: seat the card in a full x16 slot wired to the CPU, set the "
                                "slot to Gen" f"{cap_gen}/Auto in the BIOS, check risers; then "
                                "`nvidia-smi -q -d PCIE` under load"))
        elif gc < gm:
            out.append(_finding("info", f"{tag} idles at PCIe Gen{gc} x{wc} (max Gen{gm} x{wm})",
                                "normal power saving while idle; re-run `forge doctor` while a job runs to see the "
                                "loaded link"))
        if gg and gm < gg:
            out.append(_finding("warning", f"{tag} supports PCIe Gen{gg} but the slot allows only Gen{gm}",
                                f"move it to a Gen{gg} slot or enable Gen{gg} for the slot in the BIOS"))
    t, ts = g.get("temperature_c"), g.get("temperature_slowdown_c")
    if t is not None and ((ts and t >= ts - 5) or t >= 85):
        out.append(_finding("warning", f"{tag} is at {t} C" + (f" (slowdown at {ts} C)" if ts else ""),
                            "improve cooling/airflow; clocks drop at the slowdown temperature"))
    reasons = set(g.get("throttle_reasons") or [])
    sm, smx = g.get("sm_clock_mhz"), g.get("sm_clock_max_mhz")
    clk = f"SM clock {sm} of {smx} MHz" if sm and smx else "clocks reduced"
    hw = reasons & {"hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
    if hw:
        out.append(_finding("error", f"{tag} is throttled by hardware ({', '.join(sorted(hw))}): {clk}",
                            "check cooling, power cables and PSU; `nvidia-smi -q -d PERFORMANCE` shows which"))
    if "sw_thermal_slowdown" in reasons:
        out.append(_finding("warning", f"{tag} is throttled by the driver for temperature: {clk}",
                            "improve cooling/airflow"))
    if "sw_power_cap" in reasons:
        low = sm and smx and sm < 0.7 * smx
        out.append(_finding("warning" if low else "info", f"{tag} is held at its power cap: {clk}",
                            "check the power limit with `nvidia-smi -q -d POWER` (sudo nvidia-smi -pl <watts> "
                            "raises it up to the board maximum)"))
    if reasons & {"applications_clocks_setting"} and sm and smx and sm < 0.9 * smx:
        out.append(_finding("warning", f"{tag} has application clocks set below max: {clk}",
                            "reset them: sudo nvidia-smi -rac"))
    if g.get("persistence_mode") is False:
        out.append(_finding("info", f"{tag} has persistence mode off",
                            "sudo nvidia-smi -pm 1 keeps the driver loaded between runs (avoids seconds of "
                            "initialisation per process)"))
    used, total = g.get("memory_used_bytes"), g.get("memory_total_bytes")
    if used and total and used > 0.1 * total:
        out.append(_finding("warning", f"{tag} already has {used / 2**30:.1f} of {total / 2**30:.1f} GiB in use",
                            "another process holds GPU memory: the build and KV cache get less; see nvidia-smi"))
    nodes = host.get("numa_nodes") or {}
    node = g.get("numa_node")
    if len(nodes) > 1 and node is not None:
        node_cpus = set(_cpulist(nodes.get(node, ""))) if nodes.get(node) else set(
            _cpulist(g.get("cpu_affinity") or ""))
        proc = set(_cpulist(host.get("process_cpus") or ""))
        if not proc or not node_cpus or not proc <= node_cpus:
            out.append(_finding("warning",
                                f"{tag} is attached to NUMA node {node} but this process may run on CPUs of other "
                                f"nodes ({host.get('process_cpus')})",
                                f"bind the build to NUMA node {node}: numactl --cpunodebind={node} --membind={node} "
                                f"forge build ..."))
    return out


def isa_source_findings(host: dict) -> list[dict]:
    """The CPU's ISA class (pipeline/host/cpu.py) read from /proc/cpuinfo: under an emulator it is the host's."""
    isa = host.get("cpu_isa") or {}
    cls = isa.get("class")
    if cls and isa.get("source") == "/proc/cpuinfo" and cls.startswith("x86_64"):
        return [_finding("warning", f"CPU ISA class {cls} was read from /proc/cpuinfo, not CPUID (cpuid-native is "
                                    "not installed): under an emulator it shows the host's CPU, not the one "
                                    "ONNX Runtime runs on",
                         "pip install cpuid-native (`make setup` installs it)")]
    return []


def shipped_recipes() -> list:
    """The recipes in recipes/ that resolve, for the targets' checks (a broken one is `forge recipes`' to report)."""
    from .errors import ForgeError
    from .recipe import list_recipes, resolve
    out = []
    for name in list_recipes():
        try:
            out.append(resolve(name))
        except ForgeError:
            continue
    return out


def target_findings(facts: dict) -> list[dict]:
    """What each registered target checks on this host (``Target.doctor``), given ``facts``: ``versions``,
    ``host``, ``gpus``, ``ort_cuda``, ``recipes`` (the shipped recipes of that target), and whatever run_doctor was
    given to hand them instead of collecting it (``quantizations``, ...)."""
    targets = [t for t in registry.all_targets() if t.doctor is not None]
    recipes = facts.get("recipes")
    if recipes is None and targets:
        recipes = shipped_recipes()
    out = []
    for t in targets:
        out += t.doctor({**facts, "recipes": [r for r in recipes if r.build.target == t.name]})
    return out


def host_findings(host: dict, versions: dict) -> list[dict]:
    out = []
    n = host.get("process_cpu_count") or 1
    for k, val in (host.get("thread_env") or {}).items():
        if val.isdigit() and int(val) > n:
            out.append(_finding("warning", f"{k}={val} but this process may use {n} CPUs",
                                f"export {k}={n} (oversubscribed threads slow ONNX Runtime and torch down)"))
    avail = (host.get("memory") or {}).get("available_bytes")
    if avail is not None and avail < 8 * 2**30:
        out.append(_finding("warning", f"only {avail / 2**30:.1f} GiB RAM available",
                            "ONNX export of even a 135M model peaks near 3.5 GiB; a 7B model needs ~2x its fp16 "
                            "size: free memory or use a larger machine"))
    if versions.get("modelopt") and not versions.get("requests"):
        out.append(_finding("error", "nvidia-modelopt is installed but `requests` is not (modelopt imports it)",
                            "pip install requests"))
    if versions.get("torch_import_error"):
        out.append(_finding("error", f"torch does not import: {versions['torch_import_error']}",
                            "reinstall torch with `make setup`"))
    return out


def topology_findings(t: dict, host: dict) -> list[dict]:
    """Problems of the GPU-to-GPU links that hold whatever the recipe (placement_findings covers a recipe's ranks)."""
    out = []
    gpus = {g["index"]: g for g in t.get("gpus") or []}
    for p in t["pairs"]:
        a, b = p["gpus"]
        sw = (gpus.get(a, {}).get("nvswitch_links") or 0) and (gpus.get(b, {}).get("nvswitch_links") or 0)
        if sw and not p.get("nvlink"):
            out.append(_finding("warning", f"GPU{a} and GPU{b} have NVSwitch links but NVLink peer-to-peer is "
                                           f"'{p.get('p2p_nvlink')}': their traffic takes {p.get('link')} instead",
                                "start NVIDIA Fabric Manager (systemctl enable --now nvidia-fabricmanager; its "
                                "version must match the driver's), then re-run forge doctor"))
        elif not p.get("nvlink") and p.get("p2p_read") not in (None, "ok"):
            out.append(_finding("info", f"GPU{a} and GPU{b}: no PCIe peer-to-peer ({p['p2p_read']}); NCCL goes "
                                        f"through host memory between them",
                                "check the BIOS ACS / IOMMU settings; `nvidia-smi topo -p2p r` shows it per pair"))
    if t["pairs"] and not any(p.get("nvlink") for p in t["pairs"]):
        out.append(_finding("info", f"no NVLink between any of the {len(gpus) or 'several'} GPUs: a tp > 1 "
                                    f"all-reduce runs at PCIe speed",
                            "keep TP groups on GPUs under one PCIe switch (PIX), split further with pp"))
    env = host.get("gpu_env") or {}
    if env.get("NCCL_P2P_DISABLE", "0") not in ("0", ""):
        out.append(_finding("warning", f"NCCL_P2P_DISABLE={env['NCCL_P2P_DISABLE']}: NCCL copies through host "
                                       f"memory even between NVLink-connected GPUs", "unset NCCL_P2P_DISABLE"))
    return out


def _topology(nvml_topology: dict, smi_topo) -> tuple[dict, list[dict]]:
    """NVML's pairs, nvidia-smi's matrix beside them; nvidia-smi's links where NVML could not say."""
    findings = []
    text = smi_topo() if callable(smi_topo) else smi_topo
    parsed = None
    if text:
        try:
            parsed = topo.parse_nvidia_smi_topo(text)
        except ValueError as e:
            findings.append(_finding("info", f"`nvidia-smi topo -m` output not understood: {e}",
                                     "the NVML topology above is complete without it"))
    pairs = nvml_topology.get("pairs") or []
    if parsed and (not pairs or all(p.get("link") is None for p in pairs)):
        pairs = topo.pairs_from_smi(parsed)
    return {"gpus": nvml_topology.get("gpus") or [], "pairs": pairs, "nvidia_smi_topo": parsed}, findings


def run_doctor(nvml=None, *, host: dict | None = None, versions: dict | None = None, tp: int | None = None,
               pp: int = 1, recipe: str | None = None,
               smi_topo: str | Callable[[], str | None] | None = topo.run_nvidia_smi_topo,
               ort_cuda: dict | None = None, **target_facts) -> dict:
    """Collect versions, host facts and GPU facts; return them with findings (problem + fix).

    ``nvml`` defaults to ``pynvml``; ``host`` / ``versions`` override the collected facts (tests). ``tp`` / ``pp``
    (``recipe`` names where they come from) add the placement of that many ranks. ``smi_topo``: the text of
    ``nvidia-smi topo -m``, or a function that returns it (by default it runs the tool when there are 2+ GPUs).
    ``ort_cuda``: onnxruntime's CUDA provider (pipeline.host.cuda.ort_cuda_status). ``target_facts`` are handed to
    the targets' checks instead of what they collect (``quantizations={}``: no recipe or engine INT8 method for
    the onnxruntime target's ISA check; ``recipes=[...]``).
    """
    versions = dict(versions) if versions is not None else collect_versions()
    host = dict(host) if host is not None else collect_host()
    findings: list[dict] = []
    gpus: list[dict] = []
    nvml_topology: dict = {}
    try:
        nvml = nvml if nvml is not None else _nvml_default()
        drv, gpus = collect_gpus(nvml, nvml_topology)
        versions.update(drv)
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / ImportError
        versions.setdefault("driver", None)
        versions.setdefault("cuda_driver", None)
        findings.append(_finding("warning", f"no NVIDIA GPU found (NVML: {type(e).__name__}: {e})",
                                 "a recipe builds here up to its first stage that needs a GPU (`forge plan RECIPE` "
                                 "says which, exit 3, and the command that finishes it): finish it on a machine "
                                 "where `nvidia-smi` works (`forge doctor` there should list the GPU)"))
    if not gpus and not findings:
        findings.append(_finding("warning", "NVML works but reports no GPU",
                                 "check CUDA_VISIBLE_DEVICES / container --gpus flags; `nvidia-smi -L` lists GPUs"))
    for g in gpus:
        findings.extend(gpu_findings(g, host))
    topology = placement = None
    if len(gpus) > 1:
        topology, f = _topology(nvml_topology, smi_topo)
        findings.extend(f + topology_findings(topology, host))
    if tp is not None and gpus:
        placement = topo.placement(gpus, (topology or {}).get("pairs") or [], int(tp), int(pp),
                                   env=host.get("gpu_env") or {})
        placement["recipe"] = recipe
        findings.extend(topo.placement_findings(placement, _finding))
    findings.extend(host_findings(host, versions))
    findings.extend(isa_source_findings(host))
    if gpus:
        tc = versions.get("torch_cuda")
        if versions.get("torch") and not tc:
            findings.append(_finding("warning", f"torch {versions['torch']} is a CPU build on a GPU machine",
                                     "ModelOpt calibration will run on CPU (slow): install the CUDA torch wheel"))
        cd = versions.get("cuda_driver")
        if tc and cd and tuple(map(int, tc.split(".")[:2])) > tuple(map(int, cd.split(".")[:2])):
            findings.append(_finding("error", f"torch is built for CUDA {tc} but the driver supports CUDA {cd}",
                                     "upgrade the NVIDIA driver or install a torch wheel for an older CUDA"))
    for label, what in REQUIRED.items():
        if not versions.get(label):
            findings.append(_finding("error", f"{TOOLS[label][0]} is not installed: {what}",
                                     f"pip install {TOOLS[label][0]} (`make setup` installs everything forge "
                                     f"needs)"))
    if ort_cuda is None:
        from .host.cuda import ort_cuda_status
        ort_cuda = ort_cuda_status()
    findings.extend(target_findings({"versions": versions, "host": host, "gpus": gpus, "ort_cuda": ort_cuda,
                                     **target_facts}))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: order[f["severity"]])
    return {"versions": versions, "host": host, "gpus": gpus, "topology": topology, "placement": placement,
            "onnxruntime_cuda": ort_cuda, "findings": findings}


def render_doctor(report: dict, console) -> None:
    """Human view of ``run_doctor()``'s report."""
    from rich.table import Table

    v = report["versions"]
    t = Table(title="versions", show_header=False)
    t.add_column("tool")
    t.add_column("version")
    for k, val in v.items():
        if isinstance(val, dict):
            val = " ".join(f"{a}={b}" for a, b in val.items() if b)
        elif isinstance(val, list):
            val = ", ".join(map(str, val))
        missing = "[dim]not installed[/dim]" if k in REPORTED or k == "tritonserver" else "[dim]-[/dim]"
        t.add_row(k, missing if val is None else str(val))
    console.print(t)
    h = report["host"]
    mem = h.get("memory") or {}
    console.print(f"host: {h.get('cpu_model')}, {h.get('logical_cpus')} CPUs (this process: {h.get('process_cpus')}), "
                  f"NUMA nodes: {len(h.get('numa_nodes') or {}) or '?'}, RAM "
                  f"{mem.get('available_bytes', 0) / 2**30:.1f} of {mem.get('total_bytes', 0) / 2**30:.1f} GiB free")
    isa = h.get("cpu_isa") or {}
    if isa:
        console.print(f"CPU ISA class: {isa.get('class')} (what changes ONNX Runtime's int8 numbers; from "
                      f"{isa.get('source')}: {' '.join(isa.get('flags') or []) or 'no SIMD extensions'})")
    if report["gpus"]:
        gt = Table(title="GPUs")
        for c in ("#", "name", "SM", "memory", "PCIe now/max", "temp", "SM clock", "throttle", "NUMA", "CPUs", "pm"):
            gt.add_column(c)
        for g in report["gpus"]:
            p = g["pcie"]
            gt.add_row(str(g["index"]), str(g["name"]), str(g["sm"]),
                       f"{(g['memory_total_bytes'] or 0) / 2**30:.1f} GiB",
                       f"Gen{p['gen_current']} x{p['width_current']} / Gen{p['gen_max']} x{p['width_max']}",
                       f"{g['temperature_c']} C", f"{g['sm_clock_mhz']}/{g['sm_clock_max_mhz']} MHz",
                       ",".join(g["throttle_reasons"] or []) or "-", str(g["numa_node"]), str(g["cpu_affinity"]),
                       {True: "on", False: "off", None: "?"}[g["persistence_mode"]])
        console.print(gt)
    t = report.get("topology")
    if t and t.get("pairs"):
        idx = sorted({i for p in t["pairs"] for i in p["gpus"]})
        link = {frozenset(p["gpus"]): p.get("link") or "?" for p in t["pairs"]}
        tt = Table(title="GPU-to-GPU links (NV#: # NVLinks, else the PCIe path)")
        tt.add_column("")
        for j in idx:
            tt.add_column(f"GPU{j}")
        for i in idx:
            tt.add_row(f"GPU{i}", *["X" if i == j else str(link.get(frozenset((i, j)), "?")) for j in idx])
        console.print(tt)
    pl = report.get("placement")
    if pl and pl.get("ranks"):
        pt = Table(title=f"ranks of {pl.get('recipe') or 'the recipe'}: tp {pl['tp']} x pp {pl['pp']}")
        for c in ("rank", "stage", "tp rank", "GPU", "NUMA", "CPUs", "binding"):
            pt.add_column(c)
        for r in pl["ranks"]:
            pt.add_row(str(r["rank"]), str(r["stage"]), str(r["tp_rank"]), str(r["gpu"]), str(r["numa_node"]),
                       str(r["cpus"]), r["numactl"] or "-")
        console.print(pt)
    oc = report.get("onnxruntime_cuda") or {}
    libs = ", ".join(f"{k} {v.get('version') or '?'}" if v.get("found") else f"{k} missing"
                     for k, v in (oc.get("libraries") or {}).items())
    console.print(f"onnxruntime {oc.get('onnxruntime')}: CUDAExecutionProvider "
                  f"{'available' if oc.get('cuda_provider') else 'not available'}"
                  + (f", usable (session providers {oc.get('session_providers')})" if oc.get("cuda_provider")
                     and not oc.get("problem") else "") + (f"; CUDA libraries: {libs}" if libs else ""))
    dirs = sorted({str(Path(v).parent) for v in ((oc.get("preloaded") or {}).get("loaded") or {}).values() if v})
    if dirs:        # forge loads NVIDIA's wheel libraries itself (pipeline.host.cuda.preload_cuda): no LD_LIBRARY_PATH
        console.print(f"CUDA libraries loaded by forge from: {', '.join(dirs)}")
    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    if not report["findings"]:
        console.print("[green]no problems found[/green]")
    for f in report["findings"]:
        c = colors[f["severity"]]
        console.print(f"[{c}]{f['severity']}[/{c}]: {f['message']}")
        if f["fix"]:
            console.print(f"    fix: {f['fix']}")
