"""The simulated reference's grid (pipeline/eval/fake_quant.py) against ONNX Runtime's own quantizer: the contract
is MLAS's BlockwiseQuantizer (onnxruntime/core/mlas/lib/q4_dq.cpp, microsoft/onnxruntime@04000081), which
MatMulNBitsQuantizer's round-to-nearest path calls through quantize_matmul_4bits / quantize_matmul_8bits. Equal bit
for bit: a simulation that differs from the engine's grid is no yardstick for it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.eval.fake_quant import block_rtn, int8_rows, roundf


def _ort_dequantized(w_kn: np.ndarray, bits: int, block: int, symmetric: bool) -> np.ndarray:
    """B [K, N] quantized by the installed ONNX Runtime (the call MatMulNBitsQuantizer makes) and dequantized as
    MatMulNBits reads it: (q - zero point) * scale, zero point 2^(bits-1) when the graph has none (symmetric)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    k, n = w_kn.shape
    kb, pack = k // block, 8 // bits
    packed = np.zeros((n, kb, block // pack), np.uint8)
    zp = np.zeros((n, (kb + pack - 1) // pack), np.uint8)
    scales = np.zeros((n, kb), np.float32)
    (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(packed, w_kn, scales, zp, block, n, k, symmetric)
    if bits == 4:
        q = np.stack([packed & 0xF, packed >> 4], -1).reshape(n, kb, block)
        z = np.stack([zp & 0xF, zp >> 4], -1).reshape(n, -1)[:, :kb]
    else:
        q, z = packed.reshape(n, kb, block), zp[:, :kb]
    z = np.full((n, kb), 2 ** (bits - 1)) if symmetric else z
    return ((q.astype(np.float32) - z.astype(np.float32)[..., None]) * scales[..., None]).reshape(n, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block", [16, 32, 128])
def test_block_rtn_equals_onnxruntime_quantizer_bit_for_bit(bits, symmetric, block):
    rng = np.random.default_rng(bits * 1000 + block + symmetric)
    for scale in (0.02, 1.0, 300.0):
        w = (rng.standard_normal((512, 24)) * scale).astype(np.float32)
        w[:block, 0] = 0.0                              # an all-zero block: scale 0
        w[:block, 1] = np.abs(w[:block, 1])             # all positive: the largest magnitude is the max
        w[:, 2] = np.round(w[:, 2] * 4) / 4             # many exact halves after scaling (roundf vs round-half-even)
        ours = block_rtn(torch.from_numpy(np.ascontiguousarray(w.T)), bits, block, symmetric).numpy()
        theirs = _ort_dequantized(w, bits, block, symmetric)
        assert np.array_equal(ours, theirs), (scale, np.abs(ours - theirs).max())


def test_block_rtn_is_a_coarse_grid_not_the_identity():
    """Guards against a simulation that quantizes nothing (it would 'match' an FP32 engine)."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q4 = block_rtn(w, 4, 32, True)
    per_block = q4.reshape(64, -1, 32)
    assert all(len(torch.unique(b)) <= 16 for b in per_block.reshape(-1, 32)[:50])
    rel = ((q4 - w).norm() / w.norm()).item()
    assert 0.05 < rel < 0.2                              # 4-bit RTN of a Gaussian: ~10 % relative error
    assert ((block_rtn(w, 8, 32, True) - w).norm() / w.norm()).item() < rel / 10


def test_fp16_scales_are_what_the_cuda_engine_holds():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    a, b = block_rtn(w, 4, 128, True), block_rtn(w, 4, 128, True, torch.float16)
    assert not torch.equal(a, b) and torch.allclose(a, b, rtol=1e-3, atol=0)
    for ra, rb in zip(a, b):                             # K = 128: one block per row, one fp16-rounded scale
        ratio = (rb / ra)[ra != 0]
        assert torch.allclose(ratio, ratio[:1].expand_as(ratio), rtol=1e-6, atol=0)


def test_roundf_rounds_halves_away_from_zero():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 2.4, -2.6])
    assert roundf(x).tolist() == [1.0, 2.0, 3.0, -1.0, -3.0, 0.0, 2.0, -3.0]


def test_int8_rows_equal_the_embedding_quantizer():
    from pipeline.ort.quantize import quantize_embedding_int8
    from onnx import helper, numpy_helper, TensorProto

    rng = np.random.default_rng(3)
    table = (rng.standard_normal((16, 12)) * 0.1).astype(np.float32)
    table[3] = 0.0
    g = helper.make_graph([helper.make_node("Gather", ["emb", "ids"], ["out"], axis=0)], "g",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [None, 12])],
                          [numpy_helper.from_array(table, "emb")])
    model = helper.make_model(g)
    quantize_embedding_int8(model, vocab=16)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    theirs = inits["emb_int8"].astype(np.float32) * inits["emb_rowscale"]
    assert np.array_equal(int8_rows(torch.from_numpy(table)).numpy(), theirs)
