"""Reference numerics of a TensorRT-LLM checkpoint, computed on CPU from the checkpoint files alone.

Label: "checkpoint, reference numerics" — this is a torch re-implementation of what TensorRT-LLM's
Llama/QWen models compute from these tensors, not a TensorRT-LLM engine.

- Per rank: each ``rank{N}.safetensors`` is used only for the rank that owns it. Column-parallel linears
  produce local shards, attention runs on the rank's local heads (KV heads as stored, i.e. duplicated when
  kv_heads < tp), row-parallel linears produce partial sums; the TP all-reduce is a sum over the TP ranks of a
  stage, the parallel embedding is a masked lookup + sum, lm_head shards are gathered and the vocab padding
  cut. PP: the hidden state is handed from one stage's ranks to the next (first stage embeds, last stage
  applies ln_f and lm_head).
- Quantization follows TensorRT-LLM's layer semantics (trtllm-reference.md §1.7–1.10):
  * W8A8_SQ_PER_CHANNEL (``Int8SmoothQuantLinear``): ``x * prequant_scaling_factor`` (model dtype), quantize
    ``round(x / activation_scaling_factor)`` clamped to int8, dequantize, times the int8 weight dequantized
    per output channel with ``weights_scaling_factor``.
  * W8A16 / W4A16 with float weights: the per-output-channel symmetric RTN trtllm-build applies at load
    (``weight_only_quantize_dict``); int8 ``(in, out)`` + ``per_channel_scale`` is used as stored.
  * FP8: e4m3 weights times ``weights_scaling_factor``; activations cast to e4m3 after ``/ activation_scaling_factor``.
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
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .contract import QWEN_ARCHS, pp_layer_ranges

LABEL = "checkpoint, reference numerics"
_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_FP8_MAX = 448.0


@dataclass
class _Linear:
    w: torch.Tensor                      # effective (dequantized) weight [out, in], float32
    bias: torch.Tensor | None = None
    act: str | None = None               # None | "int8" | "fp8"
    act_scale: float = 1.0
    prequant: torch.Tensor | None = None  # [in], model dtype values


class ReferenceModel:
    """Logits of a TRT-LLM checkpoint (Llama / Qwen2) computed per rank; see the module docstring."""

    label = LABEL

    def __init__(self, ckpt_dir: str | Path, *, kv_cache: str = "generation", threads: int | None = None):
        if kv_cache not in ("generation", "context", "all"):
            raise ValueError(f"kv_cache must be generation, context or all, got {kv_cache!r}")
        if threads:
            torch.set_num_threads(threads)
        self.dir = Path(ckpt_dir)
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
        default_base = 100000.0 if cfg["architecture"] in QWEN_ARCHS and cfg.get("qwen_type") != "qwen" else 10000.0
        self.rotary_base = float(cfg.get("rotary_base", default_base))
        self.rotary_scaling = cfg.get("rotary_scaling")
        q = cfg.get("quantization") or {}
        self.quant_algo, self.kv_algo = q.get("quant_algo"), q.get("kv_cache_quant_algo")
        if self.quant_algo not in (None, "W8A8_SQ_PER_CHANNEL", "W8A16", "W4A16", "FP8"):
            raise NotImplementedError(f"reference numerics for quant_algo {self.quant_algo} are not implemented "
                                      f"(supported: none, W8A8_SQ_PER_CHANNEL, W8A16, W4A16, FP8)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.get('hidden_act')} (only silu gated MLP)")
        self.ranges = pp_layer_ranges(self.L, self.pp)
        self.ranks: list[dict[str, Any]] = [self._load_rank(r) for r in range(self.tp * self.pp)]

    # ------------------------------------------------------------------ loading
    def _rd(self, t: torch.Tensor) -> torch.Tensor:
        """Round to the checkpoint dtype, keep float32 storage."""
        return t.to(self.dtype).float()

    def _linear(self, sd: dict, prefix: str, excluded: bool = False) -> _Linear:
        w = sd[prefix + ".weight"]
        bias = sd.get(prefix + ".bias")
        bias = bias.float() if bias is not None else None
        algo = None if excluded else self.quant_algo
        if algo == "W8A8_SQ_PER_CHANNEL" and w.dtype == torch.int8:
            wsf = sd[prefix + ".weights_scaling_factor"].float()
            weff = self._rd(w.float() * wsf.reshape(-1, 1))
            return _Linear(weff, bias, "int8", float(sd[prefix + ".activation_scaling_factor"].reshape(-1)[0]),
                           sd[prefix + ".prequant_scaling_factor"].float())
        if algo == "FP8" and w.dtype in (torch.int8, torch.float8_e4m3fn):
            wsf = float(sd[prefix + ".weights_scaling_factor"].reshape(-1)[0])
            weff = self._rd(w.view(torch.float8_e4m3fn).float() * wsf)
            return _Linear(weff, bias, "fp8", float(sd[prefix + ".activation_scaling_factor"].reshape(-1)[0]))
        if algo in ("W8A16", "W4A16"):
            if w.dtype == torch.int8:
                if algo == "W4A16":
                    raise NotImplementedError("packed int4 weight-only tensors (quint4x2) are not decoded here")
                pcs = sd[prefix + ".per_channel_scale"].float()
                return _Linear(self._rd(w.float().t() * pcs.reshape(-1, 1)), bias)
            qmax = 127.0 if algo == "W8A16" else 7.0
            wf = w.float()
            scale = self._rd(wf.abs().amax(dim=1, keepdim=True) / qmax).clamp_min(1e-12)
            qw = torch.round(wf / scale).clamp(-qmax - 1, qmax)
            return _Linear(self._rd(qw * scale), bias)
        return _Linear(w.float(), bias)

    def _load_rank(self, rank: int) -> dict[str, Any]:
        sd = load_file(str(self.dir / f"rank{rank}.safetensors"))
        pp_rank = rank // self.tp
        out: dict[str, Any] = {"rank": rank, "layers": []}
        if "transformer.vocab_embedding.weight" in sd:
            out["emb"] = sd["transformer.vocab_embedding.weight"].float()
        if "transformer.ln_f.weight" in sd:
            out["ln_f"] = sd["transformer.ln_f.weight"].float()
        if "lm_head.weight" in sd:
            out["lm_head"] = self._linear(sd, "lm_head", excluded=True)
        for i in range(len(self.ranges[pp_rank])):
            p = f"transformer.layers.{i}."
            lay = {
                "in_ln": sd[p + "input_layernorm.weight"].float(),
                "post_ln": sd[p + "post_layernorm.weight"].float(),
                "qkv": self._linear(sd, p + "attention.qkv"),
                "dense": self._linear(sd, p + "attention.dense"),
                "fc": self._linear(sd, p + "mlp.fc"),
                "gate": self._linear(sd, p + "mlp.gate"),
                "proj": self._linear(sd, p + "mlp.proj"),
                "kv_scale": None,
            }
            if self.kv_algo in ("INT8", "FP8"):
                lay["kv_scale"] = float(sd[p + "attention.kv_cache_scaling_factor"].reshape(-1)[0])
            out["layers"].append(lay)
        return out

    # ------------------------------------------------------------------ ops
    def _apply(self, lin: _Linear, x: torch.Tensor) -> torch.Tensor:
        if lin.act is not None:
            if lin.prequant is not None:
                x = self._rd(x * lin.prequant)
            s = lin.act_scale
            if lin.act == "int8":
                x = torch.round(x / s).clamp(-128, 127) * s
            else:
                x = (x / s).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float() * s
            x = self._rd(x)
        y = x @ lin.w.t()
        if lin.bias is not None:
            y = y + lin.bias
        return y

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self._rd(x * torch.rsqrt(var + self.eps) * w)

    def _rope(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        D = self.D
        inv = 1.0 / (self.rotary_base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        pos = torch.arange(T, dtype=torch.float64)
        rs = self.rotary_scaling
        if rs:
            kind = rs.get("type", rs.get("rope_type"))
            if kind == "linear":
                pos = pos / float(rs["factor"])
            elif kind == "llama3":
                factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
                old = float(rs["original_max_position_embeddings"])
                wavelen = 2 * math.pi / inv
                smooth = ((old / wavelen) - lo) / (hi - lo)
                scaled = torch.where(wavelen > old / lo, inv / factor, inv)
                mid = (wavelen <= old / lo) & (wavelen >= old / hi)
                inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
            else:
                raise NotImplementedError(f"rotary_scaling type {kind!r} is not implemented in the reference")
        ang = torch.outer(pos, inv)
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos().float(), emb.sin().float()

    @staticmethod
    def _rot(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin

    def _kvq(self, t: torch.Tensor, s: float) -> torch.Tensor:
        if self.kv_algo == "INT8":
            return torch.round(t / s).clamp(-128, 127) * s
        return (t / s).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float() * s

    def _attention(self, lay: dict, x: torch.Tensor, cos, sin) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.D
        qkv = self._rd(self._apply(lay["qkv"], x))
        nq = self.N // self.tp
        nkv = (qkv.shape[-1] // D - nq) // 2
        q, k, v = qkv.split([nq * D, nkv * D, nkv * D], dim=-1)
        q = q.view(B, T, nq, D).transpose(1, 2)
        k = k.view(B, T, nkv, D).transpose(1, 2)
        v = v.view(B, T, nkv, D).transpose(1, 2)
        q, k = self._rd(self._rot(q, cos, sin)), self._rd(self._rot(k, cos, sin))
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scale = 1.0 / math.sqrt(D)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        s_kv = lay["kv_scale"]
        if s_kv is None or self.kv_mode == "context":
            scores = (q @ k.transpose(-1, -2)) * scale
            p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            o = p @ v
        else:
            kq, vq = self._kvq(k, s_kv), self._kvq(v, s_kv)
            scores = (q @ kq.transpose(-1, -2)) * scale
            if self.kv_mode == "generation":   # own token exact, earlier tokens from the quantized cache
                diag = (q * k).sum(-1) * scale
                scores = scores.clone()
                idx = torch.arange(T)
                scores[..., idx, idx] = diag
            p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            o = p @ vq
            if self.kv_mode == "generation":
                pd = p.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
                o = o + pd * (v - vq)
        o = self._rd(o.transpose(1, 2).reshape(B, T, nq * D))
        return self._apply(lay["dense"], o)

    def _mlp(self, lay: dict, x: torch.Tensor) -> torch.Tensor:
        a = self._rd(F.silu(self._rd(self._apply(lay["fc"], x))))
        g = self._rd(self._apply(lay["gate"], x))
        return self._apply(lay["proj"], self._rd(a * g))

    def _embed(self, ranks: list[dict], ids: torch.Tensor) -> torch.Tensor:
        if not self.cfg.get("use_parallel_embedding", False):
            return ranks[0]["emb"][ids]
        dim = int(self.cfg.get("embedding_sharding_dim", 0))
        if dim == 1:
            return torch.cat([r["emb"][ids] for r in ranks], dim=-1)
        h = None
        for t, r in enumerate(ranks):          # masked lookup per vocab shard + all-reduce (sum)
            rows = r["emb"].shape[0]
            local = ids - t * rows
            ok = (local >= 0) & (local < rows)
            part = r["emb"][local.clamp(0, rows - 1)] * ok.unsqueeze(-1)
            h = part if h is None else h + part
        return h

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def logits(self, input_ids: Any, attention_mask: Any | None = None) -> torch.Tensor:
        """Float32 logits ``[B, T, vocab_size]`` for ``input_ids`` ``[B, T]`` (right padding only)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if attention_mask is not None:
            m = torch.as_tensor(attention_mask).bool()
            if (m[:, 1:] & ~m[:, :-1]).any():
                raise ValueError("the reference takes right-padded batches only (causal attention ignores the pad)")
        B, T = ids.shape
        cos, sin = self._rope(T)
        h = None
        for stage in range(self.pp):
            ranks = self.ranks[stage * self.tp:(stage + 1) * self.tp]
            if stage == 0:
                h = self._rd(self._embed(ranks, ids))
            # PP hand-off: ``h`` is what the previous stage sends; this stage's ranks hold their own layers.
            for i in range(len(self.ranges[stage])):
                res = h
                attn = sum(self._attention(r["layers"][i], self._rms(h, r["layers"][i]["in_ln"]), cos, sin)
                           for r in ranks)          # all-reduce = sum over the stage's TP ranks
                h = self._rd(res + self._rd(attn))
                res = h
                mlp = sum(self._mlp(r["layers"][i], self._rms(h, r["layers"][i]["post_ln"])) for r in ranks)
                h = self._rd(res + self._rd(mlp))
        last = self.ranks[(self.pp - 1) * self.tp:]
        shards = []
        for r in last:
            x = self._rms(h, r["ln_f"])
            head = r.get("lm_head") or _Linear(r["emb"])   # shared embedding table (pp 1)
            shards.append(self._apply(head, x))
        return torch.cat(shards, dim=-1)[..., :self.V].float()   # all-gather, drop vocab padding
