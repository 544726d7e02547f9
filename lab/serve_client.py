"""Issue 26 serving run on the GPU machine: ``python -m bench.serve`` as it is, plus one answer per validation
prompt recorded. Same arguments as bench.serve:

    lab/gpu_ort_run.sh --exec python3 lab/serve_client.py RECIPE --levels 1 --requests 4 --protocols http,grpc \
        --out DIR --from-reports DIR

Right after ``forge serve`` is ready: one HTTP request per validation prompt (``ensemble``: text_output,
output_ids), each next to the evaluate stage's validated greedy tokens (generations.json), and NVML's used GPU
memory then -> ``DIR/answers-<recipe>.json``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import bench.serve as s

_bench_recipe, _serve_process = s.bench_recipe, s.serve_process
CTX: dict = {}


def gpu_used_mb() -> float | None:
    try:
        import pynvml as nvml
        nvml.nvmlInit()
        return round(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0)).used / 2**20)
    except Exception:  # noqa: BLE001
        return None


def bench_recipe(recipe, levels, requests, protos, out, port, reports):
    from pipeline.recipe import resolve
    r = resolve(recipe, [])
    p = s.built_payloads(r.name, reports)
    if isinstance(p, dict):
        CTX.update(recipe=recipe, out=Path(out), n_new=int(r.validate_.prompts.max_new_tokens),
                   gens=json.loads((Path(p["evaluate"]) / "generations.json").read_text()))
    return _bench_recipe(recipe, levels, requests, protos, out, port, reports)


def answers(port: int, ready_s: float) -> None:
    import tritonclient.http as mod
    res = {"recipe": CTX["recipe"], "ready_s": round(ready_s, 1), "gpu_used_mb_ready": gpu_used_mb(),
           "max_tokens": CTX["n_new"], "answers": []}
    path = CTX["out"] / f"answers-{CTX['recipe']}.json"
    c = mod.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=600, network_timeout=600)
    try:
        for g in CTX["gens"]:
            t0 = time.perf_counter()
            try:
                out = c.infer("ensemble", s._inputs(mod, g["prompt"], CTX["n_new"]))
                ids = [t for t in out.as_numpy("output_ids").reshape(-1).tolist() if t >= 0]
                txt = out.as_numpy("text_output")
                txt = None if txt is None else [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                                                for x in txt.reshape(-1).tolist()]
                err = None
            except Exception as e:  # noqa: BLE001 -- recorded
                ids, txt, err = None, None, f"{type(e).__name__}: {e}"[:500]
            res["answers"].append({
                "prompt": g["prompt"], "latency_s": round(time.perf_counter() - t0, 3), "error": err,
                "served_ids": ids, "served_text": txt, "validated_ids": g["candidate"],
                "validated_text": g.get("candidate_text"), "equals_validated": ids == g["candidate"],
                "equals_fp32_reference": ids == g.get("reference"), "gpu_used_mb": gpu_used_mb()})
            path.write_text(json.dumps(res, indent=1))
    finally:
        c.close()
    n = len(res["answers"])
    eq = sum(a["equals_validated"] for a in res["answers"])
    print(f"answers: {eq}/{n} equal the validated greedy tokens; {path}", flush=True)
    for a in res["answers"]:
        print(f"  {a['equals_validated']!s:5} {a['latency_s']:.3f}s {a['prompt'][:40]!r} -> "
              f"{(a['served_text'] or [a['error']])[0]!r:.120}", flush=True)


def serve_process(repo, port, log, timeout_s=300):
    t0 = time.perf_counter()
    proc = _serve_process(repo, port, log, timeout_s)
    if "gens" in CTX:   # once per recipe (bench_recipe sets it, serve_process runs once after)
        try:
            answers(port, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 -- the bench itself still runs
            print(f"answers failed: {type(e).__name__}: {e}", flush=True)
        CTX.pop("gens")
    return proc


s.bench_recipe, s.serve_process = bench_recipe, serve_process

if __name__ == "__main__":
    raise SystemExit(s.main(sys.argv[1:]))
