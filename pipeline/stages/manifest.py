"""What a package's manifest.json records: lineage a deployment can check before it loads an engine."""

from __future__ import annotations

import json
import platform

from .. import __version__
from .base import tool_version
from .common import set_digests

MANIFEST_TOOLS = ("torch", "transformers", "nvidia-modelopt", "onnx", "onnxruntime", "tensorrt", "tensorrt_llm",
                  "tensorrt-llm")


def manifest_info(ctx, *, target: str, evaluation: dict, build: dict | None = None) -> dict:
    r = ctx.recipe
    source = json.loads((ctx.inputs["source"] / "source.json").read_text())
    q = r.quantize
    calib = set_digests(r, [(q.calibration.set, q.calibration.split)]) if q.algo != "none" else {}
    evals = set_digests(r, [(e.set, e.split) for e in r.validate_.eval])
    return {
        "forge_version": __version__,
        "recipe": {"name": r.name, "hash": r.hash, "resolved": r.to_dict()},
        "model": {"source": source["spec"], "kind": source["kind"], "digest": source["digest"]},
        "calibration": {"config": q.calibration.model_dump(), "digests": calib} if calib else None,
        "evaluation_data": evals,
        "tools": {t: tool_version(t) for t in MANIFEST_TOOLS if tool_version(t) != "absent"} | {
            "python": platform.python_version()},
        "target": target,
        "build": build or {},
        "artifacts": ctx.extra.get("upstream_digests", {}),
        "metrics": evaluation,
    }
