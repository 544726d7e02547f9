"""One step of lab/gpu_38.sh: run a command, sample the GPU's used memory (NVML, whole device: nothing else runs
there) and the command's process-tree RSS every 0.2 s, append {step, rc, wall_s, peaks} to $OUT/steps.json.

    python3 lab/gpu_38_steps.py step NAME -- CMD ...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_7b import gpu_used_mb, tree_rss_mb  # noqa: E402 -- the lab's one NVML / process-tree sampler


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "step" or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    name, cmd = argv[1], argv[3:]
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    gpu0, peak, t0 = gpu_used_mb(), {"gpu": 0.0, "rss": 0.0}, time.time()
    with open(out / f"{name}.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample():
            while not done.is_set():
                g = gpu_used_mb()
                peak["gpu"] = max(peak["gpu"], g or 0.0)
                peak["rss"] = max(peak["rss"], tree_rss_mb(p.pid))
                done.wait(0.2)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        rc = p.wait()
        done.set()
        th.join(5)
    rec = {"step": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "cmd": cmd,
           "gpu_used_before_mb": None if gpu0 is None else round(gpu0),
           "peak_gpu_used_mb": round(peak["gpu"]), "peak_tree_rss_mb": round(peak["rss"])}
    f = out / "steps.json"
    steps = json.loads(f.read_text()) if f.exists() else []
    f.write_text(json.dumps(steps + [rec], indent=2))
    print(json.dumps(rec), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
