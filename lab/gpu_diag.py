"""Issue 17 diagnosis on the GPU machine: a CUDA engine's logits against the same graph on the CPU provider, per
position, on real text, under ONNX Runtime's attention-kernel switches. Separates a CUDA kernel fault from a graph
fault (the CPU provider upcasts fp16 nodes it has no fp16 kernel for, the CUDA provider does not).

    python lab/gpu_diag.py ENGINE_DIR [ENGINE_DIR ...] --out diag.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# each variant runs in its own process: ORT reads these switches when a kernel is created
VARIANTS = {"default": {}, "cudnn_sdpa_off": {"ORT_ENABLE_CUDNN_FLASH_ATTENTION": "0"}}


def compare(engine_dir: str, batch: int, seq: int) -> dict:
    from pipeline.data import load_prompts
    from pipeline.ort.engine import OrtEngine
    gpu = OrtEngine(engine_dir, providers=["CUDAExecutionProvider"], device="cuda")
    ids = gpu.tokenizer.encode(" ".join(load_prompts() * 64), add_special_tokens=False).ids
    x = np.array([ids[i * seq:(i + 1) * seq] for i in range(batch)], np.int64)
    x[:, 0] = gpu.meta.get("bos_token_id") or x[0, 0]          # a sink token first, as in evaluation windows
    a = OrtEngine(engine_dir, threads=8).logits(x)
    b = gpu.logits(x)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    agree = a.argmax(-1) == b.argmax(-1)
    return {"batch": batch, "seq": seq, "top1_cpu_vs_cuda": float(agree.mean()),
            "top1_by_position_quarter": [float(q.mean()) for q in np.array_split(agree, 4, axis=1)],
            "max_abs": float(np.abs(a - b).max()), "zero_rows_cuda": int((nb == 0).sum()),
            "zero_rows_cpu": int((na == 0).sum()), "first_disagreeing_position": int(np.argmin(agree.all(0)))
            if not agree.all() else None, "providers": gpu.session.get_providers()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engines", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        res = {}
        for b, s in ((1, 64), (2, 256), (4, 512)):
            try:
                res[f"{b}x{s}"] = compare(a.one[0], b, s)
            except Exception as e:  # noqa: BLE001 - recorded, the next shape runs
                res[f"{b}x{s}"] = {"error": f"{type(e).__name__}: {e}"[-800:]}
        Path(a.one[1]).write_text(json.dumps(res))
        return 0
    out = {}
    for eng in a.engines:
        for name, env in VARIANTS.items():
            tmp = Path(a.out).with_suffix(f".{len(out)}.json")
            subprocess.run([sys.executable, __file__, eng, "--out", a.out, "--one", eng, str(tmp)],
                           env={**os.environ, **env}, timeout=240, check=False)
            out[f"{Path(eng).parent.name}/{name}"] = json.loads(tmp.read_text()) if tmp.exists() else None
            Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: {s: (r or {}).get("top1_cpu_vs_cuda", (r or {}).get("error")) for s, r in (v or {}).items()}
                      for k, v in out.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
