"""TEST FIXTURE, NOT AN ENGINE: stands in for pipeline.trtllm.runtime.Runner (one rank's loaded engine).

Its "logits" are a fixed function of the input ids and its "generation" the matching greedy rule, so the
evaluation's numbers are known. Every construction and shutdown is appended to the file named by
FORGE_FAKE_RUNNER_LOG, which works across the mpirun-style worker process: the tests count how often an
engine would have been loaded.
"""

from __future__ import annotations

import os

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


def _log(event: str, engine_dir) -> None:
    with open(os.environ["FORGE_FAKE_RUNNER_LOG"], "a") as f:
        f.write(f"{event} {os.getpid()} {engine_dir}\n")


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


def make(engine_dir):
    return FakeRunner(engine_dir)


def make_non_leader(engine_dir):
    return FakeRunner(engine_dir, leader=False)


def make_broken(engine_dir):
    _log("load", engine_dir)
    raise RuntimeError("rank0.engine: deserialization failed (test fixture)")
