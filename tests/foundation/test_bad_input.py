"""Every malformed input is a clean result: the documented exit code, a message naming the file or key, and
never a traceback (issue 12). Runs the CLI in-process (``pipeline.cli.main``), so 60+ cases take seconds;
``test_real_entry_point`` checks a few through ``python -m pipeline.cli`` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.recipe import RECIPES_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/forge_cli.py
from forge_cli import run_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FORGE_PROGRESS", "0")
    monkeypatch.chdir(tmp_path)                # reports of `build` land under tmp_path/out


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


def _laughs(levels: int, width: int) -> str:
    lines = [f"l0: &l0 [{','.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _merge_bomb(levels: int, width: int) -> str:
    """Each mapping merges the previous one ``width`` times (``<<: [*m, *m, ...]``): PyYAML's merge flattening copies
    every merged key list, so building it would take width^levels steps."""
    lines = ["m0: &m0 {a: 1, b: 2}"]
    lines += [f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * width)}], k{i}: 1}}" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text, expect", [
    (_laughs(10, 10), "values (aliases expanded); a recipe has at most 5000"),
    (_merge_bomb(7, 10), "values (aliases expanded); a recipe has at most 5000"),
    (_merge_bomb(60, 2), "nested more than 16 levels"),
], ids=["billion_laughs", "merge_key_bomb", "deep_merge_chain"])
def test_yaml_bombs_are_refused_fast(text, expect, tmp_path, capsys, monkeypatch):
    """10^10 values once aliases are expanded, 10^6 through merge keys, a 60-deep merge chain: refused by counting
    the composed document, never by building it, and in seconds."""
    p = recipe(tmp_path, "!" + text)
    t0 = time.perf_counter()
    code, out = run_cli(capsys, monkeypatch, "plan", p)
    assert code == 2 and "r.yaml" in out and expect in out, out
    assert time.perf_counter() - t0 < 10, "a YAML bomb must be refused in seconds"


# plan-time checks that need model facts (bundled config of SmolLM2: widths 576 / 1536)
@pytest.mark.parametrize("block, expect", [
    (48, "quantize.block_size: must be a power of two >= 16 (ONNX Runtime's MatMulNBits block sizes: 16, 32, 64, 128, 256), got 48"),
    (128, "quantize.block_size: 128 does not divide the input width of q/k/v_proj"),
])
def test_int4_block_size_checked_at_plan_time(block, expect, capsys, monkeypatch):
    code, out = run_cli(capsys, monkeypatch, "plan", "smollm2-135m-int4", "--set", f"quantize.block_size={block}")
    assert code == 2 and expect in out, out


OVERRIDE_CASES = {
    "negative_index": ("validate.eval.-1.samples=4", "'-1' is not a position in a list of 4 (use 0 to 3)"),
    "index_past_end": ("validate.eval.5.samples=4", "position 5 does not exist in a list of 4 (use 0 to 3)"),
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
    "control_char": ("description=bell\x07", "--set 'description=bell\\x07': invisible or control character U+0007"),
    "bidi_in_key": ("quantize.calibration.sam\u202eples=4", "invisible or control character U+202E"),
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
                                               "'int4_wo' (read by: onnxruntime int8, as quantize.options.smoothquant_alpha)"),
    # one spelling per option (issue 25): the block size is quantize.block_size for every target
    ("smollm2-135m-int4", "quantize.options.block_size=64", "quantize.options.block_size: build.target 'onnxruntime' "
     "reads this as quantize.block_size (one spelling per option); did you mean 'quantize.block_size'?"),
    ("smollm2-135m-int8", "quantize.options.block_size=64", "did you mean 'quantize.block_size'?"),
    ("smollm2-135m-trtllm-tp3", "quantize.options.block_size=64", "quantize.options.block_size: build.target "
     "'tensorrt_llm' reads this as quantize.block_size (one spelling per option)"),
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


def test_long_recipe_arguments_are_whole_in_the_summary(tmp_path, capsys, monkeypatch):
    """Two bad names of 200 characters that differ only at the end: each keeps its own whole entry in summary.json
    (a name cut for the screen once merged them into one key, "...")."""
    a, b = "n" * 199 + "a", "n" * 199 + "b"
    code, out = run_cli(capsys, monkeypatch, "build", a, b, "--keep-going", "--report-dir", "rep")
    assert code == 2, out
    assert json.loads((tmp_path / "rep" / "summary.json").read_text()) == {a: "invalid", b: "invalid"}


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


# Issue 24: more hostile recipes. Each exits 2, names the file and the key (or the line), and shows no traceback.
# Recipe text is appended to a valid recipe (line 1 is its `extends:`), so a key on the first line is at line 2.
HOSTILE_CASES = {
    "control_bell": ('description: "bell\x07"\n', ["r.yaml", "U+0007", "line 2", "key 'description'"]),
    "control_escape_sequence": ('description: "\x1b[31mred"\n', ["r.yaml", "U+001B", "key 'description'"]),
    "control_nel": ("description: a\x85b\n", ["r.yaml", "U+0085", "key 'description'"]),
    "control_in_nested_key": ("quantize:\n  calibration:\n    samples: 4\x08\n",
                              ["r.yaml", "U+0008", "line 4", "key 'quantize.calibration.samples'"]),
    "zero_width_space_in_key": ("quan\u200btize:\n  algo: int8\n", ["r.yaml", "U+200B", "ZERO WIDTH SPACE"]),
    "zero_width_joiner_in_value": ("description: a\u200db\n", ["r.yaml", "U+200D", "key 'description'"]),
    "word_joiner": ("description: a\u2060b\n", ["r.yaml", "U+2060", "key 'description'"]),
    "bidi_override": ('name: "abc\u202edef"\n', ["r.yaml", "U+202E", "RIGHT-TO-LEFT OVERRIDE", "key 'name'"]),
    "bidi_isolate": ("build:\n  onnxruntime:\n    opt_level: basic\u2066\n",
                     ["r.yaml", "U+2066", "key 'build.onnxruntime.opt_level'"]),
    "soft_hyphen_in_key": ("validate:\n  thresh\u00adolds: {top1_agreement_min: 0.5}\n", ["r.yaml", "U+00AD", "line 3"]),
    "line_separator": ("description: a\u2028b\n", ["r.yaml", "U+2028", "key 'description'"]),
    "bom_in_the_middle": ("description: a\ufeffb\n", ["r.yaml", "U+FEFF", "key 'description'"]),
    "noncharacter": ("description: a\ufffeb\n", ["r.yaml", "character U+FFFE at line 2 (key 'description'): YAML "
                                                "does not allow it"]),
    "latin1_bytes": (b"description: caf\xe9\n", ["r.yaml", "not UTF-8 text (byte 0xe9 at offset 16, line 1, key 'description')"]),
    "utf16_file": ("description: x\n".encode("utf-16"), ["r.yaml", "binary file"]),
    "python_tag": ("!x: !!python/object/apply:os.system ['true']\n", ["r.yaml", "python/object/apply:os.system"]),
    "recursive_anchor": ("!quantize: &a {options: *a}\n", ["r.yaml", "nested more than 16 levels"]),
    "huge_anchor_aliased": ("!big: &a '" + "x" * 200_000 + "'\ndescription: *a\n", ["r.yaml", "unknown key 'big'"]),
    "two_documents": ("!description: a\n---\ndescription: b\n", ["r.yaml", "YAML syntax error"]),
    "tab_indent": ("!quantize:\n\talgo: int8\n", ["r.yaml", "YAML syntax error at line 2"]),
    "dup_option": ("quantize:\n  options:\n    smoothquant_alpha: 0.5\n    smoothquant_alpha: 0.6\n",
                   ["r.yaml", "duplicate key 'quantize.options.smoothquant_alpha'"]),
    "bool_for_int": ("quantize:\n  calibration: {samples: true}\n", ["r.yaml", "quantize.calibration.samples = True"]),
    "string_for_float": ("validate:\n  thresholds: {ppl_delta_pct_max: '5'}\n",
                         ["r.yaml", "validate.thresholds.ppl_delta_pct_max = '5'"]),
    "list_for_section": ("validate: [1, 2]\n", ["r.yaml", "validate = [1, 2]"]),
    "null_section": ("quantize: null\n", ["r.yaml", "quantize = None"]),
    "inf_samples": ("quantize:\n  calibration: {samples: .inf}\n", ["r.yaml", "quantize.calibration.samples = inf"]),
    "minus_inf_threshold": ("validate:\n  thresholds: {ppl_delta_pct_max: -.inf}\n",
                            ["r.yaml", "validate.thresholds.ppl_delta_pct_max = -inf"]),
    "nan_option": ("quantize:\n  options: {smoothquant_alpha: .nan}\n", ["r.yaml", "quantize.options.smoothquant_alpha"]),
    "yes_as_section_name": ("!yes: 1\n", ["r.yaml", "section names must be text, got True"]),
    "int_key_nested": ("quantize:\n  1: 2\n", ["r.yaml", "quantize.1"]),
    "long_key": ("quantize:\n  " + "k" * 5000 + ": 1\n", ["r.yaml", "YAML syntax error at line 3, column 5003 (key 'quantize.kkkk"]),
    "long_name": ("name: " + "a" * 1000 + "\n", ["r.yaml", "name = 'aaaa", "at most 128 characters"]),
    "foreign_build_section": ("build:\n  tensorrt_llm: {tp: 4}\n  tensorrt: {workspace_gib: 64}\n",
                              ["r.yaml", "build.tensorrt_llm: read only by build.target 'tensorrt_llm'",
                               "build.tensorrt: read only by build.target 'tensorrt'"]),
    "alpha_second_spelling": ("quantize:\n  alpha: 0.5\n",
                              ["r.yaml", "quantize.alpha: build.target 'onnxruntime' reads this as "
                               "quantize.options.smoothquant_alpha", "did you mean 'quantize.options.smoothquant_alpha'?"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CASES))
def test_hostile_recipe_file(case, tmp_path, capsys, monkeypatch):
    text, expect = HOSTILE_CASES[case]
    p = recipe(tmp_path, text)
    code, out = run_cli(capsys, monkeypatch, "plan", p)
    assert code == 2, out
    assert "unexpected error" not in out, out
    for frag in expect:
        assert frag in out, out


def test_a_leading_byte_order_mark_is_accepted(tmp_path, capsys, monkeypatch):
    p = recipe(tmp_path, f"\ufeffextends: {RECIPES_DIR / 'smollm2-135m-int8.yaml'}\n"
                         "description: saved by an editor that writes a BOM\n".encode())
    code, out = run_cli(capsys, monkeypatch, "recipes", "resolve", p)
    assert code == 0 and "description: saved by an editor" in out, out


def _special_files(tmp_path: Path) -> dict[str, Path]:
    """A recipe path that is no regular file: symlink loops, a dangling link, a FIFO, a device, a directory."""
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "nowhere.yaml")
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "dir.yaml").mkdir()
    return {"loop": tmp_path / "loop.yaml", "two_link_loop": tmp_path / "a.yaml",
            "dangling": tmp_path / "dangling.yaml", "fifo": tmp_path / "fifo.yaml", "device": Path("/dev/zero"),
            "directory": tmp_path / "dir.yaml"}


SPECIAL_EXPECT = {"loop": "leads to no file", "two_link_loop": "leads to no file", "dangling": "leads to no file",
                  "fifo": "not a regular file", "device": "not a regular file", "directory": "is a directory"}


@pytest.mark.parametrize("kind", sorted(SPECIAL_EXPECT))
def test_recipe_that_is_no_regular_file(kind, tmp_path, capsys, monkeypatch):
    """Given directly, and named by `extends:` (the message then names the extending file and the key)."""
    path = _special_files(tmp_path)[kind]
    code, out = run_cli(capsys, monkeypatch, "plan", path)       # a FIFO must not hang the command
    assert code == 2 and str(path) in out and SPECIAL_EXPECT[kind] in out, out
    child = recipe(tmp_path, f"!extends: {path}\n", "child")
    code, out = run_cli(capsys, monkeypatch, "plan", child)
    assert code == 2 and f"{child}: extends: {path}" in out and SPECIAL_EXPECT[kind] in out, out


def test_extends_a_directory_names_the_file_and_the_key(tmp_path, capsys, monkeypatch):
    (tmp_path / "sub").mkdir()
    p = recipe(tmp_path, "!extends: sub/\n")
    code, out = run_cli(capsys, monkeypatch, "plan", p)
    assert code == 2 and f"{p}: extends: sub/: is a directory" in out, out


@pytest.mark.parametrize("recipe_name, item, expect", [
    ("smollm2-135m-int8", "build.tensorrt_llm.tp=4", "build.tensorrt_llm: read only by build.target 'tensorrt_llm'"),
    ("smollm2-135m-trt-int8", "build.tensorrt_llm.tp=2", "build.tensorrt_llm: read only by build.target 'tensorrt_llm'"),
    ("smollm2-135m-trtllm-tp3", "build.tensorrt.gpu_sm=90", "build.tensorrt: read only by build.target 'tensorrt'"),
    ("smollm2-135m-trt-int8", "quantize.alpha=0.3", "did you mean 'quantize.options.smoothquant_alpha'?"),
    ("smollm2-135m-trtllm-tp3", "quantize.options.smoothquant_alpha=0.3", "quantize.options.smoothquant_alpha: "
     "build.target 'tensorrt_llm' reads this as quantize.alpha (one spelling per option); did you mean 'quantize.alpha'?"),
])
def test_one_target_one_section_one_spelling(recipe_name, item, expect, capsys, monkeypatch):
    code, out = run_cli(capsys, monkeypatch, "recipes", "resolve", recipe_name, "--set", item)
    assert code == 2 and expect in out, out


def test_inherited_sections_of_another_target_are_not_refused(capsys, monkeypatch):
    """smollm2-135m-trt-int8 extends the onnxruntime FP32 recipe (its build.onnxruntime section) and names
    build.target tensorrt: the parent's section is dropped, not refused (pipeline/recipe/extends.py retarget)."""
    code, out = run_cli(capsys, monkeypatch, "recipes", "resolve", "smollm2-135m-trt-int8")
    assert code == 0 and "onnxruntime:" not in out, out


FP32 = RECIPES_DIR / "smollm2-135m-fp32.yaml"
LLM = f"!extends: {FP32}\nbuild:\n  target: tensorrt_llm\n  tensorrt_llm: {{max_input_len: 777, tp: 3}}\n"


@pytest.mark.parametrize("files, code, expect, absent", [
    # a child that names another build.target: the parent's section of its target is dropped, not inherited
    ({"llm": LLM, "r": "!extends: llm.yaml\nbuild: {target: onnxruntime}\n"}, 0, ["target: onnxruntime"],
     ["tensorrt_llm", "777"]),
    # ... and so is it for the child's children, even one that names the grandparent's target again: a child
    # extends what its parent resolves to (the grandchild gets build.tensorrt_llm's defaults)
    ({"llm": LLM, "ort": "!extends: llm.yaml\nbuild: {target: onnxruntime}\n", "r": "!extends: ort.yaml\n"}, 0,
     ["target: onnxruntime"], ["tensorrt_llm", "777"]),
    ({"llm": LLM, "ort": "!extends: llm.yaml\nbuild: {target: onnxruntime}\n",
      "r": "!extends: ort.yaml\nbuild: {target: tensorrt_llm}\n"}, 0, ["tensorrt_llm:", "max_input_len: 1024"],
     ["777"]),
    # a child that keeps the target inherits the section
    ({"llm": LLM, "r": "!extends: llm.yaml\ndescription: same target\n"}, 0, ["max_input_len: 777"], []),
    # a child that names another target and sets the old one's section itself: refused, naming the child
    ({"llm": LLM, "r": "!extends: llm.yaml\nbuild:\n  target: onnxruntime\n  tensorrt_llm: {tp: 2}\n"}, 2,
     ["r.yaml: build.tensorrt_llm: read only by build.target 'tensorrt_llm'; this recipe builds build.target "
      "'onnxruntime', which ignores it: remove build.tensorrt_llm"], []),
    # a foreign section no switch of target explains (the parent wrote it for a target it does not build):
    # refused in the child naming the key, the file it came from and the fix; through a grandchild too
    ({"bad": f"!extends: {FP32}\nbuild:\n  tensorrt_llm: {{max_input_len: 777}}\n",
      "r": "!extends: bad.yaml\ndescription: a child\n"}, 2,
     ["r.yaml: build.tensorrt_llm.max_input_len: inherited from ", "bad.yaml (extends), read only by build.target "
      "'tensorrt_llm'; this recipe builds build.target 'onnxruntime', which ignores it: remove build.tensorrt_llm "
      "from ", "bad.yaml, or set build.target: tensorrt_llm in "], []),
    ({"bad": f"!extends: {FP32}\nbuild:\n  tensorrt_llm: {{max_input_len: 777}}\n",
      "mid": "!extends: bad.yaml\n", "r": "!extends: mid.yaml\ndescription: a grandchild\n"}, 2,
     ["r.yaml: build.tensorrt_llm.max_input_len: inherited from ", "bad.yaml (extends)"], ["mid.yaml (extends)"]),
    # ... whose fix works: a base file's section, for the children that name its target
    ({"bad": f"!extends: {FP32}\nbuild:\n  tensorrt_llm: {{max_input_len: 777}}\n",
      "r": "!extends: bad.yaml\nbuild: {target: tensorrt_llm}\n"}, 0, ["max_input_len: 777"], []),
], ids=["child_switches", "grandchild_of_a_switch", "grandchild_switches_back", "child_keeps", "child_sets_it",
        "inherited_unexplained", "inherited_through_a_grandchild", "base_for_its_target"])
def test_extends_and_build_target(files, code, expect, absent, tmp_path, capsys, monkeypatch):
    """Issue 25, the extends hole: a child that names another build.target does not carry its parent's section of
    the old target (accepted and ignored); a section no target switch explains is refused (exit 2)."""
    for name, text in files.items():
        recipe(tmp_path, text, name)
    got, out = run_cli(capsys, monkeypatch, "recipes", "resolve", tmp_path / "r.yaml")
    assert got == code, out
    for frag in expect:
        assert frag in out, out
    for frag in absent:
        assert frag not in out, out


def test_a_set_of_build_target_drops_the_inherited_section(tmp_path, capsys, monkeypatch):
    from pipeline.recipe import resolve
    recipe(tmp_path, LLM, "llm")
    child = recipe(tmp_path, "!extends: llm.yaml\ndescription: inherits build.tensorrt_llm\n", "r")
    r = resolve(str(child), ["build.target=onnxruntime"])
    assert r.build.tensorrt_llm.max_input_len == 1024 and "tensorrt_llm" not in r.to_dict()["build"]
    assert r.hash == resolve(str(recipe(tmp_path, f"!extends: {FP32}\ndescription: inherits build.tensorrt_llm\n",
                                        "same"))).model_copy(update={"name": "r"}).hash
    # the file's own section still is refused: it is this recipe's text that the --set makes ignored
    code, out = run_cli(capsys, monkeypatch, "recipes", "resolve", tmp_path / "llm.yaml", "--set", "build.target=onnxruntime")
    assert code == 2 and "llm.yaml (or --set): build.tensorrt_llm: read only by build.target 'tensorrt_llm'" in out, out


@pytest.mark.parametrize("make_arg, shown", [
    (lambda d: recipe(d, "", name="a\x1b[31mred"), "a\\x1b[31mred.yaml"),             # a file that exists
    (lambda d: d / "gone\x07.yaml", "gone\\x07.yaml"),                                # a bell, no such file
    (lambda d: recipe(d, "!extends: smollm2-135m-int8\n", name="rtl\u202egnp"), "rtl\\u202egnp"),  # bidi override
    (lambda d: recipe(d, "!extends: nosuch\n", name="e\x1b]0;owned\x07"), "e\\x1b]0;owned\\x07"),  # a title escape
], ids=["esc_in_existing_file", "bell_in_missing_file", "bidi_override", "osc_title_sequence"])
def test_control_characters_in_a_path_are_shown_escaped(make_arg, shown, tmp_path, capsys, monkeypatch):
    """A file name is user input too: a terminal must never receive its escape sequences (colours, a window title,
    reordered text), and the name is still recognisable in the message."""
    code, out = run_cli(capsys, monkeypatch, "plan", make_arg(tmp_path))
    assert not any(c in out for c in "\x1b\x07\u202e"), ascii(out)
    assert shown in out, ascii(out)


@pytest.mark.parametrize("recipe_name, override, expect", [
    # the onnxruntime target's own rule (Target.checks, pipeline/targets/onnxruntime.py)
    ("smollm2-135m-int8", "build.onnxruntime.precision=fp16",
     "build.onnxruntime.precision = 'fp16' needs build.onnxruntime.provider: cuda"),
    # a recipe of another target: the schema refuses the section, naming the target that reads it
    ("smollm2-135m-trt-int8", "build.onnxruntime.provider=cuda",
     "build.onnxruntime: read only by build.target 'onnxruntime'; this recipe builds build.target 'tensorrt'"),
])
def test_provider_rules_are_the_onnxruntime_targets(recipe_name, override, expect, capsys, monkeypatch):
    code, out = run_cli(capsys, monkeypatch, "recipes", "resolve", recipe_name, "--set", override)
    assert code == 2 and expect in out, out
    assert out.startswith("recipe error: "), out        # one refusal, not one per rule that reads the section
