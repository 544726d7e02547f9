"""lab/gpu_ort_run.py (the GPU session's one device script, docs/gpu-runs.md): every phase as a dry run on this
machine. Moved from tests/ort/test_cuda.py: a lab script's tests live in the lab (`make lab-test`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("phase", ["receive", "setup", "test", "build", "serve", "bench", "diag"])
def test_gpu_run_script_phases_dry_run(phase, tmp_path):
    """lab/gpu_ort_run.py (the lead's one device script): every phase runs here as a dry run and writes its
    JSON under $OUT."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path), "FORGE_CARRY_DIR": str(tmp_path / "carry"),
           "FORGE_SITE": str(tmp_path / "site" / "site-packages"), "FORGE_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "lab/gpu_ort_run.py", "--phase", phase, "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / f"{phase}.json").read_text())
    assert res["phase"] == phase and "finished" in res
    if phase == "build":
        assert any("smollm2-135m-cuda-fp16 smollm2-135m-cuda-int4" in s["cmd"] for s in res["steps"])
