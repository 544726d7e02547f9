"""Stages of the onnxruntime target: export -> quantize -> build -> evaluate -> package."""

from __future__ import annotations

import json

from .base import Stage, StageContext, cpu_hardware, cpu_isa_hardware, payload_bytes
from .common import calibration_digests, calibration_windows, model_dir, tokenizer
from .evaluate import EvaluateBase
from .package import PackageStage

ORT_TOOLS = ("onnx", "onnxruntime")


# ---- build.onnxruntime.provider: cuda -- the stages that run the engine run on the GPU and their keys name it
def on_cuda(r) -> bool:
    return r.build.onnxruntime.provider == "cuda"


def cuda_missing(r) -> str | None:
    """Why this machine cannot run a CUDA-provider stage (None when it can)."""
    if not on_cuda(r):
        return None
    from ..host.cuda import ort_cuda_status
    return ort_cuda_status()["problem"]


def cuda_finish_hint(r, stage: str) -> str:
    return (f"FORGE_CACHE=<this cache> forge build {r.name} --from {stage}  (on a machine with an NVIDIA GPU and "
            "onnxruntime-gpu: `make setup` there installs it, or `python -m pipeline.gpu_setup install`; "
            "`forge doctor` says what it finds)")


def cuda_tools(comps: dict) -> dict:
    """The onnxruntime that runs a CUDA stage is onnxruntime-gpu (same module name as the CPU wheel, and both may be
    installed): the key records the version of the module actually imported and the GPU wheel's distribution."""
    from ..host.tools import tool_version
    try:
        import onnxruntime as ort
        comps["tools"]["onnxruntime"] = ort.__version__
    except Exception:  # noqa: BLE001 - absent: the stage cannot run here anyway
        pass
    comps["tools"]["onnxruntime-gpu"] = tool_version("onnxruntime-gpu") or "absent"
    return comps


def streams_fp16(r) -> bool:
    """Whether the recipe's graph is written in fp16 straight from the weights (pipeline/ort/stream_export.py, issue
    38): build.onnxruntime.provider cuda with precision fp16 and the GroupQueryAttention export. Every other recipe
    exports fp32 through torch.export, as before, with the keys it had."""
    from ..recipe import export_attention
    return r.build.target == "onnxruntime" and on_cuda(r) and r.build.onnxruntime.precision == "fp16" \
        and export_attention(r) == "gqa"


class CudaAware:
    """build / evaluate / package of a recipe with build.onnxruntime.provider: cuda: keyed by the GPU, need a usable
    CUDA provider (exit 3 with the command to finish elsewhere)."""

    def hardware(self, r):
        from ..host.gpu import cuda_hardware
        return cuda_hardware() if on_cuda(r) else super().hardware(r)

    def missing(self, r):
        return cuda_missing(r) or super().missing(r)

    def finish_hint(self, r):
        return cuda_finish_hint(r, self.name) if on_cuda(r) else super().finish_hint(r)

    def components(self, r, home, upstream):
        comps = super().components(r, home, upstream)
        return cuda_tools(comps) if on_cuda(r) else comps


class OrtExport(Stage):
    """HF -> ONNX (KV cache I/O), onnx.checker, ORT-vs-torch parity. The CUDA fp16 recipes' graph is written in fp16
    tensor by tensor (streams_fp16); the others are exported in fp32 by torch.export."""
    name = "export"
    version = "2"   # 2: GroupQueryAttention graph with an in-place KV cache (export.attention), parity via the runtime
    needs = ("source",)
    tools = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime")

    def config(self, r):
        from ..recipe import export_attention
        cfg = {**r.export.model_dump(), "attention": export_attention(r)}
        if streams_fp16(r):   # only these recipes' keys name the writer (the fp32 recipes keep theirs)
            from ..ort.stream_export import DEFAULT_FP16_PARITY, WRITER
            tol = r.export.parity.get("fp16")
            cfg.update(writer=WRITER, dtype="fp16",
                       parity_fp16=tol.model_dump() if tol is not None else dict(DEFAULT_FP16_PARITY))
        return cfg

    def components(self, r, home, upstream):
        comps = super().components(r, home, upstream)
        if streams_fp16(r):   # the writer reads the weights with safetensors and loads the reference with accelerate
            from ..host.tools import tool_label, tool_version
            comps["tools"].update({tool_label(t): tool_version(t) or "absent" for t in ("safetensors", "accelerate")})
        return comps

    def output_bytes(self, r, info, inputs):
        # fp16 or fp32 external data + graph
        return int(info.num_params * (2 if streams_fp16(r) else 4) * 1.05) if info else None

    def run(self, ctx: StageContext) -> dict:
        from ..recipe import export_attention
        e = ctx.recipe.export
        parity = {k: v.model_dump() for k, v in e.parity.items()}
        if streams_fp16(ctx.recipe):
            from ..ort.stream_export import export_fp16_stream
            # every core: the parity engine casts each fp16 weight to fp32 on the CPU provider (a 7B model: 15 GB)
            return export_fp16_stream(model_dir(ctx), ctx.out, opset=e.opset, max_seq=e.max_seq_len, parity=parity,
                                      reference="auto", threads=0)
        from ..ort.export import export_onnx
        return export_onnx(model_dir(ctx), ctx.out, opset=e.opset, attention=export_attention(ctx.recipe),
                           max_seq=e.max_seq_len, parity=parity)


def ort_options(q):
    """The options model of quantize.algo filled from the quantize section (quantize.options, and quantize.block_size
    as the option it stands for: pipeline/targets/onnxruntime.py), what ONNX Runtime's quantizer receives."""
    from .. import target_registry as registry
    return registry.get("onnxruntime").quantize_options(q)


def ort_calibrates(q) -> bool:
    """int8 reads calibration data (SmoothQuant's activation ranges), and int4_wo's fitted methods (fit, gptq: the
    activations' second moments); int4_wo HQQ / RTN read weights only, so their key leaves the calibration settings
    out and a calibration change does not rebuild them."""
    if q.algo == "int4_wo":
        from ..ort.quantize import INT4_CALIBRATED
        return ort_options(q).method in INT4_CALIBRATED
    return q.algo == "int8"


def simulation_spec(r) -> dict | None:
    """``validate.reference: simulated``: the grids the quantize stage writes (pipeline.ort.quantize.weight_grid),
    with the scales' type the built engine holds (fp16 after the CUDA build's conversion); None for fp32."""
    if r.validate_.reference != "simulated":
        return None
    from ..ort.quantize import weight_grid
    return weight_grid(r.quantize.algo, ort_options(r.quantize),
                       scale_dtype="float16" if r.build.onnxruntime.precision == "fp16" else "float32")


def simulation_problems(r) -> list[str]:
    """A recipe that asks for the simulated reference quantizes on a grid the simulation reproduces."""
    from ..errors import ForgeError
    try:
        simulation_spec(r)
    except ForgeError as e:
        return [str(e)]
    return []


class OrtQuantize(Stage):
    """ONNX Runtime quantization (INT8 / INT4 weight-only), calibrated on the recipe's data."""
    name = "quantize"
    version = "10"  # 10: int4_wo packs q/k/v and gate/up too (zero points padded per row concatenate whole); 9: int8 blockwise packs gate/up too (one MatMulNBits and a Split; the same logits); 8: int8 blockwise packs q/k/v (pipeline/ort/pack_qkv.py; the same logits); 7: int8 per_token and options.prefill (the U8U8 session option only where u8 x s8 saturates); 6: int4_wo's lm_head_bits applies to an untied lm_head too (one rule for both quantizers and the simulation); 5: the engine metadata records batch_invariant (issue 28); 2: int4_wo defaults to HQQ with an 8-bit lm_head; 3: quantize.alpha applies (as smoothquant_alpha); 4: int8 dynamic weights 7-bit (reduce_range, issue 11)
    needs = ("export", "source")
    tools = ("onnx", "onnxruntime", "torch")

    def config(self, r):
        q = r.quantize
        cfg = {"method": q.method, "algo": q.algo, "alpha": q.alpha, "block_size": q.block_size, "options": q.options}
        if ort_calibrates(q):
            cfg["calibration"] = q.calibration.model_dump()
        if streams_fp16(r) and q.algo != "none":
            cfg["quantizer"] = "stream"   # pipeline/ort/stream_quantize.py, weight by weight
        if q.algo == "int8" and "per_token" in (ort_options(q).method, ort_options(q).prefill):
            # the per-token graph's own revision: a change to it rebuilds the recipes that make one, not every one
            from ..ort.per_token import LAYOUT
            cfg["per_token_layout"] = LAYOUT
        return cfg

    def data(self, r, home):
        return calibration_digests(r) if ort_calibrates(r.quantize) else {}

    def output_bytes(self, r, info, inputs):
        return payload_bytes(inputs["export"]) if "export" in inputs else None    # at most the fp32 graph

    def hardware(self, r):
        # Portable across ISA classes: the quantized graph is a file for every CPU. Calibration runs ORT's FP32
        # kernels, whose last bits differ between ISAs, but no quantization decision depends on them in a way
        # that matters: each ISA class measures the engine itself in build/evaluate, which are keyed by it.
        return cpu_hardware()

    def plan_problems(self, r, info):
        """int4: the block must divide every quantized linear's input width (ORT would pad a partial last block and
        quantize the padding with it: a silent accuracy cost). Its form (a power of two >= 16) is the schema's."""
        if r.quantize.algo != "int4_wo" or info is None:
            return []
        key = "quantize.block_size"
        block = ort_options(r.quantize).block_size
        widths = {**info.linear_input_widths(), "lm_head": info.hidden_size}
        bad = {k: w for k, w in widths.items() if w % block}
        if bad:
            ok = [b for b in (16, 32, 64, 128, 256) if all(w % b == 0 for w in widths.values())]
            return [f"{key}: {block} does not divide the input width of " + ", ".join(f"{k} ({w})" for k, w in bad.items())
                    + f"; block sizes that divide every width of this model: {', '.join(map(str, ok)) or 'none'}"]
        return []

    def run(self, ctx: StageContext) -> dict:
        from ..ort.quantize import quantize_onnx
        q = ctx.recipe.quantize
        if streams_fp16(ctx.recipe) and q.algo != "none":
            from ..ort.stream_quantize import quantize_stream
            return quantize_stream(ctx.inputs["export"], ctx.out, algo=q.algo, options=ort_options(q))
        calib = calibration_windows(ctx) if ort_calibrates(q) else None
        return quantize_onnx(ctx.inputs["export"], ctx.out, algo=q.algo, calib_windows=calib, options=ort_options(q))


class OrtBuildStage(CudaAware, Stage):
    """ONNX Runtime graph optimisations applied and saved, session options recorded."""
    name = "build"
    out_link = "engine"
    # 2: fp16 (CUDA) graphs with fused RMSNorms and packed QKV (the fp16 norm-statistics overflow)
    # 3: CPU graphs with fused RMSNorms and residual adds (SkipSimplifiedLayerNormalization, pipeline/ort/norms.py)
    # 4: CPU graphs take logits_start (a prompt computes the lm_head for the positions it reads; ort/logits_start.py)
    version = "4"
    needs = ("quantize", "source")
    tools = ORT_TOOLS
    section = "build.onnxruntime"

    def config(self, r):
        return r.build.onnxruntime.build_config()   # CPU recipes' keys as before provider/precision existed

    def output_bytes(self, r, info, inputs):
        if "quantize" not in inputs:
            return None
        # the engine, and on the CPU a copy of the graph with its norms fused while ORT optimises it (ort/norms.py)
        return payload_bytes(inputs["quantize"]) * (1 if on_cuda(r) else 2)

    def hardware(self, r):
        if on_cuda(r):   # the graph the CUDA provider optimised (fusions) for this GPU
            return super().hardware(r)
        # ORT's optimiser consults the CPU's kernels (e.g. rewrites for machines whose u8s8 GEMM saturates)
        return cpu_isa_hardware()

    def run(self, ctx: StageContext) -> dict:
        import shutil
        import tempfile

        import numpy as np
        from .. import data as datasets
        from ..ort.optimize import optimize
        b = ctx.recipe.build.onnxruntime
        # check on real text (our own prompt list): random ids give atypical activations to quantized graphs
        tok = tokenizer(str(model_dir(ctx)))
        ids = np.array([sum((tok(p, add_special_tokens=False)["input_ids"] for p in datasets.load_prompts()), [])])
        src, fp16 = ctx.inputs["quantize"], {}
        if streams_fp16(ctx.recipe):   # written in fp16 by the export (norms fused, QKV packed): nothing to convert
            from ..ort.export import load_meta
            fp16 = load_meta(src).get("fp16") or {}
        tmp = tempfile.mkdtemp(prefix=".fp16-", dir=ctx.out.parent) \
            if b.precision == "fp16" and not streams_fp16(ctx.recipe) else None
        try:
            if tmp:   # fp16: converted here, then optimised by the provider it runs on
                from ..ort.fp16 import convert_fp16
                fp16 = convert_fp16(src, tmp)
                src = tmp
            metrics = optimize(src, ctx.out, level=b.opt_level, threads=b.intra_op_threads, check_ids=ids,
                               provider=b.provider)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        return {**metrics, "precision": b.precision, **({"fp16": fp16} if fp16 else {})}


class OrtEvaluate(CudaAware, EvaluateBase):
    """ONNX Runtime engine vs FP32 torch: perplexity, top-1, logits, greedy generation."""
    name = "evaluate"
    version = "2"   # 2: keyed by the CPU's ISA class, metrics record the CPU they were measured on
    needs = ("build", "source")
    tools = ("torch", "transformers", "onnxruntime")
    subject = "onnxruntime engine"

    def config(self, r):
        cfg = super().config(r)
        if on_cuda(r):   # CPU recipes keep their keys
            cfg["provider"], cfg["cuda_graph"] = "cuda", r.build.onnxruntime.cuda_graph
        if r.validate_.reference == "simulated":   # fp32 recipes keep their keys
            cfg["reference"] = {"kind": "simulated", "grid": simulation_spec(r)}
        return cfg

    def simulation(self, ctx, model_config) -> dict | None:
        spec = simulation_spec(ctx.recipe)
        if spec is None:
            return None
        # the engine's own record of what the quantizer did must be what is simulated
        from ..errors import ForgeError
        from ..ort.export import META_FILE
        q = json.loads((ctx.inputs["build"] / META_FILE).read_text()).get("quantization") or {}
        if q.get("algo") != spec["algo"] or bool(q.get("lm_head")) != bool(spec["lm_head"]):
            raise ForgeError(f"validate.reference simulated: the engine was quantized as {q} but the recipe's grid "
                             f"is {spec}; rebuild with `forge build {ctx.recipe.name} --force quantize`")
        spec["expect_quantized"] = q.get("quantized_matmuls")
        return spec

    def hardware(self, r):
        if on_cuda(r):
            return super().hardware(r)
        # ONNX Runtime's int8 kernels compute different numbers per ISA class (pipeline/host/cpu.py)
        return cpu_isa_hardware()

    def measured_on(self):
        from ..host.cpu import cpu_facts
        return cpu_facts()

    def reference_device(self, r):
        if on_cuda(r):
            import torch
            if torch.cuda.is_available():   # the FP32 reference on the same GPU
                return "cuda"
        return "cpu"

    def candidate(self, ctx):
        from ..ort.engine import OrtEngine
        b = ctx.recipe.build.onnxruntime
        if b.provider == "cuda":
            return OrtEngine(ctx.inputs["build"], providers=["CUDAExecutionProvider"], device="cuda",
                             cuda_graph=b.cuda_graph)
        return OrtEngine(ctx.inputs["build"], threads=b.intra_op_threads)


class OrtPackage(CudaAware, PackageStage):
    """Triton model repository (ensemble text in / text out) + manifest.json."""
    version = "9"   # 9: CUDA packages batch in flight (K/V rows in GPU slots, requests join between decode steps; issue 38); 8: decoupled: true streams (engine model decoupled, declares streaming; the BLS forwards its configured inputs; issue 28); 7: the manifest lists the repository's empty folders and no regression rules (issue 24); 6: dynamic INT8 engines answer Triton rows one at a time (batch-dependent activation scales); 2: BLS model calls every model with exec(decoupled=True); 3: manifest.json without a creation timestamp (same inputs, same digest); 4: the manifest records the engine's quantization and the ISA class it was validated on; 5: engine module with fixed-shape / CUDA-graph decode; provider cuda: KIND_GPU, the python model on the CUDA provider
    tools = ORT_TOOLS

    def write_repository(self, ctx, evaluation):
        from ..triton.repo_onnxruntime import write_onnxruntime_repo
        res = write_onnxruntime_repo(ctx.out, engine_dir=ctx.inputs["build"], tokenizer_dir=ctx.inputs["source"] / "tokenizer",
                                     recipe=ctx.recipe.package_dict(), metrics=evaluation)
        if on_cuda(ctx.recipe):
            from ..host.gpu import cuda_hardware
            b = ctx.recipe.build.onnxruntime
            return res, cuda_hardware(), {"provider": b.provider, "precision": b.precision, "cuda_graph": b.cuda_graph}
        return res, "cpu", {}

    def shipped_code(self):
        from ..triton.repo_onnxruntime import BATCHER_MODULE, DEFAULT_ENGINE_MODULE
        return super().shipped_code() + [DEFAULT_ENGINE_MODULE, BATCHER_MODULE]

    def manifest_extra(self, ctx):
        # what verify-deploy needs to judge the engine on another CPU (pipeline.ort.quantize.isa_accuracy_risk)
        from ..ort.export import META_FILE
        return {"quantization": json.loads((ctx.inputs["build"] / META_FILE).read_text()).get("quantization")}
