"""forge doctor on multi-GPU hosts (issue 18): GPU-to-GPU links, TP-group placement, numactl per rank.

Every host here is SYNTHETIC (tests/doctor/fake_hosts.py says how each is modelled); no multi-GPU machine has been
available to capture one.
"""

from __future__ import annotations

import json
import sys

import pytest
from rich.console import Console

from pipeline import cli
from pipeline import gpu_topology as topo
from pipeline.doctor import render_doctor, run_doctor

from fake_hosts import (HOST_1NODE, HOST_2X16, HOST_2X32, hgx_8x_nvswitch, pcie_4x_two_sockets, smi_topo_2x_spaces,
                        smi_topo_hgx8, workstation_2x_pcie)
from test_doctor import VERSIONS, FakeNVML


def doctor(gpus, host, **kw):
    kw.setdefault("smi_topo", None)                       # never the real nvidia-smi in these tests
    return json.loads(json.dumps(run_doctor(FakeNVML(gpus), host=host, versions=VERSIONS, **kw)))


def found(rep, sev, *needles):
    return [f for f in rep["findings"] if f["severity"] == sev and all(n in f["message"] + " | " + f["fix"]
                                                                        for n in needles)]


def link(rep, a, b):
    return next(p for p in rep["topology"]["pairs"] if p["gpus"] == [a, b])


# ------------------------------------------------------------------ 2 GPUs, PCIe only
def test_two_pcie_gpus_without_p2p():
    rep = doctor(workstation_2x_pcie(), HOST_1NODE, tp=2, recipe="r")
    p = link(rep, 0, 1)
    assert (p["link"], p["nvlink"], p["p2p_read"], p["source"]) == ("PHB", False, "gpu not supported", "nvml")
    assert found(rep, "info", "GPU0 and GPU1: no PCIe peer-to-peer (gpu not supported)")
    assert found(rep, "info", "no NVLink between any of the 2 GPUs")
    # the recipe's TP group crosses the host bridge and has no P2P: two warnings; no better order on 2 GPUs
    assert found(rep, "warning", "TP group 0 (GPUs 0, 1) all-reduces over PHB", "no GPU order on this host does better")
    assert found(rep, "warning", "1 GPU pair(s) without PCIe peer-to-peer")
    assert [r["numactl"] for r in rep["placement"]["ranks"]] == ["numactl --cpunodebind=0 --membind=0"] * 2


def test_no_topology_without_a_second_gpu_and_no_placement_without_tp():
    rep = doctor(workstation_2x_pcie()[:1], HOST_1NODE)
    assert rep["topology"] is None and rep["placement"] is None
    rep = doctor(workstation_2x_pcie(), HOST_1NODE)
    assert rep["topology"] and rep["placement"] is None
    assert not [f for f in rep["findings"] if "TP group" in f["message"]]


def test_too_few_gpus_for_the_recipe_is_an_error():
    rep = doctor(workstation_2x_pcie(), HOST_1NODE, tp=2, pp=2)
    assert found(rep, "error", "tp 2 x pp 2 needs 4 GPUs, 2 visible", "build.tensorrt_llm.tp")


# ------------------------------------------------------------------ 4 GPUs, two sockets
def test_four_gpus_tp2_pp2_stays_under_each_pcie_switch():
    rep = doctor(pcie_4x_two_sockets(), HOST_2X16, tp=2, pp=2)
    pl = rep["placement"]
    assert [g["gpus"] for g in pl["groups"]] == [[0, 1], [2, 3]]
    assert [g["slowest_link"] for g in pl["groups"]] == ["PIX", "PIX"]
    assert "better_order" not in pl
    assert not found(rep, "warning", "TP group")                    # best PCIe can do: info only
    assert len(found(rep, "info", "all-reduces over PIX")) == 2
    assert [r["numactl"] for r in pl["ranks"]] == ["numactl --cpunodebind=0 --membind=0"] * 2 + \
        ["numactl --cpunodebind=1 --membind=1"] * 2
    assert [r["cpus"] for r in pl["ranks"]] == ["0-15", "0-15", "16-31", "16-31"]


def test_four_gpus_tp4_crosses_sockets():
    rep = doctor(pcie_4x_two_sockets(), HOST_2X16, tp=4)
    g = rep["placement"]["groups"][0]
    assert (g["slowest_link"], g["numa_nodes"]) == ("SYS", [0, 1])
    assert g["slowest_pairs"] == [[0, 2], [0, 3], [1, 2], [1, 3]]
    assert found(rep, "warning", "all-reduces over SYS", "CPU-to-CPU interconnect", "no GPU order")
    assert found(rep, "warning", "spans NUMA nodes [0, 1]")


def test_interleaved_enumeration_gets_a_better_order_and_the_order_fixes_it():
    rep = doctor(pcie_4x_two_sockets(interleaved=True), HOST_2X16, tp=2, pp=2)
    pl = rep["placement"]
    assert [g["slowest_link"] for g in pl["groups"]] == ["SYS", "SYS"]
    assert pl["better_order"]["CUDA_VISIBLE_DEVICES"] == "0,2,1,3"
    w = found(rep, "warning", "TP group 0 (GPUs 0, 1) all-reduces over SYS",
              "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,2,1,3")
    assert w
    # applying the suggestion: ranks 0,1 on GPUs 0,2 (socket 0), ranks 2,3 on GPUs 1,3 (socket 1)
    host = dict(HOST_2X16, gpu_env={"CUDA_VISIBLE_DEVICES": "0,2,1,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    rep = doctor(pcie_4x_two_sockets(interleaved=True), host, tp=2, pp=2)
    assert [r["gpu"] for r in rep["placement"]["ranks"]] == [0, 2, 1, 3]
    assert [g["slowest_link"] for g in rep["placement"]["groups"]] == ["PIX", "PIX"]
    assert not found(rep, "warning", "TP group")
    assert [r["numactl"].split()[-1] for r in rep["placement"]["ranks"]] == ["--membind=0", "--membind=0",
                                                                             "--membind=1", "--membind=1"]


def test_uuid_visible_devices_cannot_be_mapped():
    host = dict(HOST_2X16, gpu_env={"CUDA_VISIBLE_DEVICES": "GPU-8b1e0a4c,GPU-77f0"})
    rep = doctor(pcie_4x_two_sockets(), host, tp=2)
    assert found(rep, "warning", "names GPUs by UUID")
    assert found(rep, "error", "needs 2 GPUs, 0 visible")


# ------------------------------------------------------------------ 8 GPUs, NVSwitch
def test_hgx_nvswitch_tp8_is_all_nvlink_and_binds_each_rank_to_its_node():
    rep = doctor(hgx_8x_nvswitch(), HOST_2X32, tp=8)
    t = rep["topology"]
    assert len(t["pairs"]) == 28
    assert all((p["link"], p["via"], p["p2p_nvlink"]) == ("NV18", "nvswitch", "ok") for p in t["pairs"])
    assert link(rep, 0, 4)["pcie_path"] == "SYS" and link(rep, 0, 3)["pcie_path"] == "NODE"
    assert [(g["nvlinks_active"], g["nvswitch_links"], g["nvlink_version"]) for g in t["gpus"]] == [(18, 18, 4)] * 8
    assert rep["placement"]["groups"][0]["slowest_link"] == "NV18"
    # spanning both NUMA nodes is fine over NVLink: no placement finding; each rank bound to its GPU's node
    assert not [f for f in rep["findings"] if "TP group" in f["message"] or "NVLink" in f["message"]]
    assert [r["numactl"] for r in rep["placement"]["ranks"]] == \
        [f"numactl --cpunodebind={n} --membind={n}" for n in [0] * 4 + [1] * 4]
    assert [g["numa_node"] for g in rep["gpus"]] == [0] * 4 + [1] * 4
    assert [g["cpu_affinity"] for g in rep["gpus"]] == ["0-31"] * 4 + ["32-63"] * 4


def test_hgx_tp4_pp2_groups_each_node():
    rep = doctor(hgx_8x_nvswitch(), HOST_2X32, tp=4, pp=2)
    assert [g["gpus"] for g in rep["placement"]["groups"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g["numa_nodes"] for g in rep["placement"]["groups"]] == [[0], [1]]
    assert not found(rep, "warning", "TP group")


def test_hgx_without_fabric_manager():
    rep = doctor(hgx_8x_nvswitch(fabric_manager=False), HOST_2X32, tp=8)
    p = link(rep, 0, 1)
    assert (p["nvlink"], p["link"], p["p2p_nvlink"]) == (False, "NODE", "not supported")
    assert len(found(rep, "warning", "NVSwitch links but NVLink peer-to-peer is 'not supported'",
                     "nvidia-fabricmanager")) == 28
    assert found(rep, "warning", "TP group 0", "all-reduces over SYS")


def test_nccl_p2p_disable_is_flagged():
    host = dict(HOST_2X32, gpu_env={"NCCL_P2P_DISABLE": "1"})
    rep = doctor(hgx_8x_nvswitch(), host)
    assert found(rep, "warning", "NCCL_P2P_DISABLE=1", "unset NCCL_P2P_DISABLE")


# ------------------------------------------------------------------ nvidia-smi topo -m
def test_parse_nvidia_smi_topo_tab_layout_with_nics():
    t = topo.parse_nvidia_smi_topo(smi_topo_hgx8())
    assert t["devices"] == [f"GPU{i}" for i in range(8)] + ["NIC0", "NIC1"]
    assert t["matrix"]["GPU0"]["GPU7"] == "NV18" and t["matrix"]["GPU0"]["GPU0"] == "X"
    assert t["matrix"]["GPU5"]["NIC1"] == "PXB" and t["matrix"]["NIC0"]["GPU6"] == "SYS"
    assert t["affinity"]["GPU5"] == {"cpu_affinity": "32-63", "numa_affinity": "1", "gpu_numa_id": "N/A"}


def test_parse_nvidia_smi_topo_space_layout_and_garbage():
    t = topo.parse_nvidia_smi_topo(smi_topo_2x_spaces())
    assert t["matrix"]["GPU1"] == {"GPU0": "PHB", "GPU1": "X"}
    assert t["affinity"]["GPU0"] == {"cpu_affinity": "0-15", "numa_affinity": "0"}
    with pytest.raises(ValueError, match="no header line with GPU0"):
        topo.parse_nvidia_smi_topo("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")


def test_nvidia_smi_fills_in_when_nvml_has_no_topology_functions():
    gpus = workstation_2x_pcie()
    for g in gpus:
        del g["TopologyCommonAncestor"], g["P2PStatus"]
    rep = doctor(gpus, HOST_1NODE, tp=2, smi_topo=smi_topo_2x_spaces())
    p = link(rep, 0, 1)
    assert (p["link"], p["source"]) == ("PHB", "nvidia-smi")
    assert rep["topology"]["nvidia_smi_topo"]["affinity"]["GPU1"]["numa_affinity"] == "0"
    assert found(rep, "warning", "all-reduces over PHB")
    # NVML says nothing and nvidia-smi's output is not understood: an info, links unknown (treated as the worst)
    rep = doctor(gpus, HOST_1NODE, tp=2, smi_topo=lambda: "garbage")
    assert found(rep, "info", "`nvidia-smi topo -m` output not understood")
    assert found(rep, "warning", "all-reduces over")


def test_render_shows_link_matrix_and_bindings():
    rep = run_doctor(FakeNVML(pcie_4x_two_sockets(interleaved=True)), host=HOST_2X16, versions=VERSIONS, tp=2, pp=2,
                     recipe="qwen7b-int8", smi_topo=None)
    con = Console(record=True, width=220)
    render_doctor(rep, con)
    out = con.export_text()
    assert "GPU-to-GPU links" in out and "ranks of qwen7b-int8: tp 2 x pp 2" in out
    assert "numactl --cpunodebind=1 --membind=1" in out
    row0 = next(ln for ln in out.splitlines() if ln.strip("│ ").startswith("GPU0") and "SYS" in ln)
    assert [c.strip() for c in row0.split("│")[1:6]] == ["GPU0", "X", "SYS", "PIX", "SYS"]


def test_cli_doctor_recipe_and_set(capsys, monkeypatch):
    def run(*args):
        monkeypatch.setattr(sys, "argv", ["forge", "doctor", *args])
        with pytest.raises(SystemExit) as e:
            cli.main()
        return e.value.code, capsys.readouterr()
    code, out = run("--set", "build.tensorrt_llm.tp=2")
    assert code == 2 and "--set needs --recipe" in " ".join((out.out + out.err).split())
    code, out = run("--recipe", "no-such-recipe", "--json")
    assert code == 2 and "no recipe named 'no-such-recipe'" in " ".join((out.out + out.err).split())
