"""The recipe's ``quantize:`` section: defaults, plan-time validation, and the ModelOpt config it maps to.

Everything that changes the quantized result is a value of the ``quantize:`` dict (algorithm, alpha, block
size, KV cache, options.exclude, calibration set / split / samples / seq_len / batch / seed, every QAT
setting), so a stage config built from that dict changes its cache key with any of them.

The algo → ModelOpt mapping follows TensorRT-LLM's ``quantize_by_modelopt.py`` (trtllm-reference.md §3):
int8_sq / int8_sq_per_token → ``INT8_SMOOTHQUANT_CFG``, fp8 → ``FP8_DEFAULT_CFG``, int4_awq → ``INT4_AWQ_CFG``. For int8_wo / int4_wo
TensorRT-LLM exports with ``EMPTY_CFG`` and quantizes the weights at build time; for our simulated accuracy we
use ModelOpt's real weight-only fake-quant presets (``INT8_WEIGHT_ONLY_CFG``, ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``)
so the accuracy table shows the loss those formats cause.
"""

from __future__ import annotations

import copy
import math
from typing import get_args

from pipeline.gpus import min_sm
from pipeline.modelinfo import ModelInfo
from pipeline.recipe import QuantizeSection
from pipeline.recipe_options import ModeloptOptions
from pipeline.trtllm.build_config import KV_CACHE_ALGO, QUANT_ALGO, SMOOTHQUANT_ALGOS

# the recipe schema's choices (pipeline/recipe.py), for callers of this module
METHODS = get_args(QuantizeSection.model_fields["method"].annotation)
ALGOS = tuple(QUANT_ALGO)      # the tensorrt_llm target's algos (pipeline/targets/tensorrt_llm.py reads the same map)
KV_CACHE = get_args(QuantizeSection.model_fields["kv_cache"].annotation)
INT4_ALGOS = ("int4_wo", "int4_awq")
# SmoothQuant migration strength when quantize.alpha is unset. int8_sq: ModelOpt's own default; on SmolLM2
# (docs/quantization.md) 1.0 loses less than 0.5 (+22.9 % vs +29.5 % perplexity), both a lot. int8_sq_per_token:
# TensorRT-LLM's QuantConfig.smoothquant_val default (0.5); on SmolLM2 0.5 gives +0.98 %, 1.0 +6.3 %.
DEFAULT_ALPHA = {"int8_sq": 1.0, "int8_sq_per_token": 0.5}


def _defaults() -> dict:
    return QuantizeSection().model_dump()


def resolve_quant_config(q: dict | None, info: ModelInfo | None = None) -> dict:
    """The ``quantize:`` section with every default (the recipe schema's) filled in, alpha and block_size made
    concrete: an unset block_size is :func:`default_block_size` for ``info``, 128 without it."""
    from pipeline.recipe import deep_merge
    c = deep_merge(_defaults(), q or {})
    if c["alpha"] is None:
        c["alpha"] = DEFAULT_ALPHA.get(c["algo"], 1.0)
    if c["block_size"] is None:
        c["block_size"] = default_block_size(info) if info is not None else 128
    if c["method"] == "none":
        c["algo"], c["kv_cache"] = "none", "none"
    return c


def linear_input_widths(info: ModelInfo) -> dict[str, int]:
    """Input width of each kind of quantized linear in a Llama/Qwen2 decoder layer."""
    return {
        "q/k/v_proj, gate/up_proj": info.hidden_size,
        "o_proj": info.num_heads * info.head_dim,
        "down_proj": info.intermediate_size,
    }


def valid_block_sizes(info: ModelInfo) -> list[int]:
    """int4 group sizes usable on this model: multiples of 32 that divide every quantized linear's input width."""
    g = 0
    for w in linear_input_widths(info).values():
        g = math.gcd(g, w)
    return [d for d in range(32, g + 1, 32) if g % d == 0]


def default_block_size(info: ModelInfo) -> int:
    """128 (TensorRT-LLM's default) where valid, else the largest valid size below it (else the smallest)."""
    ok = valid_block_sizes(info)
    if 128 in ok:
        return 128
    below = [b for b in ok if b < 128]
    return max(below) if below else (min(ok) if ok else 128)


def needs_sm(algo: str, kv_cache: str = "none") -> int | None:
    """Minimum CUDA compute capability (89 = 8.9) a TensorRT(-LLM) engine needs for this setting (pipeline.gpus)."""
    return min_sm(algo, kv_cache)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_quant_config(q: dict | None, info: ModelInfo) -> list[str]:
    """All problems in the ``quantize:`` section of a tensorrt_llm recipe at once, each naming ``quantize.<key>``:
    the recipe schema and its rules (pipeline/recipe.py, the one schema), then what needs this model's facts --
    the int4 group size against the linear widths and the sequence lengths against the context length."""
    from pipeline.recipe import deep_merge, quantize_problems, section_problems
    raw = dict(q or {})
    facts: list[str] = []
    given = deep_merge(_defaults(), {k: v for k, v in raw.items() if k in _defaults()})
    c = resolve_quant_config(given, info)
    bs = raw.get("block_size")
    if c["algo"] in INT4_ALGOS:
        allowed = valid_block_sizes(info)
        bs = c["block_size"] if bs is None else bs
        if not _is_int(bs) or bs not in allowed:
            widths = ", ".join(f"{k} {v}" for k, v in linear_input_widths(info).items())
            facts.append(f"quantize.block_size: {bs!r} must be a multiple of 32 dividing every quantized linear's "
                         f"input width ({widths}); allowed for this model: {', '.join(map(str, allowed)) or 'none'}")
    for sub in ("calibration", "qat"):
        v = (c.get(sub) or {}).get("seq_len") if isinstance(c.get(sub), dict) else None
        if _is_int(v) and v > info.max_position_embeddings and (sub == "calibration" or c["method"] == "qat"):
            facts.append(f"quantize.{sub}.seq_len: {v} is longer than the model's context "
                         f"({info.max_position_embeddings} tokens, max_position_embeddings)")
    def key(m):
        return m.split(":")[0].split(" ")[0]
    schema = section_problems(QuantizeSection, raw, ("quantize",))
    rules = [m for m in quantize_problems(given, "tensorrt_llm") if key(m) not in {key(x) for x in schema}]
    named = {key(m) for m in facts}     # the model-specific message says more than the schema's
    return facts + [m for m in schema + rules if key(m) not in named]


def _set_weight_block(cfg: dict, block_size: int) -> None:
    for e in cfg["quant_cfg"]:
        if e.get("quantizer_name") == "*weight_quantizer" and "block_sizes" in (e.get("cfg") or {}):
            e["cfg"]["block_sizes"] = {-1: int(block_size), "type": "static"}


def modelopt_config(q: dict, info: ModelInfo | None = None) -> dict:
    """The ModelOpt ``mtq.quantize`` config for a resolved ``quantize:`` section (a fresh deep copy)."""
    import modelopt.torch.quantization as mtq

    c = resolve_quant_config(q, info)
    algo = c["algo"]
    if algo in SMOOTHQUANT_ALGOS:
        # per-token too: the smoothing vectors and int8 weights come from the same calibration; the activations
        # are then quantized per token at run time (pipeline/quant/per_token.py), the static amax is unused
        cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
        cfg["algorithm"] = {"method": "smoothquant", "alpha": float(c["alpha"])}
    elif algo == "int8_wo":
        cfg = copy.deepcopy(mtq.INT8_WEIGHT_ONLY_CFG)
    elif algo == "int4_wo":
        cfg = copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
        _set_weight_block(cfg, c["block_size"])
    elif algo == "int4_awq":
        cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
        _set_weight_block(cfg, c["block_size"])
    elif algo == "fp8":
        cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    elif algo == "none":
        # quantizers inserted but all off: KV-cache-only quantization, or an FP baseline
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        raise ValueError(f"quantize.algo: {algo!r} is not one of {', '.join(ALGOS)}")

    if c["kv_cache"] != "none":
        bits = 8 if c["kv_cache"] == "int8" else (4, 3)
        # ModelOpt's KV presets quantize the attention BMM inputs (k/v) per tensor (FP8_KV_CFG);
        # export reads num_bits 8 as INT8 and (4, 3) as FP8 (modelopt.torch.export.quant_utils).
        cfg["quant_cfg"].append({"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": bits, "axis": None}})
    for pat in ModeloptOptions.model_validate(c["options"] or {}).exclude:     # the options model's default
        cfg["quant_cfg"].append({"quantizer_name": pat if pat.endswith("quantizer") else f"{pat}*quantizer",
                                 "enable": False})
    return cfg


def trtllm_quantization(q: dict, info: ModelInfo | None = None) -> dict:
    """The checkpoint ``quantization`` block TensorRT-LLM expects for this setting (quantize_by_modelopt.py)."""
    c = resolve_quant_config(q, info)
    out = {"quant_algo": QUANT_ALGO[c["algo"]], "kv_cache_quant_algo": KV_CACHE_ALGO[c["kv_cache"]]}
    if c["algo"] in INT4_ALGOS:
        out["group_size"] = int(c["block_size"])
    if c["algo"] in SMOOTHQUANT_ALGOS:
        out["smoothquant_val"] = float(c["alpha"])
    return out


def export_uses_fake_quant(algo: str) -> bool:
    """False where TensorRT-LLM exports float weights (EMPTY_CFG) and quantizes them at build time."""
    return algo not in ("int8_wo", "int4_wo", "none")
