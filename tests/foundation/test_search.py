"""`forge search RECIPE` (issue 41, point 3): the target's candidate formats, each built through `forge build`'s code
path (cached), gated by the recipe's validate section, the passing ones measured, the fastest per metric named, and
`--apply` writing the winner as a recipe. Fast: the toy target of test_toy_target.py with candidates of its own and
a measure function in place of the bench (the real bench runs in tests/ort/test_search_real.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline import search as search_mod
from pipeline import targets
from pipeline.recipe import resolve
from pipeline.target_registry import Candidate
from test_toy_target import RUNS, TOY, ToyBuildStage, ToyQuantize, forge, recipe   # tests/foundation/


class AccelBuild(ToyBuildStage):
    """The toy's build stage, which cannot run here for a label the host has no accelerator for."""

    def missing(self, r):
        return "needs a toy accelerator (build.toy.label accel)" if r.build.toy.label == "accel" else None


class AnyQuantize(ToyQuantize):
    """The toy's quantize stage, which also takes algo none (the values as they are)."""

    def run(self, ctx):
        if ctx.recipe.quantize.algo != "none":
            return super().run(ctx)
        RUNS.append(self.name)
        (ctx.out / "values.json").write_text((ctx.inputs["export"] / "values.json").read_text())
        return {"step": None, "max_err": 0.0}


QUARTER = ("quantize.method=ptq", "quantize.algo=toy_round", "quantize.options={step: 0.25}")
CANDIDATES = (
    Candidate("exact", ("quantize.method=none", "quantize.algo=none", "quantize.options={}"), "nothing rounded"),
    Candidate("quarter", QUARTER, "rounded to 0.25"),
    Candidate("coarse", ("quantize.method=ptq", "quantize.algo=toy_round", "quantize.options={step: 2.0}"),
              "rounded to 2: misses the top-1 gate"),
    Candidate("accel", (*QUARTER, "build.toy.label=accel"), "needs an accelerator this host lacks"),
)
SEARCH_TOY = dataclasses.replace(TOY, candidates=CANDIDATES,
                                 flow=tuple({ToyBuildStage: AccelBuild, ToyQuantize: AnyQuantize}.get(s, s)
                                            for s in TOY.flow))

BASE = """\
description: toy base
build:
  target: toy
  toy: {width: 7, label: hello}
quantize: {method: none, algo: none}
validate:
  thresholds: {ppl_delta_pct_max: 10.0, top1_agreement_min: 0.7}
"""
SEARCHED = """\
extends: toy-base
description: toy searched
quantize: {method: ptq, algo: toy_round, options: {step: 0.25}}
"""
# what the fake bench says; coarse would be the fastest everywhere, but it fails its gates and is never measured
FIGURES = {"exact": {"prefill_b1": 100.0, "decode_b1": 30.0, "decode_b8": 200.0},
           "quarter": {"prefill_b1": 150.0, "decode_b1": 20.0, "decode_b8": 260.0},
           "coarse": {"prefill_b1": 999.0, "decode_b1": 999.0, "decode_b8": 999.0}}


@pytest.fixture
def toy(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FORGE_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("FORGE_CACHE", raising=False)
    targets.register(SEARCH_TOY)
    RUNS.clear()
    recipe(tmp_path, BASE, "toy-base")
    yield tmp_path
    targets.unregister("toy")


@pytest.fixture
def measured(monkeypatch):
    """The engines each search measured ({label: engine dir} per call), with FIGURES as the bench's answer."""
    calls: list[dict] = []

    def fake_bench(quick=True, reps=None, threads=None):
        def measure(engines, work):
            calls.append(dict(engines))
            return {"machine": {"cpu_model": "Test CPU", "usable_cpus": 2, "threads": 2}, "settings": {"reps": 1},
                    "engines": {n: FIGURES[n] for n in engines}}
        return measure
    monkeypatch.setattr(search_mod, "bench_measure", fake_bench)
    return calls


def _search(capsys, monkeypatch, toy, *args):
    p = recipe(toy, SEARCHED, "toy-search")
    code, out = forge(capsys, monkeypatch, "search", p, "--report-dir", toy / "out", *args)
    path = toy / "out" / "toy-search" / "search" / "search.json"
    return code, out, (json.loads(path.read_text()) if path.exists() else None)


def test_search_gates_measures_and_names_the_fastest_passing_candidate(toy, capsys, monkeypatch, measured):
    code, out, res = _search(capsys, monkeypatch, toy)
    assert code == 0, out
    rows = {c["name"]: c for c in res["candidates"]}
    assert [c["name"] for c in res["candidates"]] == ["exact", "quarter", "coarse", "accel"]
    assert {n: c["status"] for n, c in rows.items()} == {"exact": "passed", "quarter": "passed", "coarse": "failed",
                                                         "accel": "skipped"}
    # only the passing candidates were measured, once, each by its build stage's engine
    assert len(measured) == 1 and set(measured[0]) == {"exact", "quarter"}
    assert measured[0]["quarter"] == rows["quarter"]["engine"]
    assert res["winners"] == {"prefill": {"candidate": "quarter", "value": 150.0},
                              "decode": {"candidate": "exact", "value": 30.0},
                              "batch": {"candidate": "quarter", "value": 260.0}, "served": None}
    # the gate figures of each built candidate (toy: 4 of 7 values off by 1/12 at step 0.25, the values sum to 7)
    assert rows["exact"]["gates"]["ppl_delta_pct"] == 0.0 and rows["exact"]["gates"]["passed"] is True
    assert rows["quarter"]["gates"]["ppl_delta_pct"] == pytest.approx(100 * (4 / 12) / 7)
    assert rows["coarse"]["gates"]["top1_agreement"] < 0.7 and rows["coarse"]["speed"] == {}
    # step 2: [0, 0, 0, 2, 2, 2, 2] for [0, 1/3, ..., 2]: |error| 3 of a sum of 7, 4 of 7 round alike
    assert rows["coarse"]["reason"] == ("validate: ppl_delta_pct = 42.86 (needs <= 10.0, validate.thresholds."
                                        "ppl_delta_pct_max); top1_agreement = 0.5714 (needs >= 0.7, "
                                        "validate.thresholds.top1_agreement_min)")
    assert "validation failed for toy engine" in json.loads(Path(rows["coarse"]["report"]).read_text())[
        "stages"][5]["message"]
    assert rows["accel"]["reason"] == "cannot run here: build: needs a toy accelerator (build.toy.label accel)"
    assert rows["accel"]["stages"] == {} and rows["accel"]["engine"] is None     # nothing built for it
    # the candidate equal to the searched recipe keeps its name (the build `forge build toy-search` makes)
    assert rows["quarter"]["recipe"] == "toy-search" and rows["exact"]["recipe"] == "toy-search.exact"
    assert rows["quarter"]["recipe_hash"] == resolve(str(toy / "toy-search.yaml")).hash
    assert rows["exact"]["overrides"] == list(CANDIDATES[0].overrides)
    assert res["machine"]["isa_class"] and res["machine"]["cpu_model"] == "Test CPU"
    # the table on the terminal and search.md
    assert "fastest for prefill (prefill tok/s (1x256)): quarter 150.0" in out
    assert "fastest for decode (decode tok/s (batch 1)): exact 30.0" in out
    md = (toy / "out" / "toy-search" / "search" / "search.md").read_text()
    assert "| exact | passed | +0.00 | 1.000 | 100.0 | 30.0 | 200.0 | decode |" in md
    assert "| coarse | failed |" in md and "- decode (decode tok/s (batch 1)): **exact** 30.0" in md
    assert "served" not in md                # not measured without --serve: no column, no winner line
    assert f"ISA class {res['machine']['isa_class']}" in md
    # each candidate's own reports (forge build's), none of them a night in the run history
    rep = json.loads((toy / "out" / "toy-search" / "search" / "builds" / "toy-search.exact" / "report.json").read_text())
    assert rep["status"] == "passed" and "history" not in rep


def test_a_second_search_builds_nothing(toy, capsys, monkeypatch, measured):
    code, out, first = _search(capsys, monkeypatch, toy)
    assert code == 0, out
    # source and export once for all candidates; quantize..evaluate per built candidate; package for those passing
    assert RUNS.count("source") == 1 and RUNS.count("quantize") == 3 and RUNS.count("package") == 2
    RUNS.clear()
    code, out, second = _search(capsys, monkeypatch, toy)
    assert code == 0, out
    assert RUNS == []                   # every stage of every candidate a cache hit
    rows = {c["name"]: c for c in second["candidates"]}
    assert set(rows["exact"]["stages"].values()) == {"hit"} and len(rows["exact"]["stages"]) == 7
    assert rows["coarse"]["stages"]["evaluate"] == "hit" and rows["coarse"]["status"] == "failed"
    assert second["winners"] == first["winners"] and len(measured) == 2     # measured again: timings are not cached
    # and `forge build` of the searched recipe is the quarter candidate's build: nothing to do
    code, out = forge(capsys, monkeypatch, "build", toy / "toy-search.yaml", "--report-dir", toy / "b")
    assert code == 0 and RUNS == [], out


def test_serve_measures_each_passing_candidate_as_it_was_built(toy, capsys, monkeypatch, measured):
    served = []

    def fake_serve(levels=(1, 4), requests=8):
        def serve(recipe, sets, reports, work):
            served.append((recipe, sets, reports))
            name = sets[-1].removeprefix("name=") if sets[-1].startswith("name=") else recipe
            assert (reports / Path(name).stem / "report.json").is_file()      # what bench.serve reads
            return {"served_tok_s": 40.0 if "exact" in name else 55.0, "served_req_s": 1.0}
        return serve
    monkeypatch.setattr(search_mod, "serve_measure", fake_serve)
    dest = toy / "served.yaml"
    code, out, res = _search(capsys, monkeypatch, toy, "--serve", "--apply", dest, "--metric", "served")
    assert code == 0, out
    assert [s[1][-1] for s in served] == ["name=toy-search.exact", *QUARTER[-1:]]     # passing ones, as built
    assert res["winners"]["served"] == {"candidate": "quarter", "value": 55.0}
    assert "fastest for served (served output tok/s (tritonserver, HTTP)): quarter 55.0" in out
    assert "| served tok/s |" in (toy / "out" / "toy-search" / "search" / "search.md").read_text()
    assert "quarter (55.0)" in dest.read_text()


def test_a_failing_candidate_is_never_the_winner():
    rows = [search_mod.Row("fast", "", [], status=search_mod.FAILED, speed={"prefill_b1": 1e9, "decode_b1": 1e9}),
            search_mod.Row("slow", "", [], status=search_mod.PASSED, speed={"prefill_b1": 1.0, "decode_b1": 2.0}),
            search_mod.Row("gone", "", [], status=search_mod.SKIPPED, speed={"prefill_b1": 1e9})]
    assert search_mod.winners(rows) == {"prefill": {"candidate": "slow", "value": 1.0},
                                        "decode": {"candidate": "slow", "value": 2.0}, "batch": None,
                                        "served": None}
    assert search_mod.winners(rows[:1]) == {m: None for m in search_mod.METRICS}


def test_candidate_and_set_restrict_the_search(toy, capsys, monkeypatch, measured):
    code, out, res = _search(capsys, monkeypatch, toy, "--candidate", "coarse", "--candidate", "exact",
                             "--set", "build.toy.width=4")
    assert code == 0, out
    assert [c["name"] for c in res["candidates"]] == ["coarse", "exact"]
    assert res["overrides"] == ["build.toy.width=4"]
    assert RUNS.count("source") == 1 and RUNS.count("quantize") == 2
    # the candidate's overrides, then the user's --set, under the candidate's own name
    exact = resolve(str(toy / "toy-search.yaml"), [*CANDIDATES[0].overrides, "build.toy.width=4",
                                                   "name=toy-search.exact"])
    assert res["candidates"][1]["recipe_hash"] == exact.hash and exact.build.toy.width == 4
    assert res["winners"]["decode"]["candidate"] == "exact"


def test_only_failures_exit_1_and_no_bench_gates_only(toy, capsys, monkeypatch, measured):
    code, out, res = _search(capsys, monkeypatch, toy, "--candidate", "coarse")
    assert code == 1, out
    assert res["winners"] == {m: None for m in search_mod.METRICS} and measured == []
    code, out, res = _search(capsys, monkeypatch, toy, "--candidate", "accel")
    assert code == 3, out                # nothing could run here: incomplete
    code, out, res = _search(capsys, monkeypatch, toy, "--no-bench")
    assert code == 0, out
    assert measured == [] and res["bench"] == {"skipped": "--no-bench: gates only"}
    assert {c["name"]: c["status"] for c in res["candidates"]}["exact"] == "passed"


def test_apply_writes_a_recipe_that_resolves_to_the_winner(toy, capsys, monkeypatch, measured):
    # prefill: quarter, the searched recipe itself -> a child of it with nothing to add
    dest = toy / "recipes-out" / "fast-prefill.yaml"
    code, out, res = _search(capsys, monkeypatch, toy, "--apply", dest, "--metric", "prefill")
    assert code == 0, out
    assert f"wrote {dest} (extends ../toy-search.yaml)" in out
    text = dest.read_text()
    assert "extends: ../toy-search.yaml" in text and "for prefill tok/s (1x256): quarter (150.0)" in text
    won = resolve(str(dest)).to_dict()
    want = resolve(str(toy / "toy-search.yaml")).to_dict()
    for d in (won, want):
        d.pop("name"), d.pop("description")
    assert won == want
    # decode: exact, which has no quantize.options.step: toy-search sets one (an extends cannot unset it), so the
    # recipe extends toy-base, the nearest of toy-search's chain that does not, and adds what differs from it
    dest = toy / "toy-fast-decode.yaml"
    code, out, res = _search(capsys, monkeypatch, toy, "--apply", dest, "--metric", "decode", "--set",
                             "validate.thresholds.top1_agreement_min=0.75")
    assert code == 0, out
    text = dest.read_text()
    assert "extends: toy-base\n" in text and "top1_agreement_min: 0.75" in text
    r = resolve(str(dest))
    want = resolve(str(toy / "toy-search.yaml"), [*CANDIDATES[0].overrides,
                                                  "validate.thresholds.top1_agreement_min=0.75"])
    assert r.quantize.algo == "none" and r.quantize.options == {} and r.validate_.thresholds.top1_agreement_min == 0.75
    a, b = r.to_dict(), want.to_dict()
    for d in (a, b):
        d.pop("name"), d.pop("description")
    assert a == b
    assert r.name == "toy-fast-decode" and "forge search winner for decode: exact" in r.description


@pytest.mark.parametrize("args, code, message", [
    (["--candidate", "nope"], 2, "--candidate nope: not a candidate of build.target toy; choose from exact, quarter, "
                                 "coarse, accel"),
    (["--set", "quantize.options.stepp=1"], 2, "quantize.options.stepp"),
    (["--set", "build.toy.width=abc"], 2, "build.toy.width"),
    (["--metric", "speed"], 2, "--metric speed: choose prefill, decode, batch, served"),
    (["--metric", "served"], 2, "--metric served: served throughput is measured with --serve; add it"),
    (["--apply", "x.txt"], 2, "--apply x.txt: give a recipe file ending in .yaml"),
    (["--reps", "0"], 2, "--reps 0: give 1 or more"),
])
def test_bad_input_is_one_clear_line_and_exit_2(toy, capsys, monkeypatch, measured, args, code, message):
    got, out, res = _search(capsys, monkeypatch, toy, *args)
    assert got == code, out
    assert message in out
    assert RUNS == [] and res is None        # nothing built, nothing written


def test_unknown_recipe_and_a_target_without_candidates(toy, capsys, monkeypatch):
    code, out = forge(capsys, monkeypatch, "search", "smollm2-135m-int9")
    assert code == 2 and "no recipe named 'smollm2-135m-int9'" in out and "did you mean 'smollm2-135m-int8'" in out
    targets.register(TOY)       # the toy without candidates
    code, out = forge(capsys, monkeypatch, "search", recipe(toy, SEARCHED, "toy-search"))
    assert code == 2, out
    assert "build.target toy declares no search candidates (Target.candidates in pipeline/targets/toy.py)" in out


def test_the_table_cuts_no_name_at_80_columns(toy, capsys, monkeypatch, measured):
    from pipeline import cli
    p = recipe(toy, SEARCHED, "toy-search")
    monkeypatch.setattr(cli.console, "width", 80)
    monkeypatch.setattr("sys.argv", ["forge", "search", str(p), "--report-dir", str(toy / "out")])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for name, status in (("exact", "passed"), ("quarter", "passed"), ("coarse", "failed"), ("accel", "skipped")):
        assert any(f" {name} " in ln and f" {status} " in ln for ln in lines), name


# ------------------------------------------------------------------------------------- the onnxruntime candidates
def test_onnxruntime_candidates_resolve_on_its_cpu_recipes():
    t = targets.get("onnxruntime")
    names = [c.name for c in t.candidates]
    assert names == ["fp32", "int8", "int8-prompt-pt", "int8-per-token", "int8-mixed", "int4", "cuda-fp16", "cuda-int4"]
    for rn in ("smollm2-135m-fp32", "smollm2-135m-int8", "smollm2-135m-int4", "smollm2-135m-cuda-int4"):
        for c in t.candidates:
            r = resolve(rn, list(c.overrides))
            assert r.quantize.algo in t.quantizers
            assert (r.build.onnxruntime.provider == "cuda") == c.name.startswith("cuda-")
    # the int8 candidate of the default recipe is the default recipe: the search hits `make engine`'s build
    assert resolve("smollm2-135m-int8", list(next(c for c in t.candidates if c.name == "int8").overrides)).hash \
        == resolve("smollm2-135m-int8").hash
    fp32 = resolve("smollm2-135m-int8", list(t.candidates[0].overrides))
    assert (fp32.quantize.method, fp32.quantize.algo, fp32.quantize.options) == ("none", "none", {})
    assert fp32.validate_.thresholds == resolve("smollm2-135m-int8").validate_.thresholds    # the searched gates


def test_a_candidate_the_recipe_refuses_is_invalid_not_an_error(tmp_path, monkeypatch):
    """smollm2-135m-cuda-int8wo gates against its simulation, which FP32 has no grid for: that candidate is listed
    as invalid with the recipe's reason; the search goes on."""
    monkeypatch.setenv("FORGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FORGE_CACHE", raising=False)
    s = search_mod.Search("smollm2-135m-cuda-int8wo", [], tmp_path / "s", ["fp32"], None, None, None)
    res = s.run()
    (row,) = res["candidates"]
    assert row["status"] == "invalid" and "validate.reference: simulated" in row["reason"]
    assert "writes no weight-only grid to simulate" in row["reason"]
