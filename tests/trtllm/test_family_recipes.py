"""Llama-3.1-8B, Mistral-7B and Qwen3-8B recipes: listed, planned and sized on this CPU machine from the
bundled public configs (no weights), and the family facts the plan / memory tools derive from them (issue 13)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.trtllm.memory import plan_memory
from pipeline.modelinfo import ModelInfo

REPO = Path(__file__).resolve().parents[2]
RECIPES = {"llama3-8b-int8": "LlamaForCausalLM", "mistral7b-int8wo": "MistralForCausalLM",
           "qwen3-8b-fp16": "Qwen3ForCausalLM"}


def forge(*args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, COLUMNS="200", FORGE_PROGRESS="0"), timeout=120)


def test_recipes_listed():
    p = forge("recipes", "list")
    assert p.returncode == 0, p.stderr
    for r in RECIPES:
        assert r in p.stdout


@pytest.mark.parametrize("recipe,arch", RECIPES.items())
def test_plan_and_memory_from_bundled_config(recipe, arch):
    p = forge("plan", recipe)
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 0 and "Traceback" not in out, out
    m = forge("memory", recipe, "--gpu", "h100")
    out = " ".join((m.stdout + m.stderr).split())
    assert m.returncode == 0 and arch in out and "FITS" in out, out


def test_bundled_family_facts():
    llama = ModelInfo.bundled("meta-llama/Llama-3.1-8B-Instruct")
    mistral = ModelInfo.bundled("mistralai/Mistral-7B-v0.1")
    qwen3 = ModelInfo.bundled("Qwen/Qwen3-8B")
    assert llama.rope_theta == 5e5 and llama.sliding_window is None
    assert mistral.sliding_window == 4096 and mistral.sliding_layers_in(32) == 32
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.sliding_window is None
    # published sizes: Llama-3.1-8B 8.03 B, Mistral-7B 7.24 B, Qwen3-8B 8.19 B parameters
    assert abs(llama.num_params / 8.03e9 - 1) < 0.01
    assert abs(mistral.num_params / 7.24e9 - 1) < 0.01
    assert abs(qwen3.num_params / 8.19e9 - 1) < 0.01


def test_sliding_window_shrinks_kv_beyond_the_window():
    mistral = ModelInfo.bundled("mistralai/Mistral-7B-v0.1")
    short = plan_memory(mistral, max_batch_size=4, max_seq_len=4096, tokens_per_block=64)
    long = plan_memory(mistral, max_batch_size=4, max_seq_len=16384, tokens_per_block=64)
    assert long.kv_cache_paged_bytes == short.kv_cache_paged_bytes      # capped at the 4096-token window
    assert any("sliding window" in n for n in long.notes)


def test_qwen3_tp_rules_at_plan():
    p = forge("plan", "qwen3-8b-fp16", "--set", "build.tensorrt_llm.tp=3")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2 and "build.tensorrt_llm.tp: 3 does not divide the 32 attention heads" in out, out


def test_gemma3_recipe_plans_and_fp16_is_refused():
    p = forge("plan", "gemma3-270m-trtllm")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 0 and "Traceback" not in out, out
    p = forge("plan", "gemma3-270m-trtllm", "--set", "build.tensorrt_llm.dtype=float16")
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2 and "float16 overflows Gemma 3's residual stream" in out, out
    g = ModelInfo.bundled("google/gemma-3-270m")
    assert g.global_every == 6 and g.sliding_window == 512 and g.sliding_layers_in(18) == 15
    assert g.qk_norm and g.norms_per_layer == 4 and g.rope_theta == 1e6
    assert abs(g.num_params / 268.1e6 - 1) < 0.01        # published: 268 M (170 M embedding + 100 M blocks)
