"""validate.reference / validate.fp32_thresholds (issue 38): the thresholds gate the figures against the reference
the recipe asks for; with a simulation the FP32 figures are reported beside and gated only by fp32_thresholds; a
recipe that asks for a simulation it cannot have is refused (exit 2) naming the key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.errors import StageFailed
from pipeline.recipe import resolve
from pipeline.stages.base import StageContext
from pipeline.stages.validate import ValidateStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/forge_cli.py
from forge_cli import run_cli  # noqa: E402


def _metrics(sim_top1: float, fp32_ppl: float) -> dict:
    per = {"wiki/eval": {"ppl_delta_pct": 0.1, "top1_agreement": sim_top1, "logits_cosine": 0.9999}}
    return {"subject": "onnxruntime engine", "ppl_delta_pct": 0.1, "top1_agreement": sim_top1,
            "logits_cosine": 0.9999, "greedy_exact_match": 1.0, "per_set": per,
            "reference": {"kind": "simulated", "grid": {"algo": "int8"}},
            "fp32": {"ppl_delta_pct": fp32_ppl, "top1_agreement": 0.93, "logits_cosine": 0.999,
                     "greedy_exact_match": 0.5, "per_set": {"wiki/eval": {"ppl_delta_pct": fp32_ppl,
                                                                          "top1_agreement": 0.93}}},
            "note": "random weights: gates check the engine computes the same function, not accuracy"}


def _validate(tmp_path, recipe, metrics):
    ev = tmp_path / "evaluate"
    ev.mkdir()
    (ev / "metrics.json").write_text(json.dumps(metrics))
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(recipe=recipe, home=tmp_path, out=out, inputs={"evaluate": ev}, upstream_metrics={})
    return ValidateStage().run(ctx)


def test_thresholds_gate_the_simulation_and_fp32_thresholds_the_fp32_figures(tmp_path):
    r = resolve("smollm2-135m-cuda-int8wo")
    res = _validate(tmp_path, r, _metrics(sim_top1=0.99, fp32_ppl=1.2))
    assert res["passed"] and res["reference"] == "simulated"
    gates = {g["name"]: g for g in res["gates"]}
    assert gates["top1_agreement"]["vs"] == "simulated"
    assert gates["top1_agreement"]["threshold"] == r.validate_.thresholds.top1_agreement_min
    f = gates["fp32:ppl_delta_pct"]
    assert f["vs"] == "fp32" and f["value"] == 1.2 and f["key"] == "validate.fp32_thresholds.ppl_delta_pct_max"
    assert "fp32:ppl_delta_pct[wiki/eval]" in gates


def test_an_fp32_miss_fails_the_build_naming_its_key(tmp_path):
    with pytest.raises(StageFailed) as e:
        _validate(tmp_path, resolve("smollm2-135m-cuda-int8wo"), _metrics(sim_top1=0.99, fp32_ppl=3.0))
    msg = str(e.value)
    assert "vs the simulated reference" in msg and "fp32:ppl_delta_pct = 3" in msg
    assert "validate.fp32_thresholds.ppl_delta_pct_max" in msg and "random weights" in msg


def test_a_simulation_miss_fails_the_build(tmp_path):
    with pytest.raises(StageFailed, match=r"top1_agreement = 0\.5 \(needs >= 0\.95, validate\.thresholds"):
        _validate(tmp_path, resolve("smollm2-135m-cuda-int8wo"), _metrics(sim_top1=0.5, fp32_ppl=1.0))


def test_recipes_without_a_simulation_keep_their_gates_and_keys():
    r = resolve("smollm2-135m-int8")
    assert r.validate_.reference == "fp32" and r.validate_.fp32_thresholds is None
    assert "reference" not in r.to_dict()["validate"] and "fp32_thresholds" not in r.to_dict()["validate"]
    assert ValidateStage().config(r) == {"thresholds": r.validate_.thresholds.model_dump()}
    from pipeline.stages.onnxruntime import OrtEvaluate
    assert "reference" not in OrtEvaluate().config(r)


def test_the_quantized_cuda_recipes_gate_against_their_simulation():
    int8, q4 = resolve("smollm2-135m-cuda-int8wo"), resolve("qwen2.5-7b-cuda-int4")
    for r in (int8, q4):
        assert r.validate_.reference == "simulated"
    # the real model keeps its accuracy gates vs FP32 (not loosened); random weights have none
    assert (int8.validate_.fp32_thresholds.ppl_delta_pct_max, int8.validate_.fp32_thresholds.top1_agreement_min) \
        == (2.0, 0.90)
    assert q4.validate_.fp32_thresholds is None
    from pipeline.stages.onnxruntime import OrtEvaluate
    grid = OrtEvaluate().config(q4)["reference"]["grid"]
    assert grid["linear"] == {"bits": 4, "block": 128, "symmetric": True} and grid["scale_dtype"] == "float16"
    assert (q4.quantize.options["method"], q4.quantize.block_size) == ("rtn", 128)


@pytest.mark.parametrize("recipe, sets, expect", [
    ("smollm2-135m-int4", ["validate.reference=simulated"], "quantize.options.method: rtn for int4_wo"),
    ("smollm2-135m-int8", ["validate.reference=simulated"], "quantize.options.smoothquant_alpha: null"),
    ("smollm2-135m-int8", ["validate.reference=simulated", "quantize.options.method=mixed"],
     "quantize.options.method: blockwise for int8"),
    ("smollm2-135m-fp32", ["validate.reference=simulated"], "quantize.algo 'none' writes no weight-only grid"),
    ("smollm2-135m-trtllm-tp3", ["validate.reference=simulated"], "validate.reference: 'simulated' is offered by "
                                                                  "build.target onnxruntime"),
    ("smollm2-135m-int4", ["validate.fp32_thresholds.ppl_delta_pct_max=1"], "validate.fp32_thresholds: read only "
                                                                            "with validate.reference: simulated"),
    ("smollm2-135m-int4", ["validate.reference=fp16"], "validate.reference = 'fp16' is not allowed"),
])
def test_a_simulation_that_cannot_be_had_is_refused(recipe, sets, expect, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(capsys, monkeypatch, "plan", recipe, *[x for s in sets for x in ("--set", s)])
    assert code == 2 and expect in out, out
