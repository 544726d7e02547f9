"""Torch-side quantization with NVIDIA ModelOpt: PTQ, QAT (+distillation), calibration statistics, artifacts.

Public API (what the stage wrappers call)::

    quantize_model(hf_dir, quantize, calib, out_dir, *, train, eval_windows, device) -> metrics
    restore_model(hf_dir, artifact_dir, device) -> fake-quantized nn.Module

What each ``quantize.algo`` is (its options, the ModelOpt preset, the checkpoint format, the GPU it needs) is its
quantizer's, in the tensorrt_llm target's one table: pipeline/trtllm/quantizers.py.

Heavy imports (torch, modelopt) happen inside the functions so plan-time validation stays cheap.
"""

from __future__ import annotations


def quantize_model(*args, **kwargs):
    from .calibrate import quantize_model as _q
    return _q(*args, **kwargs)


def restore_model(*args, **kwargs):
    from .artifact import restore_model as _r
    return _r(*args, **kwargs)


__all__ = ["quantize_model", "restore_model"]
