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
from ..target_registry import Candidate, Target, register


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


# What `forge search` builds for a recipe of this target (pipeline/search.py): the shipped recipes' formats, each as
# --set overrides on top of the searched recipe (whose validate section gates them all). The CPU ones set the CPU
# provider (a CUDA recipe searched on a CPU host still gets them); the CUDA ones are skipped where this onnxruntime
# has no CUDA provider (the plan says why).
_CPU = ("build.onnxruntime.provider=cpu", "build.onnxruntime.precision=fp32", "build.onnxruntime.cuda_graph=false")
_CUDA = ("build.onnxruntime.provider=cuda", "build.onnxruntime.precision=fp16")
_FP32 = ("quantize.method=none", "quantize.algo=none", "quantize.block_size=null", "quantize.options={}")
_INT8 = ("quantize.method=ptq", "quantize.algo=int8", "quantize.block_size=null")
_INT4 = ("quantize.method=ptq", "quantize.algo=int4_wo", "quantize.block_size=32", "quantize.options={method: offsets}")
CANDIDATES = (
    Candidate("fp32", (*_FP32, *_CPU), "FP32 graph, nothing quantized (smollm2-135m-fp32)"),
    Candidate("int8", (*_INT8, "quantize.options={method: blockwise}", *_CPU),
              "8-bit MatMulNBits after SmoothQuant, batch-invariant (smollm2-135m-int8, the default)"),
    Candidate("int8-prompt-pt", (*_INT8, "quantize.options={method: blockwise, prefill: per_token}", *_CPU),
              "int8 plus a per-token INT8 graph (MatMulInteger) for prompts; batch-invariant"),
    Candidate("int8-per-token", (*_INT8, "quantize.options={method: per_token}", *_CPU),
              "per-token INT8 MatMulInteger everywhere after SmoothQuant; batch-invariant"),
    Candidate("int8-mixed", (*_INT8, "quantize.options={method: mixed}", *_CPU),
              "dynamic INT8 MatMulInteger + blockwise down_proj/lm_head, SmoothQuant; not batch-invariant"),
    Candidate("int4", (*_INT4, *_CPU), "weight-only INT4 MatMulNBits, block 32, offsets (smollm2-135m-int4)"),
    Candidate("cuda-fp16", (*_FP32, *_CUDA), "fp16 graph on the CUDA provider (smollm2-135m-cuda-fp16)"),
    Candidate("cuda-int4", (*_INT4, *_CUDA), "weight-only INT4 + fp16 on the CUDA provider (smollm2-135m-cuda-int4)"),
)

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
    candidates=CANDIDATES,
))
