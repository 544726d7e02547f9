"""HF causal LM -> one ONNX graph with KV-cache inputs/outputs (prefill and decode), checked for parity.

Two attention layouts (``export.attention``; the runtime, pipeline.ort.engine, reads which from the graph):

``gqa`` (onnxruntime target): every attention is ONNX Runtime's ``com.microsoft.GroupQueryAttention`` with the
rotary embedding inside the op (cos/sin tables up to ``max_seq_len`` positions are initializers). Inputs

    input_ids       int64 [batch, seq]
    attention_mask  int64 [batch, total]      row sums = tokens per row so far (right padding), width = total
    past_key_values.{i}.key / .value  float [batch, kv_heads, capacity, head_dim]

outputs ``logits`` [batch, seq, vocab] and ``present.{i}.key / .value`` shaped like the past: the runtime binds
past and present to one preallocated buffer that the op updates in place (ONNX Runtime GenAI's layout, same
input/output names). q/k/v/o projections, norms and MLP are the model's own modules, so node names and module
metadata are what the quantizer matches on.

``standard`` (plain ONNX, what TensorRT reads): the model's own attention; inputs ``attention_mask``
[batch, past + seq] and ``position_ids`` [batch, seq], presents [batch, kv_heads, past + seq, head_dim].

Exported with ``torch.onnx.export(..., dynamo=True)`` (the legacy exporter fails on transformers 5 masks).
Tokenizer and config files are copied next to the graph so the directory is self-contained for the engine.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import ForgeError, StageFailed
from pipeline.progress import progress_bar

__all__ = ["export_onnx", "check_parity", "check_gqa_model", "kv_dims", "MODEL_FILE", "META_FILE", "COPY_FILES",
           "copy_side_files"]

MODEL_FILE = "model.onnx"
META_FILE = "forge_ort.json"
# Files copied from the HF dir so an ONNX model dir also carries its tokenizer and configs.
COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")
DEFAULT_PARITY = {"fp32": {"atol": 1e-3, "rtol": 1e-3}}


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer/config files and the forge meta file from ``src`` to ``dst``; returns the names copied."""
    copied = []
    for name in COPY_FILES + (META_FILE,):
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def kv_dims(cfg) -> tuple[int, int, int]:
    layers = cfg.num_hidden_layers
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return layers, kv, hd


def io_names(num_layers: int, attention: str = "standard") -> tuple[list[str], list[str]]:
    ins = ["input_ids", "attention_mask"] + (["position_ids"] if attention == "standard" else [])
    outs = ["logits"]
    for i in range(num_layers):
        ins += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outs += [f"present.{i}.key", f"present.{i}.value"]
    return ins, outs


def _wrapper(model):
    """nn.Module taking flat past tensors and returning flat presents (what the ONNX graph exposes)."""
    import torch
    from transformers import DynamicCache

    num_layers = model.config.num_hidden_layers

    class KVWrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, past):
            cache = DynamicCache(config=self.m.config)
            for i in range(num_layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=True)
            flat = []
            for layer in out.cache.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return KVWrapper(model)


ATTENTIONS = ("gqa", "standard")
KV_LAYOUT = {"gqa": "shared", "standard": "concat"}
_GQA_OP = None


def _gqa_op():
    """``forge::group_query_attention``: a torch custom op that exists only to be exported, translated to
    ``com.microsoft.GroupQueryAttention`` (contract: onnxruntime/core/graph/contrib_ops/bert_defs.cc and
    contrib_ops/cpu/bert/group_query_attention.cc, microsoft/onnxruntime@00fe9492; inputs query, key, value,
    past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache). Its torch body is never run:
    parity is checked against the HF model itself."""
    global _GQA_OP
    if _GQA_OP is not None:
        return _GQA_OP
    import torch

    # explicit schema: this module's `from __future__ import annotations` hides the annotations from torch
    schema = ("(Tensor q, Tensor k, Tensor v, Tensor past_k, Tensor past_v, Tensor seqlens_k, Tensor total_len, "
              "Tensor cos, Tensor sin, int num_heads, int kv_heads, float scale) -> (Tensor, Tensor, Tensor)")

    @torch.library.custom_op("forge::group_query_attention", mutates_args=(), schema=schema)
    def gqa(q, k, v, past_k, past_v, seqlens_k, total_len, cos, sin, num_heads, kv_heads, scale):
        raise NotImplementedError("forge::group_query_attention is export-only (ONNX Runtime runs it)")

    @gqa.register_fake
    def _(q, k, v, past_k, past_v, seqlens_k, total_len, cos, sin, num_heads, kv_heads, scale):
        # shared buffer: present has the past's shape (the runtime feeds buffers as long as prompt + new tokens)
        return q.new_empty(q.shape), past_k.new_empty(past_k.shape), past_v.new_empty(past_v.shape)

    def to_onnx(q, k, v, past_k, past_v, seqlens_k, total_len, cos, sin, num_heads: int, kv_heads: int,
                scale: float):
        # ORT's contrib ops have no ONNX schema for onnxscript to look up, so the node is built directly
        from torch.onnx._internal.exporter._torchlib.ops.hop import call_op

        return tuple(call_op("GroupQueryAttention", q, k, v, past_k, past_v, seqlens_k, total_len, cos, sin,
                             _num_outputs=3, _domain="com.microsoft", num_heads=num_heads, kv_num_heads=kv_heads,
                             scale=scale, do_rotary=1, rotary_interleaved=0))

    _GQA_OP = (torch.ops.forge.group_query_attention.default, to_onnx)
    return _GQA_OP


def check_gqa_model(model) -> None:
    """The GQA export rebuilds attention from the model's q/k/v/o projections with full rotary (non-interleaved,
    HF's rotate_half): refuse layouts it would get wrong instead of exporting a silently different model."""
    cfg = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    problems = []
    if layers is None or not hasattr(model.model, "rotary_emb"):
        problems.append("no model.layers / model.rotary_emb")
    else:
        attn = layers[0].self_attn
        missing = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(attn, n)]
        extra = [n for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if missing or extra:
            problems.append(f"attention has {'no ' + str(missing) if missing else 'extra ' + str(extra)}")
    if (getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {cfg.partial_rotary_factor}")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        problems.append(f"sliding_window {cfg.sliding_window}")
    if (getattr(cfg, "rope_scaling", None) or {}).get("rope_type") in ("dynamic", "longrope"):
        problems.append(f"rope_scaling {cfg.rope_scaling}")
    if problems:
        raise ForgeError(f"export.attention: gqa cannot represent {type(model).__name__} ({'; '.join(problems)}); "
                         "set export.attention: standard in the recipe")


def _gqa_wrapper(model, max_seq_len: int):
    """nn.Module over the HF model whose attentions call ``forge::group_query_attention`` with per-layer past
    buffers; returns (logits, present_0_key, present_0_value, ...)."""
    import types

    import torch

    check_gqa_model(model)
    cfg = model.config
    layers, kv, hd = kv_dims(cfg)
    heads = cfg.num_attention_heads
    op, _ = _gqa_op()

    class GQAWrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m
            pos = torch.arange(max_seq_len)[None]
            cos, sin = m.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)  # [1, S, hd] = cat(f, f)
            self.register_buffer("cos_cache", cos[0, :, : hd // 2].contiguous().float(), persistent=False)
            self.register_buffer("sin_cache", sin[0, :, : hd // 2].contiguous().float(), persistent=False)
            self.state: dict = {}
            state = self.state

            def attention(attn, hidden_states, *args, **kwargs):
                i = attn.layer_idx
                o, pk, pv = op(attn.q_proj(hidden_states), attn.k_proj(hidden_states), attn.v_proj(hidden_states),
                               state["past"][2 * i], state["past"][2 * i + 1], state["seqlens_k"], state["total"],
                               state["cos"], state["sin"], heads, kv, float(attn.scaling))
                state["present"][i] = (pk, pv)
                return attn.o_proj(o), None

            for layer in m.model.layers:
                layer.self_attn.forward = types.MethodType(attention, layer.self_attn)

        def restore(self):
            """Give the model back its own attention (the parity check runs the unpatched model)."""
            for layer in self.m.model.layers:
                layer.self_attn.__dict__.pop("forward", None)

        def forward(self, input_ids, attention_mask, past):
            # GroupQueryAttention's mask contract (as ORT GenAI's model builder writes it): seqlens_k = row sum - 1,
            # total_sequence_length = mask width
            self.state.update(past=past, present={}, cos=self.cos_cache, sin=self.sin_cache,
                              seqlens_k=(attention_mask.sum(-1) - 1).to(torch.int32),
                              total=attention_mask.shape[1] * torch.ones((), dtype=torch.int32))
            out = self.m(input_ids=input_ids, use_cache=False)
            flat = []
            for i in range(layers):
                flat += list(self.state["present"][i])
            return (out.logits, *flat)

    return GQAWrapper(model)


def _tolerance(parity: dict, dtype: str) -> tuple[float, float]:
    tol = (parity or {}).get(dtype)
    if tol is None:
        raise ForgeError(f"export.parity has no tolerance for dtype {dtype!r} (have {sorted(parity or {})}); "
                         f"add e.g. parity: {{{dtype}: {{atol: 1e-3, rtol: 1e-3}}}} to the recipe")
    return float(tol.get("atol", 0.0)), float(tol.get("rtol", 0.0))


def _err(ref: np.ndarray, got: np.ndarray, atol: float, rtol: float) -> dict:
    d = np.abs(ref.astype(np.float64) - got.astype(np.float64))
    excess = d - (atol + rtol * np.abs(ref))
    return {"max_abs": float(d.max()) if d.size else 0.0, "ok": bool(np.all(excess <= 0) and np.isfinite(got).all())}


def check_parity(model, onnx_dir: Path, *, atol: float, rtol: float, threads: int = 2, seed: int = 0,
                 batch: int = 2, prompt_len: int = 12) -> dict:
    """ORT (through the runtime, pipeline.ort.engine) vs torch on fixed random tokens: a batched prefill whose
    row 0 is 3 tokens shorter (right padding), then one decode step per row on the runtime's KV cache. Returns
    max errors and ``ok``.

    The engine runs first and is released before the reference runs. ``model`` is the torch model, or a function
    that loads it: then the two never hold their weights at the same time (the streaming fp16 export's memory
    bound, pipeline/ort/stream_export.py)."""
    import gc

    import torch

    from pipeline.host.rss import trim_heap
    from pipeline.ort.engine import OrtEngine

    eng = OrtEngine(onnx_dir, threads=threads, cpu_arena=False)   # runs once: its memory goes back before torch's
    vocab, layout = int(eng.vocab_size), eng.layout
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, prompt_len), dtype=np.int64)
    lens = np.full(batch, prompt_len, np.int64)
    lens[0] -= 3  # a shorter row: exercises padding and per-row lengths
    cache = eng.cache(batch, prompt_len + 1)
    got = np.array(eng.forward(ids, lens, cache))
    nxt = rng.integers(0, vocab, size=(batch, 1), dtype=np.int64)
    got2 = np.array(eng.forward(nxt, np.ones(batch, np.int64), cache))
    del eng, cache
    gc.collect()
    trim_heap()
    if callable(model) and not isinstance(model, torch.nn.Module):
        model = model()
    pre = {"max_abs": 0.0, "ok": True}
    dec = {"max_abs": 0.0, "ok": True}
    dev = next(model.parameters()).device
    for r in range(batch):
        row = np.concatenate([ids[r, :lens[r]], nxt[r]])[None]
        with torch.inference_mode():
            ref = model(input_ids=torch.from_numpy(row).to(dev)).logits[0].float().cpu().numpy()
        for acc, e in ((pre, _err(ref[:-1], got[r, :lens[r]], atol, rtol)), (dec, _err(ref[-1:], got2[r], atol, rtol))):
            acc["max_abs"], acc["ok"] = max(acc["max_abs"], e["max_abs"]), acc["ok"] and e["ok"]
    return {"prefill_max_abs": pre["max_abs"], "decode_max_abs": dec["max_abs"], "ok": pre["ok"] and dec["ok"],
            "atol": atol, "rtol": rtol, "kv_layout": layout}


def export_onnx(hf_dir: str | Path, out_dir: str | Path, *, opset: int = 18, parity: dict | None = None,
                dtype: str = "fp32", threads: int = 2, max_batch: int = 64, max_seq: int = 4096,
                attention: str = "gqa") -> dict:
    """Export ``hf_dir`` to ``out_dir/model.onnx`` (+ external data), check it, check parity, return metrics.
    ``attention``: ``gqa`` (in-place KV cache, ONNX Runtime only) or ``standard`` (plain ONNX); ``max_seq``:
    positions the graph serves (the gqa graph's rotary tables end there).

    Raises :class:`StageFailed` (with the measured errors) when ORT and torch disagree beyond ``parity[dtype]``.
    """
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").exists():
        raise ForgeError(f"export: {hf_dir} has no config.json; the source stage must produce an HF model dir")
    if attention not in ATTENTIONS:
        raise ForgeError(f"export.attention {attention!r} is not one of {ATTENTIONS}")
    if dtype != "fp32":
        raise ForgeError(f"export.dtype {dtype!r} is not supported by the onnxruntime target on CPU; use fp32 "
                         "(quantization happens in the quantize stage)")
    atol, rtol = _tolerance(parity if parity is not None else DEFAULT_PARITY, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)

    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    cfg = model.config
    layers, kv, hd = kv_dims(cfg)
    names_in, names_out = io_names(layers, attention)

    # Example inputs: batch 2 (so batch is not specialised to 1), seq 5, past 3 (past 0 also works at run time).
    B, T, P = 2, 5, 3
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    am = torch.ones(B, P + T, dtype=torch.long)
    Dim = torch.export.Dim
    b, s = Dim("batch", min=1, max=max_batch), Dim("seq", min=1, max=max_seq)
    tot = Dim("total", min=1, max=2 * max_seq)
    translations = {}
    if attention == "gqa":
        max_pos = min(int(getattr(cfg, "max_position_embeddings", max_seq) or max_seq), max_seq)
        wrapper = _gqa_wrapper(model, max_pos)
        cap = Dim("capacity", min=1, max=max_pos)
        past = [torch.zeros(B, kv, 16, hd) for _ in range(2 * layers)]
        args = (ids, am, past)
        dyn = {"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: tot}, "past": [{0: b, 2: cap}] * (2 * layers)}
        op, to_onnx = _gqa_op()
        translations = {op: to_onnx}
    else:
        max_pos = None
        wrapper = _wrapper(model)
        pos = torch.arange(P, P + T).unsqueeze(0).expand(B, T).contiguous()
        past = [torch.zeros(B, kv, P, hd) for _ in range(2 * layers)]
        args = (ids, am, pos, past)
        p = Dim("past", min=0, max=max_seq)
        dyn = {"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: tot}, "position_ids": {0: b, 1: s},
               "past": [{0: b, 2: p} for _ in range(2 * layers)]}

    with progress_bar("export ONNX (torch.export + translate)", 1) as advance:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                prog = torch.onnx.export(wrapper, args, dynamo=True, dynamic_shapes=dyn, input_names=names_in,
                                         output_names=names_out, opset_version=opset, verbose=False,
                                         custom_translation_table=translations or None)
            finally:
                if attention == "gqa":
                    wrapper.restore()
        path = out_dir / MODEL_FILE
        prog.save(str(path), external_data=True)
        if attention == "gqa":
            _set_domain_version(path, "com.microsoft", 1)
        advance(1)
    export_s = time.time() - t0
    del prog

    onnx.checker.check_model(str(path))  # by path: handles external data
    copy_side_files(hf_dir, out_dir)
    meta = {
        "format": "forge-ort-kv/2", "model_file": MODEL_FILE, "dtype": dtype, "opset": opset,
        "attention": attention, "kv_layout": KV_LAYOUT[attention], "max_seq_len": max_pos,
        "num_layers": layers, "num_kv_heads": kv, "head_dim": hd, "vocab_size": cfg.vocab_size,
        "inputs": names_in, "outputs": names_out, "quantization": None,
        "eos_token_id": cfg.eos_token_id, "bos_token_id": getattr(cfg, "bos_token_id", None),
        "pad_token_id": getattr(cfg, "pad_token_id", None),
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))

    t1 = time.time()
    par = check_parity(model, out_dir, atol=atol, rtol=rtol, threads=threads)
    metrics = {
        "export_s": round(export_s, 2), "parity_s": round(time.time() - t1, 2), "opset": opset, "dtype": dtype,
        "parity_prefill_max_abs": par["prefill_max_abs"], "parity_decode_max_abs": par["decode_max_abs"],
        "parity_atol": atol, "parity_rtol": rtol, "attention": attention, "kv_layout": par.get("kv_layout"),
        "onnx_bytes": path.stat().st_size, "data_bytes": model_bytes(out_dir) - path.stat().st_size,
        "model_bytes": model_bytes(out_dir), "num_layers": layers,
    }
    if not par["ok"]:
        raise StageFailed(
            f"export parity check failed ({dtype}): ORT vs torch max abs error prefill {par['prefill_max_abs']:.3g}, "
            f"decode {par['decode_max_abs']:.3g} exceeds atol {atol} + rtol {rtol} (recipe key export.parity.{dtype})",
            metrics)
    return metrics


def _set_domain_version(path: Path, domain: str, version: int) -> None:
    """The exporter stamps every domain with the ONNX opset; ORT's contrib ops live in version 1 of theirs."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    for o in m.opset_import:
        if o.domain == domain:
            o.version = version
    onnx.save(m, str(path))   # external data stays where it is (same file name, same offsets)


def model_bytes(model_dir: str | Path) -> int:
    """Bytes of the ONNX graph plus its external data files (what a deployment ships for the weights)."""
    d = Path(model_dir)
    return sum(f.stat().st_size for f in d.iterdir() if f.name.endswith((".onnx", ".onnx.data", ".data")))


def graph_files(model_dir: str | Path) -> list[str]:
    """The ONNX graphs of an engine dir: ``model.onnx`` and the prompt graph its metadata names, if any
    (quantize.options.prefill)."""
    meta_path = Path(model_dir) / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return [MODEL_FILE] + ([meta["prefill_model_file"]] if meta.get("prefill_model_file") else [])


def load_meta(model_dir: str | Path) -> dict[str, Any]:
    f = Path(model_dir) / META_FILE
    if not f.exists():
        raise ForgeError(f"{model_dir} has no {META_FILE}; it was not written by forge's ONNX export")
    return json.loads(f.read_text())
