"""pipeline.gpu_setup (issue 26): a GPU found through NVML / nvidia-smi turns into the pip steps that put
onnxruntime-gpu in place of the CPU wheel; no GPU changes nothing. Probes and pip are faked: no GPU, no network."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import gpu_setup as gs

ROOT = Path(__file__).resolve().parents[1]
H200 = {"via": "NVML", "gpus": ["NVIDIA H200"], "driver": "580.159.04", "cuda_driver": "13.0"}
NONE_NVML = {"via": "NVML", "gpus": [], "error": "libnvidia-ml.so.1 not loadable"}
NONE_SMI = {"via": "nvidia-smi", "gpus": [], "error": "nvidia-smi not on PATH"}


def test_requirements_come_from_pyproject_and_pin_one_cuda13_build():
    reqs = gs.gpu_requirements()
    pin = gs.ort_gpu_pin(reqs)
    assert pin.startswith("onnxruntime-gpu==1.31."), pin      # 1.31.x: the CUDA 13 build ORT_GPU_CUDA_MAJOR names
    assert gs.ORT_GPU_CUDA_MAJOR == 13
    assert any(r.startswith("onnxruntime-gpu[cuda,cudnn]==") for r in reqs)      # CUDA + cuDNN as wheels
    assert any(r.startswith("nvidia-cublas") for r in reqs)      # the "cuda" extra names no cuBLAS
    with pytest.raises(ValueError, match="pins no onnxruntime-gpu"):
        gs.ort_gpu_pin(["onnxruntime-gpu>=1.20"])


# onnxruntime-genai's requirement on onnxruntime, per pinned version (Requires-Dist of its cp311 manylinux wheel's
# METADATA, read with `pip download --no-deps onnxruntime-genai==0.18.0`): a new genai pin needs its row here
GENAI_REQUIRES_ORT = {"0.18.0": ">=1.31.0"}


def test_one_onnxruntime_for_cpu_gpu_and_peers(tmp_path):
    """Issue 41: the CPU engines' onnxruntime is pinned to exactly the GPU extra's version, and the peers' GenAI pin
    accepts it (pip would otherwise move onnxruntime when `make bench-peers` installs `.[peers]`)."""
    from packaging.specifiers import SpecifierSet
    import tomllib

    cpu = gs.ort_cpu_pin()
    assert gs.ort_gpu_pin(gs.gpu_requirements()) == f"onnxruntime-gpu=={cpu}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    genai = gs._pinned(extras["peers"], "onnxruntime-genai")
    assert genai in GENAI_REQUIRES_ORT, f"pin onnxruntime-genai==X in the peers extra; know its onnxruntime need: {genai}"
    assert cpu in SpecifierSet(GENAI_REQUIRES_ORT[genai])
    from importlib.metadata import PackageNotFoundError, requires, version
    try:                            # where the peers are installed, their own metadata says the same
        installed = version("onnxruntime-genai")
    except PackageNotFoundError:
        installed = None
    if installed == genai:
        need = [r.replace(" ", "") for r in requires("onnxruntime-genai") if r.replace(" ", "").startswith("onnxruntime>")]
        assert need and all(cpu in SpecifierSet(r[len("onnxruntime"):]) for r in need), need
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\ndependencies = ["onnxruntime>=1.20"]\n')
    with pytest.raises(ValueError, match="pin no onnxruntime==X"):
        gs.ort_cpu_pin(bad)


def test_probe_takes_nvml_then_nvidia_smi_and_keeps_the_reasons():
    assert gs.probe(lambda: H200, lambda: NONE_SMI, env={})["gpus"] == ["NVIDIA H200"]
    smi = dict(H200, via="nvidia-smi")
    p = gs.probe(lambda: NONE_NVML, lambda: smi, env={})
    assert p["found"] and p["via"] == "nvidia-smi" and "libnvidia-ml" in p["tried"][0]
    p = gs.probe(lambda: NONE_NVML, lambda: NONE_SMI, env={})
    assert not p["found"] and len(p["tried"]) == 2
    assert not gs.probe(lambda: H200, lambda: smi, env={"FORGE_GPU": "0"})["found"]
    assert gs.probe(lambda: NONE_NVML, lambda: NONE_SMI, env={"FORGE_GPU": "1"})["found"]
    with pytest.raises(ValueError, match="FORGE_GPU='yes'"):
        gs.probe(lambda: H200, lambda: smi, env={"FORGE_GPU": "yes"})


def test_nvidia_smi_probe_parses_names_driver_and_cuda():
    def run(cmd, **kw):
        out = ("NVIDIA H200, 580.159.04\nNVIDIA H200, 580.159.04\n" if "--query-gpu=name,driver_version" in cmd
               else "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0     |")
        return subprocess.CompletedProcess(cmd, 0, out, "")
    assert gs.probe_smi(run) == {"via": "nvidia-smi", "gpus": ["NVIDIA H200"] * 2, "driver": "580.159.04",
                                 "cuda_driver": "13.0"}
    fail = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 9, "", "NVIDIA-SMI has failed: no driver")  # noqa: E731
    assert gs.probe_smi(fail)["gpus"] == [] and "no driver" in gs.probe_smi(fail)["error"]


class _FakeNvml:
    """pynvml's names for what probe_nvml asks; ``fail`` raises at nvmlInit as a machine without a driver does."""
    class NVMLError(Exception):
        pass

    def __init__(self, names=(), fail=None):
        self.names, self.fail, self.shutdown = list(names), fail, 0

    def nvmlInit(self):
        if self.fail:
            raise self.fail

    def nvmlShutdown(self):
        self.shutdown += 1

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.names[h].encode()          # older pynvml returns bytes

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 13000


def test_nvml_probe_without_the_library_says_so():
    r = gs.probe_nvml(_FakeNvml(fail=OSError("libnvidia-ml.so.1: cannot open shared object file")))
    assert r["gpus"] == [] and "libnvidia-ml.so.1 cannot be asked" in r["error"] and "OSError" in r["error"]


def test_nvml_probe_goes_through_forge_s_one_nvml_helper():
    nv = _FakeNvml(["NVIDIA H200", "NVIDIA H200"])
    assert gs.probe_nvml(nv) == {"via": "NVML", "gpus": ["NVIDIA H200"] * 2, "driver": "580.159.04",
                                 "cuda_driver": "13.0"}
    assert nv.shutdown == 1                      # NVML is shut down after the probe
    # the same helper enumerates for pipeline.host.gpu.gpus() and forge doctor: one probe, one answer
    from pipeline.host.gpu import gpus
    assert [g["name"] for g in gpus(_FakeNvml(["NVIDIA H200"]))] == ["NVIDIA H200"]


def test_no_gpu_plans_nothing():
    p = gs.plan(gs.probe(lambda: NONE_NVML, lambda: NONE_SMI, env={}), gs.gpu_requirements(),
                have=lambda n: "1.23.0" if n == "onnxruntime" else None)
    assert p["action"] == "cpu" and p["steps"] == [] and "CPU onnxruntime stays" in p["reason"]
    assert gs.install(p, run=lambda *a, **k: pytest.fail("no command may run without a GPU")) == 0


def test_gpu_replaces_the_cpu_wheel_not_beside_it():
    reqs = gs.gpu_requirements()
    p = gs.plan(dict(H200, found=True, tried=[]), reqs, python="/v/bin/python",
                have=lambda n: "1.23.0" if n == "onnxruntime" else None)
    assert p["action"] == "gpu"
    assert p["steps"] == [["/v/bin/python", "-m", "pip", "install", "--dry-run", "-q", *reqs],
                          ["/v/bin/python", "-m", "pip", "uninstall", "-y", "onnxruntime"],
                          ["/v/bin/python", "-m", "pip", "install", "-q", *reqs]]
    assert p["rollback"] == ["/v/bin/python", "-m", "pip", "install", "-q", "onnxruntime==1.23.0"]
    # both wheels installed (a later `pip install -e .` brought the CPU one back over the GPU one's files):
    # the CPU one out, then the GPU wheel's files restored
    p = gs.plan(dict(H200, found=True, tried=[]), reqs, python="py", pip_args=("--no-index", "--find-links", "/w"),
                have=lambda n: "1.31.1")
    assert p["steps"][0][3:5] == ["install", "--dry-run"] and p["steps"][0][6:8] == ["--no-index", "--find-links"]
    assert p["steps"][1][-1] == "onnxruntime" and p["steps"][2][5:7] == ["--no-index", "--find-links"]
    assert p["steps"][3][-4:] == ["--no-index", "--find-links", "/w", gs.ort_gpu_pin(reqs)]
    assert "--force-reinstall" in p["steps"][3]
    assert p["rollback"][-4:] == ["--no-index", "--find-links", "/w", "onnxruntime==1.31.1"]
    # already the GPU wheel only: just make sure the CUDA wheels are there
    p = gs.plan(dict(H200, found=True, tried=[]), reqs, python="py", have=lambda n: "1.31.1" if "gpu" in n else None)
    assert [s[3] for s in p["steps"]] == ["install"]


def test_a_driver_too_old_for_cuda13_is_refused_with_the_fix():
    p = gs.plan(dict(H200, found=True, tried=[], driver="550.54", cuda_driver="12.4"), gs.gpu_requirements(),
                have=lambda n: "1.23.0")
    assert p["action"] == "refuse" and p["steps"] == []
    assert "CUDA 12.4" in p["reason"] and "update the NVIDIA driver" in p["reason"] and "FORGE_GPU=0" in p["reason"]
    assert gs.install(p, run=lambda *a, **k: pytest.fail("nothing runs")) == 2


def test_install_runs_the_steps_then_checks_the_provider_in_a_fresh_interpreter():
    p = gs.plan(dict(H200, found=True, tried=[]), gs.gpu_requirements(), python="py", have=lambda n: "1.23.0"
                if n == "onnxruntime" else None)
    ran = []

    def run(cmd, **kw):
        ran.append(cmd)
        if cmd[1] == "-c":         # the check: ORT's provider status after the install
            return subprocess.CompletedProcess(cmd, 0, json.dumps({"problem": None, "providers": ["CUDAExecutionProvider"]}), "")
        return subprocess.CompletedProcess(cmd, 0)
    assert gs.install(p, run=run) == 0
    assert ran[:3] == p["steps"] and ran[3][:2] == ["py", "-c"] and "ort_cuda_status" in ran[3][2]

    def broken(cmd, **kw):
        out = json.dumps({"problem": "CUDAExecutionProvider cannot load libcublas.so.13"}) if cmd[1] == "-c" else ""
        return subprocess.CompletedProcess(cmd, 0, out, "")
    assert gs.install(p, run=broken) == 1
    assert gs.install(p, run=lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1)) == 1     # a pip step failed


def test_a_failed_gpu_install_leaves_the_cpu_wheel_working():
    """The GPU wheels not found: nothing is uninstalled; the install failing after the uninstall: CPU wheel back."""
    p = gs.plan(dict(H200, found=True, tried=[]), gs.gpu_requirements(), python="py",
                have=lambda n: "1.32.0" if n == "onnxruntime" else None)

    def failing(which):
        ran = []

        def run(cmd, **kw):
            ran.append(cmd)
            return subprocess.CompletedProcess(cmd, 1 if cmd[3:5] == which else 0)
        return ran, run
    ran, run = failing(["install", "--dry-run"])      # e.g. no onnxruntime-gpu in the --find-links folder
    assert gs.install(p, run=run) == 1 and len(ran) == 1 and not any("uninstall" in c for c in ran)
    ran, run = failing(["install", "-q"])             # the real install fails after the CPU wheel went
    assert gs.install(p, run=run) == 1
    assert [c[3] for c in ran] == ["install", "uninstall", "install", "install"]
    assert ran[-1] == p["rollback"] and ran[-1][-1] == "onnxruntime==1.32.0"


def test_cli_plan_on_this_machine_and_bad_input(tmp_path):
    def cli(*a, env=None):
        import os
        e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        return subprocess.run([sys.executable, "-m", "pipeline.gpu_setup", *a], capture_output=True, text=True,
                              cwd=ROOT, env=e, timeout=60)
    r = cli("plan", env={"FORGE_GPU": "0"})
    assert r.returncode == 0 and json.loads(r.stdout)["action"] == "cpu"
    r = cli("install", env={"FORGE_GPU": "0"})          # what `make setup` runs on a CPU machine: nothing
    assert r.returncode == 0 and "CPU onnxruntime stays" in r.stdout
    r = cli("plan", env={"FORGE_GPU": "maybe"})
    assert r.returncode == 2 and "FORGE_GPU='maybe'" in r.stderr and "Traceback" not in r.stderr
    r = cli("install", "--find-links", str(tmp_path / "nope"))
    assert r.returncode == 2 and "no such folder" in r.stderr
    # --find-links is repeatable: every folder reaches pip (a second one replaced the first before)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    r = cli("plan", "--no-index", "--find-links", str(tmp_path / "a"), "--find-links", str(tmp_path / "b"),
            env={"FORGE_GPU": "1"})
    steps = json.loads(r.stdout)["steps"]
    assert r.returncode == 0 and all(str(tmp_path / d) in s for s in steps if "uninstall" not in s for d in "ab")
    r = cli("install", "--find-links", str(tmp_path / "a"), "--find-links", str(tmp_path / "nope"))
    assert r.returncode == 2 and "nope: no such folder" in r.stderr


def test_makefile_setup_runs_the_gpu_setup_after_the_cpu_install():
    """`make setup` keeps its CPU steps and adds the gpu_setup step last (a no-op without a GPU)."""
    mk = (ROOT / "Makefile").read_text()
    setup = mk[mk.index("$(STAMP): pyproject.toml"):mk.index("touch $(STAMP)")]
    cpu = setup.index("pip install -q -e '.[dev,s3,ray]'")
    gpu = setup.index("-m pipeline.gpu_setup install")
    assert cpu < gpu
