"""The tensorrt_llm target's quantizers: one :class:`ModeloptQuantizer` per ``quantize.algo``, the one table of what
each algo is (pipeline/quantizer.py says what a quantizer is).

Each declares its typed options (pipeline/recipe_options.py: SmoothQuant's alpha and the INT4 group size, with their
defaults, are options of the algos that read them, written as ``quantize.alpha`` / ``quantize.block_size``), the
checkpoint's ``quant_algo`` it makes, the ModelOpt preset its calibration starts from, whether ModelOpt exports
fake-quantized weights or TensorRT-LLM quantizes float weights at build time, and the GPU it needs. The quantize stage
runs the quantizer (pipeline/quant/calibrate.py); everything else reads this table (build_config.QUANT_ALGO,
the checkpoint's quantization block, the plan-time checks).

The algo -> ModelOpt mapping follows TensorRT-LLM's ``quantize_by_modelopt.py`` (trtllm-reference.md §3):
int8_sq / int8_sq_per_token -> ``INT8_SMOOTHQUANT_CFG``, fp8 -> ``FP8_DEFAULT_CFG``, fp8_pc_pt ->
``FP8_PER_CHANNEL_PER_TOKEN_CFG`` (quantize.py's ``fp8_pc_pt`` qformat), int4_awq -> ``INT4_AWQ_CFG``. For
int8_wo / int4_wo TensorRT-LLM exports with ``EMPTY_CFG`` and quantizes the weights at build time; for the
simulated accuracy ModelOpt's real weight-only fake-quant presets run (``INT8_WEIGHT_ONLY_CFG``,
``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``), so the accuracy table shows the loss those formats cause. int4_zp (asymmetric
int4 groups with zero points) inserts the blockwise weight quantizers of ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG`` and gives
them the asymmetric grid (pipeline/quant/zero_point.py, on the grid of pipeline/trtllm/zp_grid.py); like int4_wo it exports float weights, which
pipeline/trtllm/int4_zp.py quantizes.

To add an algo: one entry in :data:`QUANTIZERS` (and, where it has options of its own, its options model in
pipeline/recipe_options.py); docs/architecture.md "Adding a quantizer".
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from ..gpus import FP8_MIN_SM
from ..modelinfo import ModelInfo
from ..quantizer import Quantizer
from ..recipe_options import (ModeloptFp8RowwiseOptions, ModeloptInt4Options, ModeloptInt4ZpOptions, ModeloptOptions,
                              ModeloptSmoothQuantOptions, ModeloptSmoothQuantPerTokenOptions)

# TensorRT-LLM's group size where it divides every quantized linear's input width (its quantize.py default)
DEFAULT_GROUP = 128
# Fine-grained (groupwise) int4 GEMMs accept these group sizes only: "Only group size 64 and 128 supported for fine
# grained kernels." (cpp/tensorrt_llm/kernels/cutlass_kernels/fpA_intB_gemm/fpA_intB_gemm_template.h @ 567239f)
GROUPWISE_SIZES = (64, 128)
# quantize.kv_cache -> the checkpoint's kv_cache_quant_algo, and the GPU a quantized KV cache needs
KV_CACHE_ALGO = {"none": None, "int8": "INT8", "fp8": "FP8"}
KV_CACHE_MIN_SM = {"fp8": FP8_MIN_SM}


@dataclass(frozen=True)
class ModeloptQuantizer(Quantizer):
    checkpoint_algo: str | None = None     # the checkpoint's quantization.quant_algo (TensorRT-LLM's QuantAlgo)
    preset: str | None = None              # modelopt.torch.quantization.<preset>: the mtq.quantize config it starts
    #                                        from; None: quantizers inserted but all off (KV-cache only, FP baseline)
    fake_quant_export: bool = True         # False: TensorRT-LLM exports float weights (EMPTY_CFG) and quantizes them
    #                                        at build time, so calibration data is not needed either
    per_token: bool = False                # activations quantized per token at run time (pipeline/quant/per_token.py)
    zero_point: bool = False               # int4 groups with zero points: the simulation's weight grid is asymmetric
    #                                        (pipeline/quant/zero_point.py) and forge rewrites the float export into
    #                                        the zero-point layout (pipeline/trtllm/int4_zp.py)
    group_sizes: tuple[int, ...] | None = None   # the only group sizes the engine's kernel takes (None: any the
    #                                              model's widths allow)

    @property
    def smoothquant(self) -> bool:
        """Reads SmoothQuant's migration strength (quantize.alpha)."""
        return "alpha" in self.options.model_fields

    @property
    def grouped(self) -> bool:
        """Reads a group size (quantize.block_size): INT4 weights, one scale per group of input channels."""
        return "block_size" in self.options.model_fields

    def needs_calibration(self, kv_cache: str = "none") -> bool:
        """Cannot run without calibration windows: activation ranges, SmoothQuant, AWQ, or a quantized KV cache."""
        return (self.preset is not None and self.fake_quant_export) or kv_cache != "none"

    def group_size(self, opts, info: ModelInfo | None) -> int | None:
        """The concrete group size: the option, else :func:`default_block_size` for the model (128 without one)."""
        if not self.grouped:
            return None
        if opts.block_size is not None:
            return int(opts.block_size)
        return default_block_size(info, self.group_sizes) if info is not None else DEFAULT_GROUP

    def modelopt_config(self, opts, kv_cache: str = "none", info: ModelInfo | None = None) -> dict:
        """The ModelOpt ``mtq.quantize`` config (a fresh deep copy of the preset, never the preset itself)."""
        import modelopt.torch.quantization as mtq

        if self.preset is None:
            cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
        else:
            cfg = copy.deepcopy(getattr(mtq, self.preset))
        if self.smoothquant:
            # per-token too: the smoothing vectors and int8 weights come from the same calibration; the activations
            # are then quantized per token at run time (pipeline/quant/per_token.py), the static amax is unused
            cfg["algorithm"] = {"method": "smoothquant", "alpha": float(opts.alpha)}
        if self.grouped:
            for e in cfg["quant_cfg"]:
                if e.get("quantizer_name") == "*weight_quantizer" and "block_sizes" in (e.get("cfg") or {}):
                    e["cfg"]["block_sizes"] = {-1: self.group_size(opts, info), "type": "static"}
        if kv_cache != "none":
            bits = 8 if kv_cache == "int8" else (4, 3)
            # ModelOpt's KV presets quantize the attention BMM inputs (k/v) per tensor (FP8_KV_CFG);
            # export reads num_bits 8 as INT8 and (4, 3) as FP8 (modelopt.torch.export.quant_utils).
            cfg["quant_cfg"].append({"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": bits, "axis": None}})
        for pat in opts.exclude:
            cfg["quant_cfg"].append({"quantizer_name": pat if pat.endswith("quantizer") else f"{pat}*quantizer",
                                     "enable": False})
        if getattr(opts, "meta_recipe", False):
            cfg["quant_cfg"] += [{"quantizer_name": pat, "enable": False} for pat in meta_recipe_float(info)]
        return cfg

    def checkpoint_quantization(self, opts, kv_cache: str = "none", info: ModelInfo | None = None) -> dict:
        """The checkpoint's ``quantization`` block TensorRT-LLM expects for this setting (quantize_by_modelopt.py)."""
        out = {"quant_algo": self.checkpoint_algo, "kv_cache_quant_algo": KV_CACHE_ALGO[kv_cache]}
        if self.grouped:
            out["group_size"] = self.group_size(opts, info)
        if self.zero_point:     # WeightOnlyGroupwiseQuantLinear(zero=True, pre_quant_scale=False) (int4_zp.py)
            out.update(has_zero_point=True, pre_quant_scale=False)
        if self.smoothquant:
            out["smoothquant_val"] = float(opts.alpha)
        if getattr(opts, "meta_recipe", False):
            out["use_meta_recipe"] = True      # QuantConfig.use_meta_recipe (fp8_rowwise_quantize reads it)
        return out

    def needs_sm(self, kv_cache: str = "none") -> int | None:
        """Lowest compute capability an engine of this setting runs on (None: any GPU)."""
        need = [s for s in (self.min_sm, KV_CACHE_MIN_SM.get(kv_cache)) if s is not None]
        return max(need) if need else None

    def plan_problems(self, quantize, opts, info: ModelInfo) -> list[str]:
        """What this model's facts refuse (the recipe has validated the section): the group size against the
        linear widths, the sequence lengths against the context."""
        out = []
        if self.grouped:
            allowed, bs = valid_block_sizes(info), self.group_size(opts, info)
            kernel = [b for b in allowed if b in self.group_sizes] if self.group_sizes else allowed
            if bs not in allowed:
                widths = ", ".join(f"{k} {v}" for k, v in info.linear_input_widths().items())
                out.append(f"quantize.block_size: {bs!r} must be a multiple of 32 dividing every quantized linear's "
                           f"input width ({widths}); allowed for this model: {', '.join(map(str, kernel)) or 'none'}")
            elif bs not in kernel:
                sizes = " or ".join(map(str, self.group_sizes))
                out.append(f"quantize.block_size: {bs} is not a group size TensorRT-LLM's groupwise int4 GEMM takes "
                           f"({sizes}: fpA_intB_gemm_template.h); use "
                           f"{' or '.join(map(str, kernel)) or 'int4_wo: no groupwise size divides this model'}")
        for key, sub, read in (("calibration", quantize.calibration, True),
                               ("qat", quantize.qat, quantize.method == "qat")):
            if read and sub.seq_len > info.max_position_embeddings:
                out.append(f"quantize.{key}.seq_len: {sub.seq_len} is longer than the model's context "
                           f"({info.max_position_embeddings} tokens, max_position_embeddings)")
        return out

    def record(self, quantize, opts, info: ModelInfo) -> dict:
        """The resolved quantize section the artifact records (quant_config.json): as it has been recorded since the
        artifact exists -- alpha and block_size concrete for every algo (1.0 and the model's group size where the
        algo reads neither), so a rebuilt artifact is byte-identical under its unchanged key."""
        c = quantize.model_dump()
        if c["alpha"] is None:
            c["alpha"] = opts.alpha if self.smoothquant else 1.0
        if c["block_size"] is None:     # the group size it quantizes with; for the others the model's default
            c["block_size"] = (self.group_size(opts, info) if self.grouped
                               else default_block_size(info) if info is not None else DEFAULT_GROUP)
        if c["method"] == "none":
            c["algo"], c["kv_cache"] = "none", "none"
        return c


def valid_block_sizes(info: ModelInfo) -> list[int]:
    """INT4 group sizes usable on this model: multiples of 32 that divide every quantized linear's input width."""
    g = 0
    for w in info.linear_input_widths().values():
        g = math.gcd(g, w)
    return [d for d in range(32, g + 1, 32) if g % d == 0]


def default_block_size(info: ModelInfo, sizes: tuple[int, ...] | None = None) -> int:
    """128 (TensorRT-LLM's default) where valid, else the largest valid size below it (else the smallest); with
    ``sizes`` (the kernel's only group sizes, e.g. GROUPWISE_SIZES) only those count."""
    ok = valid_block_sizes(info)
    if sizes:
        ok = [b for b in ok if b in sizes] or list(sizes)
    if DEFAULT_GROUP in ok:
        return DEFAULT_GROUP
    below = [b for b in ok if b < DEFAULT_GROUP]
    return max(below) if below else (min(ok) if ok else DEFAULT_GROUP)


def meta_recipe_float(info: ModelInfo | None) -> list[str]:
    """The linears TensorRT-LLM's Meta recipe for rowwise FP8 keeps in the model dtype, as ModelOpt quantizer
    patterns: every attention projection and the first and last layers' MLP (``use_meta_recipe`` in
    ``fp8_rowwise_quantize``: '*input_layernorm' and '*attention' excluded, the first and last decoder layers
    skipped; tensorrt_llm/quantization/quantize.py @ 89fd9b7). The attention's k/v BMM quantizers (KV cache) stay."""
    if info is None:
        raise ValueError("quantize.options.meta_recipe needs the model's layer count")
    last = info.num_layers - 1
    return ["*self_attn.*_proj.*quantizer", "*layers.0.mlp.*quantizer", f"*layers.{last}.mlp.*quantizer"]


_ALPHA = {"alpha": "alpha"}
_GROUP = {"block_size": "block_size"}

# quantize.algo -> its quantizer: the tensorrt_llm target's one algo table (TRT-LLM examples/quantization
# quantize_by_modelopt.py, §3, for the checkpoint algos)
QUANTIZERS: dict[str, ModeloptQuantizer] = {
    "none": ModeloptQuantizer(ModeloptOptions, summary="nothing quantized (a quantized KV cache alone, or the FP "
                                                       "baseline)"),
    "int8_sq": ModeloptQuantizer(ModeloptSmoothQuantOptions, _ALPHA, checkpoint_algo="W8A8_SQ_PER_CHANNEL",
                                 preset="INT8_SMOOTHQUANT_CFG",
                                 summary="SmoothQuant: int8 weights per channel, int8 activations per tensor"),
    # per-token activation scales: ModelOpt's int8_sq export rewritten into the plugin layout (sq_per_token.py)
    "int8_sq_per_token": ModeloptQuantizer(ModeloptSmoothQuantPerTokenOptions, _ALPHA,
                                           checkpoint_algo="W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
                                           preset="INT8_SMOOTHQUANT_CFG", per_token=True,
                                           summary="SmoothQuant with int8 activations per token (TensorRT-LLM's "
                                                   "plugin path)"),
    "int8_wo": ModeloptQuantizer(ModeloptOptions, checkpoint_algo="W8A16", preset="INT8_WEIGHT_ONLY_CFG",
                                 fake_quant_export=False, summary="int8 weights, 16-bit activations"),
    "int4_wo": ModeloptQuantizer(ModeloptInt4Options, _GROUP, checkpoint_algo="W4A16",
                                 preset="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", fake_quant_export=False,
                                 summary="int4 weights per group, 16-bit activations"),
    "int4_awq": ModeloptQuantizer(ModeloptInt4Options, _GROUP, checkpoint_algo="W4A16_AWQ", preset="INT4_AWQ_CFG",
                                  summary="int4 weights per group, AWQ-scaled"),
    # asymmetric int4 groups with zero points, in the layout of ModelOpt's AWQ export (raw packed codes, which
    # TensorRT-LLM interleaves at load) with has_zero_point on and pre_quant_scale off (pipeline/trtllm/int4_zp.py);
    # the blockwise weight quantizers, given the asymmetric grid by the quantize stage (pipeline/quant/zero_point.py)
    "int4_zp": ModeloptQuantizer(ModeloptInt4ZpOptions, _GROUP, checkpoint_algo="W4A16_AWQ",
                                 preset="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", fake_quant_export=False, zero_point=True,
                                 group_sizes=GROUPWISE_SIZES,
                                 summary="int4 weights per group with zero points, 16-bit activations"),
    "fp8": ModeloptQuantizer(ModeloptOptions, checkpoint_algo="FP8", preset="FP8_DEFAULT_CFG", min_sm=FP8_MIN_SM,
                             summary="FP8 (E4M3) weights and activations, per tensor"),
    # rowwise FP8: per-output-channel E4M3 weight scales (axis 0), per-token dynamic E4M3 activation scales
    # (ModelOpt's FP8_PC_PT export is the layout Fp8RowwiseLinear loads; contract.py RULE_FP8_PC_PT)
    "fp8_pc_pt": ModeloptQuantizer(ModeloptFp8RowwiseOptions, checkpoint_algo="FP8_PER_CHANNEL_PER_TOKEN",
                                   preset="FP8_PER_CHANNEL_PER_TOKEN_CFG", min_sm=FP8_MIN_SM,
                                   summary="FP8 (E4M3) weights per channel, activations per token (rowwise)"),
}


def quantizer_of(quantize) -> ModeloptQuantizer:
    """The quantizer of a quantize section (method none quantizes nothing)."""
    return QUANTIZERS["none" if quantize.method == "none" else quantize.algo]


def effective_group_size(algo: str, block_size: int | None, info: ModelInfo | None) -> int | None:
    """The group size ``algo`` quantizes with for ``quantize.block_size`` (None: its quantizer's default for the
    model); None for an algo without groups. For callers that hold the section as a dict (checkpoint, build rules)."""
    qz = QUANTIZERS[algo]
    return qz.group_size(qz.options.model_validate({"block_size": block_size}), info) if qz.grouped else None


def needs_sm(algo: str, kv_cache: str = "none") -> int | None:
    """Lowest compute capability (89 = 8.9) an engine of this quantize setting runs on; None = any GPU."""
    return QUANTIZERS[algo].needs_sm(kv_cache)
