"""forge doctor: real run on this (CPU-only) box, and NVML parsing against a fake NVML."""

import json
from pathlib import Path

import pytest

import pipeline.ort.deploy as ort_deploy
from rich.console import Console

from pipeline import doctor
from pipeline.doctor import gpu_findings, render_doctor, run_doctor
from pipeline.gpu_setup import ort_cpu_pin

DATA = Path(__file__).parent / "data"


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """Same function names as pynvml; each GPU is a dict of the values NVML would return."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus, driver="580.95.05", cuda=13000, fail_init=False):
        self.gpus, self.driver, self.cuda, self.fail_init = gpus, driver, cuda, fail_init
        self.shutdown = False

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return self.cuda

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def __getattr__(self, name):
        # nvmlDeviceGetX(handle, *args) -> handle["X"]; a missing key means NOT_SUPPORTED
        if not name.startswith("nvmlDeviceGet"):
            raise AttributeError(name)
        key = name[len("nvmlDeviceGet"):]

        def f(h, *args):
            if key not in h:
                raise FakeNVMLError("Not Supported")
            v = h[key]
            return v(*args) if callable(v) else v
        return f


class Mem:
    def __init__(self, total, used):
        self.total, self.used = total, used


class Util:
    def __init__(self, gpu):
        self.gpu = gpu



@pytest.fixture(autouse=True)
def _ort_cuda_healthy(monkeypatch):
    """The scenarios here inject NVML/host/version facts; onnxruntime's CUDA provider is injected as healthy too
    (its own findings are tested in tests/ort/test_cuda.py), so this machine's onnxruntime does not leak in."""
    import pipeline.host.cuda
    monkeypatch.setattr(pipeline.host.cuda, "ort_cuda_status", lambda: {
        "onnxruntime": "1.31.1", "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
        "cuda_provider": True, "problem": None})

def healthy(**over):
    g = {"Name": "NVIDIA H100 80GB HBM3", "CudaComputeCapability": (9, 0), "MemoryInfo": Mem(85520809984, 5 * 2**20),
         "CurrPcieLinkGeneration": 5, "MaxPcieLinkGeneration": 5, "GpuMaxPcieLinkGeneration": 5,
         "CurrPcieLinkWidth": 16, "MaxPcieLinkWidth": 16, "Temperature": 40, "TemperatureThreshold": 90,
         "ClockInfo": 1980, "MaxClockInfo": 1980, "CurrentClocksEventReasons": 0, "PerformanceState": 0,
         "UtilizationRates": Util(95), "PersistenceMode": 1, "NumaNodeId": 0, "CpuAffinity": [0xFFFF]}
    g.update(over)
    return g


HOST_1NODE = {"cpu_model": "test", "logical_cpus": 16, "process_cpus": "0-15", "process_cpu_count": 16,
              "numa_nodes": {0: "0-15"}, "memory": {"total_bytes": 64 * 2**30, "available_bytes": 60 * 2**30},
              "thread_env": {}}
HOST_2NODES = dict(HOST_1NODE, logical_cpus=32, process_cpus="0-31", process_cpu_count=32,
                   numa_nodes={0: "0-15", 1: "16-31"})
VERSIONS = {"python": "3.11", "torch": "2.9.0", "torch_cuda": "12.8", "transformers": "5.0", "modelopt": "0.47",
            "onnx": "1.20", "onnxruntime": ort_cpu_pin(), "tensorrt": "10.13", "tensorrt_llm": "1.2.0",
            "requests": "2"}


def msgs(rep, sev=None):
    return [f["message"] + " | " + f["fix"] for f in rep["findings"] if sev is None or f["severity"] == sev]


def test_cpu_only_box_gives_valid_json_with_no_gpu_finding():
    rep = run_doctor()
    rep2 = json.loads(json.dumps(rep))                     # JSON-serialisable as is
    v = rep2["versions"]
    for k in ("python", "torch", "transformers", "modelopt", "onnx", "onnxruntime", "tensorrt", "tensorrt_llm",
              "driver", "cuda_driver", "tritonserver"):
        assert k in v
    assert v["onnxruntime"] and v["torch"]
    if rep["gpus"]:
        pytest.skip("this machine has a GPU")
    assert any("no NVIDIA GPU" in m for m in msgs(rep2, "warning"))
    assert all(f["fix"] for f in rep2["findings"])


def test_fake_nvml_init_failure_is_a_finding_not_a_crash():
    rep = run_doctor(FakeNVML([], fail_init=True), host=HOST_1NODE, versions=VERSIONS)
    assert rep["gpus"] == []
    assert any("no NVIDIA GPU" in m and "Driver Not Loaded" in m for m in msgs(rep))


def test_healthy_gpu_has_no_gpu_findings():
    nv = FakeNVML([healthy()])
    rep = run_doctor(nv, host=HOST_1NODE, versions=VERSIONS)
    assert rep["findings"] == []
    g = rep["gpus"][0]
    assert g["sm"] == "9.0" and g["planner_gpu"] == "h100" and g["cpu_affinity"] == "0-15"
    assert rep["versions"]["driver"] == "580.95.05" and rep["versions"]["cuda_driver"] == "13.0"
    assert nv.shutdown


def test_pcie_gen3_x8_is_flagged_with_slot_fix():
    rep = run_doctor(FakeNVML([healthy(CurrPcieLinkGeneration=3, CurrPcieLinkWidth=8)]), host=HOST_1NODE,
                     versions=VERSIONS)
    w = msgs(rep, "warning")
    assert any("GPU0" in m and "PCIe Gen3 x8, capable of Gen5 x16" in m and "slot/BIOS" in m for m in w), w


def test_idle_gen_downshift_is_only_info():
    g = healthy(CurrPcieLinkGeneration=1, CurrentClocksEventReasons=0x1, UtilizationRates=Util(0), ClockInfo=345)
    rep = run_doctor(FakeNVML([g]), host=HOST_1NODE, versions=VERSIONS)
    assert not msgs(rep, "warning")
    assert any("idles at PCIe Gen1" in m for m in msgs(rep, "info"))


def test_slot_limits_generation():
    rep = run_doctor(FakeNVML([healthy(CurrPcieLinkGeneration=4, MaxPcieLinkGeneration=4)]), host=HOST_1NODE,
                     versions=VERSIONS)
    assert any("supports PCIe Gen5 but the slot allows only Gen4" in m for m in msgs(rep, "warning"))


def test_throttling_and_temperature():
    g = healthy(CurrentClocksEventReasons=0x40 | 0x4, ClockInfo=900, Temperature=88)
    rep = run_doctor(FakeNVML([g]), host=HOST_1NODE, versions=VERSIONS)
    errs = msgs(rep, "error")
    assert any("throttled by hardware (hw_thermal_slowdown)" in m and "SM clock 900 of 1980 MHz" in m for m in errs)
    warns = msgs(rep, "warning")
    assert any("power cap" in m for m in warns)           # 900 < 0.7 x 1980
    assert any("88 C" in m and "slowdown at 90 C" in m for m in warns)
    assert rep["gpus"][0]["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]


def test_two_numa_nodes_suggest_numactl_for_the_gpus_node():
    gpus = [healthy(NumaNodeId=0, CpuAffinity=[0xFFFF]), healthy(NumaNodeId=1, CpuAffinity=[0xFFFF0000])]
    rep = run_doctor(FakeNVML(gpus), host=HOST_2NODES, versions=VERSIONS)
    w = msgs(rep, "warning")
    assert any("GPU0" in m and "numactl --cpunodebind=0 --membind=0" in m for m in w), w
    assert any("GPU1" in m and "numactl --cpunodebind=1 --membind=1" in m for m in w), w
    assert rep["gpus"][1]["cpu_affinity"] == "16-31"
    # already bound to node 1: no NUMA finding for GPU1
    bound = dict(HOST_2NODES, process_cpus="16-31", process_cpu_count=16)
    rep = run_doctor(FakeNVML(gpus), host=bound, versions=VERSIONS)
    assert not any("GPU1" in m and "numactl" in m for m in msgs(rep))


def test_persistence_and_busy_memory_and_missing_tools():
    g = healthy(PersistenceMode=0, MemoryInfo=Mem(80 * 2**30, 30 * 2**30))
    versions = dict(VERSIONS, tensorrt_llm=None, modelopt=None, torch_cuda="13.1")
    rep = run_doctor(FakeNVML([g], cuda=12080), host=HOST_1NODE, versions=versions)
    text = "\n".join(msgs(rep))
    assert "nvidia-smi -pm 1" in text
    assert "30.0 of 80.0 GiB in use" in text
    assert "tensorrt_llm is not installed" in text          # warning on a GPU box
    assert any("nvidia-modelopt is not installed" in m for m in msgs(rep, "error"))
    assert any("CUDA 13.1 but the driver supports CUDA 12.8" in m for m in msgs(rep, "error"))
    # errors are listed first
    sev = [f["severity"] for f in rep["findings"]]
    assert sev == sorted(sev, key=["error", "warning", "info"].index)


def test_function_missing_from_old_nvml_is_tolerated():
    g = healthy()
    del g["CurrentClocksEventReasons"], g["NumaNodeId"], g["GpuMaxPcieLinkGeneration"]
    g["CurrentClocksThrottleReasons"] = 0x8
    rep = run_doctor(FakeNVML([g]), host=HOST_1NODE, versions=VERSIONS)
    assert rep["gpus"][0]["numa_node"] is None
    assert any("hw_slowdown" in m for m in msgs(rep, "error"))


def test_real_h200_capture_is_healthy():
    cap = json.loads((DATA / "h200_nvml.json").read_text())
    g = cap["gpus"][0]
    assert g["planner_gpu"] == "h200" and g["sm"] == "9.0"
    assert gpu_findings(g, cap["host"]) == []


def test_render_shows_fix():
    rep = run_doctor(FakeNVML([healthy(CurrPcieLinkGeneration=3, CurrPcieLinkWidth=8)]), host=HOST_1NODE,
                     versions=VERSIONS)
    con = Console(record=True, width=200)
    render_doctor(rep, con)
    out = con.export_text()
    assert "Gen3 x8 / Gen5 x16" in out and "fix: check the slot/BIOS" in out
    render_doctor(run_doctor(FakeNVML([], fail_init=True), host=HOST_1NODE, versions=VERSIONS), con)
    assert "no NVIDIA GPU" in con.export_text()


def test_thread_env_oversubscription():
    host = dict(HOST_1NODE, process_cpu_count=2, thread_env={"OMP_NUM_THREADS": "16"})
    rep = run_doctor(FakeNVML([], fail_init=True), host=host, versions=VERSIONS)
    assert any("OMP_NUM_THREADS=16" in m for m in msgs(rep, "warning"))
    assert doctor.SEVERITIES == ("error", "warning", "info")


# ------------------------------------------------------------------ CPU ISA class (issue 11)
AVX2 = {"class": "x86_64-avx2", "flags": ["avx", "avx2", "fma"], "source": "cpuid"}


def test_isa_class_reported_and_rendered(capsys):
    from rich.console import Console
    rep = run_doctor(FakeNVML([healthy()]), host=dict(HOST_1NODE, cpu_isa=AVX2), versions=VERSIONS, quantizations={})
    assert rep["host"]["cpu_isa"]["class"] == "x86_64-avx2" and rep["findings"] == []
    render_doctor(rep, Console(width=200))
    assert "CPU ISA class: x86_64-avx2" in capsys.readouterr().out
    from pipeline.host.cpu import cpu_isa
    assert doctor.collect_host()["cpu_isa"] == cpu_isa()


def test_int8_method_known_to_lose_accuracy_on_this_isa_is_a_warning():
    quants = {"recipe old-int8": {"algo": "int8", "options": {"reduce_range": False}},      # full-range s8
              "recipe default-int8": {"algo": "int8", "options": {}},                       # forge's default
              "recipe int4": {"algo": "int4_wo", "options": {}},
              "engine out/x/engine": {"algo": "int8", "method": "mixed", "quantized_matmuls": 211}}  # pre-issue-11 engine
    rep = run_doctor(FakeNVML([healthy()]), host=dict(HOST_1NODE, cpu_isa=AVX2), versions=VERSIONS, quantizations=quants)
    w = msgs(rep, "warning")
    assert len(w) == 2, w
    assert any(m.startswith("recipe old-int8: its INT8 method is known to lose accuracy on this CPU (x86_64-avx2)")
               for m in w)
    assert any(m.startswith("engine out/x/engine:") for m in w)
    vnni = dict(AVX2, **{"class": "x86_64-avx512vnni"})
    assert run_doctor(FakeNVML([healthy()]), host=dict(HOST_1NODE, cpu_isa=vnni), versions=VERSIONS,
                      quantizations=quants)["findings"] == []


def test_isa_read_from_proc_cpuinfo_is_flagged():
    host = dict(HOST_1NODE, cpu_isa=dict(AVX2, source="/proc/cpuinfo"))
    w = msgs(run_doctor(FakeNVML([healthy()]), host=host, versions=VERSIONS, quantizations={}), "warning")
    assert len(w) == 1 and "cpuid-native" in w[0]


def test_each_target_says_which_tool_it_misses():
    """`forge doctor` asks the targets (Target.doctor): a GPU target's missing tool is a warning on a GPU host and
    information on a CPU-only one."""
    v = {k: x for k, x in VERSIONS.items() if k not in ("tensorrt", "tensorrt_llm")}
    want = ("tensorrt_llm is not installed: the tensorrt_llm target stops after the checkpoint stage",
            "tensorrt is not installed: the tensorrt target cannot build engines")
    gpu = msgs(run_doctor(FakeNVML([healthy()]), host=HOST_1NODE, versions=v, quantizations={}), "warning")
    cpu = msgs(run_doctor(FakeNVML([], fail_init=True), host=HOST_1NODE, versions=v, quantizations={}), "info")
    for found in (gpu, cpu):
        assert all(any(m.startswith(w) for m in found) for w in want), found
    assert not any("is not installed" in m for m in msgs(run_doctor(FakeNVML([healthy()]), host=HOST_1NODE,
                                                                     versions=VERSIONS, quantizations={})))


def test_onnxruntime_other_than_the_pin_is_a_warning_naming_make_setup(tmp_path):
    """The onnxruntime version enters every onnxruntime stage's cache key (issue 41): another version than
    pyproject's pin builds other engines than a fresh clone, so doctor says so; the pin itself is silent."""
    pin = ort_cpu_pin()
    rep = run_doctor(FakeNVML([healthy()]), host=HOST_1NODE, versions=dict(VERSIONS, onnxruntime="1.32.0"))
    found = [m for m in msgs(rep, "warning") if "onnxruntime 1.32.0 is installed" in m]
    assert len(found) == 1 and f"pins {pin}" in found[0] and "make setup" in found[0]
    assert ort_deploy.ort_pin_findings(dict(VERSIONS, onnxruntime=pin)) == []
    # an installed forge without its checkout (no pyproject.toml) has no pin to compare with
    assert ort_deploy.ort_pin_findings({"onnxruntime": "1.32.0"}, pyproject=tmp_path / "pyproject.toml") == []
