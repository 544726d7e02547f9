"""Plan-time validator rules (trtllm-reference.md §2.3) and the trtllm-build command line."""

from __future__ import annotations

import pytest

from pipeline.errors import CannotRunHere
from pipeline.modelinfo import ModelInfo
from pipeline.trtllm.build import build_engine, trtllm_available
from pipeline.trtllm.build_config import trtllm_build_args, validate_build

SMOL = ModelInfo.bundled("HuggingFaceTB/SmolLM2-135M-Instruct")
QWEN = ModelInfo.bundled("Qwen/Qwen2.5-7B-Instruct")

# The build sections proposed for the recipes (defaults of pipeline/targets/tensorrt_llm.py TrtllmBuild otherwise).
QWEN7B_INT8 = {"dtype": "float16", "tp": 2, "pp": 1, "max_batch_size": 64, "max_input_len": 4096,
               "max_seq_len": 8192, "max_num_tokens": 8192, "kv_cache_type": "paged", "tokens_per_block": 64,
               "gemm_plugin": "auto", "gpt_attention_plugin": "auto", "context_fmha": True,
               "use_paged_context_fmha": False, "remove_input_padding": True, "use_fused_mlp": False,
               "reduce_fusion": False, "user_buffer": False, "multiple_profiles": True, "workers": 2}
INT8_SQ = {"method": "ptq", "algo": "int8_sq", "kv_cache": "int8"}
SMOL_TP3 = {**QWEN7B_INT8, "tp": 3, "max_input_len": 1024, "max_seq_len": 2048, "workers": 1}


def keys(problems):
    return " | ".join(problems)


def test_bundled_configs():
    assert (SMOL.num_heads, SMOL.num_kv_heads, SMOL.num_layers) == (9, 3, 30)
    assert (QWEN.num_heads, QWEN.num_kv_heads, QWEN.hidden_size, QWEN.rope_theta) == (28, 4, 3584, 1e6)


def test_recipes_as_proposed_are_valid():
    assert validate_build({"tensorrt_llm": QWEN7B_INT8}, INT8_SQ, QWEN, 90) == []
    assert validate_build(SMOL_TP3, INT8_SQ, SMOL, 90) == []
    fp16 = {**QWEN7B_INT8, "use_fused_mlp": True, "use_paged_context_fmha": True}
    assert validate_build(fp16, {"algo": "none"}, QWEN, 90, triton={"enable_kv_cache_reuse": True}) == []


def test_smollm2_tp2_rejected_naming_the_key():
    p = validate_build({**SMOL_TP3, "tp": 2}, {"algo": "none"}, SMOL, None)
    assert any(x.startswith("build.tensorrt_llm.tp: 2 does not divide the 9 attention heads") for x in p), p
    assert any("3 KV heads" in x for x in p), p
    assert "valid tp values for this model: 1, 3" in keys(p)


def test_int8_sq_with_duplicated_kv_heads_rejected():
    p = validate_build({**QWEN7B_INT8, "tp": 8, "workers": 8}, INT8_SQ, QWEN, 90)
    assert any(x.startswith("quantize.algo: int8_sq with build.tensorrt_llm.tp=8 > 4 KV heads") for x in p), p
    assert validate_build({**QWEN7B_INT8, "tp": 4}, INT8_SQ, QWEN, 90) == []


@pytest.mark.parametrize("change,quant,expect", [
    ({"use_fused_mlp": True}, INT8_SQ, "build.tensorrt_llm.use_fused_mlp: trtllm-build turns fused MLP off"),
    ({"use_paged_context_fmha": True}, INT8_SQ, "build.tensorrt_llm.use_paged_context_fmha: trtllm-build turns paged"),
    ({"reduce_fusion": True}, INT8_SQ, "build.tensorrt_llm.reduce_fusion: not implemented for Qwen2ForCausalLM"),
    ({"user_buffer": True}, INT8_SQ, "build.tensorrt_llm.user_buffer: needs build.tensorrt_llm.reduce_fusion"),
    ({"max_input_len": 9000}, INT8_SQ, "build.tensorrt_llm.max_input_len: 9000 exceeds"),
    ({"tokens_per_block": 48}, INT8_SQ, "build.tensorrt_llm.tokens_per_block: 48 must be a power of 2"),
    ({"context_fmha": False, "use_paged_context_fmha": True}, {"algo": "none"},
     "build.tensorrt_llm.use_paged_context_fmha: needs build.tensorrt_llm.context_fmha"),
    ({"pp": 3}, INT8_SQ, "build.tensorrt_llm.pp: 3 does not divide the 28 decoder layers"),
    ({"gemm_plugin": "int4"}, INT8_SQ, "build.tensorrt_llm.gemm_plugin: 'int4'"),
])
def test_override_rules(change, quant, expect):
    p = validate_build({**QWEN7B_INT8, **change}, quant, QWEN, 90)
    assert any(x.startswith(expect) for x in p), p


def test_kv_cache_reuse_needs_paged_context_fmha():
    p = validate_build(QWEN7B_INT8, INT8_SQ, QWEN, 90, triton={"enable_kv_cache_reuse": True})
    assert any(x.startswith("package.triton.enable_kv_cache_reuse: KV-cache reuse needs paged context FMHA, "
                            "but an INT8 KV cache") for x in p), p


def test_reduce_fusion_needs_tp():
    p = validate_build({**SMOL_TP3, "tp": 1, "reduce_fusion": True}, INT8_SQ, SMOL, 90)
    assert any(x.startswith("build.tensorrt_llm.reduce_fusion: needs build.tensorrt_llm.tp > 1") for x in p), p
    assert validate_build({**SMOL_TP3, "reduce_fusion": True}, INT8_SQ, SMOL, 90) == []   # Llama, tp 3


def test_sm_dependent_algos():
    p = validate_build(QWEN7B_INT8, INT8_SQ, QWEN, 100)
    assert any(x.startswith("quantize.algo: int8_sq (W8A8_SQ_PER_CHANNEL) is not supported") for x in p), p
    assert any(x.startswith("quantize.kv_cache: int8 is not supported") for x in p), p
    fp8 = {**QWEN7B_INT8, "use_fused_mlp": True}
    assert validate_build(fp8, {"algo": "fp8", "kv_cache": "fp8"}, QWEN, 90) == []
    assert any("FP8 needs SM >= 89" in x for x in validate_build(fp8, {"algo": "fp8"}, QWEN, 80))
    # gpu_sm from the recipe is used when the caller passes none
    assert validate_build({**QWEN7B_INT8, "gpu_sm": 100}, INT8_SQ, QWEN, None) != []


def test_unsupported_algo_named():
    p = validate_build(QWEN7B_INT8, {"algo": "int4_awq"}, QWEN, 90)
    assert any(x.startswith("quantize.algo: int4_awq (W4A16_AWQ) has no checkpoint contract") for x in p), p
    p = validate_build(QWEN7B_INT8, {"algo": "int8"}, QWEN, 90)
    assert any(x.startswith("quantize.algo: 'int8' has no TensorRT-LLM checkpoint format") for x in p), p


def test_trtllm_build_args_exact():
    args = trtllm_build_args({"tensorrt_llm": QWEN7B_INT8}, "/c", "/e", "/tc/in.cache", "/e/timing.cache")
    assert args == ["trtllm-build", "--checkpoint_dir", "/c", "--output_dir", "/e",
                    "--max_batch_size", "64", "--max_input_len", "4096", "--max_seq_len", "8192",
                    "--max_num_tokens", "8192", "--tokens_per_block", "64", "--workers", "2",
                    "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
                    "--context_fmha", "enable", "--use_paged_context_fmha", "disable",
                    "--remove_input_padding", "enable", "--use_fused_mlp", "disable", "--reduce_fusion", "disable",
                    "--user_buffer", "disable", "--multiple_profiles", "enable", "--logits_dtype", "float16",
                    "--input_timing_cache", "/tc/in.cache", "--output_timing_cache", "/e/timing.cache"]
    assert "--tp_size" not in args and "--max_output_len" not in args   # not trtllm-build flags (§2.1)


def test_logits_dtype_always_passed():
    """--logits_dtype is never left to the checkpoint's config (ModelOpt writes the model dtype there)."""
    def flag(build):
        a = trtllm_build_args(build, "/c", "/e", None, None)
        assert a.count("--logits_dtype") == 1, a
        return a[a.index("--logits_dtype") + 1]
    assert flag(QWEN7B_INT8) == "float16"                                   # the schema default
    assert flag({**QWEN7B_INT8, "logits_dtype": "float32"}) == "float32"
    assert flag({**QWEN7B_INT8, "gather_context_logits": True}) == "float16"


def test_every_trtllm_recipe_passes_its_logits_dtype():
    from pipeline.recipe import list_recipes, resolve
    seen = 0
    for name in list_recipes():
        r = resolve(name)
        if r.build.target != "tensorrt_llm":
            continue
        seen += 1
        args = trtllm_build_args(r.build.tensorrt_llm.model_dump(), "/c", "/e", None, None)
        assert args[args.index("--logits_dtype") + 1] == r.build.tensorrt_llm.logits_dtype, name
    assert seen >= 3


@pytest.mark.skipif(trtllm_available()[0], reason="tensorrt_llm is installed here; the GPU test covers the build")
def test_build_engine_stops_without_tensorrt_llm(tmp_path):
    args = trtllm_build_args(QWEN7B_INT8, tmp_path / "ckpt", tmp_path / "eng", None, None)
    with pytest.raises(CannotRunHere) as e:
        build_engine(tmp_path / "ckpt", tmp_path / "eng", args, tmp_path / "missing.cache")
    assert "tensorrt_llm" in e.value.missing
    assert e.value.finish_hint.startswith("trtllm-build --checkpoint_dir ")
    assert f"--output_timing_cache {tmp_path / 'eng' / 'timing.cache'}" in e.value.finish_hint
    assert not (tmp_path / "eng").exists()   # nothing that looks like an engine


def test_prompt_limit_with_packed_input_and_context_fmha():
    """remove_input_padding + context FMHA: trtllm-build ignores max_input_len and the batch manager accepts
    min(max_seq_len - 1, max_num_tokens) (build_config.prompt_limit cites both lines; issue 27)."""
    from pipeline.trtllm.build_config import prompt_limit
    assert prompt_limit(QWEN7B_INT8) == (8191, True)
    assert prompt_limit({**SMOL_TP3, "max_num_tokens": 1500}) == (1500, True)
    assert prompt_limit({**SMOL_TP3, "context_fmha": False}) == (1024, False)
    assert prompt_limit({**SMOL_TP3, "remove_input_padding": False}) == (1024, False)
    # a recipe promising longer prompts than the runtime takes is refused, naming the key and the real limit
    p = validate_build({**SMOL_TP3, "max_input_len": 2048}, INT8_SQ, SMOL, 90)
    assert any(x.startswith("build.tensorrt_llm.max_input_len: 2048 is ignored") and "at most 2047 tokens" in x
               for x in p), p
    p = validate_build({**SMOL_TP3, "max_num_tokens": 512}, INT8_SQ, SMOL, 90)
    assert any("at most 512 tokens" in x for x in p), p
    assert validate_build({**SMOL_TP3, "max_input_len": 2048, "context_fmha": False}, INT8_SQ, SMOL, 90) == []
