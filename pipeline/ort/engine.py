"""ONNX Runtime generation runtime for forge's KV-cache causal-LM graphs (prefill + decode in one graph).

Dependency-light on purpose (numpy + onnxruntime; ``tokenizers`` only for text helpers) so this file can be
copied as-is into a Triton python-backend model. It imports nothing from ``pipeline`` except, when present, the
progress bar. ``evaluate`` (perplexity, greedy generation), ``forge serve`` (the Triton python model) and
``make bench`` all run this class, so what is validated is what is served and what is measured.

Two graph layouts (``forge_ort.json`` ``kv_layout``, written by pipeline.ort.export):

``shared`` (default export; ONNX Runtime GenAI's contract): ``com.microsoft.GroupQueryAttention`` with rotary
    inside the op. Inputs ``input_ids`` [B, T], ``attention_mask`` [B, total] (only its row sums and width are
    read: the op gets ``seqlens_k = rowsum - 1`` and ``total_sequence_length = width``),
    ``past_key_values.{i}.key/value`` [B, kv, capacity, hd]; outputs ``logits`` and ``present.{i}.key/value``
    of the same shape as the past. The runtime binds past and present to ONE preallocated buffer per layer
    (``capacity`` = prompt + new tokens), so the op writes each step's K/V in place: no concatenation and no
    copy. Prompts of different lengths are right-padded: row b's K/V sit at positions [0, len_b) and every
    decode step writes row b's token at position len_b + t (the op reads ``seqlens_k`` per row).
``concat`` (``export.attention: standard``, the plain-ONNX graph TensorRT also reads): inputs ``attention_mask``
    [B, past + T] and ``position_ids``; presents are past + T long. The runtime rebinds each step's present
    OrtValues as the next step's past (still no numpy copies); padded slots stay masked.

Both layouts are driven through IO binding. The decode loop writes the next token ids and the mask into
preallocated numpy buffers and reads the logits from a preallocated [B, 1, V] OrtValue. ``device`` picks where
the KV buffers live (an OrtValue device: ``cpu``, or ``cuda`` with ``providers=["CUDAExecutionProvider"]``):
the GPU path keeps the cache on the GPU with the same code.

``SlotKVCache`` (shared layout, any device): the continuous batcher's cache on the GPU. One [slots, kv, capacity,
hd] buffer per layer and K/V; a range of slots is bound in place by pointer (``bind_input``/``bind_output`` at the
buffer's address plus whole rows), so a request's prefill writes its K/V into its slot and decode steps run over
the slots taken; rows never move (only when the slots grow, device to device).

``cuda_graph=True`` (CUDA provider, shared layout): decode steps are captured once per KV cache as a CUDA graph
(ONNX Runtime's ``enable_cuda_graph``; run option ``gpu_graph_id`` picks the graph, -1 runs the prefill without
one) and replayed. A replay needs every bound buffer at a fixed address and shape, so the decode step binds ids
[B, 1], the attention mask [B, capacity] (ones for each row's len + 1 positions: the op reads only the row sums as
``seqlens_k``; ``total_sequence_length`` is the capacity, which the shared buffer has) and the logits [B, 1, V] as
device OrtValues allocated once per cache and refreshed with ``update_inplace``. Each cache (each slot range) has
its own graph: a replay reuses the K/V addresses it captured.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import onnxruntime as ort

try:  # progress bars inside forge; a no-op when this file runs on its own (Triton)
    from pipeline.progress import progress_bar as _progress_bar
except Exception:  # pragma: no cover - exercised only outside the package
    _progress_bar = None

__all__ = ["OrtEngine", "KVCache", "SlotKVCache", "session_options", "inference_session", "sample_next", "LAYOUTS"]

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
LAYOUTS = ("shared", "concat")


# forge_ort.json: session config entries for CPUs whose MLAS u8 x s8 GEMM sums in saturating 16-bit lanes only
SATURATING_U8S8_CONFIG_KEY = "ort_session_config_u8s8_saturating"

# the graph input from which position on a call's logits are computed (pipeline/ort/logits_start.py adds it)
LOGITS_START = "logits_start"


def u8s8_saturates() -> bool:
    """Whether ONNX Runtime's u8 x s8 GEMM sums pairs of products in saturating 16-bit lanes on this CPU: x86 without
    VNNI or AMX. pipeline/host/cpu.py classifies the CPU by CPUID; in Triton's python stub, where this module also
    runs without pipeline/, the kernel's flags answer."""
    try:
        from pipeline.host.cpu import U8S8_SATURATING, cpu_isa_class
        return cpu_isa_class() in U8S8_SATURATING
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return False
    return "avx2" in flags and not flags & {"avx_vnni", "avx512_vnni", "amx_int8"}


def inference_session(model: str | bytes, options: ort.SessionOptions | None,
                      providers: Sequence) -> ort.InferenceSession:
    """``ort.InferenceSession``; on CUDA, the NVIDIA wheels' CUDA/cuDNN libraries are loaded first
    (:func:`pipeline.host.cuda.preload_cuda`), so no LD_LIBRARY_PATH is needed.
    No optimizer is disabled: ORT's SkipLayerNormFusion, which would make the fp16-overflowing
    SkipSimplifiedLayerNormalization, matches only ONNX ``LayerNormalization`` (never our
    SimplifiedLayerNormalization) -- onnxruntime/core/optimizer/skip_layer_norm_fusion.cc,
    ``IsSupportedOptypeVersionAndDomain(ln_node, "LayerNormalization", {1, 17})``, microsoft/onnxruntime@037b07fe;
    tests/ort/test_cuda.py checks it on both providers."""
    if any((p[0] if isinstance(p, tuple) else p) == "CUDAExecutionProvider" for p in providers):
        try:
            from pipeline.host.cuda import preload_cuda
        except ImportError:     # this file runs on its own inside Triton: ORT's own preload then
            preload = getattr(ort, "preload_dlls", None)
            if preload:
                preload(cuda=True, cudnn=True)
        else:
            preload_cuda()
    return ort.InferenceSession(model, options, providers=list(providers))


CAPACITY_STEP = 64  # KV buffers grow in steps of this many positions (fewer re-allocations across requests)


@contextlib.contextmanager
def _bar(desc: str, total: int | None) -> Iterator[Callable[[int], None]]:
    if _progress_bar is None:
        yield lambda n=1: None
    else:
        with _progress_bar(desc, total) as adv:
            yield adv


def session_options(threads: int = 0, level: str = "all", optimized_path: str | None = None, *,
                    quiet: bool = False) -> ort.SessionOptions:
    """SessionOptions with ``threads`` intra-op threads (0 = ORT default) and a graph optimisation ``level``
    (disable | basic | extended | all). ``quiet`` (CPU sessions): errors only -- ORT warns at every load of a graph
    with an overridable initializer (logits_start) that it will not fold it: expected, and nothing a user can act
    on. CUDA sessions keep their warnings (node placement)."""
    levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    if level not in levels:
        raise ValueError(f"graph optimisation level {level!r} is not one of {sorted(levels)}")
    so = ort.SessionOptions()
    so.graph_optimization_level = levels[level]
    if threads:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    if optimized_path:
        so.optimized_model_filepath = str(optimized_path)
    if quiet:
        so.log_severity_level = 3
    return so


def sample_next(logits: np.ndarray, rng: np.random.Generator, *, greedy: bool = True, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Next token per row from last-position logits [B, V]."""
    if greedy or temperature <= 0:
        return logits.argmax(-1)
    x = logits.astype(np.float64) / float(temperature)
    if top_k and top_k < x.shape[-1]:
        kth = np.partition(x, -top_k, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sp = np.take_along_axis(p, order, -1)
        keep = np.cumsum(sp, -1) - sp < top_p  # always keeps the top token
        sp = np.where(keep, sp, 0.0)
        p = np.zeros_like(p)
        np.put_along_axis(p, order, sp, -1)
        p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p], dtype=np.int64)


def _per_row(value: Any, batch: int, name: str) -> list:
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != batch:
            raise ValueError(f"{name} has {len(value)} entries for {batch} prompts")
        return list(value)
    return [value] * batch


class _BoundKV:
    """A KV cache the engine can bind: ``bind_kv`` puts each layer's K/V buffer as both past input and present
    output of an IO binding (GroupQueryAttention then writes each step's K/V in place: it shares the buffer when
    the two pointers are equal, ``past_present_share_buffer = (data.past_key == data.present_key)``,
    onnxruntime/contrib_ops/cuda/bert/group_query_attention.cc, microsoft/onnxruntime@001d12d2)."""

    layout = "shared"
    batch = capacity = width = 0
    lengths: np.ndarray
    _ios: dict | None = None       # session id -> the IO binding of this cache on it
    static: dict | None = None    # fixed-shape decode buffers and binding of this cache (OrtEngine.decode_static)

    def bind_kv(self, io: ort.IOBinding, engine: "OrtEngine") -> None:
        raise NotImplementedError

    def binding(self, engine: "OrtEngine", session: ort.InferenceSession | None = None) -> ort.IOBinding:
        """The IO binding of this cache (shared layout) on ``session`` (the engine's decode graph by default; its
        prompt graph, when it has one, for a prefill), made once per session: past and present of each layer bound
        to the same buffer; ids, mask and logits are rebound per call."""
        session = session or engine.session
        if self._ios is None:
            self._ios = {}
        io = self._ios.get(id(session))
        if io is None:
            io = self._ios[id(session)] = session.io_binding()
            self.bind_kv(io, engine)
        return io

    def reset(self) -> None:
        self.lengths[:] = 0
        self.width = 0


class KVCache(_BoundKV):
    """The KV state of one batch: one OrtValue per layer and K/V, on ``device``, plus each row's length.

    ``shared`` layout: [B, kv, capacity, hd] buffers, allocated once and written in place by the graph.
    ``concat`` layout: the last presents (ORT-allocated, [B, kv, past, hd]); ``mask`` holds the attention mask
    of every position so far (0 where a right-padded prompt left a hole)."""

    def __init__(self, engine: "OrtEngine", batch: int, capacity: int, *, host: bool = False):
        self.batch, self.capacity, self.layout = batch, capacity, engine.layout
        self.lengths = np.zeros(batch, np.int64)   # tokens stored per row
        self.width = 0                              # positions used (= attention-mask width)
        shape = [batch, engine.num_kv_heads, capacity if self.layout == "shared" else 0, engine.head_dim]
        # host: numpy buffers the OrtValues alias (CPU, shared layout), so rows can be copied between caches
        # (the continuous batcher's host backend moves a request's K/V when requests join or leave a batch)
        self.arrays = [np.zeros(shape, engine.kv_dtype) for _ in engine.past_names] if host else None
        self.values = ([ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays] if host else
                       [ort.OrtValue.ortvalue_from_shape_and_type(shape, engine.kv_dtype, engine.device,
                                                                   engine.device_id)
                        for _ in engine.past_names])
        self.mask = np.zeros((batch, 0), np.int64) if self.layout == "concat" else None

    def bind_kv(self, io: ort.IOBinding, engine: "OrtEngine") -> None:
        for name, pname, v in zip(engine.past_names, engine.present_names, self.values):
            io.bind_ortvalue_input(name, v)
            io.bind_ortvalue_output(pname, v)


class SlotKVCache:
    """Per-slot K/V for in-flight batching, on the engine's device (shared layout): one [slots, kv, capacity, hd]
    buffer per layer and K/V, allocated once; slot s is row s of every buffer and holds one request from its
    prefill to its last token. Rows of a C-contiguous tensor are one contiguous byte range, so ``rows(a, b)`` is a
    cache of slots [a, b) bound in place -- ``IOBinding.bind_input``/``bind_output`` with the buffer's address
    plus ``a`` rows (onnxruntime's documented way to bind device memory it did not allocate). A newcomer's prefill
    writes its K/V straight into its free slot and a decode step runs over slots [0, k): K/V bytes never leave the
    device and never move on it, except when ``grown`` copies them, device to device, into larger buffers."""

    def __init__(self, engine: "OrtEngine", slots: int, capacity: int):
        cap = -(-int(capacity) // CAPACITY_STEP) * CAPACITY_STEP
        if engine.max_seq_len:
            cap = min(cap, engine.max_seq_len)
        self.slots, self.capacity = int(slots), cap
        self.shape = [self.slots, engine.num_kv_heads, cap, engine.head_dim]
        self.values = [ort.OrtValue.ortvalue_from_shape_and_type(self.shape, engine.kv_dtype, engine.device,
                                                                 engine.device_id) for _ in engine.past_names]
        self.row_bytes = engine.num_kv_heads * cap * engine.head_dim * np.dtype(engine.kv_dtype).itemsize
        self.lengths = np.zeros(self.slots, np.int64)   # tokens stored per slot
        self._rows: dict[tuple[int, int], _SlotRows] = {}

    def rows(self, a: int, b: int) -> "_SlotRows":
        """Slots [a, b) as a cache the engine runs on (made once per range: its IO binding is reused)."""
        if not 0 <= a < b <= self.slots:
            raise ValueError(f"slot range [{a}, {b}) outside [0, {self.slots})")
        v = self._rows.get((a, b))
        if v is None:
            v = self._rows[(a, b)] = _SlotRows(self, a, b)
        return v

    def grown(self, engine: "OrtEngine", capacity: int) -> "SlotKVCache":
        """A cache of ``capacity`` positions holding every slot's K/V and length (copied on the device)."""
        new = SlotKVCache(engine, self.slots, capacity)
        if new.capacity > self.capacity:
            engine._copy_kv(self.values, new.values)
        new.lengths[:] = self.lengths
        return new


class _SlotRows(_BoundKV):
    """Slots [a, b) of a :class:`SlotKVCache`: ``lengths`` is a view of the parent's, so the engine's updates land
    there; ``width`` is the attention-mask width the next call extends (0: a fresh prefill)."""

    def __init__(self, parent: SlotKVCache, a: int, b: int):
        self.parent, self.a = parent, a
        self.batch, self.capacity = b - a, parent.capacity
        self.lengths = parent.lengths[a:b]
        self.width = 0

    def bind_kv(self, io: ort.IOBinding, engine: "OrtEngine") -> None:
        shape = [self.batch] + self.parent.shape[1:]
        for name, pname, v in zip(engine.past_names, engine.present_names, self.parent.values):
            ptr = v.data_ptr() + self.a * self.parent.row_bytes
            io.bind_input(name, engine.device, engine.device_id, engine.kv_dtype, shape, ptr)
            io.bind_output(pname, engine.device, engine.device_id, engine.kv_dtype, shape, ptr)


class OrtEngine:
    """Generation runtime over a forge ONNX model dir (``model.onnx`` + external data + tokenizer files)."""

    def __init__(self, model_dir: str | os.PathLike, threads: int = 0, *, providers: Sequence[str] | None = None,
                 device: str = "cpu", model_file: str | None = None, level: str = "all", cuda_graph: bool = False,
                 static_decode: bool | None = None, device_id: int = 0, cpu_arena: bool = True,
                 prefill_graph: bool = True):
        """``prefill_graph`` False: prompts run on the decode graph even when the engine has a prompt graph
        (``prefill_model_file`` in its metadata), to check that graph alone. ``cpu_arena`` False: host buffers are
        allocated and freed per run instead of kept in ONNX Runtime's arena, whose memory outlives the session (measured: 3.1 GB kept after a one-shot run of a 2.6 GB fp16 graph on the
        CPU provider). For engines that run once (checks) and must give their memory back."""
        self.model_dir = Path(model_dir)
        meta_f = self.model_dir / "forge_ort.json"
        self.meta: dict[str, Any] = json.loads(meta_f.read_text()) if meta_f.exists() else {}
        self.model_path = self.model_dir / (model_file or self.meta.get("model_file") or "model.onnx")
        if not self.model_path.exists():
            raise FileNotFoundError(f"no ONNX model at {self.model_path}")
        self.threads, self.device, self.device_id = threads, device, int(device_id)
        self.options = session_options(threads, level, quiet=device == "cpu")
        self.options.enable_cpu_mem_arena = bool(cpu_arena)
        # what the graph's producer asks, everywhere and (per_token INT8) where u8 x s8 sums saturate
        asks = dict(self.meta.get("ort_session_config") or {})
        if self.meta.get(SATURATING_U8S8_CONFIG_KEY) and u8s8_saturates():   # the CPU is probed only when asked
            asks.update(self.meta[SATURATING_U8S8_CONFIG_KEY])
        for key, value in asks.items():
            self.options.add_session_config_entry(str(key), str(value))
        providers = list(providers or ["CPUExecutionProvider"])
        self.cuda_graph = bool(cuda_graph)
        if self.cuda_graph:
            if "CUDAExecutionProvider" not in providers or device != "cuda":
                raise ValueError("cuda_graph needs providers=['CUDAExecutionProvider'] and device='cuda'")
        if "CUDAExecutionProvider" in providers:
            # use_tf32 0: ORT's CUDA provider computes fp32 MatMuls in TF32 by default, which is not the fp32 an
            # fp32 engine claims (a fp32 graph's build check moved by 0.054 on the H200); a fp16 graph is unaffected.
            # Option names: onnxruntime/core/providers/cuda/cuda_execution_provider_info.cc (kUseTF32,
            # kEnableCudaGraph), microsoft/onnxruntime@90ed1589
            opts = {"device_id": str(device_id), "use_tf32": "0"}
            # the row-gather session (_gather_rows) runs where the logits are, without a CUDA graph (its index
            # input is on the host); the model's session with one when asked
            self._providers = [("CUDAExecutionProvider", opts) if p == "CUDAExecutionProvider" else p
                               for p in providers]
            providers = [("CUDAExecutionProvider", {**opts, **({"enable_cuda_graph": "1"} if self.cuda_graph else {})})
                         if p == "CUDAExecutionProvider" else p for p in providers]
        else:
            self._providers = providers
        self.session = inference_session(str(self.model_path), self.options, providers)
        # quantize.options.prefill: per_token -- a second graph for prompts (a call on an empty cache), where its
        # integer GEMM is fast and MatMulNBits is not; decode steps stay on the first. Which graph a row runs on
        # depends on its own phase only, never on its batch-mates: batch invariance holds per graph.
        prefill_file = self.meta.get("prefill_model_file") if prefill_graph and model_file is None else None
        self.prefill_session = inference_session(str(self.model_dir / prefill_file), self.options, providers) \
            if prefill_file else None
        # graphs the build stage gave a logits_start input (pipeline/ort/logits_start.py): a prompt that reads its
        # rows' last positions only asks for the logits from there on
        # (an initializer that is also a graph input: ORT lists it with the overridable initializers, not the inputs)
        self._sliced = {id(s) for s in (self.session, self.prefill_session)
                        if s is not None and LOGITS_START in {i.name for i in s.get_overridable_initializers()}}
        zero = np.zeros(1, np.int64)
        self._start_zero = (ort.OrtValue.ortvalue_from_numpy(zero), zero)   # the array the OrtValue aliases, kept
        ins = {i.name: i for i in self.session.get_inputs()}
        pat = re.compile(r"past_key_values\.(\d+)\.key$")
        layers = sorted(int(m.group(1)) for n in ins if (m := pat.match(n)))
        if not layers or "input_ids" not in ins or "attention_mask" not in ins:
            raise ValueError(f"{self.model_path} is not a forge KV-cache graph (inputs: {sorted(ins)})")
        self.layout = "concat" if "position_ids" in ins else "shared"
        self.num_layers = len(layers)
        k0 = ins["past_key_values.0.key"]
        self.num_kv_heads, self.head_dim = int(k0.shape[1]), int(k0.shape[3])
        self.kv_dtype = _ORT_TYPES.get(k0.type, np.float32)
        self.past_names = [f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]
        self.present_names = [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]
        out0 = self.session.get_outputs()[0]
        self.vocab_size = int(out0.shape[-1]) if isinstance(out0.shape[-1], int) else int(self.meta["vocab_size"])
        self.logits_dtype = _ORT_TYPES.get(out0.type, np.float32)
        # positions the graph can address (the rotary tables of a shared-layout graph end there)
        self.max_seq_len = int(self.meta.get("max_seq_len") or 0) or None
        self.eos_token_id = self.meta.get("eos_token_id")
        # Dynamic INT8 MatMuls quantize their activations with ONE scale per tensor, computed over the whole batch:
        # a row's numbers then depend on the rows (and padding) it is batched with. Such an engine answers each
        # request as it was validated only when rows run one at a time (the Triton model does that). The quantize
        # stage records it as ``batch_invariant`` (pipeline/ort/quantize.py: batch_invariant). An engine from before
        # the field counts as invariant only when unquantized: no batch-wide scales (tests/ort/test_batcher.py).
        self.batch_invariant = bool(self.meta.get("batch_invariant",
                                                  (self.meta.get("quantization") or {}).get("algo", "none") == "none"))
        self._tokenizer = None
        self._gather = None
        self._pad = None
        self._caches: dict[int, KVCache] = {}
        self._steps: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, ort.OrtValue]] = {}
        # fixed-shape decode (what a CUDA graph replays); on by itself with cuda_graph, testable on the CPU alone
        # (on the CPU it is not faster: dynamic 1.07x static at decode b1, 1.02x at b8, SmolLM2 INT8, 10 rounds in
        # alternating order, x86_64-avx512vnni)
        self.static_decode = self.cuda_graph if static_decode is None else bool(static_decode)
        if self.static_decode and self.layout != "shared":
            raise ValueError("fixed-shape decode (cuda_graph) needs the shared-KV (GroupQueryAttention) graph")
        self._graphs = 0   # CUDA graphs captured (each decode_static cache has its own gpu_graph_id)
        # prefill shapes vary: no CUDA graph (-1 = kCudaGraphAnnotationSkip, which only disables a capture). Set on
        # every provider: onnxruntime's python run_with_iobinding reads this entry per call (_graph_annotation_id,
        # onnxruntime/python/onnxruntime_inference_collection.py, microsoft/onnxruntime@dbbfd9e7), and a missing
        # one costs a raised and caught RuntimeError (~0.1 ms a decode step)
        self._prefill_opts = ort.RunOptions()
        self._prefill_opts.add_run_config_entry("gpu_graph_id", "-1")

    # ---- state ------------------------------------------------------------------------------------------------
    def cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache for ``batch`` rows of up to ``capacity`` positions, reused across calls: buffers are
        allocated only when a batch size is new or needs more positions than any call before."""
        if self.max_seq_len and capacity > self.max_seq_len:
            raise ValueError(f"{capacity} positions exceed the engine's max_seq_len {self.max_seq_len} "
                             "(prompt + new tokens; export.max_seq_len sets it)")
        c = self._caches.get(batch)
        if c is None or c.capacity < capacity or c.layout == "concat":
            cap = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
            if self.max_seq_len:
                cap = min(cap, self.max_seq_len)
            c = KVCache(self, batch, cap)
            if self.layout == "shared":
                self._caches[batch] = c
        c.reset()
        return c

    def _step_buffers(self, batch: int, capacity: int):
        """Preallocated decode-step buffers: ids [B,1], mask (flat, viewed as [B, width]), position ids, logits."""
        buf = self._steps.get(batch)
        if buf is None or buf[1].size < batch * capacity:
            ids = np.zeros((batch, 1), np.int64)
            mask = np.zeros(batch * max(capacity, 1), np.int64)
            pos = np.zeros((batch, 1), np.int64)
            # the OrtValue aliases the numpy array: ORT writes the logits where Python reads them, no copy
            logits_np = np.zeros((batch, 1, self.vocab_size), self.logits_dtype)
            logits = (ort.OrtValue.ortvalue_from_numpy(logits_np), logits_np)
            buf = self._steps[batch] = (ids, mask, pos, logits)
        return buf

    # ---- one graph call -----------------------------------------------------------------------------------------
    def forward(self, ids: np.ndarray, lengths: np.ndarray, cache: KVCache,
                logits_out: tuple[ort.OrtValue, np.ndarray] | None = None,
                mask_buf: np.ndarray | None = None, last_only: bool = False) -> np.ndarray:
        """Run ``ids`` [B, T] (row b's first ``lengths[b]`` tokens are real, the rest right padding) on top of
        ``cache`` and advance it. Returns logits [B, T, V]: with ``logits_out`` (an OrtValue and the numpy array
        it aliases) ORT writes into that array and it is returned. Without ``logits_out``, ``last_only``: only each
        row's last real position,
        [B, V] (what generation needs): on a GPU the logits stay there and only those rows are copied to the host
        (``_gather_rows``)."""
        B, T = ids.shape
        new_len = cache.lengths + lengths
        session = self.prefill_session if self.prefill_session is not None and cache.width == 0 else self.session
        if cache.layout == "shared":
            # KV buffers stay bound across steps: only ids, mask and logits are rebound
            io = cache.binding(self, session)
            # a prefill is as wide as its ids (GroupQueryAttention's first-prompt case: T == total); each later
            # call adds T columns, so row b's mask is len_b + t ones, then zeros
            width = T if cache.width == 0 else cache.width + T
            if width > cache.capacity:
                raise ValueError(f"KV cache of {cache.capacity} positions is full")
            flat = mask_buf if mask_buf is not None and mask_buf.size >= B * width else np.empty(B * width, np.int64)
            mask = flat[:B * width].reshape(B, width)
            np.less(np.arange(width)[None, :], new_len[:, None], out=mask, casting="unsafe")
            io.bind_cpu_input("attention_mask", mask)
            cache.width = width
        else:
            io = session.io_binding()
            valid = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
            mask = np.concatenate([cache.mask, valid], 1)
            pos = cache.lengths[:, None] + np.arange(T)[None, :]
            io.bind_cpu_input("attention_mask", mask)
            io.bind_cpu_input("position_ids", np.ascontiguousarray(pos, dtype=np.int64))
            for name, v in zip(self.past_names, cache.values):
                io.bind_ortvalue_input(name, v)
            for pname in self.present_names:
                io.bind_output(pname, self.device)
            cache.mask, cache.width = mask, mask.shape[1]
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
        start = 0
        if id(session) in self._sliced:
            # every call binds it: a shared-layout binding outlives the call, and the next may want every position.
            # As an OrtValue: bind_cpu_input looks the name up among the graph inputs without initializers and
            # refuses it (CheckIfTensor, onnxruntime/python/onnxruntime_pybind_state.cc)
            start = max(int(lengths.min()) - 1, 0) if last_only and logits_out is None else 0
            io.bind_ortvalue_input(LOGITS_START, self._start_zero[0] if start == 0 else
                                   ort.OrtValue.ortvalue_from_numpy(np.array([start], np.int64)))
        on_device = last_only and self.device != "cpu" and logits_out is None
        if logits_out is not None:
            io.bind_ortvalue_output("logits", logits_out[0])
        else:
            io.bind_output("logits", self.device if on_device else "cpu", self.device_id if on_device else 0)
        session.run_with_iobinding(io, self._prefill_opts)
        cache.lengths[:] = new_len
        if logits_out is not None and cache.layout == "shared":
            # ORT wrote into logits_out's array and the K/V in place: no output to wrap (get_outputs makes an
            # OrtValue per bound output, 61 on SmolLM2, ~0.2 ms a decode step)
            return logits_out[1]
        outs = io.get_outputs()   # in bind order: presents, then logits
        if cache.layout == "concat":
            cache.values = outs[:-1]
        logits = outs[-1]
        if logits_out is not None:
            return logits_out[1]
        if last_only:
            idx = np.maximum(lengths, 1) - 1 - start
            return self._gather_rows(logits, idx) if on_device else logits.numpy()[np.arange(B), idx]
        return logits.numpy()

    def _gather_rows(self, logits: ort.OrtValue, idx: np.ndarray) -> np.ndarray:
        """``logits[b, idx[b]]`` for every row, [B, V], computed where ``logits`` lives by a one-node GatherND
        (batch_dims 1) session on this engine's providers; only those rows reach the host. A 4 x 256 prefill's
        logits are 200 MB (vocab 49,152, fp32), and copying them to the host was most of its time on the H200.
        Needs the ``onnx`` package to write that graph; without it the whole tensor is copied."""
        if self._gather is None:
            try:
                from onnx import TensorProto, helper
            except ImportError:   # pragma: no cover - a Triton environment without onnx
                return logits.numpy()[np.arange(len(idx)), idx]
            elem = TensorProto.FLOAT16 if self.logits_dtype == np.float16 else TensorProto.FLOAT
            graph = helper.make_graph(
                [helper.make_node("GatherND", ["logits", "index"], ["rows"], batch_dims=1)], "forge_gather_rows",
                [helper.make_tensor_value_info("logits", elem, ["B", "T", "V"]),
                 helper.make_tensor_value_info("index", TensorProto.INT64, ["B", 1])],
                [helper.make_tensor_value_info("rows", elem, ["B", "V"])])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
            self._gather = inference_session(model.SerializeToString(), None, self._providers)
        io = self._gather.io_binding()
        io.bind_ortvalue_input("logits", logits)
        io.bind_cpu_input("index", np.ascontiguousarray(idx.reshape(-1, 1), dtype=np.int64))
        io.bind_output("rows", "cpu")
        self._gather.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()

    def decode(self, nxt: np.ndarray, cache: _BoundKV) -> np.ndarray:
        """One decode step for every row of ``cache``: each row's last token in, its next-token logits [B, V] out.
        Only the token ids, the attention mask and the logits rows cross between host and device; the K/V stay
        bound where they are. Fixed-shape (``decode_static``) when the engine decodes that way."""
        if self.static_decode:
            return self.decode_static(nxt, cache)
        B = cache.batch
        step_ids, mask_buf, _pos, logits_v = self._step_buffers(B, cache.capacity)
        step_ids[:, 0] = nxt
        return self.forward(step_ids, np.ones(B, np.int64), cache, logits_out=logits_v, mask_buf=mask_buf)[:, -1]

    def decode_static(self, nxt: np.ndarray, cache: _BoundKV) -> np.ndarray:
        """One decode step for every row through fixed-shape bound buffers (see the module doc): returns the
        last-position logits [B, V]. With cuda_graph the first call per cache captures, later calls replay."""
        B, cap = cache.batch, cache.capacity
        st = cache.static
        if st is None:
            # made once per cache: KV, ids, mask and logits bound at addresses that never change, which a CUDA
            # graph replay needs (a graph per cache: two caches of one shape have different K/V addresses)
            dev, i = self.device, self.device_id
            st = {"ids": ort.OrtValue.ortvalue_from_shape_and_type([B, 1], np.int64, dev, i),
                  "mask": ort.OrtValue.ortvalue_from_shape_and_type([B, cap], np.int64, dev, i),
                  "logits": ort.OrtValue.ortvalue_from_shape_and_type([B, 1, self.vocab_size], self.logits_dtype,
                                                                      dev, i),
                  "mask_np": np.zeros((B, cap), np.int64), "opts": ort.RunOptions()}
            if self.cuda_graph:
                self._graphs += 1
                st["opts"].add_run_config_entry("gpu_graph_id", str(self._graphs))
            io = st["io"] = self.session.io_binding()
            cache.bind_kv(io, self)
            io.bind_ortvalue_input("input_ids", st["ids"])
            io.bind_ortvalue_input("attention_mask", st["mask"])
            io.bind_ortvalue_output("logits", st["logits"])
            cache.static = st
        io = st["io"]
        new_len = cache.lengths + 1
        if int(new_len.max()) > cap:
            raise ValueError(f"KV cache of {cap} positions is full")
        np.less(np.arange(cap)[None, :], new_len[:, None], out=st["mask_np"], casting="unsafe")
        st["ids"].update_inplace(np.ascontiguousarray(nxt.reshape(B, 1), dtype=np.int64))
        st["mask"].update_inplace(st["mask_np"])
        if self.cuda_graph:
            io.synchronize_inputs()
        self.session.run_with_iobinding(io, st["opts"])
        if self.cuda_graph:
            io.synchronize_outputs()
        cache.lengths[:] = new_len
        cache.width = cap
        return st["logits"].numpy()[:, -1]

    def _copy_kv(self, src: Sequence[ort.OrtValue], dst: Sequence[ort.OrtValue]) -> None:
        """Copy each [S, kv, cap, hd] buffer of ``src`` into the first ``cap`` positions of the larger ``dst``
        buffer, where they live: a session of one ``Pad`` per buffer on this engine's providers (what
        ``SlotKVCache.grown`` needs when requests outgrow the slots). CUDA has Pad for fp16 and fp32 with
        ``pads`` read on the host (onnxruntime/core/providers/cuda/tensor/pad.cc, microsoft/onnxruntime@0606f7d6).
        Needs ``onnx`` to write that graph; without it the buffers go through the host (only when the cache
        grows, never per step)."""
        pad = np.zeros(8, np.int64)
        pad[6] = int(dst[0].shape()[2]) - int(src[0].shape()[2])      # end of the positions axis
        if self._pad is None:
            try:
                from onnx import TensorProto, helper
            except ImportError:   # pragma: no cover - a Triton environment without onnx
                for s, d in zip(src, dst):
                    d.update_inplace(np.pad(s.numpy(), [(0, int(p)) for p in pad[4:]]))
                return
            elem = TensorProto.FLOAT16 if self.kv_dtype == np.float16 else TensorProto.FLOAT
            n = len(self.past_names)
            dims = ["S", "H", "P", "D"]
            graph = helper.make_graph(
                [helper.make_node("Pad", [f"kv{i}", "pads"], [f"out{i}"], mode="constant") for i in range(n)],
                "forge_grow_kv",
                [helper.make_tensor_value_info(f"kv{i}", elem, dims) for i in range(n)]
                + [helper.make_tensor_value_info("pads", TensorProto.INT64, [8])],
                [helper.make_tensor_value_info(f"out{i}", elem, ["S", "H", "Q", "D"]) for i in range(n)])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
            self._pad = inference_session(model.SerializeToString(), None, self._providers)
        io = self._pad.io_binding()
        for i, (s, d) in enumerate(zip(src, dst)):
            io.bind_ortvalue_input(f"kv{i}", s)
            io.bind_ortvalue_output(f"out{i}", d)
        io.bind_cpu_input("pads", pad)
        self._pad.run_with_iobinding(io)

    # ---- scoring ---------------------------------------------------------------------------------------------
    def logits(self, input_ids: Any, attention_mask: Any | None = None, *, batch_size: int = 0,
               desc: str = "ORT logits") -> np.ndarray:
        """Full-sequence logits [B, T, V] (a prefill on an empty cache), ``batch_size`` rows per call (0 = all).
        ``attention_mask`` (1 = token, 0 = padding) must be right padding: each row's tokens first."""
        ids = np.asarray(input_ids.numpy() if hasattr(input_ids, "numpy") else input_ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        if attention_mask is None:
            lengths = np.full(ids.shape[0], ids.shape[1], np.int64)
        else:
            m = np.asarray(attention_mask.numpy() if hasattr(attention_mask, "numpy") else attention_mask)
            lengths = m.astype(bool).sum(1).astype(np.int64)
            if not np.array_equal(m.astype(bool), np.arange(ids.shape[1])[None, :] < lengths[:, None]):
                raise ValueError("attention_mask must be right padding (each row's tokens first, then zeros)")
        bs = batch_size or ids.shape[0]
        out = []
        with _bar(desc, ids.shape[0]) as advance:
            for s in range(0, ids.shape[0], bs):
                i, n = ids[s:s + bs], lengths[s:s + bs]
                out.append(self.forward(i, n, self.cache(i.shape[0], i.shape[1])))
                advance(i.shape[0])
        return np.concatenate(out, 0) if len(out) > 1 else out[0]

    def prefill(self, input_ids: Any) -> np.ndarray:
        """A prompt's first-token logits, [B, V]: a prefill of ``input_ids`` [B, T] (no padding) on an empty cache,
        only the last position leaving the device. What generation's time to first token pays (``logits`` returns
        every position, which evaluation needs)."""
        ids = np.asarray(input_ids, dtype=np.int64)
        ids = ids[None] if ids.ndim == 1 else ids
        lengths = np.full(ids.shape[0], ids.shape[1], np.int64)
        return self.forward(ids, lengths, self.cache(ids.shape[0], ids.shape[1]), last_only=True)

    def prefill_feed(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """A plain ``session.run`` feed for a prefill of ``ids`` [B, T] (no padding) on an empty cache, for
        callers that add graph outputs (calibration statistics)."""
        B, T = ids.shape
        feed = {"input_ids": np.ascontiguousarray(ids, dtype=np.int64), "attention_mask": np.ones((B, T), np.int64)}
        if self.layout == "concat":
            feed["position_ids"] = np.broadcast_to(np.arange(T), (B, T)).astype(np.int64)
        past = np.zeros((B, self.num_kv_heads, T if self.layout == "shared" else 0, self.head_dim), self.kv_dtype)
        feed.update({n: past for n in self.past_names})
        return feed

    # ---- generation ------------------------------------------------------------------------------------------
    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
                       greedy: bool | Sequence[bool] = True, temperature: float | Sequence[float] = 1.0,
                       top_k: int | Sequence[int] = 0, top_p: float | Sequence[float] = 1.0,
                       seed: int | Sequence[int] = 0,
                       eos_token_id: int | None | Sequence[int | None] = None) -> list[list[int]]:
        """Generate for prompts of different lengths at once; returns the new tokens of each prompt, cut after its
        EOS or its own ``max_new_tokens``. Every sampling argument may be one value or one per prompt (the Triton
        model batches requests with their own settings). Prefill once (right padding), then one token per step
        for all rows through the in-place KV cache."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        B = len(prompts)
        n_new = [int(n) for n in _per_row(max_new_tokens, B, "max_new_tokens")]
        if any(n < 1 for n in n_new):
            raise ValueError("max_new_tokens must be >= 1")
        greedy_r = _per_row(greedy, B, "greedy")
        temp_r, topk_r = _per_row(temperature, B, "temperature"), _per_row(top_k, B, "top_k")
        topp_r, eos_r = _per_row(top_p, B, "top_p"), _per_row(eos_token_id, B, "eos_token_id")
        rngs = [np.random.default_rng(int(s)) for s in _per_row(seed, B, "seed")]
        all_greedy = all(bool(g) or float(t) <= 0 for g, t in zip(greedy_r, temp_r))
        lens = np.array([len(p) for p in prompts], np.int64)
        L, N = int(lens.max()), max(n_new)
        ids = np.zeros((B, L), np.int64)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = p
        cache = self.cache(B, int(lens.max()) + N if self.layout == "concat" else L + N)
        out: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, bool)

        def pick(last: np.ndarray) -> np.ndarray:
            if all_greedy:
                return last.argmax(-1)
            nxt = np.empty(B, np.int64)
            for r in range(B):
                nxt[r] = sample_next(last[r:r + 1], rngs[r], greedy=bool(greedy_r[r]), temperature=float(temp_r[r]),
                                     top_k=int(topk_r[r]), top_p=float(topp_r[r]))[0]
            return nxt

        with _bar("ORT generate", N) as advance:
            last = self.forward(ids, lens, cache, last_only=True)
            for step in range(N):
                nxt = pick(last)
                for r in range(B):
                    if not done[r]:
                        t = int(nxt[r])
                        out[r].append(t)
                        if (eos_r[r] is not None and t == eos_r[r]) or len(out[r]) >= n_new[r]:
                            done[r] = True
                advance(1)
                if done.all():
                    break
                last = self.decode(nxt, cache)
        return out

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, greedy: bool = True,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_id: int | None = None) -> list[int]:
        """New tokens for one prompt (prefill once, then one token per step through the KV cache)."""
        return self.generate_batch([list(prompt_ids)], max_new_tokens, greedy=greedy, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id)[0]

    # ---- text helpers (need the `tokenizers` package) ---------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        return self._tokenizer

    def generate_text(self, text: str, max_new_tokens: int, **kw) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        kw.setdefault("eos_token_id", self.eos_token_id if isinstance(self.eos_token_id, int) else None)
        return self.tokenizer.decode(self.generate(ids, max_new_tokens, **kw))
