"""Torch-side quantization with NVIDIA ModelOpt: PTQ, QAT (+distillation), calibration statistics, artifacts.

Public API (what the stage wrappers call)::

    validate_quant_config(q, info) -> list[str]        plan-time problems, each naming quantize.<key>
    needs_sm(algo, kv_cache="none") -> int | None       89 for FP8 engines
    resolve_quant_config(q, info=None) -> dict          defaults filled in
    modelopt_config(q, info=None) -> dict               the mtq.quantize config
    trtllm_quantization(q, info=None) -> dict           the checkpoint's quantization block
    quantize_model(hf_dir, q, calib, out_dir, *, train, eval_windows, device) -> metrics
    restore_model(hf_dir, artifact_dir, device) -> fake-quantized nn.Module

Heavy imports (torch, modelopt) happen inside the functions so plan-time validation stays cheap.
"""

from __future__ import annotations

from .configs import (ALGOS, KV_CACHE, METHODS, export_uses_fake_quant, modelopt_config, needs_sm,
                      resolve_quant_config, trtllm_quantization, valid_block_sizes, validate_quant_config)


def quantize_model(*args, **kwargs):
    from .calibrate import quantize_model as _q
    return _q(*args, **kwargs)


def restore_model(*args, **kwargs):
    from .artifact import restore_model as _r
    return _r(*args, **kwargs)


__all__ = ["ALGOS", "KV_CACHE", "METHODS", "export_uses_fake_quant", "modelopt_config", "needs_sm",
           "quantize_model", "resolve_quant_config", "restore_model", "trtllm_quantization",
           "valid_block_sizes", "validate_quant_config"]
