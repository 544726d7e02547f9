"""bench.gpu (issue 17), the parts that run without a GPU: the table's figures and ratios, and the environment
variants (ONNX Runtime's attention-kernel switches) reaching the worker process of their engine."""

import json

import pytest

from bench import gpu


def _res(prefill, b1, b8, ttft):
    return {"prefill": {"4": {"tokens_per_s": prefill}}, "decode": {"1": {"tokens_per_s": b1}, "8": {"tokens_per_s": b8}},
            "ttft": {"median_s": ttft}}


def test_markdown_ratios_compare_the_named_engines():
    results = {"gpu": "NVIDIA H200 (sm_90)", "engines": {
        "fp16": _res(40000, 160, 1600, 0.010), "fp16+graph": _res(44000, 660, 4200, 0.011),
        "int4+graph": _res(40000, 540, 3500, 0.012), "oga-cuda-int4": _res(130000, 300, 2300, 0.010),
        "torch-fp16": _res(30000, 30, 280, 0.040), "fp32": {"error": "boom"}}}
    md = gpu.markdown(results)
    assert "GPU: NVIDIA H200 (sm_90)" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| FP16 CUDA graph / ORT GenAI CUDA int4 |"))
    assert row == "| FP16 CUDA graph / ORT GenAI CUDA int4 | 0.34x | 2.20x | 1.83x | 0.91x |"
    row = next(ln for ln in md.splitlines() if ln.startswith("| INT4 CUDA graph / FP16 CUDA graph |"))
    assert "| 0.82x |" in row
    assert not any(ln.startswith("| FP16 / FP32 |") for ln in md.splitlines())   # fp32 failed: no ratio
    assert "- fp32: boom" in md


def test_env_variant_runs_fp16_with_cuda_graphs_under_the_given_environment(tmp_path, monkeypatch):
    runs = []

    def fake_run(cmd, check, env):
        spec = json.loads(open(cmd[-1]).read())
        runs.append((spec, env))
        open(spec["result"], "w").write(json.dumps(_res(1, 1, 1, 1)))

    monkeypatch.setattr(gpu.subprocess, "run", fake_run)
    monkeypatch.setattr("pipeline.host.gpu.cuda_device", lambda: None)
    gpu.main(["--engine", f"fp16={tmp_path}", "--out", str(tmp_path / "out"), "--no-peers",
              "--env-variant", "cudnn-off:ORT_ENABLE_CUDNN_FLASH_ATTENTION=0,ORT_X=1"])
    names = [s["name"] for s, _ in runs]
    assert names == ["fp16", "fp16+graph", "fp16+graph+cudnn-off"]
    spec, env = runs[-1]
    assert spec["cuda_graph"] is True and env["ORT_ENABLE_CUDNN_FLASH_ATTENTION"] == "0" and env["ORT_X"] == "1"
    assert "ORT_X" not in runs[0][1] and "ORT_X" not in runs[1][1]       # only the variant runs under it


@pytest.mark.parametrize("bad", ["bad", "label:", ":X=1", "label:X", "label:=1", "label:X=1,Y"])
def test_env_variant_refuses_a_malformed_value_exit_2(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--engine", f"fp16={tmp_path}", "--out", str(tmp_path / "out"), "--env-variant", bad])
    assert e.value.code == 2
    assert "LABEL:VAR=VALUE" in capsys.readouterr().err
