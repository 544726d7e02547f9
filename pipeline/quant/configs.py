"""The recipe's ``quantize:`` section: defaults, plan-time validation, and the ModelOpt config it maps to.

Everything that changes the quantized result is a value of the ``quantize:`` dict (algorithm, alpha, block
size, KV cache, options.exclude, calibration set / split / samples / seq_len / batch / seed, every QAT
setting), so a stage config built from that dict changes its cache key with any of them.

The algo → ModelOpt mapping follows TensorRT-LLM's ``quantize_by_modelopt.py`` (trtllm-reference.md §3):
int8_sq → ``INT8_SMOOTHQUANT_CFG``, fp8 → ``FP8_DEFAULT_CFG``, int4_awq → ``INT4_AWQ_CFG``. For int8_wo / int4_wo
TensorRT-LLM exports with ``EMPTY_CFG`` and quantizes the weights at build time; for our simulated accuracy we
use ModelOpt's real weight-only fake-quant presets (``INT8_WEIGHT_ONLY_CFG``, ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``)
so the accuracy table shows the loss those formats cause.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from pipeline.modelinfo import ModelInfo

METHODS = ("ptq", "qat", "none")
ALGOS = ("int8_sq", "int8_wo", "int4_wo", "int4_awq", "fp8", "none")
KV_CACHE = ("none", "int8", "fp8")
SCHEDULES = ("cosine", "linear", "constant")
INT4_ALGOS = ("int4_wo", "int4_awq")
OPTIONS = ("exclude",)

# Mirrors pipeline/recipe.py's QuantizeSection (the lead's schema) so a ``model_dump()`` validates as-is.
DEFAULTS: dict[str, Any] = {
    "method": "ptq",
    "algo": "none",
    # SmoothQuant migration strength; None = DEFAULT_ALPHA (ModelOpt's own default, 1.0). On SmolLM2
    # (docs/quantization.md) 1.0 loses less than 0.5 (+22.9 % vs +29.5 % perplexity); both lose a lot.
    "alpha": None,
    # int4 group size along the input dim; None = TensorRT-LLM's 128 where it divides every quantized
    # linear's input width, else the largest valid size <= 128 (SmolLM2: 576 and 1536 wide -> 96).
    "block_size": None,
    "kv_cache": "none",
    # options.exclude: fnmatch patterns over module names whose quantizers stay off ("*layers.0.mlp*").
    "options": {},
    "calibration": {"set": "sotu", "split": "calib", "samples": 32, "seq_len": 256, "batch": 4, "seed": 0},
    "qat": {
        "epochs": 1,
        "lr": 1e-5,
        "schedule": "cosine",
        "warmup_steps": 0,
        "batch": 4,
        "samples": 64,
        "seq_len": 256,
        "seed": 0,
        "set": "sotu",
        "split": "train",
        # loss = alpha * T^2 * KL(teacher || student) + (1 - alpha) * cross-entropy
        "distill": {"enabled": False, "temperature": 2.0, "alpha": 1.0},
    },
}
DEFAULT_ALPHA = 1.0

# checkpoint ``quantization`` fields TensorRT-LLM expects for each algo (quantize_by_modelopt.py).
TRTLLM_QUANT_ALGO = {
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int8_wo": "W8A16",
    "int4_wo": "W4A16",
    "int4_awq": "W4A16_AWQ",
    "fp8": "FP8",
    "none": None,
}
TRTLLM_KV_ALGO = {"none": None, "int8": "INT8", "fp8": "FP8"}


def _merge(defaults: dict, given: dict) -> dict:
    out = copy.deepcopy(defaults)
    for k, v in (given or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def resolve_quant_config(q: dict | None, info: ModelInfo | None = None) -> dict:
    """The ``quantize:`` section with every default filled in (alpha and block_size made concrete).

    Without ``info`` an unset block_size resolves to 128; with it, to :func:`default_block_size`.
    """
    c = _merge(DEFAULTS, q or {})
    if c["alpha"] is None:
        c["alpha"] = DEFAULT_ALPHA
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
    """Minimum CUDA compute capability (89 = 8.9) a TensorRT(-LLM) engine needs for this setting.

    FP8 weights/activations or an FP8 KV cache need Ada/Hopper (sm89+); the fake-quantized checkpoint
    itself can be produced anywhere (also on CPU).
    """
    if algo == "fp8" or kv_cache == "fp8":
        return 89
    return None


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _unknown(given: dict, allowed: dict, prefix: str) -> list[str]:
    return [f"{prefix}{k}: unknown key; allowed keys: {', '.join(sorted(allowed))}"
            for k in given if k not in allowed]


def validate_quant_config(q: dict | None, info: ModelInfo) -> list[str]:
    """All problems in the ``quantize:`` section at once; each names ``quantize.<key>`` and what is allowed.

    Empty list = OK. Checks types/ranges, the algo/kv choices, SmoothQuant alpha, the int4 group size
    against this model's linear widths, calibration and QAT settings.
    """
    p: list[str] = []
    raw = dict(q or {})
    p += _unknown(raw, DEFAULTS, "quantize.")
    for sub in ("calibration", "qat", "options"):
        if raw.get(sub) is not None and not isinstance(raw[sub], dict):
            p.append(f"quantize.{sub}: must be a mapping, got {raw[sub]!r}")
            raw.pop(sub)
    p += _unknown(raw.get("calibration") or {}, DEFAULTS["calibration"], "quantize.calibration.")
    p += _unknown(raw.get("qat") or {}, DEFAULTS["qat"], "quantize.qat.")
    p += [f"quantize.options.{k}: unknown option; allowed: {', '.join(OPTIONS)}"
          for k in (raw.get("options") or {}) if k not in OPTIONS]
    d = (raw.get("qat") or {}).get("distill")
    if d is not None and not isinstance(d, dict):
        p.append(f"quantize.qat.distill: must be a mapping like {{enabled: true, temperature: 2.0}}, got {d!r}")
        raw["qat"] = {k: v for k, v in raw["qat"].items() if k != "distill"}
    else:
        p += _unknown(d or {}, DEFAULTS["qat"]["distill"], "quantize.qat.distill.")

    c = resolve_quant_config(raw, info)
    if c["method"] not in METHODS:
        p.append(f"quantize.method: {c['method']!r} is not one of {', '.join(METHODS)}")
    if c["algo"] not in ALGOS:
        hint = "; 'int8' is the onnxruntime target's QDQ format, use int8_sq or int8_wo here" \
            if c["algo"] == "int8" else ""
        p.append(f"quantize.algo: {c['algo']!r} is not one of {', '.join(ALGOS)}{hint}")
    if c["kv_cache"] not in KV_CACHE:
        p.append(f"quantize.kv_cache: {c['kv_cache']!r} is not one of {', '.join(KV_CACHE)}")
    if not _is_num(c["alpha"]) or not 0.0 <= c["alpha"] <= 1.0:
        p.append(f"quantize.alpha: SmoothQuant alpha must be a number in [0, 1], got {c['alpha']!r}")
    elif raw.get("alpha") is not None and c["algo"] != "int8_sq":
        p.append(f"quantize.alpha: only used by algo int8_sq (SmoothQuant), but algo is {c['algo']!r}; remove it")
    bs = c["block_size"]
    if c["algo"] in INT4_ALGOS:
        allowed = valid_block_sizes(info)
        if not _is_int(bs) or bs not in allowed:
            widths = ", ".join(f"{k} {v}" for k, v in linear_input_widths(info).items())
            p.append(f"quantize.block_size: {bs!r} must be a multiple of 32 dividing every quantized linear's "
                     f"input width ({widths}); allowed for this model: {', '.join(map(str, allowed)) or 'none'}")
    elif raw.get("block_size") is not None:
        p.append(f"quantize.block_size: only used by algo int4_wo / int4_awq, but algo is {c['algo']!r}; remove it")
    excl = (c["options"] or {}).get("exclude", [])
    if not isinstance(excl, list) or not all(isinstance(x, str) and x for x in excl):
        p.append(f"quantize.options.exclude: must be a list of module-name patterns like "
                 f"'*layers.0.mlp.down_proj', got {excl!r}")

    cal = c["calibration"]
    needs_calib = c["algo"] != "none" or c["kv_cache"] != "none"
    if needs_calib:
        for k in ("set", "split"):
            if not isinstance(cal[k], str) or not cal[k]:
                p.append(f"quantize.calibration.{k}: must name a data set / split (e.g. sotu / calib), got {cal[k]!r}")
        for k, lo, hi in (("samples", 1, 4096), ("seq_len", 8, info.max_position_embeddings), ("batch", 1, 256)):
            v = cal[k]
            if not _is_int(v) or not lo <= v <= hi:
                p.append(f"quantize.calibration.{k}: must be an integer in [{lo}, {hi}], got {v!r}")
        if not _is_int(cal["seed"]) or cal["seed"] < 0:
            p.append(f"quantize.calibration.seed: must be a non-negative integer, got {cal['seed']!r}")

    if c["method"] == "qat":
        t = c["qat"]
        if not _is_int(t["epochs"]) or not 1 <= t["epochs"] <= 3:
            p.append(f"quantize.qat.epochs: must be 1, 2 or 3, got {t['epochs']!r}")
        if not _is_num(t["lr"]) or not 0 < t["lr"] <= 1e-2:
            p.append(f"quantize.qat.lr: must be a number in (0, 0.01], got {t['lr']!r}")
        for k, lo, hi in (("batch", 1, 256), ("samples", 1, 100000), ("seq_len", 8, info.max_position_embeddings)):
            v = t[k]
            if not _is_int(v) or not lo <= v <= hi:
                p.append(f"quantize.qat.{k}: must be an integer in [{lo}, {hi}], got {v!r}")
        if _is_int(t["samples"]) and _is_int(t["batch"]) and _is_int(t["epochs"]) and _is_int(t["warmup_steps"]):
            steps = t["epochs"] * -(-t["samples"] // max(t["batch"], 1))
            if not 0 <= t["warmup_steps"] < steps:
                p.append(f"quantize.qat.warmup_steps: must be in [0, {steps}) (the run has {steps} steps), "
                         f"got {t['warmup_steps']!r}")
        else:
            p.append(f"quantize.qat.warmup_steps: must be a non-negative integer, got {t['warmup_steps']!r}")
        if t["schedule"] not in SCHEDULES:
            p.append(f"quantize.qat.schedule: {t['schedule']!r} is not one of {', '.join(SCHEDULES)}")
        if not _is_int(t["seed"]) or t["seed"] < 0:
            p.append(f"quantize.qat.seed: must be a non-negative integer, got {t['seed']!r}")
        ds = t["distill"]
        if not isinstance(ds["enabled"], bool):
            p.append(f"quantize.qat.distill.enabled: must be true or false, got {ds['enabled']!r}")
        if not _is_num(ds["temperature"]) or not 0 < ds["temperature"] <= 20:
            p.append(f"quantize.qat.distill.temperature: must be a number in (0, 20], got {ds['temperature']!r}")
        if not _is_num(ds["alpha"]) or not 0 <= ds["alpha"] <= 1:
            p.append(f"quantize.qat.distill.alpha: weight of the KD loss vs cross-entropy, in [0, 1], "
                     f"got {ds['alpha']!r}")
        if c["algo"] == "none" and c["kv_cache"] == "none":
            p.append("quantize.method: qat needs something to quantize; set quantize.algo or quantize.kv_cache")
    return p


def _set_weight_block(cfg: dict, block_size: int) -> None:
    for e in cfg["quant_cfg"]:
        if e.get("quantizer_name") == "*weight_quantizer" and "block_sizes" in (e.get("cfg") or {}):
            e["cfg"]["block_sizes"] = {-1: int(block_size), "type": "static"}


def modelopt_config(q: dict, info: ModelInfo | None = None) -> dict:
    """The ModelOpt ``mtq.quantize`` config for a resolved ``quantize:`` section (a fresh deep copy)."""
    import modelopt.torch.quantization as mtq

    c = resolve_quant_config(q, info)
    algo = c["algo"]
    if algo == "int8_sq":
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
    for pat in (c["options"] or {}).get("exclude", []):
        cfg["quant_cfg"].append({"quantizer_name": pat if pat.endswith("quantizer") else f"{pat}*quantizer",
                                 "enable": False})
    return cfg


def trtllm_quantization(q: dict, info: ModelInfo | None = None) -> dict:
    """The checkpoint ``quantization`` block TensorRT-LLM expects for this setting (quantize_by_modelopt.py)."""
    c = resolve_quant_config(q, info)
    out = {"quant_algo": TRTLLM_QUANT_ALGO[c["algo"]], "kv_cache_quant_algo": TRTLLM_KV_ALGO[c["kv_cache"]]}
    if c["algo"] in INT4_ALGOS:
        out["group_size"] = int(c["block_size"])
    if c["algo"] == "int8_sq":
        out["smoothquant_val"] = float(c["alpha"])
    return out


def export_uses_fake_quant(algo: str) -> bool:
    """False where TensorRT-LLM exports float weights (EMPTY_CFG) and quantizes them at build time."""
    return algo not in ("int8_wo", "int4_wo", "none")
