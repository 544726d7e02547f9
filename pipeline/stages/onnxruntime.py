"""Stages of the onnxruntime target: export -> quantize -> build -> evaluate -> package."""

from __future__ import annotations

import json

from .base import Stage, StageContext, cpu_hardware, payload_bytes
from .common import calibration_windows, model_dir, set_digests, tokenizer
from .evaluate import EvaluateBase

ORT_TOOLS = ("onnx", "onnxruntime")


class OrtExport(Stage):
    name = "export"
    version = "2"   # 2: GroupQueryAttention graph with an in-place KV cache (export.attention), parity via the runtime
    needs = ("source",)
    tools = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime")
    description = "HF -> ONNX (KV cache I/O), onnx.checker, ORT-vs-torch parity"

    def config(self, r):
        from ..recipe import export_attention
        return {**r.export.model_dump(), "attention": export_attention(r)}

    def output_bytes(self, r, info, inputs):
        return int(info.num_params * 4 * 1.05) if info else None    # fp32 external data + graph

    def run(self, ctx: StageContext) -> dict:
        from ..ort.export import export_onnx
        from ..recipe import export_attention
        e = ctx.recipe.export
        return export_onnx(model_dir(ctx), ctx.out, opset=e.opset, attention=export_attention(ctx.recipe),
                           max_seq=e.max_seq_len, parity={k: v.model_dump() for k, v in e.parity.items()})


class OrtQuantize(Stage):
    name = "quantize"
    version = "2"   # 2: int4_wo defaults to HQQ with an 8-bit lm_head
    needs = ("export", "source")
    tools = ("onnx", "onnxruntime", "torch")
    description = "ONNX Runtime quantization (INT8 / INT4 weight-only), calibrated on the recipe's data"

    def config(self, r):
        q = r.quantize
        cfg = {"method": q.method, "algo": q.algo, "alpha": q.alpha, "block_size": q.block_size, "options": q.options}
        if q.algo != "none":
            cfg["calibration"] = q.calibration.model_dump()
        return cfg

    def data(self, r, home):
        q = r.quantize
        return set_digests(r, [(q.calibration.set, q.calibration.split)]) if q.algo != "none" else {}

    def output_bytes(self, r, info, inputs):
        return payload_bytes(inputs["export"]) if "export" in inputs else None    # at most the fp32 graph

    def hardware(self, r):
        return cpu_hardware()

    def plan_problems(self, r, info):
        """int4: ORT's MatMulNBits takes a power-of-two block >= 16; forge also wants it to divide every quantized
        linear's input width (a partial last block is padded and quantized with padding: a silent accuracy cost)."""
        q = r.quantize
        if q.algo != "int4_wo" or info is None:
            return []
        from ..quant.configs import linear_input_widths
        key, block = (("quantize.options.block_size", q.options["block_size"]) if "block_size" in q.options
                      else ("quantize.block_size", q.block_size or 32))
        if not isinstance(block, int) or isinstance(block, bool) or block < 16 or block & (block - 1):
            return [f"{key}: {block!r} is not a power of two >= 16 (ONNX Runtime's MatMulNBits block sizes: 16, 32, "
                    "64, 128, 256)"]
        widths = {**linear_input_widths(info), "lm_head": info.hidden_size}
        bad = {k: w for k, w in widths.items() if w % block}
        if bad:
            ok = [b for b in (16, 32, 64, 128, 256) if all(w % b == 0 for w in widths.values())]
            return [f"{key}: {block} does not divide the input width of " + ", ".join(f"{k} ({w})" for k, w in bad.items())
                    + f"; block sizes that divide every width of this model: {', '.join(map(str, ok)) or 'none'}"]
        return []

    def run(self, ctx: StageContext) -> dict:
        from ..ort.quantize import quantize_onnx
        q = ctx.recipe.quantize
        calib = calibration_windows(ctx) if q.algo != "none" else None
        opts = dict(q.options)
        if q.alpha is not None:
            opts.setdefault("alpha", q.alpha)
        if q.block_size is not None:
            opts.setdefault("block_size", q.block_size)
        opts.setdefault("batch", q.calibration.batch)
        return quantize_onnx(ctx.inputs["export"], ctx.out, algo=q.algo, calib_windows=calib, options=opts)


class OrtBuildStage(Stage):
    name = "build"
    version = "1"
    needs = ("quantize", "source")
    tools = ORT_TOOLS
    description = "ONNX Runtime graph optimisations applied and saved, session options recorded"

    def config(self, r):
        return r.build.onnxruntime.model_dump()

    def output_bytes(self, r, info, inputs):
        return payload_bytes(inputs["quantize"]) if "quantize" in inputs else None

    def hardware(self, r):
        return cpu_hardware()   # optimised graphs may hold hardware-specific fusions

    def run(self, ctx: StageContext) -> dict:
        import numpy as np
        from .. import data as datasets
        from ..ort.optimize import optimize
        b = ctx.recipe.build.onnxruntime
        # check on real text (our own prompt list): random ids give atypical activations to quantized graphs
        tok = tokenizer(str(model_dir(ctx)))
        ids = np.array([sum((tok(p, add_special_tokens=False)["input_ids"] for p in datasets.load_prompts()), [])])
        return optimize(ctx.inputs["quantize"], ctx.out, level=b.opt_level, threads=b.intra_op_threads, check_ids=ids)


class OrtEvaluate(EvaluateBase):
    name = "evaluate"
    needs = ("build", "source")
    tools = ("torch", "transformers", "onnxruntime")
    subject = "onnxruntime engine"
    description = "ONNX Runtime engine vs FP32 torch: perplexity, top-1, logits, greedy generation"

    def candidate(self, ctx):
        from ..ort.engine import OrtEngine
        return OrtEngine(ctx.inputs["build"], threads=ctx.recipe.build.onnxruntime.intra_op_threads)


class OrtPackage(Stage):
    name = "package"
    version = "3"   # 2: BLS model calls every model with exec(decoupled=True); 3: manifest.json without a creation timestamp (same inputs, same digest)
    needs = ("build", "validate", "evaluate", "source")
    tools = ORT_TOOLS
    description = "Triton model repository (ensemble text in / text out) + manifest.json"
    hands_off = True

    def output_bytes(self, r, info, inputs):
        return payload_bytes(inputs["build"]) + payload_bytes(inputs["source"]) if "build" in inputs else None

    def config(self, r):
        return {"triton": r.package.triton.model_dump(), "recipe": r.name, "recipe_hash": r.hash}

    def run(self, ctx: StageContext) -> dict:
        from ..triton.repo_onnxruntime import write_onnxruntime_repo
        from .manifest import manifest_info
        from ..triton.manifest import write_manifest
        evaluation = json.loads((ctx.inputs["evaluate"] / "metrics.json").read_text())
        res = write_onnxruntime_repo(ctx.out, engine_dir=ctx.inputs["build"], tokenizer_dir=ctx.inputs["source"] / "tokenizer",
                                     recipe=ctx.recipe.to_dict(), metrics=evaluation)
        write_manifest(ctx.out, manifest_info(ctx, target="cpu", evaluation=evaluation))
        return res or {}
