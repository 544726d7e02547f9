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
        return {"thresholds": r.validate_.thresholds.model_dump()}

    def run(self, ctx: StageContext) -> dict:
        m = json.loads((ctx.inputs[self.needs[0]] / "metrics.json").read_text())
        gates = check_gates(m, ctx.recipe.validate_.thresholds.model_dump(), self.skip)
        result = {"subject": m.get("subject", ""), "gates": gates, "passed": all(g["passed"] for g in gates)}
        if not result["passed"]:
            lines = [f"{g['name']} = {_shown(g['value'])} (needs {g['op']} {g['threshold']}, {g['key']})"
                     for g in gates if not g["passed"]]
            raise StageFailed(f"validation failed for {m.get('subject', '')}: " + "; ".join(lines), result)
        (ctx.out / "gates.json").write_text(json.dumps(result, indent=2))
        return result


class ValidateCheckpointStage(ValidateStage):
    """Gate the checkpoint's reference numerics on the recipe's thresholds."""
    name = "validate_checkpoint"
    needs = ("evaluate_checkpoint",)
    skip: set[str] = frozenset()
