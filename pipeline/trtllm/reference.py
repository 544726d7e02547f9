"""Reference numerics of a TensorRT-LLM checkpoint, computed from the checkpoint files alone, streamed layer by layer.

Label: "checkpoint, reference numerics" — this is a torch re-implementation of what TensorRT-LLM's
Llama / Mistral / QWen (Qwen2, Qwen3) / Gemma 3 models compute from these tensors, not a TensorRT-LLM engine.
Per-family semantics and their TensorRT-LLM 1.2 sources: ``pipeline/trtllm/families.py``.

- Streaming: nothing is materialised up front. A forward opens each ``rank{N}.safetensors`` with safetensors'
  ``safe_open`` (memory-mapped), reads one decoder layer of every rank of the stage, dequantizes it onto the
  compute device, runs every batch through it, frees it and closes the file (closing unmaps the pages, so the
  file's pages do not accumulate in the resident set). Host RAM stays near one layer of all ranks in fp32 plus
  the activations and one batch's logits, instead of the whole checkpoint in fp32.
- Device: CUDA when a GPU is visible (one device holds every rank in turn), CPU otherwise; ``device=`` overrides.
  Matmuls run in float32 without TF32 on both, so both give the same numbers within float32 rounding.
- Per rank: each ``rank{N}.safetensors`` is used only for the rank that owns it. Column-parallel linears
  produce local shards, attention runs on the rank's local heads (KV heads as stored, i.e. duplicated when
  kv_heads < tp), row-parallel linears produce partial sums; the TP all-reduce is a sum over the TP ranks of a
  stage, the parallel embedding is a masked lookup + sum, lm_head shards are gathered and the vocab padding
  cut. PP: the hidden state is handed from one stage's ranks to the next (first stage embeds, last stage
  applies ln_f and lm_head). Where the ranks meet (all-reduce, hand-off, gather) are methods of their own;
  ``pipeline/trtllm/distributed.py`` overrides them to run one rank per process over ``torch.distributed``.
- Families: Llama 3.x ``rotary_scaling`` (llama3 / linear), sliding-window attention (Mistral: every layer;
  Gemma 3: layers with ``(i + 1) % _sliding_window_pattern != 0``, with ``rope_local_base_freq``; a key at
  position j is visible from position i when ``i - window < j <= i``), per-head q/k RMSNorm before RoPE
  (Qwen3, Gemma 3), Gemma 3's embedding scale sqrt(hidden), softmax scale 1/sqrt(query_pre_attn_scalar),
  post-attention and pre/post-feedforward norms and GeGLU (tanh GELU).
- Quantization follows TensorRT-LLM's layer semantics (trtllm-reference.md §1.7–1.10):
  * W8A8_SQ_PER_CHANNEL (``Int8SmoothQuantLinear``): ``x * prequant_scaling_factor`` (model dtype), quantize
    ``round(x / activation_scaling_factor)`` clamped to int8, dequantize, times the int8 weight dequantized
    per output channel with ``weights_scaling_factor``.
  * W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN (layout and sources: ``sq_per_token.py``): dense / proj inputs divided by
    ``smoother``; each token quantized by its own scale, ``round(x * 127 / max|x|)``; the int8 GEMM dequantized by
    that scale times the output channel's ``per_channel_scale``.
  * W8A16 / W4A16 with float weights: the per-output-channel symmetric RTN trtllm-build applies at load
    (``weight_only_quantize_dict``); int8 ``(in, out)`` + ``per_channel_scale`` is used as stored.
  * FP8: e4m3 weights times ``weights_scaling_factor``; activations cast to e4m3 after ``/ activation_scaling_factor``.
  * FP8_PER_CHANNEL_PER_TOKEN (rowwise; layout: ModelOpt's export, contract.py RULE_FP8_PC_PT): every linear's input
    quantized per token by the QuantizePerToken / RMSNorm-quantization plugins -- ``scale = max(max|x| / 448,
    1 / (448 * 512))`` with max|x| at least 1e-6 (``perTokenQuantization``, hasFp8MinScaling, in
    cpp/tensorrt_llm/kernels/quantization.cu, 1.x, index id 3009811166), after clamping to ``clamp_val`` when the
    config sets one -- and the FP8 GEMM's float32 result scaled by that token's scale times the output channel's
    ``per_channel_scale`` (``fp8_rowwise_gemm``; Fp8RowwiseLinear, layers.py, index id 790827869).
  * W4A16_AWQ groupwise int4 (int4_zp.py for the layout): ``w = q * scale + zero`` per group in the model dtype
    (``zero`` 0 without has_zero_point), input times ``prequant_scaling_factor`` first when present.
  * INT8 / FP8 KV cache (``kv_cache_scaling_factor``): K (after RoPE) and V stored quantized. ``kv_cache``:
    ``"generation"`` (default) — every position attends to the quantized K/V of earlier tokens and the exact K/V
    of itself, as when tokens are decoded one at a time; ``"context"`` — no KV quantization (an engine's context
    phase with non-paged context FMHA reads the fresh K/V); ``"all"`` — every K/V quantized.
- Precision: weights and activations are rounded to the checkpoint dtype at layer boundaries; the matmuls and
  softmax run in float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from safetensors import safe_open

from .contract import QWEN_ARCHS, pp_layer_ranges
from .families import sliding_layers

LABEL = "checkpoint, reference numerics"
SQ_PER_TOKEN = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
SQ_ALGOS = ("W8A8_SQ_PER_CHANNEL", SQ_PER_TOKEN)
FP8_PC_PT = "FP8_PER_CHANNEL_PER_TOKEN"
SUPPORTED = (None, *SQ_ALGOS, "W8A16", "W4A16", "W4A16_AWQ", "FP8", FP8_PC_PT)
_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_FP8_MAX = 448.0
_FP8_MIN_SCALE = 1.0 / (448.0 * 512.0)   # QuantTypeStaticVals<__nv_fp8_e4m3>::MIN_SCALING_FACTOR (rowwise)
# The engine's per-head q/k RMSNorm eps is Attention's default, not the checkpoint's norm_epsilon: Attention(...,
# qk_layernorm, eps=1e-05) builds q_layernorm/k_layernorm with eps=eps (tensorrt_llm/layers/attention.py, TRT-LLM
# 1.x, index ids 1178835378 / 29227859985), and neither QWenDecoderLayer (qwen/model.py, index id 66032162657) nor
# GemmaDecoderLayer (gemma/model.py, index id 83670668) passes eps. HF applies rms_norm_eps (1e-6) there (issue 27).
QK_NORM_EPS = 1e-5
LM_HEAD_ROWS = 4096           # lm_head rows dequantized to fp32 at a time (bounds memory at large vocabularies)
# hidden_act of the gated MLP's fc branch. TensorRT-LLM's ``gelu`` is the tanh approximation (families.py).
_ACTS = {"silu": F.silu, "swiglu": F.silu, "gelu": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc keeps freed blocks below its dynamic mmap threshold, which
    otherwise shows up as resident memory between layers). No-op where malloc_trim does not exist."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class _Linear:
    """A linear as stored in the checkpoint; ``weight()`` dequantizes it to float32 when it is applied, so a
    layer stays resident in its stored size and only one linear is float32 at a time."""
    stored: torch.Tensor                 # the weight as in the file, on the compute device
    make: Any                            # stored -> effective float32 weight [out, in]
    bias: torch.Tensor | None = None
    act: str | None = None               # None | "int8" | "int8_token" | "fp8" | "fp8_token"
    act_scale: float = 1.0
    prequant: torch.Tensor | None = None  # [in], model dtype values
    smoother: torch.Tensor | None = None  # [in], model dtype values: the input is divided by it (plugin SQ)

    def weight(self) -> torch.Tensor:
        return self.make(self.stored)


class ReferenceModel:
    """Logits of a TRT-LLM checkpoint computed per rank, streamed one layer at a time; see the module docstring."""

    label = LABEL

    def __init__(self, ckpt_dir: str | Path, *, kv_cache: str = "generation", threads: int | None = None,
                 device: str | torch.device | None = None):
        if kv_cache not in ("generation", "context", "all"):
            raise ValueError(f"kv_cache must be generation, context or all, got {kv_cache!r}")
        if threads:
            torch.set_num_threads(threads)
        self.dir = Path(ckpt_dir)
        self.device = torch.device(device) if device is not None else default_device()
        self.cfg = cfg = json.loads((self.dir / "config.json").read_text())
        self.kv_mode = kv_cache
        self.dtype = _DT[cfg["dtype"]]
        m = cfg.get("mapping") or {}
        self.tp, self.pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
        self.H, self.N = cfg["hidden_size"], cfg["num_attention_heads"]
        self.K = cfg.get("num_key_value_heads") or self.N
        self.D = cfg.get("head_size") or self.H // self.N
        self.V, self.L = cfg["vocab_size"], cfg["num_hidden_layers"]
        self.eps = float(cfg.get("norm_epsilon", 1e-6))
        arch = cfg["architecture"]
        default_base = 100000.0 if arch in QWEN_ARCHS and cfg.get("qwen_type") != "qwen" else 10000.0
        self.rotary_base = float(cfg.get("rotary_base", default_base))
        self.rotary_scaling = cfg.get("rotary_scaling")
        gemma3 = arch == "Gemma3ForCausalLM"
        self.inter_layernorms = gemma3 or bool(cfg.get("inter_layernorms", False))
        self.emb_scale = math.sqrt(self.H) if gemma3 else None       # GemmaModel: emb * sqrt(hidden_size)
        qpas = cfg.get("query_pre_attn_scalar") if gemma3 else None
        self.attn_scale = 1.0 / math.sqrt(float(qpas) if qpas else self.D)
        self.local_base = float(cfg.get("rope_local_base_freq") or self.rotary_base)
        self.final_softcap = cfg.get("final_logit_softcapping") if gemma3 else None
        self.window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
        self.sliding = sliding_layers(cfg)
        q = cfg.get("quantization") or {}
        self.quant_algo, self.kv_algo = q.get("quant_algo"), q.get("kv_cache_quant_algo")
        if self.quant_algo not in SUPPORTED:
            raise NotImplementedError(f"reference numerics for quant_algo {self.quant_algo} are not implemented "
                                      f"(supported: none, {', '.join(a for a in SUPPORTED if a)})")
        self.group_size = int(q.get("group_size") or 128)
        self.clamp = q.get("clamp_val")          # FP8 rowwise: activations clamped to it before quantizing
        act = cfg.get("hidden_act", "silu")
        if act not in _ACTS:
            raise NotImplementedError(f"hidden_act {act!r} (gated MLP with {', '.join(_ACTS)})")
        self.act = _ACTS[act]
        self.ranges = pp_layer_ranges(self.L, self.pp)
        self.files = [self.dir / f"rank{r}.safetensors" for r in range(self.tp * self.pp)]
        missing = [f.name for f in self.files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{self.dir}: {', '.join(missing)} missing (mapping says {len(self.files)} ranks)")

    # ------------------------------------------------------------------ reading (one rank file at a time)
    def _open(self, rank: int):
        """The rank's safetensors, memory-mapped; closing the handle unmaps it (see the module docstring)."""
        return safe_open(str(self.files[rank]), framework="pt")

    def _get(self, f, name: str) -> torch.Tensor:
        """``name`` on the compute device, owned: on CPU a copy, because a tensor backed by the file mapping keeps
        the mapping, and with it every page read through it, resident after the file is closed."""
        t = f.get_tensor(name)
        return t.clone() if self.device.type == "cpu" else t.to(self.device)

    def _rd(self, t: torch.Tensor) -> torch.Tensor:
        """Round to the checkpoint dtype, keep float32 storage."""
        return t.to(self.dtype).float()

    def _linear(self, f, names: set, prefix: str, excluded: bool = False) -> _Linear:
        w = self._get(f, prefix + ".weight")
        bias = self._get(f, prefix + ".bias").float() if prefix + ".bias" in names else None
        algo = None if excluded else self.quant_algo
        rd = self._rd
        if algo == "W8A8_SQ_PER_CHANNEL" and w.dtype == torch.int8:
            wsf = self._get(f, prefix + ".weights_scaling_factor").float().reshape(-1, 1)
            asf = float(f.get_tensor(prefix + ".activation_scaling_factor").reshape(-1)[0])
            return _Linear(w, lambda t: rd(t.float() * wsf), bias, "int8", asf,
                           self._get(f, prefix + ".prequant_scaling_factor").float())
        if algo == SQ_PER_TOKEN and w.dtype == torch.int8:
            pcs = self._get(f, prefix + ".per_channel_scale").float().reshape(-1, 1)
            sm = self._get(f, prefix + ".smoother").float().reshape(-1) if prefix + ".smoother" in names else None
            return _Linear(w, lambda t: t.float() * pcs, bias, "int8_token",
                           smoother=None if sm is None else self._rd(sm))
        if algo == FP8_PC_PT and w.dtype in (torch.int8, torch.float8_e4m3fn):
            pcs = self._get(f, prefix + ".per_channel_scale").float().reshape(-1, 1)
            return _Linear(w, lambda t: t.view(torch.float8_e4m3fn).float() * pcs, bias, "fp8_token")
        if algo == "W4A16_AWQ" and w.dtype == torch.int8:
            from .int4_zp import unpack
            scale = self._rd(self._get(f, prefix + ".weights_scaling_factor").float())     # [out, in / g]
            zero = (self._rd(self._get(f, prefix + ".zero").float()).t() if prefix + ".zero" in names
                    else torch.zeros_like(scale))                                        # stored [in / g, out]
            pqs = (self._rd(self._get(f, prefix + ".prequant_scaling_factor").float().reshape(-1))
                   if prefix + ".prequant_scaling_factor" in names else None)

            def dq(t):   # the groupwise GEMM's dequantization, w = q * scale + zero, in the model dtype
                from .zp_grid import dequantize
                return rd(dequantize(unpack(t), scale, zero))
            return _Linear(w, dq, bias, prequant=pqs)
        if algo == "FP8" and w.dtype in (torch.int8, torch.float8_e4m3fn):
            wsf = float(f.get_tensor(prefix + ".weights_scaling_factor").reshape(-1)[0])
            asf = float(f.get_tensor(prefix + ".activation_scaling_factor").reshape(-1)[0])
            return _Linear(w, lambda t: rd(t.view(torch.float8_e4m3fn).float() * wsf), bias, "fp8", asf)
        if algo in ("W8A16", "W4A16"):
            if w.dtype == torch.int8:
                if algo == "W4A16":
                    raise NotImplementedError("packed int4 weight-only tensors (quint4x2) are not decoded here")
                pcs = self._get(f, prefix + ".per_channel_scale").float().reshape(-1, 1)
                return _Linear(w, lambda t: rd(t.float().t() * pcs), bias)
            qmax = 127.0 if algo == "W8A16" else 7.0

            def rtn(t):   # trtllm-build's per-output-channel symmetric RTN at load (weight_only_quantize_dict)
                wf = t.float()
                scale = rd(wf.abs().amax(dim=1, keepdim=True) / qmax).clamp_min(1e-12)
                return rd(torch.round(wf / scale).clamp(-qmax - 1, qmax) * scale)
            return _Linear(w, rtn, bias)
        return _Linear(w, lambda t: t.float(), bias)

    def _load_layer(self, rank: int, local: int) -> dict[str, Any]:
        """Layer ``local`` (PP-local index) of ``rank``, dequantized onto the device; the file is closed after."""
        p = f"transformer.layers.{local}."
        with self._open(rank) as f:
            names = set(f.keys())
            lay = {"in_ln": self._get(f, p + "input_layernorm.weight").float(),
                   "post_ln": self._get(f, p + "post_layernorm.weight").float(),
                   "qkv": self._linear(f, names, p + "attention.qkv"),
                   "dense": self._linear(f, names, p + "attention.dense"),
                   "fc": self._linear(f, names, p + "mlp.fc"),
                   "gate": self._linear(f, names, p + "mlp.gate"),
                   "proj": self._linear(f, names, p + "mlp.proj"),
                   "kv_scale": None, "q_ln": None, "k_ln": None}
            if p + "attention.q_layernorm.weight" in names:          # Qwen3 / Gemma 3 per-head q/k norm
                lay["q_ln"] = self._get(f, p + "attention.q_layernorm.weight").float()
                lay["k_ln"] = self._get(f, p + "attention.k_layernorm.weight").float()
            if self.inter_layernorms:
                lay["pre_ffn_ln"] = self._get(f, p + "pre_feedforward_layernorm.weight").float()
                lay["post_ffn_ln"] = self._get(f, p + "post_feedforward_layernorm.weight").float()
            if self.kv_algo in ("INT8", "FP8"):
                lay["kv_scale"] = float(f.get_tensor(p + "attention.kv_cache_scaling_factor").reshape(-1)[0])
        return lay

    # ------------------------------------------------------------------ ops
    def _apply(self, lin: _Linear, x: torch.Tensor) -> torch.Tensor:
        if lin.act == "int8_token":       # per-token dynamic scale; int8 GEMM, dequantized per token x channel
            if lin.smoother is not None:
                x = self._rd(x / lin.smoother)
            amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-20)
            x = torch.round(x * (127.0 / amax)).clamp(-128, 127) * (amax / 127.0)
            y = x @ lin.weight().t()
            return y + lin.bias if lin.bias is not None else y
        if lin.act == "fp8_token":        # rowwise FP8: per-token e4m3 activations, per-channel e4m3 weights
            if self.clamp:
                x = x.clamp(float(self.clamp[0]), float(self.clamp[1]))
            amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)
            scale = (amax / _FP8_MAX).clamp_min(_FP8_MIN_SCALE)
            x = (x * torch.minimum(_FP8_MAX / amax, torch.full_like(amax, 1.0 / _FP8_MIN_SCALE))
                 ).to(torch.float8_e4m3fn).float() * scale
            y = x @ lin.weight().t()
            return y + lin.bias if lin.bias is not None else y
        if lin.prequant is not None and lin.act is None:     # groupwise int4 with AWQ's smoothing vector
            x = self._rd(x * lin.prequant)
        if lin.act is not None:
            if lin.prequant is not None:
                x = self._rd(x * lin.prequant)
            s = lin.act_scale
            if lin.act == "int8":
                x = torch.round(x / s).clamp(-128, 127) * s
            else:
                x = (x / s).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float() * s
            x = self._rd(x)
        y = x @ lin.weight().t()
        if lin.bias is not None:
            y = y + lin.bias
        return y

    def _rms(self, x: torch.Tensor, w: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self._rd(x * torch.rsqrt(var + (self.eps if eps is None else eps)) * w)

    def _rope(self, T: int, base: float, scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        D = self.D
        inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        pos = torch.arange(T, dtype=torch.float64)
        rs = self.rotary_scaling if scaled else None
        if rs:
            kind = rs.get("type", rs.get("rope_type"))
            if kind == "linear":
                pos = pos / float(rs["factor"])
            elif kind == "llama3":
                factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
                old = float(rs["original_max_position_embeddings"])
                wavelen = 2 * math.pi / inv
                smooth = ((old / wavelen) - lo) / (hi - lo)
                scaled_inv = torch.where(wavelen > old / lo, inv / factor, inv)
                mid = (wavelen <= old / lo) & (wavelen >= old / hi)
                inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled_inv)
            else:
                raise NotImplementedError(f"rotary_scaling type {kind!r} is not implemented in the reference")
        ang = torch.outer(pos, inv)
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos().float().to(self.device), emb.sin().float().to(self.device)

    @staticmethod
    def _rot(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin

    def _kvq(self, t: torch.Tensor, s: float) -> torch.Tensor:
        if self.kv_algo == "INT8":
            return torch.round(t / s).clamp(-128, 127) * s
        return (t / s).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float() * s

    def _mask(self, T: int, sliding: bool) -> torch.Tensor:
        i = torch.arange(T, device=self.device)
        ok = i[None, :] <= i[:, None]                              # causal
        if sliding and self.window:
            ok &= i[None, :] > i[:, None] - self.window            # the last `window` tokens, itself included
        return ok

    def _attention(self, lay: dict, x: torch.Tensor, rope, mask) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.D
        cos, sin = rope
        qkv = self._rd(self._apply(lay["qkv"], x))
        nq = self.N // self.tp
        nkv = (qkv.shape[-1] // D - nq) // 2
        q, k, v = qkv.split([nq * D, nkv * D, nkv * D], dim=-1)
        q = q.view(B, T, nq, D).transpose(1, 2)
        k = k.view(B, T, nkv, D).transpose(1, 2)
        v = v.view(B, T, nkv, D).transpose(1, 2)
        if lay["q_ln"] is not None:            # per-head RMSNorm over head_size, before RoPE
            q, k = self._rms(q, lay["q_ln"], QK_NORM_EPS), self._rms(k, lay["k_ln"], QK_NORM_EPS)
        q, k = self._rd(self._rot(q, cos, sin)), self._rd(self._rot(k, cos, sin))
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scale = self.attn_scale
        s_kv = lay["kv_scale"]
        if s_kv is None or self.kv_mode == "context":
            scores = (q @ k.transpose(-1, -2)) * scale
            p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            o = p @ v
        else:
            kq, vq = self._kvq(k, s_kv), self._kvq(v, s_kv)
            scores = (q @ kq.transpose(-1, -2)) * scale
            if self.kv_mode == "generation":   # own token exact, earlier tokens from the quantized cache
                diag = (q * k).sum(-1) * scale
                scores = scores.clone()
                idx = torch.arange(T, device=self.device)
                scores[..., idx, idx] = diag
            p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            o = p @ vq
            if self.kv_mode == "generation":
                pd = p.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
                o = o + pd * (v - vq)
        o = self._rd(o.transpose(1, 2).reshape(B, T, nq * D))
        return self._apply(lay["dense"], o)

    def _mlp(self, lay: dict, x: torch.Tensor) -> torch.Tensor:
        a = self._rd(self.act(self._rd(self._apply(lay["fc"], x))))
        g = self._rd(self._apply(lay["gate"], x))
        return self._apply(lay["proj"], self._rd(a * g))

    def _layer(self, lays: list[dict], h: torch.Tensor, rope, mask) -> torch.Tensor:
        """One decoder layer over the stage's TP ranks (the all-reduce is the sum over ranks)."""
        res = h
        attn = self._rd(self._tp_sum(self._attention(r, self._rms(h, r["in_ln"]), rope, mask) for r in lays))
        if self.inter_layernorms:            # Gemma 3: post_layernorm on the attention output, then the residual
            attn = self._rms(attn, lays[0]["post_ln"])
        h = self._rd(res + attn)
        res = h
        ln = "pre_ffn_ln" if self.inter_layernorms else "post_ln"
        mlp = self._rd(self._tp_sum(self._mlp(r, self._rms(h, r[ln])) for r in lays))
        if self.inter_layernorms:
            mlp = self._rms(mlp, lays[0]["post_ffn_ln"])
        return self._rd(res + mlp)

    def _embed(self, ranks: list[int], batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Embedding of every batch, reading one rank's table at a time (parallel embedding: masked lookup + sum).
        On CPU the table stays memory-mapped and only the looked-up rows are read."""
        name = "transformer.vocab_embedding.weight"
        parallel = self.cfg.get("use_parallel_embedding", False)
        dim = int(self.cfg.get("embedding_sharding_dim", 0))
        out: list[Any] = [None] * len(batches)
        for rank in ranks if parallel else ranks[:1]:
            t = rank % self.tp                             # the rank's shard of the table
            with self._open(rank) as f:
                emb = f.get_tensor(name)
                emb = emb if self.device.type == "cpu" else emb.to(self.device)
                for b, ids in enumerate(batches):
                    if parallel and dim == 0:
                        rows = emb.shape[0]
                        local = ids - t * rows
                        ok = (local >= 0) & (local < rows)
                        part = emb[local.clamp(0, rows - 1)].float() * ok.unsqueeze(-1)
                        out[b] = part if out[b] is None else out[b] + part
                    else:                                  # replicated, or split on the hidden dim (concat)
                        part = emb[ids].float()
                        out[b] = part if out[b] is None else torch.cat([out[b], part], dim=-1)
                del emb
        out = [self._embedding_collective(e) for e in out]
        if self.emb_scale is not None:      # GemmaModel: cast(emb * sqrt(hidden_size), dtype)
            out = [self._rd(self._rd(e) * self.emb_scale) for e in out]
        return [self._rd(e) for e in out]

    def _head_into(self, out: torch.Tensor, col: int, rank: int, h: torch.Tensor) -> int:
        """Write rank ``rank``'s ln_f + lm_head shard of the logits of ``h`` into ``out[..., col:]``; returns the
        shard width. The shard is read LM_HEAD_ROWS rows at a time (file reopened per chunk, so its pages do not
        accumulate) and made fp32 one chunk at a time."""
        with self._open(rank) as f:
            names = set(f.keys())
            x = self._rms(h, self._get(f, "transformer.ln_f.weight").float())
            if "lm_head.bias" in names:
                y = self._apply(self._linear(f, names, "lm_head", excluded=True), x)
                width = min(y.shape[-1], out.shape[-1] - col)
                out[..., col:col + width] = y[..., :width].to(out.device)
                return y.shape[-1]
            name = "lm_head.weight" if "lm_head.weight" in names else "transformer.vocab_embedding.weight"
            rows = f.get_slice(name).get_shape()[0]      # shared embedding table (pp 1) when no lm_head
        for r in range(0, rows, LM_HEAD_ROWS):
            if col + r >= out.shape[-1]:
                break                                     # vocab padding rows
            with self._open(rank) as f:                   # reopened per chunk: its pages leave with the handle
                chunk = f.get_slice(name)[r:r + LM_HEAD_ROWS]
            y = x @ chunk.to(self.device).float().t()
            width = min(y.shape[-1], out.shape[-1] - col - r)
            out[..., col + r:col + r + width] = y[..., :width].to(out.device)
        return rows

    # ------------------------------------------------------------------ where the ranks meet
    # One process computes every rank here: the TP all-reduce is a sum over the ranks' partial results, the PP
    # hand-off passes the hidden state on, the lm_head shards are written side by side. ``distributed.py``
    # overrides these hooks to run one rank per process over ``torch.distributed``.
    def _stage_ranks(self) -> list[tuple[int, list[int]]]:
        """(pipeline stage, the ranks of it this process computes), in stage order."""
        return [(s, list(range(s * self.tp, (s + 1) * self.tp))) for s in range(self.pp)]

    def _tp_sum(self, parts: Iterable[torch.Tensor]) -> torch.Tensor:
        """The all-reduce after attention and after the MLP (row-parallel partial sums)."""
        return sum(parts)

    def _embedding_collective(self, e: torch.Tensor) -> torch.Tensor:
        """The parallel embedding's reduction; ``_embed`` already combined every rank's lookup here."""
        return e

    def _recv_hidden(self, stage: int, hs: list[torch.Tensor], batches: list[torch.Tensor]) -> list[torch.Tensor]:
        return hs

    def _send_hidden(self, stage: int, hs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Hand ``hs`` to ``stage + 1``; returns what this process keeps (all of it here)."""
        return hs

    def _final_logits(self, h: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor | None:
        """Float32 CPU logits ``[B, T, vocab_size]`` of the last stage's hidden state ``h``: every lm_head shard
        written into place (the all-gather), vocab padding cut."""
        B, T = shape
        lg = torch.empty(B, T, self.V, dtype=torch.float32)
        col = 0
        for rank in range((self.pp - 1) * self.tp, self.pp * self.tp):
            col += self._head_into(lg, col, rank, h)
        return lg

    # ------------------------------------------------------------------ forward
    def _ids(self, input_ids: Any, attention_mask: Any | None = None) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if attention_mask is not None:
            m = torch.as_tensor(attention_mask).bool()
            if (m[:, 1:] & ~m[:, :-1]).any():
                raise ValueError("the reference takes right-padded batches only (causal attention ignores the pad)")
        return ids

    @torch.inference_mode()
    def iter_logits(self, batches: Iterable[Any]) -> Iterator[torch.Tensor]:
        """Float32 CPU logits ``[B, T, vocab_size]`` of each batch of ``batches``, in order.

        One streaming pass over the checkpoint serves all batches: each layer is read once and every batch's
        hidden state runs through it. Only the hidden states of all batches are kept; logits are yielded one
        batch at a time (``None`` on the ranks of a distributed run that do not assemble them).
        """
        prev_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False          # float32 matmuls, same numbers as on CPU
        try:
            batches = [self._ids(b).to(self.device) for b in batches]
            ropes: dict[tuple[int, bool], Any] = {}

            def rope_mask(T, sliding):
                if (T, sliding) not in ropes:
                    base = self.local_base if sliding and self.emb_scale is not None else self.rotary_base
                    # Gemma 3 local layers: their own base, no rotary scaling (only global layers are scaled)
                    scaled = not (sliding and self.emb_scale is not None)
                    ropes[(T, sliding)] = (self._rope(T, base, scaled), self._mask(T, sliding))
                return ropes[(T, sliding)]

            hs: list[torch.Tensor] | None = None
            for stage, ranks in self._stage_ranks():
                # PP hand-off: the first stage embeds; a later stage takes the hidden state the previous one sends.
                hs = self._embed(ranks, batches) if stage == 0 else self._recv_hidden(stage, hs, batches)
                for i, layer in enumerate(self.ranges[stage]):
                    lays = [self._load_layer(r, i) for r in ranks]
                    sliding = self.sliding[layer]
                    hs = [self._layer(lays, h, *rope_mask(h.shape[1], sliding)) for h in hs]
                    del lays
                    if self.device.type == "cpu":
                        _trim_heap()
                if stage < self.pp - 1:
                    hs = self._send_hidden(stage, hs)
            if self.device.type == "cpu":
                _trim_heap()
            for b in range(len(batches)):
                h = None
                if hs is not None:
                    h, hs[b] = hs[b], None
                lg = self._final_logits(h, tuple(batches[b].shape))
                if lg is not None and self.final_softcap:
                    lg = torch.tanh(lg / self.final_softcap) * self.final_softcap
                yield lg
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32

    def logits(self, input_ids: Any, attention_mask: Any | None = None) -> torch.Tensor:
        """Float32 logits ``[B, T, vocab_size]`` for ``input_ids`` ``[B, T]`` (right padding only)."""
        ids = self._ids(input_ids, attention_mask)
        return next(iter(self.iter_logits([ids])))
