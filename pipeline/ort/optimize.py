"""ONNX Runtime graph optimisation: run ORT's optimiser once and save the optimised graph (with external data).

``level``: ``basic`` (constant folding, redundant-node removal), ``extended`` (plus fusions such as
DynamicQuantizeMatMul, SkipSimplifiedLayerNormalization, attention fusions), ``all`` (plus layout transforms that are
specific to this machine's CPU). The saved graph only runs on ONNX Runtime with the provider it was optimised for;
``extended`` is the portable choice for a packaged engine. On the CPU, ``extended`` and ``all`` also fuse the
export's RMSNorms (pipeline.ort.norms), which ORT's session optimiser leaves as seven nodes each.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np

from pipeline.errors import ForgeError, StageFailed
from pipeline.host.rss import trim_heap

from .engine import OrtEngine, inference_session, session_options
from .export import META_FILE, MODEL_FILE, copy_side_files, graph_files, model_bytes
from .norms import fuse_cpu_norms

__all__ = ["optimize", "LEVELS", "PROVIDERS"]

LEVELS = ("disable", "basic", "extended", "all")
# build.onnxruntime.provider -> the session's provider list (CUDA only: a node CUDA cannot run would otherwise fall
# back to the CPU silently, with copies on every step; ORT then fails the session, which is what we want)
PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider"]}


def _op_counts(path: Path) -> dict[str, int]:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return dict(Counter(n.op_type for n in m.graph.node))


# A quantized graph's fused kernels (DynamicQuantizeMatMul vs DynamicQuantizeLinear+MatMulInteger) round
# differently, so it is held to a direction check on real text instead of an elementwise one; accuracy
# against FP32 is the validate stage's job.
QUANTIZED_MIN_COSINE = 0.99


def optimize(in_dir: str | Path, out_dir: str | Path, *, level: str = "extended", threads: int = 2,
             check_atol: float = 1e-3, check_ids: np.ndarray | None = None, provider: str = "cpu") -> dict:
    """Optimise ``in_dir/model.onnx`` with ORT at ``level`` into ``out_dir`` and check it still computes the same
    logits (max abs difference <= ``check_atol`` on a fixed input). Returns metrics incl. op counts and the
    session options to run it with. ``provider`` ``cuda``: optimised for and checked on the CUDA provider (the saved
    graph may hold CUDA-only fusions), the KV cache on the GPU. On the CPU at ``extended`` and ``all`` the RMSNorms
    and their residual adds are fused first (pipeline.ort.norms.fuse_cpu_norms: ORT's session optimiser does not
    match our export's pattern); the check holds the result to ``in_dir``'s unfused graph."""
    import shutil
    import tempfile

    import onnxruntime as ort

    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if level not in LEVELS:
        raise ForgeError(f"build.onnxruntime.opt_level {level!r} is not one of {LEVELS}")
    src = in_dir / MODEL_FILE
    if not src.exists():
        raise ForgeError(f"optimize: no {MODEL_FILE} in {in_dir}; run the quantize stage first")
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / MODEL_FILE
    meta = json.loads((in_dir / META_FILE).read_text()) if (in_dir / META_FILE).exists() else {}
    graphs = graph_files(in_dir)   # the model, and the prompt graph when the quantizer wrote one
    providers = PROVIDERS[provider]
    t0 = time.time()
    fused_norms, fused_dir = None, None
    try:
        if provider == "cpu" and level in ("extended", "all"):
            fused_dir = Path(tempfile.mkdtemp(prefix=".norms-", dir=out_dir.parent))
            fused_norms = fuse_cpu_norms(in_dir, fused_dir)
        for name in graphs:
            for f in (out_dir / name, out_dir / (name + ".data")):
                f.unlink(missing_ok=True)
            so = session_options(threads, level, optimized_path=str(out_dir / name), quiet=provider == "cpu")
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", name + ".data")
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            # saves the optimised graph (optimized_model_filepath)
            inference_session(str((fused_dir or in_dir) / name), so, providers)
    finally:
        if fused_dir is not None:
            shutil.rmtree(fused_dir, ignore_errors=True)
    opt_s = time.time() - t0
    copy_side_files(in_dir, out_dir)
    meta["optimization"] = {"level": level, "threads": threads, "onnxruntime": ort.__version__,
                            "providers": providers}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))

    # The optimised graph must compute what its input graph computes.
    vocab = int(meta.get("vocab_size") or 2)
    # quantized or fp16 (fused fp16 kernels accumulate in another order): held to the direction check
    quantized = (meta.get("quantization") or {}).get("algo", "none") != "none" or meta.get("dtype") == "fp16"
    ids = check_ids if check_ids is not None else np.random.default_rng(0).integers(0, vocab, size=(2, 16))
    # one run each, one engine at a time, no arena kept (pipeline.ort.engine: cpu_arena)
    run = {"providers": providers, "device": "cuda" if provider == "cuda" else "cpu", "cpu_arena": False}
    # each graph held to its input graph; the metrics are the first failing check's, else the first's
    checks = [_check(in_dir, out_dir, ids, threads, run, prompt_graph, quantized)
              for prompt_graph in ([False, True] if len(graphs) > 1 else [True])]
    metrics = dict(next((c for c in checks if not _passes(c, quantized, check_atol)), checks[0]))
    metrics.update({"checks": checks if len(checks) > 1 else None, "level": level, "threads": threads,
                    "optimize_s": round(opt_s, 2), "provider": provider, "graphs": graphs,
                    "fused_norms": fused_norms, "ops_before": _op_counts(src), "ops_after": _op_counts(dst),
                    "model_bytes": model_bytes(out_dir),
                    "session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1,
                                        "graph_optimization_level": level}})
    if not _passes(metrics, quantized, check_atol):
        if quantized:
            raise StageFailed(f"ORT optimisation at level {level!r} changed the quantized graph's logits (cosine "
                              f"{metrics['check_cosine']:.4f} < {QUANTIZED_MIN_COSINE}); set "
                              "build.onnxruntime.opt_level: basic", metrics)
        raise StageFailed(f"ORT optimisation at level {level!r} changed the logits by {metrics['check_max_abs']:.3g} "
                          f"(> {check_atol}); set build.onnxruntime.opt_level: basic", metrics)
    return metrics


def _passes(m: dict, quantized: bool, atol: float) -> bool:
    if quantized:
        return bool(np.isfinite(m["check_cosine"]) and m["check_cosine"] >= QUANTIZED_MIN_COSINE)
    return bool(np.isfinite(m["check_max_abs"]) and m["check_max_abs"] <= atol)


def _check(in_dir: Path, out_dir: Path, ids, threads: int, run: dict, prompt_graph: bool, quantized: bool) -> dict:
    """The optimised graph's logits against its input graph's on ``ids`` (the prompt graph's when ``prompt_graph``
    and the engine has one, else the model graph's): max abs difference and mean cosine per position."""
    a = OrtEngine(in_dir, threads=threads, level="disable", prefill_graph=prompt_graph, **run).logits(ids)
    trim_heap()
    b = OrtEngine(out_dir, threads=threads, level="disable", prefill_graph=prompt_graph, **run).logits(ids)
    diff = float(np.abs(a - b).max())
    af, bf = a.reshape(-1, a.shape[-1]).astype(np.float64), b.reshape(-1, b.shape[-1]).astype(np.float64)
    na, nb = np.linalg.norm(af, axis=-1), np.linalg.norm(bf, axis=-1)
    # a position both graphs leave all-zero has no direction to compare (cosine 0/0); zero in only one is a change
    both = (na > 0) & (nb > 0)
    if np.any((na > 0) != (nb > 0)) or not both.any():
        cosine = float("nan")
    else:
        cosine = float(np.mean(np.sum(af[both] * bf[both], -1) / (na[both] * nb[both])))
    return {"check_max_abs": diff, "check_cosine": cosine, "check_zero_rows": int((~both).sum()),
            "check": "cosine" if quantized else "max_abs", "check_graph": "prompt" if prompt_graph else "model"}
