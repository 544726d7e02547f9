"""Serving load bench: `forge serve` driven by Triton's own client (tritonclient) over HTTP and gRPC.

    python -m bench.serve [RECIPE ...] [--levels 1,4,16] [--requests 32] --out bench/out

For each recipe (default: smollm2-135m-fp32 and the default smollm2-135m-int8): build it (cached), start
`forge serve <its package>` as a subprocess, and at each concurrency level send a bounded number of requests
(the recipe's validation prompts in turn, ``max_tokens`` = the validated greedy length, ``end_id`` -1 as the
validate stage generated) through the ``ensemble`` model's KServe infer API. Recorded per protocol and level:
req/s, output tok/s, p50/p99 latency, errors, and how many answers differ from the evaluate stage's validated
greedy tokens (``generations.json``). ``bench/out/serve.json`` has the shape ``forge history add-bench`` reads
(``engines.<recipe>.path`` = the engine's build payload, whose cache key names the night).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

DEFAULT_RECIPES = ("smollm2-135m-fp32", "smollm2-135m-int8")


def _inputs(mod, prompt: str, n: int):
    out = []
    for name, dt, val in (("text_input", "BYTES", np.array([[prompt.encode()]], dtype=object)),
                          ("max_tokens", "INT32", np.array([[n]], np.int32)),
                          ("end_id", "INT32", np.array([[-1]], np.int32))):
        t = mod.InferInput(name, list(val.shape), dt)
        t.set_data_from_numpy(val)
        out.append(t)
    return out


def drive(http_url: str, grpc_url: str, proto: str, gens: list[dict], n_new: int, concurrency: int,
          requests: int) -> dict:
    """``requests`` requests, ``concurrency`` at a time (one client per worker thread), against ``ensemble``."""
    if proto == "http":
        import tritonclient.http as mod
        make = lambda: mod.InferenceServerClient(http_url, connection_timeout=600, network_timeout=600)  # noqa: E731
    else:
        import tritonclient.grpc as mod
        make = lambda: mod.InferenceServerClient(grpc_url)  # noqa: E731
    # one client per worker thread (a tritonclient client is not safe to share between threads: sharing one
    # over HTTP lost a request in the first run of this bench)
    local, clients, lock = threading.local(), [], threading.Lock()
    lat, mism, errors, toks, msgs = [], 0, 0, 0, []

    def client():
        if not hasattr(local, "c"):
            local.c = make()
            with lock:
                clients.append(local.c)
        return local.c

    def one(i):
        g = gens[i % len(gens)]
        c = client()
        t0 = time.perf_counter()
        try:
            res = c.infer("ensemble", _inputs(mod, g["prompt"], n_new))
            ids = res.as_numpy("output_ids").reshape(-1).tolist()
            ids = [t for t in ids if t >= 0]
            return time.perf_counter() - t0, ids, g["candidate"], None
        except Exception as e:  # noqa: BLE001 -- counted and reported
            return time.perf_counter() - t0, None, g["candidate"], f"{type(e).__name__}: {e}"

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        for dt, ids, want, err in ex.map(one, range(requests)):
            if err:
                errors += 1
                msgs.append(err[:300])
                continue
            lat.append(dt)
            toks += len(ids)
            mism += ids != want
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    return {"requests": requests, "concurrency": concurrency, "wall_s": wall, "req_s": len(lat) / wall,
            "output_tok_s": toks / wall, "p50_s": float(np.percentile(lat, 50)) if lat else None,
            "p99_s": float(np.percentile(lat, 99)) if lat else None, "errors": errors, "mismatches": int(mism),
            "error_messages": sorted(set(msgs))[:5]}


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serve_process(repo: Path, port: int, log: Path, timeout_s: float = 300) -> subprocess.Popen:
    """`forge serve <repo> --port PORT` (this checkout's forge), up and ready."""
    cmd = [sys.executable, "-m", "pipeline.cli", "serve", str(repo), "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                      os.environ.get("PYTHONPATH", "")]))
    f = open(log, "wb")
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    f.close()
    deadline = time.monotonic() + timeout_s
    while not _ready(f"127.0.0.1:{port}"):
        if p.poll() is not None or time.monotonic() > deadline:
            stop(p)
            raise RuntimeError(f"forge serve did not become ready (rc {p.poll()}); log {log}:\n"
                               + log.read_text(errors="replace")[-2000:])
        time.sleep(0.5)
    return p


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def built_payloads(recipe: str, reports: Path) -> dict[str, str] | str:
    """{stage: payload path} of the night `forge build RECIPE --report-dir REPORTS` recorded, or why not: the
    figures attach to that night (`forge history add-bench`), so the bench measures exactly what it built."""
    path = reports / recipe / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"{path}: no build report ({e}); run `forge build {recipe} --report-dir {reports}` first"
    stages = {s["name"]: s for s in report.get("stages", [])}
    bad = {n: s["status"] for n, s in stages.items() if n in ("build", "evaluate", "package")
           and (s["status"] not in ("hit", "built") or not s.get("payload"))}
    missing = [n for n in ("build", "evaluate", "package") if n not in stages]
    if bad or missing:
        return f"forge build {recipe} did not finish ({path}): {bad or ''}{' missing ' + ', '.join(missing) if missing else ''}"
    return {n: stages[n]["payload"] for n in ("build", "evaluate", "package")}


def bench_recipe(recipe: str, levels: list[int], requests: int, protos: list[str], out: Path, port: int,
                 reports: Path, overrides: list[str] | None = None) -> dict:
    from pipeline.recipe import resolve
    from pipeline.triton.serve import free_port

    r = resolve(recipe, overrides or [])
    payloads = built_payloads(r.name, reports)
    if isinstance(payloads, str):
        return {"error": payloads}
    gens = json.loads((Path(payloads["evaluate"]) / "generations.json").read_text())
    n_new = int(r.validate_.prompts.max_new_tokens)
    repo = Path(payloads["package"])
    port = port or free_port(3)   # forge serve takes port, +1 (gRPC) and +2 (metrics)
    log = out / f"serve-{recipe}.log"
    proc = serve_process(repo, port, log)
    res: dict = {"path": str(payloads["build"]), "package": str(repo), "max_tokens": n_new,
                 "prompts": len(gens), "serve": {"protocols": {}}}
    try:
        for proto in protos:
            per = res["serve"]["protocols"][proto] = {}
            drive(f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}", proto, gens, n_new, 1, 2)   # warm-up
            for c in levels:
                per[str(c)] = m = drive(f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}", proto, gens, n_new, c,
                                        max(requests, c))
                print(f"{recipe} {proto} c{c}: {m['req_s']:.2f} req/s, {m['output_tok_s']:.1f} tok/s, "
                      f"p50 {m['p50_s']}, p99 {m['p99_s']}, errors {m['errors']}, mismatches {m['mismatches']}",
                      flush=True)
    finally:
        stop(proc)
    s = res["serve"]
    s["errors"] = sum(m["errors"] for per in s["protocols"].values() for m in per.values())
    s["mismatches"] = sum(m["mismatches"] for per in s["protocols"].values() for m in per.values())
    s["ratios"] = {proto: {f"c{c}/c1": (per[str(c)]["req_s"] / per["1"]["req_s"]) if "1" in per and per["1"]["req_s"]
                           else None for c in levels if c != 1} for proto, per in s["protocols"].items()}
    engine_meta = Path(payloads["build"]) / "forge_ort.json"
    if engine_meta.exists():
        meta = json.loads(engine_meta.read_text())
        s["batch_invariant"] = meta.get("batch_invariant")
        s["quantization"] = meta.get("quantization", {}).get("algo")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    ap.add_argument("recipes", nargs="*", default=list(DEFAULT_RECIPES))
    ap.add_argument("--levels", default="1,4,16", help="concurrency levels (comma-separated)")
    ap.add_argument("--requests", type=int, default=32, help="requests per level (at least the concurrency)")
    ap.add_argument("--protocols", default="http,grpc")
    ap.add_argument("--port", type=int, default=0, help="HTTP port of forge serve (gRPC = +1); 0: a free one")
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                    help="a recipe override, as `forge build --set` (repeatable; applies to every recipe): the "
                         "recipe as it was built (forge search's candidates)")
    ap.add_argument("--from-reports", type=Path, default=Path("out"), help="where `forge build --report-dir` wrote "
                    "each recipe's report.json (its engine and package are benched; default out)")
    a = ap.parse_args(argv)
    try:
        levels = sorted({int(x) for x in a.levels.split(",")})
    except ValueError:
        ap.error(f"--levels {a.levels!r}: comma-separated integers, e.g. 1,4,16")
    if not levels or levels[0] < 1 or a.requests < 1:
        ap.error("--levels and --requests must be >= 1")
    protos = [p.strip() for p in a.protocols.split(",") if p.strip()]
    if not protos or any(p not in ("http", "grpc") for p in protos):
        ap.error(f"--protocols {a.protocols!r}: http, grpc or both")
    from bench.run import machine_facts
    a.out.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine_facts(0), "settings": {"levels": levels, "requests": a.requests, "protocols": protos,
                                                         "model": "ensemble", "client": "tritonclient"},
               "engines": {}}
    for recipe in a.recipes:
        try:
            results["engines"][recipe] = bench_recipe(recipe, levels, a.requests, protos, a.out, a.port, a.from_reports,
                                                      a.overrides)
        except Exception as e:  # noqa: BLE001 -- one recipe's failure is recorded, the others still run
            results["engines"][recipe] = {"error": f"{type(e).__name__}: {e}"}
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    path = a.out / "serve.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}; record it with: forge history add-bench {path}")
    bad = [k for k, v in results["engines"].items() if "error" in v or v["serve"]["mismatches"] or v["serve"]["errors"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
