"""Recipe loading: extends, --set, and every bad-recipe case gives a clear message (never a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import RecipeError
from pipeline.recipe import list_recipes, resolve

REPO = Path(__file__).resolve().parents[2]


def forge(*args, cwd=None):
    env = dict(os.environ, FORGE_PROGRESS="0", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=120)


def write(d: Path, name: str, text: str) -> Path:
    p = d / f"{name}.yaml"
    p.write_text(text)
    return p


def test_every_shipped_recipe_resolves():
    names = list_recipes()
    assert {"smollm2-135m-int8", "smollm2-135m-fp32", "smollm2-135m-int4", "qwen7b-int8", "qwen7b-fp16",
            "smollm2-135m-trtllm-tp3"} <= set(names)
    for n in names:
        assert len(resolve(n).hash) == 64


def test_extends_deep_merges_and_set_overrides(tmp_path):
    write(tmp_path, "base", "quantize: {method: ptq, algo: int8, calibration: {samples: 16, seq_len: 128}}\n")
    write(tmp_path, "child", "extends: base\nquantize: {calibration: {samples: 64}}\n")
    r = resolve("child", recipes_dir=tmp_path)
    assert (r.quantize.calibration.samples, r.quantize.calibration.seq_len, r.quantize.algo) == (64, 128, "int8")
    r2 = resolve("child", ["quantize.calibration.samples=8", "validate.thresholds.top1_agreement_min=0.9"],
                 recipes_dir=tmp_path)
    assert r2.quantize.calibration.samples == 8 and r2.validate_.thresholds.top1_agreement_min == 0.9
    assert r.hash != r2.hash


def test_all_errors_reported_at_once_with_key_and_did_you_mean(tmp_path):
    write(tmp_path, "bad", "quantize:\n  metod: ptq\n  algo: int9\nbuild:\n  target: onnxruntime\n"
                           "validate:\n  thresholds: {top1_agreement_min: 3}\n")
    with pytest.raises(RecipeError) as e:
        resolve("bad", recipes_dir=tmp_path)
    msgs = e.value.problems
    assert len(msgs) == 3
    text = "\n".join(msgs)
    assert "unknown key 'quantize.metod'" in text and "did you mean 'quantize.method'" in text
    assert "quantize.algo = 'int9'" in text and "int8_sq" in text
    assert "validate.thresholds.top1_agreement_min" in text
    assert all(str(tmp_path / "bad.yaml") in m for m in msgs)


def test_yaml_syntax_error_names_line(tmp_path):
    write(tmp_path, "syntax", "quantize:\n  method: ptq\n  algo: [int8\n")
    with pytest.raises(RecipeError, match=r"YAML syntax error at line \d+"):
        resolve("syntax", recipes_dir=tmp_path)


def test_extends_cycle_and_missing_parent(tmp_path):
    write(tmp_path, "a", "extends: b\n")
    write(tmp_path, "b", "extends: a\n")
    with pytest.raises(RecipeError, match="cycle"):
        resolve("a", recipes_dir=tmp_path)
    write(tmp_path, "orphan", "extends: nosuch\n")
    with pytest.raises(RecipeError, match="no recipe named 'nosuch'"):
        resolve("orphan", recipes_dir=tmp_path)


def test_cross_field_rules(tmp_path):
    write(tmp_path, "x", "quantize: {method: ptq, algo: int8_sq}\nbuild: {target: onnxruntime}\n")
    with pytest.raises(RecipeError, match="not available for build.target 'onnxruntime'"):
        resolve("x", recipes_dir=tmp_path)
    write(tmp_path, "y", "quantize: {method: qat, algo: int8}\n")
    with pytest.raises(RecipeError, match="quantize.method 'qat' needs build.target 'tensorrt_llm'"):
        resolve("y", recipes_dir=tmp_path)


@pytest.mark.parametrize("args, expect", [
    (["plan", "nosuchrecipe"], "no recipe named 'nosuchrecipe'"),
    (["plan", "smollm2-135m-int8", "--set", "quantize.calibraton.samples=3"], "did you mean 'quantize.calibration'"),
    (["plan", "smollm2-135m-int8", "--set", "build.target=gpu"], "build.target = 'gpu' is not allowed"),
    (["plan", "smollm2-135m-int8", "--set", "novalue"], "expected KEY.PATH=VALUE"),
    (["recipes", "resolve", "smollm2-135m-int8", "--set", "quantize.calibration.samples=-1"],
     "quantize.calibration.samples = -1"),
    (["build", "smollm2-135m-int8", "--from", "nosuchstage"], "no such stage"),
])
def test_cli_bad_input_gives_message_not_traceback(args, expect, tmp_path):
    # from an empty directory: a build that fails to resolve writes its "invalid" report into ./out, which in the
    # checkout was the user's last real report (bench reads it)
    p = forge(*args, cwd=tmp_path)
    assert p.returncode in (1, 2), p.stderr
    out = p.stdout + p.stderr
    assert expect in " ".join(out.split())
    assert "Traceback" not in out


def test_cli_resolve_prints_hash():
    p = forge("recipes", "resolve", "smollm2-135m-int8")
    assert p.returncode == 0, p.stderr
    assert f"# hash: {resolve('smollm2-135m-int8').hash}" in p.stdout


def test_ort_quantize_key_holds_calibration_only_for_the_algo_that_reads_it(tmp_path):
    """int8 calibrates (SmoothQuant ranges): a calibration change must rebuild it. int4_wo reads weights only: the
    same change must not (it once rebuilt INT4 for nothing, measured in the run history)."""
    from pipeline.recipe import resolve
    from pipeline.stages.onnxruntime import OrtQuantize
    q = OrtQuantize()
    for name, reads in (("smollm2-135m-int8", True), ("smollm2-135m-int4", False)):
        a, b = resolve(name), resolve(name, ["quantize.calibration.samples=16"])
        assert (q.config(a) != q.config(b)) is reads, name
        assert ("calibration" in q.config(a)) is reads, name
        if not reads:
            assert q.data(a, tmp_path) == {}
    # int4_wo's fitted methods read calibration (E[x^2] / E[x x^T]): their key holds it (issue 41)
    for method in ("fit", "gptq"):
        a = resolve("smollm2-135m-int4", [f"quantize.options.method={method}"])
        b = resolve("smollm2-135m-int4", [f"quantize.options.method={method}", "quantize.calibration.samples=16"])
        assert q.config(a) != q.config(b) and "calibration" in q.config(a), method
