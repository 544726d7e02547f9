"""Contract check of a written TensorRT-LLM checkpoint against what TensorRT-LLM 1.2 loads.

Encodes trtllm-reference.md §1: config.json fields (§1.2), mapping and one ``rank{N}.safetensors`` per
rank (§1.1, §1.3), tensor names per rank for Llama/Qwen2 with PP-local layer indices (§1.5), per-rank
shapes from the TP split rules incl. GQA KV-head duplication and lm_head vocab padding (§1.6), and the
quantization tensors per ``quant_algo`` (§1.7–1.10, ModelOpt layout). Shapes and dtypes are read from the
safetensors headers (no weights loaded); only the small ``*scaling_factor`` tensors are read, to check
they are finite and positive.

TensorRT-LLM itself raises on missing tensors and only warns on extra ones; here an unexpected tensor is
a violation too, because a misspelt name shows up as one missing plus one unexpected tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from .families import ARCHITECTURES, GEMMA3_FIELDS, family_of

ARCHS = set(ARCHITECTURES)
QWEN_ARCHS = {a for a in ARCHITECTURES if family_of(a).qwen}
QWEN_TYPES = ("qwen", "qwen2", "qwen2_moe", "qwen2_llava_onevision", "qwen2_vl", "qwen2_audio", "qwen3", "qwen3_moe")
QUANT_ALGOS = {None, "W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL",
               "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
               "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN", "FP8",
               "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "NVFP4", "MIXED_PRECISION"}
# Algos whose per-tensor layout this module encodes exactly; others fail the check as unsupported.
CHECKED_ALGOS = {None, "W8A16", "W4A16", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
                 "FP8", "FP8_PER_CHANNEL_PER_TOKEN"}
# quant_algos whose layers replace the attention and the norms with versions without q/k norms (build_config.py
# NORM_SWAP_ALGOS): no Qwen3 / Gemma 3 checkpoint of them loads
NORM_SWAP_QUANT_ALGOS = ("W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "FP8_PER_CHANNEL_PER_TOKEN")
KV_ALGOS = {None, "INT8", "FP8", "NVFP4"}
ST_DTYPE = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}

REQUIRED_FIELDS = {"architecture": str, "dtype": str, "hidden_size": int, "num_hidden_layers": int,
                   "num_attention_heads": int, "num_key_value_heads": int, "vocab_size": int, "hidden_act": str,
                   "norm_epsilon": (int, float), "position_embedding_type": str, "max_position_embeddings": int,
                   "intermediate_size": int, "head_size": int, "rotary_base": (int, float), "mapping": dict,
                   "quantization": dict}

LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
ROW_LINEARS = {"attention.dense", "mlp.proj"}

RULE_QKV = "§1.6 qkv: column-parallel, per rank [q_r; k_r; v_r], KV heads duplicated to tp when kv_heads < tp"
RULE_ROW = "§1.6 row-parallel (dense/proj): split on dim 1 (input features)"
RULE_COL = "§1.6 column-parallel (fc/gate): split on dim 0 (output features)"
RULE_VOCAB = "§1.6 vocab padded to a multiple of tp (zero rows), then split on dim 0"
RULE_NORM = "§1.6 layer norms are not split"
RULE_SQ = "§1.9 W8A8_SQ_PER_CHANNEL (ModelOpt): int8 weight (out,in), fp32 weights_scaling_factor (out,), " \
          "fp32 activation_scaling_factor (1,), prequant_scaling_factor (in,) in model dtype"
RULE_SQ_PT = "§1.8 W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN (sq_per_token.py): int8 weight (out,in), fp32 " \
             "per_channel_scale (1,out), fp32 smoother (1,in) on dense/proj, norm scale_to_int (1,) in model dtype; " \
             "no act_scale (layers.py SmoothQuantLinear/RowLinear/RmsNorm, index id 790827869)"
RULE_WO = "§1.7 weight-only: float weight (trtllm-build quantizes) or int8 (in, out*bits/8) + per_channel_scale"
RULE_FP8 = "§1.10 FP8: fp8 weight (out,in), fp32 weights/activation_scaling_factor (1,)"
RULE_FP8_PC_PT = "§1.10 FP8_PER_CHANNEL_PER_TOKEN (rowwise): fp8 weight (out,in), fp32 per_channel_scale (out,), no " \
                 "activation scale (per token at run time); norms unchanged (layers.py Fp8RowwiseLinear/RowLinear/" \
                 "RmsNorm, index id 790827869)"
RULE_META = "§1.10 FP8_PER_CHANNEL_PER_TOKEN with use_meta_recipe: attention linears of every layer and all linears " \
            "of the first and last layers in the model dtype, no per_channel_scale (quantize.py fp8_rowwise_quantize)"
RULE_ZP = "int4_zp.py W4A16_AWQ groupwise int4: int8 weight (out/2,in) (two int4 codes per byte), " \
          "weights_scaling_factor (out,in/g), zero (in/g,out) in model dtype when has_zero_point, " \
          "prequant_scaling_factor (in,) when pre_quant_scale (layers.py WeightOnlyGroupwiseQuantLinear, " \
          "modeling_utils.py preprocess_perlayer_weights)"
RULE_KV = "§1.10 KV-cache quantization: attention.kv_cache_scaling_factor fp32 (1,)"
RULE_QK = "families.py: Qwen3 / Gemma 3 attention.q_layernorm / k_layernorm, RMSNorm over head_size, not split"
RULE_GEMMA = "families.py: Gemma 3 inter_layernorms (pre/post_feedforward_layernorm), not split"
RULE_PP = "§1.3/§1.5 PP: layers tensor_split over pp ranks, local indices; embedding on the first, ln_f/lm_head on the last stage"


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """TRT-LLM Mapping.pp_layers: torch.tensor_split(arange(L), pp) (first L % pp stages get one more)."""
    parts = torch.tensor_split(torch.arange(num_layers), pp)
    return [range(int(p[0]), int(p[-1]) + 1) if len(p) else range(0) for p in parts]


def _pad(v: int, t: int) -> int:
    return -(-v // t) * t


def expected_tensors(cfg: dict, rank: int) -> dict[str, tuple[tuple[int, ...] | None, set[str], str, bool]]:
    """Tensors ``rank`` must hold: name -> (shape or None = unchecked, allowed dtypes, rule, required)."""
    H, N = cfg["hidden_size"], cfg["num_attention_heads"]
    K = cfg.get("num_key_value_heads") or N
    D = cfg.get("head_size") or H // N
    I, V, L = cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    m = cfg.get("mapping") or {}
    T, P = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
    tp_rank, pp_rank = rank % T, rank // T
    dt = {ST_DTYPE[cfg["dtype"]]}
    q = cfg.get("quantization") or {}
    algo, kv = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    arch = cfg["architecture"]
    qwen = arch in QWEN_ARCHS
    fam = family_of(arch)
    attn_bias = bool(cfg.get("attn_bias", qwen))  # QWenConfig default True, LLaMAConfig default False
    mlp_bias = bool(cfg.get("mlp_bias", False))

    def meta_float(layer: int, lin: str) -> bool:
        """use_meta_recipe: attention of every layer and the first and last layers stay in the model dtype."""
        return bool(q.get("use_meta_recipe")) and (lin.startswith("attention") or layer in (0, L - 1))

    kv_local = max(K, T) // T
    q_local = N // T
    qkv_out = (q_local + 2 * kv_local) * D
    exp: dict[str, tuple] = {}

    def add(name, shape, dtypes, rule, required=True):
        exp[name] = (tuple(shape) if shape is not None else None, set(dtypes), rule, required)

    if pp_rank == 0:
        if cfg.get("use_parallel_embedding", False):
            if int(cfg.get("embedding_sharding_dim", 0)) == 0:
                add("transformer.vocab_embedding.weight", (_pad(V, T) // T, H), dt, RULE_VOCAB)
            else:
                add("transformer.vocab_embedding.weight", (V, H // T), dt, "§1.6 embedding split on dim 1")
        else:
            add("transformer.vocab_embedding.weight", (V, H), dt, "§1.6 embedding replicated")
    if pp_rank == P - 1:
        add("transformer.ln_f.weight", (H,), dt, RULE_NORM)
        # lm_head may be absent when it can be shared with vocab_embedding on the same rank (§1.1)
        shared_ok = P == 1 and (cfg.get("share_embedding_table") or cfg.get("tie_word_embeddings"))
        add("lm_head.weight", (_pad(V, T) // T, H), dt, RULE_VOCAB, required=not shared_ok)

    dims = {  # name -> (out_local, in_local, rule)
        "attention.qkv": (qkv_out, H, RULE_QKV),
        "attention.dense": (H, q_local * D, RULE_ROW),
        "mlp.fc": (I // T, H, RULE_COL),
        "mlp.gate": (I // T, H, RULE_COL),
        "mlp.proj": (H, I // T, RULE_ROW),
    }
    layers = pp_layer_ranges(L, P)[pp_rank]
    for local in range(len(layers)):
        pre = f"transformer.layers.{local}."
        add(pre + "input_layernorm.weight", (H,), dt, RULE_NORM)
        add(pre + "post_layernorm.weight", (H,), dt, RULE_NORM)
        if algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":
            add(pre + "input_layernorm.scale_to_int", (1,), dt, RULE_SQ_PT)
            add(pre + "post_layernorm.scale_to_int", (1,), dt, RULE_SQ_PT)
        if fam is not None and fam.qk_norm:
            add(pre + "attention.q_layernorm.weight", (D,), dt, RULE_QK)
            add(pre + "attention.k_layernorm.weight", (D,), dt, RULE_QK)
        if fam is not None and fam.inter_layernorms:
            add(pre + "pre_feedforward_layernorm.weight", (H,), dt, RULE_GEMMA)
            add(pre + "post_feedforward_layernorm.weight", (H,), dt, RULE_GEMMA)
        if attn_bias:
            add(pre + "attention.qkv.bias", (qkv_out,), dt, RULE_QKV)
            if not qwen:
                add(pre + "attention.dense.bias", (H,), dt, "§1.5 dense bias (attn_bias), not split")
        if mlp_bias:
            add(pre + "mlp.fc.bias", (I // T,), dt, RULE_COL)
            add(pre + "mlp.gate.bias", (I // T,), dt, RULE_COL)
            add(pre + "mlp.proj.bias", (H,), dt, "§1.5 proj bias, not split")
        for lin, (o, i, rule) in dims.items():
            w = pre + lin + ".weight"
            if algo is None:
                add(w, (o, i), dt, rule)
            elif algo == "W8A8_SQ_PER_CHANNEL":
                add(w, (o, i), {"I8"}, f"{rule}; {RULE_SQ}")
                add(pre + lin + ".weights_scaling_factor", (o,), {"F32"}, RULE_SQ)
                add(pre + lin + ".activation_scaling_factor", (1,), {"F32"}, RULE_SQ)
                add(pre + lin + ".prequant_scaling_factor", (i,), dt, f"{RULE_SQ}; row-parallel: split with the input")
            elif algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":
                add(w, (o, i), {"I8"}, f"{rule}; {RULE_SQ_PT}")
                add(pre + lin + ".per_channel_scale", (1, o), {"F32"}, RULE_SQ_PT)
                if lin in ROW_LINEARS:
                    add(pre + lin + ".smoother", (1, i), {"F32"}, f"{RULE_SQ_PT}; row-parallel: split with the input")
            elif algo in ("W8A16", "W4A16"):
                add(w, None, dt | {"I8"}, f"{rule}; {RULE_WO}")  # shape depends on the form, checked below
                add(pre + lin + ".per_channel_scale", (o,), dt, RULE_WO, required=False)
            elif algo == "FP8":
                add(w, (o, i), {"F8_E4M3", "I8"}, f"{rule}; {RULE_FP8}")
                add(pre + lin + ".weights_scaling_factor", (1,), {"F32"}, RULE_FP8)
                add(pre + lin + ".activation_scaling_factor", (1,), {"F32"}, RULE_FP8)
            elif algo == "FP8_PER_CHANNEL_PER_TOKEN" and meta_float(layers[local], lin):
                add(w, (o, i), dt, f"{rule}; {RULE_META}")
            elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
                add(w, (o, i), {"F8_E4M3", "I8"}, f"{rule}; {RULE_FP8_PC_PT}")
                add(pre + lin + ".per_channel_scale", (o,), {"F32"}, RULE_FP8_PC_PT)
            elif algo == "W4A16_AWQ":
                g = int(q.get("group_size") or 128)
                add(w, (o // 2, i), {"I8"}, f"{rule}; {RULE_ZP}")
                add(pre + lin + ".weights_scaling_factor", (o, i // g), dt | {"F32"}, RULE_ZP)
                if q.get("has_zero_point"):
                    add(pre + lin + ".zero", (i // g, o), dt, RULE_ZP)
                if q.get("pre_quant_scale"):
                    add(pre + lin + ".prequant_scaling_factor", (i,), dt, f"{RULE_ZP}; row-parallel: split with the input")
        if kv in ("INT8", "FP8"):
            add(pre + "attention.kv_cache_scaling_factor", (1,), {"F32"}, RULE_KV)
            add(pre + "attention.k_cache_scaling_factor", (1,), {"F32"}, RULE_KV, required=False)
            add(pre + "attention.v_cache_scaling_factor", (1,), {"F32"}, RULE_KV, required=False)
            add(pre + "attention.kv_cache_rcp_scaling_factor", (1,), {"F32"}, RULE_KV, required=False)
    return exp


def _config_problems(cfg: dict) -> list[str]:
    p = []
    for k, typ in REQUIRED_FIELDS.items():
        if k not in cfg or cfg[k] is None:
            why = " (absent: TensorRT-LLM would use its default rotary_base 10000)" if k == "rotary_base" else ""
            p.append(f"config.json: required field {k!r} missing{why} (rule §1.2)")
        elif not isinstance(cfg[k], typ) or isinstance(cfg[k], bool):
            p.append(f"config.json: field {k!r} has type {type(cfg[k]).__name__} (rule §1.2)")
    if p:
        return p
    if cfg["architecture"] not in ARCHS:
        p.append(f"config.json: architecture {cfg['architecture']!r} is not one forge checks "
                 f"({', '.join(sorted(ARCHS))}) (rule §1.2 MODEL_MAP)")
    if cfg["dtype"] not in ST_DTYPE:
        p.append(f"config.json: dtype {cfg['dtype']!r} not in float16/bfloat16/float32 (rule §1.2)")
    if cfg["architecture"] in QWEN_ARCHS and cfg.get("qwen_type") not in QWEN_TYPES:
        p.append(f"config.json: qwen_type {cfg.get('qwen_type')!r} missing or invalid; TensorRT-LLM's QWen model needs "
                 f"one of {', '.join(QWEN_TYPES)} (rule §1.2 QWenConfig / §3 fix-ups)")
    if cfg["architecture"] == "Qwen3ForCausalLM" and cfg.get("qwen_type") not in ("qwen3", "qwen3_moe"):
        p.append(f"config.json: qwen_type {cfg.get('qwen_type')!r} for Qwen3ForCausalLM; TensorRT-LLM builds the "
                 f"q/k layernorms only for qwen3/qwen3_moe (families.py: QWenDecoderLayer qk_layernorm)")
    if cfg["architecture"] == "Gemma3ForCausalLM":
        for k in GEMMA3_FIELDS:
            if k not in cfg:
                p.append(f"config.json: Gemma3 field {k!r} missing (families.py: Gemma3ConfigGroup, all required)")
        if cfg.get("query_pre_attn_scalar") is None:
            p.append("config.json: query_pre_attn_scalar is null; GemmaConfig asserts it is set for Gemma3")
        if not cfg.get("_sliding_window_pattern"):
            p.append("config.json: _sliding_window_pattern must be >= 1 (GemmaDecoderLayer: (i + 1) % pattern)")
        tp = int((cfg.get("mapping") or {}).get("tp_size", 1))
        if bool(cfg.get("use_parallel_embedding", False)) != (tp > 1):
            p.append(f"config.json: use_parallel_embedding {cfg.get('use_parallel_embedding')} but GemmaConfig "
                     f"forces it to tp_size > 1 ({tp > 1}); the tensors must follow (families.py)")
    sw = cfg.get("sliding_window")
    if sw is not None and (not isinstance(sw, int) or isinstance(sw, bool) or sw < 1):
        p.append(f"config.json: sliding_window {sw!r} must be a positive integer or absent")
    if cfg["position_embedding_type"] != "rope_gpt_neox":
        p.append(f"config.json: position_embedding_type {cfg['position_embedding_type']!r} != 'rope_gpt_neox' "
                 f"for Llama/Qwen2 (rule §1.2)")
    if not cfg["rotary_base"] > 0:
        p.append(f"config.json: rotary_base {cfg['rotary_base']} must be > 0 (rule §1.2)")
    rs = cfg.get("rotary_scaling")
    if rs is not None and (not isinstance(rs, dict) or rs.get("type", rs.get("rope_type")) in (None, "default")):
        p.append(f"config.json: rotary_scaling {rs!r} must be null or a dict with a non-default 'type' (rule §3)")
    m = cfg["mapping"]
    T, P = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
    cp = int(m.get("cp_size", 1))
    ws = int(m.get("world_size", T * P * cp))
    if T * P * cp != ws:
        p.append(f"config.json: mapping tp_size*pp_size*cp_size = {T * P * cp} != world_size {ws} (rule §1.3)")
    if cp != 1:
        p.append("config.json: mapping cp_size != 1 is not produced or checked by forge (rule §1.3)")
    N, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if N % T:
        p.append(f"config.json: num_attention_heads {N} not divisible by tp_size {T} (rule §1.6)")
    if K % T and T % K:
        p.append(f"config.json: num_key_value_heads {K} and tp_size {T} do not divide each other (rule §1.6 dup_kv_weight)")
    if N * cfg["head_size"] != cfg["hidden_size"] and cfg["architecture"] == "LlamaForCausalLM" and "head_dim" not in cfg:
        pass  # head_size may differ from H/N; shapes below use head_size
    if cfg["intermediate_size"] % T:
        p.append(f"config.json: intermediate_size {cfg['intermediate_size']} not divisible by tp_size {T} (rule §1.6)")
    if cfg["num_hidden_layers"] < P:
        p.append(f"config.json: num_hidden_layers {cfg['num_hidden_layers']} < pp_size {P} (rule §1.3)")
    q = cfg["quantization"]
    if q.get("quant_algo") not in QUANT_ALGOS:
        p.append(f"config.json: quantization.quant_algo {q.get('quant_algo')!r} is not a TensorRT-LLM QuantAlgo (rule §1.4)")
    elif q.get("quant_algo") not in CHECKED_ALGOS:
        p.append(f"config.json: quantization.quant_algo {q.get('quant_algo')} has no tensor contract in forge "
                 f"(checked: {', '.join(sorted(a for a in CHECKED_ALGOS if a))}, none) (rule §1.4)")
    fam = family_of(cfg["architecture"])
    if q.get("quant_algo") in NORM_SWAP_QUANT_ALGOS and fam is not None and (fam.qk_norm or fam.inter_layernorms):
        rule = RULE_SQ_PT if q["quant_algo"].startswith("W8A8") else RULE_FP8_PC_PT
        p.append(f"config.json: quant_algo {q['quant_algo']} for {cfg['architecture']}: its module swap has no q/k "
                 f"or feed-forward norms (rule {rule})")
    if q.get("quant_algo") == "W4A16_AWQ":
        p += _groupwise_problems(cfg, q)
    if q.get("kv_cache_quant_algo") not in KV_ALGOS:
        p.append(f"config.json: quantization.kv_cache_quant_algo {q.get('kv_cache_quant_algo')!r} not in "
                 f"FP8/INT8/NVFP4/null (rule §1.4 KV_CACHE_QUANT_ALGO_LIST)")
    return p


def _groupwise_problems(cfg: dict, q: dict) -> list[str]:
    """W4A16_AWQ: the group sizes the fine-grained GEMM takes, and widths the groupwise layers do not pad."""
    from .quantizers import GROUPWISE_SIZES
    g = q.get("group_size", 128)
    if g not in GROUPWISE_SIZES:
        return [f"config.json: quantization.group_size {g!r}: TensorRT-LLM's groupwise int4 GEMM takes "
                f"{' or '.join(map(str, GROUPWISE_SIZES))} (fpA_intB_gemm_template.h @ 567239f) (rule {RULE_ZP})"]
    T = int((cfg.get("mapping") or {}).get("tp_size", 1))
    H, N, I = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
    K, D = cfg.get("num_key_value_heads") or N, cfg.get("head_size") or H // N
    m = max(64, g) * T
    widths = {H, N * D, I, T * (N // T + 2 * (max(K, T) // T)) * D}
    bad = sorted(w for w in widths if w % m)
    if bad:
        return [f"config.json: widths {bad} are not multiples of max(64, group_size) x tp_size = {m}: "
                f"WeightOnlyGroupwiseQuantLinear pads them and would not load these tensors (rule {RULE_ZP})"]
    return []


def check_contract(ckpt_dir: str | Path, *, hf_config: dict | None = None) -> list[str]:
    """Violations of the TRT-LLM 1.2 checkpoint contract in ``ckpt_dir`` (empty list = OK).

    ``hf_config`` (the source HF config.json as a dict), when given, is also checked against the fields the
    fix-ups derive from it (rotary_base, norm_epsilon, vocab/head counts).
    """
    ckpt = Path(ckpt_dir)
    cfg_path = ckpt / "config.json"
    if not cfg_path.exists():
        return [f"{cfg_path}: missing (rule §1.1: a checkpoint dir holds config.json + rank{{N}}.safetensors)"]
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        return [f"{cfg_path}: not valid JSON ({e})"]
    problems = _config_problems(cfg)
    if problems:
        return problems
    if hf_config is not None:
        problems += _hf_problems(cfg, hf_config)
    m = cfg["mapping"]
    ws = int(m.get("world_size", int(m.get("tp_size", 1)) * int(m.get("pp_size", 1))))
    present = {int(f.stem[4:]) for f in ckpt.glob("rank*.safetensors") if f.stem[4:].isdigit()}
    for r in sorted(set(range(ws)) - present):
        problems.append(f"rank{r}.safetensors: missing; mapping.world_size is {ws} (rule §1.1: one file per rank)")
    for r in sorted(present - set(range(ws))):
        problems.append(f"rank{r}.safetensors: unexpected; mapping.world_size is {ws} (rule §1.1)")
    for r in sorted(present & set(range(ws))):
        problems += _rank_problems(ckpt / f"rank{r}.safetensors", cfg, r)
    return problems


def _hf_problems(cfg: dict, hf: dict) -> list[str]:
    from ..modelinfo import ModelInfo
    info = ModelInfo.from_hf_config(hf)
    p = []
    checks = [("rotary_base", float(cfg.get("rotary_base", 0)), info.rope_theta),
              ("norm_epsilon", float(cfg.get("norm_epsilon", 0)), info.rms_norm_eps),
              ("vocab_size", cfg["vocab_size"], info.vocab_size),
              ("num_key_value_heads", cfg["num_key_value_heads"], info.num_kv_heads),
              ("num_attention_heads", cfg["num_attention_heads"], info.num_heads),
              ("intermediate_size", cfg["intermediate_size"], info.intermediate_size),
              ("num_hidden_layers", cfg["num_hidden_layers"], info.num_layers)]
    for k, got, want in checks:
        if not math.isclose(float(got), float(want), rel_tol=1e-9):
            p.append(f"config.json: {k} {got} != source model's {want} (rule §1.2/§3: the config keeps the HF values)")
    if cfg["architecture"] != info.architecture:
        p.append(f"config.json: architecture {cfg['architecture']} != source {info.architecture} (rule §3 fix-up)")
    return p


def _rank_problems(path: Path, cfg: dict, rank: int) -> list[str]:
    p = []
    exp = expected_tensors(cfg, rank)
    algo = (cfg.get("quantization") or {}).get("quant_algo")
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for name, (shape, dtypes, rule, required) in exp.items():
            if name not in names:
                if required:
                    p.append(f"{path.name}: {name}: required tensor missing (rule {rule})")
                continue
            sl = f.get_slice(name)
            got_shape, got_dt = tuple(sl.get_shape()), sl.get_dtype()
            if got_dt not in dtypes:
                p.append(f"{path.name}: {name}: dtype {got_dt} not in {sorted(dtypes)} (rule {rule})")
            if shape is not None and got_shape != shape:
                p.append(f"{path.name}: {name}: shape {list(got_shape)} != expected {list(shape)} (rule {rule})")
            if name.endswith(("scaling_factor", "per_channel_scale", "smoother", "scale_to_int")):
                t = f.get_tensor(name).float()
                if not torch.isfinite(t).all() or not (t > 0).all():
                    bad = int((~torch.isfinite(t) | (t <= 0)).sum())
                    p.append(f"{path.name}: {name}: {bad} scale value(s) not finite and > 0 (rule {rule})")
        if algo in ("W8A16", "W4A16"):
            p += _weight_only_forms(f, path.name, exp, cfg, rank)
        for name in sorted(names - set(exp)):
            p.append(f"{path.name}: {name}: unexpected tensor for {cfg['architecture']} quant_algo={algo} "
                     f"kv={cfg['quantization'].get('kv_cache_quant_algo')} at rank {rank} "
                     f"(rule {RULE_PP if 'layers.' in name or 'embedding' in name or 'lm_head' in name else '§1.5'}: "
                     f"TensorRT-LLM ignores it, so a name is likely wrong)")
    return p


def _weight_only_forms(f, fname: str, exp: dict, cfg: dict, rank: int) -> list[str]:
    """W8A16/W4A16: float (out,in) weights, or int8 (in, out*bits/8) with per_channel_scale (§1.7)."""
    p = []
    bits = 8 if cfg["quantization"]["quant_algo"] == "W8A16" else 4
    base = expected_tensors({**cfg, "quantization": {}}, rank)
    names = set(f.keys())
    for name, (shape, _dt, rule, _req) in exp.items():
        if shape is not None or name not in names:
            continue
        o, i = base[name][0]
        sl = f.get_slice(name)
        got = tuple(sl.get_shape())
        if sl.get_dtype() == "I8":
            want = (i, o * bits // 8)
            if name.replace(".weight", ".per_channel_scale") not in names:
                p.append(f"{fname}: {name}: int8 weight without per_channel_scale (rule {RULE_WO})")
        else:
            want = (o, i)
            if name.replace(".weight", ".per_channel_scale") in names:
                p.append(f"{fname}: {name}: float weight with a per_channel_scale (rule {RULE_WO})")
        if got != want:
            p.append(f"{fname}: {name}: shape {list(got)} != expected {list(want)} (rule {rule})")
    return p
