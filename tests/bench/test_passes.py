"""make bench runs every engine and peer once a pass, the order reversed from pass to pass, and pools the samples:
on this 2-core machine whatever runs first in a round measured 1.19x slower (an engine against a copy of itself),
so a fixed order favoured the later rows (docs/search.md)."""

import json

import pytest

import bench.gates
import bench.peers
import bench.run
from bench.measure import merge_passes


def _part(b1_samples, prefill_times, rss=100, **extra):
    return {"name": "e", "what": "w", "skipped": {}, "size_bytes": 5, "load_s": 1.0, "peak_rss_bytes": rss,
            "prefill": {"1": {"batch": 1, "tokens": 256, "times_s": list(prefill_times),
                              "median_s": 0, "tokens_per_s": 0}},
            "decode": {"1": {"batch": 1, "tokens_per_s_samples": list(b1_samples), "t_first_s": [0.1] * len(b1_samples),
                             "t_all_s": [1.0] * len(b1_samples), "tokens_per_s": 0}},
            "ttft": {"times_s": [0.3, 0.5], "median_s": 0}, **extra}


def test_merge_pools_every_pass_and_takes_the_medians_again():
    m = merge_passes([_part([100, 110], [0.5, 0.5], rss=100), _part([200, 210], [0.25, 0.25], rss=300)])
    assert m["decode"]["1"]["tokens_per_s"] == 155.0
    assert m["decode"]["1"]["tokens_per_s_spread"] == {"median": 155.0, "min": 100.0, "max": 210.0, "n": 4}
    assert m["prefill"]["1"]["median_s"] == pytest.approx(0.375)
    assert m["prefill"]["1"]["tokens_per_s"] == pytest.approx(256 / 0.375)
    assert m["ttft"]["median_s"] == pytest.approx(0.4)
    assert m["peak_rss_bytes"] == 300 and m["passes"] == 2 and "pass_errors" not in m


def test_merge_keeps_the_gates_of_the_pass_that_scored_and_says_which_pass_failed():
    gates = {"passed": False, "failed": ["x"]}
    m = merge_passes([_part([100], [0.5]), {"name": "e", "error": "worker exited 1"}, _part([120], [0.5], gates=gates)])
    assert m["gates"] == gates and m["pass_errors"] == ["worker exited 1"] and m["passes"] == 3
    assert m["decode"]["1"]["tokens_per_s"] == 110.0
    assert merge_passes([{"name": "e", "error": "boom"}] * 2) == {"name": "e", "error": "boom", "passes": 2}


def test_the_order_reverses_each_pass_and_a_peer_is_scored_once(tmp_path, monkeypatch):
    calls = []

    def fake_worker(spec, work):
        calls.append((spec["name"], "gates" in spec))
        return _part([100.0 + len(calls)], [0.5])

    monkeypatch.setattr(bench.run, "run_worker", fake_worker)
    monkeypatch.setattr(bench.gates, "spec_from_reports", lambda reports: {"recipe": "r", "eval": [],
                                                                            "thresholds": {}, "not_scored": []})
    monkeypatch.setattr(bench.gates, "ours_from_report", lambda rep, spec: None)
    monkeypatch.setattr(bench.peers, "peer_plan", lambda hf, work, threads, ours=None: [
        {"name": "P", "kind": "oga", "path": "x"}, {"name": "Q", "skipped": "not installed"}])
    rp = tmp_path / "report.json"
    rp.write_text(json.dumps({"recipe": "r", "stages": []}))
    (tmp_path / "hf").mkdir()
    rc = bench.run.main(["--engine", f"fp32={tmp_path}", "--engine", f"int8={tmp_path}", "--report", f"int8={rp}",
                         "--peers", "--hf-dir", str(tmp_path / "hf"), "--passes", "3", "--out", str(tmp_path / "o"),
                         "--threads", "1"])
    assert rc == 0
    assert [c[0] for c in calls] == ["fp32", "int8", "P", "P", "int8", "fp32", "fp32", "int8", "P"]
    assert [g for n, g in calls if n == "P"] == [True, False, False]
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["engines"]["fp32"]["decode"]["1"]["tokens_per_s_samples"] == [101.0, 106.0, 107.0]
    assert res["engines"]["fp32"]["passes"] == 3 and res["peers"]["Q"] == {"skipped": "not installed"}
    assert res["settings"]["passes"] == 3
    assert "in each of 3 pass(es)" in (tmp_path / "o" / "results.md").read_text()


@pytest.mark.parametrize("flag", ["--passes", "--reps", "--threads"])
def test_zero_or_negative_counts_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as e:
        bench.run.main([flag, "0"])
    assert e.value.code == 2 and f"{flag} 0: must be at least 1" in capsys.readouterr().err
