"""bench/gates.py: a peer is held to the gates our engines pass, pooled and per set, and the bench's table says
which row is the fastest that passes (issue 41: ORT GenAI's INT4 peer decodes faster than our engines and fails the
int8 recipe's gates by +36.5 % perplexity)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.gates import gate_spec, ours_from_report, score_peer, summarize
from bench.run import fastest, markdown, worker

HERE = Path(__file__).parent
V = 16
SPEC = {"recipe": "r", "eval": [], "thresholds": {"ppl_delta_pct_max": 5.0, "top1_agreement_min": 0.85}}


class Reference:
    """Logits fixed by the ids (seeded by their bytes): a stand-in FP32 model for the arithmetic."""

    def logits(self, ids, desc=""):
        ids = torch.as_tensor(ids)
        g = torch.Generator().manual_seed(int(ids.sum()) * 7919 + ids.numel())
        return torch.randn(*ids.shape, V, generator=g) * 4


def _sets():
    g = torch.Generator().manual_seed(0)
    return [("a/eval", torch.randint(0, V, (4, 32), generator=g)),
            ("b/heldout", torch.randint(0, V, (4, 32), generator=g))]


def test_a_peer_equal_to_the_reference_passes_with_zero_change():
    ref = Reference()
    got = score_peer(ref.logits, SPEC, _sets(), ref)
    assert got["passed"] and got["failed"] == []
    assert got["ppl_delta_pct"] == pytest.approx(0.0, abs=1e-6)
    assert got["top1_agreement"] == 1.0
    assert set(got["per_set"]) == {"a/eval", "b/heldout"}


def test_a_peer_bad_on_one_set_fails_that_set_by_name():
    """The pooled figures may hide one genre: the per-set gate names it (as validate does for our engines)."""
    ref = Reference()
    sets = _sets()
    bad_rows = {tuple(r.tolist()) for r in sets[1][1]}

    def peer(ids):
        out = ref.logits(ids).clone()
        for i, row in enumerate(torch.as_tensor(ids)):
            if tuple(row.tolist()) in bad_rows:
                out[i] = torch.randn(out[i].shape, generator=torch.Generator().manual_seed(i)) * 4
        return out

    got = score_peer(peer, SPEC, sets, ref)
    assert not got["passed"]
    named = " ".join(got["failed"])
    assert "[b/heldout]" in named and "[a/eval]" not in named
    assert got["per_set"]["a/eval"]["top1_agreement"] == 1.0
    assert got["per_set"]["b/heldout"]["top1_agreement"] < 0.5


def test_no_threshold_means_not_passed():
    """A spec with no gate at all cannot make a row 'pass'."""
    got = summarize({"ppl_delta_pct": 0.0, "top1_agreement": 1.0, "per_set": {}},
                    {"recipe": "r", "eval": [], "thresholds": {}})
    assert got["passed"] is False


def test_a_missing_or_infinite_metric_fails():
    got = summarize({"ppl_delta_pct": float("inf"), "top1_agreement": None, "per_set": {}}, SPEC)
    assert not got["passed"] and len(got["failed"]) == 2


def test_gate_spec_is_the_named_recipes_eval_sets_and_thresholds():
    spec = gate_spec({"recipe": "smollm2-135m-int8"})
    assert spec["thresholds"]["ppl_delta_pct_max"] == 5.0 and spec["thresholds"]["top1_agreement_min"] == 0.85
    assert [e["set"] for e in spec["eval"]] == ["wiki", "austen", "code_docs", "licenses"]
    assert gate_spec({"recipe": "no-such-recipe"}) is None
    assert gate_spec({}) is None


def test_ours_from_report_reads_the_evaluate_stage_and_its_fp32_part():
    m = {"ppl_delta_pct": 0.23, "top1_agreement": 0.96, "per_set": {"wiki/eval": {"ppl_delta_pct": 0.04,
                                                                                  "top1_agreement": 0.957}}}
    rep = {"stages": [{"name": "evaluate", "metrics": m}]}
    got = ours_from_report(rep, SPEC)
    assert got["passed"] and got["ppl_delta_pct"] == 0.23
    sim = {"stages": [{"name": "evaluate", "metrics": {**m, "ppl_delta_pct": 0.01, "reference": {"kind": "simulated"},
                                                       "fp32": {**m, "ppl_delta_pct": 9.0}}}]}
    assert ours_from_report(sim, SPEC)["passed"] is False    # held against FP32, not its simulation
    assert ours_from_report({"stages": [{"name": "evaluate", "metrics": {}}]}, SPEC) is None
    assert ours_from_report({}, SPEC) is None


def _row(b1):
    return {"what": "x", "decode": {"1": {"tokens_per_s": b1}}, "prefill": {}, "size_bytes": 1, "peak_rss_bytes": 1}


def _results():
    ok = {"passed": True, "failed": [], "ppl_delta_pct": 0.23, "top1_agreement": 0.96}
    bad = {"passed": False, "failed": ["ppl_delta_pct = 36.55 (needs <= 5.0)"], "ppl_delta_pct": 36.55,
           "top1_agreement": 0.637}
    return {"machine": {"cpu_model": "cpu", "usable_cpus": 2, "env": {}, "versions": {}, "date": "d",
                        "load_avg_at_start": [0.5]},
            "settings": {"reps": 3, "threads": 2, "prefill_len": 256, "decode_new": 32, "decode_prompt": 32},
            "engines": {"int8": _row(100.0), "int4": _row(120.0)}, "ratios": {}, "pipeline": {},
            "gates": {"spec": {**SPEC, "eval": [{"set": "wiki", "split": "eval", "samples": 8, "seq_len": 256,
                                                 "seed": 0}]},
                      "engines": {"int8": ok, "int4": ok}},
            "peers": {"GenAI INT4": {**_row(180.0), "gates": bad}, "llama": _row(150.0),
                      "off": {"skipped": "not installed"}},
            "peer_ratios": {}}


def test_the_fastest_that_passes_is_not_a_faster_peer_that_fails():
    res = _results()
    fr = fastest(res, "decode_b1")
    assert fr["passing"] == ("ours int4", 120.0)
    assert fr["overall"] == ("GenAI INT4", 180.0, False)
    md = markdown(res)
    assert "fastest that passes, decode tok/s (batch 1): ours int4 (120.0); fastest of all: GenAI INT4 (180.0, " \
           "fails the gates)" in md
    assert "+36.55 % | 0.637 | **fails**: ppl_delta_pct = 36.55 (needs <= 5.0)" in md
    assert "| llama | x |" in md and "not scored" in md      # a peer without figures is never called passing
    assert "| gates | passes | passes |" in md


def test_a_gate_the_bench_cannot_score_is_named():
    """A recipe that gates greedy matches: the bench compares logits only and says which gate it left out."""
    spec = gate_spec({"recipe": "smollm2-135m-int8"})
    assert spec["not_scored"] == []
    res = _results()
    res["gates"]["spec"]["not_scored"] = ["greedy_exact_match"]
    assert "not scored here (the bench compares logits only): greedy_exact_match." in markdown(res)


def test_when_nothing_passes_the_table_says_none():
    res = _results()
    res["gates"]["engines"] = {}
    res["peers"] = {"GenAI INT4": res["peers"]["GenAI INT4"]}
    assert "fastest that passes, decode tok/s (batch 1): none; fastest of all: GenAI INT4" in markdown(res)


def test_worker_keeps_the_speed_figures_when_scoring_fails(tmp_path, monkeypatch):
    """Accuracy is scored after speed and peak RSS; a scoring error is recorded, the figures stand."""
    import bench.gates

    sys.path.insert(0, str(HERE))
    monkeypatch.setenv("FORGE_BENCH_ENGINE", "fake_engine:FakeEngine")
    monkeypatch.setattr(bench.gates, "score_against_fp32",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no fp32 model here")))
    d = tmp_path / "eng"
    d.mkdir()
    spec = {"name": "peer", "kind": "ours", "path": str(d), "threads": 1, "reps": 1, "vocab_size": 1000,
            "base_ids": None, "prefill_len": 8, "decode_prompt": 4, "decode_new": 3, "result": str(tmp_path / "r.json"),
            "gates": SPEC, "hf_dir": str(tmp_path)}
    sp = tmp_path / "spec.json"
    sp.write_text(json.dumps(spec))
    worker(str(sp))
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["decode"]["1"]["tokens_per_s"] > 0
    assert res["gates"] == {"error": "RuntimeError: no fp32 model here"}
    calls = []
    monkeypatch.setattr(bench.gates, "score_against_fp32", lambda logits, hf, sp_, **k: calls.append(hf) or
                        {"passed": True, "failed": []})
    worker(str(sp))
    assert calls == [str(tmp_path)] and json.loads((tmp_path / "r.json").read_text())["gates"]["passed"]
