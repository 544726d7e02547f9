"""Stages of the tensorrt target:
export (ONNX, shared with onnxruntime) -> quantize (ModelOpt ONNX PTQ: QDQ INT8 / FP8, fp16 rest) ->
evaluate_qdq (that exact graph on ONNX Runtime's CPU provider vs FP32 torch) -> validate_qdq (the recipe's gates)
-> build (Polygraphy + TensorRT, GPU).

Everything up to validate_qdq runs on any machine, so a graph that would make a bad engine fails before GPU
time is spent; build stops here with what is missing and the command that finishes it."""

from __future__ import annotations

from ..host.gpu import gpu_sm
from .base import GpuStage, Stage, StageContext, cpu_hardware, payload_bytes
from .common import calibration_digests, calibration_windows, quantize_options, quantizer
from .evaluate import EvaluateBase
from .validate import ValidateStage

__all__ = ["TensorrtQuantize", "QdqEvaluate", "QdqValidate", "TensorrtBuildStage", "engine_sm"]


def engine_sm(r) -> int | None:
    """The GPU the engine is for: build.tensorrt.gpu_sm, else this machine's first GPU."""
    return TensorrtBuildStage().gpu_sm_setting(r) or gpu_sm()


class TensorrtQuantize(Stage):
    name = "quantize"
    version = "2"   # 2: an FP8 graph's forge_ort.json asks ONNX Runtime to run its Q/DQ unfused
    needs = ("export", "source")
    tools = ("onnx", "onnxruntime", "nvidia-modelopt", "onnx-graphsurgeon")
    description = "ModelOpt ONNX PTQ: QDQ INT8 / FP8 around the weight MatMuls, the rest in build.tensorrt.precision"

    def config(self, r):
        q = r.quantize
        cfg = {"quantizer": "modelopt.onnx", "algo": q.algo, "precision": r.build.tensorrt.precision}
        if q.algo != "none":
            cfg["options"] = quantize_options(r).model_dump()      # every option, defaults included
            cfg["calibration"] = q.calibration.model_dump()
        return cfg

    def data(self, r, home):
        return calibration_digests(r)

    def hardware(self, r):
        return cpu_hardware()       # calibrated on ONNX Runtime's CPU provider

    def output_bytes(self, r, info, inputs):
        return payload_bytes(inputs["export"]) if "export" in inputs else None    # at most the fp32 graph

    def run(self, ctx: StageContext) -> dict:
        from ..tensorrt.quantize import quantize_for_tensorrt
        r = ctx.recipe
        calib = calibration_windows(ctx) if r.quantize.algo != "none" else None
        return quantize_for_tensorrt(ctx.inputs["export"], ctx.out, algo=r.quantize.algo,
                                     precision=r.build.tensorrt.precision, calib_windows=calib,
                                     options=quantize_options(r), batch=r.quantize.calibration.batch)


class QdqEvaluate(EvaluateBase):
    name = "evaluate_qdq"
    needs = ("quantize", "source")
    tools = ("torch", "transformers", "onnxruntime")
    subject = "tensorrt target's QDQ ONNX graph on ONNX Runtime CPU (the graph TensorRT builds; not the engine)"
    description = "the quantized graph TensorRT will compile, run by ONNX Runtime's CPU provider, vs FP32 torch"

    def hardware(self, r):
        return cpu_hardware()

    def candidate(self, ctx):
        from ..ort.engine import OrtEngine
        return OrtEngine(ctx.inputs["quantize"], threads=0)   # ONNX Runtime's default: all cores


class QdqValidate(ValidateStage):
    name = "validate_qdq"
    needs = ("evaluate_qdq",)
    description = "gate the QDQ graph's accuracy on the recipe's thresholds before the GPU build"


class TensorrtBuildStage(GpuStage):
    name = "build"
    out_link = "engine"
    version = "2"   # 2: Polygraphy, strongly typed QDQ graph, context + generation profiles
    needs = ("quantize", "validate_qdq")
    tools = ("tensorrt", "polygraphy")
    description = "Polygraphy/TensorRT engine from the QDQ graph (strongly typed), timing cache per GPU SM"
    module = "tensorrt"

    @property
    def install_hint(self):
        from ..tensorrt.build import INSTALL_HINT
        return INSTALL_HINT

    gpu_sm_key = "build.tensorrt.gpu_sm"

    def gpu_sm_setting(self, r):
        return r.build.tensorrt.gpu_sm

    def config(self, r):
        return r.build.tensorrt.model_dump()

    def output_bytes(self, r, info, inputs):
        return payload_bytes(inputs["quantize"]) if "quantize" in inputs else None   # the engine holds the weights

    def finish_hint(self, r):
        return (f"forge build {r.name} --from build  (on a GPU machine with `pip install -e '.[tensorrt]'`, "
                "sharing FORGE_CACHE so export/quantize/validate_qdq are cache hits)")

    def plan_problems(self, r, info):
        p = []
        b, algo = r.build.tensorrt, r.quantize.algo
        need, sm = quantizer(r).min_sm, engine_sm(r)
        if need and sm is None:
            p.append(f"quantize.algo '{algo}' makes an engine that needs a GPU with SM >= {need} (Ada/Hopper) and no GPU "
                     f"is visible here to say which one it is for: set build.tensorrt.gpu_sm (e.g. 89 or 90)")
        elif need and sm < need:
            where = "build.tensorrt.gpu_sm" if b.gpu_sm else "this machine's GPU"
            p.append(f"quantize.algo '{algo}' needs SM >= {need} (Ada/Hopper) but {where} is SM {sm}: use algo int8, "
                     f"or set build.tensorrt.gpu_sm to the SM of a GPU that has FP8")
        if info is not None and b.max_seq_len > info.max_position_embeddings:
            p.append(f"build.tensorrt.max_seq_len = {b.max_seq_len} exceeds the model's max_position_embeddings "
                     f"({info.max_position_embeddings}); lower it")
        return p

    def run(self, ctx: StageContext) -> dict:
        from ..tensorrt.build import build_tensorrt_engine
        return build_tensorrt_engine(ctx.inputs["quantize"], ctx.out, ctx.recipe.build.tensorrt.model_dump(),
                                     timing_cache_dir=ctx.home / "timing_cache" / self.hardware(ctx.recipe))
