"""Every generated ``tensorrt_llm`` repository of every TensorRT-LLM recipe against the tensorrtllm backend's
contract (tests/serving/trtllm_backend_contract.py: the table of every ``parameters`` key the 1.2-line backend
reads, with its source); the checker itself is shown to catch each class of mistake; and the BLS model's
source is held to python_backend's decoupled rule."""

import ast
import json
from pathlib import Path

import pytest
from google.protobuf import json_format

import trtllm_backend_contract as contract
from pipeline.modelinfo import ModelInfo, bundled_config
from pipeline.recipe import list_recipes, resolve
from pipeline.trtllm.checkpoint import apply_config_fixups
from pipeline.triton.pbtxt import parse_all_configs, parse_config
from pipeline.triton.repo_trtllm import write_trtllm_repo

BLS_SOURCE = Path(__file__).resolve().parents[2] / "pipeline" / "triton" / "python_models" / "bls.py"
TRTLLM_RECIPES = [n for n in list_recipes() if resolve(n).build.target == "tensorrt_llm"]


def hf_config(recipe) -> dict:
    """The recipe's model config.json, as bundled with forge (every TensorRT-LLM recipe's model has one)."""
    for name in (recipe.model.config, recipe.model.source.removeprefix("builtin:")):
        cfg = bundled_config(name) if name else None
        if cfg is not None:
            return cfg
    raise AssertionError(f"{recipe.name}: no bundled config for {recipe.model.source}")


def engine_config(recipe) -> dict:
    """What trtllm-build writes to the engine's config.json (the keys forge reads), for this recipe's build: the
    pretrained_config is the checkpoint config after forge's own fix-ups (window fields included)."""
    b = recipe.build.tensorrt_llm
    hf = hf_config(recipe)
    info = ModelInfo.from_hf_config(hf)
    mapping = {"world_size": b.tp * b.pp, "tp_size": b.tp, "pp_size": b.pp}
    pretrained = apply_config_fixups({"num_hidden_layers": info.num_layers, "mapping": mapping}, info, hf,
                                     recipe.quantize.model_dump())
    return {"version": "1.2.0",
            "pretrained_config": {**pretrained, "dtype": b.dtype, "logits_dtype": b.logits_dtype},
            "build_config": {"max_batch_size": b.max_batch_size, "max_beam_width": b.max_beam_width,
                             "max_input_len": b.max_input_len, "max_seq_len": b.max_seq_len,
                             "kv_cache_type": b.kv_cache_type.upper(), "gather_context_logits": b.gather_context_logits,
                             "plugin_config": {"context_fmha": b.context_fmha, "tokens_per_block": b.tokens_per_block,
                                               "use_paged_context_fmha": b.use_paged_context_fmha}}}


def as_json(cfg) -> dict:
    # the JSON form TRITONBACKEND_ModelConfig hands a backend
    return json_format.MessageToDict(cfg, preserving_proto_field_name=True)


@pytest.fixture(params=TRTLLM_RECIPES)
def generated(request, tiny_artifacts, tmp_path):
    r = resolve(request.param)
    eng = tmp_path / "engine"
    eng.mkdir()
    cfg = engine_config(r)
    (eng / "config.json").write_text(json.dumps(cfg))
    for rank in range(cfg["pretrained_config"]["mapping"]["world_size"]):
        (eng / f"rank{rank}.engine").write_bytes(b"test fixture: not an engine")
    repo = tmp_path / "repo"
    write_trtllm_repo(repo, engine_dir=eng, tokenizer_dir=tiny_artifacts["tokenizer_dir"], engine_config=cfg,
                      triton=r.package.triton.model_dump())
    return r, repo


def test_table_and_required_keys():
    assert len(contract.PARAMETERS) == len(contract.BY_NAME) == 47   # 43 in model_instance_state.cc, 4 in model_state.cc
    assert set(contract.REQUIRED) == {"gpt_model_type", "tokenizer_dir", "xgrammar_tokenizer_info_path",
                                      "guided_decoding_backend"}
    assert all(p.where for p in contract.PARAMETERS)


def test_recipes_covered():
    assert {"qwen7b-int8", "qwen7b-fp16", "smollm2-135m-trtllm-tp3", "mistral7b-int8wo", "gemma3-270m-trtllm",
            "llama3-8b-int8", "qwen3-8b-fp16"} <= set(TRTLLM_RECIPES)


def hf_windows(hf: dict, max_seq_len: int) -> list[int] | None:
    """What HF attends to per layer, capped at the engine's max_seq_len: Gemma 3 lists its layer types, Mistral
    slides every layer; None when nothing is shorter than max_seq_len (written independently of forge's code)."""
    w = hf.get("sliding_window")
    if not w or hf.get("use_sliding_window") is False:
        return None
    types = hf.get("layer_types") or ["sliding_attention"] * hf["num_hidden_layers"]
    out = [min(w, max_seq_len) if t == "sliding_attention" else max_seq_len for t in types]
    return out if min(out) < max_seq_len else None


def test_sliding_window_recipes_set_max_attention_window_size(generated):
    """The engine's sliding windows reach the backend: one entry per layer, as HF attends; none for Llama / Qwen."""
    r, repo = generated
    params = contract.model_parameters(as_json(parse_all_configs(repo)["tensorrt_llm"]))
    want = hf_windows(hf_config(r), r.build.tensorrt_llm.max_seq_len)
    if want is None:
        assert "max_attention_window_size" not in params, r.name
        assert r.name not in ("mistral7b-int8wo", "gemma3-270m-trtllm")
        return
    assert [int(x) for x in params["max_attention_window_size"].split(",")] == want
    if r.name == "mistral7b-int8wo":       # window 4096 < max_seq_len 8192 on all 32 layers
        assert want == [4096] * 32
    if r.name == "gemma3-270m-trtllm":     # 512 on 5 of every 6 of its 18 layers, max_seq_len 2048 on the 6th
        assert want == ([512] * 5 + [2048]) * 3


def test_generated_tensorrt_llm_config_meets_the_contract(generated):
    r, repo = generated
    cfgs = parse_all_configs(repo)
    cfg = as_json(cfgs["tensorrt_llm"])
    ens_inputs = {i.name for i in cfgs["ensemble"].input}
    problems = contract.check_model_config(cfg, engine_logits_dtype=r.build.tensorrt_llm.logits_dtype,
                                           streaming_input="stream" in ens_inputs
                                           or cfgs["tensorrt_llm_bls"].model_transaction_policy.decoupled,
                                           engine_layers=hf_config(r)["num_hidden_layers"],
                                           engine_max_seq_len=r.build.tensorrt_llm.max_seq_len)
    assert problems == [], f"{r.name}: {problems}"
    params = contract.model_parameters(cfg)
    assert Path(params["gpt_model_path"]).is_dir()
    # the values the recipe means, as the backend parses them
    t = r.package.triton
    assert contract.as_bool(params["enable_kv_cache_reuse"]) == t.enable_kv_cache_reuse
    assert float(params["kv_cache_free_gpu_mem_fraction"]) == t.kv_cache_free_gpu_mem_fraction
    assert params["batch_scheduler_policy"] == t.batch_scheduler_policy
    assert bool(cfg.get("model_transaction_policy", {}).get("decoupled", False)) == t.decoupled
    assert len(params["gpu_device_ids"].split(",")) == r.build.tensorrt_llm.tp * r.build.tensorrt_llm.pp


def test_kv_pool_is_capped_at_what_the_memory_plan_reserves(generated):
    """Issue 40: max_tokens_in_paged_kv_cache = max_batch_size x ceil(window / tokens_per_block) x tokens_per_block,
    the plan's own KV cache, so the buffers the runtime allocates after the pool get the rest; absent for Gemma 3,
    whose two window sizes make TensorRT-LLM 1.2 ignore it (the plan then budgets by the fraction alone)."""
    from pipeline.trtllm.memory import plan_for_recipe
    r, repo = generated
    params = contract.model_parameters(as_json(parse_all_configs(repo)["tensorrt_llm"]))
    b = r.build.tensorrt_llm
    plan, _ = plan_for_recipe(r, ModelInfo.from_hf_config(hf_config(r)), "h100", deploy=True)
    if r.name == "gemma3-270m-trtllm":
        assert "max_tokens_in_paged_kv_cache" not in params and plan.kv_max_tokens is None
        return
    window = 4096 if r.name == "mistral7b-int8wo" else b.max_seq_len
    hand = b.max_batch_size * -(-window // b.tokens_per_block) * b.tokens_per_block
    assert int(params["max_tokens_in_paged_kv_cache"]) == hand == plan.kv_max_tokens
    assert plan.kv_max_tokens * plan.kv_bytes_per_token == plan.kv_cache_paged_bytes


@pytest.mark.parametrize("change,expect", [
    (lambda p: p.pop("tokenizer_dir"), "parameters.tokenizer_dir: missing"),
    (lambda p: p.pop("xgrammar_tokenizer_info_path"), "parameters.xgrammar_tokenizer_info_path: missing"),
    (lambda p: p.pop("guided_decoding_backend"), "parameters.guided_decoding_backend: missing"),
    (lambda p: p.pop("gpt_model_type"), "parameters.gpt_model_type: missing"),
    (lambda p: p.update(gpt_model_type="ifb"), "parameters.gpt_model_type: 'ifb' is not one of"),
    (lambda p: p.update(enable_kv_cache_reuse="yes"), "parameters.enable_kv_cache_reuse: 'yes' is not a bool"),
    (lambda p: p.update(max_beam_width="1.0"), "parameters.max_beam_width: '1.0' is not a int"),
    (lambda p: p.update(kv_cache_free_gpu_mem_fraction="1.0"), "must be strictly between 0 and 1"),
    (lambda p: p.update(batch_scheduler_policy="max_util"), "parameters.batch_scheduler_policy: 'max_util'"),
    (lambda p: p.update(decoding_mode="greedy"), "parameters.decoding_mode: 'greedy' is not one of"),
    (lambda p: p.update(decoding_mode="lookahead"), "parameters.lookahead_window_size: required"),
    (lambda p: p.update(cross_kv_cache_fraction="0.5"), "set for a decoder-only model"),
    (lambda p: p.update(guided_decoding_backend="xgrammar"), "xgrammar needs xgrammar_tokenizer_info_path"),
    (lambda p: p.update(enable_kv_cache_resue="false"), "parameters.enable_kv_cache_resue: not read"),
    (lambda p: p.update(worker_path="/bin/x"), "use executor_worker_path"),
    (lambda p: p.update(gpt_model_path=""), "'Both encoder and decoder model paths are empty'"),
    (lambda p: p.update(gpu_device_ids="0 1"), "parameters.gpu_device_ids: '0 1'"),
    (lambda p: p.update(max_tokens_in_paged_kv_cache="${max_tokens_in_paged_kv_cache}"), "unfilled template value"),
    (lambda p: p.update(max_attention_window_size="4096;4096"), "parameters.max_attention_window_size: '4096;4096'"),
    (lambda p: p.update(max_attention_window_size=""), "parameters.max_attention_window_size: '' is not a int_csv"),
    (lambda p: p.update(max_attention_window_size="512,0"), "every window must be > 0"),
])
def test_checker_catches(tmp_path, tiny_artifacts, change, expect):
    r = resolve("smollm2-135m-trtllm-tp3")
    eng = tmp_path / "engine"
    eng.mkdir()
    cfg = engine_config(r)
    (eng / "config.json").write_text(json.dumps(cfg))
    write_trtllm_repo(tmp_path / "repo", engine_dir=eng, tokenizer_dir=tiny_artifacts["tokenizer_dir"],
                      engine_config=cfg, triton=r.package.triton.model_dump())
    params = contract.model_parameters(as_json(parse_config(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")))
    assert contract.check_parameters(params) == []
    change(params)
    problems = contract.check_parameters(params)
    assert any(expect in p for p in problems), problems


def test_attention_window_rules():
    assert contract.check_attention_windows("512,512,2048", num_layers=6, max_seq_len=2048) == []
    assert contract.check_attention_windows("4096", num_layers=32, max_seq_len=8192) == []
    assert contract.check_attention_windows(None, num_layers=32, max_seq_len=8192) == []
    p = contract.check_attention_windows("4096", num_layers=32, max_seq_len=2048)
    assert any("clamped" in x for x in p), p
    p = contract.check_attention_windows("512,512,512,512,512,2048", num_layers=18 - 1, max_seq_len=2048)
    assert any("6 windows for 17 layers" in x for x in p), p


def test_model_config_rules():
    base = {"backend": "tensorrtllm", "parameters": {k: {"string_value": v} for k, v in {
        "gpt_model_type": "inflight_fused_batching", "gpt_model_path": "/e", "tokenizer_dir": "",
        "xgrammar_tokenizer_info_path": "", "guided_decoding_backend": ""}.items()},
            "output": [{"name": "output_ids", "data_type": "TYPE_INT32"}, {"name": "sequence_length", "data_type": "TYPE_INT32"}]}
    assert contract.check_model_config(base) == []
    p = contract.check_model_config(base, streaming_input=True)
    assert any("Streaming is only supported if model is deployed using decoupled mode" in x for x in p), p
    assert contract.check_model_config({**base, "model_transaction_policy": {"decoupled": True}}, streaming_input=True) == []
    logits = {**base, "output": base["output"] + [{"name": "context_logits", "data_type": "TYPE_FP32"}]}
    p = contract.check_model_config(logits, engine_logits_dtype="float16")
    assert any("output context_logits: TYPE_FP32 but the engine's logits are float16" in x for x in p), p
    assert contract.check_model_config(logits, engine_logits_dtype="float32") == []
    p = contract.check_model_config({**base, "output": base["output"][:1]})
    assert any("output sequence_length: not declared" in x for x in p), p


def test_bls_calls_every_model_with_decoupled_true():
    """python_backend refuses exec()/async_exec() without decoupled=True into a decoupled model (PYTHON_BACKEND_RULES);
    forge's BLS makes every call that way, which also works for the non-decoupled ONNX Runtime engine."""
    calls = [n for n in ast.walk(ast.parse(BLS_SOURCE.read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("exec", "async_exec")]
    assert calls, "no BLS calls found"
    for c in calls:
        kw = {k.arg: k.value for k in c.keywords}
        assert isinstance(kw.get("decoupled"), ast.Constant) and kw["decoupled"].value is True, ast.unparse(c)
