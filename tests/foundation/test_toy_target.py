"""A build target registered from this file alone (issues 25 and 39): its own build section, quantizer options, a
seven-stage flow (source -> export -> quantize -> build -> evaluate -> forge's own validate -> package, whose
manifest is forge's), CPU hardware, what its engine needs where it is deployed, and what `forge doctor` checks for
it. It is built end to end through the real CLI and Runner with a throw-away FORGE_HOME, and its package passes or
fails `forge verify-deploy` as its target says. Nothing outside this file knows it: that is the proof that a target
owns its facts (pipeline/target_registry.py, docs/architecture.md "Adding a build target")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

import pytest
from pydantic import BaseModel, ConfigDict, Field

from pipeline import targets
from pipeline.deploy import Deploy, finding, machine_problems
from pipeline.hardware import Hardware
from pipeline.recipe import Section
from pipeline.stages.base import Stage
from pipeline.stages.package import PackageStage
from pipeline.stages.validate import ValidateStage
from test_bad_input import run_cli      # tests/foundation/test_bad_input.py


class ToyBuild(Section):                      # build.toy
    width: int = Field(4, ge=1, le=64)
    label: str = "toy"
    lanes: int = Field(1, ge=1, le=4096, description="logical CPUs a host needs to serve the engine")


class ToyRoundOptions(BaseModel):             # quantize.options of algo toy_round
    model_config = ConfigDict(extra="forbid", strict=True)
    step: float = Field(0.5, gt=0, le=10)


class NoToyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


RUNS: list[str] = []                          # toy stage names in the order they ran (a cache hit does not run)


class ToyStage(Stage):
    def hardware(self, r):
        return Hardware.cpu("toy-cpu")


def _values(path) -> list[float]:
    return json.loads((path / "values.json").read_text())


def _write_values(ctx, values) -> None:
    (ctx.out / "values.json").write_text(json.dumps(values))


class ToySource(ToyStage):
    """The toy's model: ``width`` values, recorded as a source stage records one (source.json)."""
    name = "source"

    def config(self, r):
        return {"width": r.build.toy.width}

    def run(self, ctx):
        RUNS.append(self.name)
        values = [i / 3 for i in range(ctx.recipe.build.toy.width)]
        _write_values(ctx, values)
        digest = hashlib.sha256(json.dumps(values).encode()).hexdigest()
        (ctx.out / "source.json").write_text(json.dumps({"spec": "toy:thirds", "kind": "toy", "digest": digest}))
        return {"n": len(values)}


class ToyExport(ToyStage):
    name = "export"
    needs = ("source",)

    def run(self, ctx):
        RUNS.append(self.name)
        _write_values(ctx, _values(ctx.inputs["source"]))
        return {}


class ToyQuantize(ToyStage):
    name = "quantize"
    needs = ("export",)

    def config(self, r):
        return {"algo": r.quantize.algo, "options": r.quantize.options}

    def run(self, ctx):
        RUNS.append(self.name)
        opts = targets.get("toy").quantize_options(ctx.recipe.quantize)     # the typed model, defaults filled
        assert isinstance(opts, ToyRoundOptions)
        values = _values(ctx.inputs["export"])
        q = [round(v / opts.step) * opts.step for v in values]
        _write_values(ctx, q)
        return {"step": opts.step, "max_err": max(abs(a - b) for a, b in zip(values, q))}


class ToyBuildStage(ToyStage):
    name = "build"
    needs = ("quantize",)
    section = "build.toy"                    # its key: the whole build.toy section
    out_link = "engine"

    def run(self, ctx):
        RUNS.append(self.name)
        _write_values(ctx, _values(ctx.inputs["quantize"]))
        (ctx.out / "label.txt").write_text(ctx.recipe.build.toy.label)
        return {}


class ToyEvaluate(ToyStage):
    """The engine's values against the source's, in the metrics forge's validate stage gates."""
    name = "evaluate"
    needs = ("build", "source")

    def config(self, r):
        return {}

    def run(self, ctx):
        RUNS.append(self.name)
        ref, got = _values(ctx.inputs["source"]), _values(ctx.inputs["build"])
        metrics = {"subject": "toy engine",
                   "ppl_delta_pct": 100 * sum(abs(a - b) for a, b in zip(ref, got)) / sum(ref),
                   "top1_agreement": sum(round(a) == round(b) for a, b in zip(ref, got)) / len(ref)}
        (ctx.out / "metrics.json").write_text(json.dumps(metrics))
        return metrics


class ToyPackage(PackageStage):
    """forge's package stage (its manifest included): the toy writes only its repository."""

    def hardware(self, r):
        return Hardware.cpu("toy-cpu")

    def write_repository(self, ctx, evaluation):
        RUNS.append(self.name)
        model = ctx.out / "toy_model"
        (model / "1").mkdir(parents=True)
        (model / "1" / "values.json").write_text((ctx.inputs["build"] / "values.json").read_text())
        b = ctx.recipe.build.toy
        (model / "config.pbtxt").write_text(f'name: "toy_model"\nbackend: "python"\n# {b.label}\n')
        return None, "cpu", {"label": b.label, "lanes": b.lanes}


def toy_checks(r) -> list[str]:
    """A rule across sections, for recipes of this target only."""
    if r.quantize.algo == "toy_round" and r.build.toy.width < 2:
        return [f"build.toy.width = {r.build.toy.width}: toy_round needs at least 2 values"]
    return []


# ---- what the toy engine needs where it is deployed (pipeline/deploy.py), and what `forge doctor` checks for it
def toy_hardware(info, env) -> dict:
    return {"kind": "cpu", "machine": env["machine"], "lanes": info["build"]["lanes"]}


def toy_problems(m, env) -> list[str]:
    lanes, cpus = m["hardware"]["lanes"], env["logical_cpus"]
    return machine_problems(m, env) + ([f"the toy engine needs {lanes} logical CPUs, this host has {cpus}: serve it "
                                        f"on a larger host or rebuild with build.toy.lanes <= {cpus}"]
                                       if lanes > cpus else [])


def toy_doctor(facts) -> list[dict]:
    return [finding("info", f"toy target: {len(facts['recipes'])} shipped recipes build it",
                    "nothing to fix (tests/foundation/test_toy_target.py registers it)")]


TOY = targets.Target(name="toy", section=ToyBuild,
                     quantizers={"none": targets.Quantizer(NoToyOptions),
                                 "toy_round": targets.Quantizer(ToyRoundOptions)},
                     flow=(ToySource, ToyExport, ToyQuantize, ToyBuildStage, ToyEvaluate, ValidateStage, ToyPackage),
                     summary="a toy target (tests only)", checks=toy_checks,
                     deploy=Deploy(bound_tools=("pydantic",), hardware=toy_hardware, problems=toy_problems),
                     doctor=toy_doctor)
TOY_STAGES = ["source", "export", "quantize", "build", "evaluate", "package"]     # validate is forge's, not RUNS'


@pytest.fixture
def toy(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("FORGE_HOME", str(home))
    monkeypatch.delenv("FORGE_REMOTE_CACHE", raising=False)
    targets.register(TOY)
    RUNS.clear()
    yield tmp_path
    targets.unregister("toy")


forge = run_cli     # one in-process `forge` command: (exit code, output), no traceback


def recipe(d, text: str, name: str = "toy-recipe"):
    p = d / f"{name}.yaml"
    p.write_text(text)
    return p


TOY_RECIPE = """\
build:
  target: toy
  toy: {width: 7, label: hello}
quantize:
  algo: toy_round
  options: {step: 0.25}
validate:
  thresholds: {ppl_delta_pct_max: 10.0, top1_agreement_min: 0.7}
"""


def test_a_toy_target_builds_end_to_end_and_hits_the_cache_on_rerun(toy, capsys, monkeypatch):
    p = recipe(toy, TOY_RECIPE)
    reports = toy / "out"
    code, out = forge(capsys, monkeypatch, "build", p, "--report-dir", reports)
    assert code == 0, out
    assert RUNS == TOY_STAGES
    report = json.loads((reports / "toy-recipe" / "report.json").read_text())
    assert report["target"] == "toy"
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["source", "export", "quantize", "build", "evaluate", "validate", "package"]
    assert stages["quantize"]["metrics"]["step"] == 0.25          # the option as written, typed
    assert stages["quantize"]["metrics"]["max_err"] == pytest.approx(1 / 12)   # 1/3 rounded to 0.25 steps
    # forge's validate gated the toy's metrics: 4 of 7 values off by 1/12, sum of the values 7
    gates = {g["name"]: g for g in stages["validate"]["metrics"]["gates"]}
    assert gates["ppl_delta_pct"]["value"] == pytest.approx(100 * (4 / 12) / 7) and gates["ppl_delta_pct"]["passed"]
    assert gates["top1_agreement"]["value"] == 1.0
    repo = reports / "toy-recipe" / "triton_repo"
    assert json.loads((repo / "toy_model" / "1" / "values.json").read_text()) == [0.0, 0.25, 0.75, 1.0, 1.25, 1.75, 2.0]
    assert len(list((toy / "home").rglob("values.json"))) == 5     # the cache is the throw-away FORGE_HOME's

    # forge's manifest, with what the toy target says its engine is bound to and needs
    m = json.loads((repo / "manifest.json").read_text())
    assert m["engine"] == "toy" and m["target"] == "cpu" and m["build"] == {"label": "hello", "lanes": 1}
    assert m["hardware"]["kind"] == "cpu" and m["hardware"]["lanes"] == 1
    assert m["tools"]["pydantic"] == __import__("pydantic").VERSION       # the toy's bound tool, recorded
    assert m["model"] == {"source": "toy:thirds", "kind": "toy", "digest": m["model"]["digest"]}
    assert set(m["files"]) == {"toy_model/config.pbtxt", "toy_model/1/values.json"}
    code, out = forge(capsys, monkeypatch, "verify-deploy", repo)
    assert code == 0, out
    assert "manifest matches this environment" in out

    RUNS.clear()
    code, out = forge(capsys, monkeypatch, "build", p, "--report-dir", reports)
    assert code == 0, out
    assert RUNS == []                                               # every stage a cache hit
    assert [s["status"] for s in json.loads((reports / "toy-recipe" / "report.json").read_text())["stages"]] \
        == ["hit"] * 7

    # an option the key reads: what follows quantize rebuilds, the rest hits
    code, out = forge(capsys, monkeypatch, "build", p, "--set", "quantize.options.step=0.5", "--report-dir", reports)
    assert code == 0, out
    assert RUNS == ["quantize", "build", "evaluate", "package"]


def test_the_toy_target_decides_where_its_package_deploys(toy, capsys, monkeypatch):
    """verify-deploy asks the toy target: its bound tool's version, and the CPUs its engine needs."""
    import os

    from pipeline.triton.manifest import current_env, verify_deploy
    p = recipe(toy, TOY_RECIPE)
    reports = toy / "out"
    repo = reports / "toy-recipe" / "triton_repo"
    lanes = (os.cpu_count() or 1) + 1
    code, out = forge(capsys, monkeypatch, "build", p, "--set", f"build.toy.lanes={lanes}", "--report-dir", reports)
    assert code == 0, out
    code, out = forge(capsys, monkeypatch, "verify-deploy", repo)
    assert code == 1, out
    assert (f"the toy engine needs {lanes} logical CPUs, this host has {os.cpu_count()}: serve it on a larger host "
            f"or rebuild with build.toy.lanes <= {os.cpu_count()}") in out
    assert verify_deploy(repo, {**current_env(), "logical_cpus": lanes}) == []
    other = {**current_env(), "logical_cpus": lanes}
    other["tools"] = {**other["tools"], "pydantic": "1.0"}
    assert verify_deploy(repo, other) == [
        f"pydantic 1.0 here, but the engine was built with pydantic {__import__('pydantic').VERSION} (engines are bound "
        "to the exact version); rebuild the engine with pydantic 1.0 (`forge build toy-recipe --force build`) or "
        f"deploy with pydantic=={__import__('pydantic').VERSION}"]
    # only build (its section changed, its bytes did not) and package (the recipe it records) ran again
    RUNS.clear()
    code, out = forge(capsys, monkeypatch, "build", p, "--report-dir", reports)
    assert code == 0, out
    assert RUNS == ["build", "package"]
    code, out = forge(capsys, monkeypatch, "verify-deploy", repo)
    assert code == 0, out


def test_a_toy_engine_that_misses_its_gates_is_not_packaged(toy, capsys, monkeypatch):
    p = recipe(toy, TOY_RECIPE)
    code, out = forge(capsys, monkeypatch, "build", p, "--set", "quantize.options.step=2.0", "--report-dir",
                      toy / "out")
    assert code == 1, out
    assert "validation failed for toy engine" in out and "validate.thresholds.top1_agreement_min" in out
    assert RUNS == ["source", "export", "quantize", "build", "evaluate"]


def test_forge_doctor_asks_the_toy_target(toy):
    from pipeline.doctor import run_doctor
    from pipeline.recipe import resolve
    r = resolve(str(recipe(toy, TOY_RECIPE)))
    rep = run_doctor(object(), host={}, versions={}, smi_topo=None, ort_cuda={"problem": None}, quantizations={},
                     recipes=[r])
    assert {"severity": "info", "message": "toy target: 1 shipped recipes build it",
            "fix": "nothing to fix (tests/foundation/test_toy_target.py registers it)"} in rep["findings"]


def test_the_option_default_is_the_models(toy, capsys, monkeypatch):
    p = recipe(toy, TOY_RECIPE.replace("  options: {step: 0.25}\n", ""))
    code, out = forge(capsys, monkeypatch, "build", p, "--report-dir", toy / "out")
    assert code == 0, out
    report = json.loads((toy / "out" / "toy-recipe" / "report.json").read_text())
    assert {s["name"]: s for s in report["stages"]}["quantize"]["metrics"]["step"] == 0.5


@pytest.mark.parametrize("text, expect", [
    # another target's section, set by this recipe: refused naming the target that reads it
    (TOY_RECIPE.replace("  toy: {width: 7, label: hello}\n",
                        "  toy: {width: 7, label: hello}\n  tensorrt_llm: {tp: 4}\n"),
     ["build.tensorrt_llm: read only by build.target 'tensorrt_llm'; this recipe builds build.target 'toy'"]),
    # the toy section in a recipe of a built-in target: refused naming the toy target
    ("build:\n  target: onnxruntime\n  toy: {width: 9}\nquantize: {method: none}\n",
     ["build.toy: read only by build.target 'toy'; this recipe builds build.target 'onnxruntime'"]),
    # the toy section's own schema, with did-you-mean
    (TOY_RECIPE.replace("width: 7", "widht: 7"), ["unknown key 'build.toy.widht'; did you mean 'build.toy.width'?"]),
    (TOY_RECIPE.replace("width: 7", "width: 99"), ["build.toy.width = 99: must be an integer in [1, 64]"]),
    # the toy quantizer's options, and its algos
    (TOY_RECIPE.replace("step: 0.25", "stpe: 0.25"),
     ["quantize.options.stpe: unknown key; did you mean 'quantize.options.step'? (allowed here: step)"]),
    (TOY_RECIPE.replace("algo: toy_round", "algo: int8"),
     ["quantize.algo: 'int8' is not available for build.target 'toy' (allowed: none, toy_round)"]),
    # the target's own cross-section rule
    (TOY_RECIPE.replace("width: 7", "width: 1"), ["build.toy.width = 1: toy_round needs at least 2 values"]),
    # a threshold only another target's stages produce
    (TOY_RECIPE.replace("top1_agreement_min: 0.7}", "top1_agreement_min: 0.7, simulated_ppl_gap_max: 1.0}"),
     ["validate.thresholds.simulated_ppl_gap_max gates a metric only build.target tensorrt_llm produces; remove it "
      "for 'toy'"]),
    # an unknown target: the message lists the registered ones, the toy included
    (TOY_RECIPE.replace("target: toy", "target: toyy"),
     ["build.target = 'toyy' is not allowed: Input should be 'onnxruntime', 'tensorrt_llm', 'tensorrt' or 'toy'"]),
])
def test_bad_toy_recipes_are_refused_with_exit_2(toy, capsys, monkeypatch, text, expect):
    code, out = forge(capsys, monkeypatch, "plan", recipe(toy, text))
    assert code == 2, out
    for frag in expect:
        assert frag in out, out
    assert RUNS == []


def test_a_built_in_recipe_does_not_see_the_toy_target_once_it_is_gone(toy, capsys, monkeypatch):
    targets.unregister("toy")
    code, out = forge(capsys, monkeypatch, "plan", recipe(toy, TOY_RECIPE))
    assert code == 2, out
    assert "build.target = 'toy' is not allowed: Input should be 'onnxruntime', 'tensorrt_llm' or 'tensorrt'" in out
    assert "unknown key 'build.toy'" in out


def test_the_toy_stages_hardware_is_in_their_keys(toy):
    from pipeline.recipe import resolve
    from pipeline.runner import Runner
    r = resolve(str(recipe(toy, TOY_RECIPE)))
    hw = targets.get("toy").hardware(r)
    assert hw == {**{s: "cpu:toy-cpu" for s in TOY_STAGES}, "validate": "any"}
    assert all(not h.on_gpu for h in hw.values())
    plan = Runner(r).plan()
    assert [p.name for p in plan] == ["source", "export", "quantize", "build", "evaluate", "validate", "package"]
    assert plan[0].components["hardware"] == "cpu:toy-cpu"
    assert plan[0].components["config"] == {"width": 7}
    assert ToyBuildStage().config(r) == {"width": 7, "label": "hello", "lanes": 1}     # the whole build.toy section


def test_registry_errors_name_the_registered_targets(toy):
    from pipeline.stages import flow_for
    with pytest.raises(KeyError, match="unknown build.target 'nope' .targets: onnxruntime, tensorrt_llm, tensorrt, toy"):
        flow_for("nope")
    with pytest.raises(ValueError, match="must be an identifier"):
        targets.register(targets.Target(name="to-y", section=ToyBuild, quantizers=TOY.quantizers, flow=TOY.flow))
    with pytest.raises(ValueError, match="must include 'none'"):
        targets.register(targets.Target(name="toy2", section=ToyBuild, quantizers={}, flow=TOY.flow))
    assert targets.names()[-1] == "toy" and "toy_round" in targets.quantization_algos()


def test_the_schema_imports_no_target_code_until_it_is_asked():
    """pipeline/recipe/ sits below the targets: importing it loads the registry only; the built-in targets (and the stages
    they import) load the first time the registry is read."""
    import subprocess
    code = ("import sys, pipeline.recipe as r; before = 'pipeline.stages' in sys.modules; "
            "r.resolve('smollm2-135m-int8'); print(before, 'pipeline.targets.onnxruntime' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


class _EntryPoint:                                 # what importlib.metadata gives for an installed plug-in
    def __init__(self, name, load):
        self.name, self.value, self.load = name, f"toy_plugin:{name}", load


def test_installed_plug_ins_register_through_entry_points(monkeypatch):
    from pipeline.errors import ForgeError
    from pipeline import target_registry as registry
    groups = []

    def plugin_load():
        targets.register(dataclasses.replace(TOY, name="toy_plugin"))

    def entry_points(group):
        groups.append(group)
        return [_EntryPoint("toy_plugin", plugin_load)]
    monkeypatch.setattr(registry, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_loaded", False)
    try:
        assert "toy_plugin" in targets.names() and groups == ["forge.targets"]
    finally:
        targets.unregister("toy_plugin")

    def broken():
        raise ImportError("No module named 'toy_plugin'")
    monkeypatch.setattr(registry, "entry_points", lambda group: [_EntryPoint("toy_broken", broken)])
    monkeypatch.setattr(registry, "_loaded", False)
    with pytest.raises(ForgeError, match=r"build-target plug-in 'toy_broken' \(entry point forge.targets: "
                                         r"toy_plugin:toy_broken\) failed to load: ImportError: .*fix or uninstall"):
        targets.names()


def test_registering_a_target_changes_no_shipped_recipe():
    """Issue 25: a recipe's resolved form (its hash, its package key, what report.json / plan --json / a package's
    manifest record) holds build.target and the section of the target it builds, not every registered target's
    defaults, so installing a plug-in changes no other recipe's hash."""
    from pipeline.recipe import list_recipes, resolve

    def facts():
        return {n: (r.hash, r.package_hash, r.to_dict()["build"]) for n in list_recipes() for r in [resolve(n)]}
    before = facts()
    targets.register(TOY)
    try:
        after = facts()
    finally:
        targets.unregister("toy")
    assert after == before
    for n, (_, _, build) in before.items():
        assert set(build) == {"target", build["target"]}, (n, build)     # no other target's section


def test_another_targets_section_defaults_are_not_in_a_recipes_hash():
    from pipeline.recipe import resolve
    trtllm = targets.get("tensorrt_llm")

    class NewDefault(trtllm.section):                      # a new default of build.tensorrt_llm, set by no recipe
        multiple_profiles: bool = True
    ort, llm = resolve("smollm2-135m-int8"), resolve("smollm2-135m-trtllm-tp3")
    targets.register(dataclasses.replace(trtllm, section=NewDefault))
    try:
        r = resolve("smollm2-135m-int8")
        assert (r.hash, r.package_hash) == (ort.hash, ort.package_hash)          # the section it does not build
        assert r.build.tensorrt_llm.multiple_profiles is True                     # still readable, with defaults
        assert resolve("smollm2-135m-trtllm-tp3").hash != llm.hash                # the control: its own section
    finally:
        targets.register(trtllm)
    assert resolve("smollm2-135m-trtllm-tp3").hash == llm.hash
