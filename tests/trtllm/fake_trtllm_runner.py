"""TEST FIXTURE, NOT AN ENGINE: stands in for pipeline.trtllm.runtime.Runner (one rank's loaded engine).

Its "logits" are a fixed function of the input ids and its "generation" the matching greedy rule, so the
evaluation's numbers are known. Every construction and shutdown is appended to the file named by
FORGE_FAKE_RUNNER_LOG, which works across the mpirun-style worker process: the tests count how often an
engine would have been loaded.
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch

VOCAB = 32


def next_token(t: int) -> int:
    return (7 * t + 3) % VOCAB


def fake_logits(ids) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long)
    out = torch.zeros(*ids.shape, VOCAB)
    out.scatter_(-1, ((7 * ids + 3) % VOCAB).unsqueeze(-1), 5.0)
    return out


def greedy(prompt_ids, max_new_tokens) -> list[int]:
    out, t = [], prompt_ids[-1]
    for _ in range(max_new_tokens):
        t = next_token(t)
        out.append(t)
    return out


def _log(event: str, engine_dir, detail: str = "") -> None:
    with open(os.environ["FORGE_FAKE_RUNNER_LOG"], "a") as f:
        f.write(f"{event} {os.getpid()} {engine_dir}" + (f"\t{detail}" if detail else "") + "\n")


def events() -> list[str]:
    path = os.environ["FORGE_FAKE_RUNNER_LOG"]
    return open(path).read().split("\n")[:-1] if os.path.exists(path) else []


class FakeRunner:
    def __init__(self, engine_dir, leader: bool = True):
        self.engine_dir, self.leader = engine_dir, leader
        _log("load", engine_dir)

    def context_logits(self, ids) -> torch.Tensor:
        return fake_logits(ids)

    def generate(self, prompt_ids, max_new_tokens):
        return greedy(prompt_ids, max_new_tokens)

    def shutdown(self) -> None:
        _log("shutdown", self.engine_dir)


def make(engine_dir, **kw):
    """A runner factory (``module:callable``): engine_dir, plus the KV settings forge passes when it has them."""
    if kw:
        _log("kw", engine_dir, json.dumps(kw, sort_keys=True))
    return FakeRunner(engine_dir)


def make_non_leader(engine_dir, **kw):
    return FakeRunner(engine_dir, leader=False)


def make_broken(engine_dir, **kw):
    _log("load", engine_dir)
    raise RuntimeError("rank0.engine: deserialization failed (test fixture)")


# ------------------------------------------------- through forge's own load_runner (pipeline.trtllm.runtime)
class _FakeExecutorSession:
    def can_enqueue_requests(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class FakeModelRunnerCpp:
    """Stands in for ``tensorrt_llm.runtime.ModelRunnerCpp``: ``from_dir`` logs the keywords it was given (as JSON),
    ``generate`` answers in the 1.x return_dict shape (context_logits: one [T, vocab] tensor per row)."""

    vocab_size = VOCAB

    def __init__(self, engine_dir):
        self.engine_dir = engine_dir
        self.session = _FakeExecutorSession()

    @classmethod
    def from_dir(cls, engine_dir, **kwargs):
        _log("load", engine_dir)
        _log("from_dir", engine_dir, json.dumps(kwargs, sort_keys=True))
        return cls(engine_dir)

    def generate(self, batch_input_ids, max_new_tokens, **kwargs):
        rows = [[int(t) for t in r] for r in batch_input_ids]
        outs = [r + greedy(r, max_new_tokens) for r in rows]
        return {"context_logits": [fake_logits(r) for r in rows],
                "output_ids": torch.tensor([[o] for o in outs], dtype=torch.int32)}


def make_through_load_runner(engine_dir, **kw):
    """forge's real ``runtime.load_runner`` with ``tensorrt_llm`` (and the GPU check) replaced by the fakes above,
    only for the duration of the call."""
    from pipeline.trtllm import runtime
    trt = types.ModuleType("tensorrt_llm")
    trt.mpi_rank = lambda: 0
    trt_runtime = types.ModuleType("tensorrt_llm.runtime")
    trt_runtime.ModelRunnerCpp = FakeModelRunnerCpp
    trt.runtime = trt_runtime
    names = ("tensorrt_llm", "tensorrt_llm.runtime")
    saved = {n: sys.modules.get(n) for n in names}
    require = runtime._require
    sys.modules.update({"tensorrt_llm": trt, "tensorrt_llm.runtime": trt_runtime})
    runtime._require = lambda: None
    try:
        return runtime.load_runner(engine_dir, **kw)
    finally:
        runtime._require = require
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def factory_kwargs() -> list[dict]:
    """The keywords forge passed each runner factory that got any (``make``), in order."""
    return [json.loads(e.split("\t", 1)[1]) for e in events() if e.startswith("kw ")]


def from_dir_kwargs() -> list[dict]:
    """The keywords of every logged ``ModelRunnerCpp.from_dir`` call, in order."""
    return [json.loads(e.split("\t", 1)[1]) for e in events() if e.startswith("from_dir ")]
