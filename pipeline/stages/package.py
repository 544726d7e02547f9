"""The package stage's shape, shared by every target: a Triton model repository written from the validated
engine, plus ``manifest.json``, the lineage a deployment checks before it loads the engine."""

from __future__ import annotations

import json
import platform

from .. import __version__
from .. import target_registry as registry
from ..host.tools import tool_versions
from ..triton.manifest import BUILD_TOOLS
from .base import Stage, StageContext, payload_bytes
from .common import calibration_digests, set_digests



class PackageStage(Stage):
    """Writes the repository (``write_repository``, per target) and its manifest; its payload leaves the cache, so
    its inputs are re-hashed in full before it runs (``hands_off``)."""
    name = "package"
    out_link = "triton_repo"
    needs = ("build", "validate", "evaluate", "source")
    hands_off = True

    def config(self, r):
        # the recipe as the manifest records it (Recipe.package_dict: no regression rules, no description)
        return {"triton": r.package.triton.model_dump(), "recipe": r.name, "recipe_hash": r.package_hash}

    def output_bytes(self, r, info, inputs):
        return payload_bytes(inputs["build"]) + payload_bytes(inputs["source"]) if "build" in inputs else None

    def shipped_code(self) -> list:
        """forge's own files the repository carries (the Triton python models; a target adds its runtime modules)."""
        from ..triton.templates import PY_MODELS
        return sorted(PY_MODELS.glob("*.py"))

    def components(self, r, home, upstream):
        # the code copied into the repository is part of what it is: an edit to it re-packages (a version bump was
        # the only way before, and an engine.py change that forgot one kept serving the old runtime)
        from ..hashing import file_digest
        return super().components(r, home, upstream) | {
            "shipped_code": {f.name: file_digest(f) for f in self.shipped_code()}}

    def write_repository(self, ctx: StageContext, evaluation: dict) -> tuple[dict | None, str, dict]:
        """Fill ``ctx.out``; returns (metrics, manifest target: "cpu" or "sm90", build record for the manifest)."""
        raise NotImplementedError

    def manifest_extra(self, ctx: StageContext) -> dict:
        """Target-specific manifest keys (e.g. the ORT engine's quantization, for verify-deploy)."""
        return {}

    def run(self, ctx: StageContext) -> dict:
        from ..triton.manifest import write_manifest
        evaluation = json.loads((ctx.inputs["evaluate"] / "metrics.json").read_text())
        metrics, target, build = self.write_repository(ctx, evaluation)
        # the engine is the target's: what it is bound to and needs where it is deployed is Target.deploy's
        write_manifest(ctx.out, {"engine": ctx.recipe.build.target}
                       | manifest_info(ctx, target=target, evaluation=evaluation, build=build) | self.manifest_extra(ctx))
        return metrics or {}


def manifest_info(ctx, *, target: str, evaluation: dict, build: dict | None = None) -> dict:
    """What the repository was built from and for (pipeline/triton/manifest.py adds files and hardware)."""
    r = ctx.recipe
    bound = registry.get(r.build.target).deploy.bound_tools      # recorded whatever BUILD_TOOLS says
    source = json.loads((ctx.inputs["source"] / "source.json").read_text())
    q = r.quantize
    calib = calibration_digests(r)
    evals = set_digests(r, [(e.set, e.split) for e in r.validate_.eval])
    return {
        "forge_version": __version__,
        "recipe": {"name": r.name, "hash": r.package_hash, "resolved": r.package_dict()},
        "model": {"source": source["spec"], "kind": source["kind"], "digest": source["digest"]},
        "calibration": {"config": q.calibration.model_dump(), "digests": calib} if calib else None,
        "evaluation_data": evals,
        "tools": {k: v for k, v in tool_versions(tuple(dict.fromkeys(BUILD_TOOLS + bound))).items() if v}
        | {"python": platform.python_version()},
        "target": target,
        "build": build or {},
        "artifacts": ctx.extra.get("upstream_digests", {}),
        "metrics": evaluation,
    }
