"""The schema of ``quantize.options``: the options models of the quantizers, each option declared once with its
type, default, bounds and what it does. Which model a (build.target, quantize.algo) reads is the target's
declaration (pipeline/targets/<target>.py, ``quantizers``); the recipe validates a recipe's options against it (a
typo is an error naming the key, with did-you-mean) and the quantizers receive the validated model (their defaults
are these: ``pipeline/ort/quantize.py``, ``pipeline/tensorrt/quantize.py``, ``pipeline/trtllm/quantizers.py``).

To add an option: declare it on the model of the quantizer that reads it (or on a shared base), with a default
that reproduces today's behaviour; the cache key already includes ``quantize.options`` as written.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

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
    method: Literal["mixed", "dynamic", "blockwise", "per_token"] = Field("mixed", description=(
        "dynamic: per-channel int8 weights, per-tensor int8 activations at run time (MatMulInteger); blockwise: "
        "MatMulNBits 8-bit (activations per token and block); mixed: blockwise for `blockwise`, dynamic elsewhere; "
        "per_token: per-channel int8 weights, int8 activations with a scale per token at run time (MatMulInteger, "
        "batch-invariant; SmoothQuant on every input it can fold unless smoothquant_only is set)"))
    prefill: Literal["same", "per_token"] = Field("same", description=(
        "blockwise: the graph prompts run on -- same (the one graph) or per_token (a second graph, prefill.onnx, "
        "per-token INT8 with SmoothQuant: fast at M > 1 where MatMulNBits is not; decode keeps MatMulNBits)"))
    outlier_channels: int = Field(0, ge=0, le=64, description=(
        "per_token graphs (method per_token, prefill per_token): the input channels of each quantized activation "
        "kept in fp32, chosen by calibrated max |x| after smoothing (LLM.int8()'s decomposition; needs calibration)"))
    blockwise: list[Pattern] = Field(default_factory=lambda: ["*.mlp.down_proj", "lm_head"], max_length=1000,
                                     description="mixed: fnmatch patterns of the MatMuls quantized blockwise")
    smoothquant_alpha: Optional[float] = Field(0.5, ge=0, le=1, description=(
        "SmoothQuant migration strength folded into the RMSNorm weights (needs calibration); null: no smoothing"))
    smoothquant_only: list[Pattern] = Field(default_factory=lambda: ["*.q_proj", "*.gate_proj"], max_length=1000,
                                            description="smooth only the inputs of these MatMuls (and their "
                                                        "siblings); per_token's default: every input")
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

    @model_validator(mode="after")
    def _outliers_need_a_per_token_graph(self):
        if self.outlier_channels and "per_token" not in (self.method, self.prefill):
            raise ValueError(f"outlier_channels applies to per-token graphs, and method {self.method!r} with prefill "
                             f"{self.prefill!r} has none: set method: per_token or prefill: per_token, or drop it")
        return self


class OrtInt4Options(OrtOptions):
    """onnxruntime, algo int4_wo: weight-only INT4 through MatMulNBits (measured on SmolLM2: HQQ +0.08 % ppl,
    round-to-nearest +34.9 %; 4-bit lm_head alone costs ~15 % ppl, so it stays 8-bit by default).

    Speed (issue 41): HQQ's float zero points take MatMulNBits' slow path on CPU (B dequantized on every call:
    0.16x FP32 at M = 1, SmolLM2 MLP shapes, x86_64-avx512vnni); integer zero points (rtn, fit, gptq) with
    accuracy_level 4 run MLAS's int8 QNBit kernels (3.1x FP32, 1.26x 8-bit MatMulNBits). ``fit`` and ``gptq`` fit
    the integer zero points to calibration data (pipeline/ort/int4_fit.py); docs/measurements.md has the figures."""
    method: Literal["hqq", "rtn", "fit", "gptq", "offsets"] = Field("hqq", description=(
        "hqq: ORT's half-quadratic quantizer, float zero points (slow on CPU); rtn: round to nearest, integer zero "
        "points; fit: per-block scale and integer zero point minimising the E[x^2]-weighted error; gptq: GPTQ with "
        "those per-block fits; offsets: each block's min as scale x integer zero point plus the float rest, carried "
        "as 4-bit extra input columns [x, blocksum(x)] (fit and gptq read quantize.calibration)"))
    block_size: BlockSize = Field(32, description="weights per scale along the input dim (written as quantize.block_size)")
    lm_head_bits: Literal[4, 8] = Field(8, description="the lm_head (tied to the embedding or not) as 8-bit blockwise, or 4-bit like the rest")
    symmetric: bool = Field(False, description="rtn: symmetric int4 (the 8-bit lm_head stays symmetric unless this is set)")
    accuracy_level: Literal[1, 2, 3, 4] = Field(4, description=(
        "rtn, fit, gptq: MatMulNBits compute type (4 = int8 activations per block, MLAS's fast kernels)"))
    bias_correction: bool = Field(False, description=(
        "fit, gptq: add E[x] (W - W_q) over calibration as MatMulNBits' bias (the mean of each output's error; "
        "Nagel et al. 2019's bias correction) and fit the rest under the inputs' covariance"))


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


class ModeloptSmoothQuantOptions(ModeloptOptions):
    """tensorrt_llm, algo int8_sq: SmoothQuant. ModelOpt's own default strength; on SmolLM2 (docs/quantization.md)
    1.0 loses less than 0.5 (+22.9 % vs +29.5 % perplexity), both a lot."""
    alpha: float = Field(1.0, ge=0, le=1, description="SmoothQuant migration strength (written as quantize.alpha)")


class ModeloptSmoothQuantPerTokenOptions(ModeloptSmoothQuantOptions):
    """tensorrt_llm, algo int8_sq_per_token: TensorRT-LLM's QuantConfig.smoothquant_val default; on SmolLM2 0.5 gives
    +0.98 % perplexity, 1.0 +6.3 %."""
    alpha: float = Field(0.5, ge=0, le=1, description="SmoothQuant migration strength (written as quantize.alpha)")


class ModeloptInt4Options(ModeloptOptions):
    """tensorrt_llm, algos int4_wo / int4_awq: int4 weights, one scale per group of input channels."""
    block_size: Optional[int] = Field(None, gt=0, le=65536, description=(
        "weights per scale (written as quantize.block_size); null: 128, TensorRT-LLM's default, where it divides "
        "every quantized linear's input width, else the largest multiple of 32 below it that does"))


class ModeloptInt4ZpOptions(ModeloptInt4Options):
    """tensorrt_llm, algo int4_zp: int4 weights with a scale and a zero per group of input channels."""
    block_size: Optional[int] = Field(None, gt=0, le=65536, description=(
        "weights per scale and zero (written as quantize.block_size): 64 or 128, the only group sizes TensorRT-LLM's "
        "groupwise int4 GEMM takes; null: 128 where it divides every quantized linear's input width, else 64"))


class ModeloptFp8RowwiseOptions(ModeloptOptions):
    """tensorrt_llm, algo fp8_pc_pt (rowwise FP8). TensorRT-LLM builds this format by swapping whole modules
    (Attention, GatedMLP, every RmsNorm but ln_f: ``fp8_rowwise_quantize``, tensorrt_llm/quantization/quantize.py @
    89fd9b7), so a single linear cannot stay in float and ``exclude`` must stay empty; what the checkpoint config can
    name instead is the Meta recipe."""

    @field_validator("exclude")
    @classmethod
    def _whole_modules_only(cls, v):
        if v:
            raise ValueError("fp8_pc_pt keeps no single linear in float (TensorRT-LLM swaps whole attention / MLP "
                             "modules for it); leave it empty, or set quantize.options.meta_recipe: true")
        return v

    meta_recipe: bool = Field(False, description=(
        "TensorRT-LLM's use_meta_recipe: the attention (qkv, dense) of every layer and the first and last decoder "
        "layers stay in the model dtype. SmolLM2-135M, simulated: +0.9 % perplexity (all linears rowwise FP8: "
        "+2.5 %; docs/quantization.md)"))
