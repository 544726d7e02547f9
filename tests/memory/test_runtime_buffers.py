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
    for name in sorted(set(HAND) | set(RECIPE_SHAPES)):
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
    buf = plan.runtime_buffers[0]
    assert buf["rows"] == mnt and buf["vocab_size_padded"] == -(-vocab // world) * world
    assert plan.logits_bytes == buf["bytes"] == expected
    assert plan.total_bytes == (plan.weights_bytes + plan.kv_cache_paged_bytes + plan.kv_headroom_bytes
                                + plan.activation_bytes + expected + plan.buffers_bytes + plan.runtime_bytes)
    # the same recipe without the evaluation buffer (the deploy engine): last-token rows only
    deploy = plan_memory(plan._info, **{**plan.args, "gather_context_logits": False})
    assert deploy.logits_bytes == mbs * (-(-vocab // world) * world) * lb
    assert plan.total_bytes - deploy.total_bytes == expected - mbs * (-(-vocab // world) * world) * lb


def test_qwen7b_fp16_on_a_4090_is_refused_once_the_logits_are_counted(plans):
    """Issue 27: forge said it fit with 1.02 GiB free; the 2.32 GiB logits buffer made it 1.28 GiB short, and the
    KV pool headroom (1.56 GiB at fraction 0.9 of 14 GiB) plus the decoder buffers make it 3.04 GiB short."""
    _, (plan, [v]) = plans["qwen7b-fp16"]
    assert not v.fits and -3.05 * GiB < v.margin_bytes < -3.03 * GiB
    assert v.margin_bytes + plan.logits_bytes - 64 * 152064 * 2 < 0          # the deploy engine does not fit either
    kv = [s for s in v.suggestions if s.key == "kv_cache"]
    assert kv and kv[0].recipe_key == "quantize.kv_cache" and kv[0].total_bytes <= v.capacity_bytes


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
                   "(mVocabSize + worldSize - 1) / worldSize * worldSize",
                   "dOutput.ids->reshape(maxTotalTokensShape)", "mPenaltyWorkspaceDevice",
                   "mRuntimeLogitsDevice", "freePrimaryMemBytes = static_cast<uint64_t>(finalFreeMem * freeMemFraction)",
                   "getMaxRequiredWorkspaceSize(tpSize)"):
        assert quoted in doc


def test_build_plan_refuses_a_recipe_that_does_not_fit_this_machines_gpu(plans):
    """Before any GPU work: the build stage's plan problems include the memory verdict for the GPU found here."""
    from pipeline.stages.tensorrt_llm import memory_problems

    r, (plan, _) = plans["qwen7b-fp16"]
    [p] = memory_problems(r, plan._info, [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "sm": 89}])
    assert p.startswith("memory: one rank needs") and "rtx4090" in p and "2.32 GiB" in p
    assert "--set quantize.kv_cache=" in p
    assert memory_problems(r, plan._info, [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "sm": 90}]) == []
    assert memory_problems(r, plan._info, []) == []                       # no GPU: nothing to refuse here
    assert memory_problems(r, plan._info, [{"index": 0, "name": "Tesla T4", "sm": 75}]) == []   # unknown GPU


# ------------------------------------------------------------------------------------------------------------------
# Every other buffer, by hand from the lines quoted in docs/trtllm-memory.md ("Decoder, sampling and all-reduce
# buffers"). recipe -> (vocab, hidden, tp, max_batch_size, max_beam_width, max_seq_len, logits bytes, fraction), as
# written in recipes/*.yaml (resolved) and the model configs.
RECIPE_SHAPES = {
    "qwen7b-fp16": (152064, 3584, 2, 64, 1, 8192, 2, 0.9),
    "qwen7b-int8": (152064, 3584, 2, 64, 1, 8192, 2, 0.9),
    "qwen3-8b-fp16": (151936, 4096, 2, 64, 1, 8192, 2, 0.9),
    "llama3-8b-int8": (128256, 4096, 2, 64, 1, 8192, 2, 0.9),
    "llama3-8b-fp8": (128256, 4096, 2, 64, 1, 8192, 2, 0.9),
    "qwen7b-fp8": (152064, 3584, 2, 64, 1, 8192, 2, 0.9),
    "mistral7b-int8wo": (32000, 4096, 1, 64, 1, 8192, 2, 0.9),
    "gemma3-270m-trtllm": (262144, 640, 1, 8, 1, 2048, 2, 0.9),
    "smollm2-135m-trtllm-tp3": (49152, 576, 3, 8, 1, 2048, 2, 0.9),
}


def _hand_buffers(vocab, hidden, tp, mbs, beam, seq, lb):
    vp = -(-vocab // tp) * tp                      # getVocabSizePadded(worldSize), pp = 1 in every recipe
    hand = {
        "decoder output ids": mbs * beam * seq * 4,                  # {maxBatchSize, maxBeamWidth, maxSeqLen} int32
        "decoder parent ids": mbs * beam * seq * 4,
        "decoder log probs": mbs * beam * seq * 4,                   # float
        "decoder log probs (tiled)": seq * mbs * beam * 4,
        "decoder embedding bias": mbs * vp * lb,                     # {mMaxBatchSize, vocabSizePadded} logits type
        "cache indirection (input + output)": 2 * mbs * beam * seq * 4,
        "slot decoder buffers (output ids + log probs)": mbs * (beam * seq * 4 + beam * seq * 4),
        "decoding workspace runtime logits": mbs * 1 * beam * vp * lb,
        "penalty workspace": mbs * 1 * beam * vocab * 4,             # unpadded vocab, int32
        "top-P sampling workspace (sorted logits + ids)": lb * mbs * vp + 4 * mbs * vp,
    }
    if tp > 1:
        ws = 16_000_000 if tp <= 2 else 8_000_000
        one = tp * min(mbs * beam * seq * hidden * 4, ws)
        hand["custom all-reduce workspace"] = 2 * (((one + 2**21 - 1) // 2**21) * 2**21)
    return hand


def test_every_tensorrt_llm_recipe_is_listed_here():
    from pathlib import Path

    from pipeline.recipe import resolve

    names = sorted(p.stem for p in (Path(__file__).parents[2] / "recipes").glob("*.yaml"))
    trtllm = {n for n in names if resolve(n, []).build.target == "tensorrt_llm"}
    assert trtllm == set(RECIPE_SHAPES) and set(HAND) <= trtllm


@pytest.mark.parametrize("name", sorted(RECIPE_SHAPES))
def test_every_runtime_buffer_matches_the_hand_computation(plans, name):
    vocab, hidden, tp, mbs, beam, seq, lb, frac = RECIPE_SHAPES[name]
    r, (plan, [v]) = plans[name]
    b = r.build.tensorrt_llm
    assert (b.tp, b.pp, b.max_batch_size, b.max_beam_width, b.max_seq_len) == (tp, 1, mbs, beam, seq)
    assert r.package.triton.kv_cache_free_gpu_mem_fraction == frac and plan._info.hidden_size == hidden
    hand = _hand_buffers(vocab, hidden, tp, mbs, beam, seq, lb)
    got = {rb["name"]: rb["bytes"] for rb in plan.runtime_buffers[1:]}
    assert got == hand
    for rb in plan.runtime_buffers:
        assert " @ " in rb["source"] or rb is plan.runtime_buffers[0]
    assert plan.buffers_bytes == sum(hand.values())
    # KV pool: freePrimaryMemBytes = free * fraction, so the worst case needs kv / fraction free
    kv = plan.kv_cache_paged_bytes
    assert plan.kv_headroom_bytes == -(-kv * 10 // 9) - kv if frac == 0.9 else True
    assert plan.total_bytes == (plan.weights_bytes + kv + plan.kv_headroom_bytes + plan.activation_bytes
                                + plan.logits_bytes + sum(hand.values()) + plan.runtime_bytes)
    assert v.needed_bytes == plan.total_bytes and v.fits == (plan.total_bytes <= v.capacity_bytes)


def test_qwen7b_int8_on_a_4090_numbers(plans):
    """docs/trtllm-memory.md's table: the buffers beyond the logits add 210 MiB, the KV headroom 0.78 GiB."""
    _, (plan, [v]) = plans["qwen7b-int8"]
    assert plan.buffers_bytes == 220_135_424
    assert plan.kv_cache_paged_bytes == 7 * GiB and plan.kv_headroom_bytes == 835_132_530
    assert plan.total_bytes == 17_412_792_546 and v.fits


def test_bad_kv_fraction_names_the_recipe_key():
    from pipeline.errors import ForgeError

    info = ModelInfo.bundled("Qwen/Qwen2-7B-Instruct")
    for bad in (0, 1, 1.5, "x"):
        with pytest.raises(ForgeError, match="package.triton.kv_cache_free_gpu_mem_fraction"):
            plan_memory(info, kv_cache_free_gpu_mem_fraction=bad)


def test_beam_search_adds_gathered_ids_and_a_second_penalty_workspace():
    info = ModelInfo.bundled("Qwen/Qwen2-7B-Instruct")
    bufs = {b["name"]: b["bytes"] for b in runtime_buffers(
        info, tp=1, pp=1, max_batch_size=4, max_beam_width=2, max_num_tokens=16, gather_context_logits=False,
        logits_dtype="float32", max_seq_len=100)}
    assert bufs["decoder gathered ids"] == 4 * 2 * 100 * 4
    assert bufs["penalty workspace"] == 2 * 4 * 2 * 152064 * 4
    assert "top-P sampling workspace (sorted logits + ids)" not in bufs and "custom all-reduce workspace" not in bufs
