"""GPU memory planner: what one TP/PP rank of a TensorRT-LLM engine needs, and whether it fits a GPU.

Per rank (the worst pipeline stage), in the order TensorRT-LLM 1.2's executor allocates it
(docs/trtllm-memory.md lists every term with its formula and upstream source):

* weights, by dtype / quantization algorithm: the decoder linears are split across TP ranks (column /
  row parallel; KV heads are *duplicated* when tp > num_kv_heads); embedding and lm_head stay in the
  activation dtype (ModelOpt excludes lm_head from quantization); the embedding table is replicated on every
  rank (TensorRT-LLM's default ``use_parallel_embedding=False``) unless ``parallel_embedding`` -- then each rank
  holds ``ceil(vocab / tp)`` rows, as in every checkpoint forge writes (ModelOpt 0.47's export sets
  ``use_parallel_embedding: True``, ``embedding_sharding_dim: 0``: modelopt/torch/export/tensorrt_llm_utils.py,
  and ``plan_for_recipe`` plans it so); quantization scales are counted (per-channel
  scales, AWQ group scales and pre-quant smoothing vectors).
* activations: the engine's execution-context memory, allocated once when the engine loads. The larger of
  one decoder layer's live tensors for ``max_num_tokens`` packed tokens (an estimate: TensorRT reports the
  exact size only after a build) and the lm_head's all-gather (:func:`lm_head_activation`, counted from the
  network TensorRT-LLM builds: the local ``[rows, V/tp]`` output and the gathered ``[tp x rows, V/tp]`` are alive
  together; rows = ``max_num_tokens`` for an engine built with ``--gather_context_logits``).
* start-up runtime buffers (:func:`runtime_buffers`, ``when == "start-up"``): the logits buffer at its start-up
  size ``[max_batch_size x max_beam_width, vocabSizePadded]``, the decoder's buffers, the sampling layers'
  workspaces and, when tp > 1, the custom all-reduce workspace; plus a fixed runtime overhead (CUDA context,
  cuBLAS workspaces).
* the paged KV pool: layers x kv_heads x head_dim x 2 (K and V) x tokens x bytes(kv dtype), for
  ``max_batch_size x max_seq_len`` tokens (a sliding-window layer: its window), in whole blocks of
  ``tokens_per_block``. TensorRT-LLM sizes it from the memory free *after* everything above:
  ``min(max_tokens_in_paged_kv_cache, kv_cache_free_gpu_mem_fraction x free)``.
* per-step buffers allocated *after* the KV pool (``when == "per step"``): the context-logits buffer of an engine
  that gathers context logits (``[max_num_tokens, vocabSizePadded]`` per step, two alive across a step) and
  NCCL's connection buffers (connected at the first collective). They live in what the pool leaves.

The pool rule decides the total: forge caps the pool at what the recipe needs (:func:`kv_cache_max_tokens`,
written as ``max_tokens_in_paged_kv_cache`` into the Triton config and the evaluate runtime), so the per-step
buffers get ``free - kv``: total = early + kv + max(kv x (1 / fraction - 1), per-step). TensorRT-LLM 1.2 ignores
the cap for an engine with more than one attention-window size (Gemma 3), whose pool always takes the fraction:
total = early + max(pool need / fraction, per-step / (1 - fraction)).

``fit(plan, gpu)`` compares the total with a GPU from :mod:`pipeline.gpus` and, when it does not fit,
says which ``max_batch_size`` / ``max_seq_len`` / ``max_num_tokens`` / ``kv_cache`` dtype / ``tp`` /
``quant_algo`` / ``kv_cache_free_gpu_mem_fraction`` would.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ForgeError
from ..gpus import GiB, GpuSpec
from ..modelinfo import ModelInfo
from .quantizers import DEFAULT_GROUP, QUANTIZERS

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
    "int4_zp": (4, "INT4 with zero points (group scales and zeros)"),
    "fp8": (8, "FP8 E4M3 (per-tensor scales)"),
    "fp8_pc_pt": (8, "FP8 E4M3 rowwise (per-channel weight scales, per-token activation scales)"),
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
LOGITS_BYTES = {"float16": 2, "float32": 4}
_CANONICAL_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}

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
    # 1.2.0rc2 (tensorrt_llm/version.py @ b35ac1b6): calculateFreeMemBytes, and calculateMaxNumBlocks taking
    # min(maxTokens, fraction x free) except with more than one attention-window size ("VSWA")
    "kvCacheManager": ("cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp",
                       "b35ac1b64368513d215c57d2ed01d62d910df8da"),
    # the 1.2.0rc2 executor: constructor order (TllmRuntime, createBuffers, createDecoder, calculateFreeMemBytes),
    # and per step executeStep -> prepareBuffers -> RuntimeBuffers::prepareStep before decoderStepAsync
    "trtGptModelStep": ("cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp",
                        "b35ac1b64368513d215c57d2ed01d62d910df8da"),
    "handleContextLogits": ("cpp/tensorrt_llm/batch_manager/handleContextLogits.cpp",
                            "b35ac1b64368513d215c57d2ed01d62d910df8da"),
    "bufferView": ("cpp/tensorrt_llm/runtime/bufferView.h", "65b31db1b401d3752b8ebe7c29093cbfb6af04b7"),
    "tllmRuntime": ("cpp/tensorrt_llm/runtime/tllmRuntime.cpp", "0165bd7ac275dae69796767cdbb71ce1963506f3"),
    # the network trtllm-build compiles: lm_head, its all-gather and the logits output
    "llamaModel": ("tensorrt_llm/models/llama/model.py", "2340c776201e4dba9aa625b8615e3e6ca9d7a7f6"),
    "modelingUtils": ("tensorrt_llm/models/modeling_utils.py", "b35ac1b64368513d215c57d2ed01d62d910df8da"),
    "generationMixin": ("tensorrt_llm/models/generation_mixin.py", "03ec464e2179899bff818504d30279113bbdd617"),
    "linear": ("tensorrt_llm/layers/linear.py", "03961722f65265573cad179baca3bc5fe8c03f76"),
    "functional": ("tensorrt_llm/functional.py", "0071496dc625910229bf433821453636ef3770eb"),
    "network": ("tensorrt_llm/network.py", "7b437aaa73bf5a44b1102aee5c631074da763b8f"),
    "allgatherPlugin": ("cpp/tensorrt_llm/plugins/ncclPlugin/allgatherPlugin.cpp",
                        "14e801da3632eb71367b847e335c4f2b09098651"),
    # which NCCL 1.2 runs: "nvidia-nccl-cu13" (its 25.08 base container: 2.27.7)
    "requirements": ("requirements.txt", "b35ac1b64368513d215c57d2ed01d62d910df8da"),
    "modelInstanceState": ("triton_backend/inflight_batcher_llm/src/model_instance_state.cc",
                           "c8c6df08bd0ead54cd47f7973e1e425c28a174cd"),
}

# NVIDIA/nccl v2.27.7-1 (the NCCL of TensorRT-LLM 1.2's base container; TRTLLM_SOURCES["requirements"])
NCCL_SOURCES = {
    "init": ("src/init.cc", "593de54e52679b51428571c13271e2ea9f91b1b1"),
    "device": ("src/include/device.h", "593de54e52679b51428571c13271e2ea9f91b1b1"),
    "connect": ("src/graph/connect.cc", "593de54e52679b51428571c13271e2ea9f91b1b1"),
}
# Per connection and channel, one buffer per protocol (init.cc computeBuffSizes, defaults; device.h constants):
# LL = NCCL_LL_LINES_PER_THREAD 8 x NCCL_LL_MAX_NTHREADS 512 x NCCL_STEPS 8 x sizeof(ncclLLFifoLine) 16,
# LL128 = NCCL_LL128_ELEMS_PER_THREAD 120 x NCCL_LL128_MAX_NTHREADS 640 x NCCL_STEPS 8 x 8, Simple = 1 << 22.
NCCL_CONNECTION_BYTES = 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8 + (1 << 22)          # 9,633,792
# connect.cc ncclTopoPostset: "nChannels = comm->nChannels = std::min(MAXCHANNELS,nChannels*2)", device.h MAXCHANNELS
NCCL_MAX_CHANNELS = 64

IPC_ALIGN = 1 << 21            # ipcUtils.cpp IpcMemory::allocateIpcMemory: common::alignSize(bufferSize, 1LU << 21)


def _allreduce_workspace_size(tp: int) -> int:
    """``customAllReduceUtils::getMaxRequiredWorkspaceSize(worldSize)``: 16 MB for tp <= 2, else 8 MB."""
    return 16 * 1000 * 1000 if tp <= 2 else 8 * 1000 * 1000


def vocab_size_padded(vocab: int, world_size: int) -> int:
    """``ModelConfig::getVocabSizePadded(worldSize)``: ``(vocab + worldSize - 1) / worldSize * worldSize``."""
    return (vocab + world_size - 1) // world_size * world_size


STARTUP, PER_STEP = "start-up", "per step"      # allocated before the KV pool is sized / after it, every step


def _src(key: str, ident: str, sources: dict | None = None) -> str:
    path, commit = (sources or TRTLLM_SOURCES)[key]
    return f"{path} @ {commit}: {ident}"


def runtime_buffers(info: ModelInfo, *, tp: int, pp: int, max_batch_size: int, max_beam_width: int,
                    max_num_tokens: int, gather_context_logits: bool, logits_dtype: str,
                    max_seq_len: int | None = None) -> list[dict]:
    """The runtime's buffers that scale with the model, on the rank that holds them (the last pipeline rank for
    logits and the decoder), each with the source line its size comes from and ``when`` it is allocated:
    ``"start-up"`` (before the KV pool takes its share of the free memory) or ``"per step"`` (after it).

    The first entry is the logits buffer at its start-up size; an engine that gathers context logits adds the
    per-step context-logits buffers; with ``max_seq_len`` the decoder / sampling / all-reduce buffers follow, and
    NCCL's connection buffers when tp > 1 (docs/trtllm-memory.md lists each with its formula and commit)."""
    if logits_dtype not in LOGITS_BYTES:
        raise ForgeError(f"unknown logits_dtype {logits_dtype!r} (recipe key build.tensorrt_llm.logits_dtype): "
                         f"valid values are float16, float32")
    vp = vocab_size_padded(info.vocab_size, tp * pp)
    lb = LOGITS_BYTES[logits_dtype]
    # The RuntimeBuffers constructor calls setMaxBufferSizes (numLogits = maxBatchSize * max(1 + maxDraftTokens,
    # maxBeamWidth)) and then reshape with no context request: logits->reshape({numLogits, vocabSizePadded}).
    rows = max_batch_size * max_beam_width
    out = [{"name": "logits (start-up)", "shape": "[max_batch_size x max_beam_width, vocabSizePadded]", "rows": rows,
            "vocab_size_padded": vp, "dtype": logits_dtype, "bytes": rows * vp * lb, "when": STARTUP,
            "source": _src("runtimeBuffers", "RuntimeBuffers::RuntimeBuffers setMaxBufferSizes; reshape; "
                           "setMaxBufferSizes: numLogits = maxBatchSize * std::max(1 + maxDraftTokens, maxBeamWidth)")}]
    if gather_context_logits:
        # Every step with a context request: reshape re-allocates `logits = manager.gpu({numContextTokens +
        # numGenSequences, vocabSizePadded})` (the MicroBatchScheduler keeps a step's tokens <= maxNumTokens),
        # after the KV pool. The previous step's buffer is still held then: HandleContextLogits keeps views of it
        # in the decoder input buffers (allDecoderLogits.emplace_back(logitsView); a BufferView holds the parent's
        # SharedPtr) until the next decoderStepAsync clears them, which runs after the next executeStep's
        # prepareBuffers -> prepareStep -> reshape. Two full-size buffers are alive across a step.
        out.append({"name": "context logits (per step: this step's + the previous step's)",
                    "shape": "2 x [max_num_tokens, vocabSizePadded]", "rows": 2 * max_num_tokens,
                    "vocab_size_padded": vp, "dtype": logits_dtype, "bytes": 2 * max_num_tokens * vp * lb,
                    "when": PER_STEP,
                    "source": "; ".join([
                        _src("runtimeBuffers", "RuntimeBuffers::reshape: logits = manager.gpu(ITensor::makeShape("
                             "{numContextTokens + numGenSequences, vocabSizePadded}), logitsType)"),
                        _src("microBatchScheduler", "batchNumTokens + reqNumTokens > maxNumTokensRuntime -> break"),
                        _src("handleContextLogits", "allDecoderLogits.clear(); ... "
                             "allDecoderLogits.emplace_back(std::move(decoderLogits))"),
                        _src("bufferView", "IBuffer::SharedPtr mBuffer"),
                        _src("trtGptModelStep", "forwardAsync: executeBatch before decoderStepAsync; executeStep -> "
                             "prepareBuffers -> runtimeBuffers.prepareStep")])})
    if max_seq_len is None:
        return out
    mbs, bw, sl = max_batch_size, max_beam_width, max_seq_len
    # maxAttentionWindow = the largest layer window = max_seq_len (forge sets per-layer windows <= max_seq_len)

    def add(name, shape, dtype, nbytes, key, ident, when=STARTUP):
        path, commit = TRTLLM_SOURCES[key]
        out.append({"name": name, "shape": shape, "dtype": dtype, "bytes": nbytes, "when": when,
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
    if tp > 1:
        out.append(nccl_buffers(tp))
    return out


def nccl_buffers(tp: int) -> dict:
    """NCCL's connection buffers of the TP communicator (the AllGather / AllReduce plugins' ``getComm``), an upper
    bound: NCCL >= 2.22 connects at the first collective (``NCCL_RUNTIME_CONNECT``, default 1: after the KV pool),
    one set of LL / LL128 / Simple buffers per channel and receiving peer, at most ``MAXCHANNELS`` channels. GPUs
    without peer access (GeForce) use the SHM transport, whose buffers are host memory: there it over-reserves."""
    return {"name": "NCCL connection buffers (tp > 1, upper bound)",
            "shape": "MAXCHANNELS x (tp - 1) peers x (LL + LL128 + Simple)", "dtype": "uint8",
            "bytes": NCCL_MAX_CHANNELS * (tp - 1) * NCCL_CONNECTION_BYTES, "when": PER_STEP,
            "source": "; ".join([
                _src("init", "NCCL_PARAM(RuntimeConnect, \"RUNTIME_CONNECT\", 1); comm->runtimeConn = "
                     "comm->cuMemSupport && ncclParamRuntimeConnect(); DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE, "
                     "DEFAULT_BUFFSIZE (1 << 22)", NCCL_SOURCES),
                _src("device", "MAXCHANNELS 64, NCCL_LL_LINES_PER_THREAD 8, NCCL_LL_MAX_NTHREADS 512, "
                     "NCCL_LL128_ELEMS_PER_THREAD 120, NCCL_LL128_MAX_NTHREADS 640, NCCL_STEPS 8", NCCL_SOURCES),
                _src("connect", "ncclTopoPostset: nChannels = comm->nChannels = std::min(MAXCHANNELS,nChannels*2)",
                     NCCL_SOURCES),
                _src("allgatherPlugin", "AllgatherPlugin::initialize(): the communicator of mGroup"),
                _src("requirements", "nvidia-nccl-cu13 (rel-25-08 uses 2.27.7)")])}


def lm_head_activation(info: ModelInfo, *, tp: int, rows: int, dtype: str, logits_dtype: str) -> dict:
    """The lm_head's share of the engine's execution-context memory (allocated when the engine loads).

    TensorRT-LLM builds ``lm_head = ColumnLinear(hidden, pad_vocab_size(vocab, tp), gather_output=True)``: each rank
    computes ``[rows, V/tp]`` and, when tp > 1, the AllGather plugin returns ``[tp x rows, V/tp]`` (its
    getOutputDimensions multiplies dim 0 by the group size), which slice + concat turn into ``[rows, V]``. The
    network output ``logits`` is bound to the runtime's logits buffer (counted with the runtime buffers), so what the
    engine holds is the local output and the gathered one alive together; when ``logits_dtype`` is not the model
    dtype, mark_output adds a cast and the concatenated ``[rows, V]`` is an intermediate too (then the gathered and
    the concatenated tensors are the larger pair). ``rows`` = ``max_num_tokens`` for an engine that gathers context
    logits (prepare_basic_inputs has no ``last_token_ids`` then, so the lm_head sees every packed token), else the
    last tokens of ``max_batch_size x max_beam_width`` sequences."""
    act = DTYPE_BYTES[dtype]
    vpt = math.ceil(info.vocab_size / tp) * tp          # pad_vocab_size(vocab_size, tp_size)
    cast = _CANONICAL_DTYPE.get(logits_dtype, logits_dtype) != _CANONICAL_DTYPE.get(dtype, dtype)
    if tp > 1:
        local, gathered = rows * vpt // tp, rows * vpt
        elems = gathered + (gathered if cast else local)
        shape = (f"[{rows}, {vpt}] gathered + [{rows}, {vpt}] concatenated" if cast
                 else f"[{rows}, {vpt // tp}] local + [{tp} x {rows}, {vpt // tp}] gathered")
    else:
        elems = rows * vpt if cast else 0
        shape = f"[{rows}, {vpt}] before the cast to {logits_dtype}" if cast else "none (the output is the logits buffer)"
    return {"bytes": elems * act, "shape": shape, "rows": rows, "cast": cast,
            "source": "; ".join([
                _src("llamaModel", "vocab_size_padded = pad_vocab_size(vocab_size, mapping.tp_size); "
                     "self.lm_head = ColumnLinear(hidden_size, vocab_size_padded, ..., gather_output=True)"),
                _src("linear", "Linear.collect_and_bias: x = allgather(x, self.tp_group, gather_dim=-1)"),
                _src("functional", "allgather: plugin output, then split_size = shape(x, dim=0) / group_size, "
                     "slice x group_size, x = concat(sections, dim=gather_dim)"),
                _src("allgatherPlugin", "getOutputDimensions: ret.d[0] = kPROD(*ret.d[0], *groupSize)"),
                _src("generationMixin", "last_token_ids = None unless mapping.is_last_pp_rank() and not "
                     "gather_context_logits"),
                _src("modelingUtils", "DecoderModelForCausalLM.forward: lm_logits = self.lm_head(hidden_states); "
                     "lm_logits.mark_output('logits', self.config.logits_dtype)"),
                _src("network", "_mark_output: if dtype is not None and self.strongly_typed: tensor = cast(tensor, dtype)"),
                _src("tllmRuntime", "TllmRuntime::TllmRuntime: mEngineBuffer = mBufferManager.gpu("
                     "mEngine->getDeviceMemorySizeV2())")])}


def kv_cache_max_tokens(*, max_batch_size: int, max_seq_len: int, tokens_per_block: int,
                        windows: list[int] | None = None) -> int | None:
    """The KV-pool cap forge writes (``max_tokens_in_paged_kv_cache``, Triton config and evaluate runtime): what
    the configured worst case needs (the plan's KV cache), whole blocks of ``max_batch_size`` sequences of the attention
    window (``max_seq_len`` without one). None for an engine with more than one window size, where TensorRT-LLM 1.2
    ignores the cap (kvCacheManager.cpp calculateMaxNumBlocks: "kv_cache_config.max_tokens is not effective in
    VSWA scheme"). ``windows``: the engine's per-layer windows (families.engine_attention_windows)."""
    distinct = {min(int(w), max_seq_len) for w in windows} if windows else {max_seq_len}
    if len(distinct) > 1:
        return None
    return max_batch_size * math.ceil(distinct.pop() / tokens_per_block) * tokens_per_block


def engine_kv_cache_max_tokens(engine_config: dict) -> int | None:
    """:func:`kv_cache_max_tokens` of a built engine, from its ``config.json`` (``build_config`` with its
    ``plugin_config``, the per-layer windows of ``pretrained_config``) or from a recipe's ``build.tensorrt_llm``
    section; None without a paged KV cache (trtllm-build's defaults: max_batch_size 2048, 32 tokens per block)."""
    from .families import engine_attention_windows
    bc = engine_config.get("build_config", engine_config)
    plugin = bc.get("plugin_config") or {}
    kv = str(bc.get("kv_cache_type", plugin.get("kv_cache_type", "paged"))).split(".")[-1].lower()
    if kv != "paged" or plugin.get("paged_kv_cache") is False or bc.get("max_seq_len") is None:
        return None
    return kv_cache_max_tokens(max_batch_size=int(bc.get("max_batch_size", 2048)), max_seq_len=int(bc["max_seq_len"]),
                               tokens_per_block=int(plugin.get("tokens_per_block", bc.get("tokens_per_block", 32))),
                               windows=engine_attention_windows(engine_config))


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
    activation_bytes: int                   # the engine's execution-context memory: max(layer estimate, lm_head)
    logits_bytes: int                       # every logits buffer: start-up + per-step context logits
    runtime_bytes: int                      # fixed overhead: CUDA context, cuBLAS workspaces
    total_bytes: int                        # early_bytes + kv_cache_paged_bytes + reserve_bytes
    notes: list[str] = field(default_factory=list)
    runtime_buffers: list[dict] = field(default_factory=list)
    buffers_bytes: int = 0                  # start-up runtime buffers other than logits (decoder, sampling, all-reduce)
    kv_headroom_bytes: int = 0              # free memory the fraction leaves beyond the pool's need
    late_bytes: int = 0                     # per-step buffers allocated after the KV pool
    early_bytes: int = 0                    # everything allocated before the KV pool is sized
    reserve_bytes: int = 0                  # free memory needed beyond early + KV: max(headroom, per-step)
    kv_max_tokens: int | None = None        # max_tokens_in_paged_kv_cache forge writes; None: TensorRT-LLM ignores it
    lm_head: dict = field(default_factory=dict)      # lm_head_activation()
    layer_activation_bytes: int = 0         # one decoder layer's estimate
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
    if quant == "int4_zp":     # model-dtype scale and zero per group (pipeline/trtllm/int4_zp.py)
        if in_f % group_size:
            raise ForgeError(f"int4_zp group size {group_size} (recipe key {RECIPE_KEYS['group_size']}) does not "
                             f"divide a linear input width {in_f}; pick a group size that divides it (64 or 128)")
        return (n + 1) // 2, 2 * (in_f // group_size) * out_f * act_bytes
    if quant == "fp8":
        return n, 8
    if quant == "fp8_pc_pt":   # fp32 per_channel_scale (out,) (contract.py RULE_FP8_PC_PT)
        return n, out_f * 4
    raise AssertionError(quant)


def plan_memory(info: ModelInfo, *, quant_algo: str = "none", kv_cache: str | None = None,
                dtype: str = "float16", tp: int = 1, pp: int = 1, max_batch_size: int = 8,
                max_seq_len: int = 4096, max_num_tokens: int | None = None, tokens_per_block: int = 32,
                group_size: int = 128, runtime_overhead: int = DEFAULT_RUNTIME_OVERHEAD,
                parallel_embedding: bool = False, gather_context_logits: bool = False,
                logits_dtype: str = "float32", max_beam_width: int = 1,
                kv_cache_free_gpu_mem_fraction: float = 0.9, meta_recipe: bool = False) -> MemoryPlan:
    """Bytes one rank needs; see the module docstring for what is counted. ``meta_recipe``: fp8_pc_pt with
    quantize.options.meta_recipe (attention and the first / last layers in the model dtype)."""
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
    # TensorRT-LLM's Meta recipe for rowwise FP8 keeps the attention of every layer and the first and last layers
    # in the model dtype (trtllm/quantizers.meta_recipe_float); the worst stage holds one of those layers when pp > 1
    meta = meta_recipe and quant == "fp8_pc_pt"
    float_layers = min(layers, 2 if pp == 1 else 1) if meta else 0
    w_lin = s_lin = p_lin = 0
    for k, (in_f, out_f, row) in enumerate(linears):
        n_float = layers if meta and k < 2 else float_layers
        wb, sb = _linear_bytes(quant, in_f, out_f, act, group_size, row)
        w_lin += wb * (layers - n_float) + _linear_bytes("none", in_f, out_f, act, group_size, row)[0] * n_float
        s_lin += sb * (layers - n_float)
        p_lin += in_f * out_f * layers
    bias_params = ((q_heads + 2 * kvr) * hd if info.attention_bias else 0)
    # Gemma 3: 4 norms per layer; Qwen3 / Gemma 3: per-head q/k norms (head_dim each)
    norm_params = (info.norms_per_layer * h + (2 * hd if info.qk_norm else 0) + bias_params
                   + (2 if quant == "int8_sq_per_token" else 0)) * layers     # + the two norms' scale_to_int
    emb_params = (math.ceil(info.vocab_size / tp) if parallel_embedding else info.vocab_size) * h
    head_params = math.ceil(info.vocab_size / tp) * h

    lin_dtype = {"none": dtype, "int8_sq": "int8", "int8_sq_per_token": "int8", "int8_wo": "int8", "int4_wo": "int4", "int4_awq": "int4",
                 "int4_zp": "int4", "fp8": "fp8", "fp8_pc_pt": "fp8"}.get(quant, quant)
    scale_dtype = "fp32/" + dtype if quant == "int8_sq" else "fp32" if quant in ("int8_sq_per_token", "fp8", "fp8_pc_pt") else dtype
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
    kv_groups = [kv_paged]                  # bytes per attention-window size (TensorRT-LLM pools each separately)
    n_slide = info.sliding_layers_in(layers)
    win = info.sliding_window
    windows = None
    if n_slide and win and win < max_seq_len:
        # A sliding-window layer keeps only the last `window` tokens: forge sets the runtime's per-layer
        # max_attention_window_size (TensorRT-LLM's variable sliding-window KV cache; families.attention_windows).
        per_layer = kvr * hd * 2 * kvb
        win_blocks = math.ceil(win / tokens_per_block)
        kv_contig = per_layer * max_batch_size * ((layers - n_slide) * max_seq_len + n_slide * win)
        kv_groups = [g for g in (per_layer * tokens_per_block * max_batch_size * (layers - n_slide) * blocks_per_seq,
                                 per_layer * tokens_per_block * max_batch_size * n_slide * win_blocks) if g]
        kv_paged = sum(kv_groups)
        windows = [win] * n_slide + [max_seq_len] * (layers - n_slide)
    kv_max_tokens = kv_cache_max_tokens(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                        tokens_per_block=tokens_per_block, windows=windows)

    per_token_act = (2 * h + (q_heads + 2 * kvr) * hd + q_heads * hd + 3 * i_r) * act
    layer_activation = per_token_act * max_num_tokens
    lm = lm_head_activation(info, tp=tp, rows=max_num_tokens if gather_context_logits
                            else max_batch_size * max_beam_width, dtype=dtype, logits_dtype=logits_dtype)
    # one execution-context allocation, sized for the engine's largest profile: the layers run before the lm_head
    activation = max(layer_activation, lm["bytes"])
    buffers = runtime_buffers(info, tp=tp, pp=pp, max_batch_size=max_batch_size, max_beam_width=max_beam_width,
                              max_num_tokens=max_num_tokens, gather_context_logits=gather_context_logits,
                              logits_dtype=logits_dtype, max_seq_len=max_seq_len)
    startup = [b for b in buffers if b["when"] == STARTUP]
    late = sum(b["bytes"] for b in buffers if b["when"] == PER_STEP)
    logits = sum(b["bytes"] for b in buffers if b["name"].startswith(("logits", "context logits")))
    others = sum(b["bytes"] for b in startup[1:])
    runtime = runtime_overhead
    early = weights_bytes + activation + startup[0]["bytes"] + others + runtime
    # BaseKVCacheManager::calculateFreeMemBytes (kvCacheManager.cpp): freePrimaryMemBytes = finalFreeMem *
    # freeMemFraction, measured after everything above (TrtGptModelInflightBatching ctor: createBuffers,
    # createDecoder, then calculateFreeMemBytes); calculateMaxNumBlocks gives each window size an equal share of it
    # and caps the pool at maxTokens (max_tokens_in_paged_kv_cache) unless there is more than one window size.
    if kv_max_tokens is not None:
        # the pool takes min(cap, fraction x free) = the recipe's KV when free >= kv / fraction; the per-step
        # buffers get the rest, free - kv
        pool_need = kv_paged
        reserve = max(math.ceil(kv_paged / frac) - kv_paged, late)
    else:
        # the pool takes fraction x free whatever the recipe needs, each window size 1 / (window sizes) of it;
        # the per-step buffers get (1 - fraction) x free
        pool_need = len(kv_groups) * max(kv_groups)
        reserve = max(math.ceil(pool_need / frac), math.ceil(late / (1 - frac))) - kv_paged
    headroom = math.ceil(pool_need / frac) - kv_paged
    total = early + kv_paged + reserve

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
        notes.append(f"the engine gathers context logits (--gather_context_logits): every step with a context "
                     f"request allocates a [{max_num_tokens}, {buffers[0]['vocab_size_padded']}] {logits_dtype} "
                     f"logits buffer after the KV pool, and the previous step's stays alive until the decoder "
                     f"runs: {buffers[1]['bytes'] / GiB:.2f} GiB; the deploy engine, built without it, keeps its "
                     f"{max_batch_size * max_beam_width}-row start-up buffer")
    if lm["bytes"] > layer_activation:
        notes.append(f"activations: the lm_head's all-gather ({lm['shape']}, {lm['bytes'] / GiB:.2f} GiB) is larger "
                     f"than one decoder layer's ({layer_activation / GiB:.2f} GiB)")
    if mnt_default:
        notes.append(f"max_num_tokens not set: using min({DEFAULT_MAX_NUM_TOKENS}, max_batch_size x max_seq_len)"
                     f" = {max_num_tokens}")
    if kv_max_tokens is not None:
        notes.append(f"KV pool capped at max_tokens_in_paged_kv_cache {kv_max_tokens} (what forge writes into the "
                     f"Triton config and the evaluate runtime): it needs {kv_paged / frac / GiB:.2f} GiB free "
                     f"(kv_cache_free_gpu_mem_fraction {frac}) and leaves the per-step buffers "
                     f"({late / GiB:.2f} GiB) the rest")
    else:
        notes.append(f"{len(kv_groups)} attention-window sizes: TensorRT-LLM 1.2 ignores max_tokens_in_paged_kv_cache "
                     f"and gives the KV pool kv_cache_free_gpu_mem_fraction ({frac}) of the free memory, an equal "
                     f"share per window size; the per-step buffers ({late / GiB:.2f} GiB) must fit in the remaining "
                     f"{1 - frac:.2f}")
    args = dict(quant_algo=quant, kv_cache=kv_name, dtype=dtype, tp=tp, pp=pp, max_batch_size=max_batch_size,
                max_seq_len=max_seq_len, max_num_tokens=None if mnt_default else max_num_tokens,
                tokens_per_block=tokens_per_block, group_size=group_size, runtime_overhead=runtime_overhead,
                parallel_embedding=parallel_embedding, gather_context_logits=gather_context_logits,
                logits_dtype=logits_dtype, max_beam_width=max_beam_width,
                kv_cache_free_gpu_mem_fraction=frac, meta_recipe=meta)
    model = {"architecture": info.architecture, "num_layers": info.num_layers, "hidden_size": h,
             "num_heads": info.num_heads, "num_kv_heads": info.num_kv_heads, "head_dim": hd,
             "intermediate_size": i_sz, "vocab_size": info.vocab_size, "num_params": info.num_params,
             "max_num_tokens_used": max_num_tokens}
    return MemoryPlan(model=model, args=args, layers_per_rank=layers, kv_heads_per_rank=kvr, weights=weights,
                      weights_bytes=weights_bytes, kv_bytes_per_token=kv_per_token, kv_cache_bytes=kv_contig,
                      kv_block_bytes=kv_block_bytes, kv_blocks=kv_blocks, kv_cache_paged_bytes=kv_paged,
                      activation_bytes=activation, logits_bytes=logits, runtime_bytes=runtime, total_bytes=total,
                      notes=notes, runtime_buffers=buffers, buffers_bytes=others, kv_headroom_bytes=headroom,
                      late_bytes=late, early_bytes=early, reserve_bytes=reserve, kv_max_tokens=kv_max_tokens,
                      lm_head=lm, layer_activation_bytes=layer_activation, _info=info)


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
    qz = QUANTIZERS.get(plan.args["quant_algo"])              # fp16 / bf16 / fp32: the planner's own names
    need = qz.min_sm if qz is not None else None             # the quantizer's declaration: FP8 GEMMs need SM 8.9
    if need is not None and gpu.sm < divmod(need, 10):
        probs.append(f"{gpu.name} ({sm}) has no FP8 tensor cores ({plan.args['quant_algo']} needs SM >= "
                     f"{need // 10}.{need % 10}): set {RECIPE_KEYS['quant_algo']} to int8_sq_per_token or int4_awq")
    if plan.args["kv_cache"] == "fp8" and not gpu.has_fp8:
        probs.append(f"{gpu.name} ({sm}) has no FP8: set {RECIPE_KEYS['kv_cache']}=int8")
    if plan.args["dtype"] in ("bfloat16", "bf16") and gpu.sm < (8, 0):
        probs.append(f"{gpu.name} ({sm}) has no bf16: use float16")
    return probs


def suggestable_quant_algos(plan: MemoryPlan, gpu: GpuSpec) -> list[str]:
    """The ``quantize.algo`` values the build would accept for this plan's model, parallelism and GPU: the build's
    own rule (trtllm/build_config.validate_build, its ``quantize.algo`` problems) asked for each, so ``fit`` never
    suggests what ``forge plan`` then refuses. In build_config.QUANT_ALGO order."""
    from .build_config import QUANT_ALGO, validate_build
    a = plan.args
    kv = a["kv_cache"] if a["kv_cache"] in ("int8", "fp8") else "none"
    build = {"tp": a["tp"], "pp": a["pp"], "dtype": a["dtype"]}
    sm = gpu.sm[0] * 10 + gpu.sm[1]
    return [q for q in QUANT_ALGO if q in QUANT_ALGOS and not any(
        p.startswith("quantize.algo") for p in validate_build(build, {"algo": q, "kv_cache": kv}, plan._info, sm))]


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
        if plan.activation_bytes + plan.late_bytes > 0.02 * cap:
            n = _largest(1, mnt_used // 256, lambda k: fits_with(max_num_tokens=k * 256) is not None)
            if n and n * 256 < mnt_used:
                p = fits_with(max_num_tokens=n * 256)
                sugg.append(Suggestion("max_num_tokens", n * 256, p.total_bytes,
                                       "fewer packed tokens per step: smaller activation (and gathered "
                                       "context-logits) buffers, slower prefill"))
        if plan.kv_max_tokens is None and plan.late_bytes:
            # the pool takes the fraction whatever the cap says: a smaller one leaves the per-step buffers room
            f = next((x / 20 for x in range(19, 0, -1) if x / 20 < a["kv_cache_free_gpu_mem_fraction"]
                      and fits_with(kv_cache_free_gpu_mem_fraction=x / 20) is not None), None)
            if f is not None:
                sugg.append(Suggestion("kv_cache_free_gpu_mem_fraction", f,
                                       fits_with(kv_cache_free_gpu_mem_fraction=f).total_bytes,
                                       f"leaves {1 - f:.2f} of the free memory to the per-step buffers"))
        for t in (2, 4, 8):
            if a["tp"] < t <= max_tp:
                p = fits_with(tp=t)
                if p is not None:
                    sugg.append(Suggestion("tp", t, p.total_bytes, f"split over {t} x {gpu.name}"))
                    break
        def bits(q):
            return QUANT_ALGOS[q][0] or DTYPE_BYTES[a["dtype"]] * 8
        # the least aggressive algo with fewer bits that fits and that the build accepts for this model and GPU
        for q in sorted(suggestable_quant_algos(plan, gpu), key=bits, reverse=True):
            if bits(q) < bits(a["quant_algo"]):
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


def plan_for_recipe(recipe, info: ModelInfo, gpu: str | None = None, *,
                    deploy: bool = False) -> tuple[MemoryPlan, list[FitVerdict]]:
    """Plan from a resolved recipe's quantize + build.tensorrt_llm sections; verdict for ``gpu`` (a name from
    :mod:`pipeline.gpus`) or, when None, for every GPU in the table. The evaluation engine (stage ``build``, with
    the recipe's ``gather_context_logits``) unless ``deploy``: the engine Triton serves (stage ``build_deploy``,
    built without it)."""
    from ..gpus import GPUS, get_gpu

    q, b = recipe.quantize, recipe.build.tensorrt_llm
    algo = "none" if q.method == "none" else q.algo
    if algo == "int8":                 # the onnxruntime target's name; same bytes as int8_sq / int8_wo
        algo = "int8_sq"
    # this target's quantizer reads the options: its group size (quantize.block_size, else its default for this
    # model, the one the quantize and checkpoint stages use) and the Meta recipe of rowwise FP8; another target's
    # recipe has its own quantizers
    qz = QUANTIZERS.get(algo) if recipe.build.target == "tensorrt_llm" else None
    opts = qz.options_of(q) if qz is not None else None
    group = qz.group_size(opts, info) if qz is not None else q.block_size
    plan = plan_memory(info, quant_algo=algo, kv_cache=q.kv_cache, dtype=b.dtype, tp=b.tp, pp=b.pp,
                       max_batch_size=b.max_batch_size, max_seq_len=b.max_seq_len, max_num_tokens=b.max_num_tokens,
                       tokens_per_block=b.tokens_per_block if b.kv_cache_type == "paged" else 1,
                       group_size=group or DEFAULT_GROUP, max_beam_width=b.max_beam_width,
                       parallel_embedding=True,   # what forge's checkpoint stage writes (module docstring)
                       gather_context_logits=b.gather_context_logits and not deploy, logits_dtype=b.logits_dtype,
                       kv_cache_free_gpu_mem_fraction=recipe.package.triton.kv_cache_free_gpu_mem_fraction,
                       meta_recipe=bool(getattr(opts, "meta_recipe", False)))
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
    t.add_row(f"activations: one layer's estimate ({plan.model['max_num_tokens_used']} tokens)", a["dtype"],
              f"{plan.layer_activation_bytes:,}", f"{plan.layer_activation_bytes / GiB:.2f}")
    t.add_row(escape(f"activations: lm_head all-gather {plan.lm_head['shape']}"), a["dtype"],
              f"{plan.lm_head['bytes']:,}", f"{plan.lm_head['bytes'] / GiB:.2f}")
    t.add_row("activations (the larger: the engine's context memory)", a["dtype"], f"{plan.activation_bytes:,}",
              f"{plan.activation_bytes / GiB:.2f}")
    for rb in plan.runtime_buffers:
        if rb["when"] == STARTUP:
            t.add_row(escape(f"runtime buffer: {rb['name']} {rb['shape']}"), rb["dtype"], f"{rb['bytes']:,}",
                      f"{rb['bytes'] / GiB:.2f}")
    t.add_row("runtime (CUDA context, cuBLAS)", "", f"{plan.runtime_bytes:,}", f"{plan.runtime_bytes / GiB:.2f}")
    t.add_row("[bold]before the KV pool", "", f"{plan.early_bytes:,}", f"{plan.early_bytes / GiB:.2f}")
    cap = (f"max_tokens_in_paged_kv_cache {plan.kv_max_tokens}" if plan.kv_max_tokens is not None
           else f"kv_cache_free_gpu_mem_fraction {a['kv_cache_free_gpu_mem_fraction']}")
    t.add_row(f"KV cache ({a['max_batch_size']} x {a['max_seq_len']} tokens, "
              f"{plan.kv_bytes_per_token:,} B/token, contiguous)", a["kv_cache"], f"{plan.kv_cache_bytes:,}",
              f"{plan.kv_cache_bytes / GiB:.2f}")
    t.add_row(f"KV pool, paged in blocks of {a['tokens_per_block']} tokens ({cap})", a["kv_cache"],
              f"{plan.kv_cache_paged_bytes:,}", f"{plan.kv_cache_paged_bytes / GiB:.2f}")
    for rb in plan.runtime_buffers:
        if rb["when"] == PER_STEP:
            t.add_row(escape(f"per step, after the pool: {rb['name']} {rb['shape']}"), rb["dtype"],
                      f"{rb['bytes']:,}", f"{rb['bytes'] / GiB:.2f}")
    t.add_row(f"free beyond the pool: max(headroom of fraction {a['kv_cache_free_gpu_mem_fraction']}, per step)", "",
              f"{plan.reserve_bytes:,}", f"{plan.reserve_bytes / GiB:.2f}")
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
