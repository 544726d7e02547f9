"""The typed hardware of every target's stages (pipeline/hardware.py): the cache-key text it has always had, the
Ray request it makes against a fake cluster (a CPU node, an sm_90 GPU node of another CPU class) and the hint when
nothing can be placed. No cluster, no server."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from pipeline.cache import make_key
from pipeline.hardware import Hardware
from pipeline.ray_executor import Node, node_resources, place, request
from pipeline.recipe import resolve
from pipeline.stages import flow_for

CPU_NODE = Node("a" * 56, "10.0.0.1", {"CPU": 8.0, "isa:x86_64-avx2": 1.0})
SM90_NODE = Node("b" * 56, "10.0.0.2", {"CPU": 16.0, "GPU": 1.0, "sm_90": 1.0, "isa:x86_64-amx": 1.0})
NODES = [CPU_NODE, SM90_NODE]
ON_CPU_NODE, ON_SM90_NODE, ANYWHERE = f"on 10.0.0.1 ({'a' * 8})", f"on 10.0.0.2 ({'b' * 8})", "on any of 2 nodes"
CPU1 = {"CPU": 1.0}
ISA = {"CPU": 1.0, "isa:x86_64-avx2": 0.001}
GPU_SM90 = {"CPU": 1.0, "GPU": 1.0, "sm_90": 1.0}


@pytest.fixture
def driver(monkeypatch):
    """The driver emulated: an x86_64-avx2 CPU and an H200 (sm_90), whatever this machine has."""
    monkeypatch.setattr("pipeline.host.cpu.cpu_isa_class", lambda: "x86_64-avx2")
    monkeypatch.setattr("pipeline.host.gpu.cuda_device", lambda: {"sm": 90, "name": "NVIDIA H200"})
    monkeypatch.setattr("pipeline.stages.base.gpu_sm", lambda: 90)
    return monkeypatch


def _stages(r):
    return {s.name: s for s in flow_for(r.build.target)}


# the request of every stage of every target, and where it goes on the fake cluster
CASES = {
    "onnxruntime (cpu)": ("smollm2-135m-int8", [], {
        "source": CPU1, "export": CPU1, "quantize": CPU1, "build": ISA, "evaluate": ISA, "validate": CPU1,
        "package": CPU1}),
    "onnxruntime (cuda)": ("smollm2-135m-cuda-fp16", [], {
        "source": CPU1, "export": CPU1, "quantize": CPU1, "build": GPU_SM90, "evaluate": GPU_SM90,
        "validate": CPU1, "package": GPU_SM90}),
    "tensorrt": ("smollm2-135m-trt-int8", ["build.tensorrt.gpu_sm=90"], {
        "source": CPU1, "export": CPU1, "quantize": CPU1, "evaluate_qdq": CPU1, "validate_qdq": CPU1,
        "build": GPU_SM90}),
    "tensorrt_llm": ("qwen7b-int8", ["build.tensorrt_llm.gpu_sm=90", "build.tensorrt_llm.tp=1"], {
        "source": CPU1, "quantize": CPU1, "checkpoint": CPU1, "evaluate_checkpoint": CPU1,
        "validate_checkpoint": CPU1, "build": GPU_SM90, "evaluate": GPU_SM90, "validate": CPU1, "build_deploy": GPU_SM90,
        "package": GPU_SM90}),
}


@pytest.mark.parametrize("case", CASES)
def test_every_target_asks_ray_for_what_its_stages_are_bound_to(driver, case):
    name, sets, want = CASES[case]
    r = resolve(name, sets)
    stages = _stages(r)
    assert {n: request(s, r) for n, s in stages.items()} == want
    where = {req_name: ANYWHERE if want[req_name] == CPU1 else ON_CPU_NODE if want[req_name] == ISA else ON_SM90_NODE
             for req_name in want}
    for n, s in stages.items():
        missing, at = place(s, r, NODES)
        assert missing is None and at.endswith(where[n]), (n, missing, at)


def test_cuda_ort_stages_never_land_on_a_cpu_node(driver):
    r = resolve("smollm2-135m-cuda-int8wo")
    for n in ("build", "evaluate", "package"):
        missing, where = place(_stages(r)[n], r, [CPU_NODE])
        assert where == "nowhere" and missing.startswith("no node in the Ray cluster has CPU 1, GPU 1, sm_90 1"), n
        assert "--num-gpus=1 --resources='{\"sm_90\": 1}'" in missing


def test_isa_keyed_stages_run_only_on_the_drivers_class(driver):
    r = resolve("smollm2-135m-int8")
    s = _stages(r)["evaluate"]
    assert str(s.hardware(r)) == "cpu:x86_64-avx2"
    driver.setattr("pipeline.host.cpu.cpu_isa_class", lambda: "x86_64-amx")       # a driver of the GPU node's class
    assert place(s, r, NODES) == (None, f"CPU 1, isa:x86_64-amx 0.001 {ON_SM90_NODE}")
    driver.setattr("pipeline.host.cpu.cpu_isa_class", lambda: "x86_64-avx512vnni")  # a class no node has
    missing, where = place(s, r, NODES)
    assert where == "nowhere" and "no node in the Ray cluster has CPU 1, isa:x86_64-avx512vnni 0.001" in missing
    assert "--resources='{\"isa:x86_64-avx512vnni\": 1}'" in missing
    assert "python -m pipeline.ray_executor --node-resources" in missing


@pytest.mark.parametrize("name,key", [("smollm2-135m-trt-int8", "build.tensorrt.gpu_sm"),
                                      ("qwen7b-int8", "build.tensorrt_llm.gpu_sm")])
def test_the_hint_names_the_key_that_is_read_and_following_it_places_the_stage(driver, name, key):
    driver.setattr("pipeline.stages.base.gpu_sm", lambda: None)      # a driver without a GPU
    tp1 = ["build.tensorrt_llm.tp=1"] if "tensorrt_llm" in key else []      # one GPU: the fake GPU node's
    r = resolve(name, tp1)
    missing, _ = place(_stages(r)["build"], r, NODES)
    assert f"{key} is not set" in missing and f"--set {key}=90" in missing
    other = {"build.tensorrt.gpu_sm", "build.tensorrt_llm.gpu_sm"} - {key}
    assert not any(o in missing for o in other)
    r = resolve(name, [f"{key}=90", *tp1])                           # the hint followed
    assert place(_stages(r)["build"], r, NODES) == (None, f"CPU 1, GPU 1, sm_90 1 {ON_SM90_NODE}")


def test_cuda_ort_hint_on_a_driver_without_a_gpu(driver):
    driver.setattr("pipeline.host.gpu.cuda_device", lambda: None)
    r = resolve("smollm2-135m-cuda-fp16")
    missing, _ = place(_stages(r)["build"], r, NODES)
    assert "has no CUDA GPU" in missing and "cuda:sm_90:NVIDIA H200" in missing
    assert "gpu_sm is not set" not in missing      # no key to set: the key names the GPU that ran it


def test_hardware_keeps_the_key_text_and_its_fields_survive_pickling():
    values = {Hardware.any(): "any", Hardware.cpu("x86_64"): "cpu:x86_64",
              Hardware.cpu_isa("x86_64-amx"): "cpu:x86_64-amx", Hardware.gpu_arch(90, "k"): "sm90",
              Hardware.gpu_arch(None, "k"): "sm-unspecified", Hardware.cuda(90, "NVIDIA H200"): "cuda:sm_90:NVIDIA H200",
              Hardware.cuda(None, None): "cuda:unavailable"}
    for hw, text in values.items():
        assert hw == text and json.dumps({"hardware": hw}) == json.dumps({"hardware": text})
        assert make_key({"hardware": hw}) == make_key({"hardware": text})
        back = pickle.loads(pickle.dumps(hw))
        assert (back, back.kind, back.isa, back.sm, back.gpu_name) == (hw, hw.kind, hw.isa, hw.sm, hw.gpu_name)


def test_node_resources(monkeypatch):
    monkeypatch.setattr("pipeline.host.cpu.cpu_isa_class", lambda: "x86_64-avx512vnni")
    monkeypatch.setattr("pipeline.host.gpu.gpus", lambda: [{"sm": 90}, {"sm": 90}, {"sm": 80}])
    assert node_resources() == {"isa:x86_64-avx512vnni": 1, "sm_90": 2, "sm_80": 1}
    monkeypatch.undo()
    p = subprocess.run([sys.executable, "-m", "pipeline.ray_executor", "--node-resources"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == node_resources()      # this machine's class (and GPUs)


def test_the_in_process_fallback_advertises_this_machines_hardware(monkeypatch):
    """Without --ray-address / RAY_ADDRESS forge starts Ray in its own process: that node must advertise its ISA
    class (and GPU architectures) too, or every ISA-keyed stage would be cannot-run-here."""
    import pipeline.ray_executor as rx
    calls = []

    class FakeRay:
        def is_initialized(self):
            return False

        def init(self, **kw):
            calls.append(kw)

    monkeypatch.setattr(rx, "_ray", lambda: FakeRay())
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("pipeline.host.cpu.cpu_isa_class", lambda: "x86_64-amx")
    monkeypatch.setattr("pipeline.host.gpu.gpus", lambda: [{"sm": 90}])
    assert rx.connect(None) == "a Ray instance started on this machine"
    assert calls[0]["resources"] == {"isa:x86_64-amx": 1, "sm_90": 1}


def test_an_output_not_on_this_machine_leaves_no_stale_link(tmp_path):
    from pipeline.build_run import link as _link
    old, dest = tmp_path / "old-engine", tmp_path / "out" / "engine"
    old.mkdir()
    dest.parent.mkdir()
    _link(dest, str(old))
    assert dest.resolve() == old.resolve()
    _link(dest, "s3://bucket/prefix/entries/ab/abcd.json")      # this run's engine is only in the store
    assert not dest.exists() and not dest.is_symlink()
