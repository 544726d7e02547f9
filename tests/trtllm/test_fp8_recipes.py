"""FP8 recipes (issues 27, 40): rowwise W8A8 FP8 + FP8 KV cache for SM >= 89 (not SM 100-119), refused elsewhere
with the INT8 recipe named."""

import pytest

from pipeline.errors import ForgeError
from pipeline.recipe import resolve
from pipeline.runner import Runner
from pipeline.stages.tensorrt_llm import TrtllmBuildStage


@pytest.mark.parametrize("name,int8", [("qwen7b-fp8", "qwen7b-int8"), ("llama3-8b-fp8", "llama3-8b-int8")])
def test_fp8_recipe_plans_on_sm89_and_sm90_and_is_refused_on_sm80(name, int8):
    r = resolve(name, [])
    assert (r.quantize.algo, r.quantize.kv_cache) == ("fp8_pc_pt", "fp8")     # rowwise: the more accurate FP8
    assert r.quantize.options == {"meta_recipe": True}                         # +0.95 % vs +2.7 % on SmolLM2
    # trtllm-build turns both off for rowwise FP8 with an FP8 KV cache; the recipe says so
    assert r.build.tensorrt_llm.use_paged_context_fmha is False and r.build.tensorrt_llm.use_fused_mlp is False
    info = Runner(r).model_info()
    for sm in (89, 90, 120):
        assert TrtllmBuildStage().plan_problems(resolve(name, [f"build.tensorrt_llm.gpu_sm={sm}"]), info) == []
    probs = TrtllmBuildStage().plan_problems(resolve(name, ["build.tensorrt_llm.gpu_sm=100"]), info)
    assert any("fp8_pc_pt (FP8_PER_CHANNEL_PER_TOKEN) is not supported by TensorRT-LLM on SM 100" in p
               for p in probs), probs
    probs = TrtllmBuildStage().plan_problems(resolve(name, ["build.tensorrt_llm.gpu_sm=80"]), info)
    assert any("FP8 needs SM >= 89" in p and "target GPU is SM 80" in p and int8 in p for p in probs), probs
    # the INT8 recipe of the same model is what sm80 builds
    assert TrtllmBuildStage().plan_problems(resolve(int8, ["build.tensorrt_llm.gpu_sm=80"]), info) == []


def test_fp8_memory_plan_fits_sm89_gpus_and_not_the_a100_by_hardware():
    from pipeline.trtllm.memory import plan_for_recipe

    r = resolve("qwen7b-fp8", [])
    plan, verdicts = plan_for_recipe(r, Runner(r).model_info(), None)
    v = {x.gpu: x for x in verdicts}
    assert plan.args["quant_algo"] == "fp8_pc_pt" and plan.args["kv_cache"] == "fp8"
    assert v["rtx4090"].fits and v["h100"].fits and v["h200"].fits and v["l40s"].fits
    assert not v["a100-80gb"].fits and any("no FP8" in p for p in v["a100-80gb"].problems)
