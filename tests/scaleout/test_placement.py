"""What each stage asks of a Ray cluster and where it can go (no cluster, no server), and the shared cache's URL
rules."""

from __future__ import annotations

import pytest

from pipeline.errors import UsageError
from pipeline.ray_executor import Node, place, request
from pipeline.recipe import resolve
from pipeline.remote_cache import RemoteStore
from pipeline.stages import flow_for

CPU_NODE = Node("a" * 56, "10.0.0.1", {"CPU": 8.0, "isa:x86_64-avx2": 1.0})
H100_x8 = Node("b" * 56, "10.0.0.2", {"CPU": 64.0, "GPU": 8.0, "sm_90": 8.0})
A100_x2 = Node("c" * 56, "10.0.0.3", {"CPU": 16.0, "GPU": 2.0, "sm_80": 2.0})


def _stages(recipe):
    return {s.name: s for s in flow_for(recipe.build.target)}


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_trtllm_engine_stages_ask_for_tp_x_pp_gpus_of_their_architecture(tp, pp):
    r = resolve("qwen7b-int8", [f"build.tensorrt_llm.tp={tp}", f"build.tensorrt_llm.pp={pp}",
                                "build.tensorrt_llm.gpu_sm=90"])
    stages = _stages(r)
    for name in ("build", "evaluate"):
        assert request(stages[name], r) == {"CPU": 1.0, "GPU": float(tp * pp), "sm_90": float(tp * pp)}
    assert request(stages["package"], r) == {"CPU": 1.0, "GPU": 1.0, "sm_90": 1.0}
    for name in ("source", "quantize", "checkpoint", "evaluate_checkpoint", "validate_checkpoint", "validate"):
        assert request(stages[name], r) == {"CPU": 1.0}, name


@pytest.fixture
def avx2_driver(monkeypatch):
    """The driver's CPU emulated as x86_64-avx2 (the tests hold on every ISA class)."""
    monkeypatch.setattr("pipeline.host.cpu.cpu_isa_class", lambda: "x86_64-avx2")


def test_placement_by_resources(avx2_driver):
    r = resolve("qwen7b-int8", ["build.tensorrt_llm.tp=2", "build.tensorrt_llm.gpu_sm=90"])
    stages = _stages(r)
    nodes = [CPU_NODE, H100_x8, A100_x2]
    assert place(stages["quantize"], r, nodes) == (None, "CPU 1 on any of 3 nodes")
    assert place(stages["build"], r, nodes) == (None, f"CPU 1, GPU 2, sm_90 2 on 10.0.0.2 ({'b' * 8})")
    missing, where = place(stages["build"], r, [CPU_NODE, A100_x2])     # GPUs, but of another architecture
    assert where == "nowhere" and missing.startswith("no node in the Ray cluster has CPU 1, GPU 2, sm_90 2")
    assert "10.0.0.3 (cccccccc): CPU 16, GPU 2, sm_80 2" in missing
    assert "`ray start --address=HEAD:PORT --num-gpus=2 --resources='{\"sm_90\": 2}'`" in missing
    r80 = resolve("qwen7b-int8", ["build.tensorrt_llm.tp=2", "build.tensorrt_llm.gpu_sm=80"])
    assert place(_stages(r80)["build"], r80, nodes)[1] == f"CPU 1, GPU 2, sm_80 2 on 10.0.0.3 ({'c' * 8})"
    for ort in _stages(resolve("smollm2-135m-int8")).values():
        assert place(ort, resolve("smollm2-135m-int8"), [CPU_NODE])[0] is None


def test_engine_stage_without_gpu_sm_cannot_be_placed(monkeypatch):
    monkeypatch.setattr("pipeline.stages.tensorrt_llm.gpu_sm", lambda: None)    # a driver without a GPU
    r = resolve("qwen7b-int8")
    missing, _ = place(_stages(r)["build"], r, [H100_x8])
    assert "build.tensorrt_llm.gpu_sm is not set" in missing and "--set build.tensorrt_llm.gpu_sm=90" in missing


@pytest.mark.parametrize("url,said", [
    ("memory://x/y", "s3://bucket/prefix"),
    ("file:///tmp/x", "s3://bucket/prefix"),
    ("ftp://host/x", "FORGE_CACHE=/path/on/the/shared/disk"),
    ("s3://", "name a bucket"),
    ("gs:///", "name a bucket"),
])
def test_cache_url_rules(url, said):
    with pytest.raises(UsageError) as e:
        RemoteStore(url)
    assert said in str(e.value) and url in str(e.value)


def test_store_paths():
    s = RemoteStore("S3://bucket/some/prefix/")
    key = "ab" + "0" * 62
    assert (s.url, s.bucket, s.protocol) == ("s3://bucket/some/prefix", "bucket", "s3")
    assert s.record_url(key) == f"s3://bucket/some/prefix/entries/ab/{key}.json"
    assert RemoteStore("az://container/p").protocol == "az" and RemoteStore("gcs://b").protocol == "gs"


def test_local_builds_import_nothing_of_ray_or_the_object_store(tmp_path):
    """`make engine` needs neither: a local plan (and so a local build's setup) never imports them."""
    import os
    import subprocess
    import sys
    code = ("import sys\nfrom pipeline import cli\nsys.argv = ['forge', 'plan', 'smollm2-135m-int8']\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print(sorted(m for m in ('ray', 's3fs', 'aiobotocore', 'gcsfs', 'adlfs') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, FORGE_CACHE=str(tmp_path / "cache"), FORGE_PROGRESS="0"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"
