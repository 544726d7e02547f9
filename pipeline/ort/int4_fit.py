"""4-bit weights in the layout ONNX Runtime's fast MatMulNBits CPU kernels run: unsigned 4-bit values, one float
scale and one INTEGER zero point per block of ``block`` weights along the input dimension.

Why integer zero points: MatMulNBits with float zero points (HQQ's layout) is never pre-packed for MLAS's QNBit GEMM
and falls back to dequantizing B and an fp32 GEMM on every call (microsoft/onnxruntime
onnxruntime/contrib_ops/cpu/quantization/matmul_nbits.cc@001d12d2623fd411ce0f83d05abb5e82304a3389: PrePack returns
early when ``has_unquantized_zero_point_``, i.e. a zero-point input that is not uint8): 0.16x FP32 at M = 1 on
SmolLM2's MLP shapes, against 3.1x for uint8 zero points with ``accuracy_level`` 4.

How the values are fitted (round to nearest with min/max scales costs +24 % perplexity on SmolLM2): per block,
minimise the activation-weighted squared error sum_i h_i (w_i - s (q_i - z))^2, with h_i = E[x_i^2] of the MatMul's
input channel i from calibration (the "importance matrix" llama.cpp's quantizers weight by):

* ``fit_int4``: a search over scales around (max - min) / 15 and the integer zero points next to -min / s, each
  candidate's scale refitted by least squares for its rounding, then alternating steps (q | s, z; s | q, z; z | q, s
  rounded to an integer) -- HQQ's alternating optimisation (Badri & Shaji 2023) with the zero point kept integer.
* ``gptq_int4``: GPTQ (Frantar et al. 2023) with the same per-block fit at each block start: quantizes the input
  channels in order and moves each one's output error onto the channels not yet quantized (the full E[x x^T]).

``pack_int4`` writes the operator's tensors (docs/ContribOperators.md, com.microsoft.MatMulNBits@004b79eda305a216ab8d0
e21eabe81d7713eb768): B [N, n_blocks, block/2] uint8 with element 2j in the low nibble of byte j, scales [N * n_blocks],
zero_points [N * ceil(n_blocks / 2)] uint8, low nibble first, each column's row of zero points padded to whole bytes.
"""

from __future__ import annotations

import numpy as np

QMAX = 15   # unsigned 4-bit


def _blocks(w_kn: np.ndarray, block: int) -> np.ndarray:
    """MatMul B [K, N] -> [N, n_blocks, block] (blocks along the input dimension K, MatMulNBits' layout)."""
    k, n = w_kn.shape
    if k % block:
        raise ValueError(f"input width {k} is not a multiple of the block size {block}")
    return np.ascontiguousarray(w_kn.T, dtype=np.float32).reshape(n, k // block, block)


def _weights(h_k: np.ndarray | None, k: int, block: int) -> np.ndarray:
    """Per-input-channel weights as [1, n_blocks, block]; uniform without calibration. A channel never active in
    calibration keeps a small weight (1e-3 of the mean), so its weights are still fitted, just last."""
    if h_k is None:
        return np.ones((1, k // block, block), np.float32)
    h = np.asarray(h_k, np.float64).reshape(-1)
    if h.shape[0] != k:
        raise ValueError(f"channel weights have {h.shape[0]} entries, the input width is {k}")
    mean = h.mean() if h.mean() > 0 else 1.0
    h = np.maximum(h / mean, 1e-3)
    return h.astype(np.float32).reshape(1, k // block, block)


def _round_q(x, s, z):
    return np.clip(np.rint(x / s + z), 0, QMAX)


def fit_blocks(x: np.ndarray, hw: np.ndarray, *, grid: int = 9, spread: float = 0.2, iters: int = 4):
    """Scale and integer zero point per block of ``x`` [..., block] minimising sum hw (x - s (q - z))^2;
    returns (q, s, z) with q, z in 0..15 (float arrays) and s > 0."""
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)    # z in 0..15: the format's range always holds 0
    rng = np.maximum(hi - lo, 1e-12)
    sxx = (hw * x * x).sum(-1, keepdims=True)
    best = np.full(lo.shape, np.inf, np.float32)
    bs, bz = rng / QMAX, np.clip(np.rint(-lo / (rng / QMAX)), 0, QMAX)
    for f in np.linspace(1 - spread, 1 + spread, grid):
        s = rng / (QMAX * f)
        z0 = np.rint(-lo / s)
        for dz in (-1.0, 0.0, 1.0):
            z = np.clip(z0 + dz, 0, QMAX)
            e = _round_q(x, s, z) - z
            sxe = (hw * x * e).sum(-1, keepdims=True)
            see = (hw * e * e).sum(-1, keepdims=True)
            ok = (see > 0) & (sxe > 0)
            s_ls = np.where(ok, sxe / np.where(ok, see, 1), s)          # least-squares scale for this rounding
            err = np.where(ok, sxx - sxe * sxe / np.where(ok, see, 1), sxx)
            better = err < best
            best = np.where(better, err, best)
            bs, bz = np.where(better, s_ls, bs), np.where(better, z, bz)
    s, z = bs, bz
    for _ in range(iters):
        q = _round_q(x, s, z)
        e = q - z
        sxe, see = (hw * x * e).sum(-1, keepdims=True), (hw * e * e).sum(-1, keepdims=True)
        s = np.where((see > 0) & (sxe > 0), sxe / np.where(see > 0, see, 1), s)
        # z | q, s: minimiser of sum hw (x - s q + s z)^2 is z = sum hw (s q - x) / (s sum hw), rounded
        z = np.clip(np.rint((hw * (s * q - x)).sum(-1, keepdims=True) / (s * hw.sum(-1, keepdims=True))), 0, QMAX)
    q = _round_q(x, s, z)
    return q, s.astype(np.float32), z


def rtn_int4(w_kn: np.ndarray, block: int = 32):
    """Round to nearest with min/max scales and an integer zero point (ORT's RTN for MatMulNBits), the baseline
    the fits are measured against. Same outputs as :func:`fit_int4`."""
    x = _blocks(w_kn, block)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    s = (np.maximum(hi - lo, 1e-12) / QMAX).astype(np.float32)
    z = np.clip(np.rint(-lo / s), 0, QMAX)
    q = _round_q(x, s[..., None], z[..., None])
    return q.reshape(x.shape[0], -1).astype(np.uint8), s, z.astype(np.uint8)


def weighted_error(w_kn: np.ndarray, q, s, z, block: int, h: np.ndarray | None = None) -> float:
    """The calibration output error E||x (W - W_q)||^2 summed over the outputs: with ``h`` = E[x x^T] [K, K] (GPTQ's
    objective) or its diagonal E[x_i^2] [K] (the fit's); plain squared error when None."""
    d = (effective_weight(q, s, z, block, w_kn.shape[0]) - w_kn).astype(np.float64)
    if h is None:
        return float((d * d).sum())
    h = np.asarray(h, np.float64)
    return float(((h @ d) * d).sum()) if h.ndim == 2 else float((h[:, None] * d * d).sum())


def fit_int4(w_kn: np.ndarray, h_k: np.ndarray | None = None, block: int = 32, **kw):
    """4-bit fit of a MatMul weight B [K, N]: (q [N, K] uint8, scales [N, n_blocks] f32, zero points [N, n_blocks]
    uint8). ``h_k``: per-input-channel importance (E[x^2] over calibration), None: plain squared error."""
    x = _blocks(w_kn, block)
    q, s, z = fit_blocks(x, _weights(h_k, w_kn.shape[0], block), **kw)
    n = x.shape[0]
    return q.reshape(n, -1).astype(np.uint8), s[..., 0], z[..., 0].astype(np.uint8)


def gptq_int4(w_kn: np.ndarray, hess: np.ndarray, block: int = 32, damp: float = 0.01, lazy: int = 128, **kw):
    """GPTQ with per-block (scale, integer zero) from :func:`fit_blocks` on the error-updated weights, weighted by
    diag(``hess``); ``hess`` = E[x x^T] of the MatMul's input [K, K]. Same outputs as :func:`fit_int4`."""
    k, n = w_kn.shape
    W = np.array(w_kn.T, dtype=np.float64)                   # [N, K]: GPTQ walks the input channels (columns)
    H = np.array(hess, dtype=np.float64)
    dead = np.diag(H) <= 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H[np.diag_indices(k)] += damp * np.mean(np.diag(H))
    # upper Cholesky factor of H^-1 (the GPTQ paper's formulation)
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T
    diag = np.diag(H).astype(np.float32)
    Q = np.zeros((n, k), np.uint8)
    S = np.zeros((n, k // block), np.float32)
    Z = np.zeros((n, k // block), np.uint8)
    lazy = max(block, lazy - lazy % block)
    for i1 in range(0, k, lazy):
        i2 = min(i1 + lazy, k)
        W1 = W[:, i1:i2].copy()
        Err = np.zeros_like(W1)
        Hi = Hinv[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = i1 + j
            if col % block == 0:
                b = col // block
                xb = W1[:, j:j + block].astype(np.float32)[:, None, :]
                hw = np.maximum(diag[col:col + block] / max(float(diag.mean()), 1e-12), 1e-3)[None, None, :]
                _, s, z = fit_blocks(xb, hw, **kw)
                S[:, b], Z[:, b] = s[:, 0, 0], z[:, 0, 0].astype(np.uint8)
                s_col, z_col = s[:, 0, 0].astype(np.float64), z[:, 0, 0].astype(np.float64)
            w = W1[:, j]
            q = np.clip(np.rint(w / s_col + z_col), 0, QMAX)
            Q[:, col] = q.astype(np.uint8)
            err = (w - (q - z_col) * s_col) / Hi[j, j]
            W1[:, j:] -= np.outer(err, Hi[j, j:])
            Err[:, j] = err
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    return Q, S, Z


def offsets_int4(w_kn: np.ndarray, h_k: np.ndarray | None = None, block: int = 32, **kw):
    """4-bit with per-block float offsets carried by extra input columns ("block offsets").

    Each block is w ~ s (q - z) + d: scale s and min from the block's range, z = round(-min / s) (integer), and d, the
    rest of the offset that an integer zero point cannot hold (|d| <= s / 2), a float per block. d is stored as
    ``n_blocks`` more rows of the weight, themselves 4-bit with integer zero points (:func:`fit_int4`): the MatMul
    then reads x' = [x, blocksum(x)] (the sums of x over each block) -- x' W' = x W_q + blocksum(x) D. Same outputs
    as :func:`fit_int4` for the augmented weight [K + n_blocks rounded up to whole blocks, N] (padding rows zero,
    weight 0 in the fit); ``k_aug`` = K + n_blocks is the MatMul's true input width."""
    x = _blocks(w_kn, block)
    n, nb, _ = x.shape
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    s = np.maximum(hi - lo, 1e-12) / QMAX
    z = np.clip(np.rint(-lo / s), 0, QMAX)
    q = np.clip(np.rint((x - lo) / s), 0, QMAX)       # the grid of the block's own min: q s + lo
    d = (lo + s * z)[..., 0]                          # lo = s (0 - z) + d
    k = w_kn.shape[0]
    k_aug = k + nb
    rows = -(-k_aug // block) * block - k             # offset rows, padded to whole blocks
    extra = np.zeros((rows, n), np.float32)
    extra[:nb] = d.T
    hx = np.zeros(rows)
    if h_k is None:
        hx[:nb] = 1.0
    else:   # the block sums' importance: E[(sum over the block of x)^2] ~ 32 x the block's mean E[x_i^2]
        hx[:nb] = np.asarray(h_k, np.float64).reshape(nb, block).sum(-1)
    hx[nb:] = 0.0
    q2, s2, z2 = fit_int4(extra, np.where(hx > 0, hx, 1e-9), block, **kw)
    q_all = np.concatenate([q.reshape(n, k).astype(np.uint8), q2], axis=1)
    return q_all, np.concatenate([s[..., 0].astype(np.float32), s2], 1), \
        np.concatenate([z[..., 0].astype(np.uint8), z2], 1), k_aug


def dequantize(q: np.ndarray, s: np.ndarray, z: np.ndarray, block: int) -> np.ndarray:
    """The weight B [K, N] that (q [N, K], s, z [N, n_blocks]) stand for."""
    n, k = q.shape
    x = (q.reshape(n, k // block, block).astype(np.float32) - z[..., None]) * s[..., None]
    return x.reshape(n, k).T


def effective_weight(q: np.ndarray, s: np.ndarray, z: np.ndarray, block: int, k: int) -> np.ndarray:
    """The weight [k, N] a 4-bit MatMul of input width ``k`` computes with: :func:`dequantize`, with the offset rows
    of :func:`offsets_int4` (present when q is wider than k) folded back onto their blocks."""
    wd = dequantize(q, s, z, block)
    if wd.shape[0] == k:
        return wd
    nb = k // block
    return wd[:k] + np.repeat(wd[k:k + nb], block, axis=0)


def pack_int4(q: np.ndarray, s: np.ndarray, z: np.ndarray, block: int):
    """MatMulNBits' tensors for 4 bits: (B [N, n_blocks, block/2] uint8, scales [N * n_blocks] f32,
    zero_points [N * ceil(n_blocks/2)] uint8); the module docstring cites the layout."""
    n, k = q.shape
    nb = k // block
    if np.any(q > QMAX) or np.any(z > QMAX):
        raise ValueError("4-bit values and zero points must lie in 0..15")
    qb = q.reshape(n, nb, block).astype(np.uint8)
    b = (qb[..., 0::2] | (qb[..., 1::2] << 4)).astype(np.uint8)
    zz = z.astype(np.uint8)
    if nb % 2:
        zz = np.concatenate([zz, np.zeros((n, 1), np.uint8)], axis=1)   # each column's row padded to whole bytes
    zp = (zz[:, 0::2] | (zz[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    return b, np.ascontiguousarray(s, np.float32).reshape(-1), zp


def block_sum_input(x: str, block: int, out: str) -> tuple[list, list]:
    """Nodes (and initializers) that make ``out`` = [x, blocksum(x)] from ``x`` [B, T, K]: the input of a MatMul whose
    weight carries :func:`offsets_int4`'s offset rows. Standard ONNX ops: Reshape [B, T, K / block, block],
    ReduceSum over the last axis, Concat on the last axis."""
    from onnx import helper, numpy_helper

    shape, axes = f"{out}_shape", f"{out}_axes"
    inits = [numpy_helper.from_array(np.array([0, 0, -1, block], np.int64), shape),
             numpy_helper.from_array(np.array([-1], np.int64), axes)]
    nodes = [helper.make_node("Reshape", [x, shape], [f"{out}_blocks"], name=f"{out}_reshape"),
             helper.make_node("ReduceSum", [f"{out}_blocks", axes], [f"{out}_sums"], name=f"{out}_sum", keepdims=0),
             helper.make_node("Concat", [x, f"{out}_sums"], [out], name=f"{out}_concat", axis=-1)]
    return nodes, inits

