"""Where rowwise FP8 and zero-point INT4 lose on SmolLM2 (issue 40): ModelOpt simulations on docs/quantization.md's
windows (lab/quant_table.py EVAL), FP32 perplexity from docs/quantization.json.

    python lab/format_ablation.py [--model DIR] [--out docs/quantization-ablation.json]

Rowwise FP8 with one part at a time (weights only, activations only), with the attention in float, and with
TensorRT-LLM's Meta recipe (attention and the first / last layers in float); the zero-point int4 grid with groups of
32, a size TensorRT-LLM's groupwise GEMM does not take (it shows how exactly the Q4_1 weights sit on that grid).
Simulations only, no checkpoint: rows TensorRT-LLM can load are measured in reference numerics by quant_table.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def variants(num_layers: int) -> dict[str, tuple[dict, bool]]:
    """name -> (ModelOpt config, zero-point override)."""
    import modelopt.torch.quantization as mtq
    rw = mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG

    def off(*pats):
        c = copy.deepcopy(rw)
        c["quant_cfg"] += [{"quantizer_name": p, "enable": False} for p in pats]
        return c
    zp = copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    for e in zp["quant_cfg"]:
        if e.get("quantizer_name") == "*weight_quantizer":
            e["cfg"]["block_sizes"] = {-1: 32, "type": "static"}
    last = num_layers - 1
    return {
        "fp8_pc_pt weights only (per-channel)": (off("*input_quantizer"), False),
        "fp8_pc_pt activations only (per-token)": (off("*weight_quantizer"), False),
        "fp8_pc_pt, attention in float": (off("*self_attn*"), False),
        f"fp8_pc_pt, Meta recipe (attention, layers 0 and {last} in float)":
            (off("*self_attn*", "*layers.0.*", f"*layers.{last}.*"), False),
        "int4 zero-point g32 (not a TensorRT-LLM group size)": (zp, True),
    }


def main(argv=None) -> None:
    import quant_table as qt
    from transformers import AutoTokenizer

    import modelopt.torch.quantization as mtq
    from pipeline.host.cpu import cpu_isa_class
    from pipeline.quant.calibrate import load_hf_model, perplexity, set_threads
    from pipeline.quant.zero_point import asymmetric_weights

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/smol-fp32")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "quantization-ablation.json"))
    a = ap.parse_args(argv)
    set_threads()
    fp32 = json.loads((Path(a.out).parent / "quantization.json").read_text())["ppl_fp32"]
    tok = AutoTokenizer.from_pretrained(a.model)
    ev = qt._windows(tok, qt.EVAL)
    calib = qt._windows(tok, {**{k: qt.CALIB[k] for k in ("set", "split", "seq_len", "seed")}, "samples": 4})
    out = {"model": a.model, "eval": qt.EVAL, "ppl_fp32": fp32, "isa": cpu_isa_class(), "rows": {}}
    m0 = load_hf_model(a.model, "cpu")
    for name, (cfg, zero_point) in variants(m0.config.num_hidden_layers).items():
        m = copy.deepcopy(m0)
        t = time.perf_counter()
        mtq.quantize(m, cfg, lambda mm: [mm(input_ids=calib[i:i + 2], use_cache=False) for i in range(0, 4, 2)])
        if zero_point:
            asymmetric_weights(m)
        p = perplexity(m, ev, 4, "cpu", name)
        out["rows"][name] = {"ppl": p, "delta_pct": 100 * (p - fp32) / fp32, "seconds": time.perf_counter() - t,
                             "date": time.strftime("%Y-%m-%d")}
        print(name, out["rows"][name], flush=True)
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
