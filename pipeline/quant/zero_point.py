"""INT4 with zero points (quantize.algo int4_zp) in the quantize stage's simulation and QAT: the asymmetric group
grid itself (the one the checkpoint rewrite uses too) is pipeline/trtllm/zp_grid.py.

ModelOpt 0.47 has no zero-point weight quantizer (its int4 presets are symmetric), so :func:`asymmetric_weights`
overrides ``_fake_quantize`` of the blockwise weight quantizers ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG`` inserts. Those
hand ``_fake_quantize`` the weight reshaped to ``(-1, g)`` (``TensorQuantizer._setup_for_blockquant``, last-axis
blocks), so each row there is one group. Like the per-token override (per_token.py) it is an instance attribute,
taken off by :func:`symmetric_weights` before ``mto.save``; the export does not need it (it quantizes the float
weights itself).
"""

from __future__ import annotations

import torch
from torch import nn

from ..trtllm.zp_grid import codes, grid
from . import override


def fake_quant_groups(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize every row (last dim = one group) of ``x`` on the asymmetric grid, in float32; gradients
    pass straight through (QAT)."""
    xf = x.float()
    scale, zero = grid(xf, torch.float32)
    deq = codes(xf, scale, zero) * scale[..., None] + zero[..., None]
    return (xf + (deq - xf).detach()).to(x.dtype)


def _blockwise(name, quantizer) -> None:
    if not quantizer.block_sizes or not quantizer.block_sizes.get(-1):
        raise ValueError(f"{name}: int4_zp needs blockwise weight quantizers (block_sizes[-1]), got "
                         f"{quantizer.block_sizes}")


def asymmetric_weights(model: nn.Module) -> int:
    """Give every enabled blockwise weight quantizer of ``model`` the asymmetric grid; returns how many."""
    return override.install(model, "weight_quantizer", fake_quant_groups, _blockwise)


def symmetric_weights(model: nn.Module) -> int:
    """Undo :func:`asymmetric_weights` (before ``mto.save``); returns how many quantizers it reset."""
    return override.remove(model, fake_quant_groups)
