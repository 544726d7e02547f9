"""Issue 26, item 2 on the H200: the Qwen2.5-7B-shaped CUDA engines (RANDOM weights: the recipes' model.source
random:Qwen--Qwen2.5-7B-Instruct, made by forge's source stage, pipeline/random_weights.py) made, built stage by stage with forge's own stages, evaluated, packaged, served and benched; peak GPU memory and
peak host RSS of every step. Run through lab/gpu_ort_run.sh --exec after its receive/setup phases:

    lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py build          # weights + both recipes, stage by stage
    lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py bench --run 1  # bench.gpu fp16 + int4 + PyTorch eager
    lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py serve          # forge serve fp16, one /generate answer
    # one forge invocation per call (no per-stage process start-up), per-stage peaks split at forge's stage lines:
    lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py weights      # forge build --until source (the random model)
    lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py forge --recipes qwen2.5-7b-cuda-fp16 --until quantize --tag a
    lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py client --recipes qwen2.5-7b-cuda-fp16  # bench.serve: tritonclient

Each step is its own process. A sampler thread reads the GPU's used memory (NVML, the whole device: nothing else
runs there) and the step's process tree's resident memory (psutil) every 0.1 s; the step's peaks, wall time and
return code go to ``$OUT/7b-<phase>.json`` as it goes. Each forge invocation runs one more stage than the last
(``--until``), so a step's peaks are that stage's (the earlier ones are cache hits).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or ROOT / "out-gpu")
HOME = Path(os.environ.get("FORGE_HOME", "/tmp/fh"))
SPEC = "random:Qwen--Qwen2.5-7B-Instruct"                 # the recipes' model.source (seed 0)
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


def tree_rss_mb(pid: int) -> float:
    import psutil
    try:
        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20
    except psutil.Error:
        return 0.0


STAGE_LINE = re.compile(r"^  ([a-z_]+): ([a-z_]+)")     # pipeline/cli.py on_stage: "  <stage>: <status>[ ...]"


def step(res: dict, name: str, cmd: list[str], timeout: int, log, split_stages: bool = False) -> int:
    """Run one step, sampling its peaks; record it in res['steps'] and save. With ``split_stages`` the peaks are
    also kept per forge stage: a segment ends at each stage's result line (stages run one after another)."""
    print(f"$ {' '.join(map(str, cmd))}", flush=True)
    gpu0 = gpu_used_mb()
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if split_stages else log, stderr=subprocess.STDOUT,
                            text=split_stages or None, encoding="utf-8" if split_stages else None,
                            errors="replace" if split_stages else None)
    peak = {"gpu": gpu0 or 0.0, "rss": 0.0}
    seg = {"gpu": 0.0, "rss": 0.0, "t": t0}
    stages: list[dict] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            g = gpu_used_mb()
            r = tree_rss_mb(proc.pid)
            if g is not None:
                peak["gpu"] = max(peak["gpu"], g)
                seg["gpu"] = max(seg["gpu"], g)
            peak["rss"] = max(peak["rss"], r)
            seg["rss"] = max(seg["rss"], r)
            stop.wait(0.1)

    def read():
        for line in proc.stdout:
            log.write(f"[{time.time() - t0:7.1f}] {line}")
            log.flush()
            m = STAGE_LINE.match(line)
            if m:
                now = time.time()
                stages.append({"stage": m.group(1), "status": m.group(2), "wall_s": round(now - seg["t"], 1),
                               "peak_gpu_used_mb": round(seg["gpu"]), "peak_host_rss_mb": round(seg["rss"])})
                seg.update(gpu=0.0, rss=0.0, t=now)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    rd = threading.Thread(target=read, daemon=True) if split_stages else None
    if rd:
        rd.start()
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    stop.set()
    th.join()
    if rd:
        rd.join(10)
    log.flush()
    res["steps"].append({"step": name, "rc": rc, "wall_s": round(time.time() - t0, 1),
                         "gpu_used_before_mb": None if gpu0 is None else round(gpu0),
                         "peak_gpu_used_mb": round(peak["gpu"]), "peak_host_rss_mb": round(peak["rss"]),
                         **({"stages": stages} if split_stages else {})})
    (OUT / f"7b-{res['phase']}.json").write_text(json.dumps(res, indent=2, default=str))
    print(f"   rc {rc}, {res['steps'][-1]['wall_s']} s, GPU {peak['gpu']:.0f} MB, RSS {peak['rss']:.0f} MB", flush=True)
    return rc if isinstance(rc, int) else 124


def model_dir(layers: int) -> Path:
    """The random model forge's source stage made (made now if it is not there yet)."""
    out = subprocess.run([PY, "-c", "from pathlib import Path; from pipeline.source import resolve_source; "
                          f"print(resolve_source('{SPEC}', Path('{HOME}'), seed=0, layers={layers}).path)"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def build(res: dict, log, layers: int, timeout: int) -> None:
    # the source stage makes the random weights (CPU generator) with the builtin SmolLM2's tokenizer
    deadline = time.time() + timeout
    for r in RECIPES:
        for s in STAGES:
            left = int(deadline - time.time())
            if left < 10:
                res["stopped"] = f"time limit before {r} {s or 'validate+package'}"
                return
            rc = step(res, f"{r} {s or 'validate+package'}", [PY, "-m", "pipeline.cli", "build", r,
                      "--set", f"model.layers={layers}", *(["--until", s] if s else []),
                      "--report-dir", str(OUT / "build")], left, log)
            if rc != 0:
                break
        report(res, r)


def report(res: dict, r: str) -> None:
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
    ap.add_argument("phase", choices=["build", "bench", "serve", "weights", "forge", "client"])
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    ap.add_argument("--until", default=None, help="forge: the last stage (default: all, package included)")
    ap.add_argument("--tag", default="", help="forge: suffix of the result file's phase name")
    ap.add_argument("--layers", type=int, default=4, help="--set model.layers of every forge build (28: all)")
    ap.add_argument("--run", default="1")
    ap.add_argument("--timeout", type=int, default=480)
    ap.add_argument("--no-peers", action="store_true", help="bench: our engines only (no PyTorch eager)")
    a = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    phase = {"bench": f"bench{a.run}", "forge": f"forge{a.tag}"}.get(a.phase, a.phase)
    res = {"phase": phase, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": []}
    with open(OUT / f"7b-{phase}.log", "a") as log:
        if a.phase == "build":
            build(res, log, a.layers, a.timeout)
        elif a.phase == "bench":
            # the engines this machine has built (the serving run builds fp16 only)
            engines = [f"--engine={n}={(OUT / 'build' / r / 'engine').resolve()}"
                       for n, r in (("fp16", RECIPES[0]), ("int4", RECIPES[1]))
                       if (OUT / "build" / r / "engine").exists()]
            peers = ["--no-peers"] if a.no_peers else []
            step(res, f"bench.gpu run {a.run}", [PY, "-m", "bench.gpu", *engines, "--hf-dir", str(model_dir(a.layers)),
                                                 "--no-oga",
                                                 *peers, "--out", str(OUT / f"bench{a.run}")], a.timeout, log)
        elif a.phase == "weights":
            step(res, "random weights (source stage, CPU generator)", [PY, "-m", "pipeline.cli", "build", RECIPES[0],
                 "--set", f"model.layers={a.layers}", "--until", "source", "--report-dir", str(OUT / "build")],
                 a.timeout, log)
        elif a.phase == "forge":
            for r in a.recipes:
                step(res, f"{r} until {a.until or 'package'}", [PY, "-m", "pipeline.cli", "build", r,
                     "--set", f"model.layers={a.layers}", *(["--until", a.until] if a.until else []),
                     "--report-dir", str(OUT / "build")],
                     a.timeout, log, split_stages=True)
                report(res, r)
        elif a.phase == "client":
            # forge serve of each recipe's package, one answer per prompt over HTTP and gRPC through tritonclient,
            # each compared with the evaluate stage's validated greedy tokens (bench/serve.py, through
            # lab/serve_client.py, which also records one answer per prompt)
            step(res, "bench.serve (forge serve + tritonclient http,grpc)", [PY, str(ROOT / "lab/serve_client.py"),
                 *a.recipes,
                 "--levels", "1", "--requests", "4", "--protocols", "http,grpc", "--out", str(OUT / "serve"),
                 "--from-reports", str(OUT / "build")],   # where the forge phase's --report-dir put the reports
                 a.timeout, log)
        else:
            step(res, "serve fp16 (tritonserver) + one /generate", [PY, str(ROOT / "lab/gpu_ort_run.py"),
                 "--phase", "serve", "--recipes", RECIPES[0]], a.timeout, log)
    print(json.dumps(res["steps"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
