"""Per-layer calibration statistics: raw activation ranges, smoothing factors, weight scales, KV scales.

``ActivationRecorder`` hooks every ``nn.Linear`` while calibration batches run and keeps the per-channel
max |x| of its input (the raw activation, before any smoothing or quantizer). After calibration,
:func:`collect_layer_stats` reads what ModelOpt calibrated from the quantizers (``amax``, ``pre_quant_scale``)
and joins the two into one JSON-able record per layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


class ActivationRecorder:
    """Forward pre-hooks recording per-input-channel max |x| for every Linear (lm_head excluded)."""

    def __init__(self, model: nn.Module, skip: tuple[str, ...] = ("lm_head",)):
        self.amax: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and not any(s in name for s in skip):
                self._handles.append(mod.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(_mod, args):
            x = args[0].detach()
            m = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float().cpu()
            prev = self.amax.get(name)
            self.amax[name] = m if prev is None else torch.maximum(prev, m)
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def _summary(t: torch.Tensor | None) -> dict | None:
    if t is None:
        return None
    t = t.detach().float().flatten().cpu()
    return {"numel": t.numel(), "max": float(t.max()), "min": float(t.min()), "mean": float(t.mean())}


def _quantizer_info(q) -> dict | None:
    if q is None or not getattr(q, "is_enabled", False):
        return None
    out = {"num_bits": q.num_bits if isinstance(q.num_bits, int) else list(q.num_bits),
           "axis": q.axis, "block_sizes": {str(k): v for k, v in (q.block_sizes or {}).items()} or None}
    amax = getattr(q, "amax", None)
    out["amax"] = _summary(amax) if amax is not None else None
    pqs = getattr(q, "pre_quant_scale", None)
    out["pre_quant_scale"] = _summary(pqs) if pqs is not None else None
    return out


def collect_layer_stats(model: nn.Module, act_amax: dict[str, torch.Tensor]) -> list[dict]:
    """One record per quantizable Linear and per attention module with KV quantizers, in model order."""
    rows: list[dict] = []
    for name, mod in model.named_modules():
        if name in act_amax:
            a = act_amax[name]
            med = float(a.median())
            row = {
                "layer": name,
                "in_features": a.numel(),
                "act_amax": float(a.max()),
                "act_channel_median": med,
                # how far the largest input channel sticks out: what SmoothQuant/AWQ have to fight
                "outlier_ratio": float(a.max()) / med if med > 0 else float("inf"),
                "outlier_channels": [int(i) for i in torch.topk(a, min(4, a.numel())).indices],
                "input_quantizer": _quantizer_info(getattr(mod, "input_quantizer", None)),
                "weight_quantizer": _quantizer_info(getattr(mod, "weight_quantizer", None)),
            }
            iq = getattr(mod, "input_quantizer", None)
            pqs = getattr(iq, "pre_quant_scale", None) if iq is not None else None
            # ModelOpt divides the input by pre_quant_scale's inverse: x_q = Q(x * pqs); SmoothQuant's
            # smoothing factor s_j (x / s) is therefore 1 / pqs.
            if pqs is not None:
                s = 1.0 / pqs.detach().float().flatten().cpu()
                row["smoothing_factor"] = {"max": float(s.max()), "min": float(s.min()),
                                           "argmax": int(s.argmax())}
            rows.append(row)
        kq, vq = getattr(mod, "k_bmm_quantizer", None), getattr(mod, "v_bmm_quantizer", None)
        if kq is not None and getattr(kq, "is_enabled", False):
            rows.append({"layer": name, "kind": "kv_cache",
                         "k_bmm_quantizer": _quantizer_info(kq), "v_bmm_quantizer": _quantizer_info(vq)})
    return rows


def top_outliers(rows: list[dict], k: int = 5) -> list[dict]:
    """The ``k`` layers whose largest input channel is furthest above the channel median."""
    lin = [r for r in rows if "outlier_ratio" in r]
    lin.sort(key=lambda r: r["outlier_ratio"], reverse=True)
    keep = ("layer", "outlier_ratio", "act_amax", "act_channel_median", "outlier_channels", "smoothing_factor")
    return [{k2: r[k2] for k2 in keep if k2 in r} for r in lin[:k]]


def save_stats(rows: list[dict], path: Path) -> None:
    Path(path).write_text(json.dumps({"layers": rows, "top_outliers": top_outliers(rows)}, indent=1))


def scales_fingerprint(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every calibrated quantizer buffer (amax, pre_quant_scale), for reproducibility checks."""
    out = {}
    for name, t in model.state_dict().items():
        if "quantizer" in name and (name.endswith("_amax") or name.endswith("_pre_quant_scale")):
            out[name] = t.detach().cpu().clone()
    return out
