"""The TensorRT build's orchestration with Polygraphy's own loader objects (they import without tensorrt), the
timing-cache handling, the stop on a machine without TensorRT, and plan-time rejection of what cannot work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pipeline.errors import CannotRunHere
from pipeline.tensorrt.build import (build_tensorrt_engine, graph_inputs, polygraphy_loaders, private_timing_cache,
                                     profile_shapes)

REPO = Path(__file__).resolve().parents[2]
CFG = {"precision": "fp16", "workspace_gib": 2.0, "builder_optimization_level": 3, "max_batch_size": 8,
       "max_seq_len": 512, "gpu_sm": 90}
# tensorrt's MemoryPoolType enum is the only thing of tensorrt the loader chain reads while being assembled
TRT_ENUMS = types.SimpleNamespace(MemoryPoolType=types.SimpleNamespace(WORKSPACE="MemoryPoolType.WORKSPACE"))


def test_profiles_cover_prefill_and_decode(tiny_export):
    inputs = graph_inputs(tiny_export / "model.onnx")
    assert len(inputs) == 3 + 2 * 2
    shapes = profile_shapes(inputs, max_batch=8, max_seq=512)
    ctx, gen = shapes["context"], shapes["generation"]
    assert ctx["input_ids"] == ((1, 1), (4, 256), (8, 512)) == ctx["position_ids"]
    assert ctx["attention_mask"] == ctx["input_ids"]                     # no past in a prefill
    assert ctx["past_key_values.1.value"] == ((1, 3, 0, 16), (4, 3, 0, 16), (8, 3, 0, 16))
    assert gen["input_ids"] == ((1, 1), (4, 1), (8, 1))
    assert gen["attention_mask"] == ((1, 2), (4, 257), (8, 512))         # past + 1 new token <= max_seq_len
    assert gen["past_key_values.0.key"] == ((1, 3, 1, 16), (4, 3, 256, 16), (8, 3, 511, 16))


def test_loader_chain_is_polygraphys(tiny_export, tmp_path):
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile

    tc = tmp_path / "private.cache"
    engine = polygraphy_loaders(tiny_export / "model.onnx", CFG, tc, TRT_ENUMS)
    assert isinstance(engine, EngineBytesFromNetwork) and engine.timing_cache_path == str(tc)
    net, cfg = engine._network, engine._config
    assert isinstance(net, NetworkFromOnnxPath) and net.strongly_typed is True
    assert net.path == str(tiny_export / "model.onnx")
    assert isinstance(cfg, CreateConfig) and cfg.timing_cache_path == str(tc)
    assert cfg.memory_pool_limits == {"MemoryPoolType.WORKSPACE": 2 * (1 << 30)}
    assert cfg.builder_optimization_level == 3
    assert not (cfg.fp16 or cfg.int8 or cfg.fp8 or cfg.bf16)   # strongly typed: precisions come from the graph
    assert len(cfg.profiles) == 2 and all(isinstance(p, Profile) for p in cfg.profiles)
    ctx = cfg.profiles[0]["past_key_values.0.key"]
    assert (tuple(ctx.min), tuple(ctx.opt), tuple(ctx.max)) == ((1, 3, 0, 16), (4, 3, 0, 16), (8, 3, 0, 16))


def test_private_timing_cache_copies_under_a_unique_name(tmp_path):
    shared = tmp_path / "sm90" / "tensorrt-10.13.cache"
    a = private_timing_cache(shared)
    assert a.read_bytes() == b"" and a.parent == shared.parent and not shared.exists()
    shared.write_bytes(b"tactics")
    b, c = private_timing_cache(shared), private_timing_cache(shared)
    assert b != c and b.read_bytes() == c.read_bytes() == b"tactics"
    assert b.name.startswith(".tensorrt-10.13.cache.") and b.suffix == ".tmp"


@pytest.mark.skipif(__import__("importlib").util.find_spec("tensorrt") is not None, reason="tensorrt is installed")
def test_without_tensorrt_the_build_says_how_to_finish(tiny_export, tmp_path):
    with pytest.raises(CannotRunHere) as e:
        build_tensorrt_engine(tiny_export, tmp_path, CFG, tmp_path / "tc")
    assert "tensorrt is not importable" in str(e.value) and "pip install -e '.[tensorrt]'" in str(e.value)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ plan time (recipes, CLI)

def forge(*args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, COLUMNS="200", FORGE_PROGRESS="0"), timeout=300)


def _problems(recipe, overrides, monkeypatch, gpu=None):
    from pipeline.modelinfo import ModelInfo
    from pipeline.recipe import resolve
    from pipeline.stages import tensorrt as st
    monkeypatch.setattr(st, "gpu_sm", lambda: gpu)
    r = resolve(recipe, overrides)
    cfg = json.loads((REPO / "pipeline" / "model_configs" / "smollm2-135m-instruct.json").read_text())
    info = ModelInfo.from_hf_config(cfg)
    return [p for s in (st.TensorrtQuantize(), st.TensorrtBuildStage()) for p in s.plan_problems(r, info)]


def test_fp8_needs_a_named_gpu_with_sm_89(monkeypatch):
    assert _problems("smollm2-135m-trt-fp8", [], monkeypatch) == []                       # gpu_sm: 90 in the recipe
    p = _problems("smollm2-135m-trt-fp8", ["build.tensorrt.gpu_sm=null"], monkeypatch)
    assert len(p) == 1 and "set build.tensorrt.gpu_sm" in p[0] and "SM >= 89" in p[0]
    p = _problems("smollm2-135m-trt-fp8", ["build.tensorrt.gpu_sm=80"], monkeypatch)
    assert len(p) == 1 and "build.tensorrt.gpu_sm is SM 80" in p[0]
    p = _problems("smollm2-135m-trt-fp8", ["build.tensorrt.gpu_sm=null"], monkeypatch, gpu=86)
    assert len(p) == 1 and "this machine's GPU is SM 86" in p[0]
    assert _problems("smollm2-135m-trt-int8", [], monkeypatch) == []                      # int8: any GPU, none here


def test_other_plan_problems_name_the_key(monkeypatch):
    from pipeline.errors import RecipeError
    p = _problems("smollm2-135m-trt-int8", ["build.tensorrt.max_seq_len=9000"], monkeypatch)
    assert any("build.tensorrt.max_seq_len = 9000 exceeds" in x for x in p)
    # quantize keys the tensorrt quantizer does not read are refused when the recipe loads (exit 2), with did-you-mean
    with pytest.raises(RecipeError) as e:
        _problems("smollm2-135m-trt-int8", ["quantize.block_size=64", "quantize.options.smoothquant_alpah=0.3"],
                  monkeypatch)
    assert "quantize.block_size: not read by build.target 'tensorrt'" in str(e.value)
    assert "did you mean 'quantize.options.smoothquant_alpha'" in str(e.value)


def test_build_stage_reads_its_own_gpu_sm(monkeypatch):
    from pipeline.recipe import resolve
    from pipeline.stages import tensorrt as st
    monkeypatch.setattr(st, "gpu_sm", lambda: None)
    from pipeline.errors import RecipeError
    r = resolve("smollm2-135m-trt-int8", ["build.tensorrt.gpu_sm=89"])
    assert st.TensorrtBuildStage().hardware(r) == "sm89"
    # the other target's key is not silently ignored: refused, naming the target that reads it (issue 25)
    with pytest.raises(RecipeError, match="build.tensorrt_llm: read only by build.target 'tensorrt_llm'"):
        resolve("smollm2-135m-trt-int8", ["build.tensorrt.gpu_sm=89", "build.tensorrt_llm.gpu_sm=75"])
    assert st.TensorrtBuildStage().hardware(resolve("smollm2-135m-trt-int8")) == "sm-unspecified"


def test_cli_plan_exit_codes():
    p = forge("plan", "smollm2-135m-trt-fp8", "--set", "build.tensorrt.gpu_sm=80")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2 and "needs SM >= 89" in out and "Traceback" not in out, out
    p = forge("plan", "smollm2-135m-trt-int8", "--json")
    assert p.returncode == 0, p.stderr
    stages = {s["name"]: s for s in json.loads(p.stdout)["stages"]}
    assert list(stages) == ["source", "export", "quantize", "evaluate_qdq", "validate_qdq", "build"]
    if __import__("importlib").util.find_spec("tensorrt") is None:
        assert stages["build"]["status"] == "cannot-run-here" and "tensorrt is not installed" in stages["build"]["reason"]
