"""Stages of the tensorrt_llm target:
quantize (ModelOpt) -> checkpoint (TP/PP) -> evaluate_checkpoint (reference numerics, CPU) -> validate_checkpoint
-> build (trtllm-build, GPU) -> evaluate (TensorRT-LLM runtime, GPU) -> validate -> package (Triton)."""

from __future__ import annotations

import json

from ..host.files import atomic_copy
from ..host.gpu import gpu_sm
from ..errors import StageFailed
from .base import GpuStage, Stage, StageContext, payload_bytes
from .common import calibration_windows, model_dir, quantize_options, quantizer, set_digests, windows
from .evaluate import EvaluateBase
from .package import PackageStage

MODELOPT_TOOLS = ("torch", "transformers", "modelopt")
TRTLLM_TOOLS = ("tensorrt_llm", "tensorrt")


class OnTrtllmGpu(GpuStage):
    """Runs with tensorrt_llm on a GPU; bound to the SM of build.tensorrt_llm.gpu_sm (or this machine's GPU)."""
    module = "tensorrt_llm"
    install_hint = "pip install -e '.[trtllm]' on a GPU machine with NVIDIA's index"

    gpu_sm_key = "build.tensorrt_llm.gpu_sm"

    def gpu_sm_setting(self, r):
        return r.build.tensorrt_llm.gpu_sm

    def gpus(self, r):
        return r.build.tensorrt_llm.tp * r.build.tensorrt_llm.pp     # the engine's ranks, one GPU each, at once


def target_sm(r) -> str:
    """The hardware key of the tensorrt_llm target's GPU stages ("sm90", or "sm-unspecified")."""
    return OnTrtllmGpu().hardware(r)


def calibrates(q) -> bool:
    """A KV-cache-only setting (algo none, kv_cache int8/fp8) calibrates too."""
    return q.algo != "none" or q.kv_cache != "none"


class ModeloptQuantize(Stage):
    """ModelOpt PTQ / QAT (+distillation) in torch; calibration statistics saved."""
    name = "quantize"
    version = "3"   # 2: metrics.json in the payload without timings / memory peaks (reproducible digest); 3: an
    #                 int8_sq_per_token artifact: one gate/up smoothing vector, no per-token override pickled in
    needs = ("source",)
    tools = MODELOPT_TOOLS

    def config(self, r):
        q = r.quantize
        cfg = {"method": q.method, "algo": q.algo, "alpha": q.alpha, "block_size": q.block_size,
               "kv_cache": q.kv_cache, "options": q.options}
        if calibrates(q):
            cfg["calibration"] = q.calibration.model_dump()
        if q.method == "qat":
            cfg["qat"] = q.qat.model_dump()
        cfg["eval"] = r.validate_.eval[0].model_dump()   # the simulated perplexity the checkpoint is held to
        return cfg

    def data(self, r, home):
        q = r.quantize
        sets = []
        if calibrates(q):
            sets.append((q.calibration.set, q.calibration.split))
        if q.method == "qat":
            sets.append((q.qat.set, q.qat.split))
        sets.append((r.validate_.eval[0].set, r.validate_.eval[0].split))
        return set_digests(r, sets)

    def output_bytes(self, r, info, inputs):
        return int(info.num_params * 4 * 1.05) if info else None    # fake-quant model with fp32 weights

    def plan_problems(self, r, info):
        """What the model's facts refuse (the INT4 group size, sequence lengths): the recipe validated the rest."""
        return quantizer(r).plan_problems(r.quantize, quantize_options(r), info) if info else []

    def run(self, ctx: StageContext) -> dict:
        from ..quant import quantize_model
        q = ctx.recipe.quantize
        calib = calibration_windows(ctx) if calibrates(q) else None
        train = None
        if q.method == "qat":
            t = q.qat
            train = windows(ctx, t.set, t.split, t.samples, t.seq_len, t.seed)
        e = ctx.recipe.validate_.eval[0]
        eval_w = windows(ctx, e.set, e.split, e.samples, e.seq_len, e.seed)
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return quantize_model(model_dir(ctx), q, calib, ctx.out, train=train, eval_windows=eval_w, device=device)


class TrtllmCheckpoint(Stage):
    """The TensorRT-LLM checkpoint: ModelOpt's export_tensorrt_llm_checkpoint sharded for TP/PP, the config fix-ups
    TensorRT-LLM 1.2 needs, and the contract check (pipeline/trtllm/contract.py) before anything builds on it."""
    name = "checkpoint"
    version = "1"
    needs = ("quantize", "source")
    tools = MODELOPT_TOOLS

    def config(self, r):
        b = r.build.tensorrt_llm
        cfg = {"dtype": b.dtype, "tp": b.tp, "pp": b.pp}
        q = r.quantize
        if q.method != "none" and q.algo == "int4_wo" and q.block_size is None:
            # the group size TensorRT-LLM quantizes the float weights with is the quantizer's default for the model,
            # as the quantize stage simulated it (issue 39: it was 128 whatever the model)
            cfg["group_size"] = "the model's default (pipeline/trtllm/quantizers.py)"
        if q.algo in ("int8_wo", "int4_wo") and q.kv_cache != "none":
            # these exports once dropped the KV-cache scales (checkpoint._disable_quantizers, issue 40): such a
            # cached checkpoint says kv_cache_quant_algo null, so its key moves; no other setting's does
            cfg["kv_cache_scales"] = "exported"
        return cfg

    def output_bytes(self, r, info, inputs):
        return int(info.num_params * 2 * 1.05) if info else None    # 16-bit weights at most, all ranks together

    def run(self, ctx: StageContext) -> dict:
        from ..quant import restore_model
        from ..trtllm.checkpoint import write_checkpoint
        from ..trtllm.contract import check_contract
        b = ctx.recipe.build.tensorrt_llm
        mdir = model_dir(ctx)
        model = restore_model(mdir, ctx.inputs["quantize"])
        qz, q = quantizer(ctx.recipe), ctx.recipe.quantize
        # the quantize section as the quantizer resolved it (a concrete group size): what the quantize stage ran
        metrics = write_checkpoint(model, ctx.info, mdir, ctx.out, dtype=b.dtype, tp=b.tp, pp=b.pp,
                                   quant=qz.record(q, qz.options_of(q), ctx.info))
        del model
        violations = check_contract(ctx.out)
        if violations:
            raise StageFailed(f"checkpoint violates the TensorRT-LLM 1.2 contract ({len(violations)} problems):\n  "
                              + "\n  ".join(violations[:20]), {"violations": violations})
        metrics["contract"] = "passed"
        return metrics


class CheckpointEvaluate(EvaluateBase):
    """Checkpoint logits by a torch reference of TensorRT-LLM's semantics vs FP32."""
    name = "evaluate_checkpoint"
    version = "3"   # 2: streaming reference numerics (one layer resident, CUDA when present) and new families; 3: q/k norms use the engine Attention's eps 1e-5 (Qwen3, Gemma 3)
    needs = ("checkpoint", "source", "quantize")
    subject = "tensorrt_llm checkpoint, reference numerics (not an engine)"

    def candidate(self, ctx):
        from ..trtllm.reference import ReferenceModel
        return ReferenceModel(ctx.inputs["checkpoint"])

    def run(self, ctx: StageContext) -> dict:
        metrics = super().run(ctx)
        # Hold the checkpoint to the quantize stage's own simulated figure on the same windows.
        q = ctx.upstream_metrics.get("quantize", {})
        simulated = q.get("ppl_qat") or q.get("ppl_ptq") or q.get("ppl_fp32")
        e = ctx.recipe.validate_.eval[0]
        mine = metrics["per_set"].get(f"{e.set}/{e.split}", {}).get("ppl")
        if simulated is not None and mine is not None:
            metrics["simulated_ppl"] = simulated
            metrics["simulated_ppl_gap"] = abs(mine - simulated)
            (ctx.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        return metrics


def memory_problems(r, info, found=None, *, deploy: bool = False) -> list[str]:
    """Refuses, at plan, a recipe whose evaluation engine (or, with ``deploy``, the engine Triton serves) does not fit
    this machine's GPU: the memory plan counts what TensorRT-LLM allocates before the KV pool and what it allocates
    per step after it, with the KV-cache limits forge writes (docs/trtllm-memory.md). ``found``:
    pipeline.host.gpu.gpus() (tests pass their own)."""
    from ..host.gpu import gpus
    from ..gpus import match_nvml_name
    from ..trtllm.memory import plan_for_recipe
    found = gpus() if found is None else found
    spec = match_nvml_name(found[0]["name"] or "") if found else None
    if spec is None:
        return []           # no GPU here, or one the table does not know: `forge memory --gpu NAME` plans it
    plan, [v] = plan_for_recipe(r, info, spec.name, deploy=deploy)
    if plan.total_bytes <= v.capacity_bytes:
        return []
    fixes = "; ".join(f"--set {s.recipe_key}={s.value}" for s in v.suggestions if s.value is not None)
    engine = "the served engine (build_deploy)" if deploy else "the evaluation engine"
    pool = (f"KV pool capped at {plan.kv_max_tokens} tokens" if plan.kv_max_tokens is not None else
            f"KV pool kv_cache_free_gpu_mem_fraction {plan.args['kv_cache_free_gpu_mem_fraction']} of the free memory")
    return [f"memory: one rank of {engine} needs {plan.total_bytes / 2**30:.2f} GiB, this {spec.name} has "
            f"{v.capacity_bytes / 2**30:.2f} GiB ({plan.early_bytes / 2**30:.2f} GiB before the KV pool, "
            f"{plan.kv_cache_paged_bytes / 2**30:.2f} GiB of KV cache, {plan.late_bytes / 2**30:.2f} GiB allocated "
            f"per step after it, {pool}; it would run out of memory at run time; "
            f"`forge memory {r.name} --gpu {spec.name}` shows every part)"
            + (f"; would fit with {fixes}" if fixes else "")]


class TrtllmBuildStage(OnTrtllmGpu, Stage):
    """trtllm-build per rank with plugins, timing cache from/to the cache."""
    name = "build"
    out_link = "engine"
    version = "1"
    needs = ("checkpoint", "validate_checkpoint")
    tools = TRTLLM_TOOLS
    section = "build.tensorrt_llm"

    def finish_hint(self, r):
        return f"forge build {r.name} --from build  (on a GPU machine with tensorrt_llm 1.2.x, sharing FORGE_CACHE)"

    def output_bytes(self, r, info, inputs):
        return payload_bytes(inputs["checkpoint"]) if "checkpoint" in inputs else None

    def plan_problems(self, r, info):
        from ..trtllm.build_config import validate_build
        if info is None:
            return []
        return validate_build(r.build.tensorrt_llm.model_dump(), r.quantize.model_dump(), info,
                              r.build.tensorrt_llm.gpu_sm or gpu_sm(), triton=r.package.triton.model_dump()) \
            + memory_problems(r, info)

    def run(self, ctx: StageContext) -> dict:
        from ..trtllm.build import build_engine
        from ..trtllm.build_config import trtllm_build_args
        # The timing cache lives beside the artifact cache, one per GPU SM: taken in, refreshed copy returned.
        tc_dir = ctx.home / "timing_cache" / target_sm(ctx.recipe)
        tc_in = tc_dir / "trtllm.timing.cache"
        args = trtllm_build_args(ctx.recipe.build.tensorrt_llm.model_dump(), ctx.inputs["checkpoint"], ctx.out,
                                 tc_in if tc_in.exists() else None, ctx.out / "timing.cache")
        metrics = build_engine(ctx.inputs["checkpoint"], ctx.out, args, tc_in if tc_in.exists() else None)
        if metrics.get("timing_cache_out"):
            atomic_copy(metrics["timing_cache_out"], tc_in)
        return metrics


AGREE_PROMPTS, AGREE_PROMPT_TOKENS, AGREE_NEW_TOKENS = 4, 64, 32    # deploy-vs-evaluation engine check


def deploy_build_section(r) -> dict:
    """The deploy engine's build section: the recipe's, without the evaluation buffer (issue 27). The runtime
    allocates [max_num_tokens, vocabSizePadded] logits for an engine that gathers context logits
    (docs/trtllm-memory.md) and turns KV-cache reuse off for it; the served engine needs neither."""
    return r.build.tensorrt_llm.model_dump() | {"gather_context_logits": False}


class TrtllmBuildDeploy(TrtllmBuildStage):
    """The engine Triton serves: the same checkpoint and trtllm-build arguments as ``build`` except
    ``--gather_context_logits`` (validate runs on ``build``, which returns context logits)."""
    name = "build_deploy"
    out_link = "engine_deploy"
    version = "1"

    def config(self, r):
        return deploy_build_section(r)

    def finish_hint(self, r):
        return (f"forge build {r.name} --from build_deploy  (on a GPU machine with tensorrt_llm 1.2.x, "
                f"sharing FORGE_CACHE)")

    def plan_problems(self, r, info):
        return []        # the same section as build's, less one flag: build's plan_problems cover it

    def run(self, ctx: StageContext) -> dict:
        from ..trtllm.build import build_engine
        from ..trtllm.build_config import trtllm_build_args
        tc_in = ctx.home / "timing_cache" / target_sm(ctx.recipe) / "trtllm.timing.cache"
        args = trtllm_build_args(deploy_build_section(ctx.recipe), ctx.inputs["checkpoint"], ctx.out,
                                 tc_in if tc_in.exists() else None, None)
        return build_engine(ctx.inputs["checkpoint"], ctx.out, args, tc_in if tc_in.exists() else None)


class EngineCandidate:
    """The built engine through TensorRT-LLM's runtime, shaped like the other evaluation candidates.

    One :class:`~pipeline.trtllm.runtime.EngineSession` per evaluation: the engine is loaded on the first chunk
    and every later chunk and prompt goes through the same runner (or the same mpirun worker when tp*pp > 1);
    ``close()`` (called by EvaluateBase.run) unloads it.
    """

    def __init__(self, engine_dir, *, runner_spec: str | None = None, kv_cache_free_gpu_mem_fraction=None):
        from ..trtllm.runtime import RUNNER, EngineSession
        self.session = EngineSession(engine_dir, runner_spec=runner_spec or RUNNER,
                                     kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction)

    def logits(self, input_ids):
        return self.session.context_logits(input_ids)

    def generate(self, prompt_ids, max_new_tokens, greedy=True):
        return self.session.generate(prompt_ids, max_new_tokens)

    def close(self):
        self.session.close()


class TrtllmEvaluate(OnTrtllmGpu, EvaluateBase):
    """TensorRT-LLM engine (its runtime) vs FP32 torch."""
    name = "evaluate"
    version = "2"   # 2: the runner gets the engine's per-layer max_attention_window_size (Mistral / Gemma 3)
    needs = ("build", "source")
    tools = TRTLLM_TOOLS + ("torch", "transformers")
    subject = "tensorrt_llm engine"

    def candidate(self, ctx):
        # the KV limits the memory plan assumes (runtime.runner_options): the recipe's fraction, the engine's cap
        return EngineCandidate(ctx.inputs["build"],
                               kv_cache_free_gpu_mem_fraction=ctx.recipe.package.triton.kv_cache_free_gpu_mem_fraction)


class TrtllmPackage(OnTrtllmGpu, PackageStage):
    """Triton tensorrtllm_backend repository (ensemble/pre/post/tensorrt_llm/bls) + manifest.json."""
    version = "8"   # 2: tensorrt_llm config carries the parameters read without fallback; BLS decoupled calls; 3: manifest.json without a creation timestamp (same inputs, same digest); 4: max_attention_window_size per layer for sliding-window engines (Mistral, Gemma 3); 5: packages the deploy engine (build_deploy), manifest records both engines; 6: the manifest lists the repository's empty folders and no regression rules (issue 24); 7: the BLS forwards the inputs its config lists, streaming is a shared engine input (issue 28); 8: max_tokens_in_paged_kv_cache caps the KV pool at the recipe's need, leaving the per-step buffers room (issue 40)
    tools = TRTLLM_TOOLS
    needs = ("build_deploy", "build", "validate", "evaluate", "source")

    def output_bytes(self, r, info, inputs):
        return (payload_bytes(inputs["build_deploy"]) + payload_bytes(inputs["source"])
                if "build_deploy" in inputs else None)

    def gpus(self, r):
        return 1     # writes the repository from the built engine: one GPU of its architecture, not the ranks

    def plan_problems(self, r, info):
        from ..triton.repo_trtllm import check_triton_vs_engine
        return check_triton_vs_engine(r.package.triton.model_dump(), deploy_build_section(r)) \
            + (memory_problems(r, info, deploy=True) if info is not None else [])

    def write_repository(self, ctx, evaluation):
        from ..trtllm.agreement import engines_record, greedy_agreement, greedy_tokens
        from ..triton.repo_trtllm import write_trtllm_repo
        engine_cfg = json.loads((ctx.inputs["build_deploy"] / "config.json").read_text())
        eval_cfg = json.loads((ctx.inputs["build"] / "config.json").read_text())
        engines = engines_record(eval_cfg, engine_cfg)
        # The served engine is held to the validated one: greedy tokens of both on the first eval windows' starts.
        e = ctx.recipe.validate_.eval[0]
        prompts = [w[:AGREE_PROMPT_TOKENS].tolist() for w in windows(ctx, e.set, e.split, e.samples, e.seq_len,
                                                                     e.seed)[:AGREE_PROMPTS]]
        frac = ctx.recipe.package.triton.kv_cache_free_gpu_mem_fraction
        engines["greedy_agreement"] = greedy_agreement(
            greedy_tokens(ctx.inputs["build"], prompts, AGREE_NEW_TOKENS, kv_cache_free_gpu_mem_fraction=frac),
            greedy_tokens(ctx.inputs["build_deploy"], prompts, AGREE_NEW_TOKENS, kv_cache_free_gpu_mem_fraction=frac),
            ctx.recipe.validate_.thresholds.top1_agreement_min)
        res = write_trtllm_repo(ctx.out, engine_dir=ctx.inputs["build_deploy"],
                                tokenizer_dir=ctx.inputs["source"] / "tokenizer",
                                engine_config=engine_cfg, triton=ctx.recipe.package.triton.model_dump())
        record = engine_cfg.get("build_config", {}) | {"engines": engines}
        return res, target_sm(ctx.recipe), record
