"""Accuracy metrics of a candidate engine against a reference (FP32) model.

All functions take torch tensors or numpy arrays. Logits are ``[B, T, V]``, token ids ``[B, T]``;
position ``t`` predicts token ``t + 1`` (standard causal-LM shift). Large evaluations stream windows
through :class:`LogitsComparer` (``update`` per window, ``result`` at the end) so nothing has to hold
all logits at once.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["LogitsComparer", "compare_logits", "greedy_match", "perplexity"]


def _t(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    t = t.detach().cpu()
    return t.to(dtype) if dtype is not None else t


def _check(ref: torch.Tensor, cand: torch.Tensor, ids: torch.Tensor) -> None:
    if ref.shape != cand.shape:
        raise ValueError(f"reference logits {tuple(ref.shape)} and candidate logits {tuple(cand.shape)} differ in shape")
    if ref.dim() != 3:
        raise ValueError(f"logits must be [batch, time, vocab], got {tuple(ref.shape)}")
    if tuple(ids.shape) != tuple(ref.shape[:2]):
        raise ValueError(f"input_ids {tuple(ids.shape)} do not match logits {tuple(ref.shape)} in [batch, time]")


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> float:
    """Sum over masked positions of -log p(target) (logits [N, V], targets [N])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    nll = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()
    return float(nll[mask].sum())


class LogitsComparer:
    """Accumulates reference-vs-candidate statistics over windows.

    ``update(ref_logits, cand_logits, input_ids, attention_mask=None)``: perplexity terms use positions
    ``0..T-2`` (predicting ``input_ids[:, 1:]``), masked where the next token is padding; top-1 agreement,
    cosine and max-abs use every (unmasked) position, including the last one.
    """

    def __init__(self) -> None:
        self.ref_nll = 0.0
        self.cand_nll = 0.0
        self.n_pred = 0           # next-token predictions counted for perplexity
        self.n_pos = 0            # positions counted for agreement / cosine
        self.agree = 0
        self.cos_sum = 0.0
        self.max_abs = 0.0
        self.windows = 0

    def update(self, ref_logits: Any, cand_logits: Any, input_ids: Any, attention_mask: Any | None = None) -> dict:
        ref = _t(ref_logits, torch.float32)
        cand = _t(cand_logits, torch.float32)
        ids = _t(input_ids, torch.long)
        _check(ref, cand, ids)
        B, T, V = ref.shape
        mask = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else _t(attention_mask).bool()
        if not torch.isfinite(cand[mask]).all():
            # A candidate producing NaN/inf must never pass; make every metric say so.
            self.cand_nll = math.inf
            self.max_abs = math.inf
        if T > 1:
            pmask = (mask[:, :-1] & mask[:, 1:]).reshape(-1)
            tgt = ids[:, 1:].reshape(-1)
            self.ref_nll += _nll_sum(ref[:, :-1].reshape(-1, V), tgt, pmask)
            if math.isfinite(self.cand_nll):
                self.cand_nll += _nll_sum(cand[:, :-1].reshape(-1, V), tgt, pmask)
            self.n_pred += int(pmask.sum())
        r = ref[mask]
        c = cand[mask]
        self.n_pos += r.shape[0]
        self.agree += int((r.argmax(-1) == c.argmax(-1)).sum())
        cos = torch.nn.functional.cosine_similarity(r.double(), c.double(), dim=-1)
        self.cos_sum += float(torch.nan_to_num(cos, nan=0.0).sum())
        if r.numel():
            d = float((r - c).abs().max())
            self.max_abs = max(self.max_abs, d if math.isfinite(d) else math.inf)
        self.windows += 1
        return self.result()

    def result(self) -> dict:
        ref_ppl = math.exp(self.ref_nll / self.n_pred) if self.n_pred else float("nan")
        ppl = math.exp(min(self.cand_nll / self.n_pred, 700.0)) if self.n_pred else float("nan")
        if not math.isfinite(self.cand_nll):
            ppl = math.inf
        return {
            "ref_ppl": ref_ppl,
            "ppl": ppl,
            "ppl_delta_pct": 100.0 * (ppl - ref_ppl) / ref_ppl if self.n_pred else float("nan"),
            "top1_agreement": self.agree / self.n_pos if self.n_pos else float("nan"),
            "logits_cosine": self.cos_sum / self.n_pos if self.n_pos else float("nan"),
            "logits_max_abs": self.max_abs,
            "tokens": self.n_pos,
            "predictions": self.n_pred,
            "windows": self.windows,
        }


def compare_logits(ref_logits: Any, cand_logits: Any, input_ids: Any, attention_mask: Any | None = None) -> dict:
    """One-shot :class:`LogitsComparer`: keys ref_ppl, ppl, ppl_delta_pct, top1_agreement,
    logits_cosine (mean over positions), logits_max_abs (+ tokens, predictions, windows)."""
    c = LogitsComparer()
    c.update(ref_logits, cand_logits, input_ids, attention_mask)
    return c.result()


def perplexity(logits: Any, input_ids: Any) -> float:
    """exp(mean next-token NLL) of one model's logits [B, T, V] on input_ids [B, T]."""
    lg = _t(logits, torch.float32)
    ids = _t(input_ids, torch.long)
    B, T, V = lg.shape
    if T < 2:
        raise ValueError("perplexity needs at least 2 tokens per row")
    mask = torch.ones(B * (T - 1), dtype=torch.bool)
    return math.exp(_nll_sum(lg[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), mask) / mask.numel())


def greedy_match(ref_tokens: Sequence[Sequence[int]], cand_tokens: Sequence[Sequence[int]]) -> dict:
    """Compare generated continuations prompt by prompt.

    Returns ``exact_match`` (fraction of prompts whose continuation is identical),
    ``prefix_ratio`` (mean over prompts of common-prefix length / reference length; 1.0 when both empty),
    ``prompts`` and per-prompt ``prefix_lengths``.
    """
    if len(ref_tokens) != len(cand_tokens):
        raise ValueError(f"{len(ref_tokens)} reference generations but {len(cand_tokens)} candidate generations")
    exact, ratios, prefixes = 0, [], []
    for r, c in zip(ref_tokens, cand_tokens):
        r, c = list(map(int, r)), list(map(int, c))
        n = 0
        for a, b in zip(r, c):
            if a != b:
                break
            n += 1
        prefixes.append(n)
        exact += int(r == c)
        denom = max(len(r), len(c))
        ratios.append(n / denom if denom else 1.0)
    k = len(ref_tokens)
    return {
        "exact_match": exact / k if k else float("nan"),
        "prefix_ratio": sum(ratios) / k if k else float("nan"),
        "prompts": k,
        "prefix_lengths": prefixes,
    }
