"""The TensorRT-LLM formats of docs/quantization.md on every evaluation set of the default recipe, held-out genres
included (issue 40: "INT8 per-token stays <= +2 % on every eval set").

    python lab/format_heldout.py [--rows ROW ...] [--model DIR] [--out docs/quantization-heldout.json]

For each row (names and settings of lab/quant_table.py's ROWS, calibrated the same way): ModelOpt calibration once,
the TensorRT-LLM checkpoint (fp16, tp 1) written and contract-checked once, then on each set of
smollm2-135m-int8's ``validate.eval`` (same windows as the evaluate stage) the checkpoint's logits in forge's
reference numerics (pipeline/trtllm/reference.py: a torch re-implementation of TensorRT-LLM's semantics, not an
engine) against the FP32 HF model's: perplexity delta, top-1 agreement, logits cosine. Results are kept per row
with the machine's ISA class; a row already measured with the same settings is not re-run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

from quant_table import CALIB, ROWS, _q, _windows   # noqa: E402  (the table's rows and calibration, one home)

DEFAULT_ROWS = ("int8_sq_per_token-a0.5", "fp8_pc_pt-meta")
RECIPE = "smollm2-135m-int8"     # the CPU default: its eval sets are the held-out genres' home
BATCH = 2


def _sets(tok) -> dict:
    from pipeline.recipe import resolve
    return {f"{e.set}/{e.split}": _windows(tok, {"set": e.set, "split": e.split, "samples": e.samples,
                                                   "seq_len": e.seq_len, "seed": e.seed})
            for e in resolve(RECIPE).validate_.eval}


def _fp32_logits(model: Path, sets: dict) -> dict:
    """The FP32 HF model's logits per set and batch (CPU float32), computed once for every row."""
    import torch

    from pipeline.quant.artifact import load_hf_model
    m = load_hf_model(model, "cpu")
    out = {}
    with torch.inference_mode():
        for name, ids in sets.items():
            out[name] = [m(input_ids=ids[i:i + BATCH]).logits.float() for i in range(0, ids.shape[0], BATCH)]
    return out


def measure_row(model: Path, name: str, calib, sets: dict, fp32: dict) -> dict:
    from pipeline.eval.metrics import LogitsComparer
    from pipeline.modelinfo import ModelInfo
    from pipeline.quant.artifact import restore_model
    from pipeline.quant.calibrate import quantize_model
    from pipeline.recipe import QuantizeSection
    from pipeline.trtllm.checkpoint import write_checkpoint
    from pipeline.trtllm.contract import check_contract
    from pipeline.trtllm.quantizers import quantizer_of
    from pipeline.trtllm.reference import ReferenceModel

    q = QuantizeSection.model_validate(_q(ROWS[name]))
    tmp = Path(tempfile.mkdtemp(prefix="forge-heldout-"))
    t0 = time.perf_counter()
    try:
        quantize_model(model, q, calib, tmp / "q", device="cpu")
        t_cal = time.perf_counter() - t0
        info, qz = ModelInfo.from_dir(model), quantizer_of(q)
        m = restore_model(model, tmp / "q")
        write_checkpoint(m, info, model, tmp / "ckpt", dtype="float16", tp=1, quant=qz.record(q, qz.options_of(q), info))
        del m
        problems = check_contract(tmp / "ckpt")
        if problems:
            raise RuntimeError(f"{name}: checkpoint violates the contract: {problems[:5]}")
        res = {}
        for set_name, ids in sets.items():
            chunks = [ids[i:i + BATCH] for i in range(0, ids.shape[0], BATCH)]
            cmp = LogitsComparer()
            for x, ref, lg in zip(chunks, fp32[set_name], ReferenceModel(tmp / "ckpt", device="cpu").iter_logits(chunks)):
                cmp.update(ref, lg, x)
            r = cmp.result()
            res[set_name] = {k: r[k] for k in ("ref_ppl", "ppl", "ppl_delta_pct", "top1_agreement", "logits_cosine",
                                               "tokens")}
            print(f"  {name} {set_name}: ppl {r['ref_ppl']:.3f} -> {r['ppl']:.3f} ({r['ppl_delta_pct']:+.2f} %), "
                  f"top-1 {100 * r['top1_agreement']:.1f} %", flush=True)
        return {"sets": res, "seconds": {"calibrate": t_cal, "total": time.perf_counter() - t0}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def render(res: dict) -> str:
    sets = list(next(iter(res["rows"].values()))["metrics"]["sets"]) if res["rows"] else []
    L = [f"Checkpoint (fp16, tp 1) in reference numerics vs the FP32 HF model, per set of `{RECIPE}`'s "
         "`validate.eval`; ppl Δ / top-1 agreement (`lab/format_heldout.py`, raw numbers in "
         "`quantization-heldout.json`). Not an engine.", "",
         "| row | " + " | ".join(sets) + " | measured on |", "|---|" + "---|" * len(sets) + "---|"]
    for name, r in res["rows"].items():
        s = r["metrics"]["sets"]
        L.append(f"| {name} | " + " | ".join(f"{s[k]['ppl_delta_pct']:+.2f} % / {100 * s[k]['top1_agreement']:.1f} %"
                                            for k in sets) + f" | {r['isa']}, {r['date']} |")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=list(DEFAULT_ROWS), help=f"of: {', '.join(ROWS)}")
    ap.add_argument("--model", default=os.environ.get("FORGE_TEST_MODEL"))
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "docs" / "quantization-heldout.json")
    ap.add_argument("--render-only", action="store_true")
    a = ap.parse_args(argv)
    res = json.loads(a.out.read_text()) if a.out.exists() else {"rows": {}}
    if a.render_only:
        print(render(res))
        return 0
    unknown = [r for r in a.rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; of: {', '.join(ROWS)}")

    from transformers import AutoTokenizer

    from pipeline.host.cpu import cpu_isa_class
    from pipeline.quant.calibrate import set_threads

    if a.model is None:
        from pipeline.host.paths import forge_home
        from pipeline.source import DEFAULT_SOURCE, resolve_source
        a.model = resolve_source(DEFAULT_SOURCE, forge_home()).path
    model = Path(a.model)
    set_threads()
    tok = AutoTokenizer.from_pretrained(str(model))
    sets = _sets(tok)
    calib = _windows(tok, {k: CALIB[k] for k in ("set", "split", "samples", "seq_len", "seed")})
    todo = [r for r in a.rows if res["rows"].get(r, {}).get("q") != _q(ROWS[r])]
    fp32 = _fp32_logits(model, sets) if todo else {}
    for name in todo:
        print(f"{name} ...", flush=True)
        m = measure_row(model, name, calib, sets, fp32)
        res["rows"][name] = {"q": _q(ROWS[name]), "metrics": m, "isa": cpu_isa_class(),
                             "date": time.strftime("%Y-%m-%d")}
        a.out.write_text(json.dumps(res, indent=1))
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
