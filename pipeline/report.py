"""Build reports: report.json (machine-readable), junit.xml (nightly CI), and a short human summary."""

from __future__ import annotations

import io
import json
import math
import platform
import socket
import time
from dataclasses import asdict
from pathlib import Path
from xml.etree import ElementTree as ET

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .console import make_console
from .host.cpu import cpu_facts, cpu_model
from .host.files import atomic_write
from .hashing import sha256_json
from .recipe import Recipe
from .stage_walk import StageResult
from .status import Status, overall

def machine() -> dict:
    """Where a report was made (the CPU as pipeline/host/cpu.py names it, like manifests and forge doctor)."""
    return {"platform": platform.platform(), "python": platform.python_version(), "processor": cpu_model(),
            "arch": platform.machine(), **cpu_facts()}


def overall_status(results: list[StageResult]) -> Status:
    return overall(r.status for r in results)


def _clean(obj):
    """JSON-safe: NaN/inf become strings so report.json stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def model_note(recipe: Recipe) -> str | None:
    """What a report says first about a model with generated weights (model.source random:...); None otherwise."""
    from . import random_weights
    m = recipe.model
    if not random_weights.is_random(m.source):
        return None
    return (f"{random_weights.NOTE} (model.source {m.source}, seed {m.seed}, "
            f"{'layers ' + str(m.layers) if m.layers is not None else 'all layers'})")


def local_executor() -> dict:
    """report.json's ``executor`` of a build on this machine (Ray's: ray_executor.executor_info)."""
    return {"kind": "local", "host": socket.gethostname()}


def build_report(recipe: Recipe, results: list[StageResult], wall_s: float, executor: dict | None = None) -> dict:
    """``executor``: how the night was built (local_executor(), or the Ray cluster); each stage's ``origin`` says
    where its output came from (stage_walk.StageResult)."""
    report = {
        "recipe": recipe.name,
        "recipe_hash": recipe.hash,
        "target": recipe.build.target,
        "status": overall_status(results),
        "wall_s": round(wall_s, 3),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "executor": executor or local_executor(),
        "stages": [asdict(r) | {"duration_s": round(r.duration_s, 3), "peak_rss_mb": round(r.peak_rss_mb, 1)}
                   for r in results],
    }
    if (note := model_note(recipe)) is not None:
        report["note"] = note
    return _clean(report)


def not_started_report(recipe: Recipe, error: BaseException, wall_s: float, executor: dict | None = None) -> dict:
    """report.json of a recipe that resolved but could not start its stages (the shared store cannot be opened,
    the disk is full, the Ray cluster cannot be reached): one failed step, ``start``, says why."""
    return build_report(recipe, [StageResult("start", Status.FAILED, message=str(error) or type(error).__name__,
                                             error_type=type(error).__name__)], wall_s, executor)


def report_dir_name(name: str) -> str:
    """A directory name for a recipe's reports even when the name given was not a valid recipe name."""
    from .recipe import MAX_NAME_CHARS, NAME_RE
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml") if name.endswith((".yaml", ".yml")) else name
    if len(stem) <= MAX_NAME_CHARS and NAME_RE.match(stem):
        return stem
    return "invalid-" + sha256_json(name)[:12]


def invalid_report(name: str, error: Exception) -> dict:
    """report.json of a recipe that did not resolve: no stages ran; the problems are the result."""
    problems = getattr(error, "problems", None) or [str(error)]
    return _clean({
        "recipe": name if len(name) <= 200 else name[:200] + "...",
        "recipe_hash": None,
        "target": None,
        "status": Status.INVALID,
        "wall_s": 0.0,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "problems": problems,
        "stages": [{"name": "resolve", "status": Status.FAILED, "key": None, "duration_s": 0.0, "peak_rss_mb": 0.0,
                    "metrics": {}, "message": "\n".join(problems[:50]), "payload": None,
                    "error_type": type(error).__name__, "log": None}],
    })


def write_summary(statuses: dict[str, str], report_dir: Path) -> Path:
    return atomic_write(report_dir / "summary.json", json.dumps(statuses, indent=2))


def junit_xml(report: dict) -> str:
    suite = ET.Element("testsuite", name=f"forge.{report['recipe']}")
    tests = failures = skipped = 0
    for st in report["stages"]:
        tests += 1
        case = ET.SubElement(suite, "testcase", classname=f"forge.{report['recipe']}.stage", name=st["name"],
                             time=str(st["duration_s"]))
        if st["status"] == Status.FAILED:
            failures += 1
            kind = f"{st['error_type']}: " if st.get("error_type") and st["error_type"] != "StageFailed" else ""
            text = st["message"] + (f"\nlog: {st['log']}" if st.get("log") else "")
            ET.SubElement(case, "failure", message=(kind + st["message"])[:500],
                          type=st.get("error_type") or "failed").text = text
        elif st["status"] in (Status.CANNOT_RUN_HERE, Status.SKIPPED):
            skipped += 1
            ET.SubElement(case, "skipped", message=st["message"][:500])
        for gate in (st.get("metrics") or {}).get("gates", []):
            tests += 1
            g = ET.SubElement(suite, "testcase", classname=f"forge.{report['recipe']}.{st['name']}", name=gate["name"])
            ET.SubElement(g, "system-out").text = json.dumps(gate)
            if not gate["passed"]:
                failures += 1
                text = gate.get("message") or f"{gate['name']}={gate['value']} needs {gate['op']} {gate['threshold']}"
                ET.SubElement(g, "failure", message=text[:500]).text = text
    suite.set("tests", str(tests))
    suite.set("failures", str(failures))
    suite.set("skipped", str(skipped))
    return ET.tostring(suite, encoding="unicode")


KEY_METRICS = ("ppl_delta_pct", "ppl_ptq_delta_pct", "ppl_qat_delta_pct", "simulated_ppl_gap", "top1_agreement", "logits_cosine", "greedy_exact_match", "method", "size_ratio",
               "export_s", "max_abs_err", "passed")


def summary_table(report: dict) -> Table:
    t = Table(title=f"{escape(str(report['recipe']))} [{report['target']}] — {report['status']} in {report['wall_s']:.1f}s")
    for col in ("stage", "status", "time s", "peak RSS MB", "key", "notes"):
        t.add_column(col, no_wrap=col != "notes")      # names are never cut (pipeline/console.py)
    colors = {Status.HIT: "green", Status.BUILT: "cyan", Status.FAILED: "red", Status.CANNOT_RUN_HERE: "yellow", Status.SKIPPED: "dim",
              Status.INVALID: "red"}
    for st in report["stages"]:
        m = st.get("metrics") or {}
        notes = ", ".join(f"{k}={m[k]:.4g}" if isinstance(m.get(k), float) else f"{k}={m[k]}"
                          for k in KEY_METRICS if k in m)
        if st["message"]:
            notes = (notes + "; " if notes else "") + st["message"]
        t.add_row(st["name"], f"[{colors.get(st['status'], 'white')}]{st['status']}", f"{st['duration_s']:.1f}",
                  f"{st['peak_rss_mb']:.0f}", (st["key"] or "")[:12], escape(notes))
    return t


def write_reports(report: dict, out_dir: Path, console: Console | None = None) -> None:
    atomic_write(out_dir / "report.json", json.dumps(report, indent=2, default=str))
    atomic_write(out_dir / "junit.xml", junit_xml(report))
    c = make_console(record=True, file=io.StringIO())   # a file: no line is wrapped
    note = f"note: {report['note']}" if report.get("note") else None
    c.print(summary_table(report))
    if note:
        c.print(escape(note))
    atomic_write(out_dir / "summary.txt", c.export_text())
    if console:
        console.print(summary_table(report))
        if note:
            console.print(escape(note))
