"""pipeline/host/, the one home of machine facts: tool versions with distribution aliases, GPU SM (NVML first,
torch fallback), the peak-RSS sampler, atomic publishing; and the one status / exit-code vocabulary."""

from __future__ import annotations

import importlib.metadata
import os
import threading

import pytest
from pathlib import Path

from pipeline.host import files, gpu, rss, tools
from pipeline.status import EXIT_CODES, Status, exit_code, overall


def test_tool_versions_follow_distribution_aliases(monkeypatch):
    installed = {"tensorrt-cu12": "10.13.0", "tensorrt-llm": "1.2.0", "nvidia-modelopt": "0.47.0"}

    def version(dist):
        if dist in installed:
            return installed[dist]
        raise importlib.metadata.PackageNotFoundError(dist)
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert tools.tool_version("tensorrt") == "10.13.0"                 # tensorrt-cu12 provides tensorrt
    assert tools.tool_version("tensorrt_llm") == tools.tool_version("tensorrt-llm") == "1.2.0"
    assert tools.tool_label("nvidia-modelopt") == "modelopt" and tools.tool_version("modelopt") == "0.47.0"
    assert tools.tool_version("onnxruntime") is None
    assert tools.tool_versions(["tensorrt-cu12", "nvidia-modelopt"]) == {"tensorrt": "10.13.0", "modelopt": "0.47.0"}


def test_stage_keys_and_manifests_name_tools_by_label():
    from pipeline.stages.base import Stage

    class S(Stage):
        name = "s"
        tools = ("torch", "nvidia-modelopt", "tensorrt-llm")
    assert set(S().components(None, Path("."), {})["tools"]) == {"torch", "modelopt", "tensorrt_llm"}


class FakeNvml:
    def __init__(self, sms, fail=False):
        self.sms, self.fail = sms, fail

    def nvmlInit(self):
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.sms)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return divmod(self.sms[h], 10)


def test_gpu_sm_from_nvml_then_torch(monkeypatch):
    assert gpu.gpus(FakeNvml([90, 89])) == [{"index": 0, "name": "NVIDIA H200", "sm": 90},
                                            {"index": 1, "name": "NVIDIA H200", "sm": 89}]
    monkeypatch.setattr(gpu, "_torch_gpus", lambda: [{"index": 0, "name": "torch says", "sm": 80}])
    assert gpu.gpus(FakeNvml([], fail=True)) == [{"index": 0, "name": "torch says", "sm": 80}]


def test_one_fp8_rule():
    """FP8 needs SM 8.9: one constant, which the quantizers that make FP8 engines declare (Quantizer.min_sm)."""
    from pipeline import targets
    from pipeline.gpus import FP8_MIN_SM, GPUS
    from pipeline.trtllm.quantizers import needs_sm
    assert needs_sm("fp8") == needs_sm("int8_sq", "fp8") == FP8_MIN_SM == 89 and needs_sm("int8_sq") is None
    assert {(t.name, a) for t in targets.all_targets() for a, q in t.quantizers.items() if q.min_sm} == {
        ("tensorrt_llm", "fp8"), ("tensorrt_llm", "fp8_pc_pt"), ("tensorrt", "fp8")}
    assert {q.min_sm for t in targets.all_targets() for q in t.quantizers.values()} == {None, FP8_MIN_SM}
    assert [g.name for g in GPUS.values() if g.has_fp8] == ["rtx4090", "l40s", "h100", "h200"]


def test_peak_rss_sees_memory_allocated_inside_the_block():
    import mmap
    with rss.PeakRss(interval=0.01) as m:
        # a fresh anonymous mapping: its pages become resident only when touched (a bytearray may reuse heap pages
        # freed earlier in a long test session that are still resident, so RSS need not grow: CI found that)
        block = mmap.mmap(-1, 64 * 2**20)
        for off in range(0, len(block), 4096):       # touch every page
            block[off] = 1
        threading.Event().wait(0.05)
    assert m.peak - m.start >= 48 * 2**20
    block.close()
    assert rss.process_peak_rss_bytes() >= m.peak - 2**20


def test_process_peak_rss_is_this_program_s_not_its_parent_s():
    """A child started by a large process reports its own peak: ru_maxrss survives exec on Linux and would report
    the parent's size at the fork."""
    import subprocess
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("the exec-inherited ru_maxrss is Linux's")
    block = bytearray(400 * 2**20)
    for off in range(0, len(block), 4096):
        block[off] = 1
    out = subprocess.run([sys.executable, "-c", "from pipeline.host.rss import process_peak_rss_bytes as p; "
                          "import resource; print(p(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    own, inherited = map(int, out.stdout.split())
    assert inherited >= 400 * 2**20      # the kernel figure this function does not use
    assert own < 200 * 2**20, own
    del block


def test_peak_rss_of_another_process_tree():
    """PeakRss(pid=...) watches a child process (lab/gpu_7b.py's steps): its peak is the child's, not this
    process's, and a process that has exited reads as 0 bytes, not an error."""
    import subprocess
    import sys
    code = ("import mmap, time; time.sleep(0.3); b = mmap.mmap(-1, 64 * 2**20)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "time.sleep(0.3)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    with rss.PeakRss(interval=0.01, children=False, pid=proc.pid) as m:      # this process alone would not grow
        proc.wait(30)
    assert proc.returncode == 0 and m.peak - m.start >= 48 * 2**20
    assert m.rss() == 0


def test_one_nvml_call_helper():
    """Every NVML query that may be unsupported goes through host.gpu.nvml_call: missing function or NVMLError
    -> None, bytes -> str; any other error is not swallowed. doctor and gpu_topology keep no copy of their own."""
    import inspect

    import pytest

    from pipeline import doctor, gpu_topology

    class FakeNvmlError(Exception):
        pass

    class Nvml:
        NVMLError = FakeNvmlError

        def nvmlDeviceGetName(self, h):
            return b"NVIDIA H200"

        def nvmlDeviceGetNumaNodeId(self, h):
            raise FakeNvmlError("Not Supported")

        def nvmlDeviceGetPciInfo(self, h):
            raise ValueError("a bug, not an NVML answer")
    nv = Nvml()
    assert gpu.nvml_call(nv, "nvmlDeviceGetName", 0) == "NVIDIA H200"
    assert gpu.nvml_call(nv, "nvmlDeviceGetNumaNodeId", 0) is None
    assert gpu.nvml_call(nv, "nvmlNoSuchFunction") is None
    with pytest.raises(ValueError):
        gpu.nvml_call(nv, "nvmlDeviceGetPciInfo", 0)
    for mod in (doctor, gpu_topology):
        assert mod.nvml_call is gpu.nvml_call
        assert "getattr(nvml, fn" not in inspect.getsource(mod)


def test_atomic_write_and_publish(tmp_path):
    f = tmp_path / "a" / "report.json"
    files.atomic_write(f, "one")
    files.atomic_write(f, b"two")
    assert f.read_text() == "two" and [p.name for p in f.parent.iterdir()] == ["report.json"]
    link = tmp_path / "engine"
    files.atomic_symlink(link, str(tmp_path / "x"))
    files.atomic_symlink(link, str(tmp_path / "y"))
    assert os.readlink(link) == str(tmp_path / "y")
    mine, theirs = tmp_path / "t1", tmp_path / "t2"
    for d, text in ((mine, "mine"), (theirs, "theirs")):
        d.mkdir()
        (d / "f").write_text(text)
    assert files.publish_dir(theirs, tmp_path / "final") is True
    assert files.publish_dir(mine, tmp_path / "final") is False            # the first one stays
    assert (tmp_path / "final" / "f").read_text() == "theirs" and not mine.exists()


def test_status_and_exit_codes():
    assert Status.HIT == "hit" and f"{Status.CANNOT_RUN_HERE}" == "cannot-run-here"
    assert overall([Status.HIT, Status.BUILT]) is Status.PASSED
    assert overall([Status.BUILT, Status.CANNOT_RUN_HERE, Status.SKIPPED]) is Status.INCOMPLETE
    assert overall([Status.CANNOT_RUN_HERE, Status.FAILED]) is Status.FAILED
    assert exit_code([Status.PASSED, Status.INCOMPLETE]) == 3
    assert exit_code([Status.INCOMPLETE, Status.FAILED]) == 1
    assert exit_code([Status.FAILED, Status.INVALID]) == 2 and exit_code([]) == 0
    assert set(EXIT_CODES) == {Status.INVALID, Status.FAILED, Status.INCOMPLETE, Status.PASSED}


def test_option_schemas_cover_every_target_algo_and_hold_the_quantizers_defaults():
    from pipeline.ort import quantize as ortq
    from pydantic import BaseModel

    from pipeline import targets
    from pipeline.recipe_options import OrtInt8Options
    from pipeline.trtllm.build_config import QUANT_ALGO
    assert targets.names() == ("onnxruntime", "tensorrt_llm", "tensorrt")
    assert {t.name: set(t.algos) for t in targets.all_targets()} == {
        "onnxruntime": {"none", "int8", "int4_wo"}, "tensorrt": {"none", "int8", "fp8"}, "tensorrt_llm": set(QUANT_ALGO)}
    assert all(issubclass(q.options, BaseModel) for t in targets.all_targets() for q in t.quantizers.values())
    # issue 11: dynamic MatMuls hold 7-bit s8 weights (exact on CPUs without VNNI/AMX)
    assert ortq.INT8_DEFAULTS == {"method": "mixed", "blockwise": ["*.mlp.down_proj", "lm_head"],
                                  "smoothquant_alpha": 0.5, "smoothquant_only": ["*.q_proj", "*.gate_proj"],
                                  "weight_type": "int8", "reduce_range": True, "per_channel": True,
                                  "weight_symmetric": True}
    assert ortq.INT8 == OrtInt8Options()


def test_source_commit_is_the_checkout_holding_pipeline(tmp_path, monkeypatch):
    """host/paths.py sits two folders below the checkout: the commit is the checkout's, whatever the cwd."""
    import subprocess

    import pytest

    from pipeline.host import paths
    root = Path(paths.__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert (root / "pipeline" / "host" / "paths.py").is_file()
    monkeypatch.chdir(tmp_path)
    commit, dirty = paths.source_commit()
    assert commit == head.stdout.strip() and dirty in (True, False)


def test_host_is_the_ground_floor():
    """pipeline/host/ imports only itself and the ground floor's hardware value (lazily): never stages, targets,
    recipes or the CLI, so anything in forge may import it without a loop."""
    import ast
    host = Path(files.__file__).resolve().parent
    allowed_outside = {"pipeline.hardware"}
    for p in sorted(host.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = "pipeline.host" if node.level == 1 else "pipeline"
                target += f".{node.module}" if node.module else ""
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
            elif isinstance(node, ast.Import):
                target = node.names[0].name
            else:
                continue
            if target.startswith("pipeline") and not target.startswith("pipeline.host"):
                assert target in allowed_outside, f"{p.name} imports {target}"
