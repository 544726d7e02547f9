"""The default recipe end to end on the real SmolLM2-135M: gates, caching, re-runs, reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from pipeline.recipe import resolve
from pipeline.runner import Runner

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def payload_bytes(p: str | Path, suffixes=(".onnx", ".data", ".onnx_data")) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file() and f.name.endswith(suffixes))


def test_default_int8_build_passes_its_gates(default_build):
    r, res = default_build
    assert {k: v.status for k, v in res.items()} == {k: res[k].status for k in res} and all(
        v.status in ("built", "hit") for v in res.values()), {k: (v.status, v.message) for k, v in res.items()}
    ev = res["evaluate"].metrics
    assert ev["subject"] == "onnxruntime engine"
    assert ev["ppl_delta_pct"] <= 5.0, ev
    assert ev["top1_agreement"] >= 0.85, ev
    gates = {g["name"]: g for g in res["validate"].metrics["gates"]}
    assert gates["ppl_delta_pct"]["passed"] and gates["top1_agreement"]["passed"]
    assert res["quantize"].metrics.get("method"), "the report must say which INT8 method ran"


def test_int8_model_file_is_at_most_035x_fp32(default_build):
    r, res = default_build
    fp32 = payload_bytes(res["export"].payload)
    int8 = payload_bytes(res["build"].payload)
    assert int8 <= 0.35 * fp32, (int8, fp32, int8 / fp32)


def test_rebuild_is_all_hits_and_plan_agrees(default_build):
    r, first = default_build
    runner = Runner(r)
    assert all(p.status == "hit" for p in runner.plan()), [(p.name, p.status, p.reason) for p in runner.plan()]
    again = runner.build()
    assert [x.status for x in again] == ["hit"] * len(again)
    assert [x.key for x in again] == [first[x.name].key for x in again]


def test_threshold_change_reruns_only_validate_and_package(default_build, default_overrides):
    r, _ = default_build
    # a threshold no earlier run used: the shared cache would otherwise already hold this validate/package (a
    # second `make test` on one FORGE_HOME found them as hits)
    gate = 4.5 - (time.time_ns() % 10**6) / 10**8
    r2 = resolve(r.name, default_overrides + [f"validate.thresholds.ppl_delta_pct_max={gate:.8f}"])
    plans = {p.name: p for p in Runner(r2).plan()}
    assert [n for n, p in plans.items() if p.status != "hit"] == ["validate", "package"]
    assert "config.thresholds.ppl_delta_pct_max" in plans["validate"].reason
    res = {x.name: x.status for x in Runner(r2).build()}
    assert res == {**{n: "hit" for n in res}, "validate": "built", "package": "built"}


def test_impossible_threshold_fails_the_build_with_numbers(default_build, default_overrides, tmp_path):
    r, _ = default_build
    env = dict(os.environ, COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "build", r.name, "--report-dir", str(tmp_path),
                        *sum((["--set", o] for o in default_overrides + ["validate.thresholds.top1_agreement_min=1.0"]), [])],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "top1_agreement" in p.stderr and "validate.thresholds.top1_agreement_min" in p.stderr
    rep = json.loads((tmp_path / r.name / "report.json").read_text())
    assert rep["status"] == "failed"
    assert {s["name"]: s["status"] for s in rep["stages"]}["validate"] == "failed"
    suite = ET.parse(tmp_path / r.name / "junit.xml").getroot()
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert "validate" in failed and "top1_agreement" in failed


def test_cli_noop_build_writes_reports(default_build, default_overrides, tmp_path):
    r, _ = default_build
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "build", r.name, "--report-dir", str(tmp_path),
                        *sum((["--set", o] for o in default_overrides), [])],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr
    rep = json.loads((tmp_path / r.name / "report.json").read_text())
    # every stage a cache hit; the regression check (run history) is never cached: it runs after every build
    assert rep["status"] == "passed" and all(s["status"] == "hit" for s in rep["stages"] if s["name"] != "regression")
    assert [s["status"] for s in rep["stages"] if s["name"] == "regression"] in (["passed"], ["skipped"])
    assert (tmp_path / r.name / "triton_repo" / "ensemble" / "config.pbtxt").exists()
    suite = ET.parse(tmp_path / r.name / "junit.xml").getroot()
    names = [c.get("name") for c in suite.iter("testcase")]
    assert {"source", "export", "quantize", "build", "evaluate", "validate", "package"} <= set(names)
    assert {"ppl_delta_pct", "top1_agreement"} <= set(names)
