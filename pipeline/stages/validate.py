"""validate: apply the recipe's thresholds to the evaluation; a miss fails the build with the numbers."""

from __future__ import annotations

import json
import math

from ..errors import StageFailed
from .base import Stage, StageContext

# metric -> (threshold key, comparison)
GATES = [
    ("ppl_delta_pct", "ppl_delta_pct_max", "<="),
    ("top1_agreement", "top1_agreement_min", ">="),
    ("logits_cosine", "logits_cosine_min", ">="),
    ("logits_max_abs", "logits_max_abs_max", "<="),
    ("greedy_exact_match", "greedy_match_min", ">="),
    ("simulated_ppl_gap", "simulated_ppl_gap_max", "<="),
]


# produced only by the checkpoint evaluation (its reference numerics vs the quantize stage's simulation)
CHECKPOINT_ONLY = {"simulated_ppl_gap"}


# also gated on each evaluation set alone (issue 28): a pooled figure can hide one genre that quantizes badly
PER_SET = ("ppl_delta_pct", "top1_agreement", "logits_cosine", "logits_max_abs")


def check_gates(metrics: dict, thresholds: dict, skip: set[str] = frozenset()) -> list[dict]:
    """Each threshold against the pooled metric and, for the ``PER_SET`` metrics, against every set of
    ``metrics["per_set"]`` (gate name ``metric[set/split]``)."""
    out = []
    scopes = [("", metrics)] + [(f"[{name}]", m) for name, m in sorted((metrics.get("per_set") or {}).items())]
    for metric, key, op in GATES:
        limit = thresholds.get(key)
        if limit is None or metric in skip:
            continue
        for scope, m in scopes:
            if scope and metric not in PER_SET:
                continue
            value = m.get(metric)
            ok = value is not None and math.isfinite(value) and (value <= limit if op == "<=" else value >= limit)
            out.append({"name": metric + scope, "value": value, "op": op, "threshold": limit,
                        "key": f"validate.thresholds.{key}", "passed": bool(ok)})
    return out


def _shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else "not produced by the evaluation"


class ValidateStage(Stage):
    """Gate the evaluation on the recipe's thresholds."""
    name = "validate"
    version = "2"   # 2: the thresholds gate every evaluation set alone too (per_set)
    needs = ("evaluate",)
    skip = CHECKPOINT_ONLY           # an engine's evaluation has no simulated perplexity to compare with

    def config(self, r):
        cfg = {"thresholds": r.validate_.thresholds.model_dump()}
        if r.validate_.fp32_thresholds is not None:    # only then: every other recipe keeps its key
            cfg["fp32_thresholds"] = r.validate_.fp32_thresholds.model_dump()
        return cfg

    def run(self, ctx: StageContext) -> dict:
        m = json.loads((ctx.inputs[self.needs[0]] / "metrics.json").read_text())
        v = ctx.recipe.validate_
        ref = (m.get("reference") or {}).get("kind", "fp32")
        gates = check_gates(m, v.thresholds.model_dump(), self.skip)
        if ref != "fp32":     # the thresholds gate the figures against the simulation: say so in every gate
            for g in gates:
                g["vs"] = ref
        if v.fp32_thresholds is not None and "fp32" in m:
            for g in check_gates(m["fp32"], v.fp32_thresholds.model_dump(), self.skip):
                gates.append({**g, "name": f"fp32:{g['name']}", "vs": "fp32",
                              "key": g["key"].replace("validate.thresholds.", "validate.fp32_thresholds.")})
        result = {"subject": m.get("subject", ""), "gates": gates, "passed": all(g["passed"] for g in gates)}
        if ref != "fp32":
            result["reference"] = ref
        if m.get("note"):
            result["note"] = m["note"]
        if not result["passed"]:
            vs = f" vs the {ref} reference" if ref != "fp32" else ""
            lines = [f"{g['name']} = {_shown(g['value'])} (needs {g['op']} {g['threshold']}, {g['key']})"
                     for g in gates if not g["passed"]]
            note = f" ({m['note']})" if m.get("note") else ""
            raise StageFailed(f"validation failed for {m.get('subject', '')}{vs}{note}: " + "; ".join(lines), result)
        (ctx.out / "gates.json").write_text(json.dumps(result, indent=2))
        return result


class ValidateCheckpointStage(ValidateStage):
    """Gate the checkpoint's reference numerics on the recipe's thresholds."""
    name = "validate_checkpoint"
    needs = ("evaluate_checkpoint",)
    skip: set[str] = frozenset()
