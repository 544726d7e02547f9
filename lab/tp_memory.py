"""Issue 18: per-GPU memory of the one-rank-per-GPU reference run next to `forge memory`'s prediction, tp 2 / tp 4.

For each tp:
1. a Qwen2.5-7B-shaped int8_sq + INT8-KV TensorRT-LLM checkpoint with random weights, written straight from the
   contract's tensor list (``lab/reference_memory.py synthetic``: no model, no ModelOpt);
2. ``torchrun --nproc-per-node <tp> -m pipeline.trtllm.distributed CKPT --resident --bench-allreduce``: each rank
   keeps its own decoder layers on its GPU as stored (int8 + scales), as an engine does;
3. ``plan_memory`` (what `forge memory` prints) for the same shape, tp, batch and sequence length, with the
   embedding split over the ranks as forge's checkpoints have it.

Compared per rank:
- the rank file's bytes by part (``pipeline.trtllm.memory.rank_weight_bytes``) vs the plan's weights (same bytes expected);
- on GPUs: ``resident_gpu_bytes`` (``torch.cuda.memory_allocated`` after the pass: the resident decoder layers)
  vs the plan's decoder part (linears + quant scales + norms), and ``peak_gpu_bytes``
  (``torch.cuda.max_memory_allocated``) beside the plan's total.
The peak is not expected to equal the plan's total: the reference reads embedding and lm_head from the file each
pass (lm_head 4096 rows at a time) instead of holding them, has no paged KV pool or runtime workspace, dequantizes
one linear at a time to float32 (out x in x 4 bytes, transient) and keeps float32 activations. The JSON says which
figure is which.

    python lab/tp_memory.py --out OUT [--tp 2 4] [--layers 28] [--samples 4] [--seq-len 512] [--batch 2]
                                [--work /tmp/forge-tpmem] [--device auto|cuda|cpu] [--compare] [--config HF.json]

Writes OUT/tp_memory.json and OUT/tp_memory.md; each torchrun's result.json under OUT/tp<N>/.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "lab"))
QWEN7B = ROOT / "pipeline/model_configs/Qwen--Qwen2.5-7B-Instruct.json"
DECODER_PARTS = ("decoder linears", "quant scales", "norms/bias")


def _ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def one_tp(args, hf_cfg: dict, tp: int) -> dict:
    from reference_memory import synthetic_checkpoint

    from pipeline.trtllm.memory import plan_memory, rank_weight_bytes
    from pipeline.modelinfo import ModelInfo
    from pipeline.trtllm.distributed import launch

    layers = args.layers or hf_cfg["num_hidden_layers"]
    ckpt = Path(args.work) / f"qwen7b-shape-L{layers}-tp{tp}"
    t0 = time.perf_counter()
    if not (ckpt / "config.json").exists():
        shutil.rmtree(ckpt, ignore_errors=True)
        synthetic_checkpoint(ckpt, hf_cfg, tp=tp, layers=layers)
    write_s = time.perf_counter() - t0
    run_args = ["--samples", str(args.samples), "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                "--resident", "--bench-allreduce"] + (["--compare"] if args.compare else [])
    res = launch(ckpt, tp, Path(args.out) / f"tp{tp}", *run_args, device=args.device, timeout_s=args.timeout,
                 threads_per_rank=args.threads)
    info = ModelInfo.from_hf_config(dict(hf_cfg, num_hidden_layers=layers))
    plan = plan_memory(info, quant_algo="int8_sq", kv_cache="int8", dtype="float16", tp=tp, pp=1,
                       max_batch_size=args.batch, max_seq_len=args.seq_len, parallel_embedding=True)
    decoder_plan = sum(plan.weights[p]["bytes"] for p in DECODER_PARTS if p in plan.weights)
    rows = []
    for r in res["ranks"]:
        files = rank_weight_bytes(ckpt, r["rank"])
        file_total = sum(files.values())
        rows.append({"rank": r["rank"], "device": r["device_name"],
                     "rank_file_weight_bytes": file_total, "rank_file_by_part": files,
                     "plan_weights_bytes": plan.weights_bytes,
                     "plan_weights_vs_rank_file": _ratio(plan.weights_bytes, file_total),
                     "resident_gpu_bytes": r.get("resident_gpu_bytes"), "plan_decoder_bytes": decoder_plan,
                     "resident_vs_plan_decoder": _ratio(r.get("resident_gpu_bytes"), decoder_plan),
                     "peak_gpu_bytes": r.get("peak_gpu_bytes"), "plan_total_bytes": plan.total_bytes,
                     "peak_vs_plan_total": _ratio(r.get("peak_gpu_bytes"), plan.total_bytes),
                     "peak_rss_bytes": r["peak_rss_bytes"], "wall_s": r["wall_s"],
                     "allreduce_s_per_layer_mean": r["allreduce_s_per_layer_mean"]})
    return {"tp": tp, "layers": layers, "checkpoint": str(ckpt), "checkpoint_write_s": round(write_s, 1),
            "backend": res["backend"], "samples": res["samples"], "seq_len": res["seq_len"], "batch": res["batch"],
            "wall_s": res["wall_s"], "allreduce_bench": res.get("allreduce_bench"), "compare": res.get("compare"),
            "plan": {"weights": plan.weights, "weights_bytes": plan.weights_bytes,
                     "kv_cache_paged_bytes": plan.kv_cache_paged_bytes, "activation_bytes": plan.activation_bytes,
                     "logits_bytes": plan.logits_bytes, "runtime_bytes": plan.runtime_bytes,
                     "total_bytes": plan.total_bytes, "args": plan.args},
            "ranks": rows}


def plan_only(hf_cfg: dict, tp: int, layers: int | None, batch: int, seq_len: int) -> dict:
    """No GPU, no files: each rank's bytes by part from the contract's tensor list (the dtypes the synthetic
    checkpoint uses) next to the plan's weights. At full depth this is what step 1 would write."""
    from reference_memory import synthetic_config, synthetic_dtype

    from pipeline.trtllm.memory import ST_BYTES, plan_memory, weight_part
    from pipeline.modelinfo import ModelInfo
    from pipeline.trtllm.contract import expected_tensors

    cfg = synthetic_config(hf_cfg, tp=tp, layers=layers)
    info = ModelInfo.from_hf_config(dict(hf_cfg, num_hidden_layers=cfg["num_hidden_layers"]))
    plan = plan_memory(info, quant_algo="int8_sq", kv_cache="int8", dtype="float16", tp=tp, pp=1,
                       max_batch_size=batch, max_seq_len=seq_len, parallel_embedding=True)
    ranks = []
    for rank in range(tp):
        parts: dict[str, int] = {}
        for name, (shape, dtypes, _rule, required) in expected_tensors(cfg, rank).items():
            if required:
                part = weight_part(name)
                parts[part] = parts.get(part, 0) + math.prod(shape) * ST_BYTES[synthetic_dtype(name, dtypes)]
        total = sum(parts.values())
        ranks.append({"rank": rank, "contract_bytes": total, "by_part": parts,
                      "plan_weights_vs_contract": _ratio(plan.weights_bytes, total)})
    return {"tp": tp, "layers": cfg["num_hidden_layers"], "plan_weights": plan.weights,
            "plan_weights_bytes": plan.weights_bytes, "plan_total_bytes": plan.total_bytes, "ranks": ranks}


def markdown(result: dict) -> str:
    gb = lambda b: "-" if b is None else f"{b / 1e6:,.2f}"           # noqa: E731
    out = ["| tp | rank | device | rank file weights MB | plan weights MB | resident GPU MB | plan decoder MB | "
           "peak GPU MB | plan total MB | all-reduce / layer |", "|" + "---|" * 10]
    for t in result["runs"]:
        for r in t["ranks"]:
            ar = r["allreduce_s_per_layer_mean"]
            out.append(f"| {t['tp']} | {r['rank']} | {r['device']} | {gb(r['rank_file_weight_bytes'])} | "
                       f"{gb(r['plan_weights_bytes'])} | {gb(r['resident_gpu_bytes'])} | {gb(r['plan_decoder_bytes'])}"
                       f" | {gb(r['peak_gpu_bytes'])} | {gb(r['plan_total_bytes'])} | "
                       f"{'-' if ar is None else f'{ar * 1e3:.2f} ms'} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--config", default=str(QWEN7B), help="HF config.json of the shape (default Qwen2.5-7B)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the config's)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--work", default="/tmp/forge-tpmem", help="where the checkpoints are written (reused)")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--compare", action="store_true", help="also the single-process reference on rank 0")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--plan-only", action="store_true",
                    help="no checkpoint, no run: the contract's per-rank bytes vs the plan (runs anywhere)")
    args = ap.parse_args(argv)
    hf_cfg = json.loads(Path(args.config).read_text())
    if args.plan_only:
        res = [plan_only(hf_cfg, tp, args.layers, args.batch, args.seq_len) for tp in args.tp]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tp_memory_plan_only.json").write_text(json.dumps(res, indent=2))
        for r in res:
            print(f"tp {r['tp']} ({r['layers']} layers): plan weights {r['plan_weights_bytes']:,} B per rank; "
                  f"contract " + ", ".join(f"rank {x['rank']} {x['contract_bytes']:,} B "
                                           f"(plan/contract {x['plan_weights_vs_contract']})" for x in r["ranks"]))
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    result = {"label": "checkpoint reference numerics, one rank per process: memory vs forge memory",
              "config": args.config, "runs": []}
    try:
        for tp in args.tp:
            result["runs"].append(one_tp(args, hf_cfg, tp))
    finally:
        (Path(args.out) / "tp_memory.json").write_text(json.dumps(result, indent=2))
        (Path(args.out) / "tp_memory.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
