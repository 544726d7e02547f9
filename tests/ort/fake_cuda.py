"""Test-only stand-in for the parts of ``onnxruntime`` that forge's engine drives on the CUDA provider (no GPU here).

NOT an engine and not ONNX Runtime: it lets ``pipeline/ort/engine.py`` run its CUDA code path (``device="cuda"``,
IO binding, device OrtValues, optional CUDA graphs) unchanged, and records what a real GPU would have moved:

* device memory is a fake address space: ``OrtValue.ortvalue_from_shape_and_type(..., "cuda")`` allocates a block
  at an address; ``data_ptr()`` gives it; ``IOBinding.bind_input/bind_output(..., buffer_ptr)`` resolve a pointer
  into a block (out of bounds, or into a freed block, raises);
* every host<->device transfer goes to ``Ledger.copies`` as (kind, tensor name, bytes): ``bind_cpu_input`` of a
  CUDA session's input and a host-bound output of it (what ORT copies per run), ``OrtValue.numpy()`` (D2H),
  ``update_inplace`` and ``ortvalue_from_numpy`` onto the device (H2D); device-to-device Pad runs are ``d2d``;
* a CUDA graph (provider option ``enable_cuda_graph``) is "captured" at the first run of each ``gpu_graph_id``
  (its bound addresses and shapes recorded; a host input refused) and every replay must bind the same addresses;
* the forge KV graph (``model.onnx`` next to a ``forge_ort.json``) is a deterministic tiny attention model with
  GroupQueryAttention's cache contract: past and present must be ONE buffer (``past_present_share_buffer``),
  ``seqlens_k`` = mask row sums - 1, a prompt only when T == mask width (batch > 1 with T > 1 on a past is refused,
  as the real op does), token ids outside the vocabulary raise. Each row is computed on its own (batch-invariant
  unless ``forge_ort.json`` says ``batch_invariant: false``) from the K/V stored in the bound buffer, so a
  misplaced or stale K/V row changes the tokens;
* any other model (the engine's one-node helper graphs: GatherND, Pad) runs through ``onnx.reference``.

``fake_onnxruntime()`` makes one such module (its own ledger and memory); ``load_engine(fake)`` loads a private copy
of ``pipeline/ort/engine.py`` that uses it (registered in ``sys.modules``, as the Triton model loads its copy).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import weakref
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
_TYPES = {np.dtype(np.float32): "tensor(float)", np.dtype(np.float16): "tensor(float16)",
          np.dtype(np.int64): "tensor(int64)"}


class FakeCudaError(RuntimeError):
    """What the real provider would refuse (bad pointer, graph replay at other addresses, broken GQA contract)."""


class Ledger:
    def __init__(self):
        self.copies: list[tuple[str, str, int]] = []     # (h2d | d2h | d2d, tensor name, bytes)
        self.allocs: list[tuple[str, tuple, str]] = []   # (device, shape, dtype)
        self.runs: list[tuple[str, str | None, tuple]] = []   # (graph, gpu_graph_id or None, input_ids shape)
        self.captures: dict[str, dict] = {}               # gpu_graph_id -> bound (name: (addr, shape))

    def copy(self, kind: str, name: str, nbytes: int) -> None:
        self.copies.append((kind, name, int(nbytes)))

    def clear(self) -> None:
        self.copies.clear()
        self.runs.clear()

    def bytes(self, kind: str, names=None) -> int:
        return sum(n for k, nm, n in self.copies if k == kind and (names is None or nm in names))

    def names(self, *kinds: str) -> set[str]:
        return {nm for k, nm, _ in self.copies if not kinds or k in kinds}


class _Memory:
    """A fake device address space: blocks of bytes at addresses; a block is freed with its OrtValue."""

    def __init__(self):
        self.blocks: dict[int, np.ndarray] = {}
        self.next = 1 << 40

    def alloc(self, nbytes: int) -> int:
        addr = self.next
        self.next += (int(nbytes) // 4096 + 2) * 4096
        self.blocks[addr] = np.zeros(max(int(nbytes), 1), np.uint8)
        return addr

    def view(self, ptr: int, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        for base, buf in self.blocks.items():
            if base <= ptr < base + buf.size:
                if ptr - base + nbytes > buf.size:
                    raise FakeCudaError(f"binding of {nbytes} bytes at {ptr:#x} runs past its allocation")
                return np.ndarray(tuple(shape), dtype, buffer=buf, offset=ptr - base)
        raise FakeCudaError(f"pointer {ptr:#x} is in no live device allocation (freed, or never allocated)")


def fake_onnxruntime() -> types.SimpleNamespace:
    """A fresh fake ``onnxruntime`` module with its own ledger and device memory."""
    ledger, mem = Ledger(), _Memory()

    class OrtValue:
        def __init__(self, array: np.ndarray, device: str, addr: int | None = None):
            self._a, self._device, self._addr = array, device, addr
            self.tag = "value"

        @classmethod
        def _on_device(cls, shape, dtype, device: str) -> "OrtValue":
            shape, dtype = [int(d) for d in shape], np.dtype(dtype)
            ledger.allocs.append((device, tuple(shape), dtype.name))
            if device == "cpu":
                return cls(np.zeros(shape, dtype), "cpu")
            if device != "cuda":
                raise FakeCudaError(f"unknown device {device!r}")
            addr = mem.alloc(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
            v = cls(mem.view(addr, shape, dtype), "cuda", addr)
            weakref.finalize(v, mem.blocks.pop, addr, None)
            return v

        @classmethod
        def ortvalue_from_shape_and_type(cls, shape, element_type, device_type="cpu", device_id=0):
            return cls._on_device(shape, element_type, device_type)

        @classmethod
        def ortvalue_from_numpy(cls, arr, device_type="cpu", device_id=0):
            arr = np.asarray(arr)
            if device_type == "cpu":
                return cls(arr, "cpu")      # aliases the numpy memory, as ORT does on the CPU
            v = cls._on_device(arr.shape, arr.dtype, device_type)
            v._a[...] = arr
            ledger.copy("h2d", "ortvalue_from_numpy", arr.nbytes)
            return v

        def device_name(self) -> str:
            return self._device

        def shape(self) -> list[int]:
            return list(self._a.shape)

        def data_ptr(self) -> int:
            return self._addr if self._device == "cuda" else self._a.ctypes.data

        def numpy(self) -> np.ndarray:
            if self._device == "cuda":
                ledger.copy("d2h", self.tag, self._a.nbytes)
                return self._a.copy()
            return self._a

        def update_inplace(self, arr) -> None:
            arr = np.asarray(arr)
            if arr.shape != self._a.shape:
                raise FakeCudaError(f"update_inplace of {arr.shape} into {self._a.shape}")
            if self._device == "cuda":
                ledger.copy("h2d", self.tag, arr.nbytes)
            self._a[...] = arr

    class IOBinding:
        def __init__(self, session):
            self.session = session
            self.inputs: dict[str, tuple] = {}     # name -> (device, array, addr)
            self.outputs: dict[str, tuple] = {}    # name -> ("value", OrtValue) | ("alloc", device)
            self.results: list[OrtValue] = []

        def bind_cpu_input(self, name, arr):
            self.inputs[name] = ("cpu", np.asarray(arr), None)

        def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
            if device_type != "cuda":
                raise FakeCudaError("the fake binds pointers into device memory only")
            self.inputs[name] = ("cuda", mem.view(buffer_ptr, shape, element_type), buffer_ptr)

        def bind_ortvalue_input(self, name, v):
            v.tag = name
            self.inputs[name] = (v._device, v._a, v.data_ptr())

        def bind_output(self, name, device_type="cpu", device_id=0, element_type=None, shape=None, buffer_ptr=None):
            if buffer_ptr is None:
                self.outputs[name] = ("alloc", device_type)
                return
            if device_type != "cuda":
                raise FakeCudaError("the fake binds pointers into device memory only")
            v = OrtValue(mem.view(buffer_ptr, shape, element_type), "cuda", buffer_ptr)
            self.outputs[name] = ("value", v)

        def bind_ortvalue_output(self, name, v):
            v.tag = name
            self.outputs[name] = ("value", v)

        def synchronize_inputs(self):
            pass

        def synchronize_outputs(self):
            pass

        def get_outputs(self):
            return list(self.results)

    class RunOptions:
        def __init__(self):
            self.entries: dict[str, str] = {}

        def add_run_config_entry(self, key, value):
            self.entries[key] = str(value)

    class SessionOptions:
        pass

    class _Info:
        def __init__(self, name, shape, type_):
            self.name, self.shape, self.type = name, shape, type_

    class InferenceSession:
        def __init__(self, model, sess_options=None, providers=None):
            names = [p[0] if isinstance(p, tuple) else p for p in (providers or ["CPUExecutionProvider"])]
            opts = next((p[1] for p in providers or [] if isinstance(p, tuple)), {})
            self._providers = names
            self.device = "cuda" if names and names[0] == "CUDAExecutionProvider" else "cpu"
            self.graphs = opts.get("enable_cuda_graph") == "1"
            if isinstance(model, (bytes, bytearray)):
                import onnx
                from onnx.reference import ReferenceEvaluator
                proto = onnx.load_from_string(bytes(model))
                self.name, self.lm = proto.graph.name, None
                self.evaluator = ReferenceEvaluator(proto)
                self._in = [_Info(i.name, None, "") for i in proto.graph.input]
                self._out = [_Info(o.name, None, "") for o in proto.graph.output]
            else:
                meta = json.loads((Path(model).parent / "forge_ort.json").read_text())
                self.name, self.lm = "forge_kv_graph", _TinyGQA(meta)
                self._in, self._out = self.lm.io(_Info)

        def get_inputs(self):
            return self._in

        def get_outputs(self):
            return self._out

        def get_overridable_initializers(self):   # the fake graphs have none (no logits_start)
            return []

        def get_providers(self):
            return self._providers

        def io_binding(self):
            return IOBinding(self)

        def run_with_iobinding(self, io, run_options=None):
            gid = None
            if self.graphs:   # a session with CUDA graphs captures every run not told gpu_graph_id -1 (id 0 default)
                gid = run_options.entries.get("gpu_graph_id", "0") if run_options is not None else "0"
                if gid != "-1":
                    self._graph(io, gid)
            ins = {}
            for name, (dev, arr, _addr) in io.inputs.items():
                if dev == "cpu" and self.device == "cuda":
                    ledger.copy("h2d", name, arr.nbytes)     # ORT copies a host input to the device
                ins[name] = arr
            ids = ins.get("input_ids")
            ledger.runs.append((self.name, gid, None if ids is None else tuple(ids.shape)))
            if self.lm is not None:
                outs = self.lm.run(ins, {n: b[1]._a for n, b in io.outputs.items() if b[0] == "value"})
            else:
                feed = {k: np.array(v) for k, v in ins.items()}
                res = self.evaluator.run(None, feed)
                outs = {o.name: r for o, r in zip(self._out, res)}
                if self.name == "forge_grow_kv":
                    ledger.copy("d2d", self.name, sum(r.nbytes for r in res))
            io.results = []
            for name, b in io.outputs.items():
                val = outs[name]
                if b[0] == "value":
                    v = b[1]
                    if val is not v._a:
                        if tuple(val.shape) != tuple(v._a.shape):
                            raise FakeCudaError(f"output {name} of shape {val.shape} into a bound {v._a.shape}")
                        v._a[...] = val
                    if v._device == "cpu" and self.device == "cuda":
                        ledger.copy("d2h", name, v._a.nbytes)
                    io.results.append(v)
                else:
                    v = OrtValue._on_device(val.shape, val.dtype, b[1] if self.device == "cuda" else "cpu")
                    v._a[...] = val
                    v.tag = name
                    if b[1] == "cpu" and self.device == "cuda":
                        ledger.copy("d2h", name, v._a.nbytes)
                    io.results.append(v)

        def _graph(self, io, gid):
            bound = {}
            for name, (dev, arr, addr) in io.inputs.items():
                if dev != "cuda":
                    raise FakeCudaError(f"CUDA graph {gid}: input {name} is on the host (a replay cannot copy it)")
                bound[name] = (addr, arr.shape)
            for name, b in io.outputs.items():
                if b[0] != "value" or b[1]._device != "cuda":
                    raise FakeCudaError(f"CUDA graph {gid}: output {name} is not a preallocated device buffer")
                bound[name] = (b[1].data_ptr(), b[1]._a.shape)
            seen = ledger.captures.setdefault(gid, bound)
            if seen != bound:
                raise FakeCudaError(f"CUDA graph {gid} replayed with other buffers than it captured")

    gol = types.SimpleNamespace(ORT_DISABLE_ALL=0, ORT_ENABLE_BASIC=1, ORT_ENABLE_EXTENDED=2, ORT_ENABLE_ALL=99)
    return types.SimpleNamespace(
        __version__="fake", OrtValue=OrtValue, IOBinding=IOBinding, InferenceSession=InferenceSession,
        SessionOptions=SessionOptions, RunOptions=RunOptions, GraphOptimizationLevel=gol,
        get_available_providers=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
        preload_dlls=lambda **kw: None, ledger=ledger, memory=mem)


class _TinyGQA:
    """A deterministic attention model with GroupQueryAttention's cache contract (see the module doc). Each layer
    keeps one K and one V per kv head and position: K = E_k[token] + P[position], V = E_v[token]; a position's
    query attends over the row's stored K/V up to itself; logits = sum over layers of the heads' outputs times W,
    plus a bigram term. When ``forge_ort.json`` says ``batch_invariant: false``, every row's logits also get a term
    that depends on the batch size (a batch-wide effect, as dynamic INT8's one activation scale per tensor is):
    the control for tests that rely on batch invariance."""

    def __init__(self, meta: dict):
        self.L, self.H, self.D = int(meta["num_layers"]), int(meta["num_kv_heads"]), int(meta["head_dim"])
        self.V, self.P = int(meta["vocab_size"]), int(meta["max_seq_len"])
        self.kv_dtype = np.float16 if meta.get("dtype") == "fp16" else np.float32
        self.invariant = meta.get("batch_invariant", True) is not False
        rng = np.random.default_rng(20240607)
        L, H, D, V = self.L, self.H, self.D, self.V
        self.ek, self.ev = rng.standard_normal((L, V, H, D)), rng.standard_normal((L, V, H, D))
        self.eq = rng.standard_normal((L, V, H, D)) * 2.0
        self.pos = rng.standard_normal((self.P, D))
        self.w = rng.standard_normal((L, H, D, V))
        self.bigram = rng.standard_normal((V, V)) * 0.5

    def io(self, info):
        kv = [f"past_key_values.{i}.{k}" for i in range(self.L) for k in ("key", "value")]
        t = "tensor(float16)" if self.kv_dtype == np.float16 else "tensor(float)"
        ins = [info("input_ids", ["B", "T"], "tensor(int64)"), info("attention_mask", ["B", "W"], "tensor(int64)")]
        ins += [info(n, ["B", self.H, "C", self.D], t) for n in kv]
        outs = [info("logits", ["B", "T", self.V], "tensor(float)")]
        outs += [info(n.replace("past_key_values", "present"), ["B", self.H, "C", self.D], t) for n in kv]
        return ins, outs

    def run(self, ins: dict, bound_out: dict) -> dict:
        ids, mask = ins["input_ids"], ins["attention_mask"]
        B, T = ids.shape
        W = mask.shape[1]
        if ids.min() < 0 or ids.max() >= self.V:
            raise FakeCudaError(f"input_ids: index {int(ids.max())} out of range [0, {self.V})")
        if T > 1 and T != W and B != 1:
            raise FakeCudaError("batch_size must be 1 when sequence_length > 1 and past context is given.")
        if T > 1 and T != W:
            raise FakeCudaError("the fake models prompts on an empty cache and one-token decode steps only")
        first = T == W
        seqlens = mask.sum(1).astype(np.int64)
        outs = {}
        caches = []
        for i in range(self.L):
            pair = []
            for kind in ("key", "value"):
                past, pname = ins[f"past_key_values.{i}.{kind}"], f"present.{i}.{kind}"
                pres = bound_out.get(pname)
                if pres is None or past.shape != pres.shape or \
                        past.__array_interface__["data"][0] != pres.__array_interface__["data"][0]:
                    raise FakeCudaError(f"{pname} is not bound to the buffer of its past (the fake models "
                                        "GroupQueryAttention's shared past/present buffer only)")
                if past.shape[0] != B or past.shape[2] < W:
                    raise FakeCudaError(f"KV buffer {past.shape} for batch {B} and {W} positions")
                if past.dtype != self.kv_dtype:
                    raise FakeCudaError(f"KV buffer of {past.dtype}, graph wants {np.dtype(self.kv_dtype)}")
                outs[pname] = pres
                pair.append(past)
            caches.append(pair)
        logits = np.zeros((B, T, self.V))
        for b in range(B):
            n = int(seqlens[b])
            start = 0 if first else n - 1
            for t in range(T):
                p, tok = start + t, int(ids[b, t])
                for i, (K, Vv) in enumerate(caches):
                    K[b, :, p] = self.ek[i, tok] + self.pos[p]
                    Vv[b, :, p] = self.ev[i, tok]
            for t in range(T):
                p, tok = start + t, int(ids[b, t])
                upto = min(p, n - 1) + 1
                acc = self.bigram[tok].copy()
                for i, (K, Vv) in enumerate(caches):
                    k = K[b, :, :upto].astype(np.float64)            # [H, upto, D]
                    v = Vv[b, :, :upto].astype(np.float64)
                    q = self.eq[i, tok] + self.pos[p]                   # [H, D]
                    s = np.einsum("hd,hpd->hp", q, k) / np.sqrt(self.D)
                    a = np.exp(s - s.max(-1, keepdims=True))
                    a /= a.sum(-1, keepdims=True)
                    acc += np.einsum("hp,hpd,hdv->v", a, v, self.w[i])
                logits[b, t] = acc
        if not self.invariant:
            logits += 2.0 * np.sin(np.arange(self.V) * (1 + B))
        outs["logits"] = logits.astype(np.float32)
        return outs


def write_model(path: Path, *, layers: int = 2, kv_heads: int = 2, head_dim: int = 8, vocab: int = 256,
                max_seq_len: int = 256, dtype: str = "fp16", batch_invariant: bool | None = None) -> Path:
    """A model dir the fake loads: ``forge_ort.json`` (what OrtEngine reads) and an empty ``model.onnx``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.onnx").write_bytes(b"")
    meta = {"format": "forge-ort-kv/2", "model_file": "model.onnx", "dtype": dtype, "kv_layout": "shared",
            "max_seq_len": max_seq_len, "num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "vocab_size": vocab, "quantization": None, "eos_token_id": 2}
    if batch_invariant is not None:
        meta["batch_invariant"] = batch_invariant
    (path / "forge_ort.json").write_text(json.dumps(meta))
    return path


def load_engine(fake: types.SimpleNamespace, name: str = "forge_fake_cuda_engine") -> types.ModuleType:
    """A private copy of pipeline/ort/engine.py whose ``ort`` is ``fake`` (the Triton model loads its engine copy
    the same way, by module name); CUDA library preloading is a no-op in it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "pipeline" / "ort" / "engine.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    mod.ort = fake

    def inference_session(model, options, providers):
        return fake.InferenceSession(model, options, providers=list(providers))
    mod.inference_session = inference_session
    return mod
