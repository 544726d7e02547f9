"""Run `trtllm-build` on a checkpoint: timing cache in/out, exact command saved beside the engine.

Without TensorRT-LLM (``trtllm-build`` on PATH and the ``tensorrt_llm`` package) this raises
:class:`~pipeline.errors.CannotRunHere` naming what is missing and the command that finishes the job on a
GPU machine; it never pretends an engine was built.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from ..errors import CannotRunHere, StageFailed

COMMAND_FILE = "trtllm-build.cmd"
LOG_FILE = "trtllm-build.log"


def trtllm_available() -> tuple[bool, str]:
    """(available, what is missing)."""
    missing = []
    if importlib.util.find_spec("tensorrt_llm") is None:
        missing.append("the tensorrt_llm Python package (pip install 'tensorrt-llm>=1.2,<1.3' from NVIDIA's index)")
    if shutil.which("trtllm-build") is None:
        missing.append("the trtllm-build command")
    return (not missing, "; ".join(missing))


def _with_paths(args: list[str], out_dir: Path, tc_in: Path | None, tc_out: Path) -> list[str]:
    """Point --output_dir / timing-cache flags of ``args`` at the paths this run uses."""
    a = list(args)

    def put(flag, value):
        if flag in a:
            a[a.index(flag) + 1] = str(value)
        else:
            a.extend([flag, str(value)])
    put("--output_dir", out_dir)
    if tc_in is not None:
        put("--input_timing_cache", tc_in)
    elif "--input_timing_cache" in a:
        i = a.index("--input_timing_cache")
        del a[i:i + 2]
    put("--output_timing_cache", tc_out)
    return a


def build_engine(ckpt_dir: str | Path, out_dir: str | Path, args: list[str],
                 timing_cache: str | Path | None = None, *, timeout_s: float | None = None) -> dict:
    """Run ``args`` (from :func:`trtllm_build_args`) and return metrics.

    ``timing_cache``: a timing-cache file from the artifact cache (may be absent); the refreshed cache is
    written to ``out_dir/timing.cache`` and its path returned as ``timing_cache_out`` for the caller to store.
    """
    out = Path(out_dir)
    tc_in = Path(timing_cache) if timing_cache and Path(timing_cache).exists() else None
    tc_out = out / "timing.cache"
    argv = _with_paths(args, out, tc_in, tc_out)
    if "--checkpoint_dir" not in argv:
        argv[1:1] = ["--checkpoint_dir", str(ckpt_dir)]
    cmd = shlex.join(argv)
    ok, missing = trtllm_available()
    if not ok:
        raise CannotRunHere(missing, cmd)
    out.mkdir(parents=True, exist_ok=True)
    (out / COMMAND_FILE).write_text(cmd + "\n")
    t0 = time.perf_counter()
    with open(out / LOG_FILE, "w") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (out / LOG_FILE).read_text()[-3000:]
        raise StageFailed(f"trtllm-build exited with {proc.returncode}; log {out / LOG_FILE}:\n{tail}",
                          {"seconds": seconds, "returncode": proc.returncode})
    cfg = json.loads((out / "config.json").read_text())
    ws = int(cfg["pretrained_config"]["mapping"].get("world_size", 1))
    engines = sorted(p.name for p in out.glob("rank*.engine"))
    if len(engines) != ws:
        raise StageFailed(f"trtllm-build wrote {len(engines)} engine files for world_size {ws} in {out}",
                          {"engines": engines})
    return {
        "seconds": round(seconds, 2),
        "command": cmd,
        "engines": engines,
        "tensorrt_llm_version": cfg.get("version"),
        "timing_cache_in": str(tc_in) if tc_in else None,
        "timing_cache_out": str(tc_out) if tc_out.exists() else None,
        "engine_bytes": sum((out / e).stat().st_size for e in engines),
    }
