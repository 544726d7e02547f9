"""`forge history add-bench bench/out/results.json`: bench figures onto the nights that built those engines.

`python -m bench.run` measures engines after `forge build`; an engine's directory is its build stage's
cache payload (``.../entries/xx/<key>/payload``), so the key in its path names the nights (the newest of
each recipe) whose build produced it. The figures are stored with those nights, the recipes' bench
rules (``validate.regression.prefill_tok_s`` ...) are checked against the last good night that has bench
figures, and a broken rule fails the night: its status in the history, its report.json / junit.xml
(re-written with a ``bench_regression`` case) and this command's exit code (1).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ..recipe import RegressionRules
from .facts import utc_now
from .regression import evaluate_rules
from .store import History

_KEY = re.compile(r"^[0-9a-f]{64}$")


def flat(res: dict) -> dict:
    """Headline numbers of one measured engine/peer (None where not measured): what the history stores of a
    bench result and what `python -m bench.run` tabulates (bench imports it from here)."""
    p, d = res.get("prefill", {}), res.get("decode", {})
    return {
        "prefill_b1": p.get("1", {}).get("tokens_per_s"),
        "prefill_b4": p.get("4", {}).get("tokens_per_s"),
        "decode_b1": d.get("1", {}).get("tokens_per_s"),
        "decode_b8": d.get("8", {}).get("tokens_per_s"),
        "ttft_s": (res.get("ttft") or {}).get("median_s"),
        "size_bytes": res.get("size_bytes"),
        "peak_rss_bytes": res.get("peak_rss_bytes"),
    } if "serve" not in res else serve_flat(res["serve"])


def serve_flat(serve: dict) -> dict:
    """Headline numbers of bench/serve.py: req/s at concurrency 1 and 16 over c1, per protocol; mismatches."""
    out = {}
    for proto, levels in serve.get("protocols", {}).items():
        c1 = (levels.get("1") or {}).get("req_s")
        out[f"serve_{proto}_c1_req_s"] = c1
        for c in ("4", "16"):
            cn = (levels.get(c) or {}).get("req_s")
            out[f"serve_{proto}_c{c}_over_c1"] = cn / c1 if cn and c1 else None
    out["serve_mismatches"] = serve.get("mismatches")
    out["serve_errors"] = serve.get("errors")
    return out


def engine_key(path: str) -> str | None:
    return next((p for p in reversed(Path(path).parts) if _KEY.match(p)), None)


def add_bench(h: History, results_path: Path, console: Console, err: Console) -> int:
    try:
        results = json.loads(Path(results_path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        err.print(f"[red]error:[/] {results_path}: cannot read bench results ({e}); run `python -m bench.run` first")
        return 2
    facts = {"machine": results.get("machine"), "settings": results.get("settings")}
    worst, attached = 0, 0
    for label, res in (results.get("engines") or {}).items():
        if "error" in res or not res.get("path"):
            err.print(f"{label}: not measured ({res.get('error', 'no path')}); skipped")
            continue
        key = engine_key(res["path"])
        ids = h.runs_with_stage_key("build", key) if key else []
        if not ids:
            err.print(f"{label}: no night in {h.path} built {res['path']} (not an engine from the artifact cache, "
                      f"or its build was not recorded); skipped")
            continue
        figures = {k: v for k, v in flat(res).items() if v is not None}
        for rid in ids:
            run = h.get(rid)
            run.bench = figures
            rules = RegressionRules.model_validate(run.recipe_dict.get("validate", {}).get("regression") or {})
            gates, notes = evaluate_rules(h, rules, run, {"bench"})
            bad = [g for g in gates if not g["passed"]]
            status = "failed" if bad else None
            h.attach_bench(rid, figures, source=str(Path(results_path).absolute()), label=label, facts=facts,
                           recorded=utc_now(), gates=[dict(g, stage="regression") for g in gates], status=status)
            attached += 1
            console.print(f"{run.recipe} {run.label}: bench figures of '{label}' recorded "
                          f"({', '.join(f'{k}={v:.4g}' for k, v in figures.items())})")
            for g in gates:
                mark = "[green]ok[/]" if g["passed"] else "[red]REGRESSION[/]"
                console.print(f"  {mark} {escape(g['message'])}")
            for n in notes:
                console.print(f"  [dim]{escape(n)}[/]")
            if gates:
                _update_report(run, gates, err)
            if bad:
                worst = 1
    if not attached:        # a nightly that records nothing must not look like one that did
        err.print(f"[red]error:[/] no bench figures recorded from {results_path}: no measured engine was built by a "
                  f"night in {h.path}; build the recipes with `forge build RECIPE --report-dir out` first")
        return 1
    return worst


def _update_report(run, gates: list[dict], err: Console) -> None:
    """Add the bench verdicts to the night's report.json / junit.xml / summary.txt, if they are still there."""
    from ..report import write_reports
    path = Path(run.report_path or "")
    if not path.is_file():
        return
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        err.print(f"[yellow]warning:[/] {path} unreadable: bench verdicts only in the history")
        return
    bad = [g for g in gates if not g["passed"]]
    stage = {"name": "bench_regression", "status": "failed" if bad else "built", "key": None, "duration_s": 0.0,
             "peak_rss_mb": 0.0, "metrics": {"gates": gates}, "payload": None, "components": None,
             "message": " | ".join(g["message"] for g in bad)}
    report["stages"] = [s for s in report["stages"] if s.get("name") != "bench_regression"] + [stage]
    if bad:
        report["status"] = "failed"
    write_reports(report, path.parent)
