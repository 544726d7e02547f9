"""Regression rules: the recipe schema (short and long forms, signs, unknown metrics) and their semantics
(absolute / relative, direction, per-stage timing baselines, machine classes, bench figures)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.errors import RecipeError
from pipeline.history.regression import catalog, compare, evaluate_rules
from pipeline.history.store import History
from pipeline.recipe import RegressionRule, RegressionRules, resolve

sys.path.insert(0, str(Path(__file__).parent))
from test_store import make_run  # noqa: E402


def rules(**kw) -> RegressionRules:
    return RegressionRules.model_validate(kw)


@pytest.mark.parametrize("raw, want", [
    (0.5, RegressionRule(abs=0.5)), ("+0.5", RegressionRule(abs=0.5)), ("2.5%", RegressionRule(pct=2.5)),
    ("+10 %", RegressionRule(pct=10)), ({"abs": 1}, RegressionRule(abs=1)), ({"pct": 3}, RegressionRule(pct=3))])
def test_short_and_long_forms_for_a_higher_is_worse_metric(raw, want):
    assert rules(ppl_delta_pct=raw).ppl_delta_pct == want


def test_a_sign_must_point_the_way_the_metric_gets_worse():
    assert rules(prefill_tok_s="-10%").prefill_tok_s == RegressionRule(pct=10)
    assert rules(top1_agreement=-0.01).top1_agreement == RegressionRule(abs=0.01)
    with pytest.raises(ValueError, match=r"prefill_tok_s gets worse when it is lower: write '-10%'"):
        rules(prefill_tok_s="+10%")
    with pytest.raises(ValueError, match=r"ppl_delta_pct gets worse when it is higher: write '\+0.5'"):
        rules(ppl_delta_pct=-0.5)


def test_recipe_errors_name_the_key_and_what_is_allowed():
    with pytest.raises(RecipeError) as e:
        resolve("smollm2-135m-int8", ["validate.regression.prefil_tok_s=-10%", "validate.regression.ppl_delta_pct=abc",
                                      "validate.regression.top1_agreement={abs: 0.01, pct: 1}"])
    text = str(e.value)
    assert "unknown key 'validate.regression.prefil_tok_s'; did you mean 'validate.regression.prefill_tok_s'?" in text
    assert "validate.regression.ppl_delta_pct = 'abc'" in text and "expected a number like +0.5" in text
    assert "give exactly one of abs" in text
    assert len(e.value.problems) == 3            # all at once


def test_every_rule_names_a_metric_with_a_direction_and_a_source():
    cat = catalog()
    assert set(cat) == set(RegressionRules.model_fields)
    assert all(m.worse in ("higher", "lower") and m.kind in ("evaluation", "quantize", "stage", "bench")
               for m in cat.values())
    assert cat["prefill_tok_s"].key == "prefill_b4" and cat["ppl_delta_pct"].worse == "higher"


@pytest.mark.parametrize("metric, rule, base, value, passed", [
    ("ppl_delta_pct", RegressionRule(abs=0.5), 1.0, 1.5, True),      # exactly at the limit holds
    ("ppl_delta_pct", RegressionRule(abs=0.5), 1.0, 1.51, False),
    ("ppl_delta_pct", RegressionRule(abs=0.5), 1.0, -3.0, True),     # better never fails
    ("ppl_delta_pct", RegressionRule(pct=10), -2.0, -1.7, False),    # relative to the magnitude: 0.2 allowed
    ("ppl_delta_pct", RegressionRule(pct=10), 0.0, 0.001, False),    # nothing allowed from 0
    ("top1_agreement", RegressionRule(abs=0.01), 0.93, 0.921, True),
    ("top1_agreement", RegressionRule(abs=0.01), 0.93, 0.919, False),
    ("prefill_tok_s", RegressionRule(pct=10), 1000.0, 901.0, True),
    ("prefill_tok_s", RegressionRule(pct=10), 1000.0, 899.0, False),
    ("prefill_tok_s", RegressionRule(pct=10), 1000.0, 5000.0, True),
])
def test_compare(metric, rule, base, value, passed):
    b, t = make_run(n=1), make_run(n=2)
    b.id = 1
    g = compare(catalog()[metric], rule, value, b, base, t)
    assert g["passed"] is passed
    assert g["threshold"] == pytest.approx(base + rule.allowed(base) * (1 if catalog()[metric].worse == "higher" else -1))
    assert g["baseline"] == base and g["baseline_run"] == 1


def test_baseline_is_the_last_good_night_on_the_same_machine_class(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.record(make_run(ppl=1.0, n=1))
    h.record(make_run(ppl=3.0, n=2, status="failed"))                    # failed nights are no baseline
    h.record(make_run(ppl=0.1, n=3, machine_class="aarch64-asimddp"))   # nor another machine's
    tonight = make_run(ppl=1.4, n=4)
    gates, notes = evaluate_rules(h, rules(ppl_delta_pct=0.5, prefill_tok_s="-5%"), tonight, {"evaluation"})
    assert [(g["name"], g["baseline"], g["baseline_run"], g["passed"]) for g in gates] == [
        ("ppl_delta_pct", 1.0, 1, True)]
    assert notes == ["prefill_tok_s: checked when bench figures are added (forge history add-bench)"]
    other = make_run(ppl=9.0, n=5, machine_class="x86_64-new")
    gates, notes = evaluate_rules(h, rules(ppl_delta_pct=0.5), other, {"evaluation"})
    assert gates == [] and "no earlier good night of r on x86_64-new" in notes[0]


def test_stage_time_is_compared_with_the_last_good_night_that_built_the_stage(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.record(make_run(n=1))                                   # quantize built in 11 s
    hit = make_run(n=2)
    hit.stages[0] = dict(hit.stages[0], status="hit", duration_s=0.01)
    h.record(hit)                                             # a cache hit: not a timing baseline
    tonight = make_run(n=20)                                  # quantize built in 30 s
    gates, _ = evaluate_rules(h, rules(stage_s="+50%"), tonight, {"stage"})
    by = {g["name"]: g for g in gates}
    assert by["stage_s.quantize"]["baseline"] == 11.0 and by["stage_s.quantize"]["baseline_run"] == 1
    assert by["stage_s.quantize"]["passed"] is False and by["stage_s.evaluate"]["passed"] is True
    assert "stage_s.quantize = 30 vs 11" in by["stage_s.quantize"]["message"]


def test_regression_message_names_the_changed_components(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.record(make_run(ppl=1.0, n=1))
    tonight = make_run(ppl=2.0, n=2)
    tonight.stages[0] = dict(tonight.stages[0], key="z" * 64,
                             components={"stage": "quantize", "config": {"samples": 8}})
    tonight.machine = {"cpu_model": "test cpu", "tools": {"onnxruntime": "1.1"}}
    (g,), _ = evaluate_rules(h, rules(ppl_delta_pct=0.5), tonight, {"evaluation"})
    assert not g["passed"]
    assert "quantize.samples: 32 -> 8" in g["message"] and "tools.onnxruntime: 1.0 -> 1.1" in g["message"]
    assert "+1 (+100.0 %)" in g["message"]


def test_add_bench_attaches_figures_and_fails_a_slower_night(tmp_path, capsys):
    from rich.console import Console
    from pipeline.history.bench import add_bench
    from pipeline.report import write_reports
    h = History(tmp_path / "h.sqlite")
    key1, key2 = "1" * 64, "2" * 64
    for n, key in ((1, key1), (2, key2)):
        run = make_run(n=n, rules={"prefill_tok_s": "-10%"}, stages=[
            {"name": "build", "status": "built", "key": key, "duration_s": 1.0, "peak_rss_mb": 1.0, "message": "",
             "components": {"stage": "build", "config": {"level": n}}}])
        rep_dir = tmp_path / f"night{n}"
        write_reports({"recipe": "r", "target": "onnxruntime", "status": "passed", "wall_s": 1.0, "stages": []},
                      rep_dir)
        run.report_path = str(rep_dir / "report.json")
        h.record(run)

    def results(key, tok_s):
        path = tmp_path / "cache/entries" / key[:2] / key / "payload"
        return {"machine": {"cpu_model": "test"}, "settings": {"reps": 3}, "engines": {"int8": {
            "path": str(path), "prefill": {"4": {"tokens_per_s": tok_s}, "1": {"tokens_per_s": tok_s / 2}},
            "decode": {"1": {"tokens_per_s": 50.0}}, "ttft": {"median_s": 0.1}, "size_bytes": 10,
            "peak_rss_bytes": 20}}}

    con = Console(file=open("/dev/null", "w"))
    res1, res2 = tmp_path / "r1.json", tmp_path / "r2.json"
    # night 1 was built before night 2; bench ran on each night's engine
    res1.write_text(json.dumps(results(key1, 1000.0)))
    assert add_bench(h, res1, con, con) == 0
    assert h.get(1).bench["prefill_b4"] == 1000.0 and h.get(1).bench["decode_b1"] == 50.0
    res2.write_text(json.dumps(results(key2, 850.0)))
    assert add_bench(h, res2, con, con) == 1                    # -15 % > -10 %
    night2 = h.get(2)
    assert night2.status == "failed"
    g = next(g for g in night2.gates if g["name"] == "prefill_tok_s")
    assert g["baseline"] == 1000.0 and g["threshold"] == 900.0 and not g["passed"]
    assert "build.level: 1 -> 2" in g["message"]
    rep = json.loads((tmp_path / "night2/report.json").read_text())
    assert rep["status"] == "failed" and rep["stages"][-1]["name"] == "bench_regression"
    assert "prefill_tok_s = 850 vs 1000" in (tmp_path / "night2/junit.xml").read_text()


def test_add_bench_that_records_nothing_is_an_error(tmp_path, capsys):
    """bench figures of an engine no recorded night built (`Runner.build()` outside `forge build`, an engine copied
    by hand) attach nowhere: exit 1 naming the fix, not 0 as if the night had its figures."""
    import io

    from rich.console import Console
    from pipeline.history.bench import add_bench
    h = History(tmp_path / "h.sqlite")
    h.record(make_run(n=1, stages=[{"name": "build", "status": "built", "key": "1" * 64, "duration_s": 1.0,
                                    "peak_rss_mb": 1.0, "message": ""}]))
    res = tmp_path / "serve.json"
    res.write_text(json.dumps({"engines": {"int8": {"path": str(tmp_path / "entries/99" / ("9" * 64) / "payload")},
                                           "fp32": {"error": "forge build did not finish"}}}))
    buf = io.StringIO()
    con = Console(file=buf, width=300)
    assert add_bench(h, res, con, con) == 1
    out = " ".join(buf.getvalue().split())
    assert "no bench figures recorded" in out and "forge build RECIPE --report-dir out" in out, out
    assert h.get(1).bench in (None, {})
