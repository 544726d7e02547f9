"""GPU memory planner: what one TP/PP rank of a TensorRT-LLM engine needs, and whether it fits a GPU.

Per rank (the worst pipeline stage):

* weights, by dtype / quantization algorithm: the decoder linears are split across TP ranks (column /
  row parallel; KV heads are *duplicated* when tp > num_kv_heads); embedding and lm_head stay in the
  activation dtype (ModelOpt excludes lm_head from quantization); the embedding table is replicated on every
  rank (TensorRT-LLM's default ``use_parallel_embedding=False``) unless ``parallel_embedding`` -- then each rank
  holds ``ceil(vocab / tp)`` rows, as in every checkpoint forge writes (ModelOpt 0.47's export sets
  ``use_parallel_embedding: True``, ``embedding_sharding_dim: 0``: modelopt/torch/export/tensorrt_llm_utils.py,
  and ``plan_for_recipe`` plans it so); quantization scales are counted (per-channel
  scales, AWQ group scales and pre-quant smoothing vectors).
* KV cache = layers x kv_heads x head_dim x 2 (K and V) x tokens x bytes(kv dtype), for
  ``max_batch_size x max_seq_len`` tokens, and rounded up to whole paged blocks of ``tokens_per_block``.
* activations / workspace: one layer's live tensors for ``max_num_tokens`` packed tokens, plus a fixed
  runtime overhead (CUDA context, cuBLAS workspace, NCCL buffers when tp > 1). This is an estimate; TensorRT
  reports the exact activation size only after building the engine.
* runtime buffers the batch manager allocates that scale with the model (:func:`runtime_buffers`, each with
  its TensorRT-LLM source line; docs/trtllm-memory.md): the logits buffer, ``[max_num_tokens,
  vocabSizePadded]`` of ``logits_dtype`` when the engine gathers context logits, ``[max_batch_size x
  max_beam_width, vocabSizePadded]`` when it does not; then the decoder's buffers (output / parent ids, log
  probs, embedding bias, cache indirection, per-slot buffers), the sampling layers' workspaces (runtime logits,
  penalties, top-P sort) and, when tp > 1, the custom all-reduce workspace.
* KV pool headroom: TensorRT-LLM gives the paged KV pool ``kv_cache_free_gpu_mem_fraction`` of the memory free
  after everything above, so the worst case needs ``kv / fraction`` free, ``kv x (1 / fraction - 1)`` beyond the pool.

``fit(plan, gpu)`` compares the total with a GPU from :mod:`pipeline.gpus` and, when it does not fit,
says which ``max_batch_size`` / ``max_seq_len`` / ``max_num_tokens`` / ``kv_cache`` dtype / ``tp`` /
``quant_algo`` would.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ForgeError
from .gpus import GiB, GpuSpec
from .modelinfo import ModelInfo

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}
KV_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}

# quant_algo -> (bits per weight element of the decoder linears, description)
QUANT_ALGOS = {
    "none": (None, "unquantized (activation dtype)"),
    "fp16": (16, "fp16 weights"),
    "bf16": (16, "bf16 weights"),
    "fp32": (32, "fp32 weights"),
    "int8_sq": (8, "INT8 SmoothQuant W8A8 (per-channel weight scales, smoothing vectors)"),
    "int8_sq_per_token": (8, "INT8 SmoothQuant W8A8, per-token activation scales (TensorRT-LLM's plugin path)"),
    "int8_wo": (8, "INT8 weight-only (per-channel scales)"),
    "int4_wo": (4, "INT4 weight-only (per-channel scales)"),
    "int4_awq": (4, "INT4 AWQ (group scales, pre-quant smoothing vectors)"),
    "fp8": (8, "FP8 E4M3 (per-tensor scales)"),
}

# Where each planner argument lives in a recipe (used in suggestions so a user can --set it).
RECIPE_KEYS = {
    "max_batch_size": "build.tensorrt_llm.max_batch_size",
    "max_seq_len": "build.tensorrt_llm.max_seq_len",
    "max_num_tokens": "build.tensorrt_llm.max_num_tokens",
    "tokens_per_block": "build.tensorrt_llm.tokens_per_block",
    "kv_cache": "quantize.kv_cache",
    "tp": "build.tensorrt_llm.tp",
    "pp": "build.tensorrt_llm.pp",
    "dtype": "build.tensorrt_llm.dtype",
    "quant_algo": "quantize.algo",
    "group_size": "quantize.block_size",
    "gather_context_logits": "build.tensorrt_llm.gather_context_logits",
    "logits_dtype": "build.tensorrt_llm.logits_dtype",
    "max_beam_width": "build.tensorrt_llm.max_beam_width",
    "kv_cache_free_gpu_mem_fraction": "package.triton.kv_cache_free_gpu_mem_fraction",
}

DEFAULT_MAX_NUM_TOKENS = 8192          # trtllm-build's default
DEFAULT_RUNTIME_OVERHEAD = 1 * GiB     # CUDA context + cuBLAS/cuBLASLt workspaces (measured 0.5-1 GiB)
NCCL_OVERHEAD = GiB // 4               # NCCL buffers / all-reduce workspace per rank when tp > 1
LOGITS_BYTES = {"float16": 2, "float32": 4}

# TensorRT-LLM source the runtime-buffer sizes are read from (the 1.x batch manager; the index returned these
# commits, the 1.2.1 tag's commit could not be resolved: shared/docs/trtllm-reference.md section 0). One home:
# docs/trtllm-memory.md quotes the lines, tests/memory/test_runtime_buffers.py recomputes from them.
TRTLLM_SOURCES = {
    "runtimeBuffers": ("cpp/tensorrt_llm/batch_manager/runtimeBuffers.cpp",
                       "092a5a15d8047f16efd1aeb872cac21bb441188c"),
    "microBatchScheduler": ("cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp",
                            "0a949d3128bfaf4ddedefb0259125622a9ec830f"),
    "modelConfig": ("cpp/include/tensorrt_llm/runtime/modelConfig.h", "index id 2582916338"),
    "trtGptModelInflightBatching": ("cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp",
                                    "00825c4ee813bdc5eb2e5cf218b644b8c18ce2ec"),
    "decoderState": ("cpp/tensorrt_llm/runtime/decoderState.cpp", "00fdb650a3117b0648e4efc4db4656c794f295a0"),
    "decoderBuffers": ("cpp/tensorrt_llm/batch_manager/decoderBuffers.cpp",
                       "000a01de66f0eab4ab05640711f0253f50f5209c"),
    "decoderBuffersCacheIndir": ("cpp/tensorrt_llm/batch_manager/decoderBuffers.cpp", "index id 3621611751"),
    "decodingLayerWorkspace": ("cpp/tensorrt_llm/runtime/decodingLayerWorkspace.cpp",
                               "1a43c7d62d008ca9d1efdfd50f9180390598d314"),
    "penaltyLayer": ("cpp/tensorrt_llm/layers/penaltyLayer.cpp", "2a9abd9536aa62ad3e4b9314be9286b1b1be523b"),
    "samplingTopPKernels": ("cpp/tensorrt_llm/kernels/samplingTopPKernels.cu",
                            "14e801da3632eb71367b847e335c4f2b09098651"),
    "ipcUtils": ("cpp/tensorrt_llm/runtime/ipcUtils.cpp", "03961722f65265573cad179baca3bc5fe8c03f76"),
    "customAllReduceUtils": ("cpp/tensorrt_llm/common/customAllReduceUtils.h", "index id 4968478518"),
    "kvCacheManager": ("cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp", "index id 1277673704"),
}

IPC_ALIGN = 1 << 21            # ipcUtils.cpp IpcMemory::allocateIpcMemory: common::alignSize(bufferSize, 1LU << 21)


def _allreduce_workspace_size(tp: int) -> int:
    """``customAllReduceUtils::getMaxRequiredWorkspaceSize(worldSize)``: 16 MB for tp <= 2, else 8 MB."""
    return 16 * 1000 * 1000 if tp <= 2 else 8 * 1000 * 1000


def vocab_size_padded(vocab: int, world_size: int) -> int:
    """``ModelConfig::getVocabSizePadded(worldSize)``: ``(vocab + worldSize - 1) / worldSize * worldSize``."""
    return (vocab + world_size - 1) // world_size * world_size


def runtime_buffers(info: ModelInfo, *, tp: int, pp: int, max_batch_size: int, max_beam_width: int,
                    max_num_tokens: int, gather_context_logits: bool, logits_dtype: str,
                    max_seq_len: int | None = None) -> list[dict]:
    """The batch manager's buffers that scale with the model, on the rank that holds them (the last pipeline
    rank for logits and the decoder), each with the source line its size comes from. The first entry is the
    logits buffer; with ``max_seq_len`` the decoder / sampling / all-reduce buffers follow (docs/trtllm-memory.md
    lists each with its formula and commit)."""
    if logits_dtype not in LOGITS_BYTES:
        raise ForgeError(f"unknown logits_dtype {logits_dtype!r} (recipe key build.tensorrt_llm.logits_dtype): "
                         f"valid values are float16, float32")
    vp = vocab_size_padded(info.vocab_size, tp * pp)
    lb = LOGITS_BYTES[logits_dtype]
    if gather_context_logits:
        # RuntimeBuffers::reshape re-allocates `logits` as [numContextTokens + numGenSequences, vocabSizePadded]
        # when computeContextLogits(); the MicroBatchScheduler keeps batchNumTokens (context chunk tokens +
        # generation tokens) <= maxNumTokens, so max_num_tokens rows is the largest it gets.
        rows, shape = max_num_tokens, "[max_num_tokens, vocabSizePadded]"
        src = ("runtimeBuffers.cpp RuntimeBuffers::reshape: logits = manager.gpu(ITensor::makeShape("
               "{numContextTokens + numGenSequences, vocabSizePadded}), logitsType); microBatchScheduler.cpp: "
               "batchNumTokens + reqNumTokens > maxNumTokensRuntime -> break")
    else:
        # RuntimeBuffers::setMaxBufferSizes: numLogits = maxBatchSize * max(1 + maxDraftTokens, maxBeamWidth)
        rows, shape = max_batch_size * max_beam_width, "[max_batch_size x max_beam_width, vocabSizePadded]"
        src = ("runtimeBuffers.cpp RuntimeBuffers::setMaxBufferSizes: numLogits = maxBatchSize * "
               "std::max(1 + maxDraftTokens, maxBeamWidth); reshape: logits->reshape({numLogits, vocabSizePadded})")
    out = [{"name": "logits" + (" (context, gathered)" if gather_context_logits else " (last token)"),
            "shape": shape, "rows": rows, "vocab_size_padded": vp, "dtype": logits_dtype,
            "bytes": rows * vp * lb, "source": src}]
    if max_seq_len is None:
        return out
    mbs, bw, sl = max_batch_size, max_beam_width, max_seq_len
    # maxAttentionWindow = the largest layer window = max_seq_len (forge sets per-layer windows <= max_seq_len)

    def add(name, shape, dtype, nbytes, key, ident):
        path, commit = TRTLLM_SOURCES[key]
        out.append({"name": name, "shape": shape, "dtype": dtype, "bytes": nbytes,
                    "source": f"{path} @ {commit}: {ident}"})

    # DecoderState::reshapeBuffers: dOutput.ids / parentIds / logProbs -> maxTotalTokensShape
    # {maxBatchSize, maxBeamWidth, maxSequenceLength}; logProbsTiled {maxSequenceLength, maxBatchSize, maxBeamWidth}
    add("decoder output ids", "[max_batch_size, max_beam_width, max_seq_len]", "int32", mbs * bw * sl * 4,
        "decoderState", "DecoderState::reshapeBuffers dOutput.ids->reshape(maxTotalTokensShape)")
    add("decoder parent ids", "[max_batch_size, max_beam_width, max_seq_len]", "int32", mbs * bw * sl * 4,
        "decoderState", "DecoderState::reshapeBuffers dOutput.parentIds->reshape(maxTotalTokensShape)")
    add("decoder log probs", "[max_batch_size, max_beam_width, max_seq_len]", "float32", mbs * bw * sl * 4,
        "decoderState", "DecoderState::reshapeBuffers dOutput.logProbs->reshape(maxTotalTokensShape)")
    add("decoder log probs (tiled)", "[max_seq_len, max_batch_size, max_beam_width]", "float32", mbs * bw * sl * 4,
        "decoderState", "DecoderState::reshapeBuffers dOutput.logProbsTiled->reshape({mMaxSequenceLength, ...})")
    if bw > 1:   # with beam width 1 gatheredIds is ids (no allocation)
        add("decoder gathered ids", "[max_batch_size, max_beam_width, max_seq_len]", "int32", mbs * bw * sl * 4,
            "decoderState", "DecoderState::reshapeBuffers dOutput.gatheredIds->reshape(maxTotalTokensShape)")
    # DecoderState::reshapeBuffers: dInput.embeddingBias {mMaxBatchSize, vocabSizePadded} of the decoder (logits) type
    add("decoder embedding bias", "[max_batch_size, vocabSizePadded]", logits_dtype, mbs * vp * lb,
        "decoderState", "DecoderState::reshapeBuffers dInput.embeddingBias.reshape({mMaxBatchSize, vocabSizePadded})")
    # DecoderBuffers: cacheIndirectionInput / Output = manager.gpu({maxNumSequences, maxBeamWidth,
    # maxAttentionWindow}, kINT32), both allocated whatever the beam width
    add("cache indirection (input + output)", "2 x [max_batch_size, max_beam_width, max_seq_len]", "int32",
        2 * mbs * bw * sl * 4, "decoderBuffersCacheIndir",
        "DecoderBuffers::DecoderBuffers cacheIndirectionInput/cacheIndirectionOutput = manager.gpu("
        "{maxNumSequences, maxBeamWidth, maxAttentionWindow}, kINT32)")
    # SlotDecoderBuffers(maxBeamWidth, maxSeqLen): outputIds int32 + logProbs float {maxBeamWidth, maxSeqLen} on
    # the GPU, one per sequence slot (TrtGptModelInflightBatching::createBuffers loops getMaxNumSequences())
    add("slot decoder buffers (output ids + log probs)", "max_batch_size x 2 x [max_beam_width, max_seq_len]",
        "int32/float32", mbs * bw * sl * (4 + 4), "decoderBuffers",
        "SlotDecoderBuffers::SlotDecoderBuffers outputIds / logProbs = manager.gpu({maxBeamWidth, maxSeqLen}); "
        "trtGptModelInflightBatching.cpp createBuffers: for i < getMaxNumSequences() mSlotDecoderBuffers.emplace_back")
    # DecodingLayerWorkspace: mRuntimeLogitsDevice {batch, maxDecodingTokens (1), beam, vocabSizePadded} logitsType
    add("decoding workspace runtime logits", "[max_batch_size, 1, max_beam_width, vocabSizePadded]", logits_dtype,
        mbs * bw * vp * lb, "decodingLayerWorkspace",
        "DecodingLayerWorkspace::DecodingLayerWorkspace mRuntimeLogitsDevice")
    # PenaltyLayer::allocateWorkspace (TopKTopP / BeamSearch modes carry kUsePenalties): batch x maxDecodingTokens
    # x beam x vocabSize int32, and a second one (mPenaltyWorkspacePrevDevice) for beam search
    add("penalty workspace", f"{'2 x ' if bw > 1 else ''}[max_batch_size, 1, max_beam_width, vocab]", "int32",
        (2 if bw > 1 else 1) * mbs * bw * info.vocab_size * 4, "penaltyLayer",
        "PenaltyLayer<T>::allocateWorkspace mPenaltyWorkspaceDevice = gpu(batch * maxDecodingTokens * beam * vocab, "
        "kINT32)")
    if bw == 1:
        # getTopPWorkspaceSizes<T>: sortedLogProbBufSize = sizeof(T) * batch * vocab, sortedIdValsBufSize =
        # sizeof(int32_t) * batch * vocab (cub's own temp storage is queried at runtime: not counted)
        add("top-P sampling workspace (sorted logits + ids)", "[max_batch_size, vocabSizePadded] x 2", f"{logits_dtype}/int32",
            mbs * vp * (lb + 4), "samplingTopPKernels",
            "getTopPWorkspaceSizes<T>: sortedLogProbBufSize + sortedIdValsBufSize")
    if tp > 1:
        # AllReduceBuffers: bufferSize = tp * min(mbs * beam * seqLen * hidden * sizeof(float),
        # getMaxRequiredWorkspaceSize(tp)), two of them, each IPC allocation aligned to 2 MiB (allocated only
        # where cudaDeviceCanAccessPeer: counted as the upper bound)
        one = tp * min(mbs * bw * sl * info.hidden_size * 4, _allreduce_workspace_size(tp))
        add("custom all-reduce workspace", "2 x [tp x min(mbs*beam*seq*hidden*4, 16e6 or 8e6)]",
            "uint8", 2 * (-(-one // IPC_ALIGN) * IPC_ALIGN), "ipcUtils",
            "AllReduceBuffers::AllReduceBuffers bufferSize = tpSize * std::min(..., getMaxRequiredWorkspaceSize("
            "tpSize)); IpcMemory::allocateIpcMemory alignSize(bufferSize, 1LU << 21)")
    return out


@dataclass
class MemoryPlan:
    model: dict[str, Any]
    args: dict[str, Any]                    # the arguments plan_memory was called with (normalised)
    layers_per_rank: int
    kv_heads_per_rank: int
    weights: dict[str, dict[str, Any]]      # part -> {"dtype": str, "bytes": int, "params": int}
    weights_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int                     # max_batch_size x max_seq_len tokens, contiguous
    kv_block_bytes: int
    kv_blocks: int
    kv_cache_paged_bytes: int               # whole blocks of tokens_per_block
    activation_bytes: int
    logits_bytes: int                       # runtime_buffers[0], the logits buffer
    runtime_bytes: int
    total_bytes: int
    notes: list[str] = field(default_factory=list)
    runtime_buffers: list[dict] = field(default_factory=list)
    buffers_bytes: int = 0                  # runtime_buffers other than logits (decoder, sampling, all-reduce)
    kv_headroom_bytes: int = 0              # free memory the KV manager leaves unallotted (1 - fraction)
    _info: ModelInfo | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("_info", None)
        return d


@dataclass
class Suggestion:
    key: str              # planner argument (see RECIPE_KEYS for the recipe key)
    value: Any
    total_bytes: int
    note: str

    @property
    def recipe_key(self) -> str:
        return RECIPE_KEYS.get(self.key, self.key)


@dataclass
class FitVerdict:
    gpu: str
    capacity_bytes: int
    needed_bytes: int
    fits: bool
    margin_bytes: int
    problems: list[str]
    suggestions: list[Suggestion]
    max_batch_size_that_fits: int

    def to_dict(self) -> dict:
        d = asdict(self)
        for s, so in zip(d["suggestions"], self.suggestions):
            s["recipe_key"] = so.recipe_key
        return d


def _norm_quant(q: str | None) -> str:
    q = (q or "none").lower()
    if q not in QUANT_ALGOS:
        raise ForgeError(f"unknown quant_algo {q!r} (recipe key {RECIPE_KEYS['quant_algo']}): "
                         f"valid values are {', '.join(QUANT_ALGOS)}")
    return q


def _kv_heads_per_rank(info: ModelInfo, tp: int) -> int:
    kvh = info.num_kv_heads
    if kvh % tp == 0:
        return kvh // tp
    if tp % kvh == 0:
        return 1          # TensorRT-LLM duplicates KV heads so every rank has one
    raise ForgeError(f"tp={tp} (recipe key {RECIPE_KEYS['tp']}) does not divide num_kv_heads={kvh} and is not a "
                     f"multiple of it; use a tp that divides {kvh} or a multiple of {kvh}")


def _linear_bytes(quant: str, in_f: int, out_f: int, act_bytes: int, group_size: int,
                  row: bool = False) -> tuple[int, int]:
    """(weight bytes, scale bytes) of one linear layer [out_f x in_f] under ``quant``; ``row``: row-parallel
    (attention dense, MLP down)."""
    n = in_f * out_f
    if quant == "none":
        return n * act_bytes, 0
    if quant in ("fp16", "bf16"):
        return n * 2, 0
    if quant == "fp32":
        return n * 4, 0
    if quant == "int8_sq":   # fp32 per-channel weight scale, fp32 activation scale, fp16 smoothing vector
        return n, out_f * 4 + 4 + in_f * 2
    if quant == "int8_sq_per_token":
        # fp32 per_channel_scale (1, out); fp32 smoother (1, in) on the row linears (pipeline/trtllm/sq_per_token.py)
        return n, out_f * 4 + (in_f * 4 if row else 0)
    if quant == "int8_wo":
        return n, out_f * act_bytes
    if quant == "int4_wo":
        return (n + 1) // 2, out_f * act_bytes
    if quant == "int4_awq":
        if in_f % group_size:
            raise ForgeError(f"int4_awq group size {group_size} (recipe key {RECIPE_KEYS['group_size']}) does not "
                             f"divide a linear input width {in_f}; pick a group size that divides it (e.g. 64 or 128)")
        return (n + 1) // 2, (in_f // group_size) * out_f * act_bytes + in_f * act_bytes
    if quant == "fp8":
        return n, 8
    raise AssertionError(quant)


def plan_memory(info: ModelInfo, *, quant_algo: str = "none", kv_cache: str | None = None,
                dtype: str = "float16", tp: int = 1, pp: int = 1, max_batch_size: int = 8,
                max_seq_len: int = 4096, max_num_tokens: int | None = None, tokens_per_block: int = 32,
                group_size: int = 128, runtime_overhead: int = DEFAULT_RUNTIME_OVERHEAD,
                parallel_embedding: bool = False, gather_context_logits: bool = False,
                logits_dtype: str = "float32", max_beam_width: int = 1,
                kv_cache_free_gpu_mem_fraction: float = 0.9) -> MemoryPlan:
    """Bytes one rank needs; see the module docstring for what is counted."""
    quant = _norm_quant(quant_algo)
    if dtype not in DTYPE_BYTES:
        raise ForgeError(f"unknown dtype {dtype!r} (recipe key {RECIPE_KEYS['dtype']}): valid values are float16, "
                         f"bfloat16, float32")
    act = DTYPE_BYTES[dtype]
    kv_name = dtype if kv_cache in (None, "none", "") else kv_cache.lower()
    if kv_name not in KV_BYTES:
        raise ForgeError(f"unknown kv_cache dtype {kv_cache!r} (recipe key {RECIPE_KEYS['kv_cache']}): "
                         f"valid values are fp16, bf16, fp32, int8, fp8")
    kvb = KV_BYTES[kv_name]
    for k, v in (("tp", tp), ("pp", pp), ("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                 ("tokens_per_block", tokens_per_block), ("max_beam_width", max_beam_width)):
        if int(v) < 1:
            raise ForgeError(f"{k} must be >= 1 (recipe key {RECIPE_KEYS.get(k, k)}), got {v}")
    try:
        frac = float(kv_cache_free_gpu_mem_fraction)
    except (TypeError, ValueError):
        frac = -1.0
    if not 0 < frac < 1:
        raise ForgeError(f"kv_cache_free_gpu_mem_fraction must be strictly between 0 and 1 (recipe key "
                         f"{RECIPE_KEYS['kv_cache_free_gpu_mem_fraction']}), got {kv_cache_free_gpu_mem_fraction!r}")
    if info.num_heads % tp:
        raise ForgeError(f"tp={tp} (recipe key {RECIPE_KEYS['tp']}) must divide num_attention_heads="
                         f"{info.num_heads}")
    if info.intermediate_size % tp:
        raise ForgeError(f"tp={tp} must divide intermediate_size={info.intermediate_size}")
    if pp > info.num_layers:
        raise ForgeError(f"pp={pp} (recipe key {RECIPE_KEYS['pp']}) exceeds num_layers={info.num_layers}")
    mnt_default = max_num_tokens is None
    if max_num_tokens is None:
        max_num_tokens = min(DEFAULT_MAX_NUM_TOKENS, max_batch_size * max_seq_len)

    h, hd, i_sz = info.hidden_size, info.head_dim, info.intermediate_size
    q_heads = info.num_heads // tp
    kvr = _kv_heads_per_rank(info, tp)
    layers = math.ceil(info.num_layers / pp)
    i_r = i_sz // tp

    linears = [(h, (q_heads + 2 * kvr) * hd, False),   # fused QKV (column parallel)
               (q_heads * hd, h, True),                # attention dense (row parallel)
               (h, i_r, False), (h, i_r, False),       # gate, up (column parallel)
               (i_r, h, True)]                         # down (row parallel)
    w_lin = s_lin = p_lin = 0
    for in_f, out_f, row in linears:
        wb, sb = _linear_bytes(quant, in_f, out_f, act, group_size, row)
        w_lin += wb
        s_lin += sb
        p_lin += in_f * out_f
    w_lin, s_lin, p_lin = w_lin * layers, s_lin * layers, p_lin * layers
    bias_params = ((q_heads + 2 * kvr) * hd if info.attention_bias else 0)
    # Gemma 3: 4 norms per layer; Qwen3 / Gemma 3: per-head q/k norms (head_dim each)
    norm_params = (info.norms_per_layer * h + (2 * hd if info.qk_norm else 0) + bias_params
                   + (2 if quant == "int8_sq_per_token" else 0)) * layers     # + the two norms' scale_to_int
    emb_params = (math.ceil(info.vocab_size / tp) if parallel_embedding else info.vocab_size) * h
    head_params = math.ceil(info.vocab_size / tp) * h

    lin_dtype = {"none": dtype, "int8_sq": "int8", "int8_sq_per_token": "int8", "int8_wo": "int8", "int4_wo": "int4", "int4_awq": "int4",
                 "fp8": "fp8"}.get(quant, quant)
    scale_dtype = "fp32/" + dtype if quant == "int8_sq" else "fp32" if quant == "int8_sq_per_token" else ("fp32" if quant == "fp8" else dtype)
    # Worst pipeline stage: with pp == 1 one rank holds both; with pp > 1 the first stage holds the
    # embedding and the last stage lm_head + final norm; report the larger.
    if pp == 1:
        emb_b, head_b = emb_params * act, head_params * act + h * act
    else:
        emb_b, head_b = (emb_params * act, 0) if emb_params > head_params + h else (0, head_params * act + h * act)
    weights = {
        "decoder linears": {"dtype": lin_dtype, "bytes": w_lin, "params": p_lin},
        "quant scales": {"dtype": scale_dtype, "bytes": s_lin, "params": 0},
        "norms/bias": {"dtype": dtype, "bytes": norm_params * act, "params": norm_params},
        "embedding": {"dtype": dtype, "bytes": emb_b, "params": emb_params if emb_b else 0},
        "lm_head": {"dtype": dtype, "bytes": head_b, "params": head_params if head_b else 0},
    }
    weights = {k: v for k, v in weights.items() if v["bytes"]}
    weights_bytes = sum(v["bytes"] for v in weights.values())

    kv_per_token = layers * kvr * hd * 2 * kvb
    kv_tokens = max_batch_size * max_seq_len
    blocks_per_seq = math.ceil(max_seq_len / tokens_per_block)
    kv_blocks = max_batch_size * blocks_per_seq
    kv_block_bytes = kv_per_token * tokens_per_block
    kv_contig = kv_per_token * kv_tokens
    kv_paged = kv_block_bytes * kv_blocks
    n_slide = info.sliding_layers_in(layers)
    win = info.sliding_window
    if n_slide and win and win < max_seq_len:
        # A sliding-window layer keeps only the last `window` tokens: forge sets the runtime's per-layer
        # max_attention_window_size (TensorRT-LLM's variable sliding-window KV cache; families.attention_windows).
        per_layer = kvr * hd * 2 * kvb
        win_blocks = math.ceil(win / tokens_per_block)
        kv_contig = per_layer * max_batch_size * ((layers - n_slide) * max_seq_len + n_slide * win)
        kv_paged = per_layer * tokens_per_block * max_batch_size * ((layers - n_slide) * blocks_per_seq
                                                                    + n_slide * win_blocks)

    per_token_act = (2 * h + (q_heads + 2 * kvr) * hd + q_heads * hd + 3 * i_r) * act
    activation = per_token_act * max_num_tokens
    buffers = runtime_buffers(info, tp=tp, pp=pp, max_batch_size=max_batch_size, max_beam_width=max_beam_width,
                              max_num_tokens=max_num_tokens, gather_context_logits=gather_context_logits,
                              logits_dtype=logits_dtype, max_seq_len=max_seq_len)
    logits = buffers[0]["bytes"]
    others = sum(b["bytes"] for b in buffers[1:])
    # BaseKVCacheManager::calculateFreeMemBytes (kvCacheManager.cpp): freePrimaryMemBytes = finalFreeMem *
    # freeMemFraction, measured after the engine, runtime buffers and decoder are allocated
    # (TrtGptModelInflightBatching ctor: createBuffers, createDecoder, then calculateFreeMemBytes): the pool holds
    # the worst case only when free >= kv / fraction, i.e. kv * (1 / fraction - 1) more stays unallotted.
    headroom = math.ceil(kv_paged / frac) - kv_paged
    runtime = runtime_overhead + (NCCL_OVERHEAD if tp > 1 else 0)
    total = weights_bytes + kv_paged + headroom + activation + logits + others + runtime

    notes = []
    if tp > info.num_kv_heads:
        notes.append(f"tp={tp} > num_kv_heads={info.num_kv_heads}: KV heads are duplicated, each rank holds 1 "
                     f"KV head (the KV cache does not shrink with tp beyond {info.num_kv_heads})")
    if n_slide and win and win < max_seq_len:
        notes.append(f"{n_slide} of {layers} layers use a {win}-token sliding window: their KV cache holds {win} "
                     f"tokens per sequence (forge sets max_attention_window_size per layer in the Triton "
                     f"repository and the evaluate runtime)")
    if parallel_embedding and tp > 1:
        notes.append(f"embedding split over the {tp} TP ranks (use_parallel_embedding, as forge's checkpoints set "
                     f"it): {math.ceil(info.vocab_size / tp)} rows each")
    if info.tie_word_embeddings:
        notes.append("tied embeddings: the engine stores lm_head separately from the embedding table")
    if gather_context_logits:
        notes.append(f"the engine gathers context logits (--gather_context_logits): the runtime's logits buffer is "
                     f"{max_num_tokens} x {buffers[0]['vocab_size_padded']} {logits_dtype} = "
                     f"{logits / GiB:.2f} GiB; the deploy engine, built without it, needs "
                     f"{max_batch_size * max_beam_width} rows")
    if mnt_default:
        notes.append(f"max_num_tokens not set: using min({DEFAULT_MAX_NUM_TOKENS}, max_batch_size x max_seq_len)"
                     f" = {max_num_tokens}")
    notes.append(f"TensorRT-LLM sizes the paged KV pool as kv_cache_free_gpu_mem_fraction ({frac}) of the memory "
                 f"free after the engine and runtime buffers: the configured worst case needs "
                 f"{headroom / GiB:.2f} GiB more free memory than the pool itself")
    args = dict(quant_algo=quant, kv_cache=kv_name, dtype=dtype, tp=tp, pp=pp, max_batch_size=max_batch_size,
                max_seq_len=max_seq_len, max_num_tokens=None if mnt_default else max_num_tokens,
                tokens_per_block=tokens_per_block, group_size=group_size, runtime_overhead=runtime_overhead,
                parallel_embedding=parallel_embedding, gather_context_logits=gather_context_logits,
                logits_dtype=logits_dtype, max_beam_width=max_beam_width,
                kv_cache_free_gpu_mem_fraction=frac)
    model = {"architecture": info.architecture, "num_layers": info.num_layers, "hidden_size": h,
             "num_heads": info.num_heads, "num_kv_heads": info.num_kv_heads, "head_dim": hd,
             "intermediate_size": i_sz, "vocab_size": info.vocab_size, "num_params": info.num_params,
             "max_num_tokens_used": max_num_tokens}
    return MemoryPlan(model=model, args=args, layers_per_rank=layers, kv_heads_per_rank=kvr, weights=weights,
                      weights_bytes=weights_bytes, kv_bytes_per_token=kv_per_token, kv_cache_bytes=kv_contig,
                      kv_block_bytes=kv_block_bytes, kv_blocks=kv_blocks, kv_cache_paged_bytes=kv_paged,
                      activation_bytes=activation, logits_bytes=logits, runtime_bytes=runtime, total_bytes=total,
                      notes=notes, runtime_buffers=buffers, buffers_bytes=others, kv_headroom_bytes=headroom,
                      _info=info)


def _replan(plan: MemoryPlan, **changes) -> MemoryPlan | None:
    try:
        return plan_memory(plan._info, **{**plan.args, **changes})
    except ForgeError:
        return None


def _largest(lo: int, hi: int, ok) -> int | None:
    """Largest v in [lo, hi] with ok(v) true (ok monotone: true then false), or None."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _hw_problems(plan: MemoryPlan, gpu: GpuSpec) -> list[str]:
    probs = []
    sm = f"SM {gpu.sm[0]}.{gpu.sm[1]}"
    if plan.args["quant_algo"] == "fp8" and not gpu.has_fp8:
        probs.append(f"{gpu.name} ({sm}) has no FP8 tensor cores: set {RECIPE_KEYS['quant_algo']} to "
                     f"int8_sq_per_token or int4_awq")
    if plan.args["kv_cache"] == "fp8" and not gpu.has_fp8:
        probs.append(f"{gpu.name} ({sm}) has no FP8: set {RECIPE_KEYS['kv_cache']}=int8")
    if plan.args["dtype"] in ("bfloat16", "bf16") and gpu.sm < (8, 0):
        probs.append(f"{gpu.name} ({sm}) has no bf16: use float16")
    return probs


def fit(plan: MemoryPlan, gpu: GpuSpec, *, max_tp: int = 8) -> FitVerdict:
    """Does one rank of ``plan`` fit ``gpu``? When not, which settings would (each changed alone)."""
    cap = gpu.memory_bytes
    probs = _hw_problems(plan, gpu)
    fits_mem = plan.total_bytes <= cap
    a = plan.args

    def fits_with(**ch) -> MemoryPlan | None:
        p = _replan(plan, **ch)
        return p if p is not None and p.total_bytes <= cap else None

    mb = _largest(1, 1 << 16, lambda b: fits_with(max_batch_size=b) is not None) or 0
    sugg: list[Suggestion] = []
    if not fits_mem:
        over = plan.total_bytes - cap
        if 0 < mb < a["max_batch_size"]:
            p = fits_with(max_batch_size=mb)
            sugg.append(Suggestion("max_batch_size", mb, p.total_bytes,
                                   f"largest batch of {a['max_seq_len']}-token sequences that fits"))
        tpb = a["tokens_per_block"]
        sl = _largest(1, a["max_seq_len"] // tpb, lambda n: fits_with(max_seq_len=n * tpb) is not None)
        if sl and sl * tpb < a["max_seq_len"]:
            p = fits_with(max_seq_len=sl * tpb)
            sugg.append(Suggestion("max_seq_len", sl * tpb, p.total_bytes,
                                   f"longest sequence at batch {a['max_batch_size']}"))
        if KV_BYTES[a["kv_cache"]] > 1:
            kvd = "fp8" if gpu.has_fp8 else "int8"
            p = _replan(plan, kv_cache=kvd)
            if p is not None:
                ok = p.total_bytes <= cap
                sugg.append(Suggestion("kv_cache", kvd, p.total_bytes,
                                       ("halves the KV cache" if ok else "halves the KV cache, not enough alone")
                                       + ("" if gpu.has_fp8 else f" ({gpu.name} has no FP8)")))
        mnt_used = plan.model["max_num_tokens_used"]
        if plan.activation_bytes + (plan.logits_bytes if a["gather_context_logits"] else 0) > 0.02 * cap:
            n = _largest(1, mnt_used // 256, lambda k: fits_with(max_num_tokens=k * 256) is not None)
            if n and n * 256 < mnt_used:
                p = fits_with(max_num_tokens=n * 256)
                sugg.append(Suggestion("max_num_tokens", n * 256, p.total_bytes,
                                       "fewer packed tokens per step: smaller activation (and gathered "
                                       "context-logits) buffers, slower prefill"))
        for t in (2, 4, 8):
            if a["tp"] < t <= max_tp:
                p = fits_with(tp=t)
                if p is not None:
                    sugg.append(Suggestion("tp", t, p.total_bytes, f"split over {t} x {gpu.name}"))
                    break
        order = ["none", "int8_sq", "int8_wo", "int4_awq"]
        cur = a["quant_algo"]
        cur_bits = QUANT_ALGOS[cur][0] or DTYPE_BYTES[a["dtype"]] * 8
        for q in order:
            qb = QUANT_ALGOS[q][0] or DTYPE_BYTES[a["dtype"]] * 8
            if qb < cur_bits:
                p = fits_with(quant_algo=q)
                if p is not None:
                    sugg.append(Suggestion("quant_algo", q, p.total_bytes, QUANT_ALGOS[q][1]))
                    break
        if not sugg:
            sugg.append(Suggestion("tp", None, plan.total_bytes,
                                   f"needs {over / GiB:.1f} GiB more than {gpu.name} has even with changes tried; "
                                   f"use a larger GPU or more GPUs (tp/pp)"))
    return FitVerdict(gpu=gpu.name, capacity_bytes=cap, needed_bytes=plan.total_bytes, fits=fits_mem and not probs,
                      margin_bytes=cap - plan.total_bytes, problems=probs, suggestions=sugg,
                      max_batch_size_that_fits=mb)


_DECODER_LINEAR = re.compile(r"transformer\.layers\.\d+\.(attention\.(qkv|dense)|mlp\.(fc|gate|proj))\.weight$")
ST_BYTES = {"I8": 1, "U8": 1, "F8_E4M3": 1, "F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}


def weight_part(name: str) -> str:
    """The :attr:`MemoryPlan.weights` part a TensorRT-LLM checkpoint tensor counts in."""
    if "vocab_embedding" in name:
        return "embedding"
    if name.startswith("lm_head") or "ln_f" in name:         # the plan counts ln_f with lm_head
        return "lm_head"
    if _DECODER_LINEAR.search(name):
        return "decoder linears"
    if "layernorm" in name or name.endswith(".bias"):
        return "norms/bias"
    return "quant scales"                                     # weight / activation / prequant / kv-cache scales


def rank_weight_bytes(ckpt_dir, rank: int) -> dict[str, int]:
    """Bytes of one ``rank{N}.safetensors`` of a TensorRT-LLM checkpoint, by :attr:`MemoryPlan.weights` part
    (read from the file header only): what the plan predicts for that rank, measured."""
    from pathlib import Path

    from safetensors import safe_open

    parts: dict[str, int] = {}
    with safe_open(str(Path(ckpt_dir) / f"rank{rank}.safetensors"), framework="pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            part = weight_part(name)
            parts[part] = parts.get(part, 0) + math.prod(sl.get_shape()) * ST_BYTES[sl.get_dtype()]
    return parts


def plan_for_recipe(recipe, info: ModelInfo, gpu: str | None = None) -> tuple[MemoryPlan, list[FitVerdict]]:
    """Plan from a resolved recipe's quantize + build.tensorrt_llm sections; verdict for ``gpu`` (a name from
    :mod:`pipeline.gpus`) or, when None, for every GPU in the table."""
    from .gpus import GPUS, get_gpu

    q, b = recipe.quantize, recipe.build.tensorrt_llm
    algo = "none" if q.method == "none" else q.algo
    if algo == "int8":                 # the onnxruntime target's name; same bytes as int8_sq / int8_wo
        algo = "int8_sq"
    plan = plan_memory(info, quant_algo=algo, kv_cache=q.kv_cache, dtype=b.dtype, tp=b.tp, pp=b.pp,
                       max_batch_size=b.max_batch_size, max_seq_len=b.max_seq_len, max_num_tokens=b.max_num_tokens,
                       tokens_per_block=b.tokens_per_block if b.kv_cache_type == "paged" else 1,
                       group_size=q.block_size or 128, max_beam_width=b.max_beam_width,
                       parallel_embedding=True,   # what forge's checkpoint stage writes (module docstring)
                       gather_context_logits=b.gather_context_logits, logits_dtype=b.logits_dtype,
                       kv_cache_free_gpu_mem_fraction=recipe.package.triton.kv_cache_free_gpu_mem_fraction)
    gpus = [get_gpu(gpu)] if gpu else list(GPUS.values())
    return plan, [fit(plan, g) for g in gpus]


def _gib(b: int) -> str:
    return f"{b / GiB:,.2f} GiB"


def render_memory(plan: MemoryPlan, verdicts: list[FitVerdict], console) -> None:
    """Rich tables: per-rank breakdown, then one verdict (with suggestions) per GPU."""
    from rich.markup import escape
    from rich.table import Table

    a = plan.args
    title = (f"Memory per rank — {plan.model['architecture']} quant={a['quant_algo']} kv={a['kv_cache']} "
             f"dtype={a['dtype']} tp={a['tp']} pp={a['pp']} batch={a['max_batch_size']} "
             f"seq={a['max_seq_len']} max_num_tokens={plan.model['max_num_tokens_used']}")
    t = Table(title=title, show_lines=False)
    t.add_column("part")
    t.add_column("dtype")
    t.add_column("bytes", justify="right")
    t.add_column("GiB", justify="right")
    for name, w in plan.weights.items():
        t.add_row(f"weights: {name}", w["dtype"], f"{w['bytes']:,}", f"{w['bytes'] / GiB:.2f}")
    t.add_row("[bold]weights total", "", f"{plan.weights_bytes:,}", f"{plan.weights_bytes / GiB:.2f}")
    t.add_row(f"KV cache ({a['max_batch_size']} x {a['max_seq_len']} tokens, "
              f"{plan.kv_bytes_per_token:,} B/token)", a["kv_cache"], f"{plan.kv_cache_bytes:,}",
              f"{plan.kv_cache_bytes / GiB:.2f}")
    t.add_row(f"KV cache paged ({plan.kv_blocks:,} blocks x {a['tokens_per_block']} tokens)", a["kv_cache"],
              f"{plan.kv_cache_paged_bytes:,}", f"{plan.kv_cache_paged_bytes / GiB:.2f}")
    t.add_row(f"KV pool headroom (1 - kv_cache_free_gpu_mem_fraction {a['kv_cache_free_gpu_mem_fraction']})",
              "", f"{plan.kv_headroom_bytes:,}", f"{plan.kv_headroom_bytes / GiB:.2f}")
    t.add_row(f"activations (estimate, {plan.model['max_num_tokens_used']} tokens)", a["dtype"],
              f"{plan.activation_bytes:,}", f"{plan.activation_bytes / GiB:.2f}")
    for rb in plan.runtime_buffers:
        t.add_row(escape(f"runtime buffer: {rb['name']} {rb['shape']}"), rb["dtype"], f"{rb['bytes']:,}",
                  f"{rb['bytes'] / GiB:.2f}")
    t.add_row("runtime (CUDA context, cuBLAS, NCCL)", "", f"{plan.runtime_bytes:,}",
              f"{plan.runtime_bytes / GiB:.2f}")
    t.add_row("[bold]total per rank", "", f"{plan.total_bytes:,}", f"[bold]{plan.total_bytes / GiB:.2f}")
    console.print(t)
    for n in plan.notes:
        console.print(f"  [dim]note: {n}[/dim]")
    for v in verdicts:
        head = "[green]FITS[/green]" if v.fits else "[red]DOES NOT FIT[/red]"
        ranks = a["tp"] * a["pp"]
        where = f" per GPU, {ranks} x {v.gpu} (tp={a['tp']} pp={a['pp']})" if ranks > 1 else ""
        console.print(f"{v.gpu}: {head}{where} — needs {_gib(v.needed_bytes)} of {_gib(v.capacity_bytes)} "
                      f"({'free' if v.margin_bytes >= 0 else 'short'} {_gib(abs(v.margin_bytes))}); "
                      f"largest max_batch_size at seq {a['max_seq_len']}: {v.max_batch_size_that_fits}")
        for p in v.problems:
            console.print(f"  [red]problem:[/red] {p}")
        for s in v.suggestions:
            if s.value is None:
                console.print(f"  [yellow]fix:[/yellow] {s.note}")
            else:
                console.print(f"  [yellow]fix:[/yellow] --set {s.recipe_key}={s.value} -> {_gib(s.total_bytes)} "
                              f"({s.note})")
