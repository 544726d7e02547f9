"""Issue 26, item 2 on the H200: the Qwen2.5-7B-shaped CUDA engines (RANDOM weights, see lab/random_hf_model.py)
made, built stage by stage with forge's own stages, evaluated, packaged, served and benched; peak GPU memory and
peak host RSS of every step. Run through lab/gpu_ort_run.sh --exec after its receive/setup phases:

    lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py build          # weights + both recipes, stage by stage
    lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py bench --run 1  # bench.gpu fp16 + int4 + PyTorch eager
    lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py serve          # forge serve fp16, one /generate answer

Each step is its own process. A sampler thread reads the GPU's used memory (NVML, the whole device: nothing else
runs there) and the step's process tree's resident memory (psutil) every 0.1 s; the step's peaks, wall time and
return code go to ``$OUT/7b-<phase>.json`` as it goes. Each forge invocation runs one more stage than the last
(``--until``), so a step's peaks are that stage's (the earlier ones are cache hits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.host.rss import PeakRss

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or ROOT / "out-gpu")
HOME = Path(os.environ.get("FORGE_HOME", "/tmp/fh"))
MODEL = Path("/tmp/forge-random/qwen2.5-7b-l4-seed0")     # the recipes' model.source
RECIPES = ("qwen2.5-7b-cuda-fp16", "qwen2.5-7b-cuda-int4")
STAGES = ("source", "export", "quantize", "build", "evaluate", None)   # None: the rest (validate, package)
PY = sys.executable


def gpu_used_mb() -> float | None:
    try:
        import pynvml as nvml
        nvml.nvmlInit()
        return nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0)).used / 2**20
    except Exception:  # noqa: BLE001
        return None


def step(res: dict, name: str, cmd: list[str], timeout: int, log) -> int:
    """Run one step, sampling its peaks; record it in res['steps'] and save."""
    print(f"$ {' '.join(map(str, cmd))}", flush=True)
    gpu0 = gpu_used_mb()
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    peak = {"gpu": gpu0 or 0.0, "rss": 0.0}
    stop = threading.Event()

    def sample():       # the GPU's used memory; the step's RSS is forge's own sampler's (PeakRss)
        while not stop.is_set():
            g = gpu_used_mb()
            if g is not None:
                peak["gpu"] = max(peak["gpu"], g)
            stop.wait(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    with PeakRss(interval=0.1, pid=proc.pid) as rss:
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
    peak["rss"] = rss.peak / 2**20
    stop.set()
    th.join()
    log.flush()
    res["steps"].append({"step": name, "rc": rc, "wall_s": round(time.time() - t0, 1),
                         "gpu_used_before_mb": None if gpu0 is None else round(gpu0),
                         "peak_gpu_used_mb": round(peak["gpu"]), "peak_host_rss_mb": round(peak["rss"])})
    (OUT / f"7b-{res['phase']}.json").write_text(json.dumps(res, indent=2, default=str))
    print(f"   rc {rc}, {res['steps'][-1]['wall_s']} s, GPU {peak['gpu']:.0f} MB, RSS {peak['rss']:.0f} MB", flush=True)
    return rc if isinstance(rc, int) else 124


def build(res: dict, log, layers: int, timeout: int) -> None:
    # the tokenizer: the only one on the GPU machine is the builtin SmolLM2's (converted from its GGUF once)
    step(res, "smollm2 builtin (tokenizer)", [PY, "-c", "from pathlib import Path; from pipeline.source import "
         f"resolve_source; print(resolve_source('builtin:smollm2-135m-instruct', Path('{HOME}')).path)"], 120, log)
    smol = sorted((HOME / "models").glob("smollm2-135m-instruct-*/tokenizer.json"))
    if not (MODEL / "model.safetensors").exists():
        step(res, "random weights (cuda)", [PY, str(ROOT / "lab/random_hf_model.py"), "--config",
             str(ROOT / "pipeline/model_configs/Qwen--Qwen2.5-7B-Instruct.json"), "--layers", str(layers),
             "--seed", "0", "--device", "cuda", "--out", str(MODEL),
             *(["--tokenizer-from", str(smol[0].parent)] if smol else [])], 300, log)
    deadline = time.time() + timeout
    for r in RECIPES:
        for s in STAGES:
            left = int(deadline - time.time())
            if left < 10:
                res["stopped"] = f"time limit before {r} {s or 'validate+package'}"
                return
            rc = step(res, f"{r} {s or 'validate+package'}", [PY, "-m", "pipeline.cli", "build", r,
                      *(["--until", s] if s else []), "--report-dir", str(OUT / "build")], left, log)
            if rc != 0:
                break
        rep = OUT / "build" / r / "report.json"
        if rep.exists():
            rep_j = json.loads(rep.read_text())
            res.setdefault("reports", {})[r] = {
                "status": rep_j.get("status"),
                "stages": {x["name"]: {k: x.get(k) for k in ("status", "duration_s", "peak_rss_mb", "message")}
                           for x in rep_j.get("stages", [])},
                "metrics": {x["name"]: x.get("metrics") for x in rep_j.get("stages", [])
                            if x["name"] in ("export", "quantize", "build", "evaluate", "validate")}}
            (OUT / f"7b-{res['phase']}.json").write_text(json.dumps(res, indent=2, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["build", "bench", "serve"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--run", default="1")
    ap.add_argument("--timeout", type=int, default=480)
    ap.add_argument("--no-peers", action="store_true", help="bench: our engines only (no PyTorch eager)")
    a = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    phase = a.phase if a.phase != "bench" else f"bench{a.run}"
    res = {"phase": phase, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": []}
    with open(OUT / f"7b-{phase}.log", "a") as log:
        if a.phase == "build":
            build(res, log, a.layers, a.timeout)
        elif a.phase == "bench":
            engines = [f"--engine={n}={(OUT / 'build' / r / 'engine').resolve()}"
                       for n, r in (("fp16", RECIPES[0]), ("int4", RECIPES[1]))]
            peers = ["--no-peers"] if a.no_peers else []
            step(res, f"bench.gpu run {a.run}", [PY, "-m", "bench.gpu", *engines, "--hf-dir", str(MODEL), "--no-oga",
                                                 *peers, "--out", str(OUT / f"bench{a.run}")], a.timeout, log)
        else:
            step(res, "serve fp16 (tritonserver) + one /generate", [PY, str(ROOT / "lab/gpu_ort_run.py"),
                 "--phase", "serve", "--recipes", RECIPES[0]], a.timeout, log)
    print(json.dumps(res["steps"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
