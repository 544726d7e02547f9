"""One Ray node versus two: the wall time of building the three CPU recipes through the shared cache.

    python -m bench.scaleout [--recipes smollm2-135m-fp32 smollm2-135m-int8 smollm2-135m-int4] [--full]
                             [--out bench/out/scaleout.json]

Starts SeaweedFS and Ray on loopback (tests/scaleout/servers.py: the same servers the tests use), then builds
the recipes with ``forge build --executor ray`` twice in one run: on a cluster of one node, then from scratch
(a new bucket prefix, new node homes) on a cluster of two nodes, one CPU slot per node either way. Every node's
FORGE_HOME links the data sets and converted model of this machine's FORGE_HOME (``forge data fetch`` and one
build done first). Without ``--full`` the recipes run with the test suite's smaller calibration and prompt
set (tests/conftest.py DEFAULT_OVERRIDES); the evaluation text and gates are the recipes' own.

On one machine the two "nodes" share its cores: the figure says how much the scheduling overlaps stages whose
work does not fill the machine, not what a second machine adds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "scaleout"))
from servers import link_home, ray_cluster, seaweedfs  # noqa: E402

RECIPES = ["smollm2-135m-fp32", "smollm2-135m-int8", "smollm2-135m-int4"]


def _ci_overrides() -> list[str]:
    """The test suite's smaller calibration / prompt set (one home: tests/conftest.py)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("forge_tests_conftest", REPO / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.DEFAULT_OVERRIDES)


def build(nodes: int, s3, recipes: list[str], overrides: list[str], home: Path, work: Path, log_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_", "FORGE_CACHE"))}
    env.update(s3.env(), PYTHONPATH=str(REPO), FORGE_PROGRESS="0")
    prefix = f"bench-{nodes}-{uuid.uuid4().hex[:8]}"
    with ray_cluster(work / "ray", env, nodes=nodes, link_from_home=home) as cluster:
        driver = work / "driver"
        link_home(home, driver)
        cmd = [sys.executable, "-m", "pipeline.cli", "build", *recipes, "--keep-going", "--executor", "ray",
               "--ray-address", cluster.address, "--report-dir", str(work / "out"),
               *[a for o in overrides for a in ("--set", o)]]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env={**env, "FORGE_HOME": str(driver), "FORGE_CACHE": f"s3://{s3.bucket}/{prefix}"},
                           capture_output=True, text=True, cwd=work)
        wall = time.perf_counter() - t0
    log = log_dir / f"scaleout-{nodes}-node{'s' if nodes > 1 else ''}.log"
    log.write_text(p.stdout + p.stderr)
    reports = {r: json.loads((work / "out" / r / "report.json").read_text()) for r in recipes
               if (work / "out" / r / "report.json").exists()}
    stages = [(r, s["name"], s["status"], s["duration_s"], (s.get("node") or {}).get("ip"))
              for r, rep in reports.items() for s in rep["stages"]]
    return {"nodes": nodes, "wall_s": round(wall, 1), "exit": p.returncode,
            "status": {r: rep["status"] for r, rep in reports.items()},
            "stage_s": round(sum(s[3] for s in stages if s[2] == "built"), 1),
            "stages": stages, "log": str(log)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    ap.add_argument("--full", action="store_true", help="the recipes as written (default: the CI overrides)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "scaleout.json")
    a = ap.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    from pipeline.host.cpu import cpu_facts
    from pipeline.host.paths import forge_home
    overrides = [] if a.full else _ci_overrides()
    home = forge_home()
    runs = []
    with tempfile.TemporaryDirectory(prefix="forge-scaleout-") as tmp:
        with seaweedfs(Path(tmp) / "weed", volume_mb=512) as s3:
            s3.bucket = s3.new_bucket("forge-bench")
            for nodes in (1, 2):
                work = Path(tmp) / f"n{nodes}"
                work.mkdir()
                runs.append(build(nodes, s3, a.recipes, overrides, home, work, a.out.parent))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "stages"}), flush=True)
    cpu = cpu_facts()       # the CPU and ISA class as every cache key and report names them
    result = {"machine": {"cpus": os.cpu_count(), "cpu": cpu["cpu_model"], "isa": cpu["isa_class"],
                          "loadavg_at_end": os.getloadavg()},
              "recipes": a.recipes, "overrides": overrides, "runs": runs,
              "speedup_2_vs_1": round(runs[0]["wall_s"] / runs[1]["wall_s"], 2)}
    a.out.write_text(json.dumps(result, indent=1))
    print(f"1 node: {runs[0]['wall_s']} s, 2 nodes: {runs[1]['wall_s']} s, speed-up {result['speedup_2_vs_1']}x "
          f"({os.cpu_count()} cores, {result['machine']['isa']}); {a.out}")


if __name__ == "__main__":
    main()
