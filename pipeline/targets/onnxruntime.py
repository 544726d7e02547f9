"""build.target onnxruntime: an ONNX graph quantized by ONNX Runtime's quantizers, optimised and run by ONNX Runtime
(CPU, or CUDA with ``build.onnxruntime.provider: cuda``), served by Triton's Python backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..recipe import MAX_THREADS, Section
from ..ort.quantize import OPTIONS
from ..stages.onnxruntime import OrtBuildStage, OrtEvaluate, OrtExport, OrtPackage, OrtQuantize
from ..stages.source import SourceStage
from ..stages.validate import ValidateStage
from ..target_registry import Quantizer, Target, register


class OrtBuild(Section):
    opt_level: Literal["disable", "basic", "extended", "all"] = "extended"
    intra_op_threads: int = Field(0, ge=0, le=MAX_THREADS, description="0 = ONNX Runtime's default (all cores)")
    provider: Literal["cpu", "cuda"] = Field(
        "cpu", description="execution provider the engine is built, validated and served with: cpu, or cuda "
                           "(onnxruntime-gpu's CUDAExecutionProvider; KV cache on the GPU through IO binding)")
    precision: Literal["fp32", "fp16"] = Field(
        "fp32", description="fp16: the graph converted with ONNX Runtime's float16 tool at build time (norm "
                            "statistics kept fp32, logits output fp32); needs provider: cuda")
    cuda_graph: bool = Field(False, description="decode steps replayed from a captured CUDA graph (ONNX Runtime's "
                                                "enable_cuda_graph, fixed-shape bound buffers); needs provider: cuda")

    def build_config(self) -> dict:
        """What the build stage's output depends on: the CPU defaults leave the CPU recipes' keys as they were
        before the provider existed; cuda_graph is a run-time choice (evaluate, serve), not part of the graph."""
        d = self.model_dump(exclude={"cuda_graph"})
        if self.provider == "cpu" and self.precision == "fp32":
            d.pop("provider"), d.pop("precision")
        return d


TARGET = register(Target(
    name="onnxruntime",
    section=OrtBuild,
    # the algos ONNX Runtime's quantizer implements, with their options models (pipeline/ort/quantize.OPTIONS)
    quantizers={a: Quantizer(m, ("block_size",) if "block_size" in m.model_fields else ())
                for a, m in OPTIONS.items()},
    flow=(SourceStage, OrtExport, OrtQuantize, OrtBuildStage, OrtEvaluate, ValidateStage, OrtPackage),
    summary="ONNX Runtime (CPU, or CUDA with build.onnxruntime.provider: cuda)",
    # one spelling per option (issue 25). The block size is quantize.block_size, as for tensorrt_llm (the options
    # model's block_size is what the quantizer reads, filled from it). SmoothQuant's strength belongs to the
    # options model, where null says "no smoothing", which a section-level alpha cannot say.
    section_options={"block_size": "block_size"},
    moved_options={"block_size": "quantize.block_size"},
    moved_section_keys={"alpha": "quantize.options.smoothquant_alpha"},
))
