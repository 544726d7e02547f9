"""In-flight batching on CUDA (issue 38, part 4), on the engine's CUDA code path over the fake CUDA onnxruntime
(tests/ort/fake_cuda.py: device memory, host copies and CUDA graph captures recorded; no GPU here). The scheduler
tests shared with the CPU (answers equal each request alone, joins, leaves, queue bound, cancellation) run over
this engine in tests/ort/test_batcher.py; these check what is CUDA's own: K/V rows stay in device slots, only
token ids, mask and logits rows cross per step, the slots grow on the device, CUDA graphs replay at fixed
addresses, and the Triton python model streams from it. The same code on a real GPU: test_cuda.py (gpu marker)."""

import importlib.util
import json
import sys
import types

import numpy as np
import pytest

import fake_cuda
from pipeline.ort import batcher as batcher_mod
from pipeline.ort.batcher import QUEUE_KEY, ContinuousBatcher, Job, kv_backend

ROOT = fake_cuda.ROOT
KV_NAMES = ("past_key_values", "present")


@pytest.fixture
def fake():
    return fake_cuda.fake_onnxruntime()


@pytest.fixture
def engine_mod(fake):
    return fake_cuda.load_engine(fake)


def cuda_engine(engine_mod, model_dir, **kw):
    return engine_mod.OrtEngine(model_dir, providers=["CUDAExecutionProvider"], device="cuda", **kw)


@pytest.fixture
def engine(engine_mod, tmp_path):
    return cuda_engine(engine_mod, fake_cuda.write_model(tmp_path / "m"))


def prompts(n, seed=0, lo=3, hi=20):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def drain(b):
    steps = 0
    while b.step():
        steps += 1
        assert steps < 10_000


def running(engine, ps, n_new, *, max_batch, steps):
    """A batcher that has run the first two jobs for ``steps`` steps (the rest not submitted yet), and all jobs."""
    jobs = [Job(p, n) for p, n in zip(ps, n_new)]
    b = ContinuousBatcher(engine, max_batch=max_batch, max_queue=8)
    b.submit(jobs[:2])
    for _ in range(steps):
        b.step()
    return b, jobs


def kv_copies(ledger):
    return [c for c in ledger.copies if c[1].startswith(KV_NAMES)]


def test_the_engine_device_picks_the_backend(engine, engine_mod):
    assert ContinuousBatcher(engine).kv == "slots"
    assert kv_backend(types.SimpleNamespace(layout="shared", device="cpu")) == "host"
    assert kv_backend(types.SimpleNamespace(layout="concat", device="cuda")) is None    # whole batches
    assert kv_backend(object()) is None
    with pytest.raises(ValueError, match="kv='host' needs a shared-layout engine on the CPU.*'cuda'"):
        ContinuousBatcher(engine, kv="host")      # host copies of device K/V every join: refused
    with pytest.raises(ValueError, match="kv='paged' is not one of"):
        ContinuousBatcher(engine, kv="paged")


def test_the_ledger_sees_host_kv_crossing_every_step(engine, engine_mod, fake):
    """The control for the copy counts below: a host (numpy) cache bound to the CUDA session is copied to the
    device on every call, and the ledger records it under the K/V input names."""
    cache = engine_mod.KVCache(engine, 1, 64, host=True)
    engine.forward(np.array([[5, 6, 7]]), np.array([3]), cache, last_only=True)
    engine.decode(np.array([9]), cache)
    kv_bytes = 2 * engine.num_layers * engine.num_kv_heads * 64 * engine.head_dim * 2      # fp16 K and V
    assert sum(n for k, _, n in kv_copies(fake.ledger) if k == "h2d") == 2 * kv_bytes


def test_newcomers_join_at_the_next_step_and_no_kv_byte_crosses(engine, fake):
    ps = prompts(4, seed=1)
    want = [engine.generate(p, n) for p, n in zip(ps, (24, 6, 9, 14))]
    fake.ledger.copies.clear()
    fake.ledger.allocs.clear()
    a, b_, c, d = (Job(p, n) for p, n in zip(ps, (24, 6, 9, 14)))
    b = ContinuousBatcher(engine, max_batch=4, max_queue=8)
    b.submit([a, b_])
    for _ in range(3):
        b.step()
    assert len(a.tokens) == 4 and not c.tokens
    b.submit([c, d])                       # arrive mid-generation: both join at the very next step
    b.step()
    assert b.history[-2:] == [("prefill", 2), ("decode", 4)]     # slots 2 and 3: one prefill, then one decode
    assert len(c.tokens) == len(d.tokens) == 2 and len(a.tokens) == 5
    # one pure decode step: the ids and mask go in, the logits rows come out, nothing else
    n0 = len(fake.ledger.copies)
    stored = [len(j.prompt) + len(j.tokens) - 1 for j in (a, b_, c, d)]    # the last token is fed by this step
    b.step()
    assert b.history[-1] == ("decode", 4)
    V = engine.vocab_size
    # int64 ids [4, 1]; int64 mask [4, the longest row's positions + this step's]; fp32 logits [4, 1, V]
    assert sorted(fake.ledger.copies[n0:]) == [("d2h", "logits", 4 * V * 4), ("h2d", "attention_mask",
                                               4 * 8 * (max(stored) + 1)), ("h2d", "input_ids", 4 * 8)]
    drain(b)
    assert [j.tokens for j in (a, b_, c, d)] == want
    # over the whole run: never a K/V byte to or from the host, and only logits rows came back
    assert not kv_copies(fake.ledger)
    rows = sum(n for _, n in b.history) + b.padded_rows
    assert fake.ledger.bytes("d2h") == fake.ledger.bytes("d2h", {"logits", "rows"}) == rows * V * 4
    kv_allocs = [x for x in fake.ledger.allocs if len(x[1]) == 4]
    assert len(kv_allocs) == 2 * engine.num_layers and {x[0] for x in kv_allocs} == {"cuda"}
    assert {x[1][0] for x in kv_allocs} == {4}       # one preallocated slot per batch row


def test_slots_grow_on_the_device_while_rows_decode(engine, fake):
    ps = prompts(3, seed=2)
    n_new = (10, 12, 150)                  # the third needs more positions than the first two's 64
    want = [engine.generate(p, n) for p, n in zip(ps, n_new)]
    fake.ledger.copies.clear()
    b, jobs = running(engine, ps, n_new, max_batch=3, steps=1)
    first = b._kv.cache
    assert first.capacity == 64
    b.submit(jobs[2])
    b.step()
    grown = b._kv.cache
    assert grown.capacity >= len(ps[2]) + 150 and grown is not first
    kv_total = 2 * engine.num_layers * grown.slots * engine.num_kv_heads * grown.capacity * engine.head_dim * 2
    assert fake.ledger.copies.count(("d2d", "forge_grow_kv", kv_total)) == 1     # rows copied on the device
    drain(b)
    assert [j.tokens for j in jobs] == want
    assert not kv_copies(fake.ledger)


def test_cuda_graph_replays_each_decode_range_at_fixed_addresses(engine_mod, tmp_path, fake):
    """With cuda_graph the decode steps run over slots [0, k) through buffers bound once per range: the fake
    refuses a replay whose addresses differ from its capture, and a host input under a graph."""
    d = fake_cuda.write_model(tmp_path / "m")
    plain, graph = cuda_engine(engine_mod, d), cuda_engine(engine_mod, d, cuda_graph=True)
    ps = prompts(5, seed=3)
    n_new = (8, 20, 3, 90, 12)             # the 90-token request grows the slots mid-flight
    want = [plain.generate(p, n) for p, n in zip(ps, n_new)]
    fake.ledger.captures.clear()
    b, jobs = running(graph, ps, n_new, max_batch=3, steps=2)
    b.submit(jobs[2:])
    drain(b)
    assert [j.tokens for j in jobs] == want
    decode_runs = [r for r in fake.ledger.runs if r[0] == "forge_kv_graph" and r[1] not in (None, "-1")]
    assert decode_runs and all(r[2][1] == 1 for r in decode_runs)           # every graph run is a decode step
    # one graph per (slot cache, highest slot): at most 3 per cache, and the cache grew once
    assert 2 <= len(fake.ledger.captures) <= 2 * 3
    assert len(decode_runs) > len(fake.ledger.captures)                      # most steps were replays


def test_the_fake_refuses_a_graph_replay_at_other_addresses(engine_mod, tmp_path, fake):
    """The control for the test above: the same gpu_graph_id replayed with other K/V buffers is refused."""
    eng = cuda_engine(engine_mod, fake_cuda.write_model(tmp_path / "m"), cuda_graph=True)
    a, c = eng.cache(1, 64), engine_mod.KVCache(eng, 1, 64)
    eng.forward(np.array([[4, 5]]), np.array([2]), a, last_only=True)
    eng.decode_static(np.array([7]), a)
    c.lengths[:] = 2
    c.static = dict(a.static, io=eng.session.io_binding())      # a's graph id, c's buffers
    c.bind_kv(c.static["io"], eng)
    for name, key in (("input_ids", "ids"), ("attention_mask", "mask")):
        c.static["io"].bind_ortvalue_input(name, a.static[key])
    c.static["io"].bind_ortvalue_output("logits", a.static["logits"])
    with pytest.raises(fake_cuda.FakeCudaError, match="replayed with other buffers"):
        eng.decode_static(np.array([7]), c)


# ---------------------------------------------------------------- the Triton python model on the CUDA engine
class _Tensor:
    def __init__(self, name, arr):
        self.name, self._a = name, np.asarray(arr)

    def as_numpy(self):
        return self._a


class _Response:
    def __init__(self, output_tensors=(), error=None):
        self.tensors = {t.name: t.as_numpy() for t in output_tensors}
        self.error = error


class _Error:
    UNAVAILABLE = "UNAVAILABLE"

    def __init__(self, msg, code=None):
        self.msg, self.code = msg, code


class _Sender:
    def __init__(self):
        self.sent = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return False


class _Request:
    def __init__(self, ids, n, stream=False):
        self.inputs = {"input_ids": _Tensor("input_ids", np.array([ids], np.int32)),
                       "input_lengths": _Tensor("input_lengths", np.array([[len(ids)]], np.int32)),
                       "request_output_len": _Tensor("request_output_len", np.array([[n]], np.int32))}
        if stream:
            self.inputs["streaming"] = _Tensor("streaming", np.array([[True]]))
        self.sender = _Sender()

    def get_response_sender(self):
        return self.sender


FINAL = 1


@pytest.fixture
def triton_model(monkeypatch, tmp_path):
    """ort_llm.py's TritonPythonModel over the fake CUDA engine, its batcher stepped by the test (no thread)."""
    pb = types.SimpleNamespace(Tensor=_Tensor, InferenceResponse=_Response, TritonError=_Error,
                               TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
                               get_input_tensor_by_name=lambda req, name: req.inputs.get(name))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.setattr(batcher_mod.ContinuousBatcher, "start", lambda self: self)
    spec = importlib.util.spec_from_file_location("forge_test_ort_llm",
                                                  ROOT / "pipeline/triton/python_models/ort_llm.py")
    ort_llm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ort_llm)
    fake = fake_cuda.fake_onnxruntime()
    fake_cuda.load_engine(fake, "forge_fake_cuda_engine_triton")

    def make(decoupled=True, max_queue=8, max_batch=4, invariant=None):
        d = fake_cuda.write_model(tmp_path / f"m{invariant}", batch_invariant=invariant)
        params = {"engine_module": "forge_fake_cuda_engine_triton", "batcher_module": "pipeline.ort.batcher",
                  "engine_dir": str(d), "provider": "cuda", "cuda_graph": "0", "max_queue_size": str(max_queue)}
        cfg = {"max_batch_size": max_batch, "parameters": {k: {"string_value": v} for k, v in params.items()},
               "model_transaction_policy": {"decoupled": decoupled}}
        m = ort_llm.TritonPythonModel()
        m.initialize({"model_config": json.dumps(cfg), "model_repository": str(tmp_path), "model_version": "1",
                      "model_instance_device_id": "0"})
        return m
    yield make, fake


def test_triton_model_streams_from_the_cuda_engine_and_late_requests_join(triton_model):
    make, fake = triton_model
    m = make()
    assert m.engine.device == "cuda" and m.batcher.kv == "slots"
    ps = prompts(2, seed=5)
    want = [m.engine.generate(ps[0], 12), m.engine.generate(ps[1], 5)]
    streamed, late = _Request(ps[0], 12, stream=True), _Request(ps[1], 5)
    assert m.execute([streamed]) is None
    for _ in range(3):
        m.batcher.step()
    # the prefill's token and one per decode step, each sent as it is picked; nothing final yet
    assert [f for _, f in streamed.sender.sent] == [0, 0, 0, 0]
    m.execute([late])
    m.batcher.step()
    assert m.batcher.history[-2:] == [("prefill", 1), ("decode", 2)]
    drain(m.batcher)
    *tokens, (final, flags) = streamed.sender.sent
    assert [r.tensors["output_ids"].reshape(-1).tolist() for r, _ in tokens] == [[t] for t in want[0]]
    assert all(f == 0 and r.error is None for r, f in tokens)
    assert final is None and flags == FINAL                               # the flag-only final response
    (answer, f), = late.sender.sent                                       # not streamed: one final answer
    assert f == FINAL and answer.tensors["output_ids"].reshape(-1).tolist() == want[1]
    assert answer.tensors["sequence_length"].reshape(-1).tolist() == [5]
    assert not kv_copies(fake.ledger)
    m.finalize()


def test_triton_model_queue_bound_answers_unavailable(triton_model):
    make, _ = triton_model
    m = make(max_queue=2, max_batch=1)
    reqs = [_Request(p, 4) for p in prompts(3, seed=6)]
    m.execute(reqs)                              # nothing has stepped: the third finds the queue full
    (resp, flags), = reqs[2].sender.sent
    assert flags == FINAL and resp.error.code == _Error.UNAVAILABLE
    assert "QueueFull" in resp.error.msg and f"{QUEUE_KEY} = 2" in resp.error.msg
    drain(m.batcher)
    assert all(len(r.sender.sent) == 1 and r.sender.sent[0][0].error is None for r in reqs[:2])


def test_triton_model_streaming_needs_the_decoupled_model(triton_model):
    make, _ = triton_model
    m = make(decoupled=False)
    r = _Request([5, 6, 7], 3, stream=True)
    m.execute([r])
    (resp, flags), = r.sender.sent
    assert flags == FINAL and "package.triton.decoupled: true" in resp.error.msg


def test_triton_model_serves_a_batch_dependent_cuda_engine_one_request_at_a_time(triton_model):
    make, _ = triton_model
    m = make(invariant=False)
    ps = prompts(3, seed=7)
    alone = [m.engine.generate(p, 6) for p in ps]
    assert m.engine.generate_batch(ps, 6) != alone       # the control: batching would change its answers
    reqs = [_Request(p, 6) for p in ps]
    m.execute(reqs)
    drain(m.batcher)
    assert {n for _, n in m.batcher.history} == {1}
    assert [r.sender.sent[0][0].tensors["output_ids"].reshape(-1).tolist() for r in reqs] == alone
