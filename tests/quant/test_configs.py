"""The tensorrt_llm target's quantizers (pipeline/trtllm/quantizers.py): the model facts they check at plan, the
ModelOpt config and the checkpoint block each algo maps to, and the recipe's one validation of the quantize section
(fast)."""

import pytest

from pipeline.errors import RecipeError
from pipeline.modelinfo import ModelInfo
from pipeline.recipe import QuantizeSection, resolve
from pipeline.trtllm.quantizers import QUANTIZERS, needs_sm, valid_block_sizes

SMOL = ModelInfo(model_type="llama", architecture="LlamaForCausalLM", hidden_size=576, num_layers=30,
                 num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                 max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=True, attention_bias=False)
QWEN7B = ModelInfo(model_type="qwen2", architecture="Qwen2ForCausalLM", hidden_size=3584, num_layers=28,
                   num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944, vocab_size=152064,
                   max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, attention_bias=True)
RECIPE = "smollm2-135m-trtllm-tp3"          # a tensorrt_llm recipe; --set gives the quantize section to check


def one(problems, key):
    hits = [p for p in problems if p.startswith(key + ":") or f": {key}:" in p or f": {key} " in p
            or f"unknown key '{key}'" in p]
    assert hits, f"no problem for {key} in {problems}"
    return hits[0]


def refused(*sets) -> list[str]:
    with pytest.raises(RecipeError) as e:
        resolve(RECIPE, list(sets))
    return e.value.problems


def plan(q: QuantizeSection, info=SMOL) -> list[str]:
    qz = QUANTIZERS[q.algo]
    return qz.plan_problems(q, qz.options_of(q), info)


def test_block_sizes_follow_model_dims():
    assert valid_block_sizes(SMOL) == [32, 64, 96, 192]          # 576 and 1536 wide inputs
    assert 128 in valid_block_sizes(QWEN7B)
    awq, q = QUANTIZERS["int4_awq"], QuantizeSection(algo="int4_awq")
    assert awq.group_size(awq.options_of(q), SMOL) == 96 and awq.group_size(awq.options_of(q), QWEN7B) == 128
    assert awq.record(q, awq.options_of(q), SMOL)["block_size"] == 96


@pytest.mark.parametrize("bs", [128, 48, 576])
def test_bad_block_size_named_with_allowed_values(bs):
    msg = one(plan(QuantizeSection(algo="int4_awq", block_size=bs)), "quantize.block_size")
    assert "32, 64, 96, 192" in msg and "down_proj 1536" in msg


@pytest.mark.parametrize("bs", [32, 64, 96, 192])
def test_good_block_sizes(bs):
    assert plan(QuantizeSection(algo="int4_wo", block_size=bs)) == []


def test_the_quantize_stage_asks_the_quantizer_at_plan():
    from pipeline.stages.tensorrt_llm import ModeloptQuantize
    r = resolve(RECIPE, ["quantize.algo=int4_awq", "quantize.alpha=null", "quantize.block_size=128",
                         "quantize.calibration.seq_len=9000"])
    p = ModeloptQuantize().plan_problems(r, SMOL)
    assert one(p, "quantize.block_size").startswith("quantize.block_size: 128 must be a multiple of 32")
    assert "longer than the model's context (8192 tokens" in one(p, "quantize.calibration.seq_len")
    assert ModeloptQuantize().plan_problems(resolve(RECIPE, ["quantize.algo=int4_awq", "quantize.alpha=null"]),
                                            SMOL) == []


@pytest.mark.parametrize("alpha", ["-0.1", "1.5", "high", "true"])
def test_bad_alpha(alpha):
    assert "[0, 1]" in one(refused("quantize.algo=int8_sq", f"quantize.alpha={alpha}"), "quantize.alpha")


@pytest.mark.parametrize("bs", ["0", "'64'"])
def test_bad_block_size_type_or_range(bs):
    one(refused("quantize.algo=int4_awq", f"quantize.block_size={bs}"), "quantize.block_size")


def test_alpha_on_other_algo_and_block_size_on_int8_are_rejected():
    p = refused("quantize.algo=int8_wo", "quantize.alpha=0.5", "quantize.block_size=64")
    assert "int8_sq" in one(p, "quantize.alpha")
    assert "int4" in one(p, "quantize.block_size")


def test_an_option_a_section_key_stands_for_has_one_spelling():
    p = refused("quantize.algo=int4_awq", "quantize.options.block_size=64")
    assert "reads this as quantize.block_size (one spelling per option)" in one(p, "quantize.options.block_size")
    p = refused("quantize.algo=int8_sq", "quantize.options.alpha=0.5", "quantize.options.smoothquant_alpha=0.5")
    assert "did you mean 'quantize.alpha'?" in one(p, "quantize.options.alpha")
    assert "did you mean 'quantize.alpha'?" in one(p, "quantize.options.smoothquant_alpha")


def test_bad_algo_kv_method():
    p = refused("quantize.algo=int3", "quantize.kv_cache=int4", "quantize.method=gptq")
    assert "int8_sq" in one(p, "quantize.algo")
    assert "fp8" in one(p, "quantize.kv_cache")
    assert "qat" in one(p, "quantize.method")
    assert "'int8' is the onnxruntime target's format" in one(refused("quantize.algo=int8"), "quantize.algo")


def test_all_problems_at_once_and_nested_keys_named():
    p = refused("quantize.algo=int8_sq", "quantize.method=qat", "quantize.bogus=1", "quantize.calibration.samples=0",
                "quantize.calibration.seed=-1", "quantize.calibration.sampels=3", "quantize.qat.epochs=4",
                "quantize.qat.lr=0.5", "quantize.qat.schedule=step", "quantize.qat.distill.enabled='yes'",
                "quantize.qat.distill.temperature=0", "quantize.options.exclude=lm_head")
    for key in ("quantize.bogus", "quantize.calibration.samples", "quantize.calibration.seed",
                "quantize.calibration.sampels", "quantize.qat.epochs", "quantize.qat.lr", "quantize.qat.schedule",
                "quantize.qat.distill.enabled", "quantize.qat.distill.temperature"):
        one(p, key)
    p = refused("quantize.algo=int8_sq", "quantize.method=qat", "quantize.qat.warmup_steps=99",
                "quantize.options.exclude=lm_head", "quantize.options.foo=1")
    for key in ("quantize.qat.warmup_steps", "quantize.options.exclude", "quantize.options.foo"):
        one(p, key)


def test_needs_sm():
    assert needs_sm("fp8") == 89 and needs_sm("int8_sq", "fp8") == 89
    assert needs_sm("int8_sq") is None and needs_sm("int4_awq", "int8") is None


def _entry(cfg, name):
    return [e for e in cfg["quant_cfg"] if e.get("quantizer_name") == name]


def mo(**kw) -> dict:
    q = QuantizeSection(**kw)
    qz = QUANTIZERS[q.algo]
    return qz.modelopt_config(qz.options_of(q), q.kv_cache, SMOL)


def test_modelopt_config_mapping():
    import modelopt.torch.quantization as mtq
    sq = mo(algo="int8_sq", alpha=0.7)
    assert sq["algorithm"] == {"method": "smoothquant", "alpha": 0.7}
    assert mtq.INT8_SMOOTHQUANT_CFG["algorithm"] == "smoothquant"          # preset not mutated
    assert mo(algo="int8_sq_per_token")["algorithm"] == {"method": "smoothquant", "alpha": 0.5}
    awq = mo(algo="int4_awq", block_size=64)
    assert _entry(awq, "*weight_quantizer")[0]["cfg"]["block_sizes"] == {-1: 64, "type": "static"}
    assert _entry(mo(algo="int4_awq"), "*weight_quantizer")[0]["cfg"]["block_sizes"][-1] == 96   # the model's default
    assert _entry(mtq.INT4_AWQ_CFG, "*weight_quantizer")[0]["cfg"]["block_sizes"][-1] == 128
    assert awq["algorithm"]["method"] == "awq_lite"
    wo = mo(algo="int8_wo")
    assert _entry(wo, "*input_quantizer")[0]["enable"] is False
    kv = mo(algo="fp8", kv_cache="int8")
    assert _entry(kv, "*[kv]_bmm_quantizer")[-1]["cfg"]["num_bits"] == 8
    ex = mo(algo="int8_sq", options={"exclude": ["*layers.0.*"]})
    assert {"quantizer_name": "*layers.0.**quantizer", "enable": False} in ex["quant_cfg"]
    assert mo(algo="none", kv_cache="fp8")["quant_cfg"][0] == {"quantizer_name": "*", "enable": False}


def block(**kw) -> dict:
    q = QuantizeSection(**kw)
    qz = QUANTIZERS[q.algo]
    return qz.checkpoint_quantization(qz.options_of(q), q.kv_cache, SMOL)


def test_trtllm_quantization_block():
    assert block(algo="int8_sq", alpha=0.5) == {
        "quant_algo": "W8A8_SQ_PER_CHANNEL", "kv_cache_quant_algo": None, "smoothquant_val": 0.5}
    assert block(algo="int4_awq", block_size=64, kv_cache="fp8") == {
        "quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": "FP8", "group_size": 64}
    assert block(algo="int8_wo")["quant_algo"] == "W8A16"


def test_one_algo_table():
    """build_config's QUANT_ALGO and the target's algos are views of the quantizers' table."""
    from pipeline import targets
    from pipeline.trtllm.build_config import QUANT_ALGO, SMOOTHQUANT_ALGOS
    assert targets.get("tensorrt_llm").quantizers is QUANTIZERS
    assert QUANT_ALGO == {a: q.checkpoint_algo for a, q in QUANTIZERS.items()}
    assert SMOOTHQUANT_ALGOS == ("int8_sq", "int8_sq_per_token")
    assert {a for a, q in QUANTIZERS.items() if not q.fake_quant_export} == {"int8_wo", "int4_wo", "int4_zp"}


def test_cache_relevant_values_reach_the_record():
    """Calibration set / samples / seed are values of the record the artifact keeps."""
    qz = QUANTIZERS["int8_sq"]

    def record(**cal):
        q = QuantizeSection(algo="int8_sq", calibration=cal)
        return qz.record(q, qz.options_of(q), SMOL)
    a = record()
    assert a["alpha"] == 1.0 and a["block_size"] == 96       # as the artifact has always recorded them
    for key, val in (("set", "wiki"), ("samples", 64), ("seed", 7)):
        b = record(**{key: val})
        assert b["calibration"][key] == val and b != a


def test_the_checkpoint_takes_the_quantizers_group_size():
    """int4_wo without quantize.block_size: the checkpoint's group size is the quantizer's default for the model,
    the one the quantize stage simulated (it was 128 whatever the model, which does not divide SmolLM2's 576)."""
    from pipeline.stages.tensorrt_llm import TrtllmCheckpoint
    from pipeline.trtllm.checkpoint import apply_config_fixups
    qz, q = QUANTIZERS["int4_wo"], QuantizeSection(algo="int4_wo")
    cfg = apply_config_fixups({"quantization": {}}, SMOL, {}, qz.record(q, qz.options_of(q), SMOL))
    assert cfg["quantization"]["group_size"] == 96 == qz.checkpoint_quantization(qz.options_of(q), "none", SMOL)[
        "group_size"]
    # the checkpoint's key moves for exactly that case: an explicit block size built the same checkpoint before
    base = ["quantize.algo=int4_wo", "quantize.alpha=null"]
    assert "group_size" in TrtllmCheckpoint().config(resolve(RECIPE, base))
    assert TrtllmCheckpoint().config(resolve(RECIPE, base + ["quantize.block_size=64"])) == \
        TrtllmCheckpoint().config(resolve(RECIPE)) == {"dtype": "float16", "tp": 3, "pp": 1}
