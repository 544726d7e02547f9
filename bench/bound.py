"""The memory-bandwidth bound of decode (issue 38): how fast one GPU can copy, and how many bytes one decode step
reads, measured and counted in the same run as the engines it judges.

* ``copy_bandwidth``: device-to-device ``Tensor.copy_`` on the card, bytes read + written per second (the same
  sampling rule as every GPU figure: a median of >= 5 samples of >= 100 ms, min/max kept).
* ``step_weights``: the bytes of weights one decode step reads at a given width per parameter -- every weight but
  the embedding table (a step gathers B rows of it, not the table), counted from the safetensors headers when the
  directory has them, else from the HF config (Llama / Qwen2-style decoders); a tied lm_head reads the table, so
  it counts then. At Qwen2.5-7B's config that is 7,070,619,136 parameters, 14.14 GB in fp16.
* ``onnx_step_bytes``: the same count for an ONNX engine (ours or ORT GenAI's), from its initializers' sizes, so an
  INT4 engine is judged against its own format's bytes (packed weights + scales + zero points).

The bound for batch B is B * bandwidth / step bytes: the weights are read once per step whatever the batch; K/V
reads are left out (at b1 and a 96-token context they are < 0.5 % of a 7B step).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def copy_bandwidth(device: str = "cuda", mib: int = 1024, reps: int = 5, min_sample_s: float = 0.1) -> dict:
    """Device-to-device copy of a ``mib`` MiB buffer: (read + write) bytes / s, median of ``reps`` samples."""
    import torch

    from .measure import spread, timed

    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)

    def copy():
        dst.copy_(src)
        sync()
    times = timed(copy, reps, warmup=2, min_sample_s=min_sample_s)
    rates = [2 * n / t for t in times]
    s = spread(rates)
    return {"bytes_per_s": s["median"], "bytes_per_s_spread": s, "buffer_bytes": n, "times_s": times,
            "device": torch.cuda.get_device_name() if src.is_cuda else device,
            "what": f"torch {torch.__version__} Tensor.copy_ of {mib} MiB on {device}: read + write bytes / s"}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text()) if path.is_dir() else json.loads(path.read_text())


def config_param_counts(cfg: dict) -> dict[str, int]:
    """Parameters by tensor role of a Llama / Qwen2-style decoder (RMSNorm, GQA, SwiGLU MLP), from its HF config.
    q/k/v biases where the config has them (Qwen2 always, Llama with ``attention_bias``)."""
    mt = cfg.get("model_type")
    if mt not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"config model_type {mt!r}: the parameter count knows llama, qwen2 and mistral; pass a "
                         "directory with *.safetensors to count the stored tensors instead")
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    qkv_bias = mt == "qwen2" or bool(cfg.get("attention_bias"))
    mlp_bias = bool(cfg.get("mlp_bias"))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if qkv_bias:
        attn += heads * hd + 2 * kv * hd
    if cfg.get("attention_bias") and mt == "llama":
        attn += h                                   # Llama's attention_bias also gives o_proj a bias
    mlp = 3 * h * i + (2 * i + h if mlp_bias else 0)
    layer = attn + mlp + 2 * h
    tied = bool(cfg.get("tie_word_embeddings", False))
    return {"embedding": v * h, "layers": n * layer, "norm": h, "lm_head": 0 if tied else v * h, "tied": int(tied)}


def safetensors_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from every *.safetensors header in ``model_dir`` (the 8-byte length + JSON header;
    no tensor data is read)."""
    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = tuple(meta["shape"])
    return out


def step_weights(model: Path, bytes_per_param: float = 2.0) -> dict:
    """Parameters and bytes one decode step reads at ``bytes_per_param`` (2: fp16), from ``model`` (an HF dir with
    safetensors and/or config.json, or a config.json path)."""
    model = Path(model)
    cfg = _config(model)
    shapes = safetensors_shapes(model) if model.is_dir() else {}
    if shapes:
        numel = {k: _numel(s) for k, s in shapes.items()}
        emb = numel.get(EMBEDDING, 0)
        total = sum(numel.values())
        tied = LM_HEAD not in numel and bool(cfg.get("tie_word_embeddings", False))
        step = total - (0 if tied else emb)
        source = "safetensors"
    else:
        c = config_param_counts(cfg)
        emb, tied = c["embedding"], bool(c["tied"])
        total = c["embedding"] + c["layers"] + c["norm"] + c["lm_head"]
        step = total - (0 if tied else emb)
        source = "config"
    return {"params_total": total, "embedding_params": emb, "tied_embedding": tied, "step_params": step,
            "bytes_per_param": bytes_per_param, "step_bytes": int(step * bytes_per_param), "source": source}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


_ONNX_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2, 21: 0.5, 22: 0.5}
_GATHERS = ("Gather", "GatherBlockQuantized")


def onnx_step_bytes(model_file: Path) -> dict:
    """Bytes of the initializers of an ONNX decoder except the embedding table(s): tensors whose every consumer
    gathers rows from them (``Gather`` / ``GatherBlockQuantized`` data input). The graph is read without its
    external data, so a 15 GB model costs only its protobuf."""
    import onnx

    m = onnx.load(str(model_file), load_external_data=False)
    sizes = {}
    for t in m.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        if "length" in ext:
            sizes[t.name] = int(ext["length"])
        elif t.raw_data:
            sizes[t.name] = len(t.raw_data)
        else:
            sizes[t.name] = int(_numel(t.dims) * _ONNX_BYTES.get(t.data_type, 4))
    uses: dict[str, list[bool]] = {}
    for node in m.graph.node:
        for k, name in enumerate(node.input):
            if name in sizes:
                uses.setdefault(name, []).append(node.op_type in _GATHERS and k == 0)
    tables = [n for n, u in uses.items() if u and all(u)]
    return {"step_bytes": sum(v for n, v in sizes.items() if n not in tables), "all_bytes": sum(sizes.values()),
            "excluded": tables, "file": str(model_file)}


def engine_model_file(d: Path) -> Path | None:
    """The decoder ONNX file of a forge engine dir (forge_ort.json) or an ORT GenAI dir (genai_config.json)."""
    d = Path(d)
    if (d / "forge_ort.json").is_file():
        return d / json.loads((d / "forge_ort.json").read_text()).get("model_file", "model.onnx")
    if (d / "genai_config.json").is_file():
        return d / json.loads((d / "genai_config.json").read_text())["model"]["decoder"]["filename"]
    return None


def bound_tok_s(bytes_per_s: float | None, step_bytes: int | None, batch: int) -> float | None:
    """Decode tokens/s at which a batch-``batch`` step would only read its weights at the copy bandwidth."""
    if not bytes_per_s or not step_bytes:
        return None
    return batch * bytes_per_s / step_bytes
