"""Peak host RAM and wall time of the CUDA recipes' export / quantize / build work, each step in its own process
(issue 38): forge's streaming fp16 writer against ONNX Runtime GenAI's model builder on the same weights.

    python lab/export_memory.py --hf-dir /tmp/q7-l1 --work /tmp/em [--genai-path /tmp/oga] [--steps ...]

Steps (``--steps``, default all that can run here):
  stream-export   pipeline.ort.stream_export.export_fp16_stream, parity included (ORT CPU, then FP32 torch on the GPU
                  when torch sees one, else on the CPU)
  stream-int4     pipeline.ort.stream_quantize, int4_wo RTN symmetric block 128, lm_head 8-bit
  stream-int8     pipeline.ort.stream_quantize, int8 blockwise (8-bit MatMulNBits) symmetric block 128
  build-cpu       pipeline.ort.optimize on the fp16 graph with the CPU provider: a stand-in for the CUDA build stage
                  (same graph load, optimised save and before/after check; the CUDA provider puts the weights on the
                  GPU instead), so its host figure is an upper bound of the CUDA one
  genai-fp16      onnxruntime_genai.models.builder -p fp16 -e cuda (no parity check: the builder has none)
  genai-int4      the same, -p int4 with block_size=128 is_symmetric=true algo_config=rtn

Each step's peak is the kernel's high-water mark of that process (``VmHWM``, pipeline.host.rss.process_peak_rss_bytes:
resident pages, file-backed ones included; printed by the step itself at exit), divided by the model's fp16 weight
bytes (2 bytes x parameters, from the safetensors headers). One JSON line per step, and a table at the end. The
machine's ISA class is printed with them (pipeline/host/cpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PY = {
    "stream-export": "from pipeline.ort.stream_export import export_fp16_stream as f; "
                     "r = f({hf!r}, {work!r} + '/export', reference='auto')",
    "stream-int4": "from pipeline.ort.stream_quantize import quantize_stream as f; "
                   "r = f({work!r} + '/export', {work!r} + '/int4', algo='int4_wo', "
                   "options={{'method': 'rtn', 'symmetric': True, 'block_size': 128}})",
    "stream-int8": "from pipeline.ort.stream_quantize import quantize_stream as f; "
                   "r = f({work!r} + '/export', {work!r} + '/int8', algo='int8', options={{'method': 'blockwise', "
                   "'smoothquant_alpha': None, 'embedding': 'fp32', 'block_size': 128, 'accuracy_level': 2}})",
    "build-cpu": "from pipeline.ort.optimize import optimize as f; "
                 "r = f({work!r} + '/export', {work!r} + '/build', level='extended', threads=2, provider='cpu')",
}
# the step's own figures (times, parity errors), printed as the process's last line
TAIL = "; import json; print('METRICS ' + json.dumps({{k: v for k, v in r.items() if not isinstance(v, dict)}}, " \
       "default=str))"
# every step prints its own peak when it exits (ru_maxrss would include this parent's size at the fork)
PEAK = "import atexit; from pipeline.host.rss import process_peak_rss_bytes as _p; " \
       "atexit.register(lambda: print('PEAK', _p(), flush=True)); "
GENAI = {
    "genai-fp16": ["-p", "fp16"],
    "genai-int4": ["-p", "int4", "--extra_options", "block_size=128", "is_symmetric=true", "algo_config=rtn"],
}


def fp16_bytes(hf_dir: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from pipeline.weights import HFWeights
    w = HFWeights(hf_dir)
    return sum(w.nbytes(n) // ({"F32": 2, "F64": 4}.get(w.dtype[n], 1)) for n in w.names())


def run(cmd: list[str], env: dict) -> tuple[int, float, int, str]:
    """(exit code, wall s, peak RSS bytes as the step printed it, output) of ``cmd`` in its own process."""
    t0 = time.time()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = [int(ln.split()[1]) for ln in p.stdout.splitlines() if ln.startswith("PEAK ")]
    return p.returncode, time.time() - t0, peaks[-1] if peaks else 0, p.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--genai-path", default=None, help="a folder holding the onnxruntime_genai package (pip --target)")
    ap.add_argument("--steps", nargs="+", default=None, choices=[*PY, *GENAI])
    a = ap.parse_args(argv)
    steps = a.steps or [*PY, *(GENAI if a.genai_path else [])]
    a.work.mkdir(parents=True, exist_ok=True)
    ref = fp16_bytes(a.hf_dir)
    sys.path.insert(0, str(ROOT))
    from pipeline.host.cpu import cpu_facts
    isa = cpu_facts().get("isa_class")
    env = {**os.environ, "FORGE_PROGRESS": "0", "PYTHONPATH": str(ROOT)}
    rows = []
    for step in steps:
        if step in PY:
            cmd = [sys.executable, "-c", PEAK + (PY[step] + TAIL).format(hf=str(a.hf_dir), work=str(a.work))]
            e = env
        else:   # the builder's own command line, run in a process that prints its peak at exit
            argv = ["builder", "-i", str(a.hf_dir), "-o", str(a.work / step), "-e", "cuda", "-c",
                    str(a.work / "genai-cache"), *GENAI[step]]
            cmd = [sys.executable, "-c", PEAK + f"import runpy, sys; sys.argv = {argv!r}; "
                   "runpy.run_module('onnxruntime_genai.models.builder', run_name='__main__')"]
            e = {**env, "PYTHONPATH": f"{a.genai_path}:{ROOT}"}
        rc, wall, peak, out = run(cmd, e)
        row = {"step": step, "rc": rc, "wall_s": round(wall, 1), "peak_rss_gb": round(peak / 1e9, 2),
               "x_fp16": round(peak / ref, 2), "fp16_weight_gb": round(ref / 1e9, 3), "isa_class": isa}
        metrics = [ln for ln in out.splitlines() if ln.startswith("METRICS ")]
        if metrics:
            row["metrics"] = json.loads(metrics[-1][len("METRICS "):])
        if rc:
            row["tail"] = out[-600:]
        elif not peak:
            row["rc"], row["tail"] = 1, "the step printed no PEAK line"
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'step':<14} {'wall s':>7} {'peak GB':>8} {'x fp16':>7}  (fp16 weights {ref / 1e9:.3f} GB, {isa})")
    for r in rows:
        print(f"{r['step']:<14} {r['wall_s']:>7} {r['peak_rss_gb']:>8} {r['x_fp16']:>7}{'  FAILED' if r['rc'] else ''}")
    return 1 if any(r["rc"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
