"""HF causal LM -> one ONNX graph with KV-cache inputs/outputs (prefill and decode), checked for parity.

The graph (``model.onnx`` + ``model.onnx.data``) takes

    input_ids       int64 [batch, seq]
    attention_mask  int64 [batch, past + seq]      (1 = real token, 0 = padding; left padding)
    position_ids    int64 [batch, seq]
    past_key_values.{i}.key / .value  float [batch, kv_heads, past, head_dim]   (past may be 0)

and returns ``logits`` [batch, seq, vocab] and ``present.{i}.key / .value`` [batch, kv_heads, past + seq, head_dim].
Prefill is a call with past = 0; a decode step feeds the previous presents back with seq = 1.

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

__all__ = ["export_onnx", "check_parity", "MODEL_FILE", "META_FILE", "COPY_FILES", "copy_side_files"]

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


def _kv_dims(cfg) -> tuple[int, int, int]:
    layers = cfg.num_hidden_layers
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return layers, kv, hd


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    ins = ["input_ids", "attention_mask", "position_ids"]
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
    """ORT vs torch on fixed random tokens: a prefill (past = 0, row 0 left-padded by 3) and one decode step
    fed with ORT's own presents. Returns max errors and ``ok``."""
    import torch

    from pipeline.ort.engine import OrtEngine

    eng = OrtEngine(onnx_dir, threads=threads)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, prompt_len), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, :3] = 0  # left padding on row 0: exercises the mask path
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    out = eng.run(ids, mask, pos, eng.empty_past(batch))
    with torch.inference_mode():
        ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    position_ids=torch.from_numpy(pos)).logits.float().numpy()
    m = mask.astype(bool)
    pre = _err(ref[m], out["logits"][m], atol, rtol)  # padded positions carry no meaning
    nxt = rng.integers(0, vocab, size=(batch, 1), dtype=np.int64)
    mask2 = np.concatenate([mask, np.ones((batch, 1), np.int64)], 1)
    pos2 = pos[:, -1:] + 1
    out2 = eng.run(nxt, mask2, pos2, out["past"])
    with torch.inference_mode():
        full = np.concatenate([ids, nxt], 1)
        ref2 = model(input_ids=torch.from_numpy(full), attention_mask=torch.from_numpy(mask2),
                     position_ids=torch.from_numpy(np.concatenate([pos, pos2], 1))).logits[:, -1:].float().numpy()
    dec = _err(ref2, out2["logits"], atol, rtol)
    return {"prefill_max_abs": pre["max_abs"], "decode_max_abs": dec["max_abs"], "ok": pre["ok"] and dec["ok"],
            "atol": atol, "rtol": rtol}


def export_onnx(hf_dir: str | Path, out_dir: str | Path, *, opset: int = 18, parity: dict | None = None,
                dtype: str = "fp32", threads: int = 2, max_batch: int = 64, max_seq: int = 4096) -> dict:
    """Export ``hf_dir`` to ``out_dir/model.onnx`` (+ external data), check it, check parity, return metrics.

    Raises :class:`StageFailed` (with the measured errors) when ORT and torch disagree beyond ``parity[dtype]``.
    """
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").exists():
        raise ForgeError(f"export: {hf_dir} has no config.json; the source stage must produce an HF model dir")
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
    layers, kv, hd = _kv_dims(cfg)
    names_in, names_out = io_names(layers)

    # Example inputs: batch 2 (so batch is not specialised to 1), seq 5, past 3 (past 0 also works at run time).
    B, T, P = 2, 5, 3
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    am = torch.ones(B, P + T, dtype=torch.long)
    pos = torch.arange(P, P + T).unsqueeze(0).expand(B, T).contiguous()
    past = [torch.zeros(B, kv, P, hd) for _ in range(2 * layers)]
    Dim = torch.export.Dim
    b, s = Dim("batch", min=1, max=max_batch), Dim("seq", min=1, max=max_seq)
    p, tot = Dim("past", min=0, max=max_seq), Dim("total", min=1, max=2 * max_seq)
    dyn = {"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: tot}, "position_ids": {0: b, 1: s},
           "past": [{0: b, 2: p} for _ in range(2 * layers)]}

    with progress_bar("export ONNX (torch.export + translate)", 1) as advance:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(_wrapper(model), (ids, am, pos, past), dynamo=True, dynamic_shapes=dyn,
                                     input_names=names_in, output_names=names_out, opset_version=opset,
                                     verbose=False)
        path = out_dir / MODEL_FILE
        prog.save(str(path), external_data=True)
        advance(1)
    export_s = time.time() - t0
    del prog

    onnx.checker.check_model(str(path))  # by path: handles external data
    copy_side_files(hf_dir, out_dir)
    meta = {
        "format": "forge-ort-kv/1", "model_file": MODEL_FILE, "dtype": dtype, "opset": opset,
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
        "parity_atol": atol, "parity_rtol": rtol,
        "onnx_bytes": path.stat().st_size, "data_bytes": model_bytes(out_dir) - path.stat().st_size,
        "model_bytes": model_bytes(out_dir), "num_layers": layers,
    }
    if not par["ok"]:
        raise StageFailed(
            f"export parity check failed ({dtype}): ORT vs torch max abs error prefill {par['prefill_max_abs']:.3g}, "
            f"decode {par['decode_max_abs']:.3g} exceeds atol {atol} + rtol {rtol} (recipe key export.parity.{dtype})",
            metrics)
    return metrics


def model_bytes(model_dir: str | Path) -> int:
    """Bytes of the ONNX graph plus its external data files (what a deployment ships for the weights)."""
    d = Path(model_dir)
    return sum(f.stat().st_size for f in d.iterdir() if f.name.endswith((".onnx", ".onnx.data", ".data")))


def load_meta(model_dir: str | Path) -> dict[str, Any]:
    f = Path(model_dir) / META_FILE
    if not f.exists():
        raise ForgeError(f"{model_dir} has no {META_FILE}; it was not written by forge's ONNX export")
    return json.loads(f.read_text())
