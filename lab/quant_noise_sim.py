"""How much weight-only rounding alone moves a model's logits (issue 26): the torch model against itself with every
decoder projection fake-quantized to N bits per block of 32 along the input dimension, round to nearest with an
integer zero point (MatMulNBits' layout), and the lm_head at 8 bits; logits cosine, top-1 agreement and perplexity
change on real text, the metrics forge's evaluate reports. For random weights (model.source random:...) this says
what an engine that is right should score, so that a miss can be told from a broken engine. forge's own evaluate
does this for a recipe with validate.reference: simulated.

    python lab/quant_noise_sim.py --model-dir DIR --text FILE --tokens 512 --bits 4 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere


def fake_quant_(w, bits: int, block: int = 32) -> None:
    """In place: asymmetric RTN per block of ``block`` input columns, integer zero point, on MatMulNBits' own grid
    (pipeline/eval/fake_quant.py, the simulated reference of validate.reference: simulated). Before issue 38 this
    notebook used its own min/max grid (not clamped to include 0), so the 2026-12-04 figures in docs/gpu-runs.md
    came from that slightly different grid."""
    from pipeline.eval.fake_quant import block_rtn
    w.copy_(block_rtn(w, bits, block, symmetric=False))


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the fp32 model is 4 bytes a parameter)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    ids = tok(Path(a.text).read_text()[:200_000])["input_ids"][:a.tokens]
    ids = torch.tensor(ids).view(-1, a.window).to(a.device)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).to(a.device).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n}

    def run():
        return torch.cat([model(input_ids=r[None]).logits[0].float().cpu() for r in ids])

    def nll(logits):
        lp = torch.log_softmax(logits[:-1].double(), -1)
        tgt = ids.reshape(-1)[1:].cpu()
        keep = torch.ones_like(tgt, dtype=torch.bool)
        keep[a.window - 1::a.window] = False    # no target across windows
        return -lp[torch.arange(len(tgt)), tgt][keep].mean().item()

    t0 = time.time()
    ref = run()
    res = {"model": a.model_dir, "positions": ref.shape[0], "ref_ppl": float(torch.tensor(nll(ref)).exp()),
           "ref_s": round(time.time() - t0, 1), "runs": {}}
    for bits in a.bits:
        for n, p in model.named_parameters():
            if n in original:
                p.copy_(original[n])
                fake_quant_(p.data, 8 if n.startswith("lm_head") else bits)
        got = run()
        cos = torch.nn.functional.cosine_similarity(ref.double(), got.double(), -1).mean().item()
        top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
        rel = ((got - ref).double().norm() / ref.double().norm()).item()
        res["runs"][f"int{bits}_wo"] = {"logits_cosine": cos, "top1_agreement": top1, "rel_logit_error": rel,
                                        "ppl_delta_pct": 100 * (float(torch.tensor(nll(got) - nll(ref)).exp()) - 1)}
        print(json.dumps({bits: res["runs"][f"int{bits}_wo"]}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
