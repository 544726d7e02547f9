"""Three synthetic nights through the real `forge build` CLI: a regression in the third fails the build
(exit 1) although every absolute gate passes; JUnit, `forge history diff` and the table say what changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import synthetic  # noqa: E402
from synthetic import forge, write_recipe  # noqa: E402


@pytest.fixture
def nightly_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FORGE_HISTORY", str(tmp_path / "history.sqlite"))
    monkeypatch.setenv("FORGE_PROGRESS", "0")
    (tmp_path / "recipes").mkdir()
    return tmp_path


def three_nights(d: Path, monkeypatch, capsys) -> list[tuple[int, str, str]]:
    recipe = write_recipe(d / "recipes")
    nights = []
    for i, extra in enumerate(([], [], ["--set", "quantize.calibration.samples=8"]), 1):
        nights.append(forge(monkeypatch, capsys, "build", recipe, "--report-dir", d / f"night{i}", *extra))
    return nights


def test_three_nights_regression_in_the_third(nightly_env, monkeypatch, capsys):
    d = nightly_env
    n1, n2, n3 = three_nights(d, monkeypatch, capsys)
    assert n1[0] == 0, n1[2]
    assert n2[0] == 0, n2[2]
    assert n3[0] == 1, n3[2]                        # the regression fails the build ...
    rep3 = json.loads((d / "night3/nightly-synthetic/report.json").read_text())
    stages = {s["name"]: s for s in rep3["stages"]}
    assert stages["validate"]["status"] == "built"  # ... although every absolute gate passed
    assert all(g["passed"] for g in stages["validate"]["metrics"]["gates"])
    assert stages["regression"]["status"] == "failed" and rep3["status"] == "failed"

    # night 1 had nothing to compare with; night 2 (all cache hits) held vs night 1
    rep1 = json.loads((d / "night1/nightly-synthetic/report.json").read_text())
    rep2 = json.loads((d / "night2/nightly-synthetic/report.json").read_text())
    assert {s["name"]: s["status"] for s in rep1["stages"]}["regression"] == "skipped"
    assert {s["name"]: s["status"] for s in rep2["stages"]} == {
        "quantize": "hit", "evaluate": "hit", "validate": "hit", "regression": "built"}
    assert [rep1["history"]["run"], rep2["history"]["run"], rep3["history"]["run"]] == [1, 2, 3]

    # the JUnit case says by how much and which key component changed
    suite = ET.parse(d / "night3/nightly-synthetic/junit.xml").getroot()
    case = next(c for c in suite.iter("testcase") if c.get("name") == "ppl_delta_pct"
                and c.get("classname").endswith(".regression"))
    fail = case.find("failure").text
    before, after = synthetic.numbers(32)["ppl_delta_pct"], synthetic.numbers(8)["ppl_delta_pct"]
    assert f"{after:.6g} vs {before:.6g}" in fail and f"{after - before:+.6g}" in fail
    assert "on the last good night #2" in fail and "allows +0.5" in fail
    assert "quantize.calibration.samples: 32 -> 8" in fail
    top1 = next(c for c in suite.iter("testcase") if c.get("name") == "top1_agreement"
                and c.get("classname").endswith(".regression"))
    assert top1.find("failure") is None             # -0.0075 is within -2 % of 0.9475
    assert int(suite.get("failures")) == 2          # the regression stage and its ppl_delta_pct case

    # forge history diff names the cause next to the metric change
    code, out, _ = forge(monkeypatch, capsys, "history", "diff", "nightly-synthetic~1", "nightly-synthetic")
    assert code == 0
    assert "#2 nightly-synthetic" in out and "#3 nightly-synthetic" in out
    assert "quantize.calibration.samples: 32 -> 8" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("ppl_delta_pct"))
    assert row.split()[1:4] == [f"{before:.4g}", f"{after:.4g}", f"{after - before:+.4g}"] and "worse" in row
    assert "regression: ppl_delta_pct" in out
    # one night: compared with the last good night before it
    code, out1, _ = forge(monkeypatch, capsys, "history", "diff", "3")
    assert code == 0 and out1.splitlines()[0].startswith("#2 ")

    # the table: one row per night, the third flagged
    code, out, _ = forge(monkeypatch, capsys, "history", "nightly-synthetic")
    assert code == 0
    rows = [line.strip("│ ").split("│") for line in out.splitlines() if line.startswith("│ #")]
    assert [(r[0].strip(), r[2].strip()) for r in rows] == [("#1", "passed"), ("#2", "passed"), ("#3", "failed")]
    notes = {line.split(":")[0]: line for line in out.splitlines() if line[:2] in ("#1", "#2", "#3")}
    assert "nothing changed" in notes["#2"] and "REGRESSION" not in notes["#2"]
    assert "quantize.calibration.samples: 32 -> 8" in notes["#3"] and "REGRESSION ppl_delta_pct" in notes["#3"]


def test_a_cached_night_does_not_hide_the_regression(nightly_env, monkeypatch, capsys):
    d = nightly_env
    three_nights(d, monkeypatch, capsys)
    recipe = d / "recipes/nightly-synthetic.yaml"
    code, _, err = forge(monkeypatch, capsys, "build", recipe, "--report-dir", d / "night4",
                         "--set", "quantize.calibration.samples=8")
    rep = json.loads((d / "night4/nightly-synthetic/report.json").read_text())
    assert [s["status"] for s in rep["stages"]] == ["hit", "hit", "hit", "failed"]
    assert code == 1 and "#2" in rep["stages"][-1]["message"]   # still compared with the last good night


def test_a_rule_change_reruns_no_stage(nightly_env, monkeypatch, capsys):
    d = nightly_env
    three_nights(d, monkeypatch, capsys)
    recipe = write_recipe(d / "recipes", validate={**synthetic.RECIPE["validate"],
                                                   "regression": {"ppl_delta_pct": "+1.0"}})
    code, _, _ = forge(monkeypatch, capsys, "build", recipe, "--report-dir", d / "night4",
                       "--set", "quantize.calibration.samples=8")
    rep = json.loads((d / "night4/nightly-synthetic/report.json").read_text())
    assert [s["status"] for s in rep["stages"]] == ["hit", "hit", "hit", "built"]
    assert code == 0


def test_nightly_example_calls_real_commands_and_options():
    """Every `forge ...` line of examples/nightly.yml parses against the CLI (no unknown command or option)."""
    import re
    import shlex

    import typer
    import yaml

    from pipeline.cli import app
    wf = yaml.safe_load((Path(__file__).parents[2] / "examples/nightly.yml").read_text())
    lines = [line.strip() for job in wf["jobs"].values() for step in job["steps"]
             for line in str(step.get("run", "")).replace("\\\n", " ").splitlines() if "bin/forge " in line]
    assert any("--summary-md \"$GITHUB_STEP_SUMMARY\"" in line for line in lines)
    assert any("history add-bench" in line for line in lines) and any("--html" in line for line in lines)
    cli = typer.main.get_command(app)
    for line in lines:
        line = re.sub(r"\$\{\{[^}]*\}\}", "X", line)            # ${{ matrix.recipe }} -> one word
        args = shlex.split(line.split("bin/forge ", 1)[1].split(" || ")[0].split(" > ")[0])
        cmd = cli.get_command(None, args[0])
        assert cmd is not None, f"{line}: no command {args[0]!r}"
        try:
            cmd.make_context(args[0], args[1:])
        except Exception as e:   # typer vendors click: its UsageError is not click's
            raise AssertionError(f"{line}: {e}") from None


@pytest.mark.parametrize("args, expect", [
    (["history", "diff", "99"], "no night #99"),
    (["history", "diff", "nope"], "no nights of recipe 'nope'"),
    (["history", "diff", "nightly-synthetic~5"], "has only 3 night(s)"),
    (["history", "nope"], "no nights of nope"),
    (["history", "--since", "yesterday"], "expected a duration like 7d"),
    (["history", "diff"], "usage: forge history diff A [B]"),
])
def test_history_bad_arguments_exit_2_with_the_fix(nightly_env, monkeypatch, capsys, args, expect):
    three_nights(nightly_env, monkeypatch, capsys)
    code, out, err = forge(monkeypatch, capsys, *args)
    assert code == 2 and expect in " ".join((out + err).split()) and "Traceback" not in err


def test_a_night_recorded_with_every_targets_section_diffs_only_its_own():
    """Nights recorded before issue 25 hold every target's build section; the diff reads the built target's."""
    from pipeline.history.diff import recipe_changes
    from pipeline.history.store import Run

    def night(build):
        return Run(None, "r", "h", "onnxruntime", "passed", "", "", 1.0, {"name": "r", "build": build}, "m", {})
    old = night({"target": "onnxruntime", "onnxruntime": {"opt_level": "extended"}, "tensorrt_llm": {"tp": 1}})
    new = night({"target": "onnxruntime", "onnxruntime": {"opt_level": "extended"}})
    assert recipe_changes(old, new) == []
    changed = night({"target": "onnxruntime", "onnxruntime": {"opt_level": "all"}})
    assert [c.path for c in recipe_changes(old, changed)] == ["build.onnxruntime.opt_level"]


def test_history_subcommands_take_options_before_or_after_their_name(nightly_env, monkeypatch, capsys, tmp_path):
    """`forge history` is a command group (show by default, diff, add-bench), not arguments parsed by hand: each
    subcommand has its own --help, and --history written before the subcommand's name still reaches it."""
    three_nights(nightly_env, monkeypatch, capsys)
    db = str(tmp_path / "history.sqlite")
    _, by_env, _ = forge(monkeypatch, capsys, "history", "diff", "3")
    monkeypatch.setenv("FORGE_HISTORY", str(tmp_path / "elsewhere.sqlite"))      # only --history can find it now
    for args in (["history", "--history", db, "diff", "3"], ["history", "diff", "3", "--history", db],
                 ["history", f"--history={db}", "diff", "3"]):
        code, out, err = forge(monkeypatch, capsys, *args)
        assert (code, out) == (0, by_env), (args, err)
    code, shown, _ = forge(monkeypatch, capsys, "history", "show", "nightly-synthetic", "--history", db)
    assert code == 0 and shown == forge(monkeypatch, capsys, "history", "--history", db, "nightly-synthetic")[1]
    assert "#3" in shown
    code, out, _ = forge(monkeypatch, capsys, "history", "diff", "--help")
    assert code == 0 and "RECIPE@good" in " ".join(out.split())
    code, out, err = forge(monkeypatch, capsys, "history", "add-bench", "--history", db)
    assert code == 2 and "usage: forge history add-bench" in " ".join((out + err).split())
