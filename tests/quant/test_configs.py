"""Plan-time validation of the quantize: section and the algo -> ModelOpt / TensorRT-LLM mapping (fast)."""

import pytest

from pipeline.modelinfo import ModelInfo
from pipeline.quant import (modelopt_config, needs_sm, resolve_quant_config, trtllm_quantization,
                            valid_block_sizes, validate_quant_config)

SMOL = ModelInfo(model_type="llama", architecture="LlamaForCausalLM", hidden_size=576, num_layers=30,
                 num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                 max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=True, attention_bias=False)
QWEN7B = ModelInfo(model_type="qwen2", architecture="Qwen2ForCausalLM", hidden_size=3584, num_layers=28,
                   num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944, vocab_size=152064,
                   max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, attention_bias=True)


def one(problems, key):
    hits = [p for p in problems if p.startswith(key + ":")]
    assert hits, f"no problem for {key} in {problems}"
    return hits[0]


def test_block_sizes_follow_model_dims():
    assert valid_block_sizes(SMOL) == [32, 64, 96, 192]          # 576 and 1536 wide inputs
    assert 128 in valid_block_sizes(QWEN7B)
    assert resolve_quant_config({"algo": "int4_awq"}, SMOL)["block_size"] == 96
    assert resolve_quant_config({"algo": "int4_awq"}, QWEN7B)["block_size"] == 128


@pytest.mark.parametrize("bs", [128, 48, 576, 0, "64"])
def test_bad_block_size_named_with_allowed_values(bs):
    msg = one(validate_quant_config({"algo": "int4_awq", "block_size": bs}, SMOL), "quantize.block_size")
    assert "32, 64, 96, 192" in msg and "down_proj 1536" in msg


@pytest.mark.parametrize("bs", [32, 64, 96, 192])
def test_good_block_sizes(bs):
    assert validate_quant_config({"algo": "int4_wo", "block_size": bs}, SMOL) == []


@pytest.mark.parametrize("alpha", [-0.1, 1.5, "high", True])
def test_bad_alpha(alpha):
    msg = one(validate_quant_config({"algo": "int8_sq", "alpha": alpha}, SMOL), "quantize.alpha")
    assert "[0, 1]" in msg


def test_alpha_on_other_algo_and_block_size_on_int8_are_rejected():
    p = validate_quant_config({"algo": "int8_wo", "alpha": 0.5, "block_size": 64}, SMOL)
    assert "int8_sq" in one(p, "quantize.alpha")
    assert "int4" in one(p, "quantize.block_size")


def test_bad_algo_kv_method():
    p = validate_quant_config({"algo": "int3", "kv_cache": "int4", "method": "gptq"}, SMOL)
    assert "int8_sq" in one(p, "quantize.algo")
    assert "fp8" in one(p, "quantize.kv_cache")
    assert "qat" in one(p, "quantize.method")
    assert "onnxruntime" in one(validate_quant_config({"algo": "int8"}, SMOL), "quantize.algo")


def test_all_problems_at_once_and_nested_keys_named():
    p = validate_quant_config({"algo": "int8_sq", "method": "qat", "bogus": 1,
                               "calibration": {"samples": 0, "seed": -1, "sampels": 3},
                               "qat": {"epochs": 4, "lr": 0.5, "schedule": "step", "warmup_steps": 99,
                                       "distill": {"enabled": "yes", "temperature": 0}},
                               "options": {"exclude": "lm_head", "foo": 1}}, SMOL)
    for key in ("quantize.bogus", "quantize.calibration.samples", "quantize.calibration.seed",
                "quantize.calibration.sampels", "quantize.qat.epochs", "quantize.qat.lr", "quantize.qat.schedule",
                "quantize.qat.warmup_steps", "quantize.qat.distill.enabled", "quantize.qat.distill.temperature",
                "quantize.options.exclude", "quantize.options.foo"):
        one(p, key)


def test_lead_schema_dump_validates():
    """A model_dump() of the recipe's QuantizeSection (every key present, None for unset) is accepted."""
    from pipeline.recipe import QuantizeSection
    d = QuantizeSection(method="qat", algo="int4_awq", block_size=64).model_dump()
    assert validate_quant_config(d, SMOL) == []
    assert "quantize.block_size" in validate_quant_config(
        QuantizeSection(algo="int4_awq", block_size=128).model_dump(), SMOL)[0]


def test_needs_sm():
    assert needs_sm("fp8") == 89 and needs_sm("int8_sq", "fp8") == 89
    assert needs_sm("int8_sq") is None and needs_sm("int4_awq", "int8") is None


def _entry(cfg, name):
    return [e for e in cfg["quant_cfg"] if e.get("quantizer_name") == name]


def test_modelopt_config_mapping():
    import modelopt.torch.quantization as mtq
    sq = modelopt_config({"algo": "int8_sq", "alpha": 0.7}, SMOL)
    assert sq["algorithm"] == {"method": "smoothquant", "alpha": 0.7}
    assert mtq.INT8_SMOOTHQUANT_CFG["algorithm"] == "smoothquant"          # preset not mutated
    awq = modelopt_config({"algo": "int4_awq", "block_size": 64}, SMOL)
    assert _entry(awq, "*weight_quantizer")[0]["cfg"]["block_sizes"] == {-1: 64, "type": "static"}
    assert _entry(mtq.INT4_AWQ_CFG, "*weight_quantizer")[0]["cfg"]["block_sizes"][-1] == 128
    assert awq["algorithm"]["method"] == "awq_lite"
    wo = modelopt_config({"algo": "int8_wo"}, SMOL)
    assert _entry(wo, "*input_quantizer")[0]["enable"] is False
    kv = modelopt_config({"algo": "fp8", "kv_cache": "int8"}, SMOL)
    assert _entry(kv, "*[kv]_bmm_quantizer")[-1]["cfg"]["num_bits"] == 8
    ex = modelopt_config({"algo": "int8_sq", "options": {"exclude": ["*layers.0.*"]}}, SMOL)
    assert {"quantizer_name": "*layers.0.**quantizer", "enable": False} in ex["quant_cfg"]


def test_trtllm_quantization_block():
    assert trtllm_quantization({"algo": "int8_sq", "alpha": 0.5}) == {
        "quant_algo": "W8A8_SQ_PER_CHANNEL", "kv_cache_quant_algo": None, "smoothquant_val": 0.5}
    assert trtllm_quantization({"algo": "int4_awq", "block_size": 64, "kv_cache": "fp8"}) == {
        "quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": "FP8", "group_size": 64}
    assert trtllm_quantization({"algo": "int8_wo"})["quant_algo"] == "W8A16"


def test_cache_relevant_values_reach_the_resolved_config():
    """Calibration set / samples / seed are values of the config dict, so the stage key sees them."""
    a = resolve_quant_config({"algo": "int8_sq"})
    for key, val in (("set", "wiki"), ("samples", 64), ("seed", 7)):
        b = resolve_quant_config({"algo": "int8_sq", "calibration": {key: val}})
        assert b["calibration"][key] == val and b != a
