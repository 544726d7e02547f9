"""Synthetic nights: a model-free quantize -> evaluate -> validate flow whose evaluation numbers follow the
recipe's calibration sample count, driven through the real `forge build` CLI (flow injected)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from pipeline.stages.base import Stage
from pipeline.stages.validate import ValidateStage

RECIPE = {
    "name": "nightly-synthetic",
    "description": "model-free flow for the run-history tests",
    "quantize": {"method": "ptq", "algo": "int8", "calibration": {"samples": 32}},
    "validate": {"thresholds": {"ppl_delta_pct_max": 5.0, "top1_agreement_min": 0.85},
                 "regression": {"ppl_delta_pct": "+0.5", "top1_agreement": "-2%"}},
}


def numbers(samples: int) -> dict:
    """What the fake evaluation measures for a calibration sample count (fewer samples: worse)."""
    return {"ppl_delta_pct": 0.5 + 8.0 / samples, "top1_agreement": 0.95 - 0.08 / samples,
            "logits_cosine": 0.999 - 0.004 / samples, "greedy_exact_match": 1.0 if samples >= 16 else 0.75}


class FakeQuantize(Stage):
    name = "quantize"
    tools = ("pyyaml",)

    def config(self, r):
        return {"algo": r.quantize.algo, "calibration": r.quantize.calibration.model_dump()}

    def run(self, ctx):
        (ctx.out / "model.bin").write_bytes(b"q" * 4096 * ctx.recipe.quantize.calibration.samples)
        return {"size_ratio": 0.25 + 1.0 / ctx.recipe.quantize.calibration.samples}


class FakeEvaluate(Stage):
    name = "evaluate"
    needs = ("quantize",)

    def config(self, r):
        return {"eval": [e.model_dump() for e in r.validate_.eval]}

    def run(self, ctx):
        m = {"subject": "synthetic engine", **numbers(ctx.recipe.quantize.calibration.samples)}
        (ctx.out / "metrics.json").write_text(json.dumps(m))
        return m


def flow(target: str = "onnxruntime"):
    return [FakeQuantize(), FakeEvaluate(), ValidateStage()]


def write_recipe(d: Path, **changes) -> Path:
    data = json.loads(json.dumps(RECIPE))
    data.update(changes)
    p = Path(d) / f"{data['name']}.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def forge(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run the forge CLI in this process with the synthetic flow; (exit code, stdout, stderr)."""
    import pipeline.runner
    from pipeline.cli import main
    monkeypatch.setattr(pipeline.runner, "flow_for", flow)
    monkeypatch.setattr(sys, "argv", ["forge", *map(str, args)])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    out, err = capsys.readouterr()
    return code, out, err
