"""Every malformed input is a clean result: the documented exit code, a message naming the file or key, and
never a traceback (issue 12). Runs the CLI in-process (``pipeline.cli.main``), so 60+ cases take seconds;
``test_real_entry_point`` checks a few through ``python -m pipeline.cli`` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.recipe import RECIPES_DIR

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FORGE_PROGRESS", "0")
    monkeypatch.chdir(tmp_path)                # reports of `build` land under tmp_path/out


def run_cli(capsys, monkeypatch, *args) -> tuple[int, str]:
    """(exit code, stdout + stderr with whitespace collapsed) of one in-process `forge` command."""
    monkeypatch.setattr(sys, "argv", ["forge", *map(str, args)])
    monkeypatch.setattr(cli, "DEBUG", False)
    for c in (cli.console, cli.err):
        monkeypatch.setattr(c, "width", 400)
    with pytest.raises(SystemExit) as e:
        cli.main()
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text, text
    return e.value.code, " ".join(text.split())


def recipe(dir_: Path, text: str | bytes, name: str = "r") -> Path:
    """Bytes and text starting with "!" are written as they are; other text extends the default recipe."""
    p = dir_ / f"{name}.yaml"
    if isinstance(text, bytes):
        p.write_bytes(text)
    elif text.startswith("!"):
        p.write_text(text[1:])
    else:
        p.write_text(f"extends: {RECIPES_DIR / 'smollm2-135m-int8.yaml'}\n{text}")
    return p


def nested(depth: int) -> str:
    return "quantize:\n  options:\n" + "".join("  " * (i + 2) + f"k{i}:\n" for i in range(depth)) + \
        "  " * (depth + 2) + "x: 1\n"


# (recipe text, expected fragments). Text starting with "!" is written as is; otherwise it is appended to a
# valid recipe (extends the default), so exactly one thing is wrong.
FILE_CASES = {
    "not_utf8": (b"quantize:\n  algo: \xff\xfe\n", ["r.yaml", "not UTF-8 text"]),
    "binary": (bytes(range(256)), ["r.yaml", "binary file"]),
    "empty": (b"", ["r.yaml", "empty recipe file"]),
    "only_comments": (b"# nothing here\n\n# at all\n", ["r.yaml", "empty recipe file"]),
    "null_document": ("!~\n", ["r.yaml", "empty recipe file"]),
    "deep_flow": ("!a: " + "[" * 3000 + "\n", ["r.yaml", "nested"]),
    "deep_block": ("!" + nested(40), ["r.yaml", "nested more than 16 levels"]),
    "extends_empty": ('!extends: ""\n', ["r.yaml", "'extends' must name a recipe"]),
    "extends_number": ("!extends: 5\n", ["r.yaml", "'extends' must name a recipe"]),
    "extends_dir": ("!extends: sub/\n", ["sub/", "is a directory"]),
    "extends_missing": ("!extends: nosuch\n", ["no recipe named 'nosuch'"]),
    "extends_bad_name": ("!extends: bad name!\n", ["recipe name 'bad name!' is not valid"]),
    "syntax": ("!quantize:\n  algo: [int8\n", ["r.yaml", "YAML syntax error at line"]),
    "top_level_list": ("!- a\n- b\n", ["r.yaml", "must be a mapping of sections"]),
    "non_text_section": ("!1: 2\nquantize: {algo: int8}\n", ["r.yaml", "section names must be text"]),
    "dup_top": ("!quantize: {algo: int8}\nquantize: {algo: int4_wo}\n", ["duplicate key 'quantize' at line 2"]),
    "dup_nested": ("quantize:\n  calibration:\n    samples: 4\n    samples: 8\n",
                   ["duplicate key 'quantize.calibration.samples'"]),
    "dup_in_list": ("validate:\n  eval:\n    - {set: wiki, split: eval, set: austen, samples: 2, seq_len: 16}\n",
                    ["duplicate key 'validate.eval.0.set'"]),
    "too_big": ("!description: '" + "x" * 300_000 + "'\n", ["r.yaml", "at most 256 KiB"]),
    "too_many_values": ("!quantize:\n" + "".join(f"  k{i}: 1\n" for i in range(6000)), ["r.yaml", "at most 5000"]),
    "alias_bomb": ("!a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
                   "d: [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n", ["r.yaml", "aliases expanded"]),
    "threshold_negative": ("validate:\n  thresholds: {ppl_delta_pct_max: -1}\n",
                           ["validate.thresholds.ppl_delta_pct_max = -1: must be a number >= 0"]),
    "threshold_nan": ("validate:\n  thresholds: {ppl_delta_pct_max: .nan}\n",
                      ["validate.thresholds.ppl_delta_pct_max = nan: must be a number >= 0"]),
    "threshold_inf": ("validate:\n  thresholds: {top1_agreement_min: .inf}\n",
                      ["validate.thresholds.top1_agreement_min = inf: must be a number in [0, 1]"]),
    "samples_huge": ("quantize:\n  calibration: {samples: 10000000000000000000000000000000000000000}\n",
                     ["quantize.calibration.samples = 10000000000000000000000000000000000000000: must be an integer in (0, 4096]"]),
    "threads_huge": ("build:\n  onnxruntime: {intra_op_threads: 100000000000000000}\n",
                     ["build.onnxruntime.intra_op_threads = 100000000000000000: must be an integer in [0, 1024]"]),
    "seed_negative": ("quantize:\n  calibration: {seed: -1}\n", ["quantize.calibration.seed"]),
    "eval_empty": ("validate:\n  eval: []\n", ["validate.eval", "at least 1 item"]),
    "eval_unknown_set": ("validate:\n  eval: [{set: wikii, split: eval, samples: 2, seq_len: 16}]\n",
                         ["validate.eval.0", "'wikii' is not in calibration_data/manifest.yaml"]),
    "calib_unknown_split": ("quantize:\n  calibration: {split: calibb}\n",
                            ["quantize.calibration", "no split 'calibb'"]),
    "foreign_threshold": ("validate:\n  thresholds: {simulated_ppl_gap_max: 1.0}\n",
                          ["validate.thresholds.simulated_ppl_gap_max", "remove it for 'onnxruntime'"]),
    "bad_name_in_file": ("name: ../../etc\n", ["name = '../../etc' is not a valid recipe name"]),
    "gpu_ids_negative": ("package:\n  triton: {gpu_device_ids: [-1]}\n", ["package.triton.gpu_device_ids.0"]),
    "unknown_key": ("quantize:\n  calibraton: {samples: 3}\n", ["did you mean 'quantize.calibration'"]),
    "wrong_type": ("quantize:\n  calibration: 7\n", ["quantize.calibration = 7"]),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_malformed_recipe_file(case, tmp_path, capsys, monkeypatch):
    (tmp_path / "sub").mkdir()
    text, expect = FILE_CASES[case]
    p = recipe(tmp_path, text)
    code, out = run_cli(capsys, monkeypatch, "plan", p)
    assert code == 2, out
    for frag in expect:
        assert frag in out, out


# plan-time checks that need model facts (bundled config of SmolLM2: widths 576 / 1536)
@pytest.mark.parametrize("block, expect", [
    (48, "quantize.block_size: must be a power of two >= 16 (ONNX Runtime's MatMulNBits block sizes: 16, 32, 64, 128, 256), got 48"),
    (128, "quantize.block_size: 128 does not divide the input width of q/k/v_proj"),
])
def test_int4_block_size_checked_at_plan_time(block, expect, capsys, monkeypatch):
    code, out = run_cli(capsys, monkeypatch, "plan", "smollm2-135m-int4", "--set", f"quantize.block_size={block}")
    assert code == 2 and expect in out, out


OVERRIDE_CASES = {
    "negative_index": ("validate.eval.-1.samples=4", "'-1' is not a position in a list of 2"),
    "index_past_end": ("validate.eval.5.samples=4", "position 5 does not exist in a list of 2"),
    "empty_part": ("quantize..samples=4", "is not a key path"),
    "no_value": ("novalue", "expected KEY.PATH=VALUE"),
    "typo": ("quantize.calibraton.samples=3", "did you mean 'quantize.calibration'"),
    "into_scalar": ("quantize.algo.x=1", "quantize.algo"),
    "deep_value": ("quantize.calibration.samples=" + "[" * 5000, "quantize.calibration.samples"),
    "nan_value": ("validate.thresholds.top1_agreement_min=.nan", "validate.thresholds.top1_agreement_min"),
    "unknown_set": ("quantize.calibration.set=nosuch", "quantize.calibration: data set 'nosuch'"),
    "bad_name": ("name=a/b", "name = 'a/b' is not a valid recipe name"),
    "huge_int": ("validate.prompts.max_new_tokens=99999999999999999999", "validate.prompts.max_new_tokens"),
    "option_typo": ("quantize.options.smoothquant_alpah=0.3",
                    "unknown key; did you mean 'quantize.options.smoothquant_alpha'?"),
    "option_value": ("quantize.options.method=rtn", "quantize.options.method: 'rtn' is not allowed"),
    "option_type": ("quantize.options.per_channel=maybe", "quantize.options.per_channel: Input should be a valid boolean"),
    "option_bounds": ("quantize.options.smoothquant_alpha=1.5", "quantize.options.smoothquant_alpha: must be a number in [0, 1]"),
    "block_not_pow2": ("quantize.block_size=48", "quantize.block_size: must be a power of two >= 16"),
    "kv_cache_foreign": ("quantize.kv_cache=int8", "quantize.kv_cache: 'int8' is a tensorrt_llm setting"),
    "string_for_int": ("quantize.calibration.samples='64'", "quantize.calibration.samples = '64'"),
}


@pytest.mark.parametrize("case", sorted(OVERRIDE_CASES))
def test_malformed_override(case, capsys, monkeypatch):
    item, expect = OVERRIDE_CASES[case]
    code, out = run_cli(capsys, monkeypatch, "recipes", "resolve", "smollm2-135m-int8", "--set", item)
    assert code == 2, out
    assert expect in out, out


@pytest.mark.parametrize("recipe, item, expect", [
    ("smollm2-135m-fp32", "quantize.options.method=mixed", "quantize.options.method: unknown key (no key is allowed here)"),
    ("smollm2-135m-int4", "quantize.alpha=0.5", "quantize.alpha: not read by build.target 'onnxruntime' with algo "
                                               "'int4_wo' (read by: onnxruntime int8)"),
    ("smollm2-135m-int4", "quantize.options.block_size=64", "quantize.block_size: quantize.options.block_size says "
                                                           "the same; set one of them"),
    ("smollm2-135m-trtllm-tp3", "quantize.options.blockwise=[lm_head]", "quantize.options.blockwise: unknown key "
                                                                       "(allowed here: exclude)"),
    ("smollm2-135m-trtllm-tp3", "quantize.qat.lr=0.5", None),       # not QAT: the section is still checked
])
def test_options_schema_per_target_and_algo(recipe, item, expect, capsys, monkeypatch):
    code, out = run_cli(capsys, monkeypatch, "recipes", "resolve", recipe, "--set", item)
    assert code == 2, out
    assert (expect or "quantize.qat.lr = 0.5: must be a number in (0, 0.01]") in out, out


def test_recipe_name_never_leaves_recipes_dir(tmp_path, capsys, monkeypatch):
    (tmp_path / "evil.yaml").write_text("description: outside recipes/\n")
    name = os.path.relpath(tmp_path / "evil", RECIPES_DIR)     # recipes/<name>.yaml would be tmp_path/evil.yaml
    code, out = run_cli(capsys, monkeypatch, "recipes", "resolve", name)
    assert code == 2 and "no such recipe file" in out and "outside recipes/" not in out, out


ARG_CASES = {
    "build_unknown_recipe": (["build", "nosuchrecipe"], "no recipe named 'nosuchrecipe'"),
    "build_long_name": (["build", "x" * 5000], "(5000 characters)' is not valid"),
    "plan_long_name": (["plan", "y" * 5000], "is not valid"),
    "build_from": (["build", "smollm2-135m-int8", "--from", "nosuch"], "--from nosuch: no such stage"),
    "build_until": (["build", "smollm2-135m-int8", "--until", "nosuch"], "--until nosuch: no such stage"),
    "build_force": (["build", "smollm2-135m-int8", "--force", "nosuch"], "--force nosuch: no such stage"),
    "build_until_before_from": (["build", "smollm2-135m-int8", "--from", "build", "--until", "export"],
                                "--until export comes before --from build"),
    "build_bad_set": (["build", "smollm2-135m-int8", "--set", "validate.eval.-1.samples=4"], "is not a position"),
    "build_option_typo": (["build", "smollm2-135m-int8", "--set", "quantize.options.smoothquant_alpah=0.3"],
                          "quantize.options.smoothquant_alpah: unknown key; did you mean "
                          "'quantize.options.smoothquant_alpha'?"),
    "plan_force": (["plan", "smollm2-135m-int8", "--force", "nosuch"], "--force nosuch: no such stage"),
    "memory_gpu": (["memory", "smollm2-135m-trtllm-tp3", "--gpu", "gtx480"], "unknown GPU 'gtx480'"),
    "data_set": (["data", "fetch", "nosuch"], "unknown data set(s) 'nosuch'"),
    "verify_deploy_not_repo": (["verify-deploy", "/nonexistent/repo"], "no manifest.json here"),
    "serve_port": (["serve", "smollm2-135m-int8", "--port", "0"], "--port 0: must be in"),
    "gc_keep_unknown": (["cache", "gc", "--keep", "nosuchrecipe"], "--keep nosuchrecipe: no build of that recipe"),
    "unknown_option": (["plan", "smollm2-135m-int8", "--bogus"], "No such option: --bogus"),
    "missing_argument": (["build"], "Missing argument"),
    "show_directory": (["recipes", "show", "sub.yaml"], "is a directory"),
}


@pytest.mark.parametrize("case", sorted(ARG_CASES))
def test_bad_argument(case, tmp_path, capsys, monkeypatch):
    (tmp_path / "sub.yaml").mkdir()
    args, expect = ARG_CASES[case]
    code, out = run_cli(capsys, monkeypatch, *args)
    assert code == 2, out
    assert expect in out, out


def test_build_of_bad_recipes_writes_reports_and_summary(tmp_path, capsys, monkeypatch):
    bad = recipe(tmp_path, "validate:\n  thresholds: {ppl_delta_pct_max: -1}\n", "bad")
    code, out = run_cli(capsys, monkeypatch, "build", bad, "nosuchrecipe", "--keep-going", "--report-dir", "rep")
    assert code == 2, out
    assert json.loads((tmp_path / "rep" / "summary.json").read_text()) == {str(bad): "invalid",
                                                                           "nosuchrecipe": "invalid"}
    rep = json.loads((tmp_path / "rep" / "bad" / "report.json").read_text())
    assert rep["status"] == "invalid" and "ppl_delta_pct_max" in rep["problems"][0]
    assert "<failure" in (tmp_path / "rep" / "nosuchrecipe" / "junit.xml").read_text()


def test_cache_commands_survive_garbage(tmp_path, capsys, monkeypatch):
    from pipeline.cache import ArtifactCache
    c = ArtifactCache(tmp_path / "cache")
    entries = c.root / "entries"
    for key, meta in (("a" * 64, "{not json"), ("b" * 64, "[1, 2]"), ("c" * 64, '{"payload_digest": 5}'),
                      ("d" * 64, "\xff\xfe")):
        d = entries / key[:2] / key
        (d / "payload").mkdir(parents=True)
        (d / "meta.json").write_bytes(meta.encode("latin-1"))
    (entries / "ee").mkdir()
    (entries / "ee" / "stray-file").write_text("x")
    code, out = run_cli(capsys, monkeypatch, "cache", "verify")
    assert code == 1 and "5 corrupt entries" in out, out
    assert "meta.json unreadable" in out and "not a forge entry record" in out and "not an entry" in out
    code, out = run_cli(capsys, monkeypatch, "cache", "ls")
    assert code == 0 and "meta.json unreadable" in out, out
    assert c.get("a" * 64) is None                       # a lookup sets the garbled entry aside
    code, out = run_cli(capsys, monkeypatch, "cache", "gc")
    assert code == 0, out


def test_unexpected_error_is_one_line_and_debug_shows_traceback(capsys, monkeypatch):
    def boom():
        raise ZeroDivisionError("division by zero somewhere deep")
    monkeypatch.setattr("pipeline.recipe.list_recipes", lambda *a, **k: boom())
    code, out = run_cli(capsys, monkeypatch, "recipes", "list")
    assert code == 1 and "unexpected error: ZeroDivisionError" in out and "--debug" in out
    monkeypatch.setattr(sys, "argv", ["forge", "--debug", "recipes", "list"])
    with pytest.raises(SystemExit):
        cli.main()
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("args, code, expect", [
    (["build", "nosuchrecipe"], 2, "no recipe named"),
    (["plan", "smollm2-135m-int8", "--set", "validate.eval=[]"], 2, "validate.eval"),
    (["build", "smollm2-135m-int8", "--until", "nosuch"], 2, "no such stage"),
])
def test_real_entry_point(args, code, expect, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="300", FORGE_PROGRESS="0", FORGE_CACHE=str(tmp_path / "c"))
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == code and expect in out and "Traceback" not in out, out
