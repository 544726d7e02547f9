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
    write_manifest(r, {"engine": "onnxruntime", "target": "cpu", "recipe": {"name": "tiny"}, "digests": {"model": "ab" * 32},
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


def test_each_gpu_target_names_its_own_sm_key(packaged):
    """What a GPU engine needs is its target's (Target.deploy): a tensorrt engine's fix names build.tensorrt.gpu_sm
    (verify-deploy named build.tensorrt_llm.gpu_sm for every GPU engine before issue 39)."""
    write_manifest(packaged, {"engine": "tensorrt", "target": "sm89", "recipe": {"name": "trt-int8"},
                              "tools": {"tensorrt": "10.13.0"}})
    env = _env(tensorrt="10.13.0")
    env["gpu_sms"] = [90]
    assert verify_deploy(packaged, env) == [
        "the engine was built for SM 89, this machine's GPUs are SM [90]; rebuild it here with "
        "`forge build trt-int8 --set build.tensorrt.gpu_sm=90`"]
    with pytest.raises(ForgeError, match=r"set build\.tensorrt\.gpu_sm \(e\.g\. 90\)"):
        write_manifest(packaged, {"engine": "tensorrt", "target": "sm-unspecified"})


def test_the_engine_must_be_a_registered_target(packaged):
    with pytest.raises(ForgeError, match=r"manifest engine None: not a registered build target \(targets: "
                                         r"onnxruntime, tensorrt_llm, tensorrt\)"):
        write_manifest(packaged, {"target": "cpu", "recipe": {"name": "tiny"}})
    mf = packaged / "manifest.json"
    mf.write_text(json.dumps(dict(json.loads(mf.read_text()), engine="openvino")))
    assert verify_deploy(packaged) == ["manifest.json: unknown engine 'openvino' (targets: onnxruntime, tensorrt_llm, "
                                       "tensorrt); rebuild it with `forge build tiny --force package`"]


def test_missing_manifest(tmp_path):
    with pytest.raises(ForgeError, match=r"`forge build RECIPE`"):
        verify_deploy(tmp_path)


# ------------------------------------------------------------------ the CPU ISA class the engine was validated on
AVX2_EVAL = {"ppl_delta_pct": 1.0, "measured_on": {"cpu_model": "AMD EPYC 7B13", "isa_class": "x86_64-avx2",
                                                   "isa_flags": ["avx", "avx2", "fma"], "isa_source": "cpuid"}}
S8_DYNAMIC = {"algo": "int8", "method": "mixed", "dynamic_weights": "int8", "quantized_matmuls": 211}
U8_DYNAMIC = dict(S8_DYNAMIC, dynamic_weights="uint8")


def _isa_env(cls):
    env = current_env()
    env["cpu_isa_class"] = cls
    return env


def test_manifest_records_validated_isa(tiny_repo, tmp_path):
    r = tmp_path / "repo"
    shutil.copytree(tiny_repo[0], r)
    write_manifest(r, {"engine": "onnxruntime", "target": "cpu", "recipe": {"name": "tiny"}, "metrics": AVX2_EVAL, "quantization": U8_DYNAMIC})
    hw = read_manifest(r)["hardware"]
    assert hw["validated_isa_class"] == "x86_64-avx2" and hw["validated_cpu_model"] == "AMD EPYC 7B13"
    assert hw["validated_isa_flags"] == ["avx", "avx2", "fma"]
    assert current_env()["cpu_isa_class"]


def test_verify_deploy_warns_on_another_isa_class(tiny_repo, tmp_path):
    from pipeline.triton.manifest import deploy_warnings
    r = tmp_path / "repo"
    shutil.copytree(tiny_repo[0], r)
    write_manifest(r, {"engine": "onnxruntime", "target": "cpu", "recipe": {"name": "tiny"}, "metrics": AVX2_EVAL, "quantization": U8_DYNAMIC})
    assert deploy_warnings(r, _isa_env("x86_64-avx2")) == []
    w = deploy_warnings(r, _isa_env("x86_64-amx"))
    assert len(w) == 1 and "validated on x86_64-avx2" in w[0] and "this CPU is x86_64-amx" in w[0]
    assert "not known to lose accuracy" in w[0] and "forge build tiny" in w[0]
    assert verify_deploy(r, _isa_env("x86_64-amx")) == []          # a warning, not a refusal
    # an engine with full-range s8 dynamic MatMuls, validated on AMX, deployed to an AVX2 CPU: the reason is named
    write_manifest(r, {"engine": "onnxruntime", "target": "cpu", "recipe": {"name": "tiny"}, "quantization": S8_DYNAMIC,
                       "metrics": {"measured_on": dict(AVX2_EVAL["measured_on"], isa_class="x86_64-amx")}})
    w = deploy_warnings(r, _isa_env("x86_64-avx2"))
    assert len(w) == 1 and "known to lose accuracy here" in w[0] and "saturating 16-bit" in w[0]


def test_verify_deploy_cli_prints_the_isa_warning_and_passes(tiny_repo, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app
    r = tmp_path / "repo"
    shutil.copytree(tiny_repo[0], r)
    other = "x86_64-avx2" if current_env()["cpu_isa_class"] != "x86_64-avx2" else "x86_64-amx"
    write_manifest(r, {"engine": "onnxruntime", "target": "cpu", "recipe": {"name": "tiny"}, "quantization": U8_DYNAMIC,
                       "metrics": {"measured_on": dict(AVX2_EVAL["measured_on"], isa_class=other)}})
    res = CliRunner().invoke(app, ["verify-deploy", str(r)])
    assert res.exit_code == 0, res.output
    assert f"validated on {other}" in res.output and "warning" in res.output


def test_a_missing_empty_version_folder_is_refused(packaged):
    """A copy through an object store drops empty folders; Triton then finds no version of the ensemble."""
    m = read_manifest(packaged)
    assert m["dirs"], "the packaged repository has an empty model version folder"
    assert verify_deploy(packaged) == []
    d = m["dirs"][0]
    (packaged / d).rmdir()
    problems = verify_deploy(packaged)
    assert len(problems) == 1 and problems[0].startswith(f"{d}/: empty folder listed in manifest.json but missing")


def test_an_edit_to_the_runtime_a_package_ships_repackages(tmp_path, monkeypatch):
    """The package copies forge's engine and batcher modules and the Triton python models into the repository; its
    cache key holds their digests, so an edit to any of them builds a new package (c919ce8 changed engine.py, and
    the package stage, keyed by a hand-bumped version, kept serving the old runtime)."""
    from pipeline.cache import make_key
    from pipeline.recipe import resolve
    from pipeline.stages.onnxruntime import OrtPackage
    from pipeline.triton import repo_onnxruntime

    r = resolve("smollm2-135m-int8")
    up = {k: "0" * 64 for k in OrtPackage.needs}
    engine = tmp_path / "engine.py"
    shutil.copy2(repo_onnxruntime.DEFAULT_ENGINE_MODULE, engine)
    monkeypatch.setattr(repo_onnxruntime, "DEFAULT_ENGINE_MODULE", engine)
    comps = OrtPackage().components(r, tmp_path, up)
    assert {"engine.py", "batcher.py", "ort_llm.py", "bls.py"} <= set(comps["shipped_code"])
    before = make_key(comps)
    assert make_key(OrtPackage().components(r, tmp_path, up)) == before      # same files, same key
    engine.write_text(engine.read_text() + "\n# an edit\n")
    assert make_key(OrtPackage().components(r, tmp_path, up)) != before
