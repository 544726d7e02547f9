"""validate gates every evaluation set alone (issue 28): a pooled figure must not hide one genre."""

from pipeline.stages.validate import check_gates

TH = {"ppl_delta_pct_max": 1.5, "top1_agreement_min": 0.9, "greedy_match_min": None}


def _metrics(code_docs_ppl: float) -> dict:
    return {"ppl_delta_pct": 0.8, "top1_agreement": 0.95, "greedy_exact_match": 1.0,
            "per_set": {"wiki/eval": {"ppl_delta_pct": 0.3, "top1_agreement": 0.96},
                        "code_docs/heldout": {"ppl_delta_pct": code_docs_ppl, "top1_agreement": 0.93}}}


def test_one_set_over_its_threshold_fails_although_the_pooled_figure_passes():
    gates = {g["name"]: g for g in check_gates(_metrics(3.0), TH)}
    assert gates["ppl_delta_pct"]["passed"]                       # pooled: 0.8 <= 1.5
    bad = gates["ppl_delta_pct[code_docs/heldout]"]
    assert not bad["passed"] and bad["value"] == 3.0 and bad["key"] == "validate.thresholds.ppl_delta_pct_max"
    assert gates["ppl_delta_pct[wiki/eval]"]["passed"] and gates["top1_agreement[code_docs/heldout]"]["passed"]


def test_every_set_within_passes_and_pooled_only_metrics_are_not_repeated():
    gates = check_gates(_metrics(1.4), {**TH, "greedy_match_min": 0.5})
    assert all(g["passed"] for g in gates)
    assert [g["name"] for g in gates].count("greedy_exact_match") == 1     # no per-set greedy figure exists
    assert len(gates) == 3 + 3 + 1


def test_a_set_missing_the_metric_fails_its_gate():
    m = _metrics(1.0)
    m["per_set"]["wiki/eval"]["ppl_delta_pct"] = float("nan")
    gates = {g["name"]: g for g in check_gates(m, TH)}
    assert not gates["ppl_delta_pct[wiki/eval]"]["passed"]
