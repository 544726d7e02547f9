"""Triton model repository for the ``tensorrt_llm`` target, from forge's own templates.

Layout (trtllm-reference.md §4): ``ensemble``, ``preprocessing``, ``tensorrt_llm`` (C++
``tensorrtllm`` backend, engine files copied to ``tensorrt_llm/1/engine``), ``postprocessing``,
``tensorrt_llm_bls``. Parameters come from the resolved recipe's ``package.triton`` and the engine's
own ``config.json`` (``build_config`` + ``pretrained_config.mapping``); a recipe value that
contradicts the engine is reported by :func:`check_triton_vs_engine` at plan time.

The C++ backend reads ``gpt_model_path`` as an absolute path: it is written for the repository's
location, and :func:`relocate_repo` rewrites it after the repository is moved.

Parameters follow what the ``tensorrtllm`` backend of the TensorRT-LLM 1.2 line reads
(NVIDIA/TensorRT-LLM ``triton_backend/inflight_batcher_llm/src/model_instance_state.cc`` @ c8c6df08,
``model_state.cc`` @ 5cdd6921): ``gpt_model_type``, ``tokenizer_dir``, ``xgrammar_tokenizer_info_path`` and
``guided_decoding_backend`` are read without a fallback (``getBatchingTypeFromParams``,
``getGuidedDecodingConfigFromParams``), so a config without them does not load. Every other key has a
default in the backend; forge writes the ones whose default is not what the recipe means (the backend
turns ``enable_kv_cache_reuse`` ON when the key is absent). ``tests/serving/trtllm_backend_contract.py``
holds the whole table and checks every generated repository against it.

Endpoints: with ``decoupled: true`` the ``tensorrt_llm`` model is decoupled, and Triton makes the ensemble
decoupled too, so the ensemble and the BLS model serve ``/generate`` and ``/generate_stream`` (and gRPC
streaming) but not the KServe ``/infer`` or unary gRPC calls (:func:`pipeline.triton.serve.endpoints`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.errors import ForgeError, RecipeError
from pipeline.trtllm.families import engine_attention_windows
from pipeline.trtllm.memory import engine_kv_cache_max_tokens
from pipeline.triton import templates
from pipeline.triton.pbtxt import params, parse_all_configs, parse_config, tensor, to_pbtxt, write_config

ENGINE_MODEL = "tensorrt_llm"

# tensorrt_llm model inputs beyond the shared engine interface (templates.ENGINE_INPUTS, which has ``streaming``)
_EXTRA_INPUTS = [
    ("beam_width", "TYPE_INT32", [1]), ("len_penalty", "TYPE_FP32", [1]),
    ("repetition_penalty", "TYPE_FP32", [1]), ("min_tokens", "TYPE_INT32", [1]), ("presence_penalty", "TYPE_FP32", [1]),
    ("frequency_penalty", "TYPE_FP32", [1]), ("return_log_probs", "TYPE_BOOL", [1]),
    ("exclude_input_in_output", "TYPE_BOOL", [1]), ("stop_words_list", "TYPE_INT32", [2, -1]),
    ("bad_words_list", "TYPE_INT32", [2, -1]),
]
_EXTRA_OUTPUTS = [("cum_log_probs", "TYPE_FP32", [-1]), ("output_log_probs", "TYPE_FP32", [-1, -1])]


def engine_facts(engine_build: dict) -> dict:
    """Normalise either an engine ``config.json`` (``build_config`` / ``pretrained_config``) or the
    recipe's ``build.tensorrt_llm`` section to the facts the Triton config depends on."""
    bc = engine_build.get("build_config", engine_build)
    plugin = bc.get("plugin_config", {}) or {}
    mapping = (engine_build.get("pretrained_config", {}) or {}).get("mapping", {}) or {}

    def pick(key, default=None):
        for src in (plugin, bc, engine_build):
            if key in src and src[key] is not None:
                return src[key]
        return default

    tp = int(mapping.get("tp_size", pick("tp", 1)))
    pretrained = engine_build.get("pretrained_config", {}) or {}
    pp = int(mapping.get("pp_size", pick("pp", 1)))
    kv = pick("kv_cache_type", "paged")
    kv = {"PAGED": "paged", "CONTINUOUS": "continuous", "DISABLED": "disabled"}.get(str(kv).split(".")[-1].upper(), str(kv).lower())
    if pick("paged_kv_cache") is False:
        kv = "continuous"
    return {
        "max_batch_size": int(pick("max_batch_size", 2048)),
        "max_beam_width": int(pick("max_beam_width", 1)),
        "max_seq_len": pick("max_seq_len"),
        "max_input_len": pick("max_input_len"),
        "context_fmha": bool(pick("context_fmha", True)),
        "use_paged_context_fmha": bool(pick("use_paged_context_fmha", False)),
        "kv_cache_type": kv,
        "tp": tp, "pp": pp, "world_size": int(mapping.get("world_size", tp * pp)),
        # trtllm-build's default is off; the recipe section says it explicitly (TrtllmBuild.gather_context_logits)
        "gather_context_logits": bool(pick("gather_context_logits", False)),
        "logits_dtype": pretrained.get("logits_dtype") or pick("logits_dtype"),
        # per-layer sliding windows (Mistral, Gemma 3) from the engine's own config; None without a window shorter
        # than max_seq_len, and for the recipe section (no pretrained_config)
        "attention_windows": engine_attention_windows(engine_build),
        # max_tokens_in_paged_kv_cache forge writes: what the recipe's worst case needs (the memory plan's KV cache)
        "kv_pool_cap": engine_kv_cache_max_tokens(engine_build),
    }


def check_triton_vs_engine(triton: dict, engine_build: dict) -> list[str]:
    """Plan-time problems, each naming ``package.triton.<key>`` and what to change."""
    e = engine_facts(engine_build)
    t = dict(triton or {})
    problems = []
    paged_ctx = e["context_fmha"] and e["use_paged_context_fmha"] and e["kv_cache_type"] == "paged"
    if t.get("enable_kv_cache_reuse") and not paged_ctx:
        problems.append("package.triton.enable_kv_cache_reuse: true needs an engine built with paged context FMHA "
                        f"(engine: context_fmha={e['context_fmha']}, use_paged_context_fmha={e['use_paged_context_fmha']}, "
                        f"kv_cache_type={e['kv_cache_type']}); set it to false or build with "
                        "build.tensorrt_llm.use_paged_context_fmha: true (and a paged KV cache)")
    if t.get("enable_kv_cache_reuse") and e["gather_context_logits"]:
        # TrtGptModelInflightBatching::fixExecutorConfig (cpp/tensorrt_llm/batch_manager/
        # trtGptModelInflightBatching.cpp @ b35ac1b6): "KV cache reuse disabled because model was built to
        # return context logits" -- a warning at load time, and the recipe would not say what runs.
        problems.append("package.triton.enable_kv_cache_reuse: true, but the engine is built with "
                        "build.tensorrt_llm.gather_context_logits: true, and TensorRT-LLM turns KV-cache reuse off for "
                        "engines that return context logits; set package.triton.enable_kv_cache_reuse: false (the "
                        "validated engine needs context logits) or build without gather_context_logits")
    mbw = t.get("max_beam_width")
    if mbw is not None and int(mbw) != e["max_beam_width"]:
        problems.append(f"package.triton.max_beam_width: {mbw} differs from the engine's max_beam_width "
                        f"{e['max_beam_width']}; leave it unset (it defaults to the engine's) or rebuild with "
                        f"build.tensorrt_llm.max_beam_width: {mbw}")
    mbs = t.get("max_batch_size")
    if mbs is not None and int(mbs) > e["max_batch_size"]:
        problems.append(f"package.triton.max_batch_size: {mbs} exceeds the engine's max_batch_size {e['max_batch_size']}; "
                        f"lower it to <= {e['max_batch_size']} or rebuild with build.tensorrt_llm.max_batch_size: {mbs}")
    ids = t.get("gpu_device_ids")
    if ids is not None:
        ids = list(ids)
        if len(ids) != e["world_size"]:
            problems.append(f"package.triton.gpu_device_ids: {ids} lists {len(ids)} GPU(s) but the engine has "
                            f"tp {e['tp']} x pp {e['pp']} = {e['world_size']} ranks; give exactly one device id per rank")
        if len(set(ids)) != len(ids) or any(int(i) < 0 for i in ids):
            problems.append(f"package.triton.gpu_device_ids: {ids} must be distinct non-negative device ids")
    frac = t.get("kv_cache_free_gpu_mem_fraction")
    if frac is not None and not (0 < float(frac) < 1):
        # KvCacheConfig::setFreeGpuMemoryFraction checks 0 < f < 1 (cpp/tensorrt_llm/executor/kvCacheConfig.cpp @ b35ac1b6)
        problems.append(f"package.triton.kv_cache_free_gpu_mem_fraction: {frac} must be strictly between 0 and 1 "
                        "(TensorRT-LLM's executor rejects 1.0); use e.g. 0.9")
    if t.get("kv_cache_free_gpu_mem_fraction") is not None and e["kv_cache_type"] != "paged" and float(frac) != 0.9:
        problems.append("package.triton.kv_cache_free_gpu_mem_fraction applies to a paged KV cache; the engine's "
                        f"kv_cache_type is {e['kv_cache_type']}: leave it at its default or build with a paged KV cache")
    return problems


def tensorrt_llm_config(t: dict, e: dict, engine_dir: str) -> dict:
    mbs = int(t.get("max_batch_size", 8))
    world = e["world_size"]
    device_ids = t.get("gpu_device_ids") or list(range(world))
    p = dict(
        max_beam_width=int(t.get("max_beam_width") or e["max_beam_width"]),
        gpt_model_type="inflight_fused_batching",
        gpt_model_path=engine_dir,
        batch_scheduler_policy=t.get("batch_scheduler_policy", "guaranteed_no_evict"),
        kv_cache_free_gpu_mem_fraction=float(t.get("kv_cache_free_gpu_mem_fraction", 0.9)),
        enable_kv_cache_reuse=bool(t.get("enable_kv_cache_reuse", False)),
        enable_chunked_context=False,
        exclude_input_in_output=True,
        normalize_log_probs=True,
        gpu_device_ids=",".join(str(i) for i in device_ids),
        num_nodes=1,
        cuda_graph_mode=bool(t.get("cuda_graph_mode", False)),
        decoding_mode="top_k_top_p" if int(t.get("max_beam_width") or e["max_beam_width"]) == 1 else "beam_search",
        # read with no fallback by getGuidedDecodingConfigFromParams: present, empty = guided decoding off
        # (the C++ backend ignores tokenizer_dir; xgrammar needs a tokenizer-info json forge does not write)
        tokenizer_dir="",
        xgrammar_tokenizer_info_path="",
        guided_decoding_backend="",
    )
    cap = e["kv_pool_cap"]
    if cap is not None:
        # getKvCacheConfigFromParams reads it into KvCacheConfig maxTokens (model_instance_state.cc @ c8c6df08); the
        # pool is then min(maxTokens, fraction x free) (kvCacheManager.cpp @ b35ac1b6 calculateMaxNumBlocks), so
        # what the recipe does not need stays free for the buffers the runtime allocates per step after the pool
        # (NCCL's connections; docs/trtllm-memory.md). Without it the pool takes the fraction of all free memory.
        p["max_tokens_in_paged_kv_cache"] = cap
    if world > 1:
        p["participant_ids"] = ",".join(str(r) for r in range(world))
    if e.get("attention_windows"):
        # getKvCacheConfigFromParams reads GetParameter<std::vector<int32_t>>("max_attention_window_size")
        # (model_instance_state.cc @ c8c6df08), which is utils::csvStrToVecInt of the string (model_state.cc @
        # 5cdd6921; utils.cc @ c8c6df08: comma-separated ints, whitespace skipped, empty throws -> caught, unset)
        # into KvCacheConfig's maxAttentionWindowVec: one entry per layer, cycled when shorter (trtGptModel.h).
        p["max_attention_window_size"] = ",".join(str(w) for w in e["attention_windows"])
    inputs = [tensor(n, dt, dims, optional=o) for n, dt, dims, o in templates.ENGINE_INPUTS]
    inputs += [tensor(n, dt, dims, optional=True) for n, dt, dims in _EXTRA_INPUTS]
    for i in inputs:  # per-request scalars reach the backend as scalars
        if i["dims"] == [1] and i["name"] != "input_lengths" and i["name"] != "request_output_len":
            i["reshape"] = {"shape": []}
    for i in inputs:
        if i["name"] in ("input_lengths", "request_output_len"):
            i["reshape"] = {"shape": []}
        if i["name"] == "input_ids":
            i["allow_ragged_batch"] = True
    return {
        "name": ENGINE_MODEL, "backend": "tensorrtllm", "max_batch_size": mbs,
        "model_transaction_policy": {"decoupled": bool(t.get("decoupled", False))},
        "dynamic_batching": {"preferred_batch_size": [mbs],
                             "max_queue_delay_microseconds": int(t.get("max_queue_delay_microseconds", 0)),
                             "default_queue_policy": {"max_queue_size": int(t.get("max_queue_size", 0))}},
        "input": inputs,
        "output": [tensor(n, dt, dims) for n, dt, dims in templates.ENGINE_OUTPUTS + _EXTRA_OUTPUTS],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "parameters": params(**p),
    }


def write_trtllm_repo(out_dir, *, engine_dir, tokenizer_dir, engine_config: dict, triton: dict,
                      add_special_tokens: bool = False) -> dict:
    """Write the repository. ``engine_config`` is the engine's config.json (dict), ``triton`` the
    resolved ``package.triton`` section. Raises RecipeError listing every contradiction."""
    out = Path(out_dir)
    engine_dir = Path(engine_dir)
    problems = check_triton_vs_engine(triton, engine_config)
    if problems:
        raise RecipeError(problems)
    if out.exists() and any(out.iterdir()):
        raise ForgeError(f"{out} is not empty; the package stage writes a fresh repository")
    if not engine_dir.is_dir():
        raise ForgeError(f"engine_dir {engine_dir} does not exist; run the build stage first (trtllm-build)")
    e = engine_facts(engine_config)
    t = dict(triton or {})
    mbs, inst = int(t.get("max_batch_size", 8)), int(t.get("instance_count", 1))
    decoupled = bool(t.get("decoupled", False))
    out.mkdir(parents=True, exist_ok=True)
    templates.write_common(out, Path(tokenizer_dir), mbs, inst, add_special_tokens=add_special_tokens)
    write_config(out / "ensemble", templates.ensemble(mbs, ENGINE_MODEL, streaming=decoupled))
    (out / "ensemble" / "1").mkdir(parents=True, exist_ok=True)
    eng_dst = out / ENGINE_MODEL / "1" / "engine"
    shutil.copytree(engine_dir, eng_dst)
    write_config(out / ENGINE_MODEL, tensorrt_llm_config(t, e, str(eng_dst.resolve())))
    write_config(out / "tensorrt_llm_bls", templates.bls("tensorrt_llm_bls", mbs, ENGINE_MODEL, decoupled=decoupled, instance_count=inst))
    templates.copy_python_model("bls", out / "tensorrt_llm_bls")
    parse_all_configs(out)
    return {"target": "tensorrt_llm", "repo_dir": str(out), "engine_model": ENGINE_MODEL,
            "models": sorted(["ensemble", "preprocessing", ENGINE_MODEL, "postprocessing", "tensorrt_llm_bls"]),
            "engine": e, "triton": t, "world_size": e["world_size"],
            "launch": (f"mpirun -n {e['world_size']} tritonserver --model-repository {out}" if e["world_size"] > 1 else None)}


def relocate_repo(repo_dir) -> bool:
    """Point ``tensorrt_llm``'s ``gpt_model_path`` at this repository's engine folder (after a move)."""
    repo = Path(repo_dir).resolve()
    path = repo / ENGINE_MODEL / "config.pbtxt"
    if not path.exists():
        return False
    cfg = parse_config(path)
    want = str(repo / ENGINE_MODEL / "1" / "engine")
    if cfg.parameters["gpt_model_path"].string_value == want:
        return False
    cfg.parameters["gpt_model_path"].string_value = want
    path.write_text(to_pbtxt(cfg))
    return True


def load_engine_config(engine_dir) -> dict:
    p = Path(engine_dir) / "config.json"
    if not p.exists():
        raise ForgeError(f"{p} missing: trtllm-build writes config.json next to the rank*.engine files")
    return json.loads(p.read_text())
