"""The engine is loaded once per evaluation (pipeline/trtllm/runtime.py EngineSession), for tp 1 in process and
for tp > 1 through one long-lived worker; orchestration tested with a fake runner (tests/trtllm/
fake_trtllm_runner.py, a test fixture, not an engine) that logs every load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import fake_trtllm_runner as fake
from pipeline.errors import StageFailed
from pipeline.trtllm import runtime

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SPEC = "fake_trtllm_runner:make"


def engine_dir(tmp_path, world_size):
    d = tmp_path / f"engine-ws{world_size}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"pretrained_config": {"mapping": {
        "world_size": world_size, "tp_size": world_size, "pp_size": 1}}}))
    return d


@pytest.fixture(autouse=True)
def runner_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_FAKE_RUNNER_LOG", str(tmp_path / "runner.log"))
    # the worker process imports the fake from tests/trtllm and forge from the worktree
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))


def no_mpirun(n):
    """Launch the worker program directly: one process plays the leader rank (no mpirun here)."""
    return []


def loads():
    return [e for e in fake.events() if e.startswith("load ")]


# ------------------------------------------------------------------------------- the evaluate stage
@pytest.fixture
def evaluate_ctx(tmp_path, monkeypatch):
    """TrtllmEvaluate.run on 5 windows (3 chunks of <= 2) and 3 prompts, with the FP32 reference and the data
    replaced by the fake's own rule, so the metrics must come out exact."""
    from pipeline.recipe import resolve
    from pipeline.stages import evaluate as ev
    from pipeline.stages.base import StageContext

    class Ref:
        config = None                      # TorchReference.config (the HF config; a simulated reference reads it)

        def __init__(self, mdir, device=None):     # TorchReference's signature (device: where the FP32 model runs)
            pass

        def logits(self, ids, desc=""):
            return fake.fake_logits(ids)

        def generate_greedy(self, ids, n):
            return fake.greedy(list(ids), n)

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(text) % fake.VOCAB, 1, 2]}

        def decode(self, ids):
            return " ".join(map(str, ids))

    windows = torch.randint(0, fake.VOCAB, (5, 12), generator=torch.Generator().manual_seed(0))
    from pipeline.eval import reference
    monkeypatch.setattr(reference, "TorchReference", Ref)   # evaluate imports it when the stage runs
    monkeypatch.setattr(ev, "windows", lambda ctx, *a: windows)
    monkeypatch.setattr(ev, "model_dir", lambda ctx: tmp_path)
    monkeypatch.setattr(ev, "tokenizer", lambda path: Tok())
    monkeypatch.setattr(ev.datasets, "load_prompts", lambda: ["a", "bb", "ccc"])
    monkeypatch.setattr(runtime, "RUNNER", SPEC)
    monkeypatch.setattr(runtime, "mpi_command", no_mpirun)
    r = resolve("smollm2-135m-trtllm-tp3", ["validate.prompts.limit=3", "validate.prompts.max_new_tokens=4"])

    def make(world_size):
        out = tmp_path / f"out-{world_size}"
        out.mkdir()
        return StageContext(recipe=r, home=tmp_path, out=out, inputs={"build": engine_dir(tmp_path, world_size)},
                            upstream_metrics={})
    return make


@pytest.mark.parametrize("world_size", [1, 3])
def test_evaluation_loads_the_engine_once(evaluate_ctx, world_size):
    from pipeline.stages.tensorrt_llm import TrtllmEvaluate
    m = TrtllmEvaluate().run(evaluate_ctx(world_size))
    # 3 chunks + 3 prompts went through one runner (the old code built one per chunk and per prompt: 6)
    assert len(loads()) == 1, fake.events()
    assert fake.events()[-1].startswith("shutdown "), fake.events()   # released at the end of the evaluation
    assert m["top1_agreement"] == 1.0 and m["ppl_delta_pct"] == 0.0 and m["tokens"] == 5 * 12
    assert m["greedy_exact_match"] == 1.0
    # the KV fraction the memory plan assumes reached the runner (in process at tp 1, in the worker at tp 3)
    assert fake.factory_kwargs() == [{"kv_cache_free_gpu_mem_fraction": 0.9}], fake.events()
    if world_size > 1:   # the worker (another process) loaded it, not this one
        assert loads()[0].split()[1] != str(os.getpid())


# ------------------------------------------------------------------------------- the session itself
def test_tp1_session_is_lazy_and_reuses_the_runner(tmp_path):
    eng = engine_dir(tmp_path, 1)
    with runtime.EngineSession(eng, runner_spec=SPEC) as s:
        assert loads() == []                           # nothing loaded before the first request
        ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
        for _ in range(4):
            assert torch.equal(s.context_logits(ids), fake.fake_logits(ids))
        assert s.generate([5], 3) == [6, 13, 30]
        assert len(loads()) == 1
    assert [e.split()[0] for e in fake.events()] == ["load", "shutdown"]


def test_tp_gt_1_one_worker_process_serves_every_request(tmp_path):
    eng = engine_dir(tmp_path, 2)
    launched = []

    def launch(n):
        launched.append(n)
        return []
    s = runtime.EngineSession(eng, runner_spec=SPEC, launch=launch)
    ids = torch.randint(0, fake.VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        assert torch.equal(s.context_logits(ids), fake.fake_logits(ids))
    assert s.generate([1, 2], 5) == fake.greedy([1, 2], 5)
    # a request the runner fails is an error here, and the worker keeps serving
    with pytest.raises(StageFailed, match="failed a generate request: IndexError"):
        s.generate([], 2)
    assert s.generate([3], 1) == [24]
    worker = s._worker
    assert launched == [2] and len(loads()) == 1
    s.close()
    assert worker.proc.returncode == 0 and not worker.channel.exists()
    assert [e.split()[0] for e in fake.events()] == ["load", "shutdown"]


def test_non_leader_rank_serves_nothing_and_waits_in_shutdown(tmp_path):
    (tmp_path / "chan").mkdir()
    runtime.serve(str(engine_dir(tmp_path, 2)), tmp_path / "chan", "fake_trtllm_runner:make_non_leader")
    assert [e.split()[0] for e in fake.events()] == ["load", "shutdown"]
    assert list((tmp_path / "chan").iterdir()) == []


def test_worker_that_dies_is_reported_not_waited_for(tmp_path):
    s = runtime.EngineSession(engine_dir(tmp_path, 2), runner_spec="fake_trtllm_runner:make_broken", launch=no_mpirun)
    with pytest.raises(StageFailed, match=r"(?s)TensorRT-LLM worker .*exited with code 1.*deserialization failed"):
        s.context_logits(torch.zeros(1, 3, dtype=torch.long))
    s.close()


def test_mpirun_command():
    import shutil

    from pipeline.errors import CannotRunHere
    if shutil.which("mpirun"):
        assert runtime.mpi_command(3) == ["mpirun", "--allow-run-as-root", "-n", "3"]
    else:
        with pytest.raises(CannotRunHere, match="mpirun"):
            runtime.mpi_command(3)


def test_pipeline_parallel_engine_refused_before_any_load(tmp_path):
    d = tmp_path / "pp2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"pretrained_config": {"mapping": {
        "world_size": 2, "tp_size": 1, "pp_size": 2}}}))
    with pytest.raises(StageFailed, match="build.tensorrt_llm.pp: 1"):
        runtime.EngineSession(d, runner_spec=SPEC, launch=no_mpirun).context_logits(torch.zeros(1, 2, dtype=torch.long))
    assert loads() == []


# ------------------------------------------------------------------------------- sliding windows reach the runner
THROUGH_LOAD_RUNNER = "fake_trtllm_runner:make_through_load_runner"


def windowed_engine_dir(tmp_path, world_size, pretrained: dict, max_seq_len: int):
    """An engine config.json as trtllm-build writes it: forge's window fields ride in pretrained_config."""
    d = tmp_path / f"engine-{pretrained['architecture']}-ws{world_size}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "pretrained_config": {**pretrained, "mapping": {"world_size": world_size, "tp_size": world_size, "pp_size": 1}},
        "build_config": {"max_seq_len": max_seq_len}}))
    return d


GEMMA3 = {"architecture": "Gemma3ForCausalLM", "num_hidden_layers": 6, "sliding_window": 8,
          "_sliding_window_pattern": 3}
MISTRAL = {"architecture": "MistralForCausalLM", "num_hidden_layers": 4, "sliding_window": 16}
LLAMA = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 4}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("pretrained,max_seq_len,expect", [
    (GEMMA3, 32, [8, 8, 32, 8, 8, 32]),      # global every 3rd layer: max_seq_len there
    (MISTRAL, 64, [16, 16, 16, 16]),         # every layer slides
    (MISTRAL, 16, None),                     # window >= max_seq_len: the runtime default is already right
    (LLAMA, 64, None),                       # no window: not passed at all
], ids=["gemma3", "mistral", "mistral-window-ge-max-seq-len", "llama"])
def test_runner_gets_the_per_layer_attention_window(tmp_path, world_size, pretrained, max_seq_len, expect):
    """forge's own load_runner (in process at tp 1, in the worker at tp 2) hands ModelRunnerCpp.from_dir the
    per-layer max_attention_window_size of the engine's config.json, and the engine then serves as usual."""
    eng = windowed_engine_dir(tmp_path, world_size, pretrained, max_seq_len)
    ids = torch.tensor([[1, 2, 3, 4]])
    with runtime.EngineSession(eng, runner_spec=THROUGH_LOAD_RUNNER, launch=no_mpirun) as s:
        assert torch.equal(s.context_logits(ids), fake.fake_logits(ids))
        assert s.generate([5], 3) == fake.greedy([5], 3)
    calls = fake.from_dir_kwargs()
    assert len(calls) == 1, fake.events()
    assert calls[0]["kv_cache_enable_block_reuse"] is False
    # the KV pool cap (issue 40): trtllm-build's default 2048 sequences of the one window, whole 32-token blocks;
    # none with two window sizes (Gemma 3), which TensorRT-LLM ignores the cap for
    one = {w for w in (expect or [max_seq_len])}
    assert calls[0].get("max_tokens_in_paged_kv_cache") == (2048 * -(-one.pop() // 32) * 32 if len(one) == 1 else None)
    assert "kv_cache_free_gpu_memory_fraction" not in calls[0]
    if expect is None:
        assert "max_attention_window_size" not in calls[0]
    else:
        assert calls[0]["max_attention_window_size"] == expect
        assert len(expect) == pretrained["num_hidden_layers"]
    if world_size > 1:   # loaded by the worker process
        assert loads()[0].split()[1] != str(os.getpid())


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_kv_limits_reach_model_runner_cpp(tmp_path, world_size):
    """The recipe's kv_cache_free_gpu_mem_fraction and the engine's KV cap reach ModelRunnerCpp.from_dir through
    forge's own load_runner, in process and in the mpirun worker (its --kv-fraction argument)."""
    eng = windowed_engine_dir(tmp_path, world_size, LLAMA, 100)
    cfg = json.loads((eng / "config.json").read_text())
    cfg["build_config"].update(max_batch_size=6, plugin_config={"tokens_per_block": 64})
    (eng / "config.json").write_text(json.dumps(cfg))
    with runtime.EngineSession(eng, runner_spec=THROUGH_LOAD_RUNNER, launch=no_mpirun,
                               kv_cache_free_gpu_mem_fraction=0.75) as s:
        assert s.generate([5], 2) == fake.greedy([5], 2)
    [call] = fake.from_dir_kwargs()
    assert call["kv_cache_free_gpu_memory_fraction"] == 0.75
    assert call["max_tokens_in_paged_kv_cache"] == 6 * 2 * 64          # 6 sequences x ceil(100 / 64) blocks of 64
