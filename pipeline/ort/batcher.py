"""Continuous (in-flight) batching over forge's ``OrtEngine``: what the Triton python model serves with.

Requests wait in a bounded FIFO queue. One scheduler loop (``step``) does, each iteration:
  join   -- waiting requests are admitted while the batch has free rows; the newcomers' prompts run as ONE
            prefill (right padding) in a cache of their own, their first token is picked, and their K/V rows are
            copied into a fresh cache next to the rows already decoding;
  decode -- one token for every row of the batch (one graph call);
  leave  -- rows that hit their EOS or their own ``max_new_tokens`` (or whose client cancelled) are answered
            and dropped; the cache is compacted before the next decode.
So requests that arrive together share prefill and decode, a request arriving mid-generation joins at the next
step instead of waiting for the batch to drain, and a short request leaves without waiting for a long one.

Rows of one batch share graph calls, so a row's numbers must not depend on its batch-mates: ``batched=False``
(an engine whose ``forge_ort.json`` does not say ``batch_invariant: true``, e.g. dynamic INT8 with one activation
scale per tensor) admits one request at a time, which is exactly how its greedy tokens were validated.

Joining needs the K/V rows on the host (CPU, ``shared`` KV layout: ``KVCache(host=True)``); any other engine is
served in whole batches (``engine.generate_batch``: a batch runs to its end, newcomers wait for the next one).

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


class ContinuousBatcher:
    """``submit`` jobs from any thread; ``start()`` runs the scheduler loop in a daemon thread (or call ``step()``
    yourself, as the tests do). ``max_batch``: rows decoded together; ``max_queue``: jobs waiting to join."""

    def __init__(self, engine, *, max_batch: int = 8, max_queue: int = 64, batched: bool = True):
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        self.engine = engine
        self.max_queue = int(max_queue)
        self.max_rows = int(max_batch) if batched else 1
        self.continuous = getattr(engine, "layout", None) == "shared" and getattr(engine, "device", "cpu") == "cpu"
        # the engine's own sampler (the same draws as engine.generate); whole-batch engines sample themselves
        self._sample = getattr(importlib.import_module(type(engine).__module__), "sample_next", None)
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._rows: list[Job] = []
        self._slots: list[int] = []          # each row's index in the current cache (rows leave, slots stay)
        self._cache = None
        self._next = np.zeros(0, np.int64)   # each row's last picked token (fed by the next decode step)
        self._dirty = False                  # rows left: compact the cache before the next decode
        self._stop = False
        self._thread: threading.Thread | None = None
        self.history: list[tuple[str, int]] = []   # ("prefill", rows) / ("decode", rows): what each call ran
        self.history_limit = 10_000

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
        self._slots.pop(i)
        self._next = np.delete(self._next, i)
        self._dirty = True
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
            if self._dirty and self._rows:
                self._rebuild([])
            return
        eng = self.engine
        lens = np.array([len(j.prompt) for j in new], np.int64)
        ids = np.zeros((len(new), int(lens.max())), np.int64)
        for r, j in enumerate(new):
            ids[r, :lens[r]] = j.prompt
        try:
            pre = self._new_cache(len(new), ids.shape[1])
            first = self._pick(new, eng.forward(ids, lens, pre, last_only=True))
        except Exception as e:   # a failing prefill answers its newcomers, not the rows already decoding
            for j in new:
                j._finish(e)
            return
        self._log("prefill", len(new))
        joined = []
        for r, j in enumerate(new):
            if j._emit(int(first[r])):
                j._finish()
            else:
                joined.append((j, pre, r, int(first[r])))
        self._rebuild(joined)

    def _new_cache(self, batch: int, capacity: int):
        eng = self.engine
        kv = importlib.import_module(type(eng).__module__).KVCache
        if eng.max_seq_len:
            capacity = min(capacity, eng.max_seq_len)
        return kv(eng, batch, capacity, host=True)

    def _rebuild(self, joined: list) -> None:
        """A cache for the surviving rows plus ``joined`` (job, its prefill cache, its row there, first token):
        each row's K/V positions [0, len) are copied over; capacity covers every row's remaining tokens."""
        old = self._cache
        srcs = [(j, old, r) for j, r in zip(self._rows, self._slots)] + [(j, c, r) for j, c, r, _ in joined]
        self._rows = [j for j, _, _ in srcs]
        self._slots = list(range(len(srcs)))
        self._next = np.concatenate([self._next, np.array([t for *_, t in joined], np.int64)])
        self._dirty = False
        if not srcs:
            self._cache = None
            return
        # stored positions + tokens still to feed: the last picked token is fed, then one per step until done
        need = max(int(c.lengths[r]) + (j.max_new_tokens - len(j.tokens)) for j, c, r in srcs)
        step = 64
        cache = self._new_cache(len(srcs), -(-need // step) * step)
        for dst, (j, c, r) in enumerate(srcs):
            n = int(c.lengths[r])
            for a_new, a_old in zip(cache.arrays, c.arrays):
                a_new[dst, :, :n] = a_old[r, :, :n]
            cache.lengths[dst] = n
        cache.width = int(cache.lengths.max())
        self._cache = cache

    def _decode(self) -> None:
        rows = self._rows
        B = len(rows)
        try:
            logits = self.engine.forward(self._next.reshape(B, 1), np.ones(B, np.int64), self._cache, last_only=True)
        except Exception as e:
            for j in list(rows):
                self._leave(j, e)
            return
        self._log("decode", B)
        nxt = self._pick(rows, logits)
        self._next = nxt.astype(np.int64)
        for r, j in enumerate(list(rows)):
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
