"""`make bench` on a GPU machine (issue 17): our CUDA engines (FP32 / FP16 / INT4, CUDA graphs off and on), ORT GenAI
CUDA int4 and PyTorch eager fp16 ``generate`` on the same GPU, in one run, each in its own process.

Figures per engine (bench.measure, medians of ``--reps``): prefill 1x256 and 4x256, time to first token (256-token
prompt), decode batch 1 and 8 (32-token prompts, 64 new tokens), and the process's GPU memory after the run (NVML's
per-process figure, which counts ORT's arena and torch's caching allocator alike). Ratios: FP16/FP32, INT4/FP16,
CUDA graph on/off, ours FP16 vs ORT GenAI CUDA int4 and vs PyTorch eager fp16. The GPU is named in the results.

    python -m bench.gpu --engine fp32=DIR --engine fp16=DIR --engine int4=DIR --hf-dir HF --out bench/out-gpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .measure import measure_adapter, ratio


def gpu_memory_mb() -> float | None:
    """This process's GPU memory (MiB) by NVML; None when NVML cannot tell."""
    from pipeline.host.gpu import nvml_handles
    try:
        import pynvml as nvml
        with nvml_handles(nvml) as handles:
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handles[0]):
                if p.pid == os.getpid() and p.usedGpuMemory:
                    return p.usedGpuMemory / 2**20
    except Exception:  # noqa: BLE001
        return None
    return None


class OrtCudaAdapter:
    supports_batch_prefill = True

    def __init__(self, name: str, model_dir: str, cuda_graph: bool):
        import onnxruntime as ort
        from pipeline.ort.engine import OrtEngine
        self.name = name
        self.engine = OrtEngine(model_dir, providers=["CUDAExecutionProvider"], device="cuda", cuda_graph=cuda_graph)
        self.what = (f"forge ONNX Runtime engine ({name}), onnxruntime {ort.__version__} CUDAExecutionProvider, "
                     f"KV on the GPU, CUDA graph {'on' if cuda_graph else 'off'}")
        self.generate_batch = lambda ids, n: self.engine.generate_batch([list(map(int, r)) for r in ids], n)

    def prefill(self, ids):
        return self.engine.prefill(ids)

    def generate(self, ids, n):
        return self.engine.generate([int(x) for x in np.asarray(ids).reshape(-1)], n)


class TorchEagerAdapter:
    """transformers eager ``generate`` in fp16 on the GPU (greedy, KV cache): the issue's PyTorch baseline."""
    supports_batch_prefill = True

    def __init__(self, name: str, hf_dir: str):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
        self.torch, self.name = torch, name
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float16).cuda().eval()
        self.what = f"PyTorch {torch.__version__} eager fp16 generate (transformers {transformers.__version__})"
        self.generate_batch = self._gen

    def prefill(self, ids):
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.as_tensor(ids, device="cuda"), use_cache=False).logits
            self.torch.cuda.synchronize()
            return out

    def _gen(self, ids, n):
        with self.torch.inference_mode():
            t = self.torch.as_tensor(np.asarray(ids), device="cuda")
            out = self.model.generate(t, attention_mask=self.torch.ones_like(t), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)
            return out[:, t.shape[1]:].cpu().numpy()

    def generate(self, ids, n):
        return self._gen(np.asarray(ids).reshape(1, -1), n)[0].tolist()


def build_oga_cuda_int4(hf_dir: Path, dst: Path) -> Path:
    """ORT GenAI's model builder, INT4 for CUDA (``-p int4 -e cuda``), from the fp32 HF dir."""
    if (dst / "genai_config.json").exists():
        return dst
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(dst),
           "-p", "int4", "-e", "cuda", "-c", str(dst.parent / "oga-cache")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"onnxruntime_genai model builder failed ({r.returncode}): {r.stderr[-2000:]}")
    return dst


# issue 26: a figure is the median of >= 5 samples of >= 100 ms each (one 4-6 ms prefill step was noise)
MIN_SAMPLE_S = 0.1


def one(spec: dict) -> dict:
    """Measure one engine in this process (the parent starts one process per engine)."""
    kind = spec["kind"]
    if kind == "ours":
        a = OrtCudaAdapter(spec["name"], spec["path"], spec.get("cuda_graph", False))
    elif kind == "torch":
        a = TorchEagerAdapter(spec["name"], spec["path"])
    else:
        from .peers import OgaAdapter
        a = OgaAdapter(spec["name"], spec["path"], 0)
        a.what = a.what.replace("CPU model, 0 threads", "CUDA model (model builder -p int4 -e cuda)")
    base = None
    tok = Path(spec.get("tokenizer") or "") / "tokenizer.json"
    if tok.is_file():
        from tokenizers import Tokenizer
        from pipeline.data import load_prompts
        base = Tokenizer.from_file(str(tok)).encode(" ".join(load_prompts() * 8), add_special_tokens=False).ids
    res = measure_adapter(a, vocab_size=int(spec.get("vocab", 49152)), base_ids=base, reps=int(spec.get("reps", 5)),
                          prefill_batches=(1, 4), decode_batches=(1, 8),
                          min_sample_s=float(spec.get("min_sample_s", MIN_SAMPLE_S)))
    res["gpu_memory_mb"] = gpu_memory_mb()
    return res


def _fig(r: dict | None, path: tuple[str, ...]):
    cur = r
    for k in path:
        cur = (cur or {}).get(k)
    return cur


FIGURES = {"prefill 4x256 tok/s": ("prefill", "4", "tokens_per_s"), "prefill 1x256 tok/s": ("prefill", "1", "tokens_per_s"),
           "decode b1 tok/s": ("decode", "1", "tokens_per_s"), "decode b8 tok/s": ("decode", "8", "tokens_per_s"),
           "TTFT s": ("ttft", "median_s"), "GPU MiB": ("gpu_memory_mb",)}
RATIOS = [("FP16 / FP32", "fp16", "fp32"), ("INT4 / FP16", "int4", "fp16"),
          ("FP16 CUDA graph / off", "fp16+graph", "fp16"), ("INT4 CUDA graph / off", "int4+graph", "int4"),
          ("FP16 / ORT GenAI CUDA int4", "fp16", "oga-cuda-int4"), ("INT4 / ORT GenAI CUDA int4", "int4", "oga-cuda-int4"),
          ("FP16 / PyTorch eager fp16", "fp16", "torch-fp16"),
          ("INT4 CUDA graph / FP16 CUDA graph", "int4+graph", "fp16+graph"),
          ("INT8 w/o CUDA graph / FP16 CUDA graph", "int8wo+graph", "fp16+graph"),
          ("FP16 CUDA graph / ORT GenAI CUDA int4", "fp16+graph", "oga-cuda-int4"),
          ("FP16 CUDA graph / PyTorch eager fp16", "fp16+graph", "torch-fp16")]


def markdown(results: dict) -> str:
    names = list(results["engines"])
    lines = [f"GPU: {results['gpu']}", "", "| figure | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for label, path in FIGURES.items():
        vals = []
        for n in names:
            v = _fig(results["engines"][n], path)
            vals.append("-" if v is None else (f"{v:.4f}" if "TTFT" in label else f"{v:,.0f}"))
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    lines += ["", "| ratio | prefill 4x256 | decode b1 | decode b8 | TTFT |", "|---|---|---|---|---|"]
    for label, a, b in RATIOS:
        ra, rb = results["engines"].get(a), results["engines"].get(b)
        if not ra or not rb or "error" in ra or "error" in rb:
            continue
        cells = []
        for path in (FIGURES["prefill 4x256 tok/s"], FIGURES["decode b1 tok/s"], FIGURES["decode b8 tok/s"]):
            x = ratio(_fig(ra, path), _fig(rb, path))
            cells.append("-" if x is None else f"{x:.2f}x")
        t = ratio(_fig(rb, FIGURES["TTFT s"]), _fig(ra, FIGURES["TTFT s"]))   # lower is better: b/a
        cells.append("-" if t is None else f"{t:.2f}x")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    errs = {n: r["error"][-300:] for n, r in results["engines"].items() if "error" in r}
    if errs:
        lines += ["", "errors:"] + [f"- {n}: {e}" for n, e in errs.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="append", default=[], help="NAME=DIR of a forge CUDA engine (fp32, fp16, int4, int8wo)")
    ap.add_argument("--hf-dir", help="fp32 HF dir: PyTorch eager fp16 and ORT GenAI's model builder read it")
    ap.add_argument("--out", default="bench/out-gpu")
    ap.add_argument("--reps", type=int, default=5, help="samples per figure (>= 5: the median, min and max kept)")
    ap.add_argument("--min-sample-s", type=float, default=MIN_SAMPLE_S,
                    help="each sample loops the step until it lasts this long (a 4 ms prefill alone is noise)")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph runs")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-oga", action="store_true", help="PyTorch eager only (ORT GenAI's model builder takes ~40 s)")
    ap.add_argument("--env-variant", action="append", default=[], metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
                    help="also measure fp16 with CUDA graphs under these environment variables (ONNX Runtime's "
                         "attention-kernel switches, e.g. cudnn-off:ORT_ENABLE_CUDNN_FLASH_ATTENTION=0)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        spec = json.loads(Path(a.one).read_text())
        try:
            res = one(spec)
        except Exception as e:  # noqa: BLE001 - recorded per engine, the run goes on
            import traceback
            res = {"name": spec["name"], "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
        Path(spec["result"]).write_text(json.dumps(res, indent=2, default=str))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from pipeline.host.gpu import cuda_device
    engines = dict(e.split("=", 1) for e in a.engine)
    tok = next(iter(engines.values()), None)
    specs = []
    for name, d in engines.items():
        specs.append({"name": name, "kind": "ours", "path": d, "tokenizer": d})
        if not a.no_graphs and name != "fp32":     # fp32 engine: standard attention (no fixed-shape decode)
            specs.append({"name": f"{name}+graph", "kind": "ours", "path": d, "tokenizer": d, "cuda_graph": True})
    for v in a.env_variant:
        label, _, assigns = v.partition(":")
        pairs = [x.split("=", 1) for x in assigns.split(",")]
        if not label or not assigns or any(len(p) != 2 or not p[0] for p in pairs):
            ap.error(f"--env-variant {v!r}: expected LABEL:VAR=VALUE[,VAR=VALUE], "
                     "e.g. cudnn-off:ORT_ENABLE_CUDNN_FLASH_ATTENTION=0")
        env = dict(pairs)
        if "fp16" in engines:
            specs.append({"name": f"fp16+graph+{label}", "kind": "ours", "path": engines["fp16"], "tokenizer": tok,
                          "cuda_graph": True, "env": env})
    if a.hf_dir and not a.no_peers:
        specs.append({"name": "torch-fp16", "kind": "torch", "path": a.hf_dir, "tokenizer": tok})
    if a.hf_dir and not a.no_peers and not a.no_oga:
        try:
            specs.append({"name": "oga-cuda-int4", "kind": "oga", "tokenizer": tok,
                          "path": str(build_oga_cuda_int4(Path(a.hf_dir), out / "oga-cuda-int4"))})
        except Exception as e:  # noqa: BLE001
            specs.append({"name": "oga-cuda-int4", "skip": f"{type(e).__name__}: {e}"})
    dev = cuda_device()
    results = {"gpu": f"{dev['name']} (sm_{dev['sm']})" if dev else "no GPU", "engines": {},
               "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for s in specs:
        if "skip" in s:
            results["engines"][s["name"]] = {"error": s["skip"]}
            continue
        s.update(reps=a.reps, min_sample_s=a.min_sample_s, result=str(out / f"{s['name']}.json"))
        sp = out / f"{s['name']}.spec.json"
        sp.write_text(json.dumps(s))
        print(f"== {s['name']}", flush=True)
        subprocess.run([sys.executable, "-m", "bench.gpu", "--one", str(sp)], check=False,
                       env={**os.environ, **s.get("env", {})})
        results["engines"][s["name"]] = json.loads(Path(s["result"]).read_text()) if Path(s["result"]).exists() \
            else {"error": "worker wrote no result"}
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
