"""Quantize forge's FP32 ONNX graph for TensorRT with ModelOpt's ONNX PTQ (``modelopt.onnx.quantization``).

TensorRT's ONNX parser takes explicit quantization as standard ``QuantizeLinear``/``DequantizeLinear`` pairs
(QDQ), not ONNX Runtime's ``MatMulInteger``/``DynamicQuantizeLinear``/``com.microsoft.MatMulNBits``. ModelOpt
writes QDQ INT8 or FP8 (E4M3) around the chosen MatMuls, calibrated on ONNX Runtime's CPU provider, and converts
the rest of the graph to the precision the engine runs in (``build.tensorrt.precision``: fp16 or fp32). The
result is the exact graph the strongly typed TensorRT build compiles, and ONNX Runtime's CPU provider runs it too,
so its accuracy is measured here (stage ``evaluate_qdq``) before any GPU time is spent.

What is quantized. Exploration on SmolLM2-135M (wiki eval 4 x 256 tokens vs the FP32 graph on ONNX Runtime CPU,
2-core x86_64 with AVX-512 VNNI + AMX; calibration 8 x 128 sotu tokens):

=============================================================================  =========  ======
setting                                                                         ppl delta  top-1
=============================================================================  =========  ======
int8, ModelOpt's default op types (Add/Mul/Pow... as well), max calibration     +1.4e17 %  0.1 %
int8, every MatMul (attention's activation x activation ones too), max          +186 %     44 %
int8, weight MatMuls without down_proj and lm_head, max                         +15.9 %    75 %
int8, SmoothQuant 0.5 + weight MatMuls, entropy (down_proj in int8)              +24.4 %    74 %
int8, SmoothQuant 0.5 + weight MatMuls without down_proj, entropy, fp16 rest     +2.7 %     90.9 %  <- default
fp8, weight MatMuls (down_proj too), max, fp16 rest                             +4.0 %     87.4 %  <- default
=============================================================================  =========  ======

With the recipe's own settings (``smollm2-135m-trt-int8``: calibration 32 x 256, evaluate_qdq on wiki 8 x 256 +
Austen 4 x 256 vs FP32 torch, same machine) the INT8 graph measures ppl +1.22 %, top-1 90.5 %, logits cosine
0.994; FP8 (``smollm2-135m-trt-fp8``) ppl +2.69 %, top-1 87.8 %, cosine 0.985 (gates 5 % / 85 %).

So only weight MatMuls are quantized (``q/k/v/o``, ``gate/up/down``); attention's activation-by-activation MatMuls
and the tied ``lm_head`` (its weight is the embedding, not an initializer of the MatMul) stay in ``precision``.
``down_proj`` inputs carry outlier channels (~2000x the median, layer 11) that per-tensor static INT8 cannot hold,
even after SmoothQuant; FP8's exponent holds them.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ..errors import ForgeError
from ..gpus import FP8_MIN_SM
from ..quantizer import Quantizer
from ..recipe_options import NoOptions, TensorrtFp8Options, TensorrtInt8Options, TensorrtOptions

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx_data"     # ModelOpt's name for the external weights of its output
QUANT_FILE = "tensorrt_quant.json"
# quantize.algo -> its quantizer (pipeline/quantizer.py: typed options, the GPU it needs): the tensorrt target's one
# algo table
QUANTIZERS = {
    "none": Quantizer(NoOptions, summary="the FP32 graph in build.tensorrt.precision, no QDQ"),
    "int8": Quantizer(TensorrtInt8Options, summary="QDQ INT8 around the weight MatMuls (static, per tensor)"),
    "fp8": Quantizer(TensorrtFp8Options, min_sm=FP8_MIN_SM, summary="QDQ FP8 (E4M3) around the weight MatMuls"),
}
TRT_UNPARSABLE = {"MatMulInteger", "DynamicQuantizeLinear", "MatMulNBits", "DynamicQuantizeMatMul", "QLinearMatMul"}


def module_of(node) -> str:
    """The torch module a node was exported from (the dynamo exporter's name scopes); the node name when absent."""
    from ..ort.quantize import module_name
    return module_name(node)


def weight_matmuls(model) -> list:
    """MatMul nodes whose B input is an initializer: the model's linear layers."""
    inits = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def _calibration_feeds(model, windows: np.ndarray) -> dict[str, np.ndarray]:
    """Prefill feeds for every graph input (empty KV cache), stacked over the calibration windows."""
    n, t = windows.shape
    feeds = {}
    for inp in model.graph.input:
        name = inp.name
        if name == "input_ids":
            feeds[name] = windows.astype(np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((n, t), np.int64)
        elif name == "position_ids":
            feeds[name] = np.broadcast_to(np.arange(t, dtype=np.int64), (n, t)).copy()
        elif name.startswith("past_key_values."):
            dims = inp.type.tensor_type.shape.dim
            kv, hd = dims[1].dim_value, dims[3].dim_value
            feeds[name] = np.zeros((n, kv, 0, hd), np.float32)
        else:
            raise ForgeError(f"quantize: the ONNX graph has an input {name!r} that forge's export does not write")
    return feeds


def _shapes_spec(feeds: dict[str, np.ndarray], batch: int) -> str:
    """ModelOpt's ``calibration_shapes``: each input's shape for one calibration step (``name:1x2x3,...``)."""
    return ",".join(f"{k}:" + "x".join(str(batch if j == 0 else d) for j, d in enumerate(v.shape))
                    for k, v in feeds.items())


def _save(model, out_dir: Path) -> Path:
    import onnx
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / MODEL_FILE
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=DATA_FILE, size_threshold=1024)
    return path


def _qdq_summary(model) -> dict:
    ops = [n.op_type for n in model.graph.node]
    prod = {o: n for n in model.graph.node for o in n.output}
    quantized = [n.name for n in model.graph.node if n.op_type == "MatMul"
                 and any(prod.get(i) is not None and prod[i].op_type == "DequantizeLinear" for i in n.input)]
    bad = sorted({n.op_type for n in model.graph.node if n.op_type in TRT_UNPARSABLE or n.domain not in ("", "ai.onnx")})
    if bad:
        raise ForgeError(f"quantize: the TensorRT graph holds operators TensorRT's ONNX parser does not take: {bad}")
    return {"quantize_linear": ops.count("QuantizeLinear"), "dequantize_linear": ops.count("DequantizeLinear"),
            "quantized_matmuls": len(quantized)}


def quantize_for_tensorrt(fp32_dir: str | Path, out_dir: str | Path, *, algo: str, precision: str,
                          calib_windows=None, options: TensorrtOptions | None = None, batch: int = 4,
                          threads: int = 2) -> dict:
    """Write ``out_dir/model.onnx`` (+ ``model.onnx_data``): forge's FP32 graph with QDQ ``algo`` (int8 | fp8 | none)
    around its weight MatMuls, the rest in ``precision`` (fp16 | fp32), plus the tokenizer/config side files.
    Returns metrics (what was quantized, how, how long)."""
    import onnx

    from ..ort.export import META_FILE, copy_side_files

    fp32_dir, out_dir = Path(fp32_dir), Path(out_dir)
    if precision not in ("fp16", "fp32"):
        raise ForgeError(f"build.tensorrt.precision {precision!r}: the QDQ graph must also run on ONNX Runtime's CPU "
                         "provider (for evaluate_qdq), which has fp32 and fp16 kernels; use fp16 or fp32")
    src = fp32_dir / MODEL_FILE
    if not src.exists():
        raise ForgeError(f"quantize: no {MODEL_FILE} in {fp32_dir}; run the export stage first")
    t0 = time.time()
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = options or TensorrtOptions()
    model = onnx.load(str(src), load_external_data=True)
    info: dict = {"algo": algo, "precision": precision, "quantizer": "modelopt.onnx.quantization"}
    with tempfile.TemporaryDirectory(prefix="forge-trt-quant-") as td:
        if algo == "none":
            if precision == "fp16":
                from modelopt.onnx.autocast import convert_to_f16
                # the exporter's value_info hints disagree with each other (rotary half-dims); carried into the fp16
                # graph they make ONNX Runtime reuse a buffer of the wrong shape. ModelOpt's quantize path drops
                # them too (clear_stale_value_info); shapes are re-inferred.
                del model.graph.value_info[:]
                model = convert_to_f16(model, low_precision_type="fp16", keep_io_types=True)
            _save(model, out_dir)
        elif algo in ("int8", "fp8"):
            if calib_windows is None:
                raise ForgeError(f"quantize.algo {algo} for the tensorrt target needs calibration data "
                                 "(quantize.calibration)")
            windows = np.asarray(calib_windows.numpy() if hasattr(calib_windows, "numpy") else calib_windows)
            lin = weight_matmuls(model)
            keep = [n for n in lin if not any(fnmatch.fnmatch(module_of(n), p) or fnmatch.fnmatch(n.name, p)
                                              for p in opts.exclude)]
            info.update({"weight_matmuls": len(lin), "excluded": [module_of(n) for n in lin if n not in keep],
                         "calibration_method": opts.calibration_method, "smoothquant_alpha": opts.smoothquant_alpha})
            if not keep:
                raise ForgeError(f"quantize.options.exclude {opts.exclude} leaves no MatMul to quantize")
            names = [n.name for n in keep]      # node names survive smoothing and ModelOpt's passes
            if opts.smoothquant_alpha is not None:
                info["smoothquant"] = _smooth(model, fp32_dir, windows, opts.smoothquant_alpha, threads)
            staged = _save(model, Path(td) / "in")   # ModelOpt writes intermediates beside its input: not the cache
            feeds = _calibration_feeds(model, windows)
            del model
            _modelopt_quantize(staged, out_dir / MODEL_FILE, algo=algo, precision=precision, feeds=feeds,
                               batch=min(batch, windows.shape[0]), method=opts.calibration_method, nodes=names)
            model = onnx.load(str(out_dir / MODEL_FILE), load_external_data=False)
            info.update(_qdq_summary(model))
        else:
            raise ForgeError(f"quantize.algo {algo!r} is not available for build.target 'tensorrt' (none, int8, fp8)")
    copy_side_files(fp32_dir, out_dir)
    meta = json.loads((out_dir / META_FILE).read_text()) if (out_dir / META_FILE).exists() else {}
    meta["quantization"] = info
    if algo == "fp8":
        # ONNX Runtime's CPU provider has no FP8 kernels: its QDQ fusions (the "MatMul" rule -> MatMulIntegerToFloat,
        # the "drop" rule that moves Q/DQ off Transpose/Reshape) still match E4M3 Q/DQ and leave an invalid graph
        # (onnxruntime/core/optimizer/qdq_transformer/selectors_actions/qdq_selector_action_transformer.cc,
        # MatMulQDQRules / DropQDQNodesRules, microsoft/onnxruntime@008eeb96). Run the Q/DQ as written instead.
        meta["ort_session_config"] = {"session.disable_quant_qdq": "1"}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    (out_dir / QUANT_FILE).write_text(json.dumps(info, indent=1, default=float))
    size = sum(p.stat().st_size for p in (out_dir / MODEL_FILE, out_dir / DATA_FILE) if p.exists())
    fp32_size = sum(p.stat().st_size for p in fp32_dir.glob(MODEL_FILE + "*"))
    return {**{k: v for k, v in info.items() if k not in ("smoothquant", "excluded")},
            "excluded": len(info.get("excluded", [])), "quantize_s": round(time.time() - t0, 2),
            "model_bytes": size, "size_ratio": round(size / fp32_size, 4) if fp32_size else None}


def _smooth(model, fp32_dir: Path, windows: np.ndarray, alpha: float, threads: int) -> dict:
    """SmoothQuant folded into the FP32 weights (forge's ONNX implementation, shared with the onnxruntime target):
    per-channel activation maxima over the calibration windows, then the exact fold into RMSNorm / up_proj."""
    from ..ort.quantize import activation_stats, smooth_fold

    acts = sorted({n.input[0] for n in weight_matmuls(model)})
    stats = activation_stats(fp32_dir, windows, tensors=acts, threads=threads)
    done = smooth_fold(model, {t: s["channel_absmax"] for t, s in stats.items()}, float(alpha))
    return {"tensors": len(done), "act_absmax_before": max((v["act_absmax_before"] for v in done.values()), default=None),
            "act_absmax_after": max((v["act_absmax_after"] for v in done.values()), default=None)}


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _modelopt_quantize(src: Path, dst: Path, *, algo: str, precision: str, feeds: dict, batch: int, method: str,
                       nodes: list[str]) -> None:
    try:
        from modelopt.onnx.quantization import quantize
    except ImportError as e:
        raise ForgeError(f"ModelOpt's ONNX quantizer is not importable ({e}); install forge's dependencies: "
                         "pip install -e . (onnx-graphsurgeon, onnxslim, lief, polygraphy)") from None
    # ModelOpt's MinMax calibrator asks NVML how many GPUs to shrink memory arenas on and logs an ERROR when there
    # is none; calibration runs on the CPU provider here by design, so that line is dropped
    no_gpu_alarm = _DropMessage("Failed to get GPU count")
    logging.getLogger("modelopt.onnx").addFilter(no_gpu_alarm)
    try:
        quantize(str(src), quantize_mode=algo, calibration_data=feeds, calibration_shapes=_shapes_spec(feeds, batch),
                 calibration_method=method, calibration_eps=["cpu"],     # ONNX Runtime's CPU provider calibrates
                 op_types_to_quantize=["MatMul"], nodes_to_quantize=[f"^{re.escape(n)}$" for n in nodes],
                 high_precision_dtype=precision, use_external_data_format=True, output_path=str(dst),
                 log_level="WARNING")
    finally:
        logging.getLogger("modelopt.onnx").removeFilter(no_gpu_alarm)
    if not dst.exists():
        raise ForgeError(f"ModelOpt's ONNX quantizer wrote no {dst.name}")
    for extra in dst.parent.glob("*.onnx"):
        if extra != dst:
            extra.unlink()
