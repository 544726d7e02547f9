"""INT8 engines vs the FP32 engine on every evaluation set of a recipe, side by side (docs/quantization.md).

    python lab/int8_heldout.py --ref fp32=DIR --engine blockwise=DIR --engine mixed=DIR [--recipe R] [--out J]

For each set of the recipe's ``validate.eval`` (same windows as the evaluate stage): perplexity delta and top-1
agreement of each engine against the FP32 ONNX Runtime engine, plus whether three of the set's windows cut to
different lengths give each engine bitwise-equal logits alone and batched (right padding). Prints a markdown table;
``--out`` keeps the numbers with the CPU they were measured on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere


def _pair(s: str) -> tuple[str, str]:
    label, _, d = s.partition("=")
    if not d:
        raise SystemExit(f"expected LABEL=DIR, got {s!r}")
    return label, d


def invariant(eng, ids) -> bool:
    import numpy as np

    rows = [ids[0, :64], ids[1, :200], ids[2, :137]]
    T = max(len(r) for r in rows)
    batch, mask = np.zeros((3, T), np.int64), np.zeros((3, T), np.int64)
    for i, r in enumerate(rows):
        batch[i, :len(r)], mask[i, :len(r)] = r, 1
    together = eng.logits(batch, mask)
    return all(np.array_equal(eng.logits(r[None])[0], together[i, :len(r)]) for i, r in enumerate(rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, type=_pair)
    ap.add_argument("--engine", action="append", required=True, type=_pair)
    ap.add_argument("--recipe", default="smollm2-135m-int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from pipeline import data
    from pipeline.host.cpu import cpu_facts
    from pipeline.host.paths import forge_home
    from pipeline.eval.metrics import LogitsComparer
    from pipeline.ort.engine import OrtEngine
    from pipeline.recipe import resolve

    r = resolve(a.recipe)
    ref = OrtEngine(a.ref[1], threads=a.threads)
    engines = {label: OrtEngine(d, threads=a.threads) for label, d in a.engine}
    tok = AutoTokenizer.from_pretrained(a.ref[1])
    res: dict = {"machine": cpu_facts(), "reference": a.ref[0], "recipe": a.recipe, "sets": {}}
    for e in r.validate_.eval:
        ids = data.token_windows(tok, data.load_text(e.set, e.split, forge_home()), e.samples, e.seq_len,
                                 e.seed).numpy()
        cmp = {k: LogitsComparer() for k in engines}
        for s in range(0, len(ids), 2):
            rl = ref.logits(ids[s:s + 2])
            for k, eng in engines.items():
                cmp[k].update(rl, eng.logits(ids[s:s + 2]), ids[s:s + 2])
        res["sets"][f"{e.set}/{e.split}"] = {
            k: {**{m: c.result()[m] for m in ("ppl_delta_pct", "top1_agreement", "tokens")},
                "batch_invariant_measured": invariant(engines[k], ids) if len(ids) >= 3 else None}
            for k, c in cmp.items()}
        print(e.set, {k: round(v["ppl_delta_pct"], 3) for k, v in res["sets"][f"{e.set}/{e.split}"].items()},
              flush=True)
    print(f"\n{res['machine'].get('isa_class')} ({res['machine'].get('cpu_model')}), vs {a.ref[0]}\n")
    print("| set | " + " | ".join(f"{k} ppl Δ | {k} top-1 | {k} bitwise batched" for k in engines) + " |")
    print("|---|" + "---|---|---|" * len(engines))
    for name, by in res["sets"].items():
        print(f"| {name} | " + " | ".join(f"{v['ppl_delta_pct']:+.2f} % | {100 * v['top1_agreement']:.1f} % | "
                                          f"{v['batch_invariant_measured']}" for v in by.values()) + " |")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
