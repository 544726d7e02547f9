"""Issue 7's GPU run: quantize/QAT on CUDA and a Qwen2-7B-shaped checkpoint at real scale; issue 13's streaming
reference numerics (``--stream-ref``): peak host RSS and wall of a 16 x 512-token evaluation on CPU and CUDA.

Runs on a machine with an NVIDIA GPU and PyTorch; writes JSON results to OUT. Everything here uses
forge's own modules (the same code the stages call). No TensorRT / TensorRT-LLM is needed or used.

    python lab/gpu_run.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --home FORGE_HOME --out OUT [--skip-smol] [--skip-7b]
    python lab/gpu_run.py --home /tmp --out OUT --skip-smol --stream-ref     # issue 13 (7B int8_sq + INT8 KV, tp 2)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_peak_gb() -> float:
    from pipeline.host.rss import process_peak_rss_bytes
    return process_peak_rss_bytes() / 2**30


def gpu_peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def stage(results: dict, name: str):
    class _S:
        def __enter__(self):
            torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
            self.t = time.perf_counter()
            print(f"== {name}", flush=True)
            return self

        def __exit__(self, et, ev, tb):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            results.setdefault("stages", {})[name] = {
                "seconds": round(time.perf_counter() - self.t, 2), "peak_host_rss_gb": round(rss_peak_gb(), 2),
                "peak_gpu_gb": round(gpu_peak_gb(), 2), "ok": et is None,
                **({"error": "".join(traceback.format_exception(et, ev, tb))[-3000:]} if et else {})}
            print(json.dumps(results["stages"][name]), flush=True)
            if results.get("_out"):   # keep what finished even if the run is killed later
                Path(results["_out"]).write_text(json.dumps(results, indent=2, default=str))
            return True   # record the failure and go on with the next stage
    return _S()


def smollm2(args, results):
    from pipeline import data
    from pipeline.quant import quantize_model
    from pipeline.recipe import QuantizeSection
    from pipeline.source import convert_gguf
    from transformers import AutoTokenizer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = Path(args.work) / "smollm2"
    with stage(results, "smollm2: convert GGUF -> fp32 HF dir"):
        if not (hf / "config.json").exists():
            convert_gguf(Path(args.gguf), hf)
    tok = AutoTokenizer.from_pretrained(hf)
    home = Path(args.home)
    calib = data.token_windows(tok, data.load_text("sotu", "calib", home), 16, 256, 0)
    train = data.token_windows(tok, data.load_text("sotu", "train", home), 24, 128, 0)
    ev = data.token_windows(tok, data.load_text("wiki", "eval", home), 8, 256, 0)
    runs = {
        "int8_sq PTQ (alpha 0.5)": {"method": "ptq", "algo": "int8_sq", "alpha": 0.5,
                                    "calibration": {"set": "sotu", "samples": 16, "seq_len": 256, "batch": 4, "seed": 0}},
        "int4_wo g64 QAT 1 epoch": {"method": "qat", "algo": "int4_wo", "block_size": 64,
                                    "calibration": {"set": "sotu", "samples": 16, "seq_len": 256, "batch": 4, "seed": 0},
                                    "qat": {"epochs": 1, "lr": 2e-4, "batch": 4, "samples": 24, "seq_len": 128,
                                            "distill": {"enabled": False}}},
    }
    for name, q in runs.items():
        with stage(results, f"smollm2: {name} on {dev}"):
            m = quantize_model(hf, QuantizeSection.model_validate(q), calib, Path(args.work) / name.replace(" ", "_"),
                               train=train,
                               eval_windows=ev, device=dev)
            results.setdefault("smollm2", {})[name] = m


def qwen7b(args, results):
    from pipeline.modelinfo import ModelInfo
    from pipeline.quant.calibrate import calibrate
    from pipeline.recipe import QuantizeSection
    from pipeline.trtllm.quantizers import QUANTIZERS
    from pipeline.trtllm.checkpoint import write_checkpoint
    from pipeline.trtllm.contract import check_contract
    from pipeline.trtllm.reference import ReferenceModel
    from pipeline.eval.metrics import compare_logits
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_path = Path(args.qwen_config or Path(__file__).resolve().parents[1] / "pipeline/model_configs/Qwen--Qwen2.5-7B-Instruct.json")
    cfg_dict = json.loads(cfg_path.read_text())
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # cpu only for a dry run with a tiny --qwen-config
    info = ModelInfo.from_hf_config(cfg_dict)
    q = {"method": "ptq", "algo": "int8_sq", "alpha": 0.5, "kv_cache": "int8"}
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, min(32000, cfg_dict["vocab_size"]), (args.samples, args.seq_len), generator=g)
    probe = torch.randint(0, min(32000, cfg_dict["vocab_size"]), (2, 64), generator=g)
    with stage(results, "qwen7b: random init on GPU (fp16)"):
        cfg = AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "transformers_version")})
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
        model.eval()
        results["qwen7b_params"] = sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            ref = model(probe.to(dev)).logits.float().cpu()
    with stage(results, f"qwen7b: int8_sq + int8 KV calibration {args.samples}x{args.seq_len}"):
        qs = QuantizeSection.model_validate(q)
        mcfg = QUANTIZERS[qs.algo].modelopt_config(QUANTIZERS[qs.algo].options_of(qs), qs.kv_cache, info)
        model, _ = calibrate(model, mcfg, calib, batch=args.batch, device=dev, record_activations=False)
        with torch.no_grad():
            sim = model(probe.to(dev)).logits.float().cpu()
        results["qwen7b_simulated_vs_fp16"] = compare_logits(ref, sim, probe)
    out = Path(args.work) / "qwen7b-ckpt"
    with stage(results, "qwen7b: export_tensorrt_llm_checkpoint tp 2"):
        results["qwen7b_export"] = write_checkpoint(model, info, None, out, dtype="float16", tp=2, pp=1, quant=q)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    with stage(results, "qwen7b: contract check"):
        results["qwen7b_contract"] = check_contract(out) or "passed"
    with stage(results, "qwen7b: reference numerics (CPU, 2 x 64 tokens)"):
        rm = ReferenceModel(out, threads=os.cpu_count(), device="cpu")
        lg = rm.logits(probe)
        results["qwen7b_reference_vs_fp16"] = compare_logits(ref, lg[..., :ref.shape[-1]], probe)
        results["qwen7b_reference_vs_simulated"] = compare_logits(sim, lg[..., :ref.shape[-1]], probe)


def stream_ref(args, results):
    """Issue 13: the 7B tp 2 int8_sq + INT8-KV checkpoint of ``qwen7b`` through the streaming reference numerics,
    16 x 512 tokens, 2 windows per forward (as the evaluate_checkpoint stage calls it), CUDA then CPU, each in a
    fresh process (lab/reference_memory.py) so its peak RSS is its own."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from reference_memory import measure

    out = Path(args.work) / "qwen7b-ckpt"
    if not (out / "config.json").exists():
        raise RuntimeError(f"{out}: no checkpoint; run without --skip-7b first (same --work)")
    g = torch.Generator().manual_seed(2)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, min(32000, vocab), (args.ref_samples, args.ref_seq_len), generator=g)
    ids_path = Path(args.work) / "ref_ids.pt"
    torch.save(ids, ids_path)
    top1 = {}
    runs = [("cuda", "per-batch"), ("cuda", "one")] if torch.cuda.is_available() else []
    if not args.ref_cuda_only:
        runs += [("cpu", "per-batch")]
    for device, passes in runs:
        name = f"reference numerics {device}, {args.ref_samples}x{args.ref_seq_len}, batch 2, passes={passes}"
        with stage(results, name):
            t1 = Path(args.work) / f"top1-{device}-{passes}.pt"
            res = measure(out, device, samples=args.ref_samples, seq_len=args.ref_seq_len, batch=2, passes=passes,
                          threads=os.cpu_count() if device == "cpu" else None, ids=ids_path, top1_out=t1)
            results.setdefault("stream_ref", {})[f"{device}/{passes}"] = res
            top1[(device, passes)] = torch.load(t1)
    if ("cpu", "per-batch") in top1 and ("cuda", "per-batch") in top1:
        a, b = top1[("cpu", "per-batch")], top1[("cuda", "per-batch")]
        results["stream_ref_cpu_vs_cuda_top1_agreement"] = float((a == b).float().mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf")
    ap.add_argument("--home", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/forge-gpu")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--qwen-config", help="HF config.json to use instead of Qwen2.5-7B's (dry runs)")
    ap.add_argument("--skip-smol", action="store_true")
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument("--stream-ref", action="store_true", help="issue 13: streaming reference numerics, CPU and CUDA")
    ap.add_argument("--ref-cuda-only", action="store_true", help="--stream-ref without the (minutes-long) CPU pass")
    ap.add_argument("--ref-samples", type=int, default=16)
    ap.add_argument("--ref-seq-len", type=int, default=512)
    args = ap.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (cpu dry run)",
               "torch": torch.__version__, "_out": str(Path(args.out) / "gpu_run.json")}
    try:
        if not args.skip_smol:
            smollm2(args, results)
        if not args.skip_7b:
            qwen7b(args, results)
        if args.stream_ref:
            stream_ref(args, results)
    finally:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_run.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
