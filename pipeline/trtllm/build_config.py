"""Plan-time validation of a TensorRT-LLM build config and the `trtllm-build` command line.

`trtllm-build` (TensorRT-LLM 1.2.x) silently overrides several options (trtllm-reference.md §2.3):
fused MLP is turned off for INT8/INT4 quantization, paged context FMHA is turned off with an INT8
KV cache, reduce_fusion only exists for Llama-family archs with tp > 1, ... An engine built that way is
not what the recipe says, and runtime features that depend on the overridden option (KV-cache reuse
needs paged context FMHA) fail only at serving time. `validate_build` reports every such conflict at
`forge plan`, each problem naming the recipe key to change, before any GPU work.

Inputs are plain dicts: ``build`` is the recipe's ``build`` section (or its ``tensorrt_llm`` sub-dict),
``quant`` the recipe's ``quantize`` section; keys follow pipeline/targets/tensorrt_llm.py (TrtllmBuild) and pipeline/recipe.py (QuantizeSection).
"""

from __future__ import annotations

from pathlib import Path

from ..modelinfo import ModelInfo
from .families import ARCHITECTURES, family_of
from .quantizers import KV_CACHE_ALGO, QUANTIZERS, effective_group_size

KEY = "build.tensorrt_llm"

# quantize.algo -> checkpoint quant_algo: a view of the quantizers' table (pipeline/trtllm/quantizers.py, the one home)
QUANT_ALGO = {a: q.checkpoint_algo for a, q in QUANTIZERS.items()}
# the SmoothQuant algos: they read quantize.alpha and start from ModelOpt's INT8_SMOOTHQUANT_CFG calibration
SMOOTHQUANT_ALGOS = tuple(a for a, q in QUANTIZERS.items() if q.smoothquant)
SQ_QUANT_ALGOS = {QUANT_ALGO[a] for a in SMOOTHQUANT_ALGOS}
# per-channel k/v weight scales: ModelOpt 0.47's export raises "Duplicating KV heads per-channel scales is not
# supported" (modelopt/torch/export/layer_utils.py build_qkv) when tp > KV heads, for these formats
PER_CHANNEL_KV_ALGOS = SQ_QUANT_ALGOS | {QUANT_ALGO["fp8_pc_pt"]}
# Formats whose TensorRT-LLM module swap replaces Attention, GatedMLP and every RmsNorm but ln_f with quantizing
# versions that have no per-head q/k norms: smooth_quantize_plugin (SmoothQuantAttention) and fp8_rowwise_quantize
# (Fp8RowwiseAttention) in tensorrt_llm/quantization/quantize.py @ 89fd9b7 (index id 235018984); the classes in
# tensorrt_llm/quantization/layers.py (1.x, index id 790827869). Value: the name of the path in messages.
NORM_SWAP_ALGOS = {"int8_sq_per_token": "TensorRT-LLM's SmoothQuant plugin path",
                   "fp8_pc_pt": "TensorRT-LLM's FP8 rowwise path"}
# With an FP8 KV cache trtllm-build keeps paged context FMHA only for these quant_algos ("FP8 Paged Context FMHA is
# disabled because FP8 context FMHA is disabled"; tensorrt_llm/builder.py ``build``, 1.x, index id 205252225)
FP8_CONTEXT_FMHA_ALGOS = ("FP8", "W4A8_AWQ", "NVFP4")

# Archs whose TRT-LLM model implements reduce_fusion (build.py: forced off otherwise).
REDUCE_FUSION_ARCHS = {"LlamaForCausalLM", "Gemma2ForCausalLM", "MedusaForCausalLM"}
SUPPORTED_ARCHS = ARCHITECTURES   # families.py: every family with export, contract and reference numerics
GEMM_PLUGIN_CHOICES = {"auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable"}
ATTN_PLUGIN_CHOICES = {"auto", "float16", "float32", "bfloat16", "int32", "disable"}

# Options passed as `--flag value` and the CLI spelling of each boolean plugin flag.
_INT_ARGS = ["max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width",
             "tokens_per_block", "workers"]
_BOOL_ARGS = ["context_fmha", "use_paged_context_fmha", "remove_input_padding", "use_fused_mlp",
              "reduce_fusion", "user_buffer", "multiple_profiles"]


def _section(build: dict) -> dict:
    """Accept the whole ``build`` section or its ``tensorrt_llm`` sub-dict."""
    if "tensorrt_llm" in build and isinstance(build["tensorrt_llm"], dict):
        return build["tensorrt_llm"]
    return build


def _on(v) -> bool:
    if isinstance(v, str):
        return v.lower() in ("enable", "true", "1", "yes", "on")
    return bool(v)


def quant_algo_of(quant: dict) -> str | None:
    algo = (quant or {}).get("algo") or "none"
    if (quant or {}).get("method") == "none":
        algo = "none"
    return QUANT_ALGO.get(algo, "?")


def kv_cache_algo_of(quant: dict) -> str | None:
    return KV_CACHE_ALGO.get(((quant or {}).get("kv_cache") or "none"), "?")


def validate_build(build: dict, quant: dict, info: ModelInfo, gpu_sm: int | None = None, *,
                   triton: dict | None = None) -> list[str]:
    """All problems of a TRT-LLM build config for ``info`` (empty list = OK); each names the recipe key.

    ``gpu_sm``: compute capability the engine targets (e.g. 90), or None when unknown (SM rules skipped;
    ``build.tensorrt_llm.gpu_sm`` is used when present). ``triton``: the recipe's ``package.triton``
    section, for runtime options that need build options (KV-cache reuse).
    """
    b = _section(build)
    q = quant or {}
    p: list[str] = []
    tp, pp = int(b.get("tp", 1)), int(b.get("pp", 1))
    algo_key = "quantize.algo"
    qalgo = quant_algo_of(q)
    kvalgo = kv_cache_algo_of(q)
    algo = q.get("algo") or "none"
    if gpu_sm is None and b.get("gpu_sm") is not None:
        gpu_sm = int(b["gpu_sm"])

    if qalgo == "?":
        p.append(f"{algo_key}: {algo!r} has no TensorRT-LLM checkpoint format; use one of "
                 f"{', '.join(k for k in QUANT_ALGO)}")
    if kvalgo == "?":
        p.append(f"quantize.kv_cache: {q.get('kv_cache')!r} is not a TensorRT-LLM KV-cache type; use none, int8 or fp8")
    if info.architecture not in SUPPORTED_ARCHS:
        p.append(f"model.source: architecture {info.architecture} is not supported by forge's TensorRT-LLM target "
                 f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))}); use build.target: onnxruntime")
    if info.architecture == "Gemma3ForCausalLM" and b.get("dtype", "float16") == "float16":
        p.append(f"{KEY}.dtype: float16 overflows Gemma 3's residual stream (measured on gemma-3-270m: the fp16 "
                 f"checkpoint's reference numerics reach inf; bf16 is within 0.8 % perplexity of fp32); use bfloat16")
    if b.get("dtype", "float16") not in ("float16", "bfloat16"):
        p.append(f"{KEY}.dtype: {b.get('dtype')!r}; TensorRT-LLM engines are built in float16 or bfloat16")

    # ---- parallelism (§1.6, GQA) ---------------------------------------------------------------
    n, k, layers = info.num_heads, info.num_kv_heads, info.num_layers
    if tp < 1 or pp < 1:
        p.append(f"{KEY}.tp / {KEY}.pp must be >= 1 (got tp={tp}, pp={pp})")
    else:
        if n % tp:
            ok = [t for t in range(1, n + 1) if n % t == 0 and (k % t == 0 or t % k == 0)]
            p.append(f"{KEY}.tp: {tp} does not divide the {n} attention heads of {info.architecture}; "
                     f"valid tp values for this model: {', '.join(map(str, ok))}")
        if k % tp and tp % k:
            p.append(f"{KEY}.tp: {tp} and the model's {k} KV heads (GQA) do not divide each other; TensorRT-LLM "
                     f"splits KV heads across ranks (tp divides {k}) or duplicates them (tp a multiple of {k})")
        elif tp > k and qalgo in PER_CHANNEL_KV_ALGOS:
            p.append(f"{algo_key}: {algo} with {KEY}.tp={tp} > {k} KV heads needs the per-channel k/v weight scales "
                     f"duplicated with the KV heads, which ModelOpt's export does not support; use {KEY}.tp <= {k} "
                     f"or quantize.algo int8_wo / fp8")
        if layers % pp:
            ok = [x for x in range(1, layers + 1) if layers % x == 0]
            p.append(f"{KEY}.pp: {pp} does not divide the {layers} decoder layers (ModelOpt's checkpoint export "
                     f"needs equal stages); valid pp values: {', '.join(map(str, ok[:8]))}")
    if algo in NORM_SWAP_ALGOS and qalgo != "?":
        fam = family_of(info.architecture)
        if fam is not None and (fam.qk_norm or fam.inter_layernorms):
            # the swap replaces every RmsNorm but ln_f, and the swapped attention has no q/k norm (NORM_SWAP_ALGOS)
            norms = " and ".join(n for n, on in (("per-head q/k", fam.qk_norm), ("feed-forward", fam.inter_layernorms))
                                 if on)
            p.append(f"{algo_key}: {algo} is {NORM_SWAP_ALGOS[algo]}, whose attention has no q/k norms and whose "
                     f"norm swap would quantize {info.architecture}'s {norms} norms; use quantize.algo "
                     f"{_NORM_SWAP_INSTEAD[algo]} for this model")
    if algo == "int4_awq":
        p.append(f"{algo_key}: int4_awq (W4A16_AWQ) has no checkpoint contract / reference numerics in forge's "
                 f"TensorRT-LLM target yet; use int4_zp (the same groupwise layout with zero points), int8_sq, "
                 f"int8_wo, int4_wo or fp8")
    if algo == "int4_zp" and tp >= 1:
        p += _groupwise_width_problems(q, info, tp)

    # ---- build-time overrides (§2.3) -----------------------------------------------------------
    fused_mlp = _on(b.get("use_fused_mlp", True))
    if fused_mlp and qalgo not in (None, "FP8", "?"):
        p.append(f"{KEY}.use_fused_mlp: trtllm-build turns fused MLP off for quant_algo {qalgo} "
                 f"(quantize.algo {algo}); set {KEY}.use_fused_mlp: false so the recipe says what is built")
    if _on(b.get("reduce_fusion", False)):
        if tp == 1:
            p.append(f"{KEY}.reduce_fusion: needs {KEY}.tp > 1 (trtllm-build turns it off at tp 1); set it to false")
        if info.architecture not in REDUCE_FUSION_ARCHS:
            p.append(f"{KEY}.reduce_fusion: not implemented for {info.architecture} (only "
                     f"{', '.join(sorted(REDUCE_FUSION_ARCHS))}); set it to false")
    if _on(b.get("user_buffer", False)) and not _on(b.get("reduce_fusion", False)):
        p.append(f"{KEY}.user_buffer: needs {KEY}.reduce_fusion: true (trtllm-build turns user_buffer off without it)")
    ctx_fmha = _on(b.get("context_fmha", True))
    paged_ctx = _on(b.get("use_paged_context_fmha", True))
    kv_type = b.get("kv_cache_type", "paged")
    if paged_ctx and not ctx_fmha:
        p.append(f"{KEY}.use_paged_context_fmha: needs {KEY}.context_fmha: true (turned off without it)")
    if paged_ctx and kvalgo == "INT8":
        p.append(f"{KEY}.use_paged_context_fmha: trtllm-build turns paged context FMHA off with an INT8 KV cache "
                 f"(quantize.kv_cache: int8); set {KEY}.use_paged_context_fmha: false, or use quantize.kv_cache: fp8")
    if paged_ctx and kvalgo == "FP8" and qalgo not in FP8_CONTEXT_FMHA_ALGOS:
        p.append(f"{KEY}.use_paged_context_fmha: trtllm-build turns paged context FMHA off with an FP8 KV cache "
                 f"unless quant_algo is {', '.join(FP8_CONTEXT_FMHA_ALGOS)} (here {qalgo}, quantize.algo {algo}); set "
                 f"{KEY}.use_paged_context_fmha: false so the recipe says what is built")
    if paged_ctx and kv_type != "paged":
        p.append(f"{KEY}.use_paged_context_fmha: needs {KEY}.kv_cache_type: paged (got {kv_type})")
    if triton and _on(triton.get("enable_kv_cache_reuse", False)):
        if not paged_ctx or kvalgo == "INT8" or kv_type != "paged":
            why = ("an INT8 KV cache disables paged context FMHA" if kvalgo == "INT8"
                   else f"the engine needs {KEY}.use_paged_context_fmha: true and {KEY}.kv_cache_type: paged")
            p.append(f"package.triton.enable_kv_cache_reuse: KV-cache reuse needs paged context FMHA, but {why}; "
                     f"set package.triton.enable_kv_cache_reuse: false or change the build")
    if kv_type not in ("paged", "continuous", "disabled"):
        p.append(f"{KEY}.kv_cache_type: {kv_type!r}; use paged, continuous or disabled")
    tpb = int(b.get("tokens_per_block", 32))
    if tpb < 1 or tpb & (tpb - 1):
        p.append(f"{KEY}.tokens_per_block: {tpb} must be a power of 2 (e.g. 32, 64, 128)")
    for key, choices in (("gemm_plugin", GEMM_PLUGIN_CHOICES), ("gpt_attention_plugin", ATTN_PLUGIN_CHOICES)):
        v = b.get(key)
        if v is not None and str(v) not in choices:
            p.append(f"{KEY}.{key}: {v!r}; use one of {', '.join(sorted(choices))}")
    if str(b.get("gemm_plugin", "auto")) == "fp8" and qalgo != "FP8":
        p.append(f"{KEY}.gemm_plugin: fp8 needs quantize.algo: fp8")
    if str(b.get("gpt_attention_plugin", "auto")) == "disable" and kv_type == "paged":
        p.append(f"{KEY}.gpt_attention_plugin: a paged KV cache needs the GPT attention plugin; set it to auto")

    # ---- lengths ---------------------------------------------------------------------------------
    mil, msl = int(b.get("max_input_len", 1024)), int(b.get("max_seq_len", 2048))
    mnt, mbs = int(b.get("max_num_tokens", 8192)), int(b.get("max_batch_size", 8))
    if mil > msl:
        p.append(f"{KEY}.max_input_len: {mil} exceeds {KEY}.max_seq_len {msl} (trtllm-build would clip it); "
                 f"lower max_input_len or raise max_seq_len")
    if msl > info.max_position_embeddings:
        p.append(f"{KEY}.max_seq_len: {msl} exceeds the model's max_position_embeddings "
                 f"{info.max_position_embeddings}; outputs past it are not trained behaviour")
    if not _on(b.get("remove_input_padding", True)) and mnt < mil:
        p.append(f"{KEY}.max_num_tokens: {mnt} < max_input_len {mil}; a full-length prompt could not be scheduled")
    lim, ignored = prompt_limit(b)
    if ignored and mil > lim:
        p.append(f"{KEY}.max_input_len: {mil} is ignored with remove_input_padding + context_fmha; the runtime "
                 f"accepts prompts of at most {lim} tokens = min(max_seq_len - 1, max_num_tokens); "
                 f"raise max_seq_len / max_num_tokens or lower max_input_len")
    if _on(b.get("multiple_profiles", False)) and b.get("opt_num_tokens") is not None:
        p.append(f"{KEY}.opt_num_tokens: cannot be combined with {KEY}.multiple_profiles: true")
    if mbs < 1 or int(b.get("workers", 1)) < 1:
        p.append(f"{KEY}.max_batch_size and {KEY}.workers must be >= 1")

    # ---- hardware (SM) -----------------------------------------------------------------------
    if gpu_sm is not None:
        sm = int(gpu_sm)
        if 100 <= sm < 120:
            # trtllm-build raises for INT8/INT4 weights, INT8 KV, SmoothQuant and per-channel / per-token scaling
            # when 100 <= SM < 120 (tensorrt_llm/builder.py ``build``, 1.x, index id 205252225)
            if qalgo in (*SQ_QUANT_ALGOS, "W8A16", "W4A16", "W4A16_AWQ", QUANT_ALGO["fp8_pc_pt"]):
                p.append(f"{algo_key}: {algo} ({qalgo}) is not supported by TensorRT-LLM on SM {sm} (Blackwell); "
                         f"use quantize.algo fp8")
            if kvalgo == "INT8":
                p.append(f"quantize.kv_cache: int8 is not supported by TensorRT-LLM on SM {sm}; use fp8")
        if qalgo == "W4A16_AWQ" and sm < 80:
            # "Fine grained quanitzation is only supported on Ampere+ GPUs" (fpA_intB_gemm_template.h @ 567239f)
            p.append(f"{algo_key}: {algo} ({qalgo}, groupwise int4) needs SM >= 80 (Ampere); target GPU is SM {sm}: "
                     f"use quantize.algo int8_wo or int4_wo there")
        qz = QUANTIZERS.get("none" if q.get("method") == "none" else algo)
        need = qz.needs_sm(q.get("kv_cache") or "none") if qz is not None and kvalgo != "?" else None
        if need and sm < need:
            p.append(f"{algo_key}/quantize.kv_cache: FP8 needs SM >= {need} (Ada/Hopper); target GPU is SM {sm}: "
                     f"use quantize.algo: int8_sq_per_token with quantize.kv_cache: int8 there (e.g. the qwen7b-int8 / "
                     f"llama3-8b-int8 recipes instead of the -fp8 ones)")
        if sm < 80 and b.get("dtype") == "bfloat16":
            p.append(f"{KEY}.dtype: bfloat16 needs SM >= 80; target GPU is SM {sm}")
    return p


# what to use instead of a NORM_SWAP_ALGOS format on a family it cannot build
_NORM_SWAP_INSTEAD = {"int8_sq_per_token": "int8_sq, int8_wo or fp8", "fp8_pc_pt": "fp8, int8_wo or int4_zp"}


def _groupwise_width_problems(q: dict, info: ModelInfo, tp: int) -> list[str]:
    """int4_zp: every decoder linear's full input and output width must be a multiple of max(64, group) x tp.
    TensorRT-LLM's WeightOnlyGroupwiseQuantLinear / RowLinear pad both to that multiple and then expect padded
    tensors (``multiple = max((128 if use_w4a8_awq else 64), group_size) * tp_size``, layers.py, 1.x, index id
    790827869), which a checkpoint of the model's own widths does not hold."""
    g = effective_group_size("int4_zp", q.get("block_size"), info)
    m = max(64, g) * tp
    n, k, d = info.num_heads, info.num_kv_heads, info.head_dim
    qkv = tp * (n // tp + 2 * -(-k // tp)) * d           # Attention's qkv: tp x local heads (KV heads duplicated)
    widths = {"attention.qkv": (info.hidden_size, qkv), "attention.dense": (n * d, info.hidden_size),
              "mlp.fc / mlp.gate": (info.hidden_size, info.intermediate_size),
              "mlp.proj": (info.intermediate_size, info.hidden_size)}
    bad = [f"{name} {w}" for name, (i, o) in widths.items() for w in (i, o) if w % m]
    if not bad:
        return []
    return [f"quantize.algo: int4_zp with quantize.block_size {g} and {KEY}.tp={tp}: TensorRT-LLM's groupwise int4 "
            f"linears pad every width to a multiple of max(64, block_size) x tp = {m}, and these widths are not "
            f"({', '.join(sorted(set(bad)))}), so the checkpoint would not load; lower {KEY}.tp or "
            f"quantize.block_size"]


def prompt_limit(build: dict) -> tuple[int, bool]:
    """The longest prompt the engine's runtime accepts, and whether ``max_input_len`` is ignored for it.

    With remove_input_padding and context FMHA both on, trtllm-build warns "padding removal and fMHA are both
    enabled, max_input_len is not required and will be ignored" (``tensorrt_llm/builder.py``
    ``_init_max_seq_len``, TRT-LLM 1.x, index id 205252225) and the batch manager sets ``mMaxInputLen =
    std::min(mMaxSequenceLen - 1, mMaxNumTokens)`` ("since context FMHA and usePackedInput are enabled";
    ``cpp/tensorrt_llm/batch_manager/trtGptModel.h``, index ids 625707605 / 36894874673). Otherwise it is the
    engine's max_input_len. (Chunked context would give max_seq_len - 1; forge's Triton repository keeps it off.)
    """
    b = _section(build)
    msl, mnt = int(b.get("max_seq_len", 2048)), int(b.get("max_num_tokens", 8192))
    if _on(b.get("remove_input_padding", True)) and _on(b.get("context_fmha", True)):
        return min(msl - 1, mnt), True
    return int(b.get("max_input_len", 1024)), False


def _default_logits_dtype() -> str:
    from .. import target_registry as registry      # the section's home (pipeline/targets/tensorrt_llm.py); read, not copied
    return registry.get("tensorrt_llm").section.model_fields["logits_dtype"].default


def _flag(v) -> str:
    return "enable" if _on(v) else "disable"


def trtllm_build_args(build: dict, ckpt_dir: str | Path, out_dir: str | Path,
                      timing_cache_in: str | Path | None, timing_cache_out: str | Path | None) -> list[str]:
    """The `trtllm-build` argv for the recipe's ``build.tensorrt_llm`` section (flags of TRT-LLM 1.2, §2.1/2.2).

    tp/pp are not flags: trtllm-build reads the mapping from the checkpoint's config.json.
    """
    b = _section(build)
    args = ["trtllm-build", "--checkpoint_dir", str(ckpt_dir), "--output_dir", str(out_dir)]
    for key in _INT_ARGS:
        if b.get(key) is not None:
            args += [f"--{key}", str(int(b[key]))]
    if b.get("kv_cache_type"):
        args += ["--kv_cache_type", str(b["kv_cache_type"])]
    for key in ("gemm_plugin", "gpt_attention_plugin"):
        if b.get(key) is not None:
            args += [f"--{key}", str(b[key])]
    for key in _BOOL_ARGS:
        if b.get(key) is not None:
            args += [f"--{key}", _flag(b[key])]
    if b.get("opt_num_tokens") is not None:
        args += ["--opt_num_tokens", str(int(b["opt_num_tokens"]))]
    if _on(b.get("gather_context_logits", False)):
        args += ["--gather_context_logits"]
    # Always explicit: the checkpoint's own logits_dtype (ModelOpt writes the model dtype) would otherwise decide.
    # trtllm-build applies it in build_model (model_config.logits_dtype = logits_dtype; tensorrt_llm/commands/build.py
    # @ 65f1d15, choices float16/float32); why float16 is the default: pipeline/targets/tensorrt_llm.py TrtllmBuild.logits_dtype.
    args += ["--logits_dtype", str(b.get("logits_dtype") or _default_logits_dtype())]
    if timing_cache_in is not None:
        args += ["--input_timing_cache", str(timing_cache_in)]
    if timing_cache_out is not None:
        args += ["--output_timing_cache", str(timing_cache_out)]
    args += [str(a) for a in (b.get("extra_args") or [])]
    return args
