"""A package built for the CUDA provider: Triton instance groups on the GPU and the python model told to use CUDA."""

from pipeline.triton.pbtxt import parse_config


def _repo(tiny_artifacts, tmp_path, provider, cuda_graph=False):
    from pipeline.triton.repo_onnxruntime import write_onnxruntime_repo
    recipe = {"package": {"triton": {"max_batch_size": 8, "instance_count": 1}},
              "build": {"onnxruntime": {"intra_op_threads": 1, "provider": provider, "cuda_graph": cuda_graph}}}
    out = tmp_path / provider / "triton"
    summary = write_onnxruntime_repo(out, engine_dir=tiny_artifacts["engine_dir"],
                                     tokenizer_dir=tiny_artifacts["tokenizer_dir"], recipe=recipe, metrics={},
                                     engine_module=tiny_artifacts["engine_module"])
    return out, summary


def test_cuda_package_runs_on_the_gpu(tiny_artifacts, tmp_path):
    from pipeline.triton.repo_onnxruntime import ENGINE_MODEL, GRAPH_MODEL
    out, summary = _repo(tiny_artifacts, tmp_path, "cuda", cuda_graph=True)
    assert summary["instance_kind"] == "KIND_GPU" and summary["provider"] == "cuda"
    for m in (ENGINE_MODEL, GRAPH_MODEL):
        cfg = parse_config(out / m / "config.pbtxt")
        assert [g.kind for g in cfg.instance_group] == [cfg.instance_group[0].KIND_GPU], m
    p = parse_config(out / ENGINE_MODEL / "config.pbtxt").parameters
    assert p["provider"].string_value == "cuda" and p["cuda_graph"].string_value == "1"


def test_cpu_package_unchanged(tiny_artifacts, tmp_path):
    from pipeline.triton.repo_onnxruntime import ENGINE_MODEL
    out, summary = _repo(tiny_artifacts, tmp_path, "cpu")
    cfg = parse_config(out / ENGINE_MODEL / "config.pbtxt")
    assert summary["instance_kind"] == "KIND_CPU"
    assert cfg.instance_group[0].kind == cfg.instance_group[0].KIND_CPU and "provider" not in cfg.parameters


def test_cuda_manifest_names_the_gpu_and_deploy_needs_one(tiny_artifacts, tmp_path):
    """The package stage's target for a cuda recipe (pipeline.host.gpu.cuda_hardware) becomes a GPU hardware record;
    verify-deploy refuses a machine without a GPU and accepts one with it."""
    from pipeline.triton.manifest import current_env, read_manifest, verify_deploy, write_manifest
    out, summary = _repo(tiny_artifacts, tmp_path, "cuda")
    write_manifest(out, {"engine": "onnxruntime", "target": "cuda:sm_90:NVIDIA H200", "recipe": {"name": "tiny-cuda"}, "repository": summary,
                         "build": {"provider": "cuda", "precision": "fp16"}})
    hw = read_manifest(out)["hardware"]
    assert hw["kind"] == "gpu" and hw["provider"] == "cuda" and hw["sm"] == 90 and hw["gpu"] == "NVIDIA H200"
    no_gpu = {**current_env(), "gpus": [], "gpu_sms": []}
    assert any("no NVIDIA GPU found here" in p and "CUDA provider" in p for p in verify_deploy(out, no_gpu))
    with_gpu = {**current_env(), "gpus": [{"index": 0, "name": "NVIDIA H200", "sm": 90}], "gpu_sms": [90]}
    assert verify_deploy(out, with_gpu) == []
