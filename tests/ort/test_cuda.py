"""build.onnxruntime.provider: cuda (issue 17). CPU tests: schema, exit 3 with the finish command, doctor, the fp16
graph (run on the CPU provider, loosely against FP32), fixed-shape decode (what a CUDA graph replays). Tests marked
``gpu`` run the CUDA provider itself and skip where onnxruntime has no usable CUDAExecutionProvider."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.env import ort_cuda_status

ROOT = Path(__file__).resolve().parents[2]
CUDA = ort_cuda_status()
needs_cuda = pytest.mark.skipif(bool(CUDA["problem"]), reason=f"no usable CUDA provider: {CUDA['problem']}")
PROMPTS = [[5, 17, 33, 2 + 1, 60, 61, 9], [7, 8, 100, 4]]


def forge(*args, env=None):
    e = {**os.environ, "PYTHONPATH": str(ROOT), "FORGE_PROGRESS": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, env=e,
                          cwd=ROOT, timeout=300)


# ---------------------------------------------------------------- schema
def test_schema_accepts_providers_and_cuda_recipes():
    from pipeline.recipe import resolve
    r = resolve("smollm2-135m-cuda-fp16")
    assert (r.build.onnxruntime.provider, r.build.onnxruntime.precision) == ("cuda", "fp16")
    assert resolve("smollm2-135m-cuda-int4").quantize.algo == "int4_wo"
    assert resolve("smollm2-135m-int8").build.onnxruntime.provider == "cpu"


def test_cpu_build_key_unchanged_by_the_new_keys():
    """CPU recipes' build config is what it was before provider/precision/cuda_graph existed (no rebuilds)."""
    from pipeline.recipe import resolve
    assert resolve("smollm2-135m-int8").build.onnxruntime.build_config() == {"opt_level": "extended",
                                                                             "intra_op_threads": 0}
    cfg = resolve("smollm2-135m-cuda-fp16", ["build.onnxruntime.cuda_graph=true"]).build.onnxruntime.build_config()
    assert cfg["provider"] == "cuda" and cfg["precision"] == "fp16" and "cuda_graph" not in cfg


@pytest.mark.parametrize("override, words", [
    ("build.onnxruntime.provider=rocm", ["build.onnxruntime.provider", "'cpu'", "'cuda'"]),
    ("build.onnxruntime.precision=fp16", ["build.onnxruntime.precision", "provider: cuda"]),
    ("build.onnxruntime.cuda_graph=true", ["build.onnxruntime.cuda_graph", "provider: cuda"]),
])
def test_schema_refuses_bad_provider_settings_exit_2(override, words):
    r = forge("recipes", "resolve", "smollm2-135m-int8", "--set", override)
    assert r.returncode == 2, r.stdout + r.stderr
    msg = r.stdout + r.stderr
    assert all(w in msg for w in words), msg
    assert "Traceback" not in msg


def test_plan_says_cuda_build_cannot_run_here_with_the_finish_command(tmp_path):
    if not CUDA["problem"]:
        pytest.skip("this machine has a usable CUDA provider")
    from pipeline.recipe import resolve
    from pipeline.stages import flow_for
    r = resolve("smollm2-135m-cuda-fp16")
    stages = {s.name: s for s in flow_for("onnxruntime")}
    assert stages["build"].missing(r) == CUDA["problem"]
    assert stages["evaluate"].missing(r) == CUDA["problem"]
    assert stages["export"].missing(r) is None and stages["quantize"].missing(r) is None   # run on any CPU
    hint = stages["build"].finish_hint(r)
    assert "forge build smollm2-135m-cuda-fp16 --from build" in hint and "FORGE_CACHE" in hint
    # the CUDA stages' keys name the GPU, not the CPU; the CPU recipe's stay on the CPU
    assert stages["build"].hardware(r).startswith("cuda:")
    assert stages["build"].hardware(resolve("smollm2-135m-int8")).startswith("cpu:")
    assert stages["evaluate"].hardware(resolve("smollm2-135m-int8")).startswith("cpu:")
    assert stages["evaluate"].hardware(r).startswith("cuda:") and stages["package"].hardware(r).startswith("cuda:")


def test_cuda_hardware_names_the_gpu(monkeypatch):
    import pipeline.env as env
    env.cuda_device.cache_clear()
    monkeypatch.setattr(env, "cuda_device", lambda: {"name": "NVIDIA H200", "sm": 90})
    assert env.cuda_hardware() == "cuda:sm_90:NVIDIA H200"


# ---------------------------------------------------------------- doctor
def test_doctor_reports_the_cuda_provider():
    from pipeline.doctor import ort_cuda_findings, run_doctor
    rep = run_doctor(ort_cuda=CUDA)
    assert rep["onnxruntime_cuda"]["providers"] == CUDA["providers"]
    none_gpu = ort_cuda_findings({"cuda_provider": False, "problem": "x", "onnxruntime": "1.32.0"}, have_gpu=True)
    assert none_gpu[0]["severity"] == "warning" and "onnxruntime-gpu" in none_gpu[0]["fix"]
    libs = ort_cuda_findings({"cuda_provider": True, "problem": "cannot load libcublas.so.13"}, have_gpu=True)
    assert libs[0]["severity"] == "error" and "LD_LIBRARY_PATH" in libs[0]["fix"]
    assert ort_cuda_findings({"cuda_provider": True, "problem": None}, have_gpu=True) == []


def test_doctor_json_cli_has_the_cuda_section():
    r = forge("doctor", "--json")
    assert r.returncode == 0, r.stderr
    oc = json.loads(r.stdout)["onnxruntime_cuda"]
    assert oc["cuda_provider"] == ("CUDAExecutionProvider" in oc["providers"])
    assert oc["onnxruntime"]


def test_cuda_library_versions_read_from_the_libraries():
    from pipeline.env import CUDA_LIBRARIES, cuda_library_versions
    libs = cuda_library_versions()
    assert set(libs) == set(CUDA_LIBRARIES)
    for v in libs.values():
        assert v["found"] is False or v.get("version") is None or v["version"][0].isdigit()


# ---------------------------------------------------------------- fp16 graph
@pytest.fixture(scope="module")
def tiny_fp16_dir(tiny_onnx_dir, tmp_path_factory):
    from pipeline.ort.fp16 import convert_fp16
    out = tmp_path_factory.mktemp("tiny_fp16")
    convert_fp16(tiny_onnx_dir, out)
    return out


def test_fp16_keeps_norm_statistics_and_logits_fp32(tiny_fp16_dir):
    import onnx
    from pipeline.ort.fp16 import fp32_nodes
    m = onnx.load(str(tiny_fp16_dir / "model.onnx"), load_external_data=False)
    io = {v.name: v.type.tensor_type.elem_type for v in (*m.graph.input, *m.graph.output)}
    assert io["logits"] == onnx.TensorProto.FLOAT
    assert io["past_key_values.0.key"] == io["present.0.key"] == onnx.TensorProto.FLOAT16   # KV bound in fp16
    kept = {n.op_type for n in fp32_nodes(m)}
    assert {"Pow", "ReduceMean"} <= kept, kept                 # the RMSNorm statistics
    assert "MatMul" not in kept and "GroupQueryAttention" not in kept      # the heavy ops are fp16
    weights = [i for i in m.graph.initializer if len(i.dims) == 2 and min(i.dims) >= 64]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)
    assert json.loads((tiny_fp16_dir / "forge_ort.json").read_text())["dtype"] == "fp16"


def test_fp16_graph_on_cpu_provider_close_to_fp32(tiny_onnx_dir, tiny_fp16_dir):
    from pipeline.ort.engine import OrtEngine
    ids = np.random.default_rng(0).integers(3, 256, size=(2, 24))
    a = OrtEngine(tiny_onnx_dir, threads=1).logits(ids)
    e16 = OrtEngine(tiny_fp16_dir, threads=1)
    b = e16.logits(ids)
    assert e16.kv_dtype == np.float16 and b.dtype == np.float32
    af, bf = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    cos = np.sum(af * bf, -1) / (np.linalg.norm(af, axis=-1) * np.linalg.norm(bf, axis=-1))
    assert cos.min() > 0.999, cos.min()
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.95


# ---------------------------------------------------------------- fixed-shape decode (what a CUDA graph replays)
def test_static_decode_matches_dynamic_decode(tiny_onnx_dir):
    from pipeline.ort.engine import OrtEngine
    dyn = OrtEngine(tiny_onnx_dir, threads=1)
    sta = OrtEngine(tiny_onnx_dir, threads=1, static_decode=True)
    for prompts, n in ((PROMPTS, 12), (PROMPTS[:1], 5), (PROMPTS, 70)):   # 70: a second, larger KV capacity
        assert sta.generate_batch(prompts, n) == dyn.generate_batch(prompts, n)


def test_cuda_graph_needs_cuda_provider(tiny_onnx_dir):
    from pipeline.ort.engine import OrtEngine
    with pytest.raises(ValueError, match="cuda_graph needs"):
        OrtEngine(tiny_onnx_dir, cuda_graph=True)


# ---------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_matches_cpu(tiny_onnx_dir, tiny_fp16_dir):
    from pipeline.ort.engine import OrtEngine
    ids = np.random.default_rng(1).integers(3, 256, size=(2, 24))
    cpu = OrtEngine(tiny_fp16_dir, threads=1)
    gpu = OrtEngine(tiny_fp16_dir, providers=["CUDAExecutionProvider"], device="cuda")
    assert "CUDAExecutionProvider" in gpu.session.get_providers()
    a, b = cpu.logits(ids), gpu.logits(ids)
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.95
    assert gpu.generate_batch(PROMPTS, 16) == cpu.generate_batch(PROMPTS, 16)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decode_matches_plain_cuda(tiny_fp16_dir):
    from pipeline.ort.engine import OrtEngine
    plain = OrtEngine(tiny_fp16_dir, providers=["CUDAExecutionProvider"], device="cuda")
    graph = OrtEngine(tiny_fp16_dir, providers=["CUDAExecutionProvider"], device="cuda", cuda_graph=True)
    want = plain.generate_batch(PROMPTS, 20)
    assert graph.generate_batch(PROMPTS, 20) == want     # first call captures
    assert graph.generate_batch(PROMPTS, 20) == want     # later calls replay


@pytest.mark.integration
def test_cuda_recipe_stops_at_build_with_exit_3_and_the_finish_command(tmp_path):
    """The real default model: source, export and quantize run on this CPU; build stops (exit 3) and says how to
    finish on a GPU machine. (Uses FORGE_CACHE as set: a warm cache makes it seconds.)"""
    if not CUDA["problem"]:
        pytest.skip("this machine has a usable CUDA provider")
    r = forge("build", "smollm2-135m-cuda-fp16", "--report-dir", str(tmp_path))
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    msg = " ".join((r.stdout + r.stderr).split())
    assert "forge build smollm2-135m-cuda-fp16 --from build" in msg, msg[-2000:]
    rep = json.loads((tmp_path / "smollm2-135m-cuda-fp16" / "report.json").read_text())
    st = {s["name"]: s["status"] for s in rep["stages"]}
    assert rep["status"] == "incomplete" and st["build"] == "cannot-run-here"
    assert all(st[s] in ("hit", "built") for s in ("source", "export", "quantize"))


@pytest.mark.parametrize("phase", ["receive", "setup", "test", "build", "serve", "bench"])
def test_gpu_run_script_phases_dry_run(phase, tmp_path):
    """scripts/gpu_ort_run.py (the lead's one device script): every phase runs here as a dry run and writes its
    JSON under $OUT."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path), "FORGE_CARRY_DIR": str(tmp_path / "carry"),
           "FORGE_SITE": str(tmp_path / "site" / "site-packages"), "FORGE_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "scripts/gpu_ort_run.py", "--phase", phase, "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / f"{phase}.json").read_text())
    assert res["phase"] == phase and "finished" in res
    if phase == "build":
        assert any("smollm2-135m-cuda-fp16 smollm2-135m-cuda-int4" in s["cmd"] for s in res["steps"])


def test_duplicate_casts_of_ort_1_31_converter_are_dropped():
    """onnxruntime-gpu 1.31.1's float16 converter emits one identical Cast per consumer (same node and output name);
    ORT refuses such a model. After drop_duplicate_nodes it loads and computes what one shared Cast computes."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from pipeline.ort.fp16 import drop_duplicate_nodes

    cast = helper.make_node("Cast", ["x"], ["x_cast_to_fp32"], to=TensorProto.FLOAT, name="x_cast_to_fp32_node")
    g = helper.make_graph(
        [cast, helper.make_node("Softmax", ["x_cast_to_fp32"], ["a"], name="sm"), onnx.helper.make_node(
            "Cast", ["x"], ["x_cast_to_fp32"], to=TensorProto.FLOAT, name="x_cast_to_fp32_node"),
         helper.make_node("Sqrt", ["x_cast_to_fp32"], ["b"], name="sq")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 3])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]), helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])],
        value_info=[helper.make_tensor_value_info("x_cast_to_fp32", TensorProto.FLOAT, [2, 3])] * 2)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    with pytest.raises(Exception, match="same node name"):
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert drop_duplicate_nodes(m) == 1
    assert [n.name for n in m.graph.node].count("x_cast_to_fp32_node") == 1 and len(m.graph.value_info) == 1
    x = np.array([[1, 2, 3], [4, 5, 6]], np.float16)
    a, b = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    e = np.exp(x.astype(np.float32))
    np.testing.assert_allclose(a, e / e.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(b, np.sqrt(x.astype(np.float32)), rtol=1e-6)
