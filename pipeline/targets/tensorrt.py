"""build.target tensorrt: an ONNX graph with QDQ from ModelOpt's ONNX PTQ, built by TensorRT (strongly typed)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from ..recipe.ground import MAX_BATCH, MAX_SEQ_LEN, Section
from ..tensorrt.quantize import QUANTIZERS
from ..stages.onnxruntime import OrtExport
from ..stages.source import SourceStage
from ..stages.tensorrt import QdqEvaluate, QdqValidate, TensorrtBuildStage, TensorrtQuantize
from ..deploy import gpu_arch, needs_tool
from ..target_registry import Target, register


class TensorrtBuild(Section):
    precision: Literal["fp32", "fp16"] = Field("fp16", description=(
        "what the unquantized layers run in; the quantize stage writes it into the graph (quantize.algo int8/fp8 "
        "adds QDQ around the weight MatMuls) and TensorRT builds that graph strongly typed. No bf16: the graph "
        "must also run on ONNX Runtime's CPU provider (evaluate_qdq), which has no bf16 MatMul"))
    gpu_sm: Optional[int] = Field(None, ge=30, le=200, description=(
        "compute capability the engine is for, e.g. 89 or 90; detected when a GPU is present (needed to plan fp8 "
        "on a machine without one)"))
    workspace_gib: float = Field(4.0, gt=0, le=1024, description="TensorRT builder workspace (memory pool limit)")
    builder_optimization_level: Optional[int] = Field(None, ge=0, le=5, description="TensorRT's default when null")
    max_batch_size: int = Field(4, ge=1, le=MAX_BATCH, description="optimisation profiles: largest batch")
    max_seq_len: int = Field(1024, ge=2, le=MAX_SEQ_LEN, description="optimisation profiles: largest past + new tokens")


def _checks(recipe) -> list[str]:
    if recipe.export.attention == "gqa":
        return ["export.attention 'gqa' is an ONNX Runtime contrib op that TensorRT cannot parse; "
                "use export.attention: standard (or auto) for build.target 'tensorrt'"]
    return []


TARGET = register(Target(
    name="tensorrt",
    section=TensorrtBuild,
    # the algos ModelOpt's ONNX PTQ is driven with (pipeline/tensorrt/quantize.py, the one table)
    quantizers=QUANTIZERS,
    flow=(SourceStage, OrtExport, TensorrtQuantize, QdqEvaluate, QdqValidate, TensorrtBuildStage),
    summary="TensorRT engine from an ONNX graph with QDQ (ModelOpt ONNX PTQ)",
    moved_section_keys={"alpha": "quantize.options.smoothquant_alpha"},
    onnx_attention="standard",     # TensorRT parses plain ONNX attention only
    checks=_checks,
    deploy=gpu_arch(("tensorrt",), "build.tensorrt.gpu_sm"),     # an engine runs on its GPU SM and TensorRT only
    doctor=needs_tool("tensorrt", "the tensorrt target cannot build engines",
                      "on a GPU machine: pip install tensorrt (wheels come from NVIDIA's package index)"),
))
