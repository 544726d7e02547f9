"""Weights put on ONNX Runtime's weight-only grids, in torch (fake quantization: quantize, then dequantize back to
fp32). The simulated reference of ``validate.reference: simulated`` is the FP32 torch model with these weights.

The grid is MLAS's ``BlockwiseQuantizer::quantizeAndTranspose``, which ``MatMulNBitsQuantizer``'s round-to-nearest
path reaches through ``quantize_matmul_4bits`` / ``quantize_matmul_8bits`` (onnxruntime/core/mlas/lib/q4_dq.cpp,
``range2scale`` / ``range2scalezp``, microsoft/onnxruntime@04000081). Per output channel (a row of torch's Linear
weight ``[N, K]``, a column of the MatMul's B ``[K, N]``), blocks of ``block`` inputs:

- symmetric: ``m`` = the block's value of largest magnitude (its max when ``|max| > |min|``, else its min, sign
  kept), ``scale = -m / 2^(bits-1)``, zero point ``2^(bits-1)`` (MatMulNBits' default when it has none);
- asymmetric: ``lo = min(min, 0)``, ``hi = max(max, 0)``, ``scale = (hi - lo) / (2^bits - 1)``, zero point
  ``clamp(roundf(-lo / scale), 0, 2^bits - 1)``;
- ``q = clamp(roundf(v * (1 / scale) + zp), 0, 2^bits - 1)`` in fp32 (``roundf``: halves away from zero; a zero
  scale gives ``q = zp``), and the weight the kernel uses is ``(q - zp) * scale``, with ``scale`` stored as the
  graph's float type (fp16 once the CUDA engine's graph is converted: ``scale_dtype``).

``tests/eval/test_fake_quant.py`` checks this against the installed ONNX Runtime's own quantizer, bit for bit.
The embedding's int8 rows (``pipeline.ort.quantize.quantize_embedding_int8``: ``absmax / 127`` per row, numpy's
round-half-to-even) are :func:`int8_rows`.
"""

from __future__ import annotations

import fnmatch

import torch

__all__ = ["block_rtn", "int8_rows", "roundf", "simulate_model"]

ROWS = 8192     # output channels fake-quantized at a time


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: to the nearest integer, halves away from zero (torch.round rounds halves to even)."""
    t = torch.trunc(x)
    return t + torch.where((x - t).abs() >= 0.5, torch.sign(x), torch.zeros_like(x))


def block_rtn(w: torch.Tensor, bits: int, block: int, symmetric: bool,
              scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w`` ([N, K], a Linear's weight) on MatMulNBits' round-to-nearest grid, as fp32 (see the module docstring).
    A partial last block is padded with zeros, as ORT pads the weight before quantizing."""
    n, k = w.shape
    x = w.detach().to(torch.float32)
    pad = (-k) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    x = x.reshape(n, -1, block)
    qmax = float(2 ** bits - 1)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    if symmetric:
        m = torch.where(hi.abs() > lo.abs(), hi, lo)
        scale = -m / float(2 ** (bits - 1))
        zp = torch.full_like(scale, float(2 ** (bits - 1)))
    else:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        scale = (hi - lo) / qmax
        safe = torch.where(scale != 0, scale, torch.ones_like(scale))
        zfp = torch.where(scale != 0, -lo / safe, lo)
        zp = roundf(zfp).clamp(0.0, qmax)
    recip = torch.where(scale != 0, 1.0 / torch.where(scale != 0, scale, torch.ones_like(scale)),
                        torch.zeros_like(scale))
    q = roundf(x * recip + zp).clamp(0.0, qmax)
    stored = scale.to(scale_dtype).to(torch.float32)      # the scale as the engine's graph holds it
    return ((q - zp) * stored).reshape(n, -1)[:, :k]


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """The embedding table as pipeline/ort/quantize.py's ``quantize_embedding_int8`` stores it: int8 per row,
    symmetric, ``scale = absmax / 127`` (1 for an all-zero row), numpy's round (halves to even), as fp32."""
    x = w.detach().to(torch.float32)
    absmax = x.abs().amax(1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    return torch.round(x / scale).clamp(-127, 127) * scale


def _grid_for(name: str, spec: dict) -> dict | None:
    if any(fnmatch.fnmatch(name, p) for p in spec.get("exclude", ())):
        return None
    if name == "lm_head" and spec.get("lm_head"):
        return spec["lm_head"]
    return spec["linear"]


@torch.no_grad()
def simulate_model(model: torch.nn.Module, spec: dict) -> dict:
    """Put ``model``'s weights on the grids of ``spec`` in place (pipeline.ort.quantize.weight_grid writes it):
    every ``nn.Linear`` not matched by ``spec["exclude"]`` (fnmatch on module names) on ``spec["linear"]``, the
    lm_head on ``spec["lm_head"]`` when given, the input embedding on int8 rows when ``spec["embedding"]`` is
    ``int8_rows``. A tied lm_head is untied first (the ONNX graph gives it its own copy). Returns what was done."""
    scale_dtype = getattr(torch, spec.get("scale_dtype", "float32"))
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is not None and head.weight is emb.weight:
        head.weight = torch.nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
    done = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            grid = _grid_for(name, spec)
            if grid is None:
                continue
            # by rows (each row's blocks are its own): the temporaries of a 7B lm_head stay a few hundred MB
            for i in range(0, mod.weight.shape[0], ROWS):
                rows = mod.weight[i:i + ROWS]
                rows.copy_(block_rtn(rows, grid["bits"], grid["block"], grid["symmetric"], scale_dtype))
            key = f"int{grid['bits']} {'sym' if grid['symmetric'] else 'asym'} block {grid['block']}"
            done[key] = done.get(key, 0) + 1
    if spec.get("embedding") == "int8_rows":
        for i in range(0, emb.weight.shape[0], ROWS):
            emb.weight[i:i + ROWS].copy_(int8_rows(emb.weight[i:i + ROWS]))
        done["embedding int8 rows"] = 1
    return done
