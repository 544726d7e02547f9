"""TensorRT-LLM checkpoint: ModelOpt export with tp/pp, then TensorRT-LLM's own config.json fix-ups.

`modelopt.torch.export.export_tensorrt_llm_checkpoint` writes ``config.json`` + ``rank{N}.safetensors``.
Without tensorrt_llm installed it builds config.json by hand and (measured with transformers 5) omits
``rotary_base`` (transformers 5 moved ``rope_theta`` into ``rope_parameters``), ``qwen_type`` and the
bias switches, so TensorRT-LLM's class defaults would apply (rotary_base 10000, Qwen1 semantics). The
fix-ups below are those TensorRT-LLM's ``examples/quantization/quantize.py`` applies after the same
export (``quantize_by_modelopt.py``: model_type, architecture, rotary_scaling, qwen_type, norm_epsilon,
rotary_base, intermediate_size, weight-only quant_algo, fp8 KV workaround), plus the fields the
Llama/QWen config classes would otherwise default (trtllm-reference.md §1.2, §3).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from ..host.rss import PeakRss
from ..errors import ForgeError
from ..modelinfo import ModelInfo, sliding_window_pattern
from ..progress import progress_bar
from .build_config import KV_CACHE_ALGO, PER_CHANNEL_KV_ALGOS, QUANT_ALGO
from .families import require_family
from .quantizers import QUANTIZERS, effective_group_size

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def decoder_type_for(info: ModelInfo) -> str:
    """ModelOpt's decoder_type for the model's family (ForgeError naming the supported ones otherwise)."""
    return require_family(info.architecture).decoder_type


def _rope_scaling(hf_cfg: dict) -> dict | None:
    """HF rope scaling in TRT-LLM's ``rotary_scaling`` form, None for plain RoPE (transformers 4 and 5 layouts)."""
    rs = hf_cfg.get("rope_scaling")
    if rs is None:
        rp = hf_cfg.get("rope_parameters") or {}
        if isinstance(rp.get("full_attention"), dict):   # transformers 5 Gemma 3: per layer type; global layers
            rp = rp["full_attention"]                     # carry the scaling (local layers are never scaled)
        rs = {k: v for k, v in rp.items() if k != "rope_theta"} or None
    if not rs:
        return None
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype in (None, "default"):
        return None
    out = dict(rs)
    out.setdefault("type", rtype)
    return out


def _gemma3_fields(hf_cfg: dict, tp: int) -> dict:
    """What TensorRT-LLM's GemmaConfig.from_hugging_face adds for Gemma 3 (families.py for the sources)."""
    rp = hf_cfg.get("rope_parameters") or {}
    local = hf_cfg.get("rope_local_base_freq") or (rp.get("sliding_attention") or {}).get("rope_theta") or 10000.0
    qpas = hf_cfg.get("query_pre_attn_scalar")
    if not qpas:
        raise ForgeError("model config: Gemma3ForCausalLM without query_pre_attn_scalar; TensorRT-LLM's GemmaConfig "
                         "asserts it is set")
    return {"query_pre_attn_scalar": qpas,
            "final_logit_softcapping": hf_cfg.get("final_logit_softcapping"),
            "_sliding_window_pattern": sliding_window_pattern(hf_cfg) or 1,
            "rope_local_base_freq": float(local),
            "sliding_window": hf_cfg.get("sliding_window"),
            "inter_layernorms": True,
            "share_embedding_table": True,           # forge's choice: GemmaConfig sets no sharing
            "use_parallel_embedding": tp > 1,        # GemmaConfig: tp_size > 1, whatever the checkpoint says
            "embedding_sharding_dim": 0}


def apply_config_fixups(cfg: dict, info: ModelInfo, hf_cfg: dict, quant: dict | None) -> dict:
    """Return ``cfg`` (an exported TRT-LLM config.json) with TensorRT-LLM's quantize-script fix-ups applied."""
    cfg = dict(cfg)
    quant = quant or {}
    decoder = decoder_type_for(info)
    cfg["architecture"] = info.architecture          # quantize.py: architecture = HF architectures[0]
    cfg["model_type"] = decoder                      # quantize.py: tensorrt_llm_config["model_type"]
    cfg["rotary_base"] = float(info.rope_theta)      # missing in ModelOpt's manual config (transformers 5)
    cfg["rotary_scaling"] = _rope_scaling(hf_cfg)    # HF rope_scaling -> rotary_scaling
    cfg["norm_epsilon"] = float(info.rms_norm_eps)
    cfg["tie_word_embeddings"] = bool(info.tie_word_embeddings)
    cfg["mlp_bias"] = bool(hf_cfg.get("mlp_bias", False))
    cfg.setdefault("num_key_value_heads", info.num_kv_heads)
    cfg.setdefault("head_size", info.head_dim)
    if decoder == "qwen":
        cfg["qwen_type"] = info.model_type           # qwen2 (QWenConfig default would be Qwen1 behaviour)
        cfg["intermediate_size"] = info.intermediate_size
        cfg["attn_bias"] = info.model_type not in ("qwen3", "qwen3_moe")
        cfg["seq_length"] = int(hf_cfg.get("seq_length", 8192))
    else:
        cfg["attn_bias"] = bool(hf_cfg.get("attention_bias", hf_cfg.get("bias", False)))
    if info.sliding_window and info.architecture == "MistralForCausalLM":
        # LLaMAConfig has no window field; the engine's window is the runtime max_attention_window_size.
        # Carried here (PretrainedConfig keeps unknown keys) for the reference and the Triton repository.
        cfg["sliding_window"] = int(info.sliding_window)
    if info.architecture == "Gemma3ForCausalLM":
        cfg.update(_gemma3_fields(hf_cfg, int((cfg.get("mapping") or {}).get("tp_size", 1))))
    q = dict(cfg.get("quantization") or {})
    algo = quant.get("algo") or "none"
    if quant.get("method") == "none":
        algo = "none"
    # Weight-only: ModelOpt exports float weights (EMPTY_CFG); trtllm-build quantizes them (§1.7).
    if algo in ("int8_wo", "int4_wo") and not q.get("quant_algo"):
        q["quant_algo"] = QUANT_ALGO[algo]
        if algo == "int4_wo":
            q.setdefault("group_size", int(quant.get("block_size") or 128))
        q.setdefault("exclude_modules", ["lm_head"])
    if algo == "none":
        q["quant_algo"] = None
    if algo == "fp8_pc_pt" and (quant.get("options") or {}).get("meta_recipe"):
        # ModelOpt lists the float attention / MLP modules in exclude_modules, which would leave input_layernorm
        # swapped to Fp8RowwiseRmsNorm ahead of a float attention; TensorRT-LLM's own switch for this set is
        # use_meta_recipe ('*input_layernorm', '*attention', first and last layers: quantize.py @ 89fd9b7)
        q.update(use_meta_recipe=True, exclude_modules=["lm_head"])
    kv = KV_CACHE_ALGO.get(quant.get("kv_cache") or "none")
    if kv is None:                                   # quantize.py: fp8/nvfp4 without --kv_cache_dtype
        q["kv_cache_quant_algo"] = None
    q.setdefault("quant_algo", None)
    q.setdefault("kv_cache_quant_algo", None)
    cfg["quantization"] = q
    return cfg


@contextlib.contextmanager
def _gemma3_manual_config():
    """Let ModelOpt write a Gemma 3 checkpoint config without tensorrt_llm installed.

    ModelOpt 0.47 builds config.json through TensorRT-LLM's ``GemmaConfig.from_hugging_face`` when tensorrt_llm is
    importable; without it (this CPU machine) its manual branch (``convert_to_tensorrt_llm_config`` in
    ``modelopt/torch/export/tensorrt_llm_utils.py``) accepts gemma but raises NotImplementedError for gemma3,
    although the weights are exported (q/k norms, pre/post-feedforward norms, norm weights + 1). On that error
    only, the generic fields are built as for ``gemma`` (identical for both) and ``apply_config_fixups`` adds
    the Gemma3ConfigGroup fields GemmaConfig.from_hugging_face would add.
    """
    from modelopt.torch.export import model_config_export as mce
    orig = mce.convert_to_tensorrt_llm_config

    def convert(model_config, *args, **kwargs):
        try:
            return orig(model_config, *args, **kwargs)
        except NotImplementedError:
            layers = [lay for lay in model_config.layers if getattr(lay, "decoder_type", None) == "gemma3"]
            if not layers:
                raise
            for lay in layers:
                lay.decoder_type = "gemma"
            try:
                return orig(model_config, *args, **kwargs)
            finally:
                for lay in layers:
                    lay.decoder_type = "gemma3"

    mce.convert_to_tensorrt_llm_config = convert
    try:
        yield
    finally:
        mce.convert_to_tensorrt_llm_config = orig


def _disable_quantizers(model: torch.nn.Module) -> list:
    """Disable every enabled weight / input quantizer of ``model``'s linears, so they export float weights; returns
    them (to re-enable). The attention's k/v BMM quantizers stay on: the KV-cache scales are exported as usual."""
    try:
        from modelopt.torch.quantization.nn import TensorQuantizer
    except ImportError:
        return []
    out = [m for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled
           and n.endswith(("weight_quantizer", "input_quantizer"))]
    for m in out:
        m.disable()
    return out


def write_checkpoint(model: torch.nn.Module, info: ModelInfo, hf_dir: str | Path | None, out_dir: str | Path, *,
                     dtype: str | torch.dtype = "float16", tp: int = 1, pp: int = 1, quant: dict | None = None) -> dict:
    """Export ``model`` (HF causal LM, optionally ModelOpt-quantized) as a TRT-LLM checkpoint into ``out_dir``.

    ``quant`` is the recipe's ``quantize`` section (``algo``, ``kv_cache``, ``block_size``); ``hf_dir`` the HF
    source dir (its config.json feeds the fix-ups; None = use ``model.config``). Returns metrics: seconds,
    peak/start RSS (bytes), the fp16 size of the model, ranks, quant_algo, kv_cache_quant_algo.
    """
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    quant = quant or {}
    tdtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if tdtype not in (torch.float16, torch.bfloat16):
        raise ForgeError(f"build.tensorrt_llm.dtype: {dtype!r}; TensorRT-LLM checkpoints are float16 or bfloat16")
    decoder = decoder_type_for(info)
    algo = quant.get("algo") or "none"
    if QUANT_ALGO.get(algo, "?") in PER_CHANNEL_KV_ALGOS and tp > info.num_kv_heads:
        raise ForgeError(f"quantize.algo: {algo} with build.tensorrt_llm.tp={tp} > {info.num_kv_heads} KV heads is "
                         f"not exportable (ModelOpt cannot duplicate per-channel k/v scales); use tp <= "
                         f"{info.num_kv_heads}")
    if hf_dir is not None and (Path(hf_dir) / "config.json").exists():
        hf_cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    else:
        hf_cfg = model.config.to_dict()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("rank*.safetensors")) + [out / "config.json"]:
        if stale.exists():
            stale.unlink()
    model.eval()
    # Weight-only: TensorRT-LLM loads float weights and quantizes them itself (W8A16/W4A16, §1.7); ModelOpt's
    # int8 (out,in) + weights_scaling_factor layout is not what WeightOnlyQuantLinear loads, so export float.
    # int4_zp: ModelOpt exports no zero points, so float too, quantized below by forge (int4_zp.py).
    on_grid = []
    if algo == "int4_zp" and quant.get("method") != "none":
        from . import zp_grid
        group = effective_group_size(algo, quant.get("block_size"), info)
        on_grid = zp_grid.on_grid(model, group)       # the simulation's codes survive the float export
    exports_float = algo in QUANTIZERS and not QUANTIZERS[algo].fake_quant_export
    disabled = _disable_quantizers(model) if exports_float else []
    t0 = time.perf_counter()
    try:
        with PeakRss(interval=0.05, children=False) as mem, progress_bar(f"TRT-LLM checkpoint export (tp {tp}, pp {pp})", 1) as advance, \
                torch.inference_mode():
            with _gemma3_manual_config():
                export_tensorrt_llm_checkpoint(model, decoder, tdtype, out,
                                               inference_tensor_parallel=tp, inference_pipeline_parallel=pp)
            advance(1)
    finally:
        for qz in disabled:
            qz.enable()
        if on_grid:
            zp_grid.restore(on_grid)
    seconds = time.perf_counter() - t0
    cfg = json.loads((out / "config.json").read_text())
    cfg = apply_config_fixups(cfg, info, hf_cfg, quant)
    (out / "config.json").write_text(json.dumps(cfg, indent=4))
    if algo == "int8_sq_per_token" and quant.get("method") != "none":
        from .sq_per_token import to_per_token
        to_per_token(out)
        cfg = json.loads((out / "config.json").read_text())
    if algo == "int4_zp" and quant.get("method") != "none":
        from .int4_zp import to_zero_point
        to_zero_point(out, group)
        cfg = json.loads((out / "config.json").read_text())
    fp16_bytes = info.num_params * 2
    return {
        "seconds": round(seconds, 3),
        "peak_rss_bytes": int(mem.peak),
        "start_rss_bytes": int(mem.start),
        "export_rss_increase_bytes": int(mem.peak - mem.start),
        "model_fp16_bytes": int(fp16_bytes),
        "export_rss_increase_vs_fp16": round((mem.peak - mem.start) / fp16_bytes, 3),
        "tp": tp, "pp": pp, "ranks": tp * pp,
        "quant_algo": cfg["quantization"].get("quant_algo"),
        "kv_cache_quant_algo": cfg["quantization"].get("kv_cache_quant_algo"),
        "checkpoint_bytes": sum(f.stat().st_size for f in out.glob("rank*.safetensors")),
    }
