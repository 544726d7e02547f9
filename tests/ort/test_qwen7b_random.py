"""Issue 26/38's 7B-class CUDA recipes on CPU: they resolve (a random source forge makes itself, the INT4 layout the
kernel bench measured fast, gated against its simulation) and plan (the GPU stages say why they cannot run here).
The generator itself: tests/source/test_random_source.py."""

from __future__ import annotations

import pytest

from pipeline.recipe import resolve


def test_qwen7b_cuda_recipes_resolve_with_gates_for_random_weights():
    fp16, int4 = resolve("qwen2.5-7b-cuda-fp16"), resolve("qwen2.5-7b-cuda-int4")
    for r in (fp16, int4):
        assert (r.model.source, r.model.seed, r.model.layers) == ("random:Qwen--Qwen2.5-7B-Instruct", 0, None)
        assert (r.build.target, r.build.onnxruntime.provider, r.build.onnxruntime.precision) == \
            ("onnxruntime", "cuda", "fp16")
    assert fp16.quantize.method == "none" and fp16.validate_.reference == "fp32"
    # MatMulNBits RTN symmetric block 128: 2.28x fp16 MatMul at M = 1 on an H100 (issue 38), HQQ block 32 0.42x
    assert int4.quantize.algo == "int4_wo" and int4.quantize.block_size == 128
    assert int4.quantize.options == {"method": "rtn", "symmetric": True}
    # logits cosine is the gate that separates a broken engine (cosine ~0) from noise on flat random logits; the
    # INT4 engine's noise vs FP32 is its grid's, so it is gated against its simulation, as tight as fp16 vs FP32
    t16, t4 = fp16.validate_.thresholds, int4.validate_.thresholds
    assert (t16.ppl_delta_pct_max, t16.top1_agreement_min, t16.logits_cosine_min) == (1.0, 0.95, 0.999)
    assert int4.validate_.reference == "simulated" and int4.validate_.fp32_thresholds is None
    assert (t4.ppl_delta_pct_max, t4.top1_agreement_min, t4.logits_cosine_min) == (1.0, 0.95, 0.999)


@pytest.mark.parametrize("recipe", ["qwen2.5-7b-cuda-fp16", "qwen2.5-7b-cuda-int4"])
@pytest.mark.parametrize("layers", [None, 4])
def test_qwen7b_cuda_recipe_plans_on_cpu(recipe, layers, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from pipeline import cli
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "250")
    args = ["plan", recipe] + (["--set", f"model.layers={layers}"] if layers else [])
    res = CliRunner().invoke(cli.app, args)
    assert res.exit_code == 0, res.output
    for stage in ("source", "export", "quantize", "build", "evaluate", "validate", "package"):
        assert f"│ {stage}" in res.output
