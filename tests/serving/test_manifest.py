import json
import shutil

import pytest

from pipeline.errors import ForgeError
from pipeline.triton.manifest import current_env, read_manifest, verify_deploy, write_manifest


def _env(**tools):
    env = current_env()
    env["tools"] = {**env["tools"], **tools}
    return env


@pytest.fixture
def packaged(tiny_repo, tmp_path):
    repo, summary = tiny_repo
    r = tmp_path / "repo"
    shutil.copytree(repo, r)
    write_manifest(r, {"target": "cpu", "recipe": {"name": "tiny"}, "digests": {"model": "ab" * 32},
                       "metrics": {"greedy_match": 1.0}, "repository": summary, "build_args": {"opt_level": "extended"}})
    return r


def test_manifest_contents(packaged):
    m = read_manifest(packaged)
    assert m["engine"] == "onnxruntime" and m["hardware"]["kind"] == "cpu"
    assert len(m["recipe_hash"]) == 64 and m["digests"]["model"] == "ab" * 32
    assert m["tools"]["onnxruntime"] == current_env()["tools"]["onnxruntime"]
    assert set(m["tools"]) >= {"torch", "transformers", "modelopt", "onnx", "onnxruntime", "tensorrt", "tensorrt_llm"}
    assert "onnxruntime_llm/1/model.py" in m["files"] and "manifest.json" not in m["files"]
    assert m["metrics"] == {"greedy_match": 1.0}
    assert verify_deploy(packaged) == []


def test_tampered_file_refused(packaged):
    f = packaged / "onnxruntime_llm" / "config.pbtxt"
    f.write_text(f.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))
    (packaged / "extra.txt").write_text("x")
    (packaged / "postprocessing" / "1" / "model.py").unlink()
    probs = verify_deploy(packaged)
    assert any(p.startswith("onnxruntime_llm/config.pbtxt: content differs") for p in probs)
    assert any(p.startswith("extra.txt: not listed") for p in probs)
    assert any(p.startswith("postprocessing/1/model.py: listed in manifest.json but missing") for p in probs)
    assert len(probs) == 3


def test_tampered_manifest_refused(packaged):
    mf = packaged / "manifest.json"
    m = json.loads(mf.read_text())
    m["files"]["ensemble/config.pbtxt"] = "0" * 64
    mf.write_text(json.dumps(m))
    assert verify_deploy(packaged) == ["ensemble/config.pbtxt: content differs from manifest.json (modified after packaging); rebuild it with `forge build tiny --force package`"]


def test_onnxruntime_version_mismatch_refused(packaged):
    probs = verify_deploy(packaged, _env(onnxruntime="1.0.0"))
    assert len(probs) == 1 and "onnxruntime 1.0.0 here" in probs[0]


def test_trtllm_version_and_sm_mismatch_refused(packaged):
    # the package stage's shape (pipeline/stages/package.py): target "sm90", dist names for tools
    write_manifest(packaged, {"engine": "tensorrt_llm", "target": "sm90",
                              "recipe": {"name": "qwen7b-int8", "hash": "c" * 64, "resolved": {}},
                              "tools": {"tensorrt": "10.13.0", "tensorrt-llm": "1.2.0", "nvidia-modelopt": "0.47.0"}})
    m = read_manifest(packaged)
    assert m["hardware"] == {"kind": "gpu", "sm": 90} and m["recipe_hash"] == "c" * 64
    assert {k: v for k, v in m["tools"].items() if v} == {"tensorrt": "10.13.0", "tensorrt_llm": "1.2.0", "modelopt": "0.47.0"}
    ok = _env(tensorrt="10.13.0", tensorrt_llm="1.2.0")
    ok["gpu_sms"] = [90]
    assert verify_deploy(packaged, ok) == []
    bad = _env(tensorrt="10.11.0", tensorrt_llm="1.2.0")
    bad["gpu_sms"] = [80]
    probs = verify_deploy(packaged, bad)
    assert len(probs) == 2
    assert "tensorrt 10.11.0 here, but the engine was built with tensorrt 10.13.0" in probs[0] and "forge build qwen7b-int8" in probs[0]
    assert "built for SM 90" in probs[1] and "gpu_sm=80" in probs[1]
    none = _env(tensorrt=None, tensorrt_llm=None)
    none["gpu_sms"] = []
    probs = verify_deploy(packaged, none)
    assert len(probs) == 3 and "no NVIDIA GPU" in probs[2]


def test_gpu_target_needs_sm(packaged):
    with pytest.raises(ForgeError, match="gpu_sm"):
        write_manifest(packaged, {"engine": "tensorrt_llm", "target": "sm-unspecified"})


def test_missing_manifest(tmp_path):
    with pytest.raises(ForgeError, match=r"`forge build RECIPE`"):
        verify_deploy(tmp_path)
