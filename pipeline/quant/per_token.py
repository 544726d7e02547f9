"""Per-token dynamic activation quantization on a ModelOpt-calibrated SmoothQuant model (int8_sq_per_token).

ModelOpt 0.47 calibrates SmoothQuant with a static per-tensor activation amax (``INT8_SMOOTHQUANT_CFG``), and its
``block_sizes={-1: None, "type": "dynamic"}`` per-token setting raises for int8 in ``dynamic_block_quant``
("block size for dynamic quantization not found"). TensorRT-LLM's plugin path quantizes each token's row with its
own scale instead: ``scale = max|x_t| / 127``, ``q = round(x_t * 127 / max|x_t|)`` (``quantize_per_token`` and
the RMSNorm-quantization plugin, tensorrt_llm/quantization/layers.py, index id 790827869). This module makes each
enabled input quantizer of a quantized linear do exactly that, after the pre-quant (smoothing) scale ModelOpt
applies, so the quantize stage's simulated perplexity is that of the per-token format, and QAT trains through it
(straight-through estimator). Weights, smoothing vectors and the checkpoint export are untouched.

The override is an instance attribute, not ModelOpt state, and :func:`static_activations` takes it off before the
artifact is saved (``mto.save`` would pickle the function, and ``torch.load(weights_only=True)`` refuses it): a
restored artifact (pipeline/quant/artifact.py) has static quantizers again, which is what the checkpoint export
reads (the static amax is then dropped by pipeline/trtllm/sq_per_token.py).
"""

from __future__ import annotations

import torch
from torch import nn

from . import override

INT8_MAX = 127.0


def per_token_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize every row (last dim) of ``x`` to int8 with its own max|x| / 127 scale (an all-zero row
    stays zero); gradients pass straight through (QAT)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-20)   # 127 / amax stays finite
    q = torch.round(xf * (INT8_MAX / amax)).clamp(-128, 127) * (amax / INT8_MAX)
    return (xf + (q - xf).detach()).to(x.dtype)


def per_token_activations(model: nn.Module) -> int:
    """Switch every enabled input quantizer of ``model``'s quantized linears to per-token int8; returns how many."""
    return override.install(model, "input_quantizer", per_token_fake_quant)


def static_activations(model: nn.Module) -> int:
    """Undo :func:`per_token_activations` (before ``mto.save``); returns how many quantizers it reset."""
    return override.remove(model, per_token_fake_quant)


def share_mlp_smoothing(model: nn.Module) -> int:
    """Give each gated MLP's gate_proj and up_proj one smoothing vector (their mean, weights rescaled and their
    per-channel amax recollected from the float weights) with ModelOpt's own ``preprocess_linear_fusion``
    (resmooth only). TensorRT-LLM's plugin path folds one vector into the RMSNorm both read; ModelOpt's
    TensorRT-LLM export resmooths fc/gate only when it merges them (FP8 / NVFP4), and SmoothQuant calibrates each
    linear on its own (on SmolLM2 layers 19-29 differ up to 3.3x). Returns the number of MLPs resmoothed."""
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion
    n = 0
    for mod in model.modules():
        gate, up = getattr(mod, "gate_proj", None), getattr(mod, "up_proj", None)
        qz = getattr(gate, "input_quantizer", None)
        if up is not None and qz is not None and qz.is_enabled and qz.pre_quant_scale is not None:
            preprocess_linear_fusion([gate, up], resmooth_only=True)
            n += 1
    return n
