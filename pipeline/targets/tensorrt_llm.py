"""build.target tensorrt_llm: ModelOpt quantizes the torch model (PTQ or QAT), a TensorRT-LLM checkpoint is written
and checked, trtllm-build builds the engine, Triton's tensorrtllm backend serves it."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from ..recipe.ground import MAX_BATCH, MAX_GPUS, MAX_SEQ_LEN, Section
from ..stages.source import SourceStage
from ..stages.tensorrt_llm import (CheckpointEvaluate, ModeloptQuantize, TrtllmBuildDeploy, TrtllmBuildStage,
                                   TrtllmCheckpoint, TrtllmEvaluate, TrtllmPackage)
from ..stages.validate import ValidateCheckpointStage, ValidateStage
from ..deploy import gpu_arch, needs_tool
from ..target_registry import Target, register
from ..trtllm.quantizers import QUANTIZERS


class TrtllmBuild(Section):
    dtype: Literal["float16", "bfloat16"] = "float16"
    tp: int = Field(1, ge=1, le=MAX_GPUS)
    pp: int = Field(1, ge=1, le=MAX_GPUS)
    gpu_sm: Optional[int] = Field(None, ge=30, le=200,
                                  description="compute capability the engine targets, e.g. 90; detected when a GPU is present")
    max_batch_size: int = Field(8, ge=1, le=MAX_BATCH)
    max_input_len: int = Field(1024, ge=1, le=MAX_SEQ_LEN)
    max_seq_len: int = Field(2048, ge=1, le=MAX_SEQ_LEN)
    max_num_tokens: int = Field(8192, ge=1, le=2**20)
    max_beam_width: int = Field(1, ge=1, le=64)
    kv_cache_type: Literal["paged", "continuous", "disabled"] = "paged"
    tokens_per_block: int = Field(32, ge=1, le=1024)
    gemm_plugin: str = "auto"
    gpt_attention_plugin: str = "auto"
    context_fmha: bool = True
    use_paged_context_fmha: bool = True
    remove_input_padding: bool = True
    use_fused_mlp: bool = True
    reduce_fusion: bool = False
    user_buffer: bool = False
    multiple_profiles: bool = False
    workers: int = Field(1, ge=1, le=MAX_GPUS)
    gather_context_logits: bool = Field(True, description="engine returns context logits: needed by validate's perplexity/top-1 "
                                        "(costs max_num_tokens x vocab x 2 bytes of GPU memory with logits_dtype float16, "
                                        "x 4 with float32); TensorRT-LLM turns KV-cache reuse off for such an engine")
    logits_dtype: Literal["float16", "float32"] = Field(
        "float16", description="trtllm-build --logits_dtype, always passed. The lm_head GEMM runs in the model dtype and "
                               "the engine (strongly typed) casts its output to logits_dtype, so float32 stores the same "
                               "rounded values in twice the memory")
    extra_args: list[str] = Field(default_factory=list)


def plan_notes(recipe, info, console) -> None:
    """The prompt limit the runtime will accept, and the per-rank GPU memory plan (docs/trtllm-memory.md)."""
    from rich.markup import escape

    from ..errors import ForgeError
    from ..trtllm.memory import plan_for_recipe, render_memory
    from ..trtllm.build_config import prompt_limit
    b = recipe.build.tensorrt_llm
    lim, ignored = prompt_limit(b.model_dump())
    if ignored:    # trtllm-build warns and ignores it; say what the runtime will accept instead
        console.print(f"prompt limit: {lim} tokens = min(max_seq_len - 1, max_num_tokens); "
                      f"build.tensorrt_llm.max_input_len {b.max_input_len} is ignored "
                      f"(remove_input_padding + context_fmha)")
    try:
        if info is not None:
            plan_, verdicts = plan_for_recipe(recipe, info, None)
            render_memory(plan_, verdicts, console)
    except ForgeError as e:
        console.print(f"memory plan not shown: {escape(str(e))}")


TARGET = register(Target(
    name="tensorrt_llm",
    section=TrtllmBuild,
    # one ModelOpt quantizer per algo TensorRT-LLM's checkpoint can say (pipeline/trtllm/quantizers.py, the one table)
    quantizers=QUANTIZERS,
    flow=(SourceStage, ModeloptQuantize, TrtllmCheckpoint, CheckpointEvaluate, ValidateCheckpointStage,
          TrtllmBuildStage, TrtllmEvaluate, ValidateStage, TrtllmBuildDeploy, TrtllmPackage),
    summary="TensorRT-LLM engine from a ModelOpt-quantized checkpoint",
    kv_cache=True,
    thresholds=("simulated_ppl_gap_max",),     # the checkpoint's reference numerics vs the quantize stage's
    qat=True,
    # SmoothQuant's strength is quantize.alpha here (the onnxruntime and tensorrt targets' option name)
    moved_options={"smoothquant_alpha": "quantize.alpha"},
    algo_hints={"int8": "'int8' is the onnxruntime target's format, use int8_sq_per_token, int8_sq or int8_wo here"},
    plan_notes=plan_notes,
    # an engine runs on its GPU SM, with the TensorRT and TensorRT-LLM it was built with
    deploy=gpu_arch(("tensorrt", "tensorrt_llm"), "build.tensorrt_llm.gpu_sm"),
    doctor=needs_tool("tensorrt_llm", "the tensorrt_llm target stops after the checkpoint stage",
                      "on a GPU machine: pip install 'tensorrt-llm>=1.2,<1.3' (wheels come from NVIDIA's package index)"),
    ranks=lambda r: (r.build.tensorrt_llm.tp, r.build.tensorrt_llm.pp),
))
