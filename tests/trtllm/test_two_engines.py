"""Two engines from one checkpoint (issue 27): build (--gather_context_logits, validated) and build_deploy
(without it, packaged). Fast: stage wiring, argv, manifest record, agreement arithmetic; no engine is built."""

from __future__ import annotations

import pytest

from pipeline.errors import StageFailed
from pipeline.recipe import resolve
from pipeline.stages import flow_for
from pipeline.stages.tensorrt_llm import TrtllmBuildDeploy, TrtllmBuildStage, TrtllmPackage, deploy_build_section
from pipeline.trtllm.agreement import engines_record, greedy_agreement
from pipeline.trtllm.build_config import trtllm_build_args


@pytest.fixture(scope="module")
def qwen():
    return resolve("qwen7b-int8", [])


def test_flow_builds_both_engines_and_packages_the_deploy_engine():
    names = [s.name for s in flow_for("tensorrt_llm")]
    assert names.index("build") < names.index("build_deploy") < names.index("package")
    pkg = TrtllmPackage()
    assert pkg.needs[0] == "build_deploy" and "build" in pkg.needs and "evaluate" in pkg.needs
    assert pkg.version == "8" and TrtllmBuildDeploy().version == "1"
    assert TrtllmBuildDeploy().needs == TrtllmBuildStage().needs == ("checkpoint", "validate_checkpoint")


def test_deploy_argv_is_the_evaluation_argv_less_one_flag(qwen):
    ev = trtllm_build_args(qwen.build.tensorrt_llm.model_dump(), "/ckpt", "/out", None, None)
    de = trtllm_build_args(deploy_build_section(qwen), "/ckpt", "/out", None, None)
    assert "--gather_context_logits" in ev and "--gather_context_logits" not in de
    assert [a for a in ev if a != "--gather_context_logits"] == de
    # distinct cache keys: the two stages' configs differ exactly in the flag
    a, b = TrtllmBuildStage().config(qwen), TrtllmBuildDeploy().config(qwen)
    assert {k for k in a if a[k] != b[k]} == {"gather_context_logits"}


def test_package_checks_triton_against_the_deploy_engine():
    """KV-cache reuse is refused for an engine that gathers context logits; the packaged one does not."""
    from pipeline.triton.repo_trtllm import check_triton_vs_engine

    r = resolve("qwen7b-fp16", ["package.triton.enable_kv_cache_reuse=true"])
    assert TrtllmPackage().plan_problems(r, None) == []
    refused = check_triton_vs_engine(r.package.triton.model_dump(), r.build.tensorrt_llm.model_dump())
    assert any("gather_context_logits" in p for p in refused)


def _cfg(**over):
    bc = {"max_num_tokens": 8192, "gather_context_logits": True, "output_timing_cache": "/a/timing.cache",
          "plugin_config": {"gemm_plugin": "auto", "use_paged_context_fmha": True}}
    return {"build_config": bc | over}


def test_engines_record_accepts_only_the_flag_and_timing_paths():
    rec = engines_record(_cfg(), _cfg(gather_context_logits=False, output_timing_cache="/b/timing.cache"))
    assert rec["differ_in"] == {"gather_context_logits": [True, False]}
    assert rec["deploy"]["stage"] == "build_deploy" and rec["evaluation"]["stage"] == "build"
    with pytest.raises(StageFailed, match="max_num_tokens: 8192 vs 4096"):
        engines_record(_cfg(), _cfg(gather_context_logits=False, max_num_tokens=4096))
    with pytest.raises(StageFailed, match="plugin_config.gemm_plugin"):
        engines_record(_cfg(), _cfg(gather_context_logits=False, plugin_config={"gemm_plugin": "float16",
                                                                                 "use_paged_context_fmha": True}))
    with pytest.raises(StageFailed, match="expected true / false"):
        engines_record(_cfg(gather_context_logits=False), _cfg(gather_context_logits=True))
    with pytest.raises(StageFailed, match="expected true / false"):
        engines_record(_cfg(), _cfg())


def test_greedy_agreement_counts_positions_up_to_the_first_divergence():
    ev = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert greedy_agreement(ev, [[1, 2, 3, 4], [5, 6, 7, 8]], 1.0)["agreement"] == 1.0
    r = greedy_agreement(ev, [[1, 2, 9, 4], [5, 6, 7, 8]], 0.75)     # position 3 agrees again: not counted
    assert (r["agreeing"], r["positions"], r["first_divergence"]) == (6, 8, [2, None])
    short = greedy_agreement(ev, [[1, 2], [5, 6, 7, 8]], 0.0)          # one engine stopped early (EOS)
    assert (short["agreeing"], short["positions"]) == (6, 8)
    with pytest.raises(StageFailed, match="0.750 of 8 positions.*top1_agreement_min"):
        greedy_agreement(ev, [[1, 2, 9, 4], [5, 6, 7, 8]], 0.97)
    with pytest.raises(ValueError):
        greedy_agreement(ev, ev[:1], 0.5)


def test_the_cannot_run_hint_names_a_real_command():
    """It used to say `forge validate`, which does not exist."""
    import typer.main

    from pipeline.cli import app
    from pipeline.errors import CannotRunHere
    from pipeline.trtllm import runtime

    try:
        runtime._require()
    except CannotRunHere as e:
        msg = str(e)
    else:
        pytest.skip("tensorrt_llm and a GPU are present")
    cmds = {c.name for c in typer.main.get_command(app).commands.values()}
    assert "forge build <recipe> --from evaluate" in msg and "build" in cmds and "validate" not in cmds


def test_gemma_sharing_is_not_attributed_to_gemmaconfig():
    """Issue 27: TensorRT-LLM's GemmaConfig (tensorrt_llm/models/gemma/config.py, index id 397088162) forces
    use_parallel_embedding = tp_size > 1 and has no share_embedding_table logic; the docs said it forced both."""
    import inspect

    from pipeline.trtllm import checkpoint, families

    doc = " ".join(families.__doc__.split())
    assert "forces ``use_parallel_embedding = tp_size > 1``" in doc and "sets nothing about sharing" in doc
    assert "and a shared embedding table" not in doc
    assert "GemmaConfig: always" not in inspect.getsource(checkpoint)
    f = checkpoint._gemma3_fields({"query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0,
                                   "sliding_window": 512, "sliding_window_pattern": 6}, 2)
    assert f["share_embedding_table"] is True and f["use_parallel_embedding"] is True
