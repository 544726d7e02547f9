"""Stages of the tensorrt target: export (ONNX) -> quantize -> build (TensorRT engine, GPU) -> evaluate -> package.

The build needs TensorRT on a GPU; here it stops with what is missing. Export and quantize are the
onnxruntime target's stages (same ONNX graph)."""

from __future__ import annotations

from .base import Stage, StageContext, has_module
from .onnxruntime import OrtExport, OrtQuantize
from ..env import gpu_sm
from .tensorrt_llm import target_sm


def tensorrt_missing() -> str | None:
    if not has_module("tensorrt"):
        return "tensorrt is not installed (pip install -e '.[tensorrt]' on a GPU machine with NVIDIA's index)"
    if gpu_sm() is None:
        return "no CUDA GPU visible"
    return None


class TensorrtBuildStage(Stage):
    name = "build"
    version = "1"
    needs = ("quantize",)
    tools = ("tensorrt",)
    description = "ONNX -> TensorRT engine (timing cache from/to the cache)"

    def config(self, r):
        return r.build.tensorrt.model_dump()

    def hardware(self, r):
        return target_sm(r)

    def missing(self, r):
        return tensorrt_missing()

    def run(self, ctx: StageContext) -> dict:
        from ..tensorrt_build import build_tensorrt_engine
        return build_tensorrt_engine(ctx.inputs["quantize"], ctx.out, ctx.recipe.build.tensorrt.model_dump(),
                                     timing_cache_dir=ctx.home / "timing_cache" / target_sm(ctx.recipe))


