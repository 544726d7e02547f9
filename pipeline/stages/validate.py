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


def check_gates(metrics: dict, thresholds: dict) -> list[dict]:
    out = []
    for metric, key, op in GATES:
        limit = thresholds.get(key)
        if limit is None:
            continue
        value = metrics.get(metric)
        ok = value is not None and math.isfinite(value) and (value <= limit if op == "<=" else value >= limit)
        out.append({"name": metric, "value": value, "op": op, "threshold": limit, "key": f"validate.thresholds.{key}",
                    "passed": bool(ok)})
    return out


class ValidateStage(Stage):
    name = "validate"
    version = "1"
    needs = ("evaluate",)
    description = "gate the evaluation on the recipe's thresholds"

    def config(self, r):
        return {"thresholds": r.validate_.thresholds.model_dump()}

    def run(self, ctx: StageContext) -> dict:
        m = json.loads((ctx.inputs[self.needs[0]] / "metrics.json").read_text())
        gates = check_gates(m, ctx.recipe.validate_.thresholds.model_dump())
        result = {"subject": m.get("subject", ""), "gates": gates, "passed": all(g["passed"] for g in gates)}
        if not result["passed"]:
            lines = [f"{g['name']} = {g['value']:.4g} (needs {g['op']} {g['threshold']}, {g['key']})"
                     for g in gates if not g["passed"]]
            raise StageFailed(f"validation failed for {m.get('subject', '')}: " + "; ".join(lines), result)
        (ctx.out / "gates.json").write_text(json.dumps(result, indent=2))
        return result


class ValidateCheckpointStage(ValidateStage):
    name = "validate_checkpoint"
    needs = ("evaluate_checkpoint",)
    description = "gate the checkpoint's reference numerics on the recipe's thresholds"
