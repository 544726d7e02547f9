"""GPU setup for the CUDA recipes (issue 26): on a machine with an NVIDIA GPU, onnxruntime-gpu *instead of* the CPU
wheel, with the CUDA/cuDNN runtime libraries as wheels (loaded by forge itself: ``pipeline.host.cuda.preload_cuda``).

    python -m pipeline.gpu_setup plan     what would be done here, as JSON (changes nothing)
    python -m pipeline.gpu_setup install  do it (``make setup`` runs this; without a GPU it changes nothing)
        [--no-index --find-links DIR ...] from local wheels instead of the package index (the GPU lab machine)

The GPU is found through NVML (libnvidia-ml.so.1, the driver's own library) or else ``nvidia-smi``.
``FORGE_GPU=0`` keeps the CPU wheel on a GPU machine; ``FORGE_GPU=1`` installs the GPU wheels without a probe.
Standard library only: it runs before anything else is installed. Exit codes: 0 done / nothing to do, 1 a pip step
failed or the installed provider does not work, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable

from .host.gpu import nvml_call, nvml_driver, nvml_handles

ROOT = Path(__file__).resolve().parents[1]
# onnxruntime-gpu 1.31.x is built for CUDA 13 (its METADATA: extra "cuda" -> nvidia-cuda-runtime~=13.0); the
# driver must support that CUDA major. Its "cuda" extra names no cuBLAS, so pyproject's `gpu` extra adds it.
ORT_GPU_CUDA_MAJOR = 13


def gpu_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pyproject's ``gpu`` extra: the one home of the onnxruntime-gpu pin and the CUDA library wheels."""
    import tomllib
    return list(tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["gpu"])


def _pinned(reqs: list[str], dist: str) -> str | None:
    """X of ``dist==X`` (extras dropped) in the requirements, None when ``dist`` is not pinned exactly."""
    for r in reqs:
        m = re.match(re.escape(dist) + r"(\[[^\]]*\])?==([\w.]+)(;.*)?$", r.replace(" ", ""))
        if m:
            return m.group(2)
    return None


def ort_gpu_pin(reqs: list[str]) -> str:
    """``onnxruntime-gpu==X`` (extras dropped) from the requirements."""
    v = _pinned(reqs, "onnxruntime-gpu")
    if v is None:
        raise ValueError(f"pyproject.toml [project.optional-dependencies] gpu pins no onnxruntime-gpu==X: {reqs}")
    return "onnxruntime-gpu==" + v


def ort_cpu_pin(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """X of ``onnxruntime==X`` in pyproject's dependencies: the CPU engines' runtime. It equals the GPU pin (one
    onnxruntime: the version enters the cache key of every onnxruntime stage; tests/test_gpu_setup.py holds them
    equal), so ``make setup``, ``.[peers]`` and this GPU setup all install the same release."""
    import tomllib
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    v = _pinned(deps, "onnxruntime")
    if v is None:
        raise ValueError(f"{pyproject}: [project] dependencies pin no onnxruntime==X: "
                         f"{[d for d in deps if d.startswith('onnxruntime')]}")
    return v


def probe_nvml(nvml=None) -> dict:
    """GPUs through NVML (the driver's libnvidia-ml.so.1, by nvidia-ml-py's ``pynvml``; ``nvml`` is for tests)
    through forge's one NVML helper; ``{"gpus": []...}`` with ``error`` when it cannot be asked."""
    try:
        if nvml is None:
            import pynvml as nvml
        with nvml_handles(nvml) as handles:
            return {"via": "NVML", "gpus": [nvml_call(nvml, "nvmlDeviceGetName", h) for h in handles],
                    **nvml_driver(nvml)}
    except Exception as e:      # no library, no driver, no permission: the reason goes to probe()'s `tried`
        return {"via": "NVML", "gpus": [], "error": f"libnvidia-ml.so.1 cannot be asked ({type(e).__name__}: {e})"}


def probe_smi(run: Callable = subprocess.run) -> dict:
    """GPUs through ``nvidia-smi`` (names, driver; the CUDA version from its banner)."""
    if not shutil.which("nvidia-smi") and run is subprocess.run:
        return {"via": "nvidia-smi", "gpus": [], "error": "nvidia-smi not on PATH"}
    try:
        q = run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30)
        banner = run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"via": "nvidia-smi", "gpus": [], "error": str(e)}
    if q.returncode != 0:
        return {"via": "nvidia-smi", "gpus": [], "error": (q.stderr or q.stdout).strip()[:200]}
    rows = [[c.strip() for c in line.split(",")] for line in q.stdout.splitlines() if line.strip()]
    m = re.search(r"CUDA Version:\s*([\d.]+)", banner.stdout or "")
    return {"via": "nvidia-smi", "gpus": [r[0] for r in rows], "driver": rows[0][1] if rows else None,
            "cuda_driver": m.group(1) if m else None}


def probe(nvml: Callable[[], dict] = probe_nvml, smi: Callable[[], dict] = probe_smi,
          env: dict | None = None) -> dict:
    """What GPU this machine has: the first probe that finds one, else every probe's reason (``tried``)."""
    env = os.environ if env is None else env
    forced = env.get("FORGE_GPU", "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"FORGE_GPU={forced!r}: use 1 (GPU wheels), 0 (CPU wheel) or leave it unset (probe)")
    if forced == "0":
        return {"found": False, "forced": True, "gpus": [], "tried": ["FORGE_GPU=0"]}
    tried = []
    for p in (nvml, smi):
        r = p()
        if r.get("gpus"):
            return {"found": True, "forced": False, "tried": tried, **r}
        tried.append(f"{r.get('via')}: {r.get('error') or 'no GPU listed'}")
    if forced == "1":
        return {"found": True, "forced": True, "gpus": [], "cuda_driver": None, "tried": tried}
    return {"found": False, "forced": False, "gpus": [], "tried": tried}


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def plan(gpu: dict, reqs: list[str], *, python: str = sys.executable, pip_args: tuple[str, ...] = (),
         have: Callable[[str], str | None] = installed) -> dict:
    """The pip steps that put onnxruntime-gpu in place of the CPU wheel here (none without a GPU)."""
    out = {"gpu": gpu, "requirements": reqs, "steps": []}
    if not gpu["found"]:
        out["action"] = "cpu"
        out["reason"] = "no NVIDIA GPU found (" + "; ".join(gpu["tried"]) + "): the CPU onnxruntime stays"
        return out
    cuda = gpu.get("cuda_driver")
    if cuda and int(cuda.split(".")[0]) < ORT_GPU_CUDA_MAJOR:
        out["action"] = "refuse"
        out["reason"] = (f"the driver {gpu.get('driver')} supports CUDA {cuda}; {ort_gpu_pin(reqs)} needs CUDA "
                         f"{ORT_GPU_CUDA_MAJOR} (driver >= 580): update the NVIDIA driver, or FORGE_GPU=0 for CPU only")
        return out
    pip = [python, "-m", "pip"]
    pin = ort_gpu_pin(reqs)
    # both wheels install the same `onnxruntime` package folder: the CPU one goes first (not beside). Before it
    # goes, a dry run proves the GPU wheels resolve (index or --find-links), and a failure after it puts it back:
    # a failed setup leaves the CPU wheel working, never no onnxruntime at all.
    cpu = have("onnxruntime")
    if cpu:
        out["steps"].append([*pip, "install", "--dry-run", "-q", *pip_args, *reqs])
        out["steps"].append([*pip, "uninstall", "-y", "onnxruntime"])
        out["rollback"] = [*pip, "install", "-q", *pip_args, f"onnxruntime=={cpu}"]
    out["steps"].append([*pip, "install", "-q", *pip_args, *reqs])
    if have("onnxruntime") and have("onnxruntime-gpu"):
        # the uninstall above removed files the GPU wheel shares with it; pip thinks that wheel still complete
        out["steps"].append([*pip, "install", "-q", "--force-reinstall", "--no-deps", *pip_args, pin])
    out["action"] = "gpu"
    out["reason"] = (f"{len(gpu['gpus']) or 'a'} NVIDIA GPU(s) ({', '.join(gpu['gpus']) or 'FORGE_GPU=1'}) via "
                     f"{gpu.get('via', 'FORGE_GPU')}, CUDA {cuda or '?'}: {pin} with its CUDA/cuDNN wheels")
    return out


VERIFY = ("import json; from pipeline.host.cuda import ort_cuda_status; s = ort_cuda_status(); "
          "print(json.dumps({k: s.get(k) for k in ('onnxruntime', 'providers', 'preloaded', 'problem')}))")


def install(p: dict, run: Callable = subprocess.run) -> int:
    print(p["reason"], flush=True)
    if p["action"] == "refuse":
        return 2
    removed = False
    for step in p["steps"]:
        print("$ " + " ".join(step), flush=True)
        if run(step).returncode != 0:
            print(f"gpu setup: step failed: {' '.join(step)}", file=sys.stderr)
            if removed and p.get("rollback"):
                print("gpu setup: putting the CPU onnxruntime back: $ " + " ".join(p["rollback"]), file=sys.stderr)
                if run(p["rollback"]).returncode != 0:
                    print("gpu setup: the CPU onnxruntime could not be put back: run `make setup` again",
                          file=sys.stderr)
            return 1
        removed = removed or step[3:5] == ["uninstall", "-y"]
    if p["action"] != "gpu":
        return 0
    # a fresh interpreter: the one that ran pip may still hold the old onnxruntime
    r = run([p["steps"][0][0], "-c", VERIFY], capture_output=True, text=True, cwd=ROOT)
    print(r.stdout.strip() or r.stderr.strip()[-800:], flush=True)
    try:
        st = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 1
    if st.get("problem"):
        print(f"gpu setup: onnxruntime-gpu is installed but its CUDA provider does not run: {st['problem']} "
              "(`forge doctor` says more)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.gpu_setup", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("plan", "install"))
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose environment is set up")
    ap.add_argument("--no-index", action="store_true", help="pip --no-index (with --find-links)")
    ap.add_argument("--find-links", metavar="DIR", action="append", default=[],
                    help="pip --find-links DIR: local wheels (no network); repeatable")
    a = ap.parse_args(argv)
    for d in a.find_links:
        if not Path(d).is_dir():
            print(f"gpu setup: --find-links {d}: no such folder", file=sys.stderr)
            return 2
    pip_args = (("--no-index",) if a.no_index else ()) + tuple(x for d in a.find_links for x in ("--find-links", d))
    try:
        p = plan(probe(), gpu_requirements(), python=a.python, pip_args=pip_args)
    except ValueError as e:
        print(f"gpu setup: {e}", file=sys.stderr)
        return 2
    if a.command == "plan":
        print(json.dumps(p, indent=2))
        return 0
    return install(p)


if __name__ == "__main__":
    sys.exit(main())
