"""build.target onnxruntime: an ONNX graph quantized by ONNX Runtime's quantizers, optimised and run by ONNX Runtime
(CPU, or CUDA with ``build.onnxruntime.provider: cuda``), served by Triton's Python backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..recipe.ground import MAX_THREADS, Section
from ..ort import deploy
from ..ort.quantize import QUANTIZERS
from ..stages.onnxruntime import OrtBuildStage, OrtEvaluate, OrtExport, OrtPackage, OrtQuantize, simulation_problems
from ..stages.source import SourceStage
from ..stages.validate import ValidateStage
from ..target_registry import Target, register


class OrtBuild(Section):
    opt_level: Literal["disable", "basic", "extended", "all"] = "extended"
    intra_op_threads: int = Field(0, ge=0, le=MAX_THREADS, description="0 = ONNX Runtime's default (all cores)")
    provider: Literal["cpu", "cuda"] = Field(
        "cpu", description="execution provider the engine is built, validated and served with: cpu, or cuda "
                           "(onnxruntime-gpu's CUDAExecutionProvider; KV cache on the GPU through IO binding)")
    precision: Literal["fp32", "fp16"] = Field(
        "fp32", description="fp16 (needs provider: cuda): with the gqa export the graph is written in fp16 from the "
                            "weights, tensor by tensor (pipeline/ort/stream_export.py), with standard attention "
                            "converted by ONNX Runtime's float16 tool at build time; norm statistics and logits fp32")
    cuda_graph: bool = Field(False, description="decode steps replayed from a captured CUDA graph (ONNX Runtime's "
                                                "enable_cuda_graph, fixed-shape bound buffers); needs provider: cuda")

    def build_config(self) -> dict:
        """What the build stage's output depends on: the CPU defaults leave the CPU recipes' keys as they were
        before the provider existed; cuda_graph is a run-time choice (evaluate, serve), not part of the graph."""
        d = self.model_dump(exclude={"cuda_graph"})
        if self.provider == "cpu" and self.precision == "fp32":
            d.pop("provider"), d.pop("precision")
        return d


def _checks(recipe) -> list[str]:
    """The provider's rules: fp16 graphs and CUDA graphs need the CUDA provider. (A build.onnxruntime section in a
    recipe of another target is refused by the schema, naming the target that reads it.)"""
    b = recipe.build.onnxruntime
    if b.provider == "cuda":
        return []
    return [f"build.onnxruntime.{key} = {getattr(b, key)!r} needs build.onnxruntime.provider: cuda (the CPU "
            "provider runs fp32 graphs and has no CUDA graphs)"
            for key, bad in (("precision", b.precision == "fp16"), ("cuda_graph", b.cuda_graph)) if bad]


def _stream_checks(recipe) -> list[str]:
    """The CUDA fp16 recipes' graph is fp16 from the export on (pipeline/ort/stream_export.py): their int8 is
    weight-only MatMulNBits (what needs the fp32 graph -- dynamic INT8, SmoothQuant, the int8 embedding -- cannot
    run there)."""
    from ..ort.stream_quantize import streamable
    from ..stages.onnxruntime import ort_options, streams_fp16
    if streams_fp16(recipe) and recipe.quantize.algo == "int8":
        why = streamable("int8", ort_options(recipe.quantize))
        return [why] if why else []
    return []


def _all_checks(recipe) -> list[str]:
    # the provider's rules, the streamed fp16 graph's int8, and validate.reference: simulated needs a grid the
    # simulation reproduces
    return _checks(recipe) + _stream_checks(recipe) + simulation_problems(recipe)


TARGET = register(Target(
    name="onnxruntime",
    section=OrtBuild,
    # the algos ONNX Runtime's quantizer implements (pipeline/ort/quantize.py, the one table)
    quantizers=QUANTIZERS,
    flow=(SourceStage, OrtExport, OrtQuantize, OrtBuildStage, OrtEvaluate, ValidateStage, OrtPackage),
    summary="ONNX Runtime (CPU, or CUDA with build.onnxruntime.provider: cuda)",
    # one spelling per option (issue 25): SmoothQuant's strength belongs to the options model, where null says
    # "no smoothing", which a section-level alpha cannot say
    moved_section_keys={"alpha": "quantize.options.smoothquant_alpha"},
    checks=_all_checks,
    simulated_reference=True,       # weight-only MatMulNBits grids (pipeline/eval/fake_quant.py)
    deploy=deploy.DEPLOY,           # a CPU engine (machine, ORT release, ISA class) or a CUDA-provider one
    doctor=deploy.doctor,
))
