"""The CUDA recipes' fp16 graph written straight from the HF weights, tensor by tensor (issue 38).

The fp32 path (pipeline/ort/export.py, then pipeline/ort/fp16.py at build time) peaks at 4.0x (export: torch.export
in fp32 plus parity) and 6.9x (build: ONNX Runtime's float16 tool holds the whole protobuf) the model's fp16 bytes of
host RAM. This writer never makes an fp32 graph and never holds a weight-bearing protobuf: the graph is a few hundred
nodes written with ``onnx.helper``, and every initializer is an external-data region of ``model.onnx.data`` filled
slice by slice from the safetensors (pipeline/weights.py, pipeline/ort/extdata.py).

The graph is the one the build stage made from the fp32 export until now, so the engine (pipeline/ort/engine.py),
evaluate and the Triton model run it unchanged:

- inputs ``input_ids``, ``attention_mask`` (row sums and width read, GroupQueryAttention's mask contract as in
  pipeline/ort/export.py), ``past_key_values.{i}.key/value`` fp16 [batch, kv_heads, capacity, head_dim];
  outputs ``logits`` fp32 and ``present.{i}.key/value`` fp16, shaped like the past (one shared buffer per layer);
- ``com.microsoft.GroupQueryAttention`` with rotary inside (cos/sin tables up to ``max_seq`` positions, fp16, taken
  from the model's own rotary module as the fp32 export does), fed one packed QKV projection (pipeline/ort/pack_qkv.py
  explains the contract) plus its concatenated bias where the model has q/k/v biases;
- RMSNorms as ``SimplifiedLayerNormalization`` with fp32 statistics inside the kernel (``stash_type`` 1; why fp16
  statistics overflow: pipeline/ort/fp16.py), SiLU as Sigmoid * x, fp16 residual stream, the lm_head in fp16 and one
  Cast to fp32 logits.

Node names are the torch module paths (``model.layers.3.mlp.down_proj``; the packed projection
``model.layers.3.self_attn.qkv_proj`` lists the modules it packs in its ``forge.modules`` metadata), which is what
the quantize stage's ``exclude`` patterns match.

Families: the decoder the GQA export already accepts (pipeline/ort/export.py ``check_gqa_model``: q/k/v/o
projections, full non-interleaved rotary, no sliding window) with RMSNorm and a SiLU-gated MLP, i.e. the
``model_type`` values in :data:`FAMILIES`; anything else is refused with the recipe key that avoids this writer.

Parity is checked against the torch model as before, but in sequence: the ORT engine's logits are taken first and
the engine released, then the torch model is loaded (pipeline/weights.py) on ``reference_device``; the two never hold
their weights at once, which is what keeps the stage within 2.5x the fp16 bytes (docs/gpu-runs.md, issue 38).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from pipeline.errors import ForgeError, StageFailed
from pipeline.progress import progress_bar

from .export import KV_LAYOUT, META_FILE, MODEL_FILE, check_gqa_model, kv_dims, check_parity, copy_side_files, \
    io_names, model_bytes
from .extdata import DataFile

__all__ = ["export_fp16_stream", "FAMILIES", "DEFAULT_FP16_PARITY", "WRITER", "reference_device"]

FAMILIES = ("llama", "mistral", "qwen2")
WRITER = "forge-stream-fp16/1"
# ORT on the CPU (fp16 weights and activations, fp32 norm statistics) vs the FP32 torch model, max abs error of the
# logits: 0.060 on SmolLM2-135M (logits up to 33; 0.047 above 2 % of |ref|), bitwise the same as the fp32 export
# converted by ORT's float16 tool; 0.0053 on the Qwen2.5-7B shape (1 layer, random weights); 3e-4 on a tiny Qwen2.
# A broken graph is off by the logits' own spread (std 4.8 on SmolLM2). export.parity.fp16 in a recipe replaces it.
DEFAULT_FP16_PARITY = {"atol": 0.1, "rtol": 0.02}
WHOLE_BYTES = 256 << 20   # a projection up to this size is transposed in memory and written in one go


def reference_device(requested: str = "auto") -> str:
    """Where the parity reference runs: ``auto`` is the GPU when torch sees one (the model then costs no host
    memory), else the CPU."""
    if requested != "auto":
        return requested
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _meta_model(hf_dir: Path):
    """The model's modules with parameters on the meta device (no weight memory) and real buffers (rotary)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(hf_dir)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(cfg)


def _check_family(model) -> None:
    cfg = model.config
    problems = []
    if cfg.model_type not in FAMILIES:
        problems.append(f"model_type {cfg.model_type!r} (the writer knows {', '.join(FAMILIES)})")
    if getattr(cfg, "hidden_act", None) != "silu":
        problems.append(f"hidden_act {getattr(cfg, 'hidden_act', None)!r} (SiLU-gated MLPs only)")
    mlp = model.model.layers[0].mlp
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        problems.append("an MLP without gate/up/down projections")
    if problems:
        raise ForgeError(f"export: the streaming fp16 writer (build.onnxruntime.provider: cuda, precision: fp16) "
                         f"cannot write {type(model).__name__}: {'; '.join(problems)}; set export.attention: standard "
                         "in the recipe (the fp32 export, converted to fp16 at build time)")
    check_gqa_model(model)


class _Writer:
    """The graph under construction: nodes, small constants, and the external-data layout of the weights."""

    def __init__(self, data: DataFile):
        self.data = data
        self.nodes, self.inits, self.fills = [], [], []

    def weight(self, name: str, shape, fill) -> str:
        """An fp16 initializer filled later by ``fill(data_file, name)``."""
        self.inits.append(self.data.add(name, shape, np.float16))
        self.fills.append((name, fill))
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], name: str, *, domain: str = "",
             modules: list[str] | None = None, **attrs) -> list[str]:
        from onnx import helper
        n = helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs)
        if modules:   # onnx has no helper for node metadata: the field is set directly
            p = n.metadata_props.add()
            p.key, p.value = "forge.modules", ",".join(modules)
        self.nodes.append(n)
        return outputs


def _fits_fp16(t, name: str):
    """``t`` (a torch slice) unchanged; a ForgeError when a finite value would overflow fp16 (|x| >= 65520 rounds to
    inf; an fp16 engine cannot hold it). One min/max pass, no temporaries."""
    import torch

    if t.numel() and t.dtype != torch.float16:
        lo, hi = torch.aminmax(t)
        if (float(hi) >= 65520 or float(lo) <= -65520) and bool(torch.isfinite(t).all()):
            raise ForgeError(f"export: weight {name} has values beyond fp16's range (|x| > 65504); this model cannot "
                             "be built with build.onnxruntime.precision: fp16")
    return t


def _to_fp16(t, name: str) -> np.ndarray:
    import torch
    return _fits_fp16(t, name).to(torch.float16).numpy()


def _fill_copy(w, src: str):
    def fill(data: DataFile, name: str):
        for s, part in w.iter_rows(src):
            data.write_rows(name, s, _to_fp16(part, src))
    return fill


def _fill_linear(w, srcs: list[str]):
    """B [K, sum(N_i)] = concat(W_i^T) of nn.Linear weights W_i [N_i, K]: each slice of W_i's rows is a block of
    B's columns. B is assembled in memory and written once when it is
    at most WHOLE_BYTES (every projection of a 7B model), else each block goes to the file as it comes (one write
    per row of B: the embedding-sized lm_head)."""
    import torch

    def fill(data: DataFile, name: str):
        k, n = data.regions[name][1]
        whole = torch.empty((k, n), dtype=torch.float16) if k * n * 2 <= WHOLE_BYTES else None
        col = 0
        for src in srcs:
            # the column-block path writes one segment per row of B: larger slices, fewer and longer writes
            for s, part in w.iter_rows(src, None if whole is not None else WHOLE_BYTES // 2):
                _fits_fp16(part, src)
                a = col + s
                part = part.to(torch.float16)   # then transpose: 2.4x faster than one converting transposed copy
                if whole is not None:
                    whole[:, a:a + part.shape[0]].copy_(part.T)
                else:
                    data.write_cols(name, a, part.T.contiguous().numpy())
            col += w.shape[src][0]
        if whole is not None:
            data.write_rows(name, 0, whole.numpy())
    return fill


def _fill_bias(w, srcs: list[str], widths: list[int]):
    def fill(data: DataFile, name: str):
        out = np.zeros(sum(widths), np.float16)
        col = 0
        for src, n in zip(srcs, widths):
            if src in w.shape:
                out[col:col + n] = _to_fp16(w.tensor(src), src)
            col += n
        data.write_rows(name, 0, out)
    return fill


def _build(w, model, writer: _Writer, max_pos: int) -> dict:
    """Nodes and initializers of the whole graph (see the module doc); returns counts for the metrics."""
    import torch
    from onnx import TensorProto

    cfg = model.config
    layers, kv, hd = kv_dims(cfg)
    heads, hidden, vocab = cfg.num_attention_heads, cfg.hidden_size, cfg.vocab_size
    eps = float(cfg.rms_norm_eps)
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) or "lm_head.weight" not in w.shape
    n = writer.node

    # rotary tables exactly as the fp32 export takes them (pipeline/ort/export.py _gqa_wrapper), then fp16
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(max_pos)[None])
    writer.const("cos_cache", cos[0, :, : hd // 2].float().numpy().astype(np.float16))
    writer.const("sin_cache", sin[0, :, : hd // 2].float().numpy().astype(np.float16))
    one = writer.const("forge_one_i64", np.array([1], np.int64))
    n("ReduceSum", ["attention_mask", one], ["mask_rowsum"], "attention_mask_rowsum", keepdims=0)
    n("Sub", ["mask_rowsum", one], ["mask_rowsum_m1"], "attention_mask_seqlens")
    n("Cast", ["mask_rowsum_m1"], ["seqlens_k"], "attention_mask_seqlens_i32", to=TensorProto.INT32)
    n("Shape", ["attention_mask"], ["mask_width"], "attention_mask_width", start=1, end=2)
    n("Squeeze", ["mask_width"], ["mask_width_scalar"], "attention_mask_width_scalar")
    n("Cast", ["mask_width_scalar"], ["total_seq_len"], "attention_mask_total_i32", to=TensorProto.INT32)

    def linear(x: str, module: str, srcs: list[str], out: str, modules: list[str] | None = None) -> str:
        """MatMul by the (concatenated, transposed) weights of ``srcs``, plus their bias where any has one."""
        k = w.shape[srcs[0]][1]
        widths = [w.shape[s][0] for s in srcs]
        bias = [s.removesuffix("weight") + "bias" for s in srcs]
        has_bias = any(b in w.shape for b in bias)
        b = writer.weight(f"{module}.weight", (k, sum(widths)), _fill_linear(w, srcs))
        y = n("MatMul", [x, b], [out + "_mm" if has_bias else out], module, modules=modules)[0]
        if has_bias:
            bname = writer.weight(f"{module}.bias", (sum(widths),), _fill_bias(w, bias, widths))
            y = n("Add", [y, bname], [out], f"{module}.bias_add")[0]
        return y

    def norm(x: str, module: str, out: str) -> str:
        g = writer.weight(f"{module}.weight", (hidden,), _fill_copy(w, f"{module}.weight"))
        return n("SimplifiedLayerNormalization", [x, g], [out], module, axis=-1, epsilon=eps, stash_type=1)[0]

    emb = writer.weight("model.embed_tokens.weight", (vocab, hidden), _fill_copy(w, "model.embed_tokens.weight"))
    h = n("Gather", [emb, "input_ids"], ["embeddings"], "model.embed_tokens", axis=0)[0]
    for i in range(layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        x = norm(h, f"{p}.input_layernorm", f"{p}.ln1")
        projs = [f"{a}.{m}_proj" for m in "qkv"]
        qkv = linear(x, f"{a}.qkv_proj", [f"{m}.weight" for m in projs], f"{a}.qkv", modules=projs)
        att = n("GroupQueryAttention", [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value",
                                        "seqlens_k", "total_seq_len", "cos_cache", "sin_cache"],
                [f"{a}.out", f"present.{i}.key", f"present.{i}.value"], f"{a}.attn", domain="com.microsoft",
                num_heads=heads, kv_num_heads=kv, scale=float(model.model.layers[i].self_attn.scaling),
                do_rotary=1, rotary_interleaved=0)[0]
        o = linear(att, f"{a}.o_proj", [f"{a}.o_proj.weight"], f"{a}.o")
        h = n("Add", [h, o], [f"{p}.resid1"], f"{p}.resid1")[0]
        x = norm(h, f"{p}.post_attention_layernorm", f"{p}.ln2")
        m = f"{p}.mlp"
        g = linear(x, f"{m}.gate_proj", [f"{m}.gate_proj.weight"], f"{m}.gate")
        u = linear(x, f"{m}.up_proj", [f"{m}.up_proj.weight"], f"{m}.up")
        sg = n("Sigmoid", [g], [f"{m}.gate_sigmoid"], f"{m}.act_fn.sigmoid")[0]
        act = n("Mul", [g, sg], [f"{m}.act"], f"{m}.act_fn")[0]
        hm = n("Mul", [act, u], [f"{m}.hidden"], f"{m}.mul")[0]
        d = linear(hm, f"{m}.down_proj", [f"{m}.down_proj.weight"], f"{m}.down")
        h = n("Add", [h, d], [f"{p}.resid2"], f"{p}.resid2")[0]
    x = norm(h, "model.norm", "final_norm")
    head = writer.weight("lm_head.weight", (hidden, vocab),
                         _fill_linear(w, ["model.embed_tokens.weight" if tied else "lm_head.weight"]))
    y = n("MatMul", [x, head], ["logits_fp16"], "lm_head")[0]
    n("Cast", [y], ["logits"], "logits_fp32", to=TensorProto.FLOAT)
    return {"fused_rms_norms": 2 * layers + 1, "packed_qkv": layers, "tied_lm_head": tied}


def _graph_io(cfg, layers: int, kv: int, hd: int):
    from onnx import TensorProto, helper

    names_in, names_out = io_names(layers, "gqa")
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", cfg.vocab_size])]
    kv_shape = ["batch", kv, "capacity", hd]
    for i in range(layers):
        for part in ("key", "value"):
            ins.append(helper.make_tensor_value_info(f"past_key_values.{i}.{part}", TensorProto.FLOAT16, kv_shape))
            outs.append(helper.make_tensor_value_info(f"present.{i}.{part}", TensorProto.FLOAT16, kv_shape))
    assert [v.name for v in ins] == names_in and [v.name for v in outs] == names_out
    return ins, outs, names_in, names_out


def write_fp16_graph(hf_dir: str | Path, out_dir: str | Path, *, opset: int = 18, max_seq: int = 4096) -> dict:
    """Write ``out_dir/model.onnx`` + ``model.onnx.data`` (fp16) and ``forge_ort.json`` from ``hf_dir``; no parity.
    Returns what was written."""
    from onnx import helper, save_model

    from pipeline.weights import HFWeights, check_names

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").exists():
        raise ForgeError(f"export: {hf_dir} has no config.json; the source stage must produce an HF model dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = _meta_model(hf_dir)
    _check_family(model)
    cfg = model.config
    w = HFWeights(hf_dir)
    check_names(w, model)
    layers, kv, hd = kv_dims(cfg)
    max_pos = min(int(getattr(cfg, "max_position_embeddings", max_seq) or max_seq), max_seq)
    for f in (out_dir / MODEL_FILE, out_dir / (MODEL_FILE + ".data")):
        f.unlink(missing_ok=True)
    data = DataFile(out_dir / (MODEL_FILE + ".data"))
    writer = _Writer(data)
    counts = _build(w, model, writer, max_pos)
    with data, progress_bar("export fp16 (tensor by tensor)", len(writer.fills)) as advance:
        for name, fill in writer.fills:
            fill(data, name)
            advance(1)
    ins, outs, names_in, names_out = _graph_io(cfg, layers, kv, hd)
    graph = helper.make_graph(writer.nodes, "forge_fp16", ins, outs, writer.inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10, producer_name="forge", producer_version=WRITER)
    # initializers are external already: only the graph is written. No onnx.checker: it knows no
    # SimplifiedLayerNormalization (ORT's op in the ONNX domain); ORT itself loads the graph in the parity check.
    save_model(proto, str(out_dir / MODEL_FILE))
    copy_side_files(hf_dir, out_dir)
    meta = {
        "format": "forge-ort-kv/2", "model_file": MODEL_FILE, "dtype": "fp16", "opset": opset, "attention": "gqa",
        "kv_layout": KV_LAYOUT["gqa"], "max_seq_len": max_pos, "num_layers": layers, "num_kv_heads": kv,
        "head_dim": hd, "vocab_size": cfg.vocab_size, "inputs": names_in, "outputs": names_out, "quantization": None,
        "eos_token_id": cfg.eos_token_id, "bos_token_id": getattr(cfg, "bos_token_id", None),
        "pad_token_id": getattr(cfg, "pad_token_id", None),
        "fp16": {"tool": f"pipeline.ort.stream_export ({WRITER})", "fp32_ops": [], "fp32_io": ["logits"],
                 "norm_statistics": "fp32 (SimplifiedLayerNormalization stash_type 1)", **counts},
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    return {"tensors": len(writer.fills), **counts}


def export_fp16_stream(hf_dir: str | Path, out_dir: str | Path, *, opset: int = 18, parity: dict | None = None,
                       threads: int = 2, max_seq: int = 4096, reference: str = "auto") -> dict:
    """The streaming fp16 export with its parity check (ORT on the CPU vs the FP32 torch model on ``reference``:
    ``auto``, ``cpu`` or ``cuda``; ``threads`` for both, 0 = every core). Raises :class:`StageFailed` with the measured errors when they exceed
    ``parity['fp16']`` (default :data:`DEFAULT_FP16_PARITY`)."""
    import torch

    from pipeline.host.rss import PeakRss
    from pipeline.weights import load_causal_lm

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    tol = (parity or {}).get("fp16") or DEFAULT_FP16_PARITY
    atol, rtol = float(tol.get("atol", 0.0)), float(tol.get("rtol", 0.0))
    if threads:
        torch.set_num_threads(threads)
    t0 = time.time()
    with PeakRss() as write_rss:
        written = write_fp16_graph(hf_dir, out_dir, opset=opset, max_seq=max_seq)
    export_s = time.time() - t0
    dev = reference_device(reference)
    t1 = time.time()
    with PeakRss() as parity_rss:
        par = check_parity(lambda: load_causal_lm(hf_dir, dtype=torch.float32, device=dev), out_dir, atol=atol,
                           rtol=rtol, threads=threads)
    path = out_dir / MODEL_FILE
    metrics = {
        "export_s": round(export_s, 2), "parity_s": round(time.time() - t1, 2), "opset": opset, "dtype": "fp16",
        "writer": WRITER, "parity_reference": f"torch fp32 on {dev}", "parity_engine": "onnxruntime CPU",
        "parity_prefill_max_abs": par["prefill_max_abs"], "parity_decode_max_abs": par["decode_max_abs"],
        "parity_atol": atol, "parity_rtol": rtol, "attention": "gqa", "kv_layout": par.get("kv_layout"),
        "onnx_bytes": path.stat().st_size, "data_bytes": model_bytes(out_dir) - path.stat().st_size,
        "model_bytes": model_bytes(out_dir), **written,
        # host RAM of this process (sampled): the write holds a slice, the parity one model at a time
        "write_peak_rss_mb": round(write_rss.peak_mb), "parity_peak_rss_mb": round(parity_rss.peak_mb),
    }
    if not par["ok"]:
        raise StageFailed(
            f"export parity check failed (fp16): ORT vs torch max abs error prefill {par['prefill_max_abs']:.3g}, "
            f"decode {par['decode_max_abs']:.3g} exceeds atol {atol} + rtol {rtol} (recipe key export.parity.fp16)",
            metrics)
    return metrics
