"""The memory plan's runtime buffers, activations and KV-pool rule against hand computations from TensorRT-LLM 1.2's
source (issues 27 and 40). Every rule below is a line quoted in docs/trtllm-memory.md:

- start-up logits: RuntimeBuffers ctor -> setMaxBufferSizes (numLogits = maxBatchSize * max(1 + draft, beam)) ->
  reshape: [max_batch_size x max_beam_width, vocabSizePadded], vocabSizePadded = ceil(vocab / (tp*pp)) * (tp*pp);
- per step, after the KV pool, for an engine that gathers context logits: reshape's logits = manager.gpu(
  [numContextTokens + numGenSequences, vocabSizePadded]), at most max_num_tokens rows (microBatchScheduler), and the
  previous step's buffer held by HandleContextLogits' views until the next decoderStepAsync: 2 x max_num_tokens rows;
- NCCL's connection buffers, per step after the pool (NCCL_RUNTIME_CONNECT): MAXCHANNELS 64 x (tp - 1) peers x
  (LL 8*512*8*16 + LL128 120*640*8*8 + Simple 4 MiB);
- the lm_head's all-gather in the engine's context memory: ColumnLinear(hidden, pad_vocab_size(vocab, tp),
  gather_output=True): local [rows, V/tp] + gathered [tp*rows, V/tp] (a cast to logits_dtype adds the concatenated
  [rows, V] instead of the local one); rows = max_num_tokens with --gather_context_logits, else mbs x beam;
- the pool: min(max_tokens_in_paged_kv_cache, fraction x free); the cap is ignored with more than one window size.
"""

import math

import pytest

from pipeline.gpus import GPUS, GiB
from pipeline.modelinfo import ModelInfo
from pipeline.trtllm.memory import (NCCL_SOURCES, PER_STEP, STARTUP, TRTLLM_SOURCES, fit, plan_for_recipe,
                                    plan_memory, runtime_buffers, vocab_size_padded)

NCCL_SET = 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8 + 4 * 1024 * 1024      # LL + LL128 + Simple = 9,633,792 B

# recipe -> (vocab, hidden, tp, max_batch_size, max_beam_width, max_seq_len, max_num_tokens, model dtype bytes,
# cast to float16 logits?, fraction), as written in recipes/*.yaml (resolved) and the model configs.
RECIPE_SHAPES = {
    "qwen7b-fp16": (152064, 3584, 2, 64, 1, 8192, 8192, 2, False, 0.9),
    "qwen7b-int8": (152064, 3584, 2, 64, 1, 8192, 8192, 2, False, 0.9),
    "qwen7b-fp8": (152064, 3584, 2, 64, 1, 8192, 8192, 2, False, 0.9),
    "qwen7b-int4zp": (152064, 3584, 2, 64, 1, 8192, 8192, 2, False, 0.9),
    "qwen3-8b-fp16": (151936, 4096, 2, 64, 1, 8192, 8192, 2, False, 0.9),
    "llama3-8b-int8": (128256, 4096, 2, 64, 1, 8192, 8192, 2, False, 0.9),
    "llama3-8b-fp8": (128256, 4096, 2, 64, 1, 8192, 8192, 2, False, 0.9),
    "mistral7b-int8wo": (32000, 4096, 1, 64, 1, 8192, 8192, 2, False, 0.9),
    "gemma3-270m-trtllm": (262144, 640, 1, 8, 1, 2048, 4096, 2, True, 0.9),     # bfloat16 model, float16 logits
    "smollm2-135m-trtllm-tp3": (49152, 576, 3, 8, 1, 2048, 4096, 2, False, 0.9),
}

# the lm_head all-gather of the evaluation engine (rows = max_num_tokens), written out
LM_HEAD = {
    "qwen7b-fp16": 8192 * (76032 + 152064) * 2,          # 3,737,124,864 B = 3.48 GiB: local + gathered
    "qwen7b-int8": 8192 * (76032 + 152064) * 2,
    "qwen7b-fp8": 8192 * (76032 + 152064) * 2,
    "qwen7b-int4zp": 8192 * (76032 + 152064) * 2,
    "qwen3-8b-fp16": 8192 * (75968 + 151936) * 2,
    "llama3-8b-int8": 8192 * (64128 + 128256) * 2,
    "llama3-8b-fp8": 8192 * (64128 + 128256) * 2,
    "mistral7b-int8wo": 0,                                # tp 1, no cast: the GEMM writes the logits buffer itself
    "gemma3-270m-trtllm": 4096 * 262144 * 2,              # tp 1, bf16 -> fp16 cast: the bf16 [rows, V] is internal
    "smollm2-135m-trtllm-tp3": 4096 * (16384 + 49152) * 2,
}

# max_tokens_in_paged_kv_cache = max_batch_size x ceil(window / tokens_per_block) x tokens_per_block
KV_CAP = {"qwen7b-fp16": 64 * 8192, "qwen7b-int8": 64 * 8192, "qwen7b-fp8": 64 * 8192, "qwen3-8b-fp16": 64 * 8192,
          "qwen7b-int4zp": 64 * 8192,
          "llama3-8b-int8": 64 * 8192, "llama3-8b-fp8": 64 * 8192,
          "mistral7b-int8wo": 64 * 4096,                  # every layer slides over 4096 tokens: one window size
          "gemma3-270m-trtllm": None,                     # windows 512 and 2048: TensorRT-LLM ignores the cap
          "smollm2-135m-trtllm-tp3": 8 * 2048}


@pytest.fixture(scope="module")
def plans():
    from pipeline.recipe import resolve
    from pipeline.runner import Runner

    out = {}
    for name in sorted(RECIPE_SHAPES):
        r = resolve(name, [])
        info = Runner(r).model_info()
        out[name] = (r, plan_for_recipe(r, info, "rtx4090"), plan_for_recipe(r, info, "rtx4090", deploy=True))
    return out


def test_every_tensorrt_llm_recipe_is_listed_here():
    from pathlib import Path

    from pipeline.recipe import resolve

    names = sorted(p.stem for p in (Path(__file__).parents[2] / "recipes").glob("*.yaml"))
    trtllm = {n for n in names if resolve(n, []).build.target == "tensorrt_llm"}
    assert trtllm == set(RECIPE_SHAPES) == set(LM_HEAD) == set(KV_CAP)


def _hand_buffers(vocab, hidden, tp, mbs, beam, seq, mnt, lb, gather):
    """name -> (bytes, when), every formula from the lines quoted in docs/trtllm-memory.md."""
    vp = -(-vocab // tp) * tp                      # getVocabSizePadded(worldSize), pp = 1 in every recipe
    hand = {
        "logits (start-up)": (mbs * beam * vp * lb, STARTUP),
        "decoder output ids": (mbs * beam * seq * 4, STARTUP),
        "decoder parent ids": (mbs * beam * seq * 4, STARTUP),
        "decoder log probs": (mbs * beam * seq * 4, STARTUP),
        "decoder log probs (tiled)": (seq * mbs * beam * 4, STARTUP),
        "decoder embedding bias": (mbs * vp * lb, STARTUP),
        "cache indirection (input + output)": (2 * mbs * beam * seq * 4, STARTUP),
        "slot decoder buffers (output ids + log probs)": (mbs * (beam * seq * 4 + beam * seq * 4), STARTUP),
        "decoding workspace runtime logits": (mbs * 1 * beam * vp * lb, STARTUP),
        "penalty workspace": (mbs * 1 * beam * vocab * 4, STARTUP),          # unpadded vocab, int32
        "top-P sampling workspace (sorted logits + ids)": (lb * mbs * vp + 4 * mbs * vp, STARTUP),
    }
    if gather:
        hand["context logits (per step: this step's + the previous step's)"] = (2 * mnt * vp * lb, PER_STEP)
    if tp > 1:
        ws = 16_000_000 if tp <= 2 else 8_000_000
        one = tp * min(mbs * beam * seq * hidden * 4, ws)
        hand["custom all-reduce workspace"] = (2 * (((one + 2**21 - 1) // 2**21) * 2**21), STARTUP)
        hand["NCCL connection buffers (tp > 1, upper bound)"] = (64 * (tp - 1) * NCCL_SET, PER_STEP)
    return hand


@pytest.mark.parametrize("deploy", [False, True], ids=["evaluation", "deploy"])
@pytest.mark.parametrize("name", sorted(RECIPE_SHAPES))
def test_every_runtime_buffer_matches_the_hand_computation(plans, name, deploy):
    vocab, hidden, tp, mbs, beam, seq, mnt, _, _, frac = RECIPE_SHAPES[name]
    r, (plan, _), (dplan, _) = plans[name]
    p = dplan if deploy else plan
    b = r.build.tensorrt_llm
    assert (b.tp, b.pp, b.max_batch_size, b.max_beam_width, b.max_seq_len, b.max_num_tokens) == (tp, 1, mbs, beam,
                                                                                                   seq, mnt)
    assert b.gather_context_logits is True and b.logits_dtype == "float16"
    assert r.package.triton.kv_cache_free_gpu_mem_fraction == frac and p._info.hidden_size == hidden
    hand = _hand_buffers(vocab, hidden, tp, mbs, beam, seq, mnt, 2, gather=not deploy)
    assert {rb["name"]: (rb["bytes"], rb["when"]) for rb in p.runtime_buffers} == hand
    assert all(" @ " in rb["source"] for rb in p.runtime_buffers)
    assert p.buffers_bytes == sum(v for n, (v, w) in hand.items() if w == STARTUP and n != "logits (start-up)")
    assert p.late_bytes == sum(v for v, w in hand.values() if w == PER_STEP)
    assert p.logits_bytes == sum(v for n, (v, _) in hand.items() if "logits" in n and "workspace" not in n)


@pytest.mark.parametrize("name", sorted(RECIPE_SHAPES))
def test_lm_head_all_gather_is_in_the_activations(plans, name):
    """Issue 40: the evaluation engine's lm_head runs on every packed token and all-gathers its output."""
    vocab, _, tp, mbs, beam, _, mnt, act, cast, _ = RECIPE_SHAPES[name]
    _, (plan, _), (dplan, _) = plans[name]
    vpt = -(-vocab // tp) * tp                     # pad_vocab_size(vocab_size, tp_size)
    if tp > 1:
        hand = (mnt * vpt + (mnt * vpt if cast else mnt * vpt // tp)) * act
    else:
        hand = mnt * vpt * act if cast else 0
    assert hand == LM_HEAD[name] == plan.lm_head["bytes"]
    assert plan.activation_bytes == max(plan.layer_activation_bytes, LM_HEAD[name])
    # the deploy engine's lm_head sees the last token of max_batch_size x max_beam_width sequences
    rows = mbs * beam
    dhand = (rows * vpt + rows * vpt // tp) * act if tp > 1 else (rows * vpt * act if cast else 0)
    assert dplan.lm_head["bytes"] == dhand and dplan.lm_head["rows"] == rows


def test_qwen7b_lm_head_outweighs_the_layer_estimate(plans):
    """Issue 40's figure: 3.5 GiB per rank at tp 2, where the plan used to count one layer's 0.61 GiB."""
    _, (plan, _), _ = plans["qwen7b-int8"]
    assert plan.layer_activation_bytes == 8192 * (2 * 3584 + 18 * 128 + 14 * 128 + 3 * 9472) * 2 == 650_117_120
    assert plan.activation_bytes == 3_737_124_864 and 3.47 * GiB < plan.activation_bytes < 3.49 * GiB


@pytest.mark.parametrize("deploy", [False, True], ids=["evaluation", "deploy"])
@pytest.mark.parametrize("name", sorted(RECIPE_SHAPES))
def test_total_is_what_is_allocated_before_the_pool_plus_the_pool_plus_what_comes_after(plans, name, deploy):
    _, (plan, [v]), (dplan, [dv]) = plans[name]
    p, verdict = (dplan, dv) if deploy else (plan, v)
    frac = p.args["kv_cache_free_gpu_mem_fraction"]
    start = [rb["bytes"] for rb in p.runtime_buffers if rb["when"] == STARTUP]
    early = p.weights_bytes + p.activation_bytes + sum(start) + p.runtime_bytes
    assert p.early_bytes == early and p.runtime_bytes == GiB
    kv = p.kv_cache_paged_bytes
    assert p.kv_max_tokens == KV_CAP[name]
    if p.kv_max_tokens is not None:
        # min(cap, fraction x free) = kv when free >= kv / fraction; the per-step buffers get free - kv
        assert p.kv_max_tokens * p.kv_bytes_per_token == kv
        assert p.reserve_bytes == max(math.ceil(kv / frac) - kv, p.late_bytes)
    else:
        # fraction x free, an equal share per window size; the per-step buffers get (1 - fraction) x free.
        # Gemma 3 270M: 3 global layers x 2048 tokens and 15 sliding layers x 512, 8 sequences, 1 KV head x 256 x
        # (K, V) x bf16 = 1024 B per token and layer
        assert name == "gemma3-270m-trtllm"
        groups = (1024 * 8 * 3 * 2048, 1024 * 8 * 15 * 512)
        assert kv == sum(groups) == 113_246_208
        assert p.kv_headroom_bytes == math.ceil(2 * max(groups) / frac) - kv == 26_563_926
        assert p.reserve_bytes == max(math.ceil(2 * max(groups) / frac), math.ceil(p.late_bytes / (1 - frac))) - kv
    assert p.total_bytes == early + kv + p.reserve_bytes == verdict.needed_bytes
    assert verdict.fits == (p.total_bytes <= verdict.capacity_bytes)
    if not deploy:      # the evaluation engine needs at least what the served one does
        assert plan.total_bytes >= dplan.total_bytes


def test_qwen7b_int8_on_a_4090_numbers(plans):
    """docs/trtllm-memory.md's qwen7b-int8 column: 16.22 GiB per rank before issue 40, 20.98 GiB after."""
    _, (plan, [v]), (dplan, [dv]) = plans["qwen7b-int8"]
    assert plan.weights_bytes == 4_357_620_848 and plan.buffers_bytes == 220_135_424
    logits_start = 64 * 152064 * 2                                      # 19,464,192
    assert plan.early_bytes == 4_357_620_848 + 3_737_124_864 + logits_start + 220_135_424 + GiB == 9_408_087_152
    assert plan.kv_cache_paged_bytes == 7 * GiB and plan.kv_headroom_bytes == 835_132_530
    assert plan.late_bytes == 2 * 8192 * 152064 * 2 + 64 * NCCL_SET == 5_599_395_840
    assert plan.total_bytes == 9_408_087_152 + 7 * GiB + 5_599_395_840 == 22_523_675_760
    assert v.fits and v.margin_bytes == 24564 * 2**20 - 22_523_675_760          # 3.01 GiB free
    # the served engine: no per-step logits, the all-gather of 64 last tokens only
    assert dplan.late_bytes == 64 * NCCL_SET and dplan.reserve_bytes == 835_132_530
    assert dv.fits and dplan.total_bytes < plan.total_bytes


def test_qwen7b_fp16_on_a_4090_is_refused(plans):
    """Issue 27: 1.02 GiB free, then 3.04 GiB short; with the all-gather and the per-step buffers 7.02 GiB short,
    and the deploy engine alone 0.49 GiB short."""
    _, (plan, [v]), (dplan, [dv]) = plans["qwen7b-fp16"]
    assert not v.fits and -7.03 * GiB < v.margin_bytes < -7.01 * GiB
    assert not dv.fits and -0.50 * GiB < dv.margin_bytes < -0.48 * GiB
    kv = [s for s in v.suggestions if s.key == "kv_cache"]
    assert kv and kv[0].recipe_key == "quantize.kv_cache"


def test_vocab_is_padded_to_the_world_size_and_not_split():
    """Every last-pipeline rank holds the full padded vocabulary (the engine all-gathers lm_head's output)."""
    assert vocab_size_padded(49152, 3) == 49152 and vocab_size_padded(32001, 2) == 32002
    assert vocab_size_padded(151655, 4) == 151656 and vocab_size_padded(7, 8) == 8
    info = ModelInfo.bundled("Qwen/Qwen2-7B-Instruct")
    one = runtime_buffers(info, tp=1, pp=1, max_batch_size=4, max_beam_width=1, max_num_tokens=16,
                          gather_context_logits=False, logits_dtype="float32")
    four = runtime_buffers(info, tp=4, pp=1, max_batch_size=4, max_beam_width=1, max_num_tokens=16,
                           gather_context_logits=False, logits_dtype="float32")
    assert one[0]["bytes"] == four[0]["bytes"] == 4 * 152064 * 4 and len(one) == len(four) == 1
    beams = runtime_buffers(info, tp=1, pp=1, max_batch_size=4, max_beam_width=3, max_num_tokens=16,
                            gather_context_logits=True, logits_dtype="float16")
    assert beams[0]["rows"] == 12 and beams[0]["bytes"] == 12 * 152064 * 2 and beams[0]["when"] == STARTUP
    assert beams[1]["rows"] == 32 and beams[1]["bytes"] == 32 * 152064 * 2 and beams[1]["when"] == PER_STEP


def test_float32_logits_make_the_concatenated_logits_internal():
    """A cast to logits_dtype after the all-gather: the gathered and the concatenated [rows, V] are alive together."""
    info = ModelInfo.bundled("Qwen/Qwen2-7B-Instruct")
    f16 = plan_memory(info, tp=2, max_num_tokens=1024, gather_context_logits=True, logits_dtype="float16")
    f32 = plan_memory(info, tp=2, max_num_tokens=1024, gather_context_logits=True, logits_dtype="float32")
    assert f16.lm_head["bytes"] == 1024 * (76032 + 152064) * 2 and not f16.lm_head["cast"]
    assert f32.lm_head["bytes"] == 2 * 1024 * 152064 * 2 and f32.lm_head["cast"]
    bf16 = plan_memory(info, tp=1, dtype="bfloat16", max_num_tokens=1024, gather_context_logits=True,
                       logits_dtype="float16")
    assert bf16.lm_head["bytes"] == 1024 * 152064 * 2


def test_bad_logits_dtype_names_the_recipe_key():
    from pipeline.errors import ForgeError

    with pytest.raises(ForgeError, match="build.tensorrt_llm.logits_dtype"):
        plan_memory(ModelInfo.bundled("Qwen/Qwen2-7B-Instruct"), logits_dtype="int8")
    with pytest.raises(ForgeError, match="max_beam_width"):
        plan_memory(ModelInfo.bundled("Qwen/Qwen2-7B-Instruct"), max_beam_width=0)


def test_sources_are_cited_by_upstream_commit_and_in_the_doc():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "trtllm-memory.md").read_text()
    for path, commit in [*TRTLLM_SOURCES.values(), *NCCL_SOURCES.values()]:
        assert path in doc and commit in doc
        if not commit.startswith("index id"):
            assert len(commit) == 40 and int(commit, 16) >= 0
    for quoted in ("{numContextTokens + numGenSequences, vocabSizePadded}",
                   "numLogits = maxBatchSize * std::max(1 + maxDraftTokens, maxBeamWidth)",
                   "batchNumTokens + reqNumTokens > maxNumTokensRuntime.value()",
                   "(mVocabSize + worldSize - 1) / worldSize * worldSize",
                   "dOutput.ids->reshape(maxTotalTokensShape)", "mPenaltyWorkspaceDevice",
                   "mRuntimeLogitsDevice", "freePrimaryMemBytes = static_cast<uint64_t>(finalFreeMem * freeMemFraction)",
                   "getMaxRequiredWorkspaceSize(tpSize)", "allDecoderLogits.emplace_back(std::move(decoderLogits))",
                   "IBuffer::SharedPtr mBuffer", "x = allgather(x, self.tp_group, gather_dim=-1)",
                   "kv_cache_config.max_tokens is not effective in VSWA scheme", "mEngineBuffer = mBufferManager.gpu(",
                   'NCCL_PARAM(RuntimeConnect, "RUNTIME_CONNECT", 1)',
                   "nChannels = comm->nChannels = std::min(MAXCHANNELS,nChannels*2)",
                   'GetParameter<int32_t>("max_tokens_in_paged_kv_cache")'):
        assert quoted in doc, quoted


def test_build_plan_refuses_a_recipe_that_does_not_fit_this_machines_gpu(plans):
    """Before any GPU work: the build stage's plan problems include the memory verdict for the GPU found here."""
    from pipeline.stages.tensorrt_llm import memory_problems

    r, (plan, _), _ = plans["qwen7b-fp16"]
    [p] = memory_problems(r, plan._info, [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "sm": 89}])
    assert p.startswith("memory: one rank of the evaluation engine needs") and "rtx4090" in p
    assert "5.21 GiB allocated per step after it" in p and "KV pool capped at 524288 tokens" in p
    assert "--set quantize.kv_cache=" in p
    assert memory_problems(r, plan._info, [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "sm": 90}]) == []
    assert memory_problems(r, plan._info, []) == []                       # no GPU: nothing to refuse here
    assert memory_problems(r, plan._info, [{"index": 0, "name": "Tesla T4", "sm": 75}]) == []   # unknown GPU


def test_an_engine_that_fits_until_its_per_step_buffers_is_refused_at_plan():
    """Issue 40: qwen7b-int8 at max_batch_size 96 fits a 4090 with everything the runtime allocates before the KV
    pool and the pool's own headroom, but not the per-step context logits that come after it: refused."""
    from pipeline.recipe import resolve
    from pipeline.runner import Runner
    from pipeline.stages.tensorrt_llm import memory_problems

    r = resolve("qwen7b-int8", ["build.tensorrt_llm.max_batch_size=96", "package.triton.max_batch_size=96"])
    info = Runner(r).model_info()
    plan, [v] = plan_for_recipe(r, info, "rtx4090")
    cap = GPUS["rtx4090"].memory_bytes
    assert plan.early_bytes + plan.kv_cache_paged_bytes + plan.kv_headroom_bytes <= cap < plan.total_bytes
    assert plan.late_bytes > plan.kv_headroom_bytes and not v.fits
    [p] = memory_problems(r, info, [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "sm": 89}])
    assert "would run out of memory at run time" in p and "allocated per step" in p
    fixes = {s.key: s.value for s in v.suggestions}
    assert fixes["max_batch_size"] < 96 and fixes["max_num_tokens"] < 8192
    for key in ("max_batch_size", "max_num_tokens"):    # each fix alone fits
        assert plan_memory(info, **{**plan.args, key: fixes[key]}).total_bytes <= cap
    # the served engine (no per-step logits) fits: the package stage does not refuse it
    assert memory_problems(r, info, [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "sm": 89}], deploy=True) == []


def test_gemma3_evaluation_engine_needs_a_smaller_kv_fraction_on_a_4090(plans):
    """Two window sizes: the cap is ignored, the pool takes 0.9 of the free memory and the 4 GiB of per-step
    context logits would not fit the remaining 0.1 of a 4090; fit() proposes the fraction that leaves them room."""
    _, (plan, [v]), (dplan, [dv]) = plans["gemma3-270m-trtllm"]
    assert plan.kv_max_tokens is None and plan.late_bytes == 2 * 4096 * 262144 * 2
    assert plan.total_bytes == plan.early_bytes + math.ceil(plan.late_bytes / (1 - 0.9)) and not v.fits
    f = {s.key: s for s in v.suggestions}["kv_cache_free_gpu_mem_fraction"]
    assert f.recipe_key == "package.triton.kv_cache_free_gpu_mem_fraction" and f.value == 0.8
    lower = plan_memory(plan._info, **{**plan.args, "kv_cache_free_gpu_mem_fraction": f.value})
    assert lower.total_bytes <= v.capacity_bytes == f.total_bytes + (v.capacity_bytes - lower.total_bytes)
    above = plan_memory(plan._info, **{**plan.args, "kv_cache_free_gpu_mem_fraction": 0.85})
    assert above.total_bytes > v.capacity_bytes          # 0.8 is the largest 0.05 step that fits
    assert dv.fits and dplan.late_bytes == 0


def test_gemma3_fraction_fix_is_accepted_at_plan():
    from pipeline.recipe import resolve
    from pipeline.runner import Runner
    from pipeline.stages.tensorrt_llm import memory_problems

    gpu = [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "sm": 89}]
    r = resolve("gemma3-270m-trtllm", [])
    [p] = memory_problems(r, Runner(r).model_info(), gpu)
    assert "kv_cache_free_gpu_mem_fraction 0.9 of the free memory" in p
    assert "--set package.triton.kv_cache_free_gpu_mem_fraction=0.8" in p
    fixed = resolve("gemma3-270m-trtllm", ["package.triton.kv_cache_free_gpu_mem_fraction=0.8"])
    assert memory_problems(fixed, Runner(fixed).model_info(), gpu) == []


def test_forge_plan_exits_2_naming_the_per_step_buffers(monkeypatch, capsys):
    """`forge plan` on a machine with an RTX 4090: the recipe is refused before any stage runs (exit 2)."""
    import sys

    import pipeline.host.gpu
    from pipeline.cli import main

    monkeypatch.setattr(pipeline.host.gpu, "gpus", lambda nvml=None: [{"index": 0, "name": "NVIDIA GeForce RTX 4090",
                                                                         "sm": 89}])
    monkeypatch.setattr(sys, "argv", ["forge", "plan", "qwen7b-int8", "--set", "build.tensorrt_llm.max_batch_size=96",
                                      "--set", "package.triton.max_batch_size=96"])
    with pytest.raises(SystemExit) as e:
        main()
    out = " ".join("".join(capsys.readouterr()).split())
    assert e.value.code == 2, out
    assert "memory: one rank of the evaluation engine needs" in out and "allocated per step" in out


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


def test_nccl_buffers_grow_with_the_peers():
    info = ModelInfo.bundled("HuggingFaceTB/SmolLM2-135M-Instruct")
    for tp in (1, 3):
        bufs = {b["name"]: b for b in runtime_buffers(info, tp=tp, pp=1, max_batch_size=8, max_beam_width=1,
                                                      max_num_tokens=64, gather_context_logits=False,
                                                      logits_dtype="float16", max_seq_len=64)}
        nccl = bufs.get("NCCL connection buffers (tp > 1, upper bound)")
        assert (nccl is None) if tp == 1 else (nccl["bytes"] == 64 * 2 * 9_633_792 and nccl["when"] == PER_STEP)


def test_fit_reports_the_per_step_buffers_of_a_plan_it_refuses():
    info = ModelInfo.bundled("Qwen/Qwen2-7B-Instruct")
    p = plan_memory(info, quant_algo="int8_sq", kv_cache="int8", tp=2, max_batch_size=64, max_seq_len=8192,
                    max_num_tokens=16384, gather_context_logits=True, logits_dtype="float16", parallel_embedding=True)
    v = fit(p, GPUS["rtx4090"])
    assert not v.fits and p.late_bytes == 2 * 16384 * 152064 * 2 + 64 * NCCL_SET
    mnt = {s.key: s.value for s in v.suggestions}["max_num_tokens"]
    assert mnt < 16384 and plan_memory(info, **{**p.args, "max_num_tokens": mnt}).total_bytes <= v.capacity_bytes


def test_package_refuses_a_served_engine_that_does_not_fit(monkeypatch):
    """Stage package plans the served engine (build_deploy): qwen7b-fp16's is 0.49 GiB short of a 4090."""
    import pipeline.host.gpu
    from pipeline.recipe import resolve
    from pipeline.runner import Runner
    from pipeline.stages.tensorrt_llm import TrtllmPackage

    r = resolve("qwen7b-fp16", [])
    info = Runner(r).model_info()
    monkeypatch.setattr(pipeline.host.gpu, "gpus", lambda nvml=None: [{"index": 0, "name": "NVIDIA GeForce RTX 4090",
                                                                         "sm": 89}])
    [p] = TrtllmPackage().plan_problems(r, info)
    assert p.startswith("memory: one rank of the served engine (build_deploy) needs 24.48 GiB")
    monkeypatch.setattr(pipeline.host.gpu, "gpus", lambda nvml=None: [{"index": 0, "name": "NVIDIA H100 80GB HBM3",
                                                                         "sm": 90}])
    assert TrtllmPackage().plan_problems(r, info) == []
