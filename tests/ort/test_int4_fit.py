"""pipeline/ort/int4_fit.py: 4-bit weights with integer zero points in MatMulNBits' layout (issue 41). The packed
tensors are run by ONNX Runtime itself and checked against the dequantized weights; the fits are checked to lower
the error they minimise against round-to-nearest, the layout ORT's own RTN quantizer writes."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.ort.int4_fit import (QMAX, block_sum_input, dequantize, effective_weight, fit_int4, gptq_int4,
                                  offsets_int4, pack_int4, rtn_int4, weighted_error)


def _run_nbits(q, s, z, block, x, accuracy_level):
    import onnxruntime as ort

    n, k = q.shape
    b, sc, zp = pack_int4(q, s, z, block)
    node = helper.make_node("MatMulNBits", ["x", "B", "scales", "zp"], ["y"], domain="com.microsoft", K=k, N=n,
                            bits=4, block_size=block, accuracy_level=accuracy_level)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                          [numpy_helper.from_array(b, "B"), numpy_helper.from_array(sc, "scales"),
                           numpy_helper.from_array(zp, "zp")])
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17),
                                                            helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("k,block", [(96, 32), (128, 32), (64, 16)])   # 3 blocks: the zero points' padding nibble
def test_packed_tensors_run_in_onnxruntime_as_the_dequantized_weight(k, block):
    rng = np.random.default_rng(0)
    n = 24
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, s, z = fit_int4(w, block=block)
    x = rng.standard_normal((5, k)).astype(np.float32)
    want = x @ dequantize(q, s, z, block)
    np.testing.assert_allclose(_run_nbits(q, s, z, block, x, 1), want, rtol=1e-4, atol=1e-4)
    # accuracy_level 4 (the fast kernels): activations rounded to int8 per block, so close but not equal
    got4 = _run_nbits(q, s, z, block, x, 4)
    assert np.abs(got4 - want).max() < 0.05 * np.abs(want).max()


def test_pack_rejects_values_outside_4_bits():
    q = np.full((2, 32), 16, np.uint8)
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(q, np.ones((2, 1), np.float32), np.zeros((2, 1), np.uint8), 32)


def test_fit_lowers_the_weighted_error_of_round_to_nearest():
    rng = np.random.default_rng(1)
    k, n, block = 256, 64, 32
    w = rng.standard_normal((k, n)).astype(np.float32) * rng.uniform(0.2, 2, (1, n)).astype(np.float32)
    h = rng.uniform(0.01, 10, k)                       # uneven channel importance
    err = lambda q, s, z: weighted_error(w, q, s, z, block, h)  # noqa: E731
    e_rtn, e_fit, e_unw = err(*rtn_int4(w, block)), err(*fit_int4(w, h, block)), err(*fit_int4(w, None, block))
    assert e_fit < 0.85 * e_rtn and e_fit < e_unw
    q, s, z = fit_int4(w, h, block)
    assert q.dtype == np.uint8 and q.max() <= QMAX and z.max() <= QMAX and (s > 0).all()
    assert q.shape == (n, k) and s.shape == z.shape == (n, k // block)


def test_fit_of_weights_already_on_an_integer_zero_grid_is_exact():
    """A weight that is s (q - z) with integer z (what MatMulNBits stores) comes back unchanged."""
    rng = np.random.default_rng(2)
    k, n, block = 64, 8, 32
    s = rng.uniform(0.01, 0.1, (n, k // block)).astype(np.float32)
    z = rng.integers(3, 12, (n, k // block)).astype(np.uint8)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    q[:, ::block], q[:, 1::block] = 0, 15                  # every block spans the full range
    w = dequantize(q, s, z, block)
    q2, s2, z2 = fit_int4(w, None, block)
    np.testing.assert_allclose(dequantize(q2, s2, z2, block), w, rtol=1e-5, atol=1e-6)


def test_gptq_lowers_the_output_error_on_correlated_inputs():
    """GPTQ minimises ||X (W - W_q)||^2; with correlated input channels it beats the per-weight fit there."""
    rng = np.random.default_rng(3)
    k, n, block = 128, 32, 32
    mix = rng.standard_normal((k, k)) * 0.3 + np.eye(k)
    x = rng.standard_normal((2048, k)) @ mix
    w = rng.standard_normal((k, n)).astype(np.float32)
    hess = x.T @ x / len(x)
    out_err = lambda q, s, z: float(((x @ (dequantize(q, s, z, block) - w)) ** 2).mean())  # noqa: E731
    e_fit = out_err(*fit_int4(w, np.diag(hess), block))
    e_gptq = out_err(*gptq_int4(w, hess, block))
    assert e_gptq < 0.8 * e_fit
    q, s, z = gptq_int4(w, hess, block)
    assert q.max() <= QMAX and z.max() <= QMAX and (s > 0).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        fit_int4(np.ones((48, 4), np.float32), block=32)
    with pytest.raises(ValueError, match="channel weights have 3 entries"):
        fit_int4(np.ones((64, 4), np.float32), np.ones(3), block=32)


def _q41(rng, k, n, block=32):
    """Weights the way SmolLM2's ship: Q4_1, d q + m per block of 32 (float scale and float minimum), d = (max -
    min) / 15 and m = min of the original block (llama.cpp's quantize_row_q4_1), so levels 0 and 15 both occur."""
    d = rng.uniform(0.005, 0.05, (n, k // block, 1))
    m = -d * rng.uniform(3, 12, (n, k // block, 1))
    q = rng.integers(0, 16, (n, k // block, block))
    q[..., 0], q[..., -1] = 0, 15
    return (d * q + m).reshape(n, k).T.astype(np.float32)


def test_block_offsets_hold_a_float_minimum_that_integer_zero_points_cannot():
    """Q4_1 weights: an integer zero point leaves each block offset by up to s/2 (the fit trades that against the
    scale); the offset rows carry it at 4 bits, ~16x finer. Says nothing about models whose weights were not
    stored at 4 bits with a float minimum (the recipe and docs say so)."""
    rng = np.random.default_rng(4)
    k, n, block = 128, 16, 32
    w = _q41(rng, k, n, block)
    q, s, z, k_aug = offsets_int4(w, None, block)
    assert k_aug == k + k // block and q.shape == (n, k + block) and s.shape == z.shape == (n, k // block + 1)
    e_off = float(((effective_weight(q, s, z, block, k) - w) ** 2).sum())
    e_fit = weighted_error(w, *fit_int4(w, None, block), block)
    assert e_off < e_fit / 50


def test_block_offset_graph_runs_in_onnxruntime_as_the_effective_weight():
    import onnxruntime as ort

    rng = np.random.default_rng(5)
    k, n, block = 96, 8, 32
    w = _q41(rng, k, n, block)
    q, s, z, k_aug = offsets_int4(w, None, block)
    b, sc, zp = pack_int4(q, s, z, block)
    nodes, inits = block_sum_input("x", block, "x_aug")
    nodes.append(helper.make_node("MatMulNBits", ["x_aug", "B", "scales", "zp"], ["y"], domain="com.microsoft",
                                  K=k_aug, N=n, bits=4, block_size=block, accuracy_level=1))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, n])],
                          inits + [numpy_helper.from_array(b, "B"), numpy_helper.from_array(sc, "scales"),
                                   numpy_helper.from_array(zp, "zp")])
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17),
                                                            helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ effective_weight(q, s, z, block, k), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y, x @ w, rtol=0.02, atol=0.02 * np.abs(x @ w).max())
