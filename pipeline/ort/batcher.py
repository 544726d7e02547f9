"""Continuous (in-flight) batching over forge's ``OrtEngine``: what the Triton python model serves with.

Requests wait in a bounded FIFO queue. One scheduler loop (``step``) does, each iteration:
  join   -- waiting requests are admitted while the batch has free rows; the newcomers' prompts run as ONE
            prefill (right padding; on ``slots``, one per run of adjacent free slots) and their first token is
            picked;
  decode -- one token for every row of the batch (one graph call);
  leave  -- rows that hit their EOS or their own ``max_new_tokens`` (or whose client cancelled) are answered
            and dropped.
So requests that arrive together share prefill and decode, a request arriving mid-generation joins at the next
step instead of waiting for the batch to drain, and a short request leaves without waiting for a long one.

Where the rows' K/V live is the cache backend's business; the scheduler is the same for both:
  ``host``  (CPU engine): numpy-backed caches (``KVCache(host=True)``); the newcomers prefill in a cache of their
            own and, whenever rows joined or left, the surviving rows and the joiners are copied into a fresh,
            compacted cache (host memory copies, cheap on the CPU).
  ``slots`` (CUDA or any other device): one preallocated row ("slot") per batch row in the engine's device memory
            (``SlotKVCache``); a newcomer's prefill writes its K/V straight into a free slot, a decode step runs
            over the slots from the lowest taken to the highest (a free one between them is decoded as an empty
            row; with CUDA graphs the range starts at slot 0, so there is one graph per highest slot), and a row
            that leaves frees its slot.
            No K/V byte crosses to the host or moves on the device; only token ids, the attention mask and the
            logits rows cross, once per step. The slots grow (a copy on the device) when a request needs more
            positions than any before. It runs on the CPU too (``kv="slots"``), which tests use.
An engine of the ``concat`` layout (whose presents grow each step) is served in whole batches
(``engine.generate_batch``: a batch runs to its end, newcomers wait for the next one).

Rows of one batch share graph calls, so a row's numbers must not depend on its batch-mates: ``batched=False``
(an engine whose ``forge_ort.json`` does not say ``batch_invariant: true``, e.g. dynamic INT8 with one activation
scale per tensor) admits one request at a time, which is exactly how its greedy tokens were validated.

Dependency-light like the engine (stdlib + numpy): copied into the Triton model as ``forge_batcher.py``.
"""

from __future__ import annotations

import collections
import importlib
import threading
import time
from typing import Callable, Sequence

import numpy as np

QUEUE_KEY = "package.triton.max_queue_size"


class QueueFull(RuntimeError):
    """The bounded queue is full; the Triton model answers UNAVAILABLE (HTTP 503, gRPC UNAVAILABLE)."""


class Job:
    """One generation (one row): its prompt, settings, and the callbacks that answer it.

    ``on_token(job, token)`` runs for every new token (streaming); ``on_done(job, error)`` once, with
    ``job.tokens`` complete or an exception. ``cancelled()`` is polled between steps."""

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, *, greedy: bool = True, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id: int | None = None,
                 on_done: Callable[["Job", Exception | None], None] | None = None,
                 on_token: Callable[["Job", int], None] | None = None,
                 cancelled: Callable[[], bool] | None = None):
        if len(prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        if int(max_new_tokens) < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.prompt = [int(t) for t in prompt]
        self.max_new_tokens = int(max_new_tokens)
        self.greedy = bool(greedy) or float(temperature) <= 0
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)
        self.eos = eos_token_id
        self.on_done, self.on_token, self.cancelled = on_done, on_token, cancelled or (lambda: False)
        self.tokens: list[int] = []
        self.error: Exception | None = None
        self.finished = threading.Event()

    def _emit(self, token: int) -> bool:
        """Record a token; True when the job is complete."""
        self.tokens.append(token)
        if self.on_token:
            self.on_token(self, token)
        return (self.eos is not None and token == self.eos) or len(self.tokens) >= self.max_new_tokens

    def _finish(self, error: Exception | None = None) -> None:
        self.error = error
        self.finished.set()
        if self.on_done:
            self.on_done(self, error)


def kv_backend(engine) -> str | None:
    """The cache backend an engine is served with: ``host`` (CPU), ``slots`` (any other device), None (whole
    batches: the concat layout, or an engine class without forge's KV cache)."""
    if getattr(engine, "layout", None) != "shared":
        return None
    return "host" if getattr(engine, "device", "cpu") == "cpu" else "slots"


class _HostKV:
    """K/V rows in numpy-backed host caches (CPU engine): newcomers prefill in a cache of their own; a fresh cache
    holding the surviving rows and the joiners, compacted, is built whenever rows joined or left."""

    def __init__(self, engine, slots: int):
        self.engine = engine
        self._kv = importlib.import_module(type(engine).__module__).KVCache
        self._src: list[tuple] = []   # each row's (cache, row there)
        self._cache = None
        self._pending = None          # the last prefill's cache
        self._dirty = False           # rows left: compact before the next decode

    def _new_cache(self, batch: int, capacity: int):
        eng = self.engine
        if eng.max_seq_len:
            capacity = min(capacity, eng.max_seq_len)
        return self._kv(eng, batch, capacity, host=True)

    def prefill(self, ids: np.ndarray, lens: np.ndarray, need: list[int]) -> tuple[np.ndarray, list[int]]:
        pre = self._new_cache(len(ids), ids.shape[1])
        logits = self.engine.forward(ids, lens, pre, last_only=True)
        self._pending = pre
        return logits, [len(ids)]

    def admit(self, rows: list, picked: list[int]) -> None:
        self._src += [(self._pending, r) for r in picked]
        self._pending = None
        self._rebuild(rows)

    def leave(self, i: int) -> None:
        self._src.pop(i)
        self._dirty = True

    def decode(self, rows: list, nxt: np.ndarray) -> tuple[np.ndarray, int]:
        if self._dirty:
            self._rebuild(rows)
        return self.engine.decode(nxt, self._cache), len(rows)

    def _rebuild(self, rows: list) -> None:
        """A cache for ``rows`` (each row's K/V positions [0, len) copied from where it is); its capacity covers
        every row's stored positions plus the tokens still to feed (the last picked, then one per step)."""
        self._dirty = False
        if not rows:
            self._cache, self._src = None, []
            return
        need = max(int(c.lengths[r]) + (j.max_new_tokens - len(j.tokens)) for j, (c, r) in zip(rows, self._src))
        step = 64
        cache = self._new_cache(len(rows), -(-need // step) * step)
        for dst, (c, r) in enumerate(self._src):
            n = int(c.lengths[r])
            for a_new, a_old in zip(cache.arrays, c.arrays):
                a_new[dst, :, :n] = a_old[r, :, :n]
            cache.lengths[dst] = n
        cache.width = int(cache.lengths.max())
        self._cache = cache
        self._src = [(cache, r) for r in range(len(rows))]


class _SlotKV:
    """K/V rows in the engine's ``SlotKVCache`` (see the module doc): a row keeps its slot from its prefill to its
    last token; nothing is copied when rows join or leave."""

    def __init__(self, engine, slots: int):
        self.engine, self.slots = engine, int(slots)
        self._kv = importlib.import_module(type(engine).__module__).SlotKVCache
        self.cache = None
        self._slot: list[int] = []      # each row's slot
        self._pending: list[int] = []   # the last prefill's slots, in its row order

    def _fit(self, need: int) -> None:
        """Slots of at least ``need`` positions: made at the first prefill, grown (at least doubled, up to the
        engine's max_seq_len) when a newcomer needs more than any request before; rows still decoding are
        copied on the device, an idle cache is simply made anew."""
        if self.cache is not None and need <= self.cache.capacity:
            return
        if self.cache is not None:
            need = max(need, 2 * self.cache.capacity)
        if self.cache is None or not self._slot:
            self.cache = None          # free the old buffers before the new ones are allocated
            self.cache = self._kv(self.engine, self.slots, need)
        else:
            self.cache = self.cache.grown(self.engine, need)

    def prefill(self, ids: np.ndarray, lens: np.ndarray, need: list[int]) -> tuple[np.ndarray, list[int]]:
        taken = set(self._slot)
        free = [s for s in range(self.slots) if s not in taken][:len(ids)]
        self._fit(max(need))
        out, calls, r = None, [], 0
        while r < len(free):           # one prefill per run of adjacent free slots
            e = r + 1
            while e < len(free) and free[e] == free[e - 1] + 1:
                e += 1
            view = self.cache.rows(free[r], free[e - 1] + 1)
            view.reset()
            width = int(lens[r:e].max())
            logits = self.engine.forward(np.ascontiguousarray(ids[r:e, :width]), lens[r:e], view, last_only=True)
            if out is None:
                out = np.empty((len(ids), logits.shape[-1]), logits.dtype)
            out[r:e] = logits
            calls.append(e - r)
            r = e
        self._pending = free
        return out, calls

    def admit(self, rows: list, picked: list[int]) -> None:
        self._slot += [self._pending[r] for r in picked]
        self._pending = []

    def leave(self, i: int) -> None:
        self._slot.pop(i)

    def decode(self, rows: list, nxt: np.ndarray) -> tuple[np.ndarray, int]:
        # slots [lo, hi) in one call; with CUDA graphs lo = 0: at most ``slots`` graphs per slot cache
        lo = 0 if getattr(self.engine, "cuda_graph", False) else min(self._slot)
        hi = max(self._slot) + 1
        view = self.cache.rows(lo, hi)
        at = np.array(self._slot) - lo
        ids = np.zeros(hi - lo, np.int64)    # a free slot in the range decodes token 0 on an empty row
        ids[at] = nxt
        holes = np.ones(hi - lo, bool)
        holes[at] = False
        view.lengths[holes] = 0
        view.width = int(view.lengths.max())
        logits = self.engine.decode(ids, view)
        view.lengths[holes] = 0
        return logits[at], hi - lo


_BACKENDS = {"host": _HostKV, "slots": _SlotKV}


class ContinuousBatcher:
    """``submit`` jobs from any thread; ``start()`` runs the scheduler loop in a daemon thread (or call ``step()``
    yourself, as the tests do). ``max_batch``: rows decoded together; ``max_queue``: jobs waiting to join;
    ``kv``: the cache backend (``host`` | ``slots``; default :func:`kv_backend` of the engine)."""

    def __init__(self, engine, *, max_batch: int = 8, max_queue: int = 64, batched: bool = True,
                 kv: str | None = None):
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        self.engine = engine
        self.max_queue = int(max_queue)
        self.max_rows = int(max_batch) if batched else 1
        auto = kv_backend(engine)
        if kv is not None:
            if kv not in _BACKENDS:
                raise ValueError(f"kv={kv!r} is not one of {sorted(_BACKENDS)}")
            if auto is None or (kv == "host" and auto != "host"):
                raise ValueError(f"kv={kv!r} needs a shared-layout engine" + (" on the CPU" if kv == "host" else "")
                                 + f" (this one: layout {getattr(engine, 'layout', None)!r}, "
                                 f"device {getattr(engine, 'device', None)!r})")
        self.kv = kv or auto
        self.continuous = self.kv is not None
        self._kv = _BACKENDS[self.kv](engine, self.max_rows) if self.continuous else None
        # the engine's own sampler (the same draws as engine.generate); whole-batch engines sample themselves
        self._sample = getattr(importlib.import_module(type(engine).__module__), "sample_next", None)
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._rows: list[Job] = []
        self._next = np.zeros(0, np.int64)   # each row's last picked token (fed by the next decode step)
        self._stop = False
        self._thread: threading.Thread | None = None
        # ("prefill", rows) / ("decode", rows) / ("batch", rows): each graph call and the requests it ran (a slots
        # decode also runs the free slots below the highest one taken: ``padded_rows`` counts them)
        self.history: list[tuple[str, int]] = []
        self.history_limit = 10_000
        self.padded_rows = 0

    # ---- submission ---------------------------------------------------------------------------------------
    def submit(self, jobs: Job | Sequence[Job]) -> None:
        """Queue jobs (all or none); QueueFull names the recipe key when the queue has no room for them."""
        jobs = [jobs] if isinstance(jobs, Job) else list(jobs)
        cap = getattr(self.engine, "max_seq_len", None)
        for j in jobs:
            if cap and len(j.prompt) + j.max_new_tokens > cap:
                raise ValueError(f"prompt ({len(j.prompt)} tokens) + max_tokens ({j.max_new_tokens}) exceed the "
                                 f"engine's max_seq_len {cap} (export.max_seq_len sets it)")
        with self._cond:
            if self._stop:
                raise RuntimeError("the batcher is stopped")
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"request queue full: {len(self._waiting)} requests wait for a free row "
                                f"({QUEUE_KEY} = {self.max_queue}); retry later, or raise {QUEUE_KEY} in the recipe")
            self._waiting.extend(jobs)
            self._cond.notify()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._rows)

    def _log(self, kind: str, rows: int) -> None:
        if len(self.history) < self.history_limit:
            self.history.append((kind, rows))

    # ---- scheduling ---------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduler iteration (leave, join, one decode step). Returns whether any work is left."""
        self._drop_cancelled()
        if self.continuous:
            self._join()
            if self._rows:
                self._decode()
        else:
            self._whole_batch()
        with self._cond:
            return bool(self._rows or self._waiting)

    def _take(self, n: int) -> list[Job]:
        with self._cond:
            out = []
            while self._waiting and len(out) < n:
                out.append(self._waiting.popleft())
            return out

    def _drop_cancelled(self) -> None:
        for j in [j for j in self._rows if j.cancelled()]:
            self._leave(j, RuntimeError("cancelled by the client"))

    def _leave(self, job: Job, error: Exception | None = None) -> None:
        i = self._rows.index(job)
        self._rows.pop(i)
        self._next = np.delete(self._next, i)
        self._kv.leave(i)
        job._finish(error)

    def _pick(self, jobs: list[Job], logits: np.ndarray) -> np.ndarray:
        if all(j.greedy for j in jobs):
            return logits.argmax(-1)
        return np.array([self._sample(logits[r:r + 1], j.rng, greedy=j.greedy, temperature=j.temperature,
                                      top_k=j.top_k, top_p=j.top_p)[0] for r, j in enumerate(jobs)], np.int64)

    def _join(self) -> None:
        free = self.max_rows - len(self._rows)
        new = self._take(free) if free > 0 else []
        if not new:
            return
        lens = np.array([len(j.prompt) for j in new], np.int64)
        ids = np.zeros((len(new), int(lens.max())), np.int64)
        for r, j in enumerate(new):
            ids[r, :lens[r]] = j.prompt
        try:
            logits, calls = self._kv.prefill(ids, lens, [len(j.prompt) + j.max_new_tokens for j in new])
            first = self._pick(new, logits)
        except Exception as e:   # a failing prefill answers its newcomers, not the rows already decoding
            for j in new:
                j._finish(e)
            return
        for n in calls:
            self._log("prefill", n)
        joined = []
        for r, j in enumerate(new):
            if j._emit(int(first[r])):
                j._finish()
            else:
                joined.append(r)
        self._rows += [new[r] for r in joined]
        self._next = np.concatenate([self._next, first[joined].astype(np.int64)])
        self._kv.admit(self._rows, joined)

    def _decode(self) -> None:
        rows = list(self._rows)
        try:
            logits, ran = self._kv.decode(rows, self._next)
        except Exception as e:
            for j in rows:
                self._leave(j, e)
            return
        self._log("decode", len(rows))
        self.padded_rows += ran - len(rows)
        nxt = self._pick(rows, logits)
        self._next = nxt.astype(np.int64)
        for r, j in enumerate(rows):
            if j._emit(int(nxt[r])):
                self._leave(j)

    def _whole_batch(self) -> None:
        """Engines whose K/V cannot move between caches: run up to ``max_rows`` waiting jobs to completion."""
        jobs = self._take(self.max_rows)
        if not jobs:
            return
        try:
            outs = self.engine.generate_batch([j.prompt for j in jobs], [j.max_new_tokens for j in jobs],
                                              greedy=[j.greedy for j in jobs], temperature=[j.temperature for j in jobs],
                                              top_k=[j.top_k for j in jobs], top_p=[j.top_p for j in jobs],
                                              seed=[j.seed for j in jobs],
                                              eos_token_id=[j.eos for j in jobs])
        except Exception as e:
            for j in jobs:
                j._finish(e)
            return
        self._log("batch", len(jobs))
        for j, toks in zip(jobs, outs):
            for t in toks:
                j._emit(int(t))
            j._finish()

    # ---- the loop -----------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._rows:
                    self._cond.wait()
                if self._stop:
                    break
            try:
                self.step()
            except Exception as e:  # never let the loop die with requests in it
                for j in list(self._rows):
                    self._leave(j, e)
                time.sleep(0.01)
        err = RuntimeError("the model is unloading")
        for j in list(self._rows):
            self._leave(j, err)
        for j in self._take(len(self._waiting)):
            j._finish(err)

    def start(self) -> "ContinuousBatcher":
        self._thread = threading.Thread(target=self.run, name="forge-batcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
