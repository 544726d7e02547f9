"""Run quantized one-MatMul graphs on this CPU and print what they computed (JSON on stdout).

``python isa_probe.py DIR`` reads ``DIR/x.npy`` (input), ``DIR/ref.npy`` (FP32 result) and every ``DIR/*.onnx``,
runs each with ONNX Runtime's CPU provider (graph optimisation level ``extended``, as forge's build stage) and prints
``{"isa": pipeline.host.cpu.cpu_isa(), "errors": {name: mean relative error}}``. numpy + onnxruntime only, so the test
can run it under ``qemu-x86_64 -cpu Haswell`` (an emulated AVX2 CPU without VNNI) in reasonable time.
"""

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from pipeline.host.cpu import cpu_isa


def main(d: Path) -> None:
    x, ref = np.load(d / "x.npy"), np.load(d / "ref.npy")
    errors = {}
    for f in sorted(d.glob("*.onnx")):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.intra_op_num_threads = 1
        y = ort.InferenceSession(str(f), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        errors[f.stem] = float(np.abs(y - ref).mean() / np.abs(ref).mean())
    print(json.dumps({"isa": cpu_isa(), "errors": errors}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
