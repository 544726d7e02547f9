"""Test-only stand-in with OrtEngine's API whose costs are known sleeps (NOT an engine: nothing is computed).

prefill: PREFILL_S_PER_TOKEN per token; each decode step: STEP_S per step (independent of batch). With a
``VirtualClock`` the costs advance that clock instead of sleeping: the measurement arithmetic is then checked
exactly, whatever the machine's load (a real sleep overshoots on a busy 2-core machine)."""

import time

import numpy as np

PREFILL_S_PER_TOKEN = 0.0001     # 10,000 tokens/s
STEP_S = 0.004                   # 250 steps/s


class VirtualClock:
    """perf_counter stand-in: time moves only when the fake engine spends it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class FakeEngine:
    def __init__(self, model_dir, threads=0, clock: VirtualClock | None = None):
        self.model_dir, self.threads = model_dir, threads
        self.calls = []
        self._sleep = clock.sleep if clock is not None else time.sleep

    def logits(self, input_ids):
        ids = np.asarray(input_ids)
        self._sleep(ids.size * PREFILL_S_PER_TOKEN)
        self.calls.append(("logits", ids.shape))
        return np.zeros(ids.shape + (8,), np.float32)

    def prefill(self, input_ids):
        ids = np.atleast_2d(np.asarray(input_ids))
        self._sleep(ids.size * PREFILL_S_PER_TOKEN)
        self.calls.append(("prefill", ids.shape))
        return np.zeros((ids.shape[0], 8), np.float32)

    def generate_batch(self, prompts, max_new_tokens, greedy=True):
        self._sleep(sum(len(p) for p in prompts) * PREFILL_S_PER_TOKEN)
        self._sleep(STEP_S * (max_new_tokens - 1))      # the first token comes from the prefill
        self.calls.append(("generate_batch", len(prompts), max_new_tokens))
        return [[1] * max_new_tokens for _ in prompts]

    def generate(self, prompt_ids, max_new_tokens, greedy=True):
        assert all(isinstance(x, int) for x in prompt_ids)
        return self.generate_batch([list(prompt_ids)], max_new_tokens, greedy)[0]
