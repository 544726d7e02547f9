"""The contract of Triton's TensorRT-LLM C++ backend (``backend: "tensorrtllm"``), 1.2 line, as data + a checker.

Test-suite material: forge's generator (pipeline/triton/repo_trtllm.py) does not import it, so the two are
independent transcriptions of the same sources, and every generated ``tensorrt_llm`` repository is checked
against this one. It is also copied into the serving test's stand-in for ``tensorrt_llm``, which refuses to
load a config that breaks it, as the real backend does.

Sources (NVIDIA/TensorRT-LLM, read through the source index; commit per file as the index stores it):
  MIS = triton_backend/inflight_batcher_llm/src/model_instance_state.cc @ c8c6df08bd0ead54cd47f7973e1e425c28a174cd
  MS  = triton_backend/inflight_batcher_llm/src/model_state.cc          @ 5cdd69218f8815d6c8c101ca1facf2ec4ac4b622
  UT  = triton_backend/inflight_batcher_llm/src/utils.cc                @ c8c6df08bd0ead54cd47f7973e1e425c28a174cd
  KV  = cpp/tensorrt_llm/executor/kvCacheConfig.cpp                     @ b35ac1b64368513d215c57d2ed01d62d910df8da
  IFB = cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp  @ b35ac1b64368513d215c57d2ed01d62d910df8da
  TGM = cpp/tensorrt_llm/batch_manager/trtGptModel.h                    @ c8c6df08bd0ead54cd47f7973e1e425c28a174cd
  (tensorrt_llm/version.py @ b35ac1b6 reads "1.2.0rc2". The 1.2 line as Triton ships it:
  triton-inference-server/tensorrtllm_backend 4575a5d "v1.2.0rc7 release" pins TensorRT-LLM a65b0d4e, and
  9e828d3 moves to release/1.2@36e34eeff; those exact trees are not in the index. Of the stored versions of
  model_instance_state.cc, c8c6df08 is the newer; the older 0c8de69a reads the same keys with the same
  required set, and differs only in still honouring enable_trt_overlap.)
  PB  = triton-inference-server/python_backend r25.12 (397eddfcee0bdc6051c4317cea2ff752b79ef9b4):
        src/request_executor.cc RequestExecutor::Infer, src/pb_stub.cc Stub::ProcessReturnedResponses.

How the backend reads a parameter (MS, ModelState::GetParameter): ``parameters[name].string_value``; a
missing key throws "Cannot find parameter with name: <name>". Every read except the REQUIRED ones sits in a
try/catch that logs a warning and keeps a default, so a misspelt bool or int is *silently* the default;
the checker below is therefore stricter than the backend: it accepts only values the backend parses as
meant. Bool spellings (GetParameter<bool>): True true TRUE 1 / False false FALSE 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIS = "model_instance_state.cc@c8c6df08"
MS = "model_state.cc@5cdd6921"
UT = "utils.cc@c8c6df08"
KV = "kvCacheConfig.cpp@b35ac1b6"
IFB = "trtGptModelInflightBatching.cpp@b35ac1b6"
TGM = "trtGptModel.h@c8c6df08"

BOOL_TRUE = ("True", "true", "TRUE", "1")
BOOL_FALSE = ("False", "false", "FALSE", "0")


@dataclass(frozen=True)
class Param:
    name: str
    kind: str                    # string | int | uint | size | float | bool | int_csv | int_csv_groups | int_nested
    required: bool = False       # read with no try/catch: absence fails the model load
    values: tuple = ()           # accepted spellings, when the backend compares strings
    default: str | None = None   # what the backend uses when the key is absent (None: unset / engine's value)
    where: str = ""
    note: str = ""


PARAMETERS: tuple[Param, ...] = (
    # ---- read without a fallback --------------------------------------------------------------------
    Param("gpt_model_type", "string", True, ("V1", "v1", "inflight_batching", "inflight_fused_batching"),
          where=f"{MIS} getBatchingTypeFromParams", note="anything else throws 'Invalid gpt_model_type'"),
    Param("tokenizer_dir", "string", True, where=f"{MIS} getGuidedDecodingConfigFromParams",
          note="ignored by the C++ backend (logged) but must exist; empty allowed"),
    Param("xgrammar_tokenizer_info_path", "string", True, where=f"{MIS} getGuidedDecodingConfigFromParams",
          note="empty (or '${xgrammar_tokenizer_info_path}') = guided decoding off; else the file must exist"),
    Param("guided_decoding_backend", "string", True, ("", "xgrammar", "${guided_decoding_backend}"),
          where=f"{MIS} getGuidedDecodingConfigFromParams",
          note="any other non-empty value with an info path throws"),
    # ---- model paths (try/catch, but an empty decoder and encoder path fails the load) -------------------
    Param("gpt_model_path", "string", where=f"{MIS} ModelInstanceState ctor",
          note="must exist on disk (TLLM_CHECK), else 'Both encoder and decoder model paths are empty'"),
    Param("encoder_model_path", "string", where=f"{MIS} ModelInstanceState ctor", note="encoder-decoder only"),
    # ---- executor config ----------------------------------------------------------------------------------
    Param("max_beam_width", "int", default="1", where=f"{MIS} getExecutorConfigFromParams"),
    Param("iter_stats_max_iterations", "int", where=f"{MIS} getExecutorConfigFromParams"),
    Param("request_stats_max_iterations", "int", where=f"{MIS} getExecutorConfigFromParams"),
    Param("enable_trt_overlap", "bool", where=f"{MIS} getExecutorConfigFromParams", note="deprecated, ignored"),
    Param("normalize_log_probs", "bool", default="true", where=f"{MIS} getExecutorConfigFromParams"),
    Param("enable_chunked_context", "bool", default="false", where=f"{MIS} getExecutorConfigFromParams",
          note="needs paged context FMHA in the engine"),
    Param("decoding_mode", "string", values=("top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter",
                                             "lookahead", "eagle"),
          where=f"{MIS} getExecutorConfigFromParams", note="other values: warning, top_k_top_p / beam_search"),
    Param("medusa_choices", "int_nested", where=f"{MIS} getExecutorConfigFromParams"),
    Param("eagle_choices", "int_nested", where=f"{MIS} getExecutorConfigFromParams"),
    Param("lookahead_window_size", "uint", where=f"{MIS} getExecutorConfigFromParams",
          note="required when decoding_mode is lookahead"),
    Param("lookahead_ngram_size", "uint", where=f"{MIS} getExecutorConfigFromParams",
          note="required when decoding_mode is lookahead"),
    Param("lookahead_verification_set_size", "uint", where=f"{MIS} getExecutorConfigFromParams",
          note="required when decoding_mode is lookahead"),
    Param("gpu_weights_percent", "float", default="1.0", where=f"{MIS} getExecutorConfigFromParams"),
    Param("recv_poll_period_ms", "int", default="0", where=f"{MIS} getExecutorConfigFromParams"),
    # ---- KV cache (getKvCacheConfigFromParams) + executor checks (KvCacheConfig setters) -------------------
    Param("max_tokens_in_paged_kv_cache", "int", where=f"{MIS} getKvCacheConfigFromParams; {KV} setMaxTokens > 0"),
    Param("kv_cache_free_gpu_mem_fraction", "float", default="0.9",
          where=f"{MIS} getKvCacheConfigFromParams; {KV} setFreeGpuMemoryFraction 0 < f < 1"),
    Param("cross_kv_cache_fraction", "float", where=f"{MIS} getKvCacheConfigFromParams; {KV}; {IFB}",
          note="encoder-decoder only: 'Do not set crossKvCacheFraction for decoder-only model'"),
    Param("kv_cache_host_memory_bytes", "size", default="0", where=f"{MIS} getKvCacheConfigFromParams"),
    Param("kv_cache_onboard_blocks", "bool", default="true", where=f"{MIS} getKvCacheConfigFromParams"),
    Param("max_attention_window_size", "int_csv",
          where=f"{MIS} getKvCacheConfigFromParams (GetParameter<std::vector<int32_t>>, {MS} -> {UT} csvStrToVecInt); "
                f"{TGM} TrtGptModel ctor",
          note="one window per attention layer, cycled when the list is shorter; each > 0 (TLLM_CHECK), each capped "
               "at the engine's max_seq_len with a warning; absent = every layer attends to max_seq_len"),
    Param("sink_token_length", "int", where=f"{MIS} getKvCacheConfigFromParams; {KV} > 0"),
    Param("enable_kv_cache_reuse", "bool", default="true", where=f"{MIS} getKvCacheConfigFromParams",
          note="ON when absent; off anyway without paged context FMHA or with context logits ({IFB})"),
    # ---- perf knobs ----------------------------------------------------------------------------------------
    Param("multi_block_mode", "bool", default="true", where=f"{MIS} getExtendedRuntimePerfKnobConfigFromParams"),
    Param("enable_context_fmha_fp32_acc", "bool", default="false",
          where=f"{MIS} getExtendedRuntimePerfKnobConfigFromParams"),
    Param("cuda_graph_mode", "bool", default="false", where=f"{MIS} getExtendedRuntimePerfKnobConfigFromParams"),
    Param("cuda_graph_cache_size", "int", default="0", where=f"{MIS} getExtendedRuntimePerfKnobConfigFromParams"),
    # ---- parallelism -----------------------------------------------------------------------------------------
    Param("gpu_device_ids", "int_csv_groups", where=f"{MS} LoadParameters",
          note="';' separates model instances, ',' the devices of one instance"),
    Param("participant_ids", "int_csv_groups", where=f"{MS} LoadParameters"),
    Param("num_nodes", "int", default="1", where=f"{MIS} getParallelConfigFromParams"),
    Param("executor_worker_path", "string", where=f"{MS} GetExecutorWorkerPath", note="orchestrator mode only"),
    Param("worker_path", "string", where=f"{MS} GetExecutorWorkerPath",
          note="removed: meant to throw, but the throw is swallowed by its own try; use executor_worker_path"),
    # ---- LoRA ------------------------------------------------------------------------------------------------
    Param("lora_cache_max_adapter_size", "int", default="64", where=f"{MIS} getPeftCacheConfigFromParams"),
    Param("lora_cache_optimal_adapter_size", "int", default="8", where=f"{MIS} getPeftCacheConfigFromParams"),
    Param("lora_cache_gpu_memory_fraction", "float", default="0.05", where=f"{MIS} getPeftCacheConfigFromParams"),
    Param("lora_cache_host_memory_bytes", "size", where=f"{MIS} getPeftCacheConfigFromParams"),
    Param("lora_prefetch_dir", "string", where=f"{MIS} getPeftCacheConfigFromParams"),
    # ---- scheduling ------------------------------------------------------------------------------------------
    Param("batch_scheduler_policy", "string", values=("max_utilization", "guaranteed_no_evict"),
          default="guaranteed_no_evict", where=f"{MIS} getSchedulerConfigFromParams",
          note="other values: warning, guaranteed_no_evict"),
    Param("speculative_decoding_fast_logits", "bool", default="false",
          where=f"{MIS} getSpeculativeDecodingConfigFromParams"),
    # ---- per instance (ModelInstanceState ctor) -----------------------------------------------------------
    Param("exclude_input_in_output", "bool", default="false", where=f"{MIS} ModelInstanceState ctor"),
    Param("cancellation_check_period_ms", "int", default="100", where=f"{MIS} ModelInstanceState ctor"),
    Param("stats_check_period_ms", "int", default="100", where=f"{MIS} ModelInstanceState ctor"),
)

BY_NAME = {p.name: p for p in PARAMETERS}
REQUIRED = tuple(p.name for p in PARAMETERS if p.required)

# Model-config facts the backend reads outside `parameters` (MS LoadParameters, MIS, UT).
CONFIG_RULES = (
    ("model_transaction_policy.decoupled", f"{MS} LoadParameters",
     "streaming requests need it ('Streaming is only supported if model is deployed using decoupled mode', "
     f"{UT} createRequestsFromInputTensors), and so does a request with batch > 1 ('Batch size > 1 requires the "
     "tensorrt_llm backend to be using decoupled transaction policy')"),
    ("output context_logits / generation_logits data_type", f"{MS} LoadParameters; {MIS} fillTritonResponse",
     "the first of them declared sets the logits type; TLLM_CHECK that it equals the engine's logits dtype"),
    ("outputs output_ids and sequence_length", f"{MIS} fillTritonResponse",
     "'tensor must be present in list of output tensors' otherwise"),
    ("dynamic_batching.default_queue_policy.max_queue_size", f"{MIS} getExecutorConfigFromParams",
     "optional; the executor's queue bound"),
)

# python_backend (PB) rules the BLS and any python model around a decoupled tensorrt_llm must follow.
PYTHON_BACKEND_RULES = (
    ("BLS exec()/async_exec() into a decoupled model needs decoupled=True",
     "PB src/request_executor.cc RequestExecutor::Infer: \"Model <m> is using the decoupled. The current BLS "
     "request call doesn't support models using the decoupled transaction policy. Please use 'decoupled=True'\""),
    ("a decoupled python model's execute() returns None and answers through its response sender",
     "PB src/pb_stub.cc Stub::ProcessReturnedResponses: \"... is using the decoupled mode and the execute "
     "function must return None.\""),
    ("exec(decoupled=True) also works for a non-decoupled model: one response, flagged final",
     "PB src/request_executor.cc InferResponseComplete (decoupled payload branch)"),
)

_INT = re.compile(r"[+-]?\d+")
_UINT = re.compile(r"\+?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _parses(kind: str, v: str) -> bool:
    if kind == "string":
        return True
    if kind == "bool":
        return v in BOOL_TRUE + BOOL_FALSE
    if kind == "int":
        return bool(_INT.fullmatch(v)) and -2**31 <= int(v) < 2**31
    if kind in ("uint", "size"):
        return bool(_UINT.fullmatch(v))
    if kind == "float":
        return bool(_FLOAT.fullmatch(v))
    if kind == "int_csv":
        return all(_INT.fullmatch(x.strip()) for x in v.split(","))
    if kind == "int_csv_groups":
        return all(all(_INT.fullmatch(x.strip()) for x in g.split(",")) for g in v.split(";"))
    if kind == "int_nested":
        return bool(re.fullmatch(r"\{\s*\{[\d\s,]*\}(\s*,\s*\{[\d\s,]*\})*\s*\}", v))
    raise ValueError(kind)


def as_bool(v: str) -> bool:
    return v in BOOL_TRUE


def check_parameters(params: dict[str, str], *, decoder_only: bool = True) -> list[str]:
    """Problems of a ``parameters`` map (name -> string_value) against the table; [] = loads as meant."""
    p = []
    for name in REQUIRED:
        if name not in params:
            p.append(f"parameters.{name}: missing; the backend reads it without a fallback "
                     f"('Cannot find parameter with name: {name}', {BY_NAME[name].where})")
    for name, v in params.items():
        spec = BY_NAME.get(name)
        if spec is None:
            p.append(f"parameters.{name}: not read by the tensorrtllm backend (a misspelt key is silently ignored)")
            continue
        if "${" in v and name not in ("guided_decoding_backend", "xgrammar_tokenizer_info_path", "tokenizer_dir"):
            p.append(f"parameters.{name}: unfilled template value {v!r}")
            continue
        if not _parses(spec.kind, v):
            p.append(f"parameters.{name}: {v!r} is not a {spec.kind} the backend parses "
                     f"({'/'.join(BOOL_TRUE + BOOL_FALSE) if spec.kind == 'bool' else spec.where}); it would "
                     f"fall back to {spec.default!r}" if not spec.required else f"parameters.{name}: {v!r} unparsable")
            continue
        if spec.values and v not in spec.values:
            p.append(f"parameters.{name}: {v!r} is not one of {', '.join(repr(x) for x in spec.values)} ({spec.where})")
    if "worker_path" in params:
        p.append("parameters.worker_path: removed in the 1.x backend; use executor_worker_path")
    frac = params.get("kv_cache_free_gpu_mem_fraction")
    if frac is not None and _parses("float", frac) and not 0 < float(frac) < 1:
        p.append(f"parameters.kv_cache_free_gpu_mem_fraction: {frac} must be strictly between 0 and 1 ({KV})")
    cross = params.get("cross_kv_cache_fraction")
    if cross is not None and decoder_only:
        p.append(f"parameters.cross_kv_cache_fraction: set for a decoder-only model ({IFB}: 'Do not set "
                 "crossKvCacheFraction for decoder-only model')")
    for name in ("max_tokens_in_paged_kv_cache", "sink_token_length"):
        v = params.get(name)
        if v is not None and _parses("int", v) and int(v) <= 0:
            p.append(f"parameters.{name}: {v} must be > 0 ({KV})")
    win = params.get("max_attention_window_size")
    if win is not None and _parses("int_csv", win) and any(int(x) <= 0 for x in win.split(",")):
        p.append(f"parameters.max_attention_window_size: {win!r}: every window must be > 0 ({TGM}: 'Attention window "
                 "sizes (elements in maxAttentionWindowVec) must be > 0')")
    if params.get("decoding_mode") == "lookahead":
        for name in ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size"):
            if name not in params:
                p.append(f"parameters.{name}: required with decoding_mode lookahead ({MIS})")
    gdb, info = params.get("guided_decoding_backend", ""), params.get("xgrammar_tokenizer_info_path", "")
    if gdb == "xgrammar" and (not info or info.startswith("${")):
        p.append("parameters.guided_decoding_backend: xgrammar needs xgrammar_tokenizer_info_path (a json file)")
    if not params.get("gpt_model_path") and not params.get("encoder_model_path"):
        p.append(f"parameters.gpt_model_path: empty; 'Both encoder and decoder model paths are empty' ({MIS})")
    return p


def model_parameters(cfg: dict) -> dict[str, str]:
    """``parameters`` of a ModelConfig in JSON form (what TRITONBACKEND_ModelConfig hands the backend)."""
    return {k: (v or {}).get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}


def check_attention_windows(value: str | None, *, num_layers: int, max_seq_len: int) -> list[str]:
    """``max_attention_window_size`` against the engine it serves, beyond what the backend rejects: a value the
    runtime silently changes is not what the config says (TGM: entries > max_seq_len are clamped, a list is
    cycled over the layers, so a length that does not divide the layer count shifts the pattern)."""
    if value is None or not _parses("int_csv", value):
        return []
    w = [int(x) for x in value.split(",")]
    p = []
    if any(x > max_seq_len for x in w):
        p.append(f"parameters.max_attention_window_size: entries above the engine's max_seq_len {max_seq_len} are "
                 f"clamped to it ({TGM}: 'cannot exceed mMaxSequenceLen')")
    if len(w) > num_layers or num_layers % len(w):
        p.append(f"parameters.max_attention_window_size: {len(w)} windows for {num_layers} layers; the runtime cycles "
                 f"the list over the layers ({TGM} numRepeatsAttenWindow), give one per layer (or one for all)")
    return p


def check_model_config(cfg: dict, *, engine_logits_dtype: str | None = None, streaming_input: bool = False,
                       decoder_only: bool = True, engine_layers: int | None = None,
                       engine_max_seq_len: int | None = None) -> list[str]:
    """Problems of a whole ``tensorrt_llm`` ModelConfig (JSON form). ``streaming_input``: some front model
    (ensemble/BLS) can send ``streaming=true``; ``engine_logits_dtype``: the engine's logits dtype;
    ``engine_layers`` / ``engine_max_seq_len``: the engine's layer count and max_seq_len (attention windows)."""
    p = []
    if cfg.get("backend") != "tensorrtllm":
        p.append(f"backend: {cfg.get('backend')!r}, expected 'tensorrtllm'")
    params = model_parameters(cfg)
    p += check_parameters(params, decoder_only=decoder_only)
    if engine_layers and engine_max_seq_len:
        p += check_attention_windows(params.get("max_attention_window_size"), num_layers=engine_layers,
                                     max_seq_len=engine_max_seq_len)
    decoupled = bool((cfg.get("model_transaction_policy") or {}).get("decoupled", False))
    if streaming_input and not decoupled:
        p.append(f"model_transaction_policy.decoupled: false, but a front model sends streaming=true "
                 f"({UT}: 'Streaming is only supported if model is deployed using decoupled mode')")
    outs = {o["name"]: o for o in cfg.get("output") or []}
    for name in ("output_ids", "sequence_length"):
        if name not in outs:
            p.append(f"output {name}: not declared ({MIS} fillTritonResponse requires it)")
    logit_outs = [o for o in cfg.get("output") or [] if o["name"] in ("context_logits", "generation_logits")]
    if logit_outs and engine_logits_dtype:
        want = {"float16": "TYPE_FP16", "float32": "TYPE_FP32"}[engine_logits_dtype]
        for o in logit_outs:
            if o.get("data_type") != want:
                p.append(f"output {o['name']}: {o.get('data_type')} but the engine's logits are {engine_logits_dtype} "
                         f"({MIS} fillTritonResponse TLLM_CHECK)")
    return p
