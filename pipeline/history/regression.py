"""Regression rules (``validate.regression`` in a recipe): tonight vs the last good night of the same recipe.

Where the comparison runs, and why not as a cached stage
--------------------------------------------------------
It runs after the stage graph, on every `forge build` (``check`` below, called from the CLI once per
recipe), and is never cached. It is a pure function of tonight's numbers, the history's baseline and the
rules, and costs milliseconds, so a cache could only save nothing and hide something:

* a cached ``validate`` (or a fully cached night) cannot hide a regression: the check reads tonight's
  metrics from the stage results whether they were built or hit, and compares them with the baseline
  the history holds *now*. Night 2 regresses, night 3 changes nothing and is all cache hits: night 3 is
  compared with the last good night again and fails again, until the cause is fixed.
* a rule change re-runs no stage: the rules are in no stage's key (``validate`` keys only the absolute
  thresholds), so changing ``validate.regression`` costs one re-check. (The recipe hash does change,
  and with it ``package``, whose manifest embeds the resolved recipe.)
* as a stage, the baseline would have to enter its key (the history as a declared input), so every new
  good night would change the key of the stage after it, and ``package`` would be rebuilt each night
  for no change in the engine.

The verdict is reported like a stage: a ``regression`` entry in report.json / junit.xml whose cases
say by how much and which key components changed, and a failed verdict fails the build (exit 1). Bench
figures arrive after the build (``python -m bench.run``); ``forge history add-bench`` attaches them to
their nights and checks the bench rules the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..recipe import RegressionRule, RegressionRules
from .diff import brief, changes
from .store import History, HistoryUnavailable, Run

EVAL_STAGES = ("evaluate", "evaluate_checkpoint")   # the engine's evaluation, else the checkpoint's


@dataclass(frozen=True)
class MetricDef:
    name: str
    worse: str          # higher | lower
    kind: str           # evaluation | quantize | stage | bench
    key: str            # the metric's name where it is found
    description: str


def catalog() -> dict[str, MetricDef]:
    """The metrics a rule can name: the fields of ``RegressionRules`` (their one home, pipeline/recipe/schema.py)."""
    out = {}
    for name, f in RegressionRules.model_fields.items():
        extra = f.json_schema_extra
        kind, _, key = extra["source"].partition(":")
        out[name] = MetricDef(name, extra["worse"], kind, key, f.description or "")
    return out


def value_of(run: Run, m: MetricDef, stage: str | None = None) -> float | None:
    """The metric's value in a night (None where it was not measured)."""
    if m.kind == "evaluation":
        src = next((run.metrics[s] for s in EVAL_STAGES if s in run.metrics and m.key in run.metrics[s]), {})
        v = src.get(m.key)
    elif m.kind == "stage":
        st = run.stage(stage or "")
        v = st.get(m.key) if st and st["status"] == "built" else None
    elif m.kind == "bench":
        v = run.bench.get(m.key)
    else:
        v = (run.metrics.get(m.kind) or {}).get(m.key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def compare(m: MetricDef, rule: RegressionRule, value: float, base: Run, base_value: float,
            tonight: Run, stage: str | None = None) -> dict:
    """One rule's verdict as a gate dict (the shape validate's gates have, plus baseline and message)."""
    allowed = rule.allowed(base_value)
    sign = 1.0 if m.worse == "higher" else -1.0
    worse_by = sign * (value - base_value)
    passed = worse_by <= allowed + 1e-9 * max(1.0, abs(base_value))
    limit = base_value + sign * allowed
    name = f"{m.name}.{stage}" if stage else m.name
    change = value - base_value
    rel = f" ({change / abs(base_value) * 100:+.1f} %)" if base_value else ""
    msg = (f"{name} = {value:.6g} vs {base_value:.6g} on the last good night {base.label} ({base.finished}): "
           f"{change:+.6g}{rel}; validate.regression.{m.name} allows {rule.text(m.worse)}")
    if not passed:
        msg = f"regression: {msg}. What changed since {base.label}: {brief(changes(base, tonight))}"
    return {"name": name, "value": value, "op": "<=" if sign > 0 else ">=", "threshold": limit,
            "key": f"validate.regression.{m.name}", "passed": passed, "baseline": base_value,
            "baseline_run": base.id, "message": msg}


def evaluate_rules(history: History, rules: RegressionRules, tonight: Run, kinds: set[str]) -> tuple[list[dict], list[str]]:
    """(gates, notes) for the active rules whose metric kind is in ``kinds``."""
    cat = catalog()
    gates, notes = [], []
    base = history.last_good(tonight.recipe, tonight.machine_class, before=tonight.id)
    for name, rule in rules.active().items():
        m = cat[name]
        if m.kind not in kinds:
            if m.kind == "bench":
                notes.append(f"{name}: checked when bench figures are added (forge history add-bench)")
            continue
        if m.kind == "stage":
            built = [s["name"] for s in tonight.stages if s["status"] == "built" and s.get(m.key) is not None]
            if not built:
                notes.append(f"{name}: no stage was built tonight (all cached): nothing timed")
            for stage in built:
                b = history.last_good(tonight.recipe, tonight.machine_class, before=tonight.id, built_stage=stage)
                bv = value_of(b, m, stage) if b else None
                if bv is None:
                    notes.append(f"{name}.{stage}: no good night on {tonight.machine_class} built {stage} before")
                    continue
                gates.append(compare(m, rule, value_of(tonight, m, stage), b, bv, tonight, stage))
            continue
        b = (history.last_good(tonight.recipe, tonight.machine_class, before=tonight.id, with_bench=True)
             if m.kind == "bench" else base)
        v = value_of(tonight, m)
        bv = value_of(b, m) if b else None
        if v is None:
            notes.append(f"{name}: not measured tonight")
        elif b is None:
            notes.append(f"{name}: no earlier good night of {tonight.recipe} on {tonight.machine_class} to compare with")
        elif bv is None:
            notes.append(f"{name}: not measured on the last good night {b.label}")
        else:
            gates.append(compare(m, rule, v, b, bv, tonight))
    return gates, notes


def check(history: History | None, recipe, tonight: Run, unavailable: str = ""):
    """The ``regression`` verdict of a build as a StageResult, or None when the recipe has no rules.

    status failed: a rule was broken (exit 1); built: every comparable rule held; skipped: nothing to
    compare (no history, no earlier good night, nothing measured)."""
    from ..stage_walk import StageResult
    rules = recipe.validate_.regression
    if not rules.active():
        return None
    if history is None:
        return StageResult("regression", "skipped", message=f"run history unavailable{': ' + unavailable if unavailable else ''}; "
                                                             "regression rules not checked")
    try:
        gates, notes = evaluate_rules(history, rules, tonight, {"evaluation", "quantize", "stage"})
    except HistoryUnavailable as e:
        return StageResult("regression", "skipped", message=f"regression rules not checked: {e}")
    metrics = {"gates": gates, "notes": notes, "passed": all(g["passed"] for g in gates)}
    if not gates:
        return StageResult("regression", "skipped", metrics=metrics, message="; ".join(notes))
    bad = [g for g in gates if not g["passed"]]
    if bad:
        return StageResult("regression", "failed", metrics=metrics, message=" | ".join(g["message"] for g in bad))
    return StageResult("regression", "built", metrics=metrics,
                       message=f"{len(gates)} rule(s) held vs the last good night #{gates[0]['baseline_run']}")
