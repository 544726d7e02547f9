"""pipeline/env.py, the one home of machine facts: tool versions with distribution aliases, GPU SM (NVML first,
torch fallback), the peak-RSS sampler, atomic publishing; and the one status / exit-code vocabulary."""

from __future__ import annotations

import importlib.metadata
import os
import threading
from pathlib import Path

from pipeline import env
from pipeline.status import EXIT_CODES, Status, exit_code, overall


def test_tool_versions_follow_distribution_aliases(monkeypatch):
    installed = {"tensorrt-cu12": "10.13.0", "tensorrt-llm": "1.2.0", "nvidia-modelopt": "0.47.0"}

    def version(dist):
        if dist in installed:
            return installed[dist]
        raise importlib.metadata.PackageNotFoundError(dist)
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert env.tool_version("tensorrt") == "10.13.0"                 # tensorrt-cu12 provides tensorrt
    assert env.tool_version("tensorrt_llm") == env.tool_version("tensorrt-llm") == "1.2.0"
    assert env.tool_label("nvidia-modelopt") == "modelopt" and env.tool_version("modelopt") == "0.47.0"
    assert env.tool_version("onnxruntime") is None
    assert env.tool_versions(["tensorrt-cu12", "nvidia-modelopt"]) == {"tensorrt": "10.13.0", "modelopt": "0.47.0"}


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
    assert env.gpus(FakeNvml([90, 89])) == [{"index": 0, "name": "NVIDIA H200", "sm": 90},
                                            {"index": 1, "name": "NVIDIA H200", "sm": 89}]
    monkeypatch.setattr(env, "_torch_gpus", lambda: [{"index": 0, "name": "torch says", "sm": 80}])
    assert env.gpus(FakeNvml([], fail=True)) == [{"index": 0, "name": "torch says", "sm": 80}]


def test_one_fp8_rule():
    from pipeline.gpus import FP8_MIN_SM, GPUS, min_sm
    from pipeline.quant import needs_sm
    assert needs_sm("fp8") == min_sm("int8_sq", "fp8") == FP8_MIN_SM == 89 and min_sm("int8_sq") is None
    assert [g.name for g in GPUS.values() if g.has_fp8] == ["rtx4090", "l40s", "h100", "h200"]


def test_peak_rss_sees_memory_allocated_inside_the_block():
    import mmap
    with env.PeakRss(interval=0.01) as m:
        # a fresh anonymous mapping: its pages become resident only when touched (a bytearray may reuse heap pages
        # freed earlier in a long test session that are still resident, so RSS need not grow: CI found that)
        block = mmap.mmap(-1, 64 * 2**20)
        for off in range(0, len(block), 4096):       # touch every page
            block[off] = 1
        threading.Event().wait(0.05)
    assert m.peak - m.start >= 48 * 2**20
    block.close()
    assert env.process_peak_rss_bytes() >= m.peak - 2**20


def test_atomic_write_and_publish(tmp_path):
    f = tmp_path / "a" / "report.json"
    env.atomic_write(f, "one")
    env.atomic_write(f, b"two")
    assert f.read_text() == "two" and [p.name for p in f.parent.iterdir()] == ["report.json"]
    link = tmp_path / "engine"
    env.atomic_symlink(link, str(tmp_path / "x"))
    env.atomic_symlink(link, str(tmp_path / "y"))
    assert os.readlink(link) == str(tmp_path / "y")
    mine, theirs = tmp_path / "t1", tmp_path / "t2"
    for d, text in ((mine, "mine"), (theirs, "theirs")):
        d.mkdir()
        (d / "f").write_text(text)
    assert env.publish_dir(theirs, tmp_path / "final") is True
    assert env.publish_dir(mine, tmp_path / "final") is False            # the first one stays
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
