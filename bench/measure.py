"""Engine-agnostic timing: prefill / decode tokens per second, time to first token, medians.

An *adapter* is any object with

* ``name``: label shown in tables, ``what``: what actually ran (e.g. "ONNX Runtime 1.32 CPU, INT8 QDQ graph")
* ``prefill(ids)``: run the model over ``ids`` (np.int64 [B, T]) once
* ``generate(ids, n)``: greedy-generate ``n`` new tokens after ``ids`` ([1, T]); returns the new ids
* ``generate_batch(ids, n)`` (optional, may be None): same for [B, T]
* ``supports_batch_prefill`` (bool)

Decode speed is measured as (n - 1) new tokens over the time of generate(n) minus generate(1), per
repetition, so the prompt's prefill and the first token do not count; the median over repetitions is
reported. Time to first token is the median time of generate(prompt, 1).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Callable

import numpy as np


def median(xs: list[float]) -> float:
    if not xs:
        raise ValueError("median of no samples")
    return float(statistics.median(xs))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def timed(fn: Callable[[], object], reps: int, warmup: int = 1, clock=None, min_sample_s: float = 0.0) -> list[float]:
    """Run fn warmup times, then ``reps`` samples; return each sample's wall time per call, in seconds. With
    ``min_sample_s``, a sample loops fn as many times as make it last that long (the count is set once from the
    last warm-up call), so a 4 ms step is not timed alone (the GPU bench: >= 100 ms)."""
    clock = clock or time.perf_counter
    loops, t = 1, None
    for _ in range(max(warmup, 1 if min_sample_s else 0)):
        t0 = clock()
        fn()
        t = clock() - t0
    if min_sample_s and t is not None:
        loops = max(1, math.ceil(min_sample_s / max(t, 1e-9)))
    out = []
    for _ in range(reps):
        t0 = clock()
        for _ in range(loops):
            fn()
        out.append((clock() - t0) / loops)
    return out


def spread(xs: list[float]) -> dict:
    """median, min and max of samples (what the JSON keeps beside each figure)."""
    return {"median": median(xs), "min": float(min(xs)), "max": float(max(xs)), "n": len(xs)}


def prompt_ids(vocab_size: int, batch: int, length: int, seed: int = 0, base: list[int] | None = None) -> np.ndarray:
    """[batch, length] int64 prompt ids: rows of ``base`` (real text ids) cycled with a per-row offset, or
    seeded random ids when there is no tokenizer. Same input for every engine and peer."""
    if base:
        out = np.empty((batch, length), dtype=np.int64)
        for b in range(batch):
            start = (b * 37) % len(base)
            row = (base[start:] + base[:start]) * (length // len(base) + 1)
            out[b] = row[:length]
        return out
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size - 100, size=(batch, length), dtype=np.int64)


def measure_prefill(adapter, ids: np.ndarray, reps: int, warmup: int = 1, clock=None,
                    min_sample_s: float = 0.0) -> dict:
    times = timed(lambda: adapter.prefill(ids), reps, warmup, clock, min_sample_s)
    tokens = int(ids.shape[0] * ids.shape[1])
    return {"batch": int(ids.shape[0]), "tokens": tokens, "times_s": times, "median_s": median(times),
            "tokens_per_s": tokens / median(times), "tokens_per_s_spread": spread([tokens / t for t in times])}


def measure_decode(adapter, ids: np.ndarray, new_tokens: int, reps: int, warmup: int = 1,
                   clock=None, min_sample_s: float = 0.0) -> dict:
    """Decode rate of ``generate`` (batch 1) or ``generate_batch`` (batch > 1) on ``ids``."""
    if new_tokens < 2:
        raise ValueError("new_tokens must be >= 2 to separate decode from the first token")
    clock = clock or time.perf_counter
    b = int(ids.shape[0])
    gen = adapter.generate if b == 1 else adapter.generate_batch
    if gen is None:
        raise NotImplementedError(f"{adapter.name} has no batched generate")
    for _ in range(warmup):
        gen(ids, new_tokens)
    rates, t1s, tns = [], [], []
    got = new_tokens

    def gen_n():
        nonlocal got
        got = _count_new(gen(ids, new_tokens), b, new_tokens)
    for _ in range(reps):       # one sample each of generate(1) and generate(n), each >= min_sample_s
        t1 = timed(lambda: gen(ids, 1), 1, 1 if min_sample_s else 0, clock, min_sample_s)[0]
        tn = timed(gen_n, 1, 1 if min_sample_s else 0, clock, min_sample_s)[0]
        t1s.append(t1)
        tns.append(tn)
        rates.append(b * (got - 1) / max(tn - t1, 1e-9))
    return {"batch": b, "new_tokens": new_tokens, "prompt_tokens": int(ids.shape[1]), "t_first_s": t1s,
            "t_all_s": tns, "tokens_per_s_samples": rates, "tokens_per_s": median(rates),
            "tokens_per_s_spread": spread(rates), "ttft_s": median(t1s)}


def _count_new(out, batch: int, asked: int) -> int:
    """How many new tokens per sequence the engine returned (it may stop early at EOS)."""
    if out is None:
        return asked
    arr = np.asarray(out, dtype=object if isinstance(out, list) and out and isinstance(out[0], list) else None)
    if arr.ndim == 2:
        return int(arr.shape[1])
    if batch == 1:
        return int(len(out))
    return asked


def measure_adapter(adapter, *, vocab_size: int, base_ids: list[int] | None, reps: int, prefill_len: int = 256,
                    prefill_batches=(1, 4), decode_prompt: int = 32, decode_new: int = 64,
                    decode_batches=(1, 8), warmup: int = 1, progress: Callable[[str], None] | None = None,
                    clock=None, min_sample_s: float = 0.0, prefill_shapes=None, ttft_len: int | None = None,
                    keep_going: bool = False, checkpoint: Callable[[dict], None] | None = None) -> dict:
    """All speed figures of one engine/peer; unsupported cases are recorded with the reason. ``clock``: seconds
    (default time.perf_counter; tests pass a virtual clock).

    ``prefill_shapes`` [(B, T), ...] replaces ``prefill_len`` x ``prefill_batches`` (results keyed "BxT" instead of
    "B"); ``ttft_len``: the time-to-first-token prompt (default ``prefill_len``; 0: not measured). ``keep_going``: a figure that
    raises is recorded under ``errors`` and the next one is measured (a GPU peer failing one shape, e.g. ORT
    GenAI's batch 8 under CUDA graphs, keeps its other figures). ``checkpoint(res)`` is called after every figure,
    so a caller can write what is measured as it goes."""
    res: dict = {"name": adapter.name, "what": adapter.what, "prefill": {}, "decode": {}, "skipped": {}}

    def figure(label: str, fn: Callable[[], None]) -> None:
        if progress:
            progress(f"{adapter.name} {label}")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded per figure when keep_going
            if not keep_going:
                raise
            res.setdefault("errors", {})[label] = f"{type(e).__name__}: {e}"[-2000:]
        if checkpoint:
            checkpoint(res)

    shapes = list(prefill_shapes) if prefill_shapes is not None else [(b, prefill_len) for b in prefill_batches]
    for b, t in shapes:
        key = f"{b}x{t}" if prefill_shapes is not None else str(b)
        if b > 1 and not getattr(adapter, "supports_batch_prefill", True):
            res["skipped"][f"prefill_b{b}" if prefill_shapes is None else f"prefill_{key}"] = \
                f"{adapter.name}: no batched prefill in this API"
            continue

        def pre(b=b, t=t, key=key):
            res["prefill"][key] = measure_prefill(adapter, prompt_ids(vocab_size, b, t, base=base_ids), reps, warmup,
                                                  clock, min_sample_s)
        figure(f"prefill {b}x{t}", pre)
    tl = prefill_len if ttft_len is None else ttft_len
    p1 = prompt_ids(vocab_size, 1, tl, base=base_ids) if tl else None

    def ttft_fig():
        ttft = timed(lambda: adapter.generate(p1, 1), reps, warmup, clock, min_sample_s)
        res["ttft"] = {"prompt_tokens": tl, "times_s": ttft, "median_s": median(ttft), "spread_s": spread(ttft)}
    if tl:
        figure("time to first token", ttft_fig)
    for b in decode_batches:
        if b > 1 and getattr(adapter, "generate_batch", None) is None:
            res["skipped"][f"decode_b{b}"] = f"{adapter.name}: no batched generate"
            continue

        def dec(b=b):
            res["decode"][str(b)] = measure_decode(adapter, prompt_ids(vocab_size, b, decode_prompt, base=base_ids),
                                                   decode_new, reps, warmup, clock, min_sample_s)
        figure(f"decode batch {b}", dec)
    return res


def merge_passes(parts: list[dict]) -> dict:
    """One engine's figures from several passes of the bench (each pass runs every engine once, in an order that
    reverses from pass to pass): the samples of every pass pooled, each median taken again over all of them.
    Sizes and load time are the first pass's, peak RSS the highest; ``gates`` come from the pass that scored them.
    A pass that failed is listed under ``pass_errors``; all passes failing gives the first pass's error."""
    good = [p for p in parts if "error" not in p]
    if not good:
        return dict(parts[0], passes=len(parts))
    out = copy.deepcopy(good[0])     # the first good pass is the frame
    for later in good[1:]:
        for key, fig in later.get("prefill", {}).items():
            if key in out["prefill"]:
                out["prefill"][key]["times_s"] += fig["times_s"]
            else:
                out["prefill"][key] = copy.deepcopy(fig)
        for key, fig in later.get("decode", {}).items():
            if key in out["decode"]:
                for s in ("t_first_s", "t_all_s", "tokens_per_s_samples"):
                    out["decode"][key][s] += fig[s]
            else:
                out["decode"][key] = copy.deepcopy(fig)
        if "ttft" in later and "ttft" in out:
            out["ttft"]["times_s"] += later["ttft"]["times_s"]
        for k in ("skipped", "errors"):
            if later.get(k):
                out.setdefault(k, {}).update(later[k])
        if later.get("peak_rss_bytes") and later["peak_rss_bytes"] > (out.get("peak_rss_bytes") or 0):
            out["peak_rss_bytes"] = later["peak_rss_bytes"]
        if "gates" in later and "gates" not in out:
            out["gates"] = later["gates"]
    for fig in out.get("prefill", {}).values():
        fig["median_s"] = median(fig["times_s"])
        fig["tokens_per_s"] = fig["tokens"] / fig["median_s"]
        fig["tokens_per_s_spread"] = spread([fig["tokens"] / t for t in fig["times_s"]])
    for fig in out.get("decode", {}).values():
        fig["tokens_per_s"] = median(fig["tokens_per_s_samples"])
        fig["tokens_per_s_spread"] = spread(fig["tokens_per_s_samples"])
        fig["ttft_s"] = median(fig["t_first_s"])
    if "ttft" in out:
        out["ttft"]["median_s"] = median(out["ttft"]["times_s"])
        out["ttft"]["spread_s"] = spread(out["ttft"]["times_s"])
    out["passes"] = len(parts)
    errs = [p["error"] for p in parts if "error" in p]
    if errs:
        out["pass_errors"] = errs
    return out
