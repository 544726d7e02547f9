"""Per-token dynamic INT8 MatMuls in standard ONNX ops (issue 41: an INT8 prompt that is fast and batch-invariant).

``y = MatMul(x, W)`` becomes, for the weight MatMuls named:

    m   = max(ReduceMax(|x|, last axis), eps)          one scale per token (row): no other row takes part
    xq  = Cast<uint8>(Round(x * 127 / m) + 128)         x quantized once per input tensor, shared by its consumers
    acc = MatMulInteger(xq, Wq, 128)                    u8 x s8 -> int32 (MLAS: VNNI / AMX / AVX2 kernels)
    y   = Cast<float>(acc) * (m / 127) * s              s: W's per-output-channel scale

ONNX Runtime's own dynamic quantizer (``quantize_dynamic``) takes ONE activation scale per tensor, over the whole
batch (DynamicQuantizeLinear), which makes a row's numbers depend on its batch-mates; MatMulIntegerToFloat's
``a_scale`` is per tensor or per column of A, not per row (onnxruntime/core/graph/contrib_ops/quantization_defs.cc,
microsoft/onnxruntime@9c69a3b7), so the per-row scale is applied after the integer product here.

Weights: symmetric per output channel, ``weight_bits`` 7 ([-63, 63]) or 8 ([-127, 127]). MLAS runs u8 x s8 on AVX2
and AVX-512 without VNNI with vpmaddubsw, whose 16-bit pair sums saturate at 2 x 255 x 127 but not at 2 x 255 x 63
(pipeline/ort/quantize.py ``isa_accuracy_risk``): 7-bit weights avoid it, or MLAS's exact U8U8 kernels
(:data:`SESSION_CONFIG`, what forge's ``per_token`` method uses with 8-bit weights).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["per_token_int8", "quantize_weight_per_channel", "SESSION_CONFIG"]

# What the graph's session needs on CPUs whose u8 x s8 sums saturate (x86 without VNNI / AMX), written into its
# forge_ort.json (pipeline/ort/engine.py SATURATING_U8S8_CONFIG_KEY, applied there only): MLAS's U8U8 kernels, exact
# with full-range s8 weights (kOrtSessionOptionsAvx2PrecisionMode in
# include/onnxruntime/core/session/onnxruntime_session_options_config_keys.h, microsoft/onnxruntime@5bbf2675). Not
# everywhere: with VNNI it also takes the U8U8 path, measured 0.56x the prompt speed (x86_64-avx512vnni). 7-bit
# weights avoid the overflow too but measured +3.0 % against +1.5 % ppl on SmolLM2 (docs/quantization.md).
SESSION_CONFIG = {"session.x64quantprecision": "1"}

# The per-token graph's revision, in the quantize stage's key of recipes that make one (pipeline/stages/onnxruntime.py):
# 2: MatMulIntegerToFloat (the channel scale inside the integer GEMM), q/k/v and gate/up packed, outlier_channels
LAYOUT = "2"


def quantize_weight_per_channel(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``w`` [K, N] float -> (int8 [K, N], float32 scale [N]): symmetric, round half to even, a zero column scale 1."""
    qmax = 2 ** (bits - 1) - 1
    absmax = np.abs(w).max(axis=0).astype(np.float32)
    scale = np.where(absmax > 0, absmax / np.float32(qmax), np.float32(1.0)).astype(np.float32)
    return np.clip(np.round(w / scale), -qmax, qmax).astype(np.int8), scale


def per_token_int8(model: Any, names: list[str], *, weight_bits: int = 7,
                   outliers: dict[str, np.ndarray] | None = None) -> dict:
    """Rewrite the weight MatMuls of ``model`` (an in-memory ONNX ModelProto with its weights loaded) named in
    ``names`` to per-token dynamic INT8, in place. Returns counts of what was done.

    ``outliers``: activation tensor -> the input channels kept in fp32 (LLM.int8()'s decomposition, Dettmers et al.
    2022): those columns of x are zeroed before the row's scale is taken and multiply their weight rows in an fp32
    MatMul added to the integer product, so a few large channels no longer set every other channel's step; the
    weight rows they leave are zero in the int8 weight (finer per-channel weight scales too). Still per row."""
    from onnx import TensorProto, helper, numpy_helper

    if weight_bits not in (7, 8):
        raise ValueError(f"weight_bits must be 7 or 8, not {weight_bits}")
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    wanted = set(names)
    prefix = "forge_pt"
    consts = {f"{prefix}_axis": np.array([-1], np.int64), f"{prefix}_eps": np.array(1e-12, np.float32),
              f"{prefix}_127": np.array(127.0, np.float32), f"{prefix}_128": np.array(128.0, np.float32),
              f"{prefix}_zp": np.array(128, np.uint8), f"{prefix}_one": np.array(1.0, np.float32)}
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    outliers = outliers or {}
    # activation tensor -> (its uint8 tensor, its row scale, its fp32 outlier columns or None)
    quantized: dict[str, tuple[str, str, str | None]] = {}
    nodes, done, dropped = [], 0, set()
    for node in g.node:
        if node.op_type != "MatMul" or node.name not in wanted or node.input[1] not in inits:
            nodes.append(node)
            continue
        x, wname = node.input[0], node.input[1]
        w = numpy_helper.to_array(inits[wname]).astype(np.float32)
        idx = np.asarray(outliers.get(x, ()), np.int64)
        if x not in quantized:
            p = f"{prefix}/{len(quantized)}"
            src, cols = x, None
            if idx.size:
                mask = np.ones(w.shape[0], np.float32)
                mask[idx] = 0
                src, cols = f"{p}/inliers", f"{p}/outliers"
                g.initializer.extend([numpy_helper.from_array(mask, f"{p}/inlier_mask"),
                                      numpy_helper.from_array(idx, f"{p}/outlier_idx")])
                nodes += [helper.make_node("Mul", [x, f"{p}/inlier_mask"], [src], name=f"{p}/Inliers"),
                          helper.make_node("Gather", [x, f"{p}/outlier_idx"], [cols], name=f"{p}/Outliers", axis=-1)]
            xs = [f"{p}/abs", f"{p}/max", f"{p}/max_eps", f"{p}/inv", f"{p}/scaled", f"{p}/round", f"{p}/shift",
                  f"{p}/xq", f"{p}/row_scale"]
            nodes += [
                helper.make_node("Abs", [src], [xs[0]], name=f"{p}/Abs"),
                helper.make_node("ReduceMax", [xs[0], f"{prefix}_axis"], [xs[1]], name=f"{p}/ReduceMax", keepdims=1),
                helper.make_node("Max", [xs[1], f"{prefix}_eps"], [xs[2]], name=f"{p}/Max"),
                helper.make_node("Div", [f"{prefix}_127", xs[2]], [xs[3]], name=f"{p}/Inv"),
                helper.make_node("Mul", [src, xs[3]], [xs[4]], name=f"{p}/Scale"),
                helper.make_node("Round", [xs[4]], [xs[5]], name=f"{p}/Round"),
                helper.make_node("Add", [xs[5], f"{prefix}_128"], [xs[6]], name=f"{p}/Shift"),
                helper.make_node("Cast", [xs[6]], [xs[7]], name=f"{p}/ToUint8", to=TensorProto.UINT8),
                helper.make_node("Div", [xs[2], f"{prefix}_127"], [xs[8]], name=f"{p}/RowScale"),
            ]
            quantized[x] = (xs[7], xs[8], cols)
        xq, row_scale, cols = quantized[x]
        base = node.name
        y, tail = node.output[0], []
        if cols is not None:
            g.initializer.append(numpy_helper.from_array(w[idx], f"{base}/W_outliers"))
            w = w.copy()
            w[idx] = 0
            y = f"{base}/int8_part"
            tail = [helper.make_node("MatMul", [cols, f"{base}/W_outliers"], [f"{base}/fp32_part"],
                                     name=f"{base}/OutlierMatMul"),
                    helper.make_node("Add", [y, f"{base}/fp32_part"], [node.output[0]], name=f"{base}/AddOutliers")]
        wq, ws = quantize_weight_per_channel(w, weight_bits)
        g.initializer.extend([numpy_helper.from_array(wq, f"{base}/Wq"), numpy_helper.from_array(ws, f"{base}/Ws")])
        # the integer product, its cast and the channel scale in one kernel (MLAS scales the int32 tile as it
        # leaves the GEMM); the row scale after it
        nodes += [
            helper.make_node("MatMulIntegerToFloat", [xq, f"{base}/Wq", f"{prefix}_one", f"{base}/Ws",
                                                      f"{prefix}_zp"], [f"{base}/channel_scaled"],
                             name=f"{base}/MatMulIntegerToFloat", domain="com.microsoft"),
            helper.make_node("Mul", [f"{base}/channel_scaled", row_scale], [y], name=f"{base}/RowScale"),
        ] + tail
        dropped.add(wname)
        done += 1
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input}
    for init in [i for i in g.initializer if i.name in dropped and i.name not in used]:
        g.initializer.remove(init)
    return {"per_token_matmuls": done, "quantized_inputs": len(quantized), "weight_bits": weight_bits,
            "fp32_outlier_channels": int(sum(len(v) for k, v in outliers.items() if k in quantized))}
