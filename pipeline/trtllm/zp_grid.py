"""The INT4-with-zero-points grid of quantize.algo int4_zp, in one place for the checkpoint rewrite (int4_zp.py), the
export that puts the model's weights on it (checkpoint.py) and the quantize stage's simulation and QAT
(pipeline/quant/zero_point.py, which sits above this package and imports it).

Per group of ``g`` consecutive input channels of one output row: ``w ~ q * scale + zero`` with a signed code q in
[-8, 7], ``scale = (max - min) / 15`` and ``zero = min + 8 * scale``, i.e. ``(q + 8) * scale + min``: the min/max
asymmetric round-to-nearest grid (GPTQ's and AWQ's zero-point grid, without their searches). It is the form
TensorRT-LLM's groupwise GEMM computes when the linear has zeros: ``w = q * scale + zero`` with q a signed int4 and
``zero`` an additive value in the model dtype (``cutlass::WeightOnlyQuantOp::FINEGRAINED_SCALE_AND_ZEROS``;
TensorRT-LLM's own GPTQ conversion writes ``zero = (8 - z) * scale`` for an unsigned zero point z:
``postprocess_weight_only_groupwise`` in tensorrt_llm/quantization/functional.py, 1.x, index id 240578642).

The checkpoint stores scale and zero in the model dtype, so the export rounds them first and picks each code against
the rounded values (:func:`group_params` with ``dtype``); the simulation keeps them in float32.
"""

from __future__ import annotations

import torch
from torch import nn

QMIN, QMAX = -8, 7          # signed int4 codes
LEVELS = QMAX - QMIN        # 15 steps between min and max


def grid(wg: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero of every group along the last dim of ``wg``, rounded to ``dtype``, returned as float32.
    A constant group keeps its value as ``zero - 8 * scale`` with the smallest normal scale of ``dtype``."""
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / LEVELS).to(dtype).float().clamp_min(torch.finfo(dtype).tiny)
    zero = (lo - QMIN * scale).to(dtype).float()
    return scale, zero


def codes(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round((wg - zero[..., None]) / scale[..., None]).clamp(QMIN, QMAX)


def groups(w: torch.Tensor, group: int) -> torch.Tensor:
    out, inp = w.shape
    if inp % group:
        raise ValueError(f"input width {inp} is not a multiple of the group size {group}")
    return w.float().reshape(out, inp // group, group)


def group_params(w: torch.Tensor, group: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` ``[out, in / group]`` of a weight ``[out, in]``, rounded to ``dtype`` (float32 values)."""
    return grid(groups(w, group), dtype)


def quantize(w: torch.Tensor, group: int, dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 codes in [-8, 7] ``[out, in]`` and ``(scale, zero)`` ``[out, in / group]`` of ``w`` ``[out, in]``."""
    wg = groups(w, group)
    scale, zero = grid(wg, dtype)
    return codes(wg, scale, zero).reshape(w.shape).to(torch.int8), scale, zero


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale + zero`` ``[out, in]`` from codes ``[out, in]`` and ``[out, in / group]`` scale / zero."""
    out, inp = q.shape
    g = inp // scale.shape[-1]
    return (q.float().reshape(out, -1, g) * scale[..., None] + zero[..., None]).reshape(out, inp)


def on_grid(model: nn.Module, group: int) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Replace the weight of every linear with an enabled weight quantizer by its quantize-dequantized value on the
    asymmetric grid (float32 scale / zero: the simulation's), in place; returns ``(parameter, original)`` pairs for
    :func:`restore`. The export then writes weights that lie on the grid, so the checkpoint rewrite recovers the
    simulation's codes exactly (each group's min and max are its codes -8 and 7) and only its scale and zero are
    rounded to the model dtype."""
    from modelopt.torch.quantization.nn import TensorQuantizer
    done = []
    with torch.no_grad():
        for mod in model.modules():
            wq = getattr(mod, "weight_quantizer", None)
            if isinstance(wq, TensorQuantizer) and wq.is_enabled and isinstance(getattr(mod, "weight", None),
                                                                                 torch.nn.Parameter):
                w = mod.weight
                q, scale, zero = quantize(w.detach(), group)
                done.append((w, w.detach().clone()))
                w.copy_(dequantize(q, scale, zero).to(w.dtype))
    return done


def restore(pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """Undo :func:`on_grid`."""
    with torch.no_grad():
        for w, orig in pairs:
            w.copy_(orig)
