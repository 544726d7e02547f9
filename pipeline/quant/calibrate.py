"""PTQ with NVIDIA ModelOpt: load the HF model, calibrate on token windows, measure perplexity.

The numbers this produces come from ModelOpt's *fake quantization* in PyTorch (quantize → dequantize in
fp32); they are a simulation of the quantized format, not an engine.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from pipeline.host.rss import process_peak_rss_bytes
from pipeline.progress import progress_bar

from .artifact import load_hf_model  # noqa: F401 (the loader lives with the artifact it restores)


def _quiet_modelopt():
    warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")


def batches(windows: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """Consecutive row batches of a ``[N, T]`` token tensor (the last one may be smaller)."""
    return [windows[i:i + batch] for i in range(0, windows.shape[0], batch)]


def make_forward_loop(windows: torch.Tensor, batch: int, device: str, desc: str = "calibrate") -> Callable:
    """The ``forward_loop(model)`` ModelOpt calls (possibly more than once, e.g. AWQ) to see calibration data."""
    chunks = batches(windows, batch)
    calls = {"n": 0}

    def forward_loop(model: nn.Module) -> None:
        calls["n"] += 1
        label = desc if calls["n"] == 1 else f"{desc} (pass {calls['n']})"
        with torch.no_grad(), progress_bar(label, len(chunks)) as advance:
            for x in chunks:
                model(input_ids=x.to(device), use_cache=False)
                advance(1)

    return forward_loop


@torch.no_grad()
def perplexity(model: nn.Module, windows: torch.Tensor, batch: int = 4, device: str = "cpu",
               desc: str = "perplexity") -> float:
    """exp(mean next-token NLL) over ``[N, T]`` windows (no BOS; position t predicts t+1).

    Uses ``pipeline.eval.metrics.perplexity`` per batch and combines the batches by token count.
    """
    from pipeline.eval.metrics import perplexity as batch_ppl

    was_training = model.training
    model.eval()
    log_sum, n = 0.0, 0
    chunks = batches(windows, batch)
    with progress_bar(desc, len(chunks)) as advance:
        for x in chunks:
            logits = model(input_ids=x.to(device), use_cache=False).logits
            k = x.shape[0] * (x.shape[1] - 1)
            log_sum += math.log(batch_ppl(logits.float(), x)) * k
            n += k
            advance(1)
    model.train(was_training)
    return math.exp(log_sum / n)


def calibrate(model: nn.Module, mtq_cfg: dict, calib: torch.Tensor | None, batch: int, device: str = "cpu",
              record_activations: bool = True) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``mtq.quantize`` the model in place with a progress bar over calibration batches.

    Returns the model and the raw per-channel input max |x| of every Linear seen during calibration
    (empty when ``calib`` is None or recording is off).
    """
    _quiet_modelopt()
    import modelopt.torch.quantization as mtq

    from .stats import ActivationRecorder

    if calib is None:
        loop = None
        rec = None
    else:
        loop = make_forward_loop(calib, batch, device)
        rec = ActivationRecorder(model) if record_activations else None
    try:
        model = mtq.quantize(model, mtq_cfg, loop)
    finally:
        if rec is not None:
            rec.remove()
    return model, (rec.amax if rec is not None else {})


def set_threads() -> None:
    """Respect FORGE_THREADS (default: leave torch's choice) for CPU runs."""
    n = os.environ.get("FORGE_THREADS")
    if n:
        torch.set_num_threads(int(n))


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t


def quantize_model(hf_dir: Path, quantize, calib: torch.Tensor | None, out_dir: Path, *,
                   train: torch.Tensor | None = None, eval_windows: torch.Tensor | None = None,
                   device: str = "cpu", eval_batch: int = 4, ppl_fp32: float | None = None) -> dict:
    """PTQ (and QAT when ``quantize.method`` is qat) of the HF model in ``hf_dir`` by the tensorrt_llm target's
    quantizer of ``quantize`` (the recipe's quantize section, validated: pipeline/trtllm/quantizers.py); writes the
    artifact.

    ``calib`` / ``train`` / ``eval_windows`` are ``[N, T]`` token tensors (``pipeline.data.token_windows``).
    Perplexities are measured on ``eval_windows`` when given (FP32, after PTQ, after QAT); pass ``ppl_fp32``
    when the FP32 perplexity on those windows is already known. Returns metrics.
    """
    import copy
    import json

    from pipeline.errors import ForgeError, RecipeError
    from pipeline.modelinfo import ModelInfo
    from pipeline.trtllm.quantizers import quantizer_of

    from . import artifact
    from .per_token import per_token_activations, share_mlp_smoothing, static_activations
    from .zero_point import asymmetric_weights, symmetric_weights
    from .qat import train_qat
    from .stats import collect_layer_stats, save_stats, top_outliers

    _quiet_modelopt()
    set_threads()
    t_all = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    info = ModelInfo.from_dir(hf_dir)
    qz = quantizer_of(quantize)
    opts = qz.options_of(quantize)
    problems = qz.plan_problems(quantize, opts, info)       # this model's facts; the recipe validated the rest
    if problems:
        raise RecipeError(problems)
    c = qz.record(quantize, opts, info)
    quantizes = c["algo"] != "none" or c["kv_cache"] != "none"
    if qz.needs_calibration(c["kv_cache"]) and calib is None:
        raise ForgeError(f"quantize.algo {c['algo']} / kv_cache {c['kv_cache']} needs calibration windows "
                         f"(quantize.calibration), none were given")
    if c["method"] == "qat" and train is None:
        raise ForgeError("quantize.method is qat but no training windows were given (quantize.qat.set/split)")
    torch.manual_seed(int(c["calibration"]["seed"]))
    out_dir.mkdir(parents=True, exist_ok=True)

    m: dict = {"label": "simulated: ModelOpt fake quantization in PyTorch (not an engine)",
               "algo": c["algo"], "method": c["method"], "kv_cache": c["kv_cache"], "device": device,
               "alpha": c["alpha"] if qz.smoothquant else None,
               "block_size": c["block_size"] if qz.grouped else None,
               "needs_sm": qz.needs_sm(c["kv_cache"]),
               "trtllm_quantization": qz.checkpoint_quantization(opts, c["kv_cache"], info),
               "seconds": {}}
    model = load_hf_model(hf_dir, device)
    if eval_windows is not None and ppl_fp32 is not None:
        m["eval_tokens"], m["ppl_fp32"] = int(eval_windows.numel()), float(ppl_fp32)
    elif eval_windows is not None:
        m["eval_tokens"] = int(eval_windows.numel())
        m["ppl_fp32"], m["seconds"]["eval_fp32"] = timed(perplexity, model, eval_windows, eval_batch, device,
                                                          "eval FP32")
    teacher = None
    if c["method"] == "qat" and c["qat"]["distill"]["enabled"]:
        teacher = copy.deepcopy(model).eval()

    mtq_cfg = qz.modelopt_config(opts, c["kv_cache"], info)
    (model, act_amax), m["seconds"]["calibrate"] = timed(
        calibrate, model, mtq_cfg, calib if quantizes else None, int(c["calibration"]["batch"]), device)
    if qz.per_token:       # the format TensorRT-LLM's plugin path computes (per_token.py)
        m["mlp_resmoothed"] = share_mlp_smoothing(model)
        m["per_token_quantizers"] = per_token_activations(model)
    if qz.zero_point:          # zero-point groups: the grid of the checkpoint (zero_point.py)
        m["zero_point_quantizers"] = asymmetric_weights(model)
    rows = collect_layer_stats(model, act_amax)
    save_stats(rows, out_dir / artifact.STATS_FILE)
    m["top_outliers"] = top_outliers(rows)
    if eval_windows is not None and quantizes:
        m["ppl_ptq"], m["seconds"]["eval_ptq"] = timed(perplexity, model, eval_windows, eval_batch, device,
                                                        "eval PTQ")
    if c["method"] == "qat":
        qm = train_qat(model, train, c["qat"], teacher=teacher, device=device)
        m["qat"] = {k: v for k, v in qm.items() if k != "log"}
        m["qat"]["loss_curve"] = [round(r["loss"], 5) for r in qm["log"]]
        m["seconds"]["qat"] = qm["seconds"]
        if eval_windows is not None:
            m["ppl_qat"], m["seconds"]["eval_qat"] = timed(perplexity, model, eval_windows, eval_batch, device,
                                                            "eval QAT")
    del teacher
    base = m.get("ppl_fp32")
    for k in ("ptq", "qat"):
        if base and f"ppl_{k}" in m:
            m[f"ppl_{k}_delta_pct"] = 100.0 * (m[f"ppl_{k}"] - base) / base
    if "ppl_qat_delta_pct" in m and m.get("ppl_ptq_delta_pct"):
        m["qat_gap_recovered"] = 1.0 - m["ppl_qat_delta_pct"] / m["ppl_ptq_delta_pct"]

    static_activations(model)       # the per-token override is not ModelOpt state (per_token.py)
    symmetric_weights(model)        # nor is the zero-point one (zero_point.py)
    artifact.save_artifact(model.to("cpu"), out_dir, {"quantize": c, "modelopt_config": mtq_cfg,
                                                      "trtllm_quantization": m["trtllm_quantization"],
                                                      "needs_sm": m["needs_sm"], "model": info.to_dict()})
    m["seconds"]["total"] = time.perf_counter() - t_all
    m["peak_rss_mb"] = process_peak_rss_bytes() / 2**20
    if device.startswith("cuda") and torch.cuda.is_available():
        m["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    (out_dir / artifact.METRICS_FILE).write_text(json.dumps(reproducible(m), indent=1, default=str))
    return m


VOLATILE = ("seconds", "peak_rss_mb", "peak_gpu_mb")


def reproducible(m: dict) -> dict:
    """The metrics without timings and memory peaks: what the payload keeps, so the same inputs give the same
    payload digest on any machine (the full metrics go to the cache entry's meta.json and the report)."""
    out = {k: v for k, v in m.items() if k not in VOLATILE}
    if isinstance(out.get("qat"), dict):
        out["qat"] = {k: v for k, v in out["qat"].items() if k not in VOLATILE}
    return out
