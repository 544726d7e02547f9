"""GPU-to-GPU topology of a host, and where a recipe's TP / PP ranks land on it (``forge doctor``).

Sources, both reported when present:
- NVML, per pair of GPUs: ``nvmlDeviceGetTopologyCommonAncestor`` (the PCIe path), ``nvmlDeviceGetP2PStatus`` for
  the NVLINK and READ capabilities; per GPU and NVLink: ``nvmlDeviceGetNvLinkState``, the remote end's PCI bus id
  (``nvmlDeviceGetNvLinkRemotePciInfo_v2``) and type (``nvmlDeviceGetNvLinkRemoteDeviceType``: GPU or NVSwitch).
- ``nvidia-smi topo -m``: its matrix (``NV#``, ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``) and the CPU / NUMA
  affinity columns, parsed; used for a pair's link when NVML cannot tell.

Rank placement follows TensorRT-LLM's ``Mapping`` (tensorrt_llm/mapping.py @ 05ebebb2): rank ``r`` runs on local
GPU ``r % gpus_per_node`` (through ``CUDA_VISIBLE_DEVICES`` when set), TP group ``s`` is ranks
``[s * tp, (s + 1) * tp)``. A TP group all-reduces twice per layer, so its slowest link sets its pace; the PP
hand-off moves one hidden state per step and is not weighed here.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from typing import Any

from .host.gpu import nvml_call

# nvml.h constants (stable), used directly: pynvml defines NVML_P2P_CAPS_INDEX_READ as a tuple by mistake.
NVML_P2P_CAPS_INDEX_READ = 0
NVML_P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS = {0: "ok", 1: "chipset not supported", 2: "gpu not supported", 3: "topology not supported",
              4: "disabled by regkey", 5: "not supported", 6: "unknown"}
NVLINK_MAX_LINKS = 18                       # NVML_NVLINK_MAX_LINKS for Hopper (H100/H200: 18 links)
NVLINK_DEVICE_TYPE = {0: "gpu", 1: "ibmnpu", 2: "nvswitch", 0xFF: "unknown"}
NVML_FEATURE_ENABLED = 1
NVML_AFFINITY_SCOPE_NODE = 0
# nvmlGpuTopologyLevel_t -> the label nvidia-smi topo -m prints for that path
TOPOLOGY_LEVEL = {0: "internal", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# slowest first is worst: NVLink, then PCIe paths by how far up the hierarchy they go
LINK_RANK = {"NV": 0, "internal": 1, "PIX": 2, "PXB": 3, "PHB": 4, "NODE": 5, "SYS": 6}
LINK_MEANING = {"PIX": "PCIe through at most one PCIe bridge", "PXB": "PCIe through several PCIe bridges",
                "PHB": "PCIe through the CPU's PCIe host bridge", "internal": "the same board",
                "NODE": "PCIe across host bridges within one NUMA node",
                "SYS": "PCIe plus the CPU-to-CPU interconnect between NUMA nodes (QPI/UPI/Infinity Fabric)"}


def _bus_id(info) -> str | None:
    b = getattr(info, "busId", None) if info is not None else None
    if isinstance(b, bytes):
        b = b.decode()
    return b.strip().lower() if b else None


def _mask_bits(words) -> list[int]:
    return [wi * 64 + b for wi, w in enumerate(words or []) for b in range(64) if int(w) >> b & 1]


def numa_node_of(nvml, h) -> int | None:
    """The NUMA node the GPU is attached to: NVML's ideal memory affinity at node scope when it names one node;
    else ``nvmlDeviceGetNumaNodeId``, which reports a node only where the GPU's memory is itself a NUMA node
    (coherent platforms; on an x86 host it is not supported, as on the H200 capture in tests/doctor/data)."""
    nodes = _mask_bits(nvml_call(nvml, "nvmlDeviceGetMemoryAffinity", h, 1, NVML_AFFINITY_SCOPE_NODE))
    if len(nodes) == 1:
        return nodes[0]
    n = nvml_call(nvml, "nvmlDeviceGetNumaNodeId", h)
    return n if isinstance(n, int) and n >= 0 else None


def _nvlinks(nvml, h) -> list[dict]:
    """Active NVLinks of one GPU: link index, version, remote PCI bus id and remote device type."""
    out = []
    for link in range(NVLINK_MAX_LINKS):
        if nvml_call(nvml, "nvmlDeviceGetNvLinkState", h, link) != NVML_FEATURE_ENABLED:
            continue
        remote = (nvml_call(nvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2", h, link)
                  or nvml_call(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", h, link))
        kind = nvml_call(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
        out.append({"link": link, "version": nvml_call(nvml, "nvmlDeviceGetNvLinkVersion", h, link),
                    "remote_bus_id": _bus_id(remote), "remote_type": NVLINK_DEVICE_TYPE.get(kind)})
    return out


def collect_topology(nvml, handles: list) -> dict[str, Any]:
    """Per GPU its PCI bus id and NVLinks; per pair the link NVML reports. NVML must be initialised."""
    n = len(handles)
    bus = [_bus_id(nvml_call(nvml, "nvmlDeviceGetPciInfo", h)) for h in handles]
    index_of = {b: i for i, b in enumerate(bus) if b}
    links = [_nvlinks(nvml, h) for h in handles]
    gpus = []
    for i, ls in enumerate(links):
        for lk in ls:
            if lk["remote_type"] is None:           # old driver: a remote bus id that is one of ours is a GPU
                lk["remote_type"] = "gpu" if lk["remote_bus_id"] in index_of else None
        gpus.append({"index": i, "pci_bus_id": bus[i], "nvlinks_active": len(ls),
                     "nvlink_version": next((lk["version"] for lk in ls if lk["version"] is not None), None),
                     "nvswitch_links": sum(lk["remote_type"] == "nvswitch" for lk in ls),
                     "nvlink_peers": {str(index_of[lk["remote_bus_id"]]): sum(
                         1 for x in ls if x["remote_bus_id"] == lk["remote_bus_id"])
                         for lk in ls if lk["remote_bus_id"] in index_of}})
    pairs = []
    for i, j in itertools.combinations(range(n), 2):
        level = nvml_call(nvml, "nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
        p2p_nv = nvml_call(nvml, "nvmlDeviceGetP2PStatus", handles[i], handles[j], NVML_P2P_CAPS_INDEX_NVLINK)
        p2p_rd = nvml_call(nvml, "nvmlDeviceGetP2PStatus", handles[i], handles[j], NVML_P2P_CAPS_INDEX_READ)
        direct = gpus[i]["nvlink_peers"].get(str(j), 0)
        switched = min(gpus[i]["nvswitch_links"], gpus[j]["nvswitch_links"])
        pair = {"gpus": [i, j], "pcie_path": TOPOLOGY_LEVEL.get(level) if level is not None else None,
                "p2p_read": P2P_STATUS.get(p2p_rd) if p2p_rd is not None else None,
                "p2p_nvlink": P2P_STATUS.get(p2p_nv) if p2p_nv is not None else None, "source": "nvml"}
        if direct:
            pair.update(link=f"NV{direct}", nvlink=True, nvlinks=direct, via="direct")
        elif switched and p2p_nv in (None, 0):
            pair.update(link=f"NV{switched}", nvlink=True, nvlinks=switched, via="nvswitch")
        elif p2p_nv == 0:                             # NVLink P2P without link details
            pair.update(link="NV", nvlink=True, nvlinks=None, via=None)
        else:
            pair.update(link=pair["pcie_path"], nvlink=False, nvlinks=0, via="pcie" if level is not None else None)
        pairs.append(pair)
    return {"gpus": gpus, "pairs": pairs}


# ------------------------------------------------------------------ nvidia-smi topo -m
def run_nvidia_smi_topo(timeout: float = 20) -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        p = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def _cells(line: str) -> list[str]:
    """Columns of one line: tab-separated (current drivers; empty cells dropped, e.g. ``0\\t\\tN/A``), else runs of
    2+ spaces (older drivers pad with spaces; 'CPU Affinity' keeps its single space)."""
    if "\t" in line:
        return [c.strip() for c in line.split("\t") if c.strip()]
    return [c for c in re.split(r"\s{2,}", line.strip()) if c]


def parse_nvidia_smi_topo(text: str) -> dict[str, Any]:
    """``nvidia-smi topo -m`` -> {"devices": [...], "matrix": {row: {col: label}}, "affinity": {GPUn: {...}}}.
    Lines after "Legend:" are ignored."""
    lines = text.split("Legend:")[0].splitlines()
    header_i = next((i for i, ln in enumerate(lines) if re.search(r"\bGPU0\b", ln) and ln[:1] in (" ", "\t")),
                    None)                             # the header is indented; row labels start the line
    if header_i is None:
        raise ValueError("no header line with GPU0 (is this `nvidia-smi topo -m` output?)")
    header = _cells(lines[header_i])
    devices = [h for h in header if re.fullmatch(r"(GPU|NIC|mlx)\S*", h)]
    extra = header[len(devices):]                     # CPU Affinity, NUMA Affinity, GPU NUMA ID
    matrix: dict[str, dict[str, str]] = {}
    affinity: dict[str, dict[str, str]] = {}
    for ln in lines[header_i + 1:]:
        cells = _cells(ln)
        if not cells or not re.fullmatch(r"(GPU|NIC|mlx)\S*", cells[0]):
            continue
        row, vals = cells[0], cells[1:]
        matrix[row] = {d: v for d, v in zip(devices, vals[:len(devices)])}
        if row.startswith("GPU"):
            affinity[row] = {k.lower().replace(" ", "_"): v for k, v in zip(extra, vals[len(devices):])}
    return {"devices": devices, "matrix": matrix, "affinity": affinity}


def pairs_from_smi(parsed: dict) -> list[dict]:
    """GPU pairs from a parsed ``nvidia-smi topo -m`` (when NVML has no topology functions)."""
    gpus = sorted((int(d[3:]) for d in parsed["devices"] if re.fullmatch(r"GPU\d+", d)))
    out = []
    for i, j in itertools.combinations(gpus, 2):
        label = parsed["matrix"].get(f"GPU{i}", {}).get(f"GPU{j}")
        if label is None:
            continue
        nv = re.fullmatch(r"NV(\d*)", label)
        out.append({"gpus": [i, j], "link": label, "nvlink": bool(nv),
                    "nvlinks": int(nv.group(1)) if nv and nv.group(1) else (None if nv else 0),
                    "pcie_path": None if nv else label, "p2p_read": None, "p2p_nvlink": None, "via": None,
                    "source": "nvidia-smi"})
    return out


# ------------------------------------------------------------------ placement of a recipe's ranks
def _link_rank(pair: dict | None) -> int:
    if pair is None or pair.get("link") is None:
        return LINK_RANK["SYS"]                        # unknown: assume the worst
    return LINK_RANK["NV"] if pair.get("nvlink") else LINK_RANK.get(pair["link"], LINK_RANK["SYS"])


def _pair_map(pairs: list[dict]) -> dict[frozenset, dict]:
    return {frozenset(p["gpus"]): p for p in pairs}


def group_cost(group: list[int], pm: dict, numa: dict[int, int | None]) -> tuple[int, int, int]:
    """(slowest link rank, NUMA nodes spanned - 1, pairs without P2P): lower is better, compared in order."""
    ps = [pm.get(frozenset((a, b))) for a, b in itertools.combinations(group, 2)]
    worst = max((_link_rank(p) for p in ps), default=0)
    nodes = {numa.get(g) for g in group if numa.get(g) is not None}
    no_p2p = sum(1 for p in ps if p and not p.get("nvlink") and p.get("p2p_read") not in (None, "ok"))
    return worst, max(len(nodes) - 1, 0), no_p2p


def best_groups(gpus: list[int], tp: int, pp: int, pm: dict, numa: dict) -> list[list[int]] | None:
    """The pp groups of tp GPUs (from ``gpus``) whose worst group is best, then whose total is; None past 8 GPUs
    (the search is exhaustive)."""
    if len(gpus) > 8 or tp * pp > len(gpus):
        return None
    best: tuple | None = None
    choice = None

    def rec(left: list[int], groups: list[list[int]]):
        nonlocal best, choice
        if len(groups) == pp:
            costs = [group_cost(g, pm, numa) for g in groups]
            key = (max(costs), tuple(sorted(costs, reverse=True)), [g for gr in groups for g in gr])
            if best is None or key < best:
                best, choice = key, [list(g) for g in groups]
            return
        for g in itertools.combinations(left, tp):
            rec([x for x in left if x not in g], groups + [list(g)])
    rec(list(gpus), [])
    return choice


def _visible_gpus(n: int, env: dict) -> tuple[list[int] | None, str | None]:
    """NVML indices in CUDA order: CUDA_VISIBLE_DEVICES when it lists indices; note when it lists UUIDs."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None or cvd.strip() == "":
        return list(range(n)), None
    try:
        idx = [int(x) for x in cvd.split(",") if x.strip()]
    except ValueError:
        return None, f"CUDA_VISIBLE_DEVICES={cvd} names GPUs by UUID/MIG id: ranks cannot be mapped to NVML indices"
    return [i for i in idx if 0 <= i < n], None


def numactl_for(gpu: dict) -> str | None:
    """The binding that keeps a rank's host threads and memory next to its GPU."""
    node = gpu.get("numa_node")
    if node is not None:
        return f"numactl --cpunodebind={node} --membind={node}"
    if gpu.get("cpu_affinity"):
        return f"numactl --physcpubind={gpu['cpu_affinity']}"
    return None


def placement(gpus: list[dict], pairs: list[dict], tp: int, pp: int, env: dict | None = None) -> dict[str, Any]:
    """Ranks -> GPUs for tp x pp on this host, each TP group's slowest link and NUMA span, and the binding per rank."""
    env = dict(os.environ) if env is None else env
    world = tp * pp
    order, note = _visible_gpus(len(gpus), env)
    out: dict[str, Any] = {"tp": tp, "pp": pp, "world": world, "visible": order, "note": note, "ranks": [],
                           "groups": [], "fits": bool(order) and world <= len(order or []),
                           "cuda_device_order": env.get("CUDA_DEVICE_ORDER")}
    if not out["fits"]:
        return out
    by_index = {g["index"]: g for g in gpus}
    numa = {g["index"]: g.get("numa_node") for g in gpus}
    pm = _pair_map(pairs)
    for r in range(world):
        g = by_index[order[r % len(order)]]
        out["ranks"].append({"rank": r, "stage": r // tp, "tp_rank": r % tp, "gpu": g["index"],
                             "numa_node": g.get("numa_node"), "cpus": g.get("cpu_affinity"),
                             "numactl": numactl_for(g)})
    for s in range(pp):
        grp = [order[r] for r in range(s * tp, (s + 1) * tp)]
        worst, span, no_p2p = group_cost(grp, pm, numa)
        slow = [p for a, b in itertools.combinations(grp, 2) if (p := pm.get(frozenset((a, b)))) is not None
                and _link_rank(p) == worst]
        out["groups"].append({"stage": s, "gpus": grp, "slowest_link": slow[0]["link"] if slow else
                              ("NV" if worst == 0 else None), "slowest_pairs": [p["gpus"] for p in slow],
                              "numa_nodes": sorted({n for g in grp if (n := numa.get(g)) is not None}),
                              "pairs_without_p2p": no_p2p, "cost": [worst, span, no_p2p]})
    best = best_groups(order, tp, pp, pm, numa)
    if best is not None:
        now = max(tuple(g["cost"]) for g in out["groups"])
        new = max(group_cost(g, pm, numa) for g in best)
        if new < now:
            used = [x for g in best for x in g]
            seq = used + [i for i in order if i not in used]
            out["better_order"] = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, seq)), "groups": best, "cost": list(new)}
    return out


def placement_findings(pl: dict, finding) -> list[dict]:
    """Warnings for a placement (``finding(severity, message, fix)`` makes one)."""
    out = []
    tp, pp = pl["tp"], pl["pp"]
    if pl.get("note"):
        out.append(finding("warning", pl["note"], "list GPUs by index in CUDA_VISIBLE_DEVICES so forge doctor "
                                                  "can check each rank's GPU"))
    if not pl["fits"]:
        n = len(pl["visible"] or [])
        out.append(finding("error", f"tp {tp} x pp {pp} needs {tp * pp} GPUs, {n} visible",
                           "lower build.tensorrt_llm.tp / pp, or run on a host with more GPUs"))
        return out
    better = pl.get("better_order")
    fix_order = (f"launch with CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={better['CUDA_VISIBLE_DEVICES']} "
                 f"(TP groups {better['groups']})" if better else
                 "no GPU order on this host does better: prefer pp over tp across this link, or fewer ranks")
    for g in pl["groups"]:
        worst, span, no_p2p = g["cost"]
        tag = f"TP group {g['stage']} (GPUs {', '.join(map(str, g['gpus']))})"
        if worst > LINK_RANK["NV"]:
            # through the CPU (PHB / NODE / SYS), or a better order exists: a warning; under one PCIe switch
            # (PIX / PXB) it is the best PCIe gives: said as info
            slow = worst >= LINK_RANK["PHB"] or better is not None
            what = LINK_MEANING.get(g["slowest_link"] or "", "an unknown link")
            out.append(finding("warning" if slow else "info",
                               f"{tag} all-reduces over {g['slowest_link'] or 'an unknown link'} ({what}) between "
                               f"GPUs {g['slowest_pairs']}, not NVLink", fix_order))
        if span and worst > LINK_RANK["NV"]:
            # over NVLink the all-reduce does not touch the CPUs; each rank is bound to its own node (numactl)
            out.append(finding("warning", f"{tag} spans NUMA nodes {g['numa_nodes']}: its all-reduce crosses the "
                                          f"CPU-to-CPU interconnect", fix_order))
        if no_p2p:
            out.append(finding("warning", f"{tag} has {no_p2p} GPU pair(s) without PCIe peer-to-peer: NCCL stages "
                                          f"the all-reduce through host memory",
                               "enable P2P: check the BIOS ACS / IOMMU settings (`nvidia-smi topo -p2p r` shows "
                                          "the status per pair)"))
    return out
