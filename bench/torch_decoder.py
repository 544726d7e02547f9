"""The PyTorch peer of the GPU bench (issue 38): a plain decoder with a static KV cache, its decode step compiled
with ``torch.compile(mode="reduce-overhead")`` so that it replays as a CUDA graph -- what a PyTorch user who wants
speed writes (the gpt-fast recipe), on the same HF weights as our engines.

* Llama / Qwen2 / Mistral-style HF configs: RMSNorm, RoPE with the config's theta (and its ``rope_scaling`` type,
  computed by transformers' own ``ROPE_INIT_FUNCTIONS``), grouped-query attention, q/k/v (and o) biases where the
  checkpoint has them, SwiGLU MLP, tied or untied lm_head. q/k/v and gate/up are each one matmul.
* fp16: weights and activations fp16. INT4: every linear (lm_head included) as PyTorch's tinygemm INT4 kernel
  (``aten._weight_int4pack_mm``), group 128, min/max asymmetric with a float zero point as torchao's int4
  weight-only does; that kernel takes bf16 activations on CUDA, so the INT4 model runs in bf16.
* The KV cache is one preallocated [B, kv_heads, capacity, head_dim] buffer per layer (static addresses, marked
  for the compiler as transformers' StaticCache does); prefill from an empty cache is eager causal attention over
  the prompt, decode attends to the cache under a position mask.
* ``torch.compile`` is used only where it yields a CUDA graph (device cuda); elsewhere the step runs eager and
  the adapter says so (``compiled: false``). tests/bench/test_torch_decoder.py checks the eager math against
  transformers' own model on tiny random Qwen2 / Llama configs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 128
INT4_INNER_K_TILES = 8     # the tinygemm layout torchao and gpt-fast use for _weight_int4pack_mm
CACHE_ROUND = 256          # cache capacities are allocated in steps of this many positions


@dataclass
class Spec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    tied: bool
    rope_type: str
    rope_theta: float


def spec_from_config(cfg) -> Spec:
    """The decoder's shape from a transformers config; refuses what this decoder does not compute."""
    mt = getattr(cfg, "model_type", None)
    if mt not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"model_type {mt!r}: the PyTorch static-KV peer computes llama / qwen2 / mistral decoders")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r}: the PyTorch static-KV peer computes a SiLU-gated MLP only")
    if getattr(cfg, "use_sliding_window", False) or (mt == "mistral" and getattr(cfg, "sliding_window", None)):
        raise ValueError("sliding-window attention: the PyTorch static-KV peer attends to the whole cache")
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    rs = dict(getattr(cfg, "rope_scaling", None) or {})
    rope_type = rp.get("rope_type") or rs.get("rope_type") or rs.get("type") or "default"
    theta = float(rp.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
    heads = cfg.num_attention_heads
    return Spec(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=heads,
                kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, eps=float(cfg.rms_norm_eps),
                tied=bool(getattr(cfg, "tie_word_embeddings", False)), rope_type=rope_type, rope_theta=theta)


def rope_tables(cfg, spec: Spec, max_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq, head_dim] in fp32, as transformers' rotary embedding computes them (rotate-half layout,
    times the rope type's attention factor)."""
    if spec.rope_type == "default":
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float()
                                              / spec.head_dim))
        factor = 1.0
    elif spec.rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope type {spec.rope_type!r} changes with the sequence length: not computed here")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, factor = ROPE_INIT_FUNCTIONS[spec.rope_type](cfg, "cpu")
    t = torch.arange(max_seq, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor, emb.sin() * factor


# ---------------------------------------------------------------------------------------------------- INT4 weights
def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP, dtype=torch.bfloat16):
    """[N, K] float -> (q int32 [N, K] in 0..15, scales_and_zeros [K/group, N, 2] in ``dtype``): per group of
    ``group`` input channels, scale = (max - min) / 15 and zero = min + 8 * scale, so w ~ (q - 8) * scale + zero
    (the tinygemm kernel's dequantization; torchao's get_groupwise_affine_qparams with a float zero point)."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"INT4 group {group} does not divide the input width {k}")
    wg = w.float().reshape(n, k // group, group)
    mx, mn = wg.amax(-1), wg.amin(-1)
    scale = (mx - mn).clamp(min=1e-6) / 15
    zero = mn + scale * 8
    q = ((wg - mn[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return q, sz


def dequantize_int4(q: torch.Tensor, sz: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    n, k = q.shape
    scale, zero = sz[..., 0].T.float(), sz[..., 1].T.float()
    return ((q.reshape(n, k // group, group).float() - 8) * scale[..., None] + zero[..., None]).reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """The kernel's weight layout on q's device. CUDA: ``_convert_weight_to_int4pack`` of [N, K/2] uint8 with the
    even input channel in the high nibble (pytorch torch/_meta_registrations.py: w is [n][k / 2] uint8, as
    torchao packs it); CPU: ``_convert_weight_to_int4pack_for_cpu`` of the int32 values."""
    if q.is_cuda:
        u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack(u8, INT4_INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INT4_INNER_K_TILES)


class Int4Linear(nn.Module):
    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, group: int, act_dtype):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.group = group
        q, sz = quantize_int4(w, group, act_dtype)
        self.register_buffer("packed", pack_int4(q))
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.to(act_dtype))

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class DenseLinear(nn.Module):
    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", w)
        self.register_buffer("bias", bias)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def rms_norm(x, weight, eps: float):
    """transformers' LlamaRMSNorm / Qwen2RMSNorm: statistics in fp32, the weight applied in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def cache_attention(q, k_cache, v_cache, mask, s: Spec):
    """q [B, H, T, D] against the whole cache [B, KV, C, D] under ``mask`` [T, C] (True: attend). The G = H / KV
    query heads of one KV head are folded into rows, so the cache is read once and never repeated per head (SDPA's
    enable_gqa path on the math backend copies it G times, which at b8 would add ~10 % to a 7B step's bytes).
    Scores in the model dtype, softmax in fp32, as transformers' eager attention."""
    b, h, t, d = q.shape
    g = h // s.kv_heads
    qf = q.reshape(b, s.kv_heads, g * t, d)
    scores = torch.matmul(qf, k_cache.transpose(2, 3)) * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~mask.repeat(g, 1), float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v_cache).reshape(b, h, t, d)


class Layer(nn.Module):
    def __init__(self, spec: Spec, w: dict, make_linear):
        super().__init__()
        self.spec = spec
        qkv_b = [w.get(f"self_attn.{p}_proj.bias") for p in "qkv"]
        self.qkv = make_linear(torch.cat([w[f"self_attn.{p}_proj.weight"] for p in "qkv"]),
                               torch.cat(qkv_b) if all(b is not None for b in qkv_b) else None)
        self.o = make_linear(w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))
        self.gate_up = make_linear(torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]), None)
        self.down = make_linear(w["mlp.down_proj.weight"], None)
        self.register_buffer("norm1", w["input_layernorm.weight"])
        self.register_buffer("norm2", w["post_attention_layernorm.weight"])
        self.register_buffer("k_cache", None)
        self.register_buffer("v_cache", None)

    def forward(self, x, cos, sin, input_pos, mask, prefill: bool):
        s = self.spec
        b, t, _ = x.shape
        h = rms_norm(x, self.norm1, s.eps)
        q, k, v = self.qkv(h).split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
        q = q.view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = k.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        c, sn = cos.to(q.dtype), sin.to(q.dtype)
        q = q * c + rotate_half(q) * sn
        k = k * c + rotate_half(k) * sn
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        if prefill:      # from an empty cache: the prompt attends causally to itself
            g = s.heads // s.kv_heads
            # K/V repeated per query head, as transformers' sdpa path does: without a mask and without GQA,
            # SDPA can pick its flash kernel on CUDA (enable_gqa would limit the choice of backends)
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                                               is_causal=True)
        else:
            a = cache_attention(q, self.k_cache, self.v_cache, mask, s)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))
        g, u = self.gate_up(rms_norm(x, self.norm2, s.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class StaticDecoder(nn.Module):
    """The whole decoder; ``forward(ids [B, T], input_pos [T], prefill)`` -> logits [B, T or 1, V]."""

    def __init__(self, spec: Spec, weights: dict, cos, sin, dtype, int4_group: int | None = None):
        super().__init__()
        self.spec, self.dtype, self.int4_group = spec, dtype, int4_group

        def make_linear(w, b):
            if int4_group:
                return Int4Linear(w, b, int4_group, dtype)
            return DenseLinear(w.to(dtype), None if b is None else b.to(dtype))
        self.register_buffer("embed", weights["model.embed_tokens.weight"].to(dtype))
        self.layers = nn.ModuleList()
        for i in range(spec.layers):
            pre = f"model.layers.{i}."
            w = {k[len(pre):]: v.to(dtype) for k, v in weights.items() if k.startswith(pre)}
            self.layers.append(Layer(spec, w, make_linear))
            for k in list(weights):      # free the source tensors of this layer as soon as it is built
                if k.startswith(pre):
                    del weights[k]
        self.register_buffer("norm", weights["model.norm.weight"].to(dtype))
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.lm_head = make_linear(head.to(dtype), None)
        self.register_buffer("cos", cos.to(self.embed.device))
        self.register_buffer("sin", sin.to(self.embed.device))
        self.caches: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.capacity = 0
        if self.embed.is_cuda:
            # the weights are inputs of the captured graph: static addresses, so a replay never copies them
            # (torch.compile copies a non-static input into the graph's own buffer before every replay)
            for t in self.buffers():
                torch._dynamo.mark_static_address(t)

    @property
    def device(self):
        return self.embed.device

    def use_cache(self, batch: int, needed: int) -> int:
        """Point every layer at the KV cache for ``batch`` rows and ``needed`` positions rounded up to a multiple of
        CACHE_ROUND: allocated once per (batch, capacity) and kept, so a captured CUDA graph finds its buffers at
        the same addresses again, and a 96-token decode does not attend over a 2,304-position cache."""
        cap = math.ceil(needed / CACHE_ROUND) * CACHE_ROUND
        if cap > self.cos.shape[0]:
            raise ValueError(f"{needed} positions: the rope tables hold {self.cos.shape[0]} (max_seq)")
        if (batch, cap) not in self.caches:
            s = self.spec
            bufs = []
            for _ in self.layers:
                k = torch.zeros(batch, s.kv_heads, cap, s.head_dim, dtype=self.dtype, device=self.device)
                v = torch.zeros_like(k)
                if k.is_cuda:
                    torch._dynamo.mark_static_address(k)
                    torch._dynamo.mark_static_address(v)
                bufs.append((k, v))
            self.caches[(batch, cap)] = bufs
        for layer, (k, v) in zip(self.layers, self.caches[(batch, cap)]):
            layer.k_cache, layer.v_cache = k, v
        self.capacity = cap
        return cap

    def forward(self, ids, input_pos, prefill: bool, last_only: bool = True):
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        mask = None if prefill else (torch.arange(self.capacity, device=ids.device)[None, :] <= input_pos[:, None])
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, mask, prefill)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(rms_norm(x, self.norm, self.spec.eps))

    def weight_bytes(self) -> dict:
        """Bytes of every weight tensor, and of those one decode step reads (all but the embedding table, unless
        the lm_head is that table)."""
        total = emb = 0
        for name, t in self.named_buffers():
            if t is None or name in ("cos", "sin") or name.endswith(("k_cache", "v_cache")):
                continue
            total += t.numel() * t.element_size()
            if name == "embed":
                emb = t.numel() * t.element_size()
        return {"all_bytes": total, "step_bytes": total - emb}


def load_weights(hf_dir: Path, device: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors (the PyTorch peer reads the HF weights)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=device) as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def load(hf_dir: Path, device: str = "cuda", dtype=torch.float16, int4_group: int | None = None,
         max_seq: int = 4096) -> StaticDecoder:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(hf_dir))
    spec = spec_from_config(cfg)
    cos, sin = rope_tables(cfg, spec, max_seq)
    with torch.no_grad():
        return StaticDecoder(spec, load_weights(hf_dir, device), cos, sin, dtype, int4_group).eval()


def decode_step(model: StaticDecoder, compile: bool):
    """(step(tok [B, 1], pos [1]) -> next tok [B, 1], compiled?). Compiled with mode="reduce-overhead" (CUDA
    graphs) only on a CUDA device: on a CPU that mode has no graph to replay."""
    def step(tok, pos):
        return model(tok, pos, prefill=False)[:, -1].argmax(-1, keepdim=True)
    if compile and model.device.type == "cuda":
        return torch.compile(step, mode="reduce-overhead", fullgraph=True), True
    return step, False


class Generator:
    """Greedy generation: eager prefill, then the (compiled) decode step once per token. If compiling fails (no C
    compiler for Triton, an unsupported op), decode goes on eager and says so (``compiled``, ``compile_error``)."""

    def __init__(self, model: StaticDecoder, compile: bool = True):
        self.model = model
        self.step, self.compiled = decode_step(model, compile)
        self.compile_s: dict[str, float] = {}
        self.compile_error: str | None = None

    def _step(self, tok, pos, first: bool):
        if not self.compiled:
            return self.step(tok, pos)
        try:
            torch.compiler.cudagraph_mark_step_begin()
            return self.step(tok, pos).clone()     # a CUDA graph's output is overwritten by its next replay
        except Exception as e:  # noqa: BLE001 - only a first (compiling) call falls back
            if not first:
                raise
            self.compile_error = f"{type(e).__name__}: {e}"[:500]
            self.step, self.compiled = decode_step(self.model, compile=False)
            return self.step(tok, pos)

    def _sync(self):
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def prefill_logits(self, ids: torch.Tensor, last_only: bool = True) -> torch.Tensor:
        b, t = ids.shape
        self.model.use_cache(b, t)
        out = self.model(ids, torch.arange(t, device=ids.device), prefill=True, last_only=last_only)
        self._sync()
        return out

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        b, t = ids.shape
        cap = self.model.use_cache(b, t + n)
        tok = self.model(ids, torch.arange(t, device=ids.device), prefill=True)[:, -1].argmax(-1, keepdim=True)
        out = [tok]
        pos = torch.tensor([t], device=ids.device)
        key = f"b{b}_cap{cap}"
        for _ in range(n - 1):
            first = key not in self.compile_s
            t0 = time.perf_counter()
            tok = self._step(tok, pos, first)
            if first:
                self._sync()
                self.compile_s[key] = time.perf_counter() - t0
            pos += 1
            out.append(tok)
        res = torch.cat(out, dim=1)
        self._sync()
        return res


class TorchStaticAdapter:
    """bench.measure adapter over :class:`Generator` (prefill: prompt to last-position logits, eager)."""

    supports_batch_prefill = True

    def __init__(self, name: str, hf_dir: str, quant: str = "fp16", device: str = "cuda", compile: bool = True,
                 group: int = INT4_GROUP, max_seq: int = 4096):
        if quant not in ("fp16", "int4"):
            raise ValueError(f"quant {quant!r}: fp16 or int4")
        # tinygemm's CUDA kernel takes bf16 activations only, so the INT4 model runs in bf16
        dtype = torch.float16 if quant == "fp16" else torch.bfloat16
        t0 = time.perf_counter()
        self.model = load(Path(hf_dir), device, dtype, group if quant == "int4" else None,
                          max_seq=math.ceil(max_seq / CACHE_ROUND) * CACHE_ROUND)
        self.load_s = time.perf_counter() - t0
        self.gen = Generator(self.model, compile)
        self.name, self.device = name, device
        step = ("decode step torch.compile(mode='reduce-overhead'), replayed as a CUDA graph" if self.gen.compiled
                else f"decode step eager (torch.compile's CUDA graphs need a CUDA device; this is {device})")
        w = ("fp16" if quant == "fp16" else
             f"INT4 weights (aten._weight_int4pack_mm, group {group}, min/max asymmetric, lm_head too), bf16 "
             "activations")
        self.what = f"PyTorch {torch.__version__} static-KV decoder, {w}; {step}; prefill eager"
        self.generate_batch = self._gen

    def _ids(self, ids) -> torch.Tensor:
        arr = np.asarray(ids, dtype=np.int64)
        return torch.as_tensor(arr if arr.ndim == 2 else arr.reshape(1, -1), device=self.device)

    def prefill(self, ids):
        return self.gen.prefill_logits(self._ids(ids))

    def _gen(self, ids, n):
        return self.gen.generate(self._ids(ids), n).cpu().numpy()

    def generate(self, ids, n):
        return self._gen(ids, n)[0].tolist()

    def facts(self) -> dict:
        return {"compiled": self.gen.compiled, "compile_s": dict(self.gen.compile_s), "load_s": self.load_s,
                "compile_error": self.gen.compile_error,
                **{f"weights_{k}": v for k, v in self.model.weight_bytes().items()}}
