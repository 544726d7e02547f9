"""Peak host RSS and wall of the streaming checkpoint reference numerics (issue 13), CPU or CUDA.

Two parts:

* ``synthetic``: writes a TensorRT-LLM checkpoint of any HF config's shape straight from the contract's tensor
  list (``pipeline.trtllm.contract.expected_tensors``): int8 SmoothQuant (W8A8_SQ_PER_CHANNEL) + INT8 KV cache,
  random int8 weights with plausible scales, one rank file at a time. No model, no ModelOpt: a 7B-shaped
  checkpoint with fewer layers is a proxy for memory and time on a small machine.
* ``measure``: in a fresh child process (so nothing else is in its RSS), runs ``ReferenceModel.iter_logits``
  over ``samples x seq_len`` token ids, ``batch`` windows per forward. ``--passes per-batch`` re-streams the
  checkpoint for every batch (what the evaluate_checkpoint stage does, one ``logits`` call per chunk);
  ``one`` streams it once for all batches. Peak RSS is sampled every 20 ms (psutil) and also read from
  ``ru_maxrss``; the result is compared with the largest ``rank{N}.safetensors``.

    python lab/reference_memory.py synthetic --out /tmp/ck --layers 6 [--config HF_CONFIG.json] [--tp 2]
    python lab/reference_memory.py measure --ckpt /tmp/ck --device cpu --samples 16 --seq-len 512 --batch 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QWEN7B = ROOT / "pipeline/model_configs/Qwen--Qwen2.5-7B-Instruct.json"


def synthetic_config(hf_config: dict, *, tp: int = 2, layers: int | None = None) -> dict:
    """The config.json of the int8_sq + INT8-KV checkpoint ``synthetic_checkpoint`` writes."""
    from pipeline.modelinfo import ModelInfo

    info = ModelInfo.from_hf_config(hf_config)
    L = layers or info.num_layers
    qwen = info.model_type.startswith("qwen")
    cfg = {"architecture": info.architecture, "dtype": "float16", "logits_dtype": "float16",
           "hidden_size": info.hidden_size, "num_hidden_layers": L, "num_attention_heads": info.num_heads,
           "num_key_value_heads": info.num_kv_heads, "head_size": info.head_dim, "vocab_size": info.vocab_size,
           "hidden_act": "silu", "norm_epsilon": info.rms_norm_eps, "position_embedding_type": "rope_gpt_neox",
           "max_position_embeddings": info.max_position_embeddings, "intermediate_size": info.intermediate_size,
           "rotary_base": info.rope_theta, "rotary_scaling": None, "use_parallel_embedding": True,
           "embedding_sharding_dim": 0, "share_embedding_table": False, "tie_word_embeddings": False,
           "attn_bias": bool(info.attention_bias), "mlp_bias": False,
           "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
           "quantization": {"quant_algo": "W8A8_SQ_PER_CHANNEL", "kv_cache_quant_algo": "INT8"}}
    if qwen:
        cfg["qwen_type"] = info.model_type
    return cfg


def synthetic_dtype(name: str, dtypes) -> str:
    """The safetensors dtype ``synthetic_checkpoint`` gives tensor ``name`` (of the contract's allowed ``dtypes``)."""
    if "I8" in dtypes:
        return "I8"
    if name.endswith(("weights_scaling_factor", "activation_scaling_factor", "kv_cache_scaling_factor")):
        return "F32"
    return "F16"


def synthetic_checkpoint(out: Path, hf_config: dict, *, tp: int = 2, layers: int | None = None, seed: int = 0) -> dict:
    """Write an int8_sq + INT8-KV TensorRT-LLM checkpoint of ``hf_config``'s shape (``layers`` overrides the depth)."""
    import torch
    from safetensors.torch import save_file

    from pipeline.modelinfo import ModelInfo
    from pipeline.trtllm.contract import check_contract, expected_tensors

    info = ModelInfo.from_hf_config(hf_config)
    cfg = synthetic_config(hf_config, tp=tp, layers=layers)
    L = cfg["num_hidden_layers"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    for rank in range(tp):
        sd = {}
        for name, (shape, dtypes, _rule, required) in expected_tensors(cfg, rank).items():
            if not required:
                continue
            if "I8" in dtypes:
                t = torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)
            elif name.endswith("weights_scaling_factor"):          # effective weight std ~ 1/sqrt(in)
                fan_in = info.hidden_size
                t = torch.full(shape, 1.0 / (73.0 * fan_in ** 0.5), dtype=torch.float32)
            elif name.endswith("activation_scaling_factor"):
                t = torch.full(shape, 4.0 / 127, dtype=torch.float32)
            elif name.endswith("kv_cache_scaling_factor"):
                t = torch.full(shape, 0.05, dtype=torch.float32)
            elif name.endswith("prequant_scaling_factor") or name.endswith("layernorm.weight") or \
                    name.endswith("ln_f.weight"):
                t = torch.ones(shape, dtype=torch.float16)
            else:                                                   # embedding, lm_head, biases
                t = (torch.randn(shape, generator=g) * 0.02).to(torch.float16)
            assert {torch.int8: "I8", torch.float32: "F32", torch.float16: "F16"}[t.dtype] == \
                synthetic_dtype(name, dtypes), name
            sd[name] = t
        save_file(sd, str(out / f"rank{rank}.safetensors"))
        del sd
    problems = check_contract(out)
    if problems:
        raise RuntimeError("synthetic checkpoint violates the contract:\n" + "\n".join(problems[:10]))
    return {"layers": L, "tp": tp, "rank_bytes": [f.stat().st_size for f in sorted(out.glob("rank*.safetensors"))]}


def child(args) -> dict:
    """Runs in its own process: the reference over the ids, peak RSS and wall."""
    import torch

    from pipeline.trtllm.reference import ReferenceModel

    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = Path(args.ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    g = torch.Generator().manual_seed(1)
    ids = (torch.load(args.ids) if args.ids else
           torch.randint(0, min(32000, cfg["vocab_size"]), (args.samples, args.seq_len), generator=g))
    batches = [ids[i:i + args.batch] for i in range(0, ids.shape[0], args.batch)]
    if args.device == "cuda":
        torch.zeros(1, device="cuda")                    # CUDA context before the baseline
    from pipeline.host.rss import PeakRss, process_peak_rss_bytes
    nll = n = 0.0
    top1 = []
    t0 = time.perf_counter()
    with PeakRss(interval=0.02, children=False) as mem:
        rm = ReferenceModel(ckpt, device=args.device)
        outs = (rm.iter_logits(batches) if args.passes == "one" else (rm.logits(b) for b in batches))
        for b, lg in zip(batches, outs):
            for s in range(lg.shape[0]):      # next-token NLL, 128 positions at a time (small temporaries)
                for t in range(0, lg.shape[1] - 1, 128):
                    e = min(t + 128, lg.shape[1] - 1)
                    nll += float(torch.nn.functional.cross_entropy(lg[s, t:e], b[s, t + 1:e + 1], reduction="sum"))
            n += b[:, 1:].numel()
            top1.append(lg.argmax(-1).to(torch.int32))
            del lg
        if args.device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if args.top1_out:
        torch.save(torch.cat(top1), args.top1_out)
    sizes = [f.stat().st_size for f in ckpt.glob("rank*.safetensors")]
    res = {"device": args.device, "passes": args.passes, "samples": int(ids.shape[0]),
           "seq_len": int(ids.shape[1]), "batch": args.batch, "threads": torch.get_num_threads(),
           "wall_s": round(wall, 2), "peak_rss_bytes": mem.peak, "baseline_rss_bytes": mem.start,
           "ru_maxrss_bytes": process_peak_rss_bytes(),
           "largest_rank_file_bytes": max(sizes), "checkpoint_bytes": sum(sizes),
           "peak_rss_vs_largest_rank_file": round(mem.peak / max(sizes), 3),
           "ppl": round(float(torch.exp(torch.tensor(nll / n))), 3)}
    if args.device == "cuda":
        res["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        res["gpu"] = torch.cuda.get_device_name(0)
    return res


def measure(ckpt: Path, device: str, *, samples=16, seq_len=512, batch=2, passes="per-batch", threads=None,
            ids: Path | None = None, top1_out: Path | None = None) -> dict:
    """Run ``child`` in a fresh interpreter and return its JSON."""
    cmd = [sys.executable, __file__, "child", "--ckpt", str(ckpt), "--device", device, "--samples", str(samples),
           "--seq-len", str(seq_len), "--batch", str(batch), "--passes", passes]
    if threads:
        cmd += ["--threads", str(threads)]
    if ids:
        cmd += ["--ids", str(ids)]
    if top1_out:
        cmd += ["--top1-out", str(top1_out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, FORGE_PROGRESS="0"))
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("--out", required=True)
    s.add_argument("--config", default=str(QWEN7B))
    s.add_argument("--tp", type=int, default=2)
    s.add_argument("--layers", type=int)
    for name in ("measure", "child"):
        m = sub.add_parser(name)
        m.add_argument("--ckpt", required=True)
        m.add_argument("--device", default="cpu")
        m.add_argument("--samples", type=int, default=16)
        m.add_argument("--seq-len", type=int, default=512)
        m.add_argument("--batch", type=int, default=2)
        m.add_argument("--passes", choices=("per-batch", "one"), default="per-batch")
        m.add_argument("--threads", type=int)
        m.add_argument("--ids")
        m.add_argument("--top1-out", help="save the argmax token ids [samples, seq_len] here (CPU vs CUDA check)")
    args = ap.parse_args()
    if args.cmd == "synthetic":
        print(json.dumps(synthetic_checkpoint(Path(args.out), json.loads(Path(args.config).read_text()),
                                              tp=args.tp, layers=args.layers)))
    elif args.cmd == "child":
        print(json.dumps(child(args)))
    else:
        print(json.dumps(measure(Path(args.ckpt), args.device, samples=args.samples, seq_len=args.seq_len,
                                 batch=args.batch, passes=args.passes, threads=args.threads,
                                 ids=Path(args.ids) if args.ids else None), indent=2))


if __name__ == "__main__":
    main()
