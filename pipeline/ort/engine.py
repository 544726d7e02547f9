"""ONNX Runtime engine for forge's KV-cache causal-LM graphs (prefill + decode in one graph).

Dependency-light on purpose (numpy + onnxruntime; ``tokenizers`` only for text helpers) so this file can be
copied as-is into a Triton python-backend model. It imports nothing from ``pipeline`` except, when present, the
progress bar.

Graph contract (written by pipeline.ort.export): inputs ``input_ids``, ``attention_mask`` [B, past+T],
``position_ids``, ``past_key_values.{i}.key/value`` [B, kv, past, hd]; outputs ``logits`` and
``present.{i}.key/value``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import onnxruntime as ort

try:  # progress bars inside forge; a no-op when this file runs on its own (Triton)
    from pipeline.progress import progress_bar as _progress_bar
except Exception:  # pragma: no cover - exercised only outside the package
    _progress_bar = None

__all__ = ["OrtEngine", "session_options", "sample_next"]

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bfloat16)": np.float32}


@contextlib.contextmanager
def _bar(desc: str, total: int | None) -> Iterator[Callable[[int], None]]:
    if _progress_bar is None:
        yield lambda n=1: None
    else:
        with _progress_bar(desc, total) as adv:
            yield adv


def session_options(threads: int = 0, level: str = "all", optimized_path: str | None = None) -> ort.SessionOptions:
    """SessionOptions with ``threads`` intra-op threads (0 = ORT default) and a graph optimisation ``level``
    (disable | basic | extended | all)."""
    levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    if level not in levels:
        raise ValueError(f"graph optimisation level {level!r} is not one of {sorted(levels)}")
    so = ort.SessionOptions()
    so.graph_optimization_level = levels[level]
    if threads:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    if optimized_path:
        so.optimized_model_filepath = str(optimized_path)
    return so


def sample_next(logits: np.ndarray, rng: np.random.Generator, *, greedy: bool = True, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Next token per row from last-position logits [B, V]."""
    if greedy or temperature <= 0:
        return logits.argmax(-1)
    x = logits.astype(np.float64) / float(temperature)
    if top_k and top_k < x.shape[-1]:
        kth = np.partition(x, -top_k, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sp = np.take_along_axis(p, order, -1)
        keep = np.cumsum(sp, -1) - sp < top_p  # always keeps the top token
        sp = np.where(keep, sp, 0.0)
        p = np.zeros_like(p)
        np.put_along_axis(p, order, sp, -1)
        p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p], dtype=np.int64)


class OrtEngine:
    """ONNX Runtime session over a forge ONNX model dir (``model.onnx`` + external data + tokenizer files)."""

    def __init__(self, model_dir: str | os.PathLike, threads: int = 0, *, providers: Sequence[str] | None = None,
                 model_file: str | None = None, level: str = "all"):
        self.model_dir = Path(model_dir)
        meta_f = self.model_dir / "forge_ort.json"
        self.meta: dict[str, Any] = json.loads(meta_f.read_text()) if meta_f.exists() else {}
        self.model_path = self.model_dir / (model_file or self.meta.get("model_file") or "model.onnx")
        if not self.model_path.exists():
            raise FileNotFoundError(f"no ONNX model at {self.model_path}")
        self.threads = threads
        self.options = session_options(threads, level)
        self.session = ort.InferenceSession(str(self.model_path), self.options,
                                            providers=list(providers or ["CPUExecutionProvider"]))
        ins = {i.name: i for i in self.session.get_inputs()}
        pat = re.compile(r"past_key_values\.(\d+)\.key$")
        layers = sorted(int(m.group(1)) for n in ins if (m := pat.match(n)))
        if not layers or "input_ids" not in ins:
            raise ValueError(f"{self.model_path} is not a forge KV-cache graph (inputs: {sorted(ins)})")
        self.num_layers = len(layers)
        k0 = ins["past_key_values.0.key"]
        self.num_kv_heads, self.head_dim = int(k0.shape[1]), int(k0.shape[3])
        self.kv_dtype = _ORT_TYPES.get(k0.type, np.float32)
        self.past_names = [f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]
        self.present_names = [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]
        self.output_names = ["logits"] + self.present_names
        self.vocab_size = int(self.session.get_outputs()[0].shape[-1]) if isinstance(
            self.session.get_outputs()[0].shape[-1], int) else self.meta.get("vocab_size")
        self.eos_token_id = self.meta.get("eos_token_id")
        self._tokenizer = None

    # ---- low level -------------------------------------------------------------------------------------------
    def empty_past(self, batch: int) -> list[np.ndarray]:
        z = np.zeros((batch, self.num_kv_heads, 0, self.head_dim), dtype=self.kv_dtype)
        return [z] * (2 * self.num_layers)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            past: Sequence[np.ndarray]) -> dict[str, Any]:
        """One graph call. Returns ``{"logits": [B,T,V], "past": [present tensors]}``."""
        feed = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64),
                "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64)}
        feed.update(zip(self.past_names, past))
        outs = self.session.run(self.output_names, feed)
        return {"logits": outs[0], "past": outs[1:]}

    # ---- scoring ---------------------------------------------------------------------------------------------
    def logits(self, input_ids: Any, attention_mask: Any | None = None, *, batch_size: int = 0,
               desc: str = "ORT logits") -> np.ndarray:
        """Full-sequence logits [B, T, V] (prefill with an empty cache), ``batch_size`` rows per call (0 = all)."""
        ids = np.asarray(input_ids.numpy() if hasattr(input_ids, "numpy") else input_ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(
            attention_mask.numpy() if hasattr(attention_mask, "numpy") else attention_mask, dtype=np.int64)
        bs = batch_size or ids.shape[0]
        out = []
        with _bar(desc, ids.shape[0]) as advance:
            for s in range(0, ids.shape[0], bs):
                i, m = ids[s:s + bs], mask[s:s + bs]
                pos = np.clip(np.cumsum(m, axis=1) - 1, 0, None)
                out.append(self.run(i, m, pos, self.empty_past(i.shape[0]))["logits"])
                advance(i.shape[0])
        return np.concatenate(out, 0)

    # ---- generation ------------------------------------------------------------------------------------------
    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, greedy: bool = True,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                       eos_token_id: int | None = None) -> list[list[int]]:
        """Generate for several prompts at once (left padding); returns the new tokens of each prompt, cut after
        its EOS. Prefill once, then one token per step through the KV cache."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = np.zeros((B, L), np.int64)
        mask = np.zeros((B, L), np.int64)
        for r, p in enumerate(prompts):
            ids[r, L - len(p):] = p
            mask[r, L - len(p):] = 1
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        rng = np.random.default_rng(seed)
        out: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        past = self.empty_past(B)
        step_ids, step_pos = ids, pos
        with _bar("ORT generate", max_new_tokens) as advance:
            for _ in range(max_new_tokens):
                res = self.run(step_ids, mask, step_pos, past)
                past = res["past"]
                nxt = sample_next(res["logits"][:, -1], rng, greedy=greedy, temperature=temperature,
                                  top_k=top_k, top_p=top_p)
                for r in range(B):
                    if not done[r]:
                        out[r].append(int(nxt[r]))
                        if eos_token_id is not None and int(nxt[r]) == eos_token_id:
                            done[r] = True
                advance(1)
                if done.all():
                    break
                step_ids = nxt.reshape(B, 1).astype(np.int64)
                step_pos = step_pos[:, -1:] + 1
                mask = np.concatenate([mask, np.ones((B, 1), np.int64)], 1)
        return out

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, greedy: bool = True,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_token_id: int | None = None) -> list[int]:
        """New tokens for one prompt (prefill once, then one token per step through the KV cache)."""
        return self.generate_batch([list(prompt_ids)], max_new_tokens, greedy=greedy, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id)[0]

    # ---- text helpers (need the `tokenizers` package) ---------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        return self._tokenizer

    def generate_text(self, text: str, max_new_tokens: int, **kw) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        kw.setdefault("eos_token_id", self.eos_token_id if isinstance(self.eos_token_id, int) else None)
        return self.tokenizer.decode(self.generate(ids, max_new_tokens, **kw))
