"""Issue 41, INT8 prefill: one SmolLM2-135M layer's seven weight MatMuls (random weights, the real shapes) at M = 256
(a prompt) and M = 1 (decode), ONNX Runtime CPU, 2 threads, medians of 7 samples of >= 150 ms, four layouts:

  fp32    MatMul
  nbits8  MatMulNBits 8-bit, block 32, accuracy_level 4 (the default engine's `blockwise`)
  dyn     DynamicQuantizeMatMul: ONE activation scale per tensor (the `mixed` method; not batch-invariant)
  tok     per-token dynamic INT8 in standard ops: a scale per row (ReduceMax |x| / 127), x/s rounded + 128 as uint8,
          MatMulInteger u8 x s8 (per-output-channel weights), times row scale x channel scale -- batch-invariant

    python lab/int8_prefill_probe.py

Prints each layout's time and speed-up over fp32, and checks bitwise that a row gives the same `tok` output alone as
in a batch whose other rows are 100x larger. Caveat: u8 x s8 with full-range s8 weights saturates on CPUs without
VNNI (pipeline/ort/quantize.py isa_accuracy_risk): a product `tok` needs 7-bit weights there."""
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
rng = np.random.default_rng(0)
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
def graph(kind):
    nodes, inits = [], []
    for i, (k, n) in enumerate(SHAPES):
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        x = "x" if k == 576 else "h"
        y = f"y{i}"
        if kind == "fp32":
            inits.append(nh.from_array(w, f"w{i}")); nodes.append(h.make_node("MatMul", [x, f"w{i}"], [y]))
        elif kind == "dyn":
            s = np.abs(w).max(0) / 127; q = np.round(w / s).astype(np.int8)
            inits += [nh.from_array(q, f"q{i}"), nh.from_array(s.astype(np.float32), f"s{i}")]
            nodes.append(h.make_node("DynamicQuantizeMatMul", [x, f"q{i}", f"s{i}"], [y], domain="com.microsoft"))
        elif kind == "tok":
            s = np.abs(w).max(0) / 127; q = np.round(w / s).astype(np.int8)
            inits += [nh.from_array(q, f"q{i}"), nh.from_array(s.astype(np.float32), f"s{i}")]
            p = f"p{i}_"
            nodes += [h.make_node("Abs", [x], [p+"a"]), h.make_node("ReduceMax", [p+"a", "ax"], [p+"m"], keepdims=1),
                      h.make_node("Max", [p+"m", "eps"], [p+"m2"]), h.make_node("Div", [p+"m2", "c127"], [p+"rs"]),
                      h.make_node("Div", [x, p+"rs"], [p+"xs"]),
                      h.make_node("Round", [p+"xs"], [p+"xr"]), h.make_node("Add", [p+"xr", "f128"], [p+"xa"]),
                      h.make_node("Cast", [p+"xa"], [p+"xu"], to=T.UINT8),
                      h.make_node("MatMulInteger", [p+"xu", f"q{i}", "zp128u"], [p+"acc"]),
                      h.make_node("Cast", [p+"acc"], [p+"accf"], to=T.FLOAT),
                      h.make_node("Mul", [p+"accf", p+"rs"], [p+"t"]), h.make_node("Mul", [p+"t", f"s{i}"], [y])]
        elif kind == "nbits8":
            bl = 32; qq = w.T.reshape(n, k // bl, bl); sc = np.abs(qq).max(-1) / 127
            qv = (np.round(qq / sc[..., None]) + 128).astype(np.uint8)
            inits += [nh.from_array(qv, f"q{i}"), nh.from_array(sc.reshape(-1).astype(np.float32), f"s{i}")]
            nodes.append(h.make_node("MatMulNBits", [x, f"q{i}", f"s{i}"], [y], domain="com.microsoft", K=k, N=n,
                                     bits=8, block_size=bl, accuracy_level=4))
    inits += [nh.from_array(np.array([-1], np.int64), "ax"), nh.from_array(np.array(1e-8, np.float32), "eps"),
              nh.from_array(np.array(127, np.float32), "c127"), nh.from_array(np.array(128, np.float32), "f128"),
              nh.from_array(np.array(128, np.uint8), "zp128u")]
    outs = [h.make_tensor_value_info(f"y{i}", T.FLOAT, None) for i in range(len(SHAPES))]
    g = h.make_graph(nodes, kind, [h.make_tensor_value_info("x", T.FLOAT, ["m", 576]),
                                   h.make_tensor_value_info("h", T.FLOAT, ["m", 1536])], outs, inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)]); m.ir_version = 9
    return m
so = ort.SessionOptions(); so.log_severity_level = 3; so.intra_op_num_threads = 2; so.inter_op_num_threads = 1
res = {}
for kind in ("fp32", "nbits8", "dyn", "tok"):
    s = ort.InferenceSession(graph(kind).SerializeToString(), so, providers=["CPUExecutionProvider"])
    for M in (256, 1):
        feeds = {"x": rng.standard_normal((M, 576)).astype(np.float32), "h": rng.standard_normal((M, 1536)).astype(np.float32)}
        for _ in range(5): s.run(None, feeds)
        ts = []
        for _ in range(7):
            t0 = time.perf_counter(); n = 0
            while time.perf_counter() - t0 < 0.15: s.run(None, feeds); n += 1
            ts.append((time.perf_counter() - t0) / n)
        res[(kind, M)] = sorted(ts)[3]
for M in (256, 1):
    base = res[("fp32", M)]
    print(f"M={M}: " + ", ".join(f"{k} {res[(k, M)]*1e6:.0f} us ({base/res[(k, M)]:.2f}x fp32)" for k in ("fp32", "nbits8", "dyn", "tok")))
# batch invariance of tok: row 0 alone vs in a batch
s = ort.InferenceSession(graph("tok").SerializeToString(), so, providers=["CPUExecutionProvider"])
x = rng.standard_normal((8, 576)).astype(np.float32) * np.array([1, 1, 1, 100, 1, 1, 1, 1], np.float32)[:, None]
hh = rng.standard_normal((8, 1536)).astype(np.float32)
a = s.run(None, {"x": x, "h": hh}); b = s.run(None, {"x": x[:1], "h": hh[:1]})
print("tok batch-invariant row 0:", all(np.array_equal(u[:1], v) for u, v in zip(a, b)))
