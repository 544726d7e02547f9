"""Lab (issue 26): why is our INT4 decode slower than fp16 at 7B width? Time ONNX Runtime's MatMulNBits against an
fp16 MatMul at M=1 on the CUDA provider, for the quantizer settings forge's int4/int8wo recipes can choose.

The graph is a chain of ``--pairs`` Qwen2.5-7B MLP pairs (hidden -> intermediate -> hidden; distinct seeded random
weights, so nothing stays in L2), quantized by the same ``MatMulNBitsQuantizer`` forge's quantize stage calls
(pipeline/ort/quantize.py) and converted to fp16 by the same ``OnnxModel.convert_float_to_float16`` forge's build
stage calls (pipeline/ort/fp16.py). One sample loops ``run_with_iobinding`` for >= ``--min-ms`` ms; the figure is the
median of ``--samples`` samples, min/max kept. Bytes read per call are the initializers' bytes, so
``GB/s = bytes / time`` and ``pct_of_copy = GB/s / --copy-gbs`` (the H200's device-to-device copy, 4,260 GB/s, issue 26).

    python lab/nbits_kernel_bench.py --device cuda --out nbits.json      # on the GPU (lab/gpu_ort_run.sh --exec)
    python lab/nbits_kernel_bench.py --hidden 256 --inter 512 --pairs 1  # a CPU smoke test of the graph building
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VARIANTS = {   # name -> quantizer settings (None: the fp16 MatMul baseline)
    "fp16": None,
    "hqq-b32": {"algo": "hqq", "bits": 4, "block": 32},            # forge's int4 recipes today
    "hqq-b128": {"algo": "hqq", "bits": 4, "block": 128},
    "rtn-asym-b32": {"algo": "rtn", "bits": 4, "block": 32, "sym": False},
    "rtn-sym-b32": {"algo": "rtn", "bits": 4, "block": 32, "sym": True},
    "rtn-sym-b128": {"algo": "rtn", "bits": 4, "block": 128, "sym": True},
    "int8-sym-b32": {"algo": "rtn", "bits": 8, "block": 32, "sym": True},   # the int8wo recipes
}


def chain_model(hidden: int, inter: int, pairs: int, seed: int) -> onnx.ModelProto:
    """fp32 X[1, hidden] -> (MatMul up_i, MatMul down_i) x pairs; weights N(0, 1/K) so values stay O(1)."""
    inits, nodes, x = [], [], "x"
    for i in range(pairs):
        for j, (k, n) in enumerate(((hidden, inter), (inter, hidden))):
            rng = np.random.default_rng([seed, i, j])
            w = (rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
            name = f"w{i}_{j}"
            inits.append(numpy_helper.from_array(w, name))
            y = f"y{i}_{j}"
            nodes.append(helper.make_node("MatMul", [x, name], [y], name=f"mm{i}_{j}"))
            x = y
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, hidden])], inits)
    # IR 10: onnx 1.23 writes IR 14 by default, which ONNX Runtime 1.31 refuses ("max supported IR version: 13";
    # seen on the GPU image, 2026-12-06)
    return helper.make_model(g, ir_version=10,
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def quantized(model: onnx.ModelProto, q: dict | None) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, MatMulNBitsQuantizer

    m = onnx.ModelProto()   # a copy: saving with external data rewrites the proto it is given
    m.CopyFrom(model)
    if q is None:
        return m
    if q["algo"] == "hqq":
        mq = MatMulNBitsQuantizer(m, algo_config=HQQWeightOnlyQuantConfig(block_size=q["block"], bits=q["bits"]),
                                  op_types_to_quantize=("MatMul",))
    else:
        mq = MatMulNBitsQuantizer(m, bits=q["bits"], block_size=q["block"], is_symmetric=q["sym"],
                                  op_types_to_quantize=("MatMul",))
    mq.process()
    return mq.model.model


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.transformers.onnx_model import OnnxModel

    om = OnnxModel(model)
    om.convert_float_to_float16(keep_io_types=False)
    return om.model


def weight_bytes(model: onnx.ModelProto) -> int:
    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def time_session(path: Path, hidden: int, device: str, samples: int, min_ms: float, graph: bool) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    if device == "cuda":
        prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graph else "0"})]
    else:
        prov = ["CPUExecutionProvider"]
    s = ort.InferenceSession(str(path), so, providers=prov)
    dtype = np.float16 if s.get_inputs()[0].type == "tensor(float16)" else np.float32
    x = ort.OrtValue.ortvalue_from_numpy(np.ones((1, hidden), dtype) * 0.1, device, 0)
    y = ort.OrtValue.ortvalue_from_shape_and_type([1, hidden], dtype, device, 0)
    b = s.io_binding()
    b.bind_ortvalue_input("x", x)
    b.bind_ortvalue_output(s.get_outputs()[0].name, y)
    for _ in range(3):   # the first runs capture the CUDA graph / pick algorithms
        s.run_with_iobinding(b)
    b.synchronize_outputs()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < min_ms / 1e3:
        s.run_with_iobinding(b)
        n += 1
    b.synchronize_outputs()
    per = max(1, n)
    vals = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(per):
            s.run_with_iobinding(b)
        b.synchronize_outputs()
        vals.append((time.perf_counter() - t0) / per * 1e6)
    out = y.numpy().astype(np.float32)
    return {"us_median": statistics.median(vals), "us_min": min(vals), "us_max": max(vals), "calls_per_sample": per,
            "sample_ms": per * statistics.median(vals) / 1e3, "out_rms": float(np.sqrt(np.mean(out ** 2)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--inter", type=int, default=18944)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cpu")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--min-ms", type=float, default=100.0)
    ap.add_argument("--no-graph", action="store_true", help="CUDA: without CUDA graphs")
    ap.add_argument("--copy-gbs", type=float, default=4260.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    base = chain_model(a.hidden, a.inter, a.pairs, a.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nbits-") as td:
        for v in a.variants:
            t0 = time.perf_counter()
            m = to_fp16(quantized(base, VARIANTS[v])) if a.device == "cuda" else quantized(base, VARIANTS[v])
            prep_s = time.perf_counter() - t0
            p = Path(td) / v / "m.onnx"
            p.parent.mkdir()
            nbytes = weight_bytes(m)
            onnx.save_model(m, str(p), save_as_external_data=True, location="m.data")
            del m
            r = {"variant": v, "activations": "fp16" if a.device == "cuda" else "fp32 (CPU smoke test)",
                 "quant": VARIANTS[v], "weight_mb": round(nbytes / 1e6, 1), "prep_s": round(prep_s, 1)}
            r.update(time_session(p, a.hidden, a.device, a.samples, a.min_ms, not a.no_graph))
            r["gb_s"] = round(nbytes / (r["us_median"] * 1e-6) / 1e9, 1)
            r["pct_of_copy"] = round(100 * r["gb_s"] / a.copy_gbs, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
    fp16 = next((r for r in rows if r["variant"] == "fp16"), None)
    if fp16:
        for r in rows:
            r["speedup_vs_fp16"] = round(fp16["us_median"] / r["us_median"], 3)
    res = {"shape": {"hidden": a.hidden, "inter": a.inter, "pairs": a.pairs, "M": 1}, "device": a.device,
           "cuda_graph": not a.no_graph, "rows": rows}
    if a.device == "cuda":
        import onnxruntime as ort
        res["onnxruntime"] = ort.__version__
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    for r in rows:
        print(f"{r['variant']:>14} {r['weight_mb']:>9.1f} MB {r['us_median']:>9.1f} us [{r['us_min']:.1f}-"
              f"{r['us_max']:.1f}] {r['gb_s']:>8.1f} GB/s {r['pct_of_copy']:>5.1f} % x{r.get('speedup_vs_fp16', 0)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
