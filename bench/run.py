"""`make bench`: our FP32 / INT8 / INT4 ONNX Runtime engines side by side (+ peers), medians, ratios.

    python -m bench.run [--quick] [--peers] --out bench/out \
        --engine fp32=DIR --engine int8=DIR --engine int4=DIR [--report cold=out/x/report.json ...] \
        [--from-reports out] [--hf-dir DIR] [--threads N] [--reps N] [--passes N]

Each engine and peer runs in its own subprocess (``python -m bench.run --worker SPEC.json``) so its
peak RSS is its own. Writes ``results.json``, ``results.md`` and ``chart.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench.measure import measure_adapter, merge_passes, ratio
from pipeline.host.rss import process_peak_rss_bytes
from pipeline.history.bench import flat

HERE = Path(__file__).parent
METRICS = [("prefill_b1", "prefill tok/s (1x256)"), ("prefill_b4", "prefill tok/s (4x256)"),
           ("decode_b1", "decode tok/s (batch 1)"), ("decode_b8", "decode tok/s (batch 8)")]


# ----------------------------------------------------------------------------- facts
def machine_facts(threads: int) -> dict:
    from pipeline.host.cpu import cpu_facts
    from pipeline.host.tools import tool_version

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    vers = {d: tool_version(d) for d in ("onnxruntime", "onnxruntime-genai", "llama-cpp-python", "torch", "numpy")}
    return {**cpu_facts(), "logical_cpus": os.cpu_count(), "usable_cpus": cpus, "threads": threads,
            "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
            "os": platform.platform(), "python": platform.python_version(), "versions": vers,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_avg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


def ratios(a: dict, b: dict) -> dict:
    """a vs b: speed ratios a/b (>1: a faster); ttft, size, rss ratios a/b (<1: a smaller/faster)."""
    fa, fb = flat(a), flat(b)
    return {k: ratio(fa[k], fb[k]) for k in fa}


# ----------------------------------------------------------------------------- pipeline reports
def stage_times(report: dict) -> dict:
    """{stage: {"status", "seconds"}} + total from a forge report.json (tolerant of older shapes)."""
    stages = report.get("stages") or []
    if isinstance(stages, dict):
        stages = [dict(v, name=k) for k, v in stages.items()]
    out = {}
    for s in stages:
        name = s.get("name") or s.get("stage")
        secs = next((s[k] for k in ("duration_s", "seconds", "elapsed_s", "wall_s") if k in s), None)
        out[name] = {"status": s.get("status") or s.get("cache"), "seconds": secs,
                     "peak_rss_mb": s.get("peak_rss_mb")}
    total = report.get("wall_s")
    if total is None:
        total = sum(v["seconds"] or 0 for v in out.values())
    return {"recipe": report.get("recipe"), "status": report.get("status"), "wall_s": total, "stages": out}


def hf_dir_from_report(rep: dict, home: Path | None = None) -> str | None:
    """The HF model dir the source stage resolved (its metrics carry ``model_dir``: relative to FORGE_HOME where it
    lies there, since source stage v3; an absolute path otherwise), as an absolute path; None when it is not here."""
    from pipeline.host.paths import forge_home

    src = next((s for s in rep.get("stages", []) if s.get("name") == "source"), None)
    d = ((src or {}).get("metrics") or {}).get("model_dir")
    if not d:
        return None
    p = Path(d) if Path(d).is_absolute() else Path(home or forge_home()) / d
    return str(p) if (p / "config.json").exists() else None


def engines_from_reports(root: Path) -> tuple[dict[str, str], dict[str, Path]]:
    """From ``forge build --report-dir root``: {label: engine dir}, {label: report.json}; label = fp32/int8/int4
    from the recipe name's suffix, else the recipe name."""
    engines, reports = {}, {}
    for rp in sorted(root.glob("*/report.json")):
        rep = json.loads(rp.read_text())
        if rep.get("target", "onnxruntime") != "onnxruntime":
            continue
        name = rep.get("recipe") or rp.parent.name
        label = next((q for q in ("fp32", "int8", "int4", "fp16") if name.endswith(q)), name)
        reports[label] = rp
        eng = rp.parent / "engine"
        if not eng.exists():
            build = next((s for s in rep.get("stages", []) if s.get("name") == "build" and s.get("payload")), None)
            eng = Path(build["payload"]) if build else None
        if eng is not None and Path(eng).exists():
            engines[label] = str(Path(eng).resolve())
    return engines, reports


def warm_rerun(recipes: list[str], out: Path) -> dict:
    """Time a second `forge build` of the same recipes: every stage should be a cache hit."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", "build", *recipes,
                        "--report-dir", str(out)],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    reps = {p.parent.name: stage_times(json.loads(p.read_text())) for p in sorted(out.glob("*/report.json"))}
    statuses = {n: sorted({v["status"] for v in r_["stages"].values()}) for n, r_ in reps.items()}
    return {"command_wall_s": wall, "returncode": r.returncode, "reports": reps, "stage_statuses": statuses,
            "stderr_tail": r.stderr[-1000:] if r.returncode else ""}


# ----------------------------------------------------------------------------- worker
def base_ids(tokenizer_dir: str | None) -> list[int] | None:
    if not tokenizer_dir or not (Path(tokenizer_dir) / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return tok.encode((HERE / "prompt.txt").read_text()).ids


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("FORGE_PROGRESS", "0")
    threads = spec["threads"]
    t0 = time.perf_counter()
    if spec["kind"] == "ours":
        from bench.adapters import OursAdapter

        ad = OursAdapter.load(spec["name"], spec["path"], threads)
    else:
        from bench.peers import load_peer

        ad = load_peer(spec, threads)
    load_s = time.perf_counter() - t0
    from bench.adapters import dir_size

    res = measure_adapter(ad, vocab_size=spec["vocab_size"], base_ids=spec.get("base_ids"), reps=spec["reps"],
                          prefill_len=spec["prefill_len"], decode_prompt=spec["decode_prompt"],
                          decode_new=spec["decode_new"], warmup=1,
                          progress=lambda m: print(f"  [{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr,
                                                   flush=True))
    res.update(kind=spec["kind"], path=spec["path"], load_s=load_s, size_bytes=dir_size(spec["path"]),
               peak_rss_bytes=process_peak_rss_bytes(), note=spec.get("note"))
    if spec.get("gates"):   # after the peak RSS is read: the FP32 reference is not the peer's memory
        from bench.gates import score_against_fp32

        print(f"  [{time.strftime('%H:%M:%S')}] {spec['name']} accuracy vs FP32 ({spec['gates']['recipe']}'s "
              f"eval sets)", file=sys.stderr, flush=True)
        try:
            res["gates"] = score_against_fp32(ad.logits, spec["hf_dir"], spec["gates"])
        except Exception as e:  # noqa: BLE001 - the speed figures stand; the table says why accuracy is missing
            res["gates"] = {"error": f"{type(e).__name__}: {e}"[-500:]}
    Path(spec["result"]).write_text(json.dumps(res, indent=1))


def run_worker(spec: dict, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() else "_" for c in spec["name"])
    sp, rp = work / f"spec_{safe}.json", work / f"result_{safe}.json"
    rp.unlink(missing_ok=True)
    sp.write_text(json.dumps(dict(spec, result=str(rp))))
    print(f"[bench] {spec['name']}: {spec['path']}", file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, "-m", "bench.run", "--worker", str(sp)], stdout=subprocess.PIPE,
                       stderr=None, text=True, cwd=str(HERE.parent))
    if r.returncode != 0 or not rp.exists():
        return {"name": spec["name"], "kind": spec["kind"], "error": f"worker exited {r.returncode}"}
    return json.loads(rp.read_text())


# ----------------------------------------------------------------------------- outputs
def _fmt(v, kind="num"):
    if v is None:
        return "n/a"
    if kind == "ratio":
        return f"{v:.2f}x"
    if kind == "bytes":
        return f"{v / 2**20:,.0f} MiB"
    if kind == "ms":
        return f"{v * 1000:,.0f} ms"
    return f"{v:,.1f}"


def _gate_cells(g: dict | None) -> list[str]:
    """ppl vs FP32, top-1, verdict: the cells of one row's accuracy (bench/gates.py)."""
    if not g:
        return ["n/a", "n/a", "not scored"]
    if "error" in g:
        return ["n/a", "n/a", f"not scored: {g['error']}"]
    verdict = "passes" if g["passed"] else "**fails**: " + "; ".join(g["failed"][:3]) + \
        (f" (+{len(g['failed']) - 3} more)" if len(g["failed"]) > 3 else "")
    ppl, top1 = g.get("ppl_delta_pct"), g.get("top1_agreement")
    return [f"{ppl:+.2f} %" if ppl is not None else "n/a", f"{top1:.3f}" if top1 is not None else "n/a", verdict]


def fastest(results: dict, metric: str) -> dict:
    """The fastest row (ours or peer) for ``metric`` among those that pass the gates, and overall:
    {"passing": (name, value) | None, "overall": (name, value, passed) | None}."""
    gates = (results.get("gates") or {}).get("engines") or {}
    rows = [(f"ours {k}", flat(v).get(metric), (gates.get(k) or {}).get("passed"))
            for k, v in (results.get("engines") or {}).items() if "error" not in v]
    rows += [(k, flat(v).get(metric), (v.get("gates") or {}).get("passed"))
             for k, v in (results.get("peers") or {}).items() if "what" in v]
    rows = [r for r in rows if r[1] is not None]
    ok = [r for r in rows if r[2]]
    best = max(rows, key=lambda r: r[1], default=None)
    best_ok = max(ok, key=lambda r: r[1], default=None)
    return {"passing": best_ok[:2] if best_ok else None, "overall": best}


def markdown(results: dict) -> str:
    m = results["machine"]
    s = results["settings"]
    lines = [f"# forge bench — {m['date']}", "",
             f"Machine: {m['cpu_model']} (ISA class {m.get('isa_class', 'not recorded')}), {m['usable_cpus']} usable "
             f"CPUs, {s['threads']} threads per engine; "
             f"OPENBLAS_NUM_THREADS={m['env'].get('OPENBLAS_NUM_THREADS')}, "
             f"OMP_NUM_THREADS={m['env'].get('OMP_NUM_THREADS')}; load average at start "
             f"{', '.join(f'{x:.2f}' for x in (m.get('load_avg_at_start') or []))}; onnxruntime "
             f"{m['versions'].get('onnxruntime')}.",
             f"Medians of {s['reps']} repetitions (after 1 warm-up) in each of {s.get('passes', 1)} pass(es) over "
             f"every engine and peer, the order reversed each pass. Prefill: {s['prefill_len']}-token prompts. "
             f"Decode: {s['decode_new']} new tokens after a {s['decode_prompt']}-token prompt, rate = "
             f"(n-1) tokens / (t(n) - t(1)). TTFT: generate 1 token after a {s['prefill_len']}-token prompt.", ""]
    eng = results["engines"]
    if eng:
        cols = list(eng)
        lines += ["## Our engines (ONNX Runtime, CPU)", "", "| metric | " + " | ".join(cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for key, label in METRICS + [("ttft_s", "time to first token"), ("size_bytes", "size on disk"),
                                     ("peak_rss_bytes", "peak RSS")]:
            kind = "ms" if key == "ttft_s" else "bytes" if key.endswith("bytes") else "num"
            lines.append(f"| {label} | " + " | ".join(_fmt(flat(eng[c]).get(key) if "error" not in eng[c] else None,
                                                           kind) for c in cols) + " |")
        if results["ratios"]:
            lines += ["", "Ratios (speed: >1 = faster; TTFT/size/RSS: <1 = smaller):", "",
                      "| ratio | " + " | ".join(k for k, _ in METRICS) + " | TTFT | size | peak RSS |",
                      "|---|" + "---|" * (len(METRICS) + 3)]
            for name, r in results["ratios"].items():
                lines.append(f"| {name} | " + " | ".join(_fmt(r.get(k), "ratio") for k, _ in METRICS) +
                             f" | {_fmt(r.get('ttft_s'), 'ratio')} | {_fmt(r.get('size_bytes'), 'ratio')} | "
                             f"{_fmt(r.get('peak_rss_bytes'), 'ratio')} |")
        g = results.get("gates")
        if g:
            cells = {c: _gate_cells(g["engines"].get(c)) for c in cols}
            for i, label in enumerate(("ppl vs FP32", "top-1 vs FP32", "gates")):
                lines.append(f"| {label} | " + " | ".join(cells[c][i] for c in cols) + " |")
        errs = [f"- {c}: {eng[c]['error']}" for c in cols if "error" in eng[c]]
        skips = [f"- {c}: {v}" for c in cols for v in (eng[c].get("skipped") or {}).values()]
        if errs or skips:
            lines += ["", *errs, *skips]
    pl = results.get("pipeline") or {}
    if pl.get("cold"):
        lines += ["", "## Pipeline (forge build)", "", "| recipe | stage | status | seconds |", "|---|---|---|---|"]
        for label, rep in pl["cold"].items():
            for st, v in rep["stages"].items():
                lines.append(f"| {rep.get('recipe') or label} | {st} | {v['status']} | {_fmt(v['seconds'])} |")
            lines.append(f"| {rep.get('recipe') or label} | **total** | {rep.get('status')} | "
                         f"{_fmt(rep.get('wall_s'))} |")
        lines.append("")
        lines.append("A stage shown as `hit` was already in the cache for that run: its cold time is not measured "
                     "there.")
    if pl.get("warm"):
        w = pl["warm"]
        lines += ["", f"Warm no-op re-run (`forge build` of the same recipes again): {w['command_wall_s']:.1f} s "
                      f"wall, exit {w['returncode']}, stage statuses: {w['stage_statuses']}"]
    peers = results.get("peers") or {}
    if peers:
        blank = " |" * (len(METRICS) + 5)
        lines += ["", "## Peers (same prompt ids, same threads)", "",
                  "| peer | what ran | " + " | ".join(l for _, l in METRICS) +
                  " | size | peak RSS | ppl vs FP32 | top-1 vs FP32 | gates |",
                  "|---|---|" + "---|" * (len(METRICS) + 5)]
        for n, p in peers.items():
            if "skipped" in p and isinstance(p["skipped"], str):
                lines.append(f"| {n} | skipped: {p['skipped']} |" + blank)
                continue
            if "error" in p:
                lines.append(f"| {n} | error: {p['error']} |" + blank)
                continue
            f = flat(p)
            lines.append(f"| {n} | {p.get('what')} | " + " | ".join(_fmt(f[k]) for k, _ in METRICS) +
                         f" | {_fmt(f['size_bytes'], 'bytes')} | {_fmt(f['peak_rss_bytes'], 'bytes')} | " +
                         " | ".join(_gate_cells(p.get("gates"))) + " |")
        g = results.get("gates")
        if g:
            spec = g["spec"]
            sets = ", ".join(f"{e['set']}/{e['split']} ({e['samples']} x {e['seq_len']})" for e in spec["eval"])
            th = spec["thresholds"]
            held = ", ".join(x for x in (
                f"perplexity <= +{th['ppl_delta_pct_max']} %" if th.get("ppl_delta_pct_max") is not None else "",
                f"top-1 >= {th['top1_agreement_min']}" if th.get("top1_agreement_min") is not None else "") if x)
            lines += ["", f"Accuracy: each row's logits against the FP32 torch model on {spec['recipe']}'s eval sets "
                          f"({sets}), held to its gates ({held or 'none set'}; pooled and per set); ours from their "
                          f"build reports."
                          + (f" Gated by the recipe but not scored here (the bench compares logits only): "
                             f"{', '.join(spec['not_scored'])}." if spec.get("not_scored") else "")]
            for key, label in METRICS:
                fr = fastest(results, key)
                if fr["overall"] is None:
                    continue
                ok = f"{fr['passing'][0]} ({_fmt(fr['passing'][1])})" if fr["passing"] else "none"
                over = fr["overall"]
                tail = "" if fr["passing"] and over[0] == fr["passing"][0] else \
                    f"; fastest of all: {over[0]} ({_fmt(over[1])}, " + \
                    ("passes" if over[2] else "fails the gates" if over[2] is False else "not scored") + ")"
                lines.append(f"- fastest that passes, {label}: {ok}{tail}")
        if any(results.get("peer_ratios", {}).values()):
            lines += ["", "Peer speed ÷ our engine's speed (>1: the peer is faster):", "",
                      "| peer | vs | " + " | ".join(k for k, _ in METRICS) + " |",
                      "|---|---|" + "---|" * len(METRICS)]
            for n, by in results["peer_ratios"].items():
                for ours, r in by.items():
                    lines.append(f"| {n} | our {ours} | " + " | ".join(_fmt(r.get(k), "ratio") for k, _ in METRICS)
                                 + " |")
    return "\n".join(lines) + "\n"


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [(f"ours {k}", v) for k, v in results["engines"].items() if "error" not in v]
    rows += [(k, v) for k, v in (results.get("peers") or {}).items() if "error" not in v and "what" in v]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(rows))
    for ax, keys, title in ((axes[0], ["prefill_b1", "prefill_b4"], "prefill tokens/s (256-token prompts)"),
                            (axes[1], ["decode_b1", "decode_b8"], "decode tokens/s")):
        w = 0.38
        for j, k in enumerate(keys):
            vals = [flat(v)[k] or 0 for _, v in rows]
            bars = ax.bar(x + (j - 0.5) * w, vals, w, label=k.replace("_b", " batch "))
            for b, val in zip(bars, vals):
                if val:
                    ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{val:.0f}", ha="center", va="bottom",
                            fontsize=7)
        ax.set_xticks(x, [n for n, _ in rows], rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(f"SmolLM2-135M on {m['cpu_model']} ({m.get('isa_class', '?')}), {results['settings']['threads']} threads "
                 f"(medians of {results['settings']['reps']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    ap.add_argument("--engine", action="append", default=[], metavar="LABEL=DIR", help="engine dir (repeatable)")
    ap.add_argument("--report", action="append", default=[], metavar="LABEL=report.json",
                    help="forge report.json for pipeline stage times (repeatable)")
    ap.add_argument("--from-reports", type=Path, help="a forge --report-dir: take engines + report.json from it")
    ap.add_argument("--warm-rerun", action=argparse.BooleanOptionalAction, default=True,
                    help="with --from-reports: run `forge build` on the same recipes again and time the no-op "
                         "(default on)")
    ap.add_argument("--hf-dir", help="fp32 HF dir (tokenizer, ORT GenAI builder input); default: FORGE_TEST_MODEL")
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--peers", action="store_true", help="also run llama.cpp and ONNX Runtime GenAI")
    ap.add_argument("--gate-peers", action=argparse.BooleanOptionalAction, default=True,
                    help="score each peer's logits against FP32 on our recipe's eval sets and apply its gates "
                         "(default on; ~1 min a peer on 2 cores)")
    ap.add_argument("--quick", action="store_true", help="one pass, 32 new tokens (a smoke run)")
    ap.add_argument("--reps", type=int, help="repetitions of each figure per pass (default 2)")
    ap.add_argument("--passes", type=int, help="passes over every engine and peer, the order reversed each pass "
                                                "(default 2; --quick: 1)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for flag, v in (("--reps", a.reps), ("--passes", a.passes), ("--threads", a.threads)):
        if v is not None and v < 1:
            ap.error(f"{flag} {v}: must be at least 1")
    if a.worker:
        worker(a.worker)
        return 0

    t_start = time.perf_counter()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    threads = a.threads or usable
    reps = a.reps or 2
    passes = a.passes or (1 if a.quick else 2)   # 2 passes x 2 repetitions: 4 samples a figure, the order reversed
    engines: dict[str, str] = {}
    reports: dict[str, Path] = {}
    if a.from_reports:
        engines, reports = engines_from_reports(a.from_reports)
    for e in a.engine:
        k, _, v = e.partition("=")
        engines[k] = v
    for r in a.report:
        k, _, v = r.partition("=")
        reports[k] = Path(v)
    hf_dir = a.hf_dir or next((d for d in (hf_dir_from_report(json.loads(Path(p).read_text()))
                                            for p in reports.values()) if d), None) \
        or os.environ.get("FORGE_TEST_MODEL") or None
    tok_dir = hf_dir if hf_dir and (Path(hf_dir) / "tokenizer.json").exists() else next(
        (d for d in engines.values() if (Path(d) / "tokenizer.json").exists()), None)
    ids = base_ids(tok_dir)
    vocab = 49152
    cfg_dir = hf_dir or next(iter(engines.values()), None)
    if cfg_dir and (Path(cfg_dir) / "config.json").exists():
        vocab = json.loads((Path(cfg_dir) / "config.json").read_text()).get("vocab_size", vocab)
    settings = {"reps": reps, "passes": passes, "threads": threads, "prefill_len": 256, "decode_prompt": 32,
                "decode_new": 32 if a.quick else 64, "quick": a.quick, "prompt": "bench/prompt.txt (Austen, public "
                "domain), tokenized" if ids else "seeded random ids (no tokenizer found)"}
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "work"
    common = dict(threads=threads, reps=reps, vocab_size=vocab, base_ids=ids, prefill_len=256,
                  decode_prompt=32, decode_new=settings["decode_new"])
    results: dict = {"machine": machine_facts(threads), "settings": settings, "engines": {}, "ratios": {},
                     "pipeline": {}, "peers": {}, "peer_ratios": {}}
    if not engines:
        print("[bench] no engines given (--engine LABEL=DIR or --from-reports DIR)", file=sys.stderr)
    gate = None
    if reports:
        from bench.gates import ours_from_report, spec_from_reports

        gate = spec_from_reports(reports)
        if gate is not None:
            results["gates"] = {"spec": gate, "engines": {
                k: ours_from_report(json.loads(Path(reports[k]).read_text()), gate) for k in reports}}
    jobs = [("engines", label, dict(common, name=label, kind="ours", path=d)) for label, d in engines.items()]
    if a.peers:
        from bench.peers import peer_plan

        scored = dict(gates=gate, hf_dir=hf_dir) if a.gate_peers and gate is not None and hf_dir else {}
        if a.gate_peers and not scored:
            print("[bench] peers' accuracy not scored: it needs a forge report with validate.eval and the fp32 HF "
                  "dir (--from-reports / --report and --hf-dir)", file=sys.stderr)
        for spec in peer_plan(Path(hf_dir) if hf_dir else None, a.out / "peers", threads, ours=engines):
            if "skipped" in spec:
                print(f"[bench] peer {spec['name']} skipped: {spec['skipped']}", file=sys.stderr)
                results["peers"][spec["name"]] = {"skipped": spec["skipped"]}
                continue
            jobs.append(("peers", spec["name"], dict(common, **spec, **scored)))
    # every engine and peer runs once a pass, the order reversed from pass to pass: on a machine whose speed drifts
    # (or that runs whatever comes first slower) a fixed order favours the later rows
    parts: dict[tuple[str, str], list[dict]] = {(kind, name): [] for kind, name, _ in jobs}
    for p in range(passes):
        print(f"[bench] pass {p + 1} of {passes}", file=sys.stderr, flush=True)
        for kind, name, spec in (jobs if p % 2 == 0 else jobs[::-1]):
            if p and "gates" in spec:      # a peer's accuracy is scored once, in the pass it first ran
                spec = {k: v for k, v in spec.items() if k not in ("gates", "hf_dir")}
            parts[(kind, name)].append(run_worker(spec, work))
    for (kind, name), got in parts.items():
        results[kind][name] = merge_passes(got)
    eng = {k: v for k, v in results["engines"].items() if "error" not in v}
    if "fp32" in eng:
        for k in eng:
            if k != "fp32":
                results["ratios"][f"{k}/fp32"] = ratios(eng[k], eng["fp32"])
    if "int8" in eng and "int4" in eng:
        results["ratios"]["int4/int8"] = ratios(eng["int4"], eng["int8"])
    for n, p in results["peers"].items():
        if "what" in p:
            results["peer_ratios"][n] = {k: ratios(p, eng[k]) for k in ("int8", "int4") if k in eng}
    if reports:
        results["pipeline"]["cold"] = {k: stage_times(json.loads(Path(p).read_text())) for k, p in reports.items()}
    if a.warm_rerun and a.from_reports:   # after every measurement: a build beside them would slow them
        recipes = [json.loads(Path(p).read_text()).get("recipe") for p in reports.values()]
        results["pipeline"]["warm"] = warm_rerun([r for r in recipes if r], a.out / "warm-reports")
    results["bench_wall_s"] = time.perf_counter() - t_start
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    md_text = markdown(results)
    (a.out / "results.md").write_text(md_text)
    try:
        chart(results, a.out / "chart.png")
    except ImportError as e:
        print(f"[bench] no chart: {e} (pip install matplotlib)", file=sys.stderr)
    print(md_text)
    for n, p in (results.get("peers") or {}).items():     # said last, plainly: which peer did not run and why
        why = p.get("skipped") if isinstance(p.get("skipped"), str) else p.get("error")
        if why:
            print(f"[bench] peer {n} did not run: {why}", file=sys.stderr)
    print(f"[bench] wrote {a.out}/results.json, results.md, chart.png in {results['bench_wall_s']:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
