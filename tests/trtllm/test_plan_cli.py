"""Plan-time validation of TensorRT-LLM recipes through the CLI (no model weights needed)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def forge(*args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, COLUMNS="200", FORGE_PROGRESS="0"), timeout=120)


def test_tp2_on_smollm2_fails_at_plan_naming_the_key():
    p = forge("plan", "smollm2-135m-trtllm-tp3", "--set", "build.tensorrt_llm.tp=2")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2, out
    assert "build.tensorrt_llm.tp: 2 does not divide the 9 attention heads" in out
    assert "smollm2-135m-trtllm-tp3.yaml" in out and "Traceback" not in out


def test_int8_kv_with_kv_cache_reuse_is_refused_at_plan():
    p = forge("plan", "qwen7b-int8", "--set", "package.triton.enable_kv_cache_reuse=true")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2, out
    assert "enable_kv_cache_reuse" in out


def test_plan_marks_gpu_stages_cannot_run_here():
    p = forge("plan", "qwen7b-fp16", "--json")
    assert p.returncode == 0, p.stderr
    import json
    stages = {s["name"]: s for s in json.loads(p.stdout)["stages"]}
    assert stages["build"]["status"] == "cannot-run-here"
    assert "tensorrt_llm" in stages["build"]["reason"]


def test_kv_cache_reuse_is_checked_against_the_deploy_engine_at_plan():
    """TensorRT-LLM silently turns reuse off for an engine built with gather_context_logits. Since issue 27 the
    packaged engine is build_deploy's, built without it: reuse plans with the recipe's gather_context_logits true
    (check_triton_vs_engine still refuses it for a gathering engine: tests/trtllm/test_two_engines.py), and the
    other rule, paged context FMHA, is still enforced at plan."""
    ok = forge("plan", "smollm2-135m-trtllm-tp3", "--set", "package.triton.enable_kv_cache_reuse=true")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "enable_kv_cache_reuse" not in ok.stdout + ok.stderr
    p = forge("plan", "smollm2-135m-trtllm-tp3", "--set", "package.triton.enable_kv_cache_reuse=true",
              "--set", "build.tensorrt_llm.use_paged_context_fmha=false")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2, out
    assert "package.triton.enable_kv_cache_reuse: true needs an engine built with paged context FMHA" in out


def test_kv_cache_fraction_of_one_is_a_recipe_error():
    p = forge("plan", "qwen7b-fp16", "--set", "package.triton.kv_cache_free_gpu_mem_fraction=1.0")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2, out
    assert "package.triton.kv_cache_free_gpu_mem_fraction" in out and "Traceback" not in out


def test_plan_says_max_input_len_is_ignored():
    """forge plan names the runtime's prompt limit, not the max_input_len trtllm-build ignores (issue 27)."""
    p = forge("plan", "gemma3-270m-trtllm")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 0, out
    assert ("prompt limit: 2047 tokens = min(max_seq_len - 1, max_num_tokens); "
            "build.tensorrt_llm.max_input_len 1024 is ignored") in out
