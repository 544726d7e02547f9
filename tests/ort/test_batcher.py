"""Continuous batching (pipeline/ort/batcher.py): answers under batching, joining and leaving equal each prompt's
greedy tokens run alone; the bounded queue refuses with the recipe key. Every test runs the one scheduler over each
K/V backend: ``host`` and ``slots`` on the tiny FP32 engine (real ONNX Runtime, CPU provider), and ``slots`` on
the CUDA code path of the engine over the fake CUDA onnxruntime (tests/ort/fake_cuda.py)."""

import functools
import threading

import numpy as np
import pytest

import fake_cuda
from pipeline.ort.batcher import QUEUE_KEY, ContinuousBatcher, Job, QueueFull
from pipeline.ort.engine import OrtEngine


@pytest.fixture(scope="module")
def cpu_engine(tiny_onnx_dir):
    return OrtEngine(tiny_onnx_dir, threads=1)


@pytest.fixture(scope="module")
def fake_cuda_engine(tmp_path_factory):
    mod = fake_cuda.load_engine(fake_cuda.fake_onnxruntime())
    return mod.OrtEngine(fake_cuda.write_model(tmp_path_factory.mktemp("fake_cuda")),
                         providers=["CUDAExecutionProvider"], device="cuda")


@pytest.fixture(params=["cpu-host", "cpu-slots", "fake-cuda"])
def served(request):
    """(engine, ContinuousBatcher bound to the backend under test)"""
    if request.param == "fake-cuda":
        eng = request.getfixturevalue("fake_cuda_engine")
        return eng, functools.partial(ContinuousBatcher, eng)
    eng = request.getfixturevalue("cpu_engine")
    kv = "slots" if request.param == "cpu-slots" else None
    return eng, functools.partial(ContinuousBatcher, eng, kv=kv)


@pytest.fixture
def engine(served):
    return served[0]


@pytest.fixture
def batcher(served):
    return served[1]


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 250, size=int(rng.integers(3, 20))).tolist() for _ in range(n)]


def drain(b):
    steps = 0
    while b.step():
        steps += 1
        assert steps < 10_000
    return steps


def test_batched_answers_equal_each_prompt_alone(engine, batcher):
    ps = prompts(6)
    n_new = [5, 12, 1, 9, 12, 3]       # different lengths: rows leave at different steps
    alone = [engine.generate(p, n) for p, n in zip(ps, n_new)]
    b = batcher(max_batch=8, max_queue=16)
    jobs = [Job(p, n) for p, n in zip(ps, n_new)]
    b.submit(jobs)
    drain(b)
    assert [j.tokens for j in jobs] == alone
    assert all(j.finished.is_set() and j.error is None for j in jobs)
    # one prefill for all six, then decode steps over the rows still running (the 1-token job never decodes)
    assert b.history[0] == ("prefill", 6)
    decodes = [n for k, n in b.history if k == "decode"]
    assert decodes[0] == 5 and decodes[-1] == 2 and len(decodes) == max(n_new) - 1


def test_requests_join_between_decode_steps_and_leave_when_done(engine, batcher):
    ps = prompts(4, seed=1)
    long_a, short_b, late_c, late_d = [Job(ps[0], 16), Job(ps[1], 5), Job(ps[2], 6), Job(ps[3], 10)]
    b = batcher(max_batch=3, max_queue=8)
    b.submit([long_a, short_b])
    for _ in range(3):
        b.step()
    assert b.active == 2 and not long_a.finished.is_set()
    b.submit([late_c, late_d])   # arrive mid-generation: C joins at the next step, D waits for a free row (max 3)
    b.step()
    assert b.history[-2] == ("prefill", 1) and b.history[-1] == ("decode", 3)
    assert b.waiting == 1 and short_b.finished.is_set()       # B left (5 tokens), its row frees for D
    drain(b)
    assert ("prefill", 1) in b.history[-20:]                  # D joined later while A was still running
    for j, p in zip((long_a, short_b, late_c, late_d), ps):
        assert j.tokens == engine.generate(p, j.max_new_tokens), "a joined/left row's tokens changed"
    assert max(n for k, n in b.history if k == "decode") == 3


def test_non_invariant_engines_run_one_request_at_a_time(engine, batcher):
    ps = prompts(3, seed=2)
    b = batcher(max_batch=8, max_queue=8, batched=False)
    jobs = [Job(p, 4) for p in ps]
    b.submit(jobs)
    drain(b)
    assert {n for _, n in b.history} == {1}
    assert [j.tokens for j in jobs] == [engine.generate(p, 4) for p in ps]


def test_eos_and_sampling_settings_per_row(engine, batcher):
    p = prompts(1, seed=3)[0]
    ref = engine.generate(p, 8)
    eos = ref[2]
    sampled_alone = engine.generate(p, 8, greedy=False, temperature=0.8, top_k=20, seed=7)
    b = batcher(max_batch=4, max_queue=4)
    jobs = [Job(p, 8, eos_token_id=eos), Job(p, 8, greedy=False, temperature=0.8, top_k=20, seed=7), Job(p, 8)]
    b.submit(jobs)
    drain(b)
    assert jobs[0].tokens == ref[:ref.index(eos) + 1]
    assert jobs[1].tokens == sampled_alone
    assert jobs[2].tokens == ref


def test_queue_full_names_the_recipe_key_and_takes_nothing(engine, batcher):
    b = batcher(max_batch=1, max_queue=2)
    b.submit([Job([1, 2], 2), Job([3], 2)])
    with pytest.raises(QueueFull, match=QUEUE_KEY.replace(".", r"\.") + " = 2"):
        b.submit(Job([4], 2))
    with pytest.raises(QueueFull):          # all or none: two more do not fit even after one leaves the queue
        b.step()
        b.submit([Job([5], 2), Job([6], 2)])
    assert b.waiting == 1
    drain(b)


def test_hostile_jobs_fail_alone(engine, batcher):
    with pytest.raises(ValueError, match="at least one token"):
        Job([], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Job([1], 0)
    b = batcher(max_batch=4, max_queue=4)
    if engine.max_seq_len:
        with pytest.raises(ValueError, match="max_seq_len"):
            b.submit(Job([1] * 4, engine.max_seq_len))
    ok, bad = Job([1, 2, 3], 3), Job([10**9], 3)          # a token id beyond the vocabulary: the prefill fails
    b.submit(bad)
    b.step()
    assert bad.finished.is_set() and bad.error is not None
    b.submit(ok)
    drain(b)
    assert ok.error is None and ok.tokens == engine.generate([1, 2, 3], 3)


def test_cancelled_rows_leave_and_the_thread_answers_everyone(engine, batcher):
    ps = prompts(5, seed=4)
    done = threading.Event()
    flag = {"cancel": False}
    finished = []
    lock = threading.Lock()

    def on_done(job, err):
        with lock:
            finished.append((job, err))
            if len(finished) == 5:
                done.set()

    b = batcher(max_batch=2, max_queue=8).start()
    try:
        jobs = [Job(p, 6, on_done=on_done) for p in ps[:4]]
        victim = Job(ps[4], 500 if not engine.max_seq_len else min(500, engine.max_seq_len - len(ps[4])),
                     on_done=on_done, cancelled=lambda: flag["cancel"])
        b.submit(jobs + [victim])
        flag["cancel"] = True
        assert done.wait(60)
    finally:
        b.stop()
    assert all(err is None for j, err in finished if j is not victim)
    assert [j.tokens for j in jobs] == [engine.generate(p, 6) for p in ps[:4]]
    assert victim.error is not None and len(victim.tokens) < victim.max_new_tokens
