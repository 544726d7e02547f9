"""Memory planner numbers, checked against hand arithmetic on public model configs."""

import pytest
from rich.console import Console

from pipeline.errors import ForgeError
from pipeline.gpus import GPUS, GiB, get_gpu
from pipeline.memory import fit, plan_memory, render_memory
from pipeline.modelinfo import ModelInfo


@pytest.fixture
def llama7b():
    return ModelInfo.bundled("meta-llama/Llama-2-7b-hf")


@pytest.fixture
def qwen7b():
    return ModelInfo.bundled("Qwen/Qwen2-7B-Instruct")


def test_qwen7b_fp16_weights_about_14_to_15_gb(qwen7b):
    p = plan_memory(qwen7b, quant_algo="none", dtype="float16", max_batch_size=1, max_seq_len=128)
    assert 14 * GiB < p.weights_bytes < 15 * GiB            # 7.6 B params x 2 bytes = 15.2 GB = 14.2 GiB
    assert p.weights_bytes == pytest.approx(qwen7b.num_params * 2, rel=1e-3)


def test_kv_cache_32_layer_4096_mha_4k_x4_fp16_is_8_gib(llama7b):
    p = plan_memory(llama7b, max_batch_size=4, max_seq_len=4096, kv_cache="fp16")
    assert p.kv_cache_bytes == 8 * GiB
    assert p.kv_bytes_per_token == 32 * 32 * 128 * 2 * 2
    assert p.kv_cache_paged_bytes == 8 * GiB                 # 4096 is a whole number of 32-token blocks
    for kv in ("int8", "fp8"):
        assert plan_memory(llama7b, max_batch_size=4, max_seq_len=4096, kv_cache=kv).kv_cache_bytes == 4 * GiB


def test_paged_blocks_round_up(llama7b):
    p = plan_memory(llama7b, max_batch_size=3, max_seq_len=100, tokens_per_block=64)
    assert p.kv_blocks == 3 * 2
    assert p.kv_cache_paged_bytes == 6 * 64 * p.kv_bytes_per_token
    assert p.kv_cache_bytes == 300 * p.kv_bytes_per_token


def test_quant_algos_shrink_linears_and_count_scales(qwen7b):
    kw = dict(max_batch_size=1, max_seq_len=128)
    fp16 = plan_memory(qwen7b, quant_algo="fp16", **kw).weights
    i8 = plan_memory(qwen7b, quant_algo="int8_wo", **kw).weights
    i4 = plan_memory(qwen7b, quant_algo="int4_awq", group_size=128, **kw).weights
    lin = fp16["decoder linears"]["bytes"]
    assert i8["decoder linears"]["bytes"] == lin // 2
    assert i4["decoder linears"]["bytes"] == lin // 4
    # embedding / lm_head stay fp16 whatever the algo
    assert i4["embedding"]["bytes"] == fp16["embedding"]["bytes"] == 152064 * 3584 * 2
    # AWQ group scales: one fp16 per 128 inputs per output  ->  1/64 of the int4 payload's elements x 2 bytes
    params = fp16["decoder linears"]["params"]
    assert i4["quant scales"]["bytes"] > params // 128 * 2
    assert i4["quant scales"]["bytes"] < params // 128 * 2 * 1.03   # + fp16 pre-quant smoothing vectors
    with pytest.raises(ForgeError, match="group size"):
        plan_memory(ModelInfo.bundled("HuggingFaceTB/SmolLM2-135M-Instruct"), quant_algo="int4_awq", group_size=128)


def test_tp_splits_linears_and_duplicates_kv_heads(qwen7b):
    one = plan_memory(qwen7b, max_batch_size=4, max_seq_len=1024)
    two = plan_memory(qwen7b, max_batch_size=4, max_seq_len=1024, tp=2)
    assert two.weights["decoder linears"]["bytes"] == one.weights["decoder linears"]["bytes"] // 2
    assert two.kv_cache_bytes == one.kv_cache_bytes // 2
    # a GQA model with 2 KV heads on tp=4: each rank holds one (duplicated) KV head
    gqa = ModelInfo.from_hf_config({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
                                    "num_hidden_layers": 32, "intermediate_size": 11008, "vocab_size": 32000})
    g1 = plan_memory(gqa, max_batch_size=4, max_seq_len=1024)
    g4 = plan_memory(gqa, max_batch_size=4, max_seq_len=1024, tp=4)
    assert g4.kv_heads_per_rank == 1
    assert g4.kv_cache_bytes == g1.kv_cache_bytes // 2      # not // 4
    assert any("duplicated" in n for n in g4.notes)
    with pytest.raises(ForgeError, match="num_attention_heads"):
        plan_memory(qwen7b, tp=8)                            # 28 heads


def test_pp_worst_stage(llama7b):
    p = plan_memory(llama7b, pp=2, max_batch_size=1, max_seq_len=128)
    assert p.layers_per_rank == 16
    full = plan_memory(llama7b, max_batch_size=1, max_seq_len=128)
    assert p.weights_bytes < full.weights_bytes * 0.6


def test_fit_and_suggestions_on_rtx4090(qwen7b):
    p = plan_memory(qwen7b, quant_algo="int8_sq", kv_cache="fp16", max_batch_size=64, max_seq_len=4096)
    v = fit(p, get_gpu("rtx4090"))
    assert not v.fits and v.margin_bytes < 0
    keys = {s.key: s for s in v.suggestions}
    assert {"max_batch_size", "kv_cache", "tp"} <= set(keys)
    # every concrete suggestion really fits when applied alone
    for s in v.suggestions:
        if s.key in ("max_batch_size", "max_seq_len", "tp", "max_num_tokens"):
            changed = plan_memory(ModelInfo.bundled("Qwen/Qwen2-7B-Instruct"), **{**p.args, s.key: s.value})
            assert changed.total_bytes <= GPUS["rtx4090"].memory_bytes
    b = keys["max_batch_size"].value
    assert b == v.max_batch_size_that_fits
    assert plan_memory(qwen7b, **{**p.args, "max_batch_size": b + 1}).total_bytes > GPUS["rtx4090"].memory_bytes
    assert keys["kv_cache"].value == "fp8"              # Ada has FP8
    assert fit(p, get_gpu("h200")).fits


def test_fp8_rejected_on_a100(qwen7b):
    p = plan_memory(qwen7b, quant_algo="fp8", kv_cache="fp8", max_batch_size=1, max_seq_len=1024)
    v = fit(p, get_gpu("a100"))
    assert not v.fits and any("FP8" in x for x in v.problems)
    assert fit(p, get_gpu("h100")).fits


def test_fp16_7b_on_4090_suggests_quantization(qwen7b):
    p = plan_memory(qwen7b, quant_algo="fp16", max_batch_size=64, max_seq_len=8192)
    v = fit(p, get_gpu("rtx4090"))
    assert not v.fits
    assert any(s.key == "quant_algo" for s in v.suggestions) or any(s.key == "tp" for s in v.suggestions)


def test_get_gpu_names_and_error():
    assert get_gpu("RTX4090").name == "rtx4090"
    assert get_gpu("a100").name == "a100-80gb"
    with pytest.raises(ForgeError, match="rtx4090, l40s, a100-80gb, h100, h200"):
        get_gpu("v100")


def test_bad_values_name_the_recipe_key(qwen7b):
    with pytest.raises(ForgeError, match="quantize.algo"):
        plan_memory(qwen7b, quant_algo="int3")
    with pytest.raises(ForgeError, match="quantize.kv_cache"):
        plan_memory(qwen7b, kv_cache="int4")


def test_render(qwen7b):
    p = plan_memory(qwen7b, quant_algo="int8_sq", max_batch_size=64, max_seq_len=4096)
    con = Console(record=True, width=160)
    render_memory(p, [fit(p, get_gpu("rtx4090")), fit(p, get_gpu("h200"))], con)
    out = con.export_text()
    assert "DOES NOT FIT" in out and "FITS" in out and "build.tensorrt_llm.max_batch_size" in out
    assert "KV cache" in out and "total per rank" in out


def test_kv_none_means_activation_dtype(llama7b):
    a = plan_memory(llama7b, kv_cache="none", max_batch_size=1, max_seq_len=1024)
    assert a.args["kv_cache"] == "float16" and a.kv_cache_bytes == 1024 * 32 * 32 * 128 * 2 * 2


def test_plan_for_recipe_qwen7b_int8_on_rtx4090():
    recipe_mod = pytest.importorskip("pipeline.recipe")
    from pipeline.memory import plan_for_recipe
    from pipeline.runner import Runner

    try:
        r = recipe_mod.resolve("qwen7b-int8", [])
    except Exception as e:  # the recipe belongs to the lead; skip only when it is absent
        pytest.skip(f"recipe qwen7b-int8 not available: {e}")
    info = Runner(r).model_info()
    assert info is not None and info.hidden_size == 3584
    plan, verdicts = plan_for_recipe(r, info, "rtx4090")
    assert plan.args["quant_algo"] == "int8_sq_per_token" and plan.args["kv_cache"] == "int8"
    assert plan.args["tp"] == r.build.tensorrt_llm.tp
    assert len(verdicts) == 1 and verdicts[0].gpu == "rtx4090"
    assert verdicts[0].needed_bytes == plan.total_bytes
    _, all_v = plan_for_recipe(r, info, None)
    assert [v.gpu for v in all_v] == ["rtx4090", "l40s", "a100-80gb", "h100", "h200"]


def test_plan_for_recipe_splits_the_embedding_as_forge_checkpoints_do():
    """forge's checkpoints (ModelOpt export) carry use_parallel_embedding: each rank holds ceil(vocab / tp) rows of
    the table, which the per-rank plan must count (issue 18: plan vs the rank files)."""
    from pipeline.memory import plan_for_recipe
    from pipeline.recipe import resolve
    from pipeline.runner import Runner

    r = resolve("qwen7b-int8", [])
    info = Runner(r).model_info()
    plan, _ = plan_for_recipe(r, info, "h200")
    tp = r.build.tensorrt_llm.tp
    assert tp == 2 and plan.args["parallel_embedding"] is True
    assert plan.weights["embedding"]["bytes"] == -(-152064 // tp) * 3584 * 2
    assert any("embedding split over the 2 TP ranks" in n for n in plan.notes)
    replicated = plan_memory(info, **{**plan.args, "parallel_embedding": False})
    assert replicated.weights["embedding"]["bytes"] == 152064 * 3584 * 2
