"""The schema of ``quantize.options``: the options models of the quantizers, each option declared once with its
type, default, bounds and what it does. Which model a (build.target, quantize.algo) reads is the target's
declaration (pipeline/targets/<target>.py, ``quantizers``); the recipe validates a recipe's options against it (a
typo is an error naming the key, with did-you-mean) and the quantizers receive the validated model (their defaults
are these: ``pipeline/ort/quantize.py``, ``pipeline/tensorrt/quantize.py``).

To add an option: declare it on the model of the quantizer that reads it (or on a shared base), with a default
that reproduces today's behaviour; the cache key already includes ``quantize.options`` as written.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

Pattern = Annotated[str, Field(min_length=1, max_length=512)]


def _power_of_two_16(v: int) -> int:
    if v < 16 or v & (v - 1):
        raise ValueError("must be a power of two >= 16 (ONNX Runtime's MatMulNBits block sizes: 16, 32, 64, 128, 256)")
    return v


BlockSize = Annotated[int, Field(ge=16, le=4096), AfterValidator(_power_of_two_16)]


class Options(BaseModel):
    """Options every quantizer reads."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    exclude: list[Pattern] = Field(default_factory=list, max_length=1000, description=(
        "fnmatch patterns of module / MatMul names kept unquantized, e.g. '*layers.0.mlp.down_proj'"))


class NoOptions(BaseModel):
    """Nothing is quantized (algo none): no option applies."""
    model_config = ConfigDict(extra="forbid", strict=True)


class OrtOptions(Options):
    threads: int = Field(2, ge=1, le=1024, description="ONNX Runtime threads of the calibration pass (activation ranges)")


class OrtInt8Options(OrtOptions):
    """onnxruntime, algo int8. Defaults chosen by measurement on SmolLM2-135M (wiki eval, 16 x 256 tokens, vs FP32
    ORT, 2-core x86_64 with AVX-512 VNNI):

    - dynamic per-tensor everywhere: ppl +69 %, top-1 59 %, 1.84x (down_proj inputs have 2000x outlier channels)
    - blockwise (MatMulNBits 8-bit) everywhere: ppl +0.6 %, top-1 96 %, 1.09x (accurate, not faster)
    - mixed: blockwise down_proj + lm_head, dynamic elsewhere, SmoothQuant 0.5 on q/k/v and gate/up inputs:
      ppl +1.8 %, top-1 93 %, 1.43-1.66x, 0.32x size  <- default

    Weights of the dynamic MatMuls (issue 11): ORT's u8 x s8 kernels sum pairs of products in saturating 16-bit lanes
    on x86 without VNNI/AMX (pipeline.ort.quantize.isa_accuracy_risk), so one full-range s8 engine measured ppl +0.98 %
    on an AMX CPU and +5.9 % on an AVX2-only EPYC. Candidates, measured natively on x86_64-amx with the recipe's eval
    (12 x 256 tokens vs FP32 torch) and the INT8/FP32 prefill ratio (CPU time of one thread, 4 x 256, shared machine):

    - s8 full range                       ppl +0.98 %, top-1 92.7 %, 1.22x; saturates on AVX2 (+5.9 %)
    - s8 reduce_range (7-bit, [-64, 64])  ppl +1.81 %, top-1 90.7 %, 1.50x; 2 x 255 x 64 < 2^15: exact on every
      ISA, and it keeps the fast u8 x s8 kernels (VNNI, AMX, AVX2 vpmaddubsw)  <- default
    - u8 symmetric (zero point 128)       ppl +1.13 %, top-1 92.3 %, 0.92x; exact everywhere, slower than FP32 here
    - u8 asymmetric                       ppl +1.68 %, top-1 92.9 %, 1.06x
    - blockwise everywhere                ppl -0.11 %, top-1 96.0 %, 0.88x

    On an emulated AVX2 CPU (qemu-x86_64 -cpu Haswell, x86_64-avx2) the default measured ppl +3.21 %, top-1 88.1 % on
    the eval's first 2 windows, against +3.78 %, 87.1 % on AMX for the same windows (docs/measurements.md).

    Issue 28: dynamic INT8 (``dynamic``, ``mixed``) is not batch-invariant (one activation scale per tensor over the
    batch), so Triton cannot batch its rows; the recipe smollm2-135m-int8 therefore sets ``method: blockwise``
    (batch-invariant, the most accurate on every eval set, slower prefill on AVX2: docs/quantization.md). The option
    default stays ``mixed`` for recipes that ask for it by leaving ``method`` out.
    """
    method: Literal["mixed", "dynamic", "blockwise"] = Field("mixed", description=(
        "dynamic: per-channel int8 weights, per-tensor int8 activations at run time (MatMulInteger); blockwise: "
        "MatMulNBits 8-bit (activations per token and block); mixed: blockwise for `blockwise`, dynamic elsewhere"))
    blockwise: list[Pattern] = Field(default_factory=lambda: ["*.mlp.down_proj", "lm_head"], max_length=1000,
                                     description="mixed: fnmatch patterns of the MatMuls quantized blockwise")
    smoothquant_alpha: Optional[float] = Field(0.5, ge=0, le=1, description=(
        "SmoothQuant migration strength folded into the RMSNorm weights (needs calibration); null: no smoothing"))
    smoothquant_only: list[Pattern] = Field(default_factory=lambda: ["*.q_proj", "*.gate_proj"], max_length=1000,
                                            description="smooth only the inputs of these MatMuls (and their siblings)")
    embedding: Literal["int8", "fp32"] = Field("int8", description="the embedding Gather as int8 per row, or fp32")
    per_channel: bool = Field(True, description="dynamic: per-channel (else per-tensor) weight scales")
    weight_type: Literal["int8", "uint8"] = Field("int8", description=(
        "dynamic: s8 weights (MLAS u8 x s8 kernels) or u8 (u8 x u8 kernels: exact everywhere, slower)"))
    reduce_range: bool = Field(True, description=(
        "dynamic: 7-bit weights, exact on x86 CPUs without VNNI/AMX whose u8 x s8 kernels saturate 16-bit sums"))
    weight_symmetric: bool = Field(True, description="dynamic: symmetric weights (zero point 0 for s8, 128 for u8)")
    block_size: BlockSize = Field(32, description="blockwise: block size (written as quantize.block_size)")
    symmetric: bool = Field(True, description="blockwise: symmetric 8-bit weights")
    accuracy_level: Literal[1, 2, 3, 4] = Field(4, description=(
        "blockwise: MatMulNBits compute type: 4 = int8 activations, 1/2/3 = fp32/fp16/bf16"))


class OrtInt4Options(OrtOptions):
    """onnxruntime, algo int4_wo: weight-only INT4 through MatMulNBits (measured on SmolLM2: HQQ +0.08 % ppl,
    round-to-nearest +34.9 %; 4-bit lm_head alone costs ~15 % ppl, so it stays 8-bit by default)."""
    method: Literal["hqq", "rtn"] = Field("hqq", description=(
        "hqq: ORT's half-quadratic quantizer, float zero points; rtn: round to nearest, integer zero points"))
    block_size: BlockSize = Field(32, description="weights per scale along the input dim (written as quantize.block_size)")
    lm_head_bits: Literal[4, 8] = Field(8, description="the untied lm_head as 8-bit blockwise, or 4-bit like the rest")
    symmetric: bool = Field(False, description="rtn: symmetric int4 (the 8-bit lm_head stays symmetric unless this is set)")
    accuracy_level: Literal[1, 2, 3, 4] = Field(4, description="rtn: MatMulNBits compute type (4 = int8 activations)")


class TensorrtOptions(Options):
    """tensorrt target: ModelOpt's ONNX PTQ writes a QDQ graph (pipeline/tensorrt/quantize.py); ``exclude``
    patterns match torch module names (``model.layers.3.mlp.down_proj``) whose MatMuls stay unquantized."""
    calibration_method: Literal["entropy", "max"] = Field("entropy", description=(
        "activation ranges: entropy (KL-optimal clipping, ORT's calibrator) or max (absolute maximum)"))
    smoothquant_alpha: Optional[float] = Field(None, ge=0, le=1, description=(
        "SmoothQuant migration strength folded into the FP32 weights before calibration; null: no smoothing"))


class TensorrtInt8Options(TensorrtOptions):
    """tensorrt, algo int8 (measured on SmolLM2-135M: down_proj inputs carry 2000x outlier channels)."""
    exclude: list[Pattern] = Field(default_factory=lambda: ["*.mlp.down_proj"], max_length=1000)
    smoothquant_alpha: Optional[float] = Field(0.5, ge=0, le=1)


class TensorrtFp8Options(TensorrtOptions):
    calibration_method: Literal["entropy", "max"] = "max"


class ModeloptOptions(Options):
    """tensorrt_llm (ModelOpt): ``exclude`` patterns match module names; their quantizers stay off."""
