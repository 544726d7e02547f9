"""The memory plan's runtime buffers against a hand computation from TensorRT-LLM's batch manager (issue 27).

Hand rule, from the lines quoted in docs/trtllm-memory.md (runtimeBuffers.cpp @ 092a5a15, microBatchScheduler.cpp
@ 0a949d31, modelConfig.h getVocabSizePadded):
  gathered context logits: rows = max_num_tokens; otherwise rows = max_batch_size * max_beam_width;
  vocabSizePadded = ceil(vocab / (tp * pp)) * (tp * pp); bytes = rows * vocabSizePadded * bytes(logits_dtype).
"""

import pytest

from pipeline.gpus import GiB
from pipeline.memory import TRTLLM_SOURCES, plan_for_recipe, plan_memory, runtime_buffers, vocab_size_padded
from pipeline.modelinfo import ModelInfo

# recipe -> (vocab, tp*pp, max_num_tokens, max_batch_size, logits bytes) as written in recipes/*.yaml and the
# model configs; the expected bytes are the products, written out.
HAND = {
    "qwen7b-fp16": (152064, 2, 8192, 64, 2, 2_491_416_576),             # 8192 * 152064 * 2 = 2.32 GiB
    "qwen7b-int8": (152064, 2, 8192, 64, 2, 2_491_416_576),
    "qwen3-8b-fp16": (151936, 2, 8192, 64, 2, 2_489_319_424),
    "llama3-8b-int8": (128256, 2, 8192, 64, 2, 2_101_346_304),           # 1.96 GiB
    "mistral7b-int8wo": (32000, 1, 8192, 64, 2, 524_288_000),
    "gemma3-270m-trtllm": (262144, 1, 4096, 8, 2, 2_147_483_648),       # 2.0 GiB
    "smollm2-135m-trtllm-tp3": (49152, 3, 4096, 8, 2, 402_653_184),      # 49152 % 3 == 0: no padding
}


@pytest.fixture(scope="module")
def plans():
    from pipeline.recipe import resolve
    from pipeline.runner import Runner

    out = {}
    for name in HAND:
        r = resolve(name, [])
        out[name] = (r, plan_for_recipe(r, Runner(r).model_info(), "rtx4090"))
    return out


@pytest.mark.parametrize("name", sorted(HAND))
def test_plan_counts_the_gathered_context_logits_per_recipe(plans, name):
    vocab, world, mnt, mbs, lb, expected = HAND[name]
    r, (plan, _) = plans[name]
    b = r.build.tensorrt_llm
    assert (b.tp * b.pp, b.max_num_tokens, b.max_batch_size, b.max_beam_width) == (world, mnt, mbs, 1)
    assert b.gather_context_logits is True and b.logits_dtype == "float16"
    assert mnt * (-(-vocab // world) * world) * lb == expected
    [buf] = plan.runtime_buffers
    assert buf["rows"] == mnt and buf["vocab_size_padded"] == -(-vocab // world) * world
    assert plan.logits_bytes == buf["bytes"] == expected
    assert plan.total_bytes == (plan.weights_bytes + plan.kv_cache_paged_bytes + plan.activation_bytes
                                + expected + plan.runtime_bytes)
    # the same recipe without the evaluation buffer (the deploy engine): last-token rows only
    deploy = plan_memory(plan._info, **{**plan.args, "gather_context_logits": False})
    assert deploy.logits_bytes == mbs * (-(-vocab // world) * world) * lb
    assert plan.total_bytes - deploy.total_bytes == expected - mbs * (-(-vocab // world) * world) * lb


def test_qwen7b_fp16_on_a_4090_is_refused_once_the_logits_are_counted(plans):
    """Issue 27: forge said it fit with 1.02 GiB free; the 2.32 GiB logits buffer makes it 1.28 GiB short."""
    _, (plan, [v]) = plans["qwen7b-fp16"]
    assert not v.fits and -1.30 * GiB < v.margin_bytes < -1.26 * GiB
    assert v.margin_bytes + plan.logits_bytes - 64 * 152064 * 2 > 0          # the deploy engine fits
    mnt = [s for s in v.suggestions if s.key == "max_num_tokens"]
    assert mnt and mnt[0].value < 8192 and mnt[0].recipe_key == "build.tensorrt_llm.max_num_tokens"


def test_vocab_is_padded_to_the_world_size_and_not_split():
    """Every last-pipeline rank holds the full padded vocabulary (the engine all-gathers lm_head's output)."""
    assert vocab_size_padded(49152, 3) == 49152 and vocab_size_padded(32001, 2) == 32002
    assert vocab_size_padded(151655, 4) == 151656 and vocab_size_padded(7, 8) == 8
    info = ModelInfo.bundled("Qwen/Qwen2-7B-Instruct")
    one = runtime_buffers(info, tp=1, pp=1, max_batch_size=4, max_beam_width=1, max_num_tokens=16,
                          gather_context_logits=False, logits_dtype="float32")
    four = runtime_buffers(info, tp=4, pp=1, max_batch_size=4, max_beam_width=1, max_num_tokens=16,
                           gather_context_logits=False, logits_dtype="float32")
    assert one[0]["bytes"] == four[0]["bytes"] == 4 * 152064 * 4
    beams = runtime_buffers(info, tp=1, pp=1, max_batch_size=4, max_beam_width=3, max_num_tokens=16,
                            gather_context_logits=False, logits_dtype="float16")
    assert beams[0]["rows"] == 12 and beams[0]["bytes"] == 12 * 152064 * 2


def test_bad_logits_dtype_names_the_recipe_key():
    from pipeline.errors import ForgeError

    with pytest.raises(ForgeError, match="build.tensorrt_llm.logits_dtype"):
        plan_memory(ModelInfo.bundled("Qwen/Qwen2-7B-Instruct"), logits_dtype="int8")
    with pytest.raises(ForgeError, match="max_beam_width"):
        plan_memory(ModelInfo.bundled("Qwen/Qwen2-7B-Instruct"), max_beam_width=0)


def test_sources_are_cited_by_upstream_commit_and_in_the_doc():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "trtllm-memory.md").read_text()
    for path, commit in TRTLLM_SOURCES.values():
        assert path in doc and commit in doc
        if not commit.startswith("index id"):
            assert len(commit) == 40 and int(commit, 16) >= 0
    for quoted in ("{numContextTokens + numGenSequences, vocabSizePadded}",
                   "numLogits = maxBatchSize * std::max(1 + maxDraftTokens, maxBeamWidth)",
                   "batchNumTokens + reqNumTokens > maxNumTokensRuntime.value()",
                   "(mVocabSize + worldSize - 1) / worldSize * worldSize"):
        assert quoted in doc


def test_build_plan_refuses_a_recipe_that_does_not_fit_this_machines_gpu(plans):
    """Before any GPU work: the build stage's plan problems include the memory verdict for the GPU found here."""
    from pipeline.stages.tensorrt_llm import memory_problems

    r, (plan, _) = plans["qwen7b-fp16"]
    [p] = memory_problems(r, plan._info, [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "sm": 89}])
    assert p.startswith("memory: one rank needs") and "rtx4090" in p and "2.32 GiB" in p
    assert "--set build.tensorrt_llm.max_num_tokens=" in p
    assert memory_problems(r, plan._info, [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "sm": 90}]) == []
    assert memory_problems(r, plan._info, []) == []                       # no GPU: nothing to refuse here
    assert memory_problems(r, plan._info, [{"index": 0, "name": "Tesla T4", "sm": 75}]) == []   # unknown GPU
