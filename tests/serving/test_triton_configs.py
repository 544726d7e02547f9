"""Every generated config.pbtxt parses into Triton's ModelConfig; tampering is caught."""

import json
import shutil

import pytest

from pipeline.errors import ForgeError, RecipeError
from pipeline.triton.pbtxt import config_from_dict, parse_all_configs, parse_config, to_pbtxt
from pipeline.triton.repo_trtllm import check_triton_vs_engine, engine_facts, relocate_repo, write_trtllm_repo

ENGINE_CFG = {  # shape of a trtllm-build config.json (only the keys forge reads)
    "pretrained_config": {"architecture": "LlamaForCausalLM", "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1}},
    "build_config": {"max_batch_size": 16, "max_beam_width": 1, "max_seq_len": 2048, "kv_cache_type": "PAGED",
                     "plugin_config": {"context_fmha": True, "use_paged_context_fmha": True}},
}


@pytest.fixture
def trtllm_repo(tiny_artifacts, tmp_path):
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "config.json").write_text(json.dumps(ENGINE_CFG))
    (eng / "rank0.engine").write_bytes(b"not a real engine: layout test only")
    triton = {"max_batch_size": 8, "decoupled": True, "enable_kv_cache_reuse": True, "kv_cache_free_gpu_mem_fraction": 0.8,
              "gpu_device_ids": [2, 3], "cuda_graph_mode": True, "instance_count": 1}
    summary = write_trtllm_repo(tmp_path / "repo", engine_dir=eng, tokenizer_dir=tiny_artifacts["tokenizer_dir"],
                                engine_config=ENGINE_CFG, triton=triton)
    return tmp_path / "repo", summary


def test_onnxruntime_repo_configs_parse(tiny_repo):
    repo, summary = tiny_repo
    cfgs = parse_all_configs(repo)
    assert sorted(cfgs) == summary["models"] == ["bls", "ensemble", "llm_graph", "onnxruntime_llm", "postprocessing", "preprocessing"]
    ens = cfgs["ensemble"]
    assert ens.platform == "ensemble" and ens.max_batch_size == 8
    assert [i.name for i in ens.input][:2] == ["text_input", "max_tokens"]
    assert {o.name for o in ens.output} == {"text_output", "output_ids"}
    assert [s.model_name for s in ens.ensemble_scheduling.step] == ["preprocessing", "onnxruntime_llm", "postprocessing"]
    g = cfgs["llm_graph"]
    assert g.backend == "onnxruntime" and g.max_batch_size == 0 and g.default_model_filename == "model.onnx"
    assert [(i.name, list(i.dims)) for i in g.input] == [("input_ids", [-1, -1])]
    assert [(o.name, list(o.dims)) for o in g.output] == [("logits", [-1, -1, 64])]
    eng = cfgs["onnxruntime_llm"]
    assert eng.backend == "python" and eng.parameters["engine_dir"].string_value == "../llm_graph/1"
    assert eng.parameters["intra_op_threads"].string_value == "1"
    # the engine module and tokenizer are copied in: the repository is self-contained
    assert (repo / "onnxruntime_llm" / "1" / "forge_ort_engine.py").exists()
    assert (repo / "preprocessing" / "1" / "tokenizer" / "tokenizer.json").exists()


def test_trtllm_repo_configs_parse(trtllm_repo):
    repo, summary = trtllm_repo
    cfgs = parse_all_configs(repo)
    assert sorted(cfgs) == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls"]
    t = cfgs["tensorrt_llm"]
    p = {k: v.string_value for k, v in t.parameters.items()}
    assert t.backend == "tensorrtllm" and t.max_batch_size == 8 and t.model_transaction_policy.decoupled
    assert p["gpt_model_type"] == "inflight_fused_batching"
    assert p["max_beam_width"] == "1" and p["enable_kv_cache_reuse"] == "true"
    assert p["kv_cache_free_gpu_mem_fraction"] == "0.8" and p["cuda_graph_mode"] == "true"
    assert p["gpu_device_ids"] == "2,3" and p["participant_ids"] == "0,1"
    assert p["gpt_model_path"] == str((repo / "tensorrt_llm" / "1" / "engine").resolve())
    assert (repo / "tensorrt_llm" / "1" / "engine" / "config.json").exists()
    # scalars are reshaped to [] for the backend, input_ids is ragged
    ins = {i.name: i for i in t.input}
    assert ins["input_lengths"].HasField("reshape") and list(ins["input_lengths"].reshape.shape) == []
    assert ins["input_ids"].allow_ragged_batch
    ens = cfgs["ensemble"]
    assert "stream" in {i.name for i in ens.input}  # decoupled -> streaming input
    assert cfgs["tensorrt_llm_bls"].model_transaction_policy.decoupled
    assert summary["launch"].startswith("mpirun -n 2 ")


def test_relocate_rewrites_engine_path(trtllm_repo, tmp_path):
    repo, _ = trtllm_repo
    moved = tmp_path / "moved"
    shutil.copytree(repo, moved)
    assert relocate_repo(moved) is True
    assert parse_config(moved / "tensorrt_llm" / "config.pbtxt").parameters["gpt_model_path"].string_value == \
        str((moved / "tensorrt_llm" / "1" / "engine").resolve())
    assert relocate_repo(moved) is False


# what python_models/bls.py sends the engine besides its engine_inputs table (preprocessing's outputs)
BLS_FIXED_ENGINE_INPUTS = {"input_ids", "input_lengths", "request_output_len", "end_id", "pad_id"}


def _bls_sends(bls_cfg):
    p = bls_cfg.parameters
    return (set(json.loads(p["preprocessing_inputs"].string_value).values()),
            BLS_FIXED_ENGINE_INPUTS | set(json.loads(p["engine_inputs"].string_value).values()))


@pytest.mark.parametrize("which", ["onnxruntime", "tensorrt_llm"])
def test_decoupled_repo_declares_every_input_the_bls_sends(which, tiny_repo_decoupled, trtllm_repo):
    """Issue 28: the decoupled BLS sent ``streaming`` to onnxruntime_llm, whose config.pbtxt did not declare it
    (HTTP 400 "unexpected inference input"). Each config.pbtxt is read with Triton's ModelConfig protobuf."""
    repo, bls_name, engine = ((tiny_repo_decoupled[0], "bls", "onnxruntime_llm") if which == "onnxruntime"
                              else (trtllm_repo[0], "tensorrt_llm_bls", "tensorrt_llm"))
    cfgs = {d.name: parse_config(d / "config.pbtxt") for d in repo.iterdir() if (d / "config.pbtxt").exists()}
    bls = cfgs[bls_name]
    assert bls.model_transaction_policy.decoupled and cfgs[engine].model_transaction_policy.decoupled
    to_pre, to_engine = _bls_sends(bls)
    assert "streaming" in to_engine and json.loads(bls.parameters["engine_inputs"].string_value)["stream"] == "streaming"
    assert to_pre <= {i.name for i in cfgs["preprocessing"].input}
    assert to_engine <= {i.name for i in cfgs[engine].input}, to_engine - {i.name for i in cfgs[engine].input}
    # the ensemble takes `stream` too and passes it to the engine's `streaming`
    ens = cfgs["ensemble"]
    assert "stream" in {i.name for i in ens.input}
    step = next(s for s in ens.ensemble_scheduling.step if s.model_name == engine)
    assert step.input_map["streaming"] == "stream" and set(step.input_map) <= {i.name for i in cfgs[engine].input}


def test_undeclared_forwarded_input_is_refused(tiny_repo_decoupled, tmp_path):
    """parse_all_configs (run by the writer and by forge serve) names the input a BLS would send undeclared."""
    repo, _ = tiny_repo_decoupled
    bad = tmp_path / "bad"
    shutil.copytree(repo, bad)
    f = bad / "onnxruntime_llm" / "config.pbtxt"
    cfg = parse_config(f)
    keep = [i for i in cfg.input if i.name != "streaming"]
    del cfg.input[:]
    cfg.input.extend(keep)
    f.write_text(to_pbtxt(cfg))
    with pytest.raises(ForgeError, match="bls: forwards 'stream' to onnxruntime_llm input 'streaming', which "
                                         "onnxruntime_llm does not declare"):
        parse_all_configs(bad)


def test_not_decoupled_repo_streams_nothing(tiny_repo):
    """decoupled: false (the default): no model is decoupled and the ensemble takes no `stream`."""
    cfgs = parse_all_configs(tiny_repo[0])
    assert not any(c.model_transaction_policy.decoupled for c in cfgs.values())
    assert not cfgs["onnxruntime_llm"].HasField("model_transaction_policy")
    assert "stream" not in {i.name for i in cfgs["ensemble"].input}


def test_unknown_field_fails(tiny_repo, tmp_path):
    repo, _ = tiny_repo
    bad = tmp_path / "bad"
    shutil.copytree(repo, bad)
    f = bad / "preprocessing" / "config.pbtxt"
    f.write_text(f.read_text() + "\nmax_batch_sise: 4\n")
    with pytest.raises(ForgeError, match=r"preprocessing/config.pbtxt.*max_batch_sise"):
        parse_all_configs(bad)


def test_wrong_type_fails(tiny_repo, tmp_path):
    repo, _ = tiny_repo
    bad = tmp_path / "bad"
    shutil.copytree(repo, bad)
    f = bad / "postprocessing" / "config.pbtxt"
    f.write_text(f.read_text().replace("max_batch_size: 8", 'max_batch_size: "eight"'))
    with pytest.raises(ForgeError, match="postprocessing"):
        parse_all_configs(bad)


def test_ensemble_step_must_match_models(tiny_repo, tmp_path):
    repo, _ = tiny_repo
    bad = tmp_path / "bad"
    shutil.copytree(repo, bad)
    f = bad / "ensemble" / "config.pbtxt"
    f.write_text(f.read_text().replace('key: "QUERY"', 'key: "QUERRY"'))
    with pytest.raises(ForgeError, match="QUERRY"):
        parse_all_configs(bad)
    shutil.rmtree(bad / "postprocessing")
    with pytest.raises(ForgeError, match="'postprocessing', which is not in"):
        parse_all_configs(bad)


def test_name_must_match_folder(tiny_repo, tmp_path):
    repo, _ = tiny_repo
    bad = tmp_path / "bad"
    shutil.copytree(repo, bad)
    (bad / "bls").rename(bad / "bls2")
    with pytest.raises(ForgeError, match="differs from its folder"):
        parse_all_configs(bad)


def test_template_dict_with_typo_is_rejected():
    with pytest.raises(ForgeError, match="max_batch_sise"):
        config_from_dict({"name": "x", "backend": "python", "max_batch_sise": 4})
    with pytest.raises(ForgeError):
        config_from_dict({"name": "x", "input": [{"name": "a", "data_type": "TYPE_NOPE", "dims": [1]}]})


def test_plan_time_checks_name_recipe_keys():
    no_paged = {**ENGINE_CFG, "build_config": {**ENGINE_CFG["build_config"],
                                               "plugin_config": {"context_fmha": True, "use_paged_context_fmha": False}}}
    probs = check_triton_vs_engine({"enable_kv_cache_reuse": True, "max_beam_width": 4, "max_batch_size": 32,
                                    "gpu_device_ids": [0]}, no_paged)
    assert len(probs) == 4
    assert probs[0].startswith("package.triton.enable_kv_cache_reuse") and "use_paged_context_fmha" in probs[0]
    assert probs[1].startswith("package.triton.max_beam_width: 4") and "engine's max_beam_width 1" in probs[1]
    assert probs[2].startswith("package.triton.max_batch_size: 32")
    assert probs[3].startswith("package.triton.gpu_device_ids") and "2 ranks" in probs[3]
    # the same facts from a recipe's build.tensorrt_llm section
    assert check_triton_vs_engine({"enable_kv_cache_reuse": True}, {"tp": 1, "use_paged_context_fmha": True, "max_batch_size": 8}) == []
    assert check_triton_vs_engine({"enable_kv_cache_reuse": True}, {"tp": 1, "use_paged_context_fmha": True,
                                                                    "kv_cache_type": "continuous"})
    assert check_triton_vs_engine({"max_beam_width": None, "max_batch_size": 8, "gpu_device_ids": [0, 1]}, ENGINE_CFG) == []


def test_write_trtllm_refuses_contradiction(tiny_artifacts, tmp_path):
    with pytest.raises(RecipeError, match="package.triton.max_beam_width"):
        write_trtllm_repo(tmp_path / "r", engine_dir=tmp_path, tokenizer_dir=tiny_artifacts["tokenizer_dir"],
                          engine_config=ENGINE_CFG, triton={"max_beam_width": 2})
    assert not (tmp_path / "r").exists()


def test_kv_cache_reuse_refused_for_an_engine_with_context_logits():
    with_logits = {**ENGINE_CFG, "build_config": {**ENGINE_CFG["build_config"], "gather_context_logits": True}}
    probs = check_triton_vs_engine({"enable_kv_cache_reuse": True}, with_logits)
    assert len(probs) == 1 and probs[0].startswith("package.triton.enable_kv_cache_reuse: true, but the engine is built "
                                                   "with build.tensorrt_llm.gather_context_logits: true"), probs
    assert check_triton_vs_engine({"enable_kv_cache_reuse": False}, with_logits) == []
    # the recipe's build section says the same (TrtllmBuild.gather_context_logits defaults to true)
    assert check_triton_vs_engine({"enable_kv_cache_reuse": True},
                                  {"tp": 1, "use_paged_context_fmha": True, "gather_context_logits": True})


@pytest.mark.parametrize("frac", [1.0, 0.0, 1.5])
def test_kv_cache_fraction_strictly_inside_zero_one(frac):
    probs = check_triton_vs_engine({"kv_cache_free_gpu_mem_fraction": frac}, ENGINE_CFG)
    assert any(p.startswith(f"package.triton.kv_cache_free_gpu_mem_fraction: {frac} must be strictly between 0 and 1")
               for p in probs), probs
    assert check_triton_vs_engine({"kv_cache_free_gpu_mem_fraction": 0.95}, ENGINE_CFG) == []


def test_trtllm_config_carries_the_parameters_read_without_fallback(trtllm_repo):
    repo, _ = trtllm_repo
    p = parse_config(repo / "tensorrt_llm" / "config.pbtxt").parameters
    for key in ("gpt_model_type", "tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"):
        assert key in p, key
    assert p["guided_decoding_backend"].string_value == "" and "FORCE_CPU_ONLY_INPUT_TENSORS" not in p


@pytest.mark.parametrize("pretrained,expect", [
    # Gemma 3: global every 3rd layer (max_seq_len 2048 there), window 512 on the others
    ({"architecture": "Gemma3ForCausalLM", "num_hidden_layers": 6, "sliding_window": 512, "_sliding_window_pattern": 3},
     "512,512,2048,512,512,2048"),
    ({"architecture": "MistralForCausalLM", "num_hidden_layers": 3, "sliding_window": 1024}, "1024,1024,1024"),
    ({"architecture": "MistralForCausalLM", "num_hidden_layers": 3, "sliding_window": 4096}, None),  # >= max_seq_len
    ({"architecture": "LlamaForCausalLM", "num_hidden_layers": 3}, None),
])
def test_trtllm_config_sets_attention_windows_from_the_engine(tiny_artifacts, tmp_path, pretrained, expect):
    cfg = {**ENGINE_CFG, "pretrained_config": {**pretrained, "mapping": ENGINE_CFG["pretrained_config"]["mapping"]}}
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "config.json").write_text(json.dumps(cfg))
    write_trtllm_repo(tmp_path / "repo", engine_dir=eng, tokenizer_dir=tiny_artifacts["tokenizer_dir"],
                      engine_config=cfg, triton={"gpu_device_ids": [0, 1]})
    p = parse_config(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").parameters
    if expect is None:
        assert "max_attention_window_size" not in p
    else:
        assert p["max_attention_window_size"].string_value == expect
    # the recipe's build section has no pretrained config: plan-time facts carry no windows
    assert engine_facts({"tp": 2, "max_seq_len": 2048})["attention_windows"] is None


def test_free_port_leaves_the_ephemeral_range_and_checks_the_whole_span(monkeypatch):
    """`forge serve --port P` binds P, P+1 and P+2. A port from bind(0) lies in the kernel's ephemeral range, where an
    outgoing connection made before the server binds (a package fetched from S3) can take it: a CI run lost its
    serve port that way (tests/scaleout/test_remote_cache.py)."""
    import socket

    from pipeline.triton import serve

    monkeypatch.setattr(serve, "_ephemeral_range", lambda: (32768, 60999))
    for _ in range(20):
        p = serve.free_port(3)
        assert serve.LOWEST_PICKED_PORT <= p and p + 2 < 32768 and not 10002 <= p <= 19999   # not Ray's worker ports
        assert not any(serve.port_in_use(p + i) for i in range(3))
    # a taken port inside the span is never handed out: hold P+1 of the next pick's candidates
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    monkeypatch.setattr(serve, "_ephemeral_range", lambda: None)      # where the range cannot be read: bind(0)
    try:
        for _ in range(20):
            p = serve.free_port(3)
            assert taken not in (p, p + 1, p + 2)
            assert not any(serve.port_in_use(p + i) for i in range(3))
    finally:
        held.close()
