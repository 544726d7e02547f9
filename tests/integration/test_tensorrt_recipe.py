"""The SmolLM2 TensorRT recipes through the CLI on the real default model: ModelOpt ONNX PTQ (QDQ) -> the QDQ graph
on ONNX Runtime's CPU provider vs FP32 torch -> the recipe's gates, then a clean stop (exit 3) at the engine build
on a machine without TensorRT. The recipes' own calibration, evaluation sets and gates; fewer prompts only."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["validate.prompts.limit=2", "validate.prompts.max_new_tokens=8"]


@pytest.mark.parametrize("recipe,algo", [("smollm2-135m-trt-int8", "int8"), ("smollm2-135m-trt-fp8", "fp8")])
def test_qdq_graph_passes_its_gates_on_cpu(tmp_path, recipe, algo):
    args = [sys.executable, "-m", "pipeline.cli", "build", recipe, "--report-dir", str(tmp_path)]
    for o in OVERRIDES:
        args += ["--set", o]
    p = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=3600,
                       env=dict(os.environ, COLUMNS="200"))
    rep = json.loads((tmp_path / recipe / "report.json").read_text())
    st = {s["name"]: s for s in rep["stages"]}
    for name in ("export", "quantize", "evaluate_qdq", "validate_qdq"):
        assert st[name]["status"] in ("built", "hit"), (name, st[name]["message"])
    if __import__("importlib").util.find_spec("tensorrt") is None:
        assert p.returncode == 3, p.stderr      # incomplete: the engine needs a GPU with tensorrt
        assert st["build"]["status"] == "cannot-run-here"
        assert f"forge build {recipe} --from build" in st["build"]["message"]
    q = st["quantize"]["metrics"]
    assert q["algo"] == algo and q["precision"] == "fp16" and q["quantizer"] == "modelopt.onnx.quantization"
    # 30 layers x 7 linear layers; int8 keeps down_proj in fp16, fp8 quantizes all of them
    assert (q["weight_matmuls"], q["quantized_matmuls"]) == ((210, 180) if algo == "int8" else (210, 210))
    ev = st["evaluate_qdq"]["metrics"]
    assert ev["subject"].startswith("tensorrt target's QDQ ONNX graph on ONNX Runtime CPU")
    print(recipe, {k: ev[k] for k in ("ppl_delta_pct", "top1_agreement", "logits_cosine")}, ev.get("per_set"))
    gates = {g["name"]: g for g in st["validate_qdq"]["metrics"]["gates"]}
    assert gates["ppl_delta_pct"]["threshold"] == 5.0 and gates["top1_agreement"]["threshold"] == 0.85
    assert all(g["passed"] for g in gates.values()), gates
