"""SYNTHETIC multi-GPU hosts for `forge doctor` tests (issue 18): NOT captured from real machines.

Each host is a list of fake-NVML GPU dicts in the style of ``test_doctor.FakeNVML`` (key ``X`` answers
``nvmlDeviceGetX(handle, *args)``; a callable is called with the remaining arguments; a missing key means
NOT_SUPPORTED). Pairwise functions (``TopologyCommonAncestor``, ``P2PStatus``) take the other GPU's handle.
The layouts are modelled on common machine types, with values chosen by hand:

- ``workstation_2x_pcie``: 2 GPUs under the CPU's root complex (PHB), no NVLink, PCIe P2P "gpu not supported"
  (as consumer boards report it); one NUMA node.
- ``pcie_4x_two_sockets``: 4 GPUs, two per socket behind one PCIe switch each (PIX), SYS across sockets, no
  NVLink; ``interleaved=True`` enumerates them 0,2 on socket 0 and 1,3 on socket 1.
- ``hgx_8x_nvswitch``: 8 GPUs, 18 NVLinks each to NVSwitches, NVLink P2P between all pairs; GPUs 0-3 on NUMA
  node 0, 4-7 on node 1 (PCIe NODE within a node, SYS across); ``fabric_manager=False``: NVLink P2P "not
  supported" (the state of an NVSwitch system whose Fabric Manager is not running).

The ``nvidia-smi topo -m`` texts below are written by hand in the tab-separated layout current drivers print
(header, one row per GPU/NIC, affinity columns, legend); they are not captures either.
"""

from __future__ import annotations

NVML_TOPOLOGY = {"internal": 0, "PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}
P2P_OK, P2P_GPU_NOT_SUPPORTED, P2P_NOT_SUPPORTED = 0, 2, 5
NVLINK_SWITCH = 2


class Pci:
    def __init__(self, bus):
        self.busId = bus.encode()


def _gpu(i, name, *, numa, cpus_mask, bus):
    return {"_index": i, "Name": name, "CudaComputeCapability": (9, 0), "CurrPcieLinkGeneration": 5,
            "MaxPcieLinkGeneration": 5, "GpuMaxPcieLinkGeneration": 5, "CurrPcieLinkWidth": 16,
            "MaxPcieLinkWidth": 16, "Temperature": 40, "TemperatureThreshold": 90, "ClockInfo": 1980,
            "MaxClockInfo": 1980, "CurrentClocksEventReasons": 0, "PerformanceState": 0, "PersistenceMode": 1,
            "MemoryAffinity": lambda size, scope, n=numa: [1 << n],
            "CpuAffinity": lambda size, m=cpus_mask: [m],
            "PciInfo": Pci(bus)}


def _wire(gpus, path, p2p_read, p2p_nvlink=None):
    """Pairwise answers: path(i, j) -> PCIe label; p2p_read(i, j) / p2p_nvlink(i, j) -> NVML P2P status."""
    for g in gpus:
        i = g["_index"]
        g["TopologyCommonAncestor"] = lambda other, i=i: NVML_TOPOLOGY[path(i, other["_index"])]
        g["P2PStatus"] = lambda other, cap, i=i: (p2p_nvlink or (lambda a, b: P2P_NOT_SUPPORTED))(
            i, other["_index"]) if cap == 2 else p2p_read(i, other["_index"])
    return gpus


def workstation_2x_pcie():
    gpus = [_gpu(i, "NVIDIA GeForce RTX 4090", numa=0, cpus_mask=0xFFFF, bus=f"00000000:{0x41 + i:02X}:00.0")
            for i in range(2)]
    return _wire(gpus, lambda a, b: "PHB", lambda a, b: P2P_GPU_NOT_SUPPORTED)


def pcie_4x_two_sockets(interleaved=False):
    socket = [0, 1, 0, 1] if interleaved else [0, 0, 1, 1]
    masks = {0: 0xFFFF, 1: 0xFFFF << 16}
    gpus = [_gpu(i, "NVIDIA L40S", numa=socket[i], cpus_mask=masks[socket[i]], bus=f"00000000:{0x18 + i:02X}:00.0")
            for i in range(4)]
    return _wire(gpus, lambda a, b: "PIX" if socket[a] == socket[b] else "SYS", lambda a, b: P2P_OK)


def hgx_8x_nvswitch(fabric_manager=True):
    masks = {0: 0xFFFFFFFF, 1: 0xFFFFFFFF << 32}
    gpus = []
    for i in range(8):
        node = i // 4
        g = _gpu(i, "NVIDIA H200", numa=node, cpus_mask=masks[node], bus=f"00000000:{0x19 + 0x10 * i:02X}:00.0")
        g["NvLinkState"] = lambda link: 1                              # all 18 links up
        g["NvLinkVersion"] = lambda link: 4
        g["NvLinkRemotePciInfo_v2"] = lambda link: Pci("00000000:00:00.0")   # an NVSwitch, not a GPU
        g["NvLinkRemoteDeviceType"] = lambda link: NVLINK_SWITCH
        gpus.append(g)
    nv = (lambda a, b: P2P_OK) if fabric_manager else (lambda a, b: P2P_NOT_SUPPORTED)
    return _wire(gpus, lambda a, b: "NODE" if a // 4 == b // 4 else "SYS", lambda a, b: P2P_OK, nv)


HOST_1NODE = {"cpu_model": "test", "logical_cpus": 16, "process_cpus": "0-15", "process_cpu_count": 16,
              "numa_nodes": {0: "0-15"}, "memory": {"total_bytes": 64 * 2**30, "available_bytes": 60 * 2**30},
              "thread_env": {}, "gpu_env": {}}
HOST_2X16 = dict(HOST_1NODE, logical_cpus=32, process_cpus="0-31", process_cpu_count=32,
                 numa_nodes={0: "0-15", 1: "16-31"})
HOST_2X32 = dict(HOST_1NODE, logical_cpus=64, process_cpus="0-63", process_cpu_count=64,
                 numa_nodes={0: "0-31", 1: "32-63"})


def _row(name, cells):
    return name + "\t" + "\t".join(cells)


def smi_topo_hgx8() -> str:
    """Hand-written ``nvidia-smi topo -m`` for ``hgx_8x_nvswitch`` plus two NICs (tab-separated, current layout)."""
    cols = [f"GPU{i}" for i in range(8)] + ["NIC0", "NIC1"]
    lines = ["\t" + "\t".join(cols + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])]
    for i in range(8):
        cells = [" X " if i == j else "NV18" for j in range(8)]
        cells += ["PXB" if i // 4 == 0 else "SYS", "SYS" if i // 4 == 0 else "PXB"]
        aff = "0-31" if i < 4 else "32-63"
        lines.append(_row(f"GPU{i}", cells + [aff, str(i // 4), "", "N/A"]))
    for k in range(2):
        lines.append(_row(f"NIC{k}", [("PXB" if i // 4 == k else "SYS") for i in range(8)] +
                          [" X " if k == m else "SYS" for m in range(2)]))
    lines += ["", "Legend:", "", "  X    = Self",
              "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)",
              "  NV#  = Connection traversing a bonded set of # NVLinks", "", "NIC Legend:", "",
              "  NIC0: mlx5_0", "  NIC1: mlx5_1", ""]
    return "\n".join(lines)


def smi_topo_2x_spaces() -> str:
    """Hand-written ``nvidia-smi topo -m`` for 2 GPUs in the older space-padded layout (no GPU NUMA ID column)."""
    return ("        GPU0    GPU1    CPU Affinity    NUMA Affinity\n"
            "GPU0     X      PHB     0-15            0\n"
            "GPU1    PHB      X      0-15            0\n"
            "\nLegend:\n\n  X    = Self\n  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge\n")
