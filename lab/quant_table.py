"""Regenerate docs/quantization.md: every ModelOpt algo's simulated perplexity vs FP32, PTQ vs QAT vs QAT+distill,
and for the rows of REFERENCE_ROWS the perplexity of the TensorRT-LLM checkpoint itself in reference numerics.

    python lab/quant_table.py [--model DIR] [--out docs/quantization.md] [--only ROW ...] [--force]

Results are kept per row in ``<out>.json`` (next to the markdown) together with the exact settings; a row whose
settings are unchanged is not re-run unless ``--force`` (or it is a REFERENCE_ROWS row measured before that column
existed). The simulated column is ModelOpt fake quantization in PyTorch; the checkpoint column is forge's torch
re-implementation of TensorRT-LLM's semantics on the exported fp16 tp 1 checkpoint (pipeline/trtllm/reference.py).
Neither is an engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

# --- the exact settings of the checked-in table ------------------------------------------------------------
EVAL = {"set": "wiki", "split": "eval", "samples": 8, "seq_len": 256, "seed": 0}
CALIB = {"set": "sotu", "split": "calib", "samples": 16, "seq_len": 256, "batch": 4, "seed": 0}
QAT = {"epochs": 2, "lr": 2e-4, "schedule": "cosine", "warmup_steps": 1, "batch": 4, "samples": 24,
       "seq_len": 128, "seed": 0, "set": "sotu", "split": "train"}
DISTILL = {"enabled": True, "temperature": 2.0, "alpha": 1.0}

ROWS: dict[str, dict] = {
    "int8_sq-a0.5": {"algo": "int8_sq", "alpha": 0.5},
    "int8_sq-a1.0": {"algo": "int8_sq", "alpha": 1.0},
    "int8_sq_per_token-a0.5": {"algo": "int8_sq_per_token", "alpha": 0.5},
    "int8_sq_per_token-a1.0": {"algo": "int8_sq_per_token", "alpha": 1.0},
    "int8_wo": {"algo": "int8_wo"},
    "int4_wo-g64": {"algo": "int4_wo", "block_size": 64},
    "int4_wo-g32": {"algo": "int4_wo", "block_size": 32},
    "int4_awq-g64": {"algo": "int4_awq", "block_size": 64},
    "fp8": {"algo": "fp8"},
    "fp8+kv_fp8": {"algo": "fp8", "kv_cache": "fp8"},
    "fp8_pc_pt": {"algo": "fp8_pc_pt"},
    "fp8_pc_pt+kv_fp8": {"algo": "fp8_pc_pt", "kv_cache": "fp8"},
    "fp8_pc_pt-meta": {"algo": "fp8_pc_pt", "options": {"meta_recipe": True}},
    "fp8_pc_pt-meta+kv_fp8": {"algo": "fp8_pc_pt", "kv_cache": "fp8", "options": {"meta_recipe": True}},
    "int4_zp-g64": {"algo": "int4_zp", "block_size": 64},
    "none (fp16 checkpoint)": {"method": "none", "algo": "none"},
    "int8_sq-a0.5+kv_int8": {"algo": "int8_sq", "alpha": 0.5, "kv_cache": "int8"},
    "int8_sq_per_token-a0.5+kv_int8": {"algo": "int8_sq_per_token", "alpha": 0.5, "kv_cache": "int8"},
    "int4_wo-g64 QAT": {"algo": "int4_wo", "block_size": 64, "method": "qat", "qat": dict(QAT)},
    "int4_wo-g64 QAT+distill": {"algo": "int4_wo", "block_size": 64, "method": "qat",
                                "qat": dict(QAT, distill=DISTILL)},
}
# rows whose checkpoint (fp16, tp 1) is also evaluated in reference numerics (issue 40)
REFERENCE_ROWS = ("none (fp16 checkpoint)", "fp8", "fp8+kv_fp8", "fp8_pc_pt", "fp8_pc_pt+kv_fp8", "fp8_pc_pt-meta",
                  "fp8_pc_pt-meta+kv_fp8", "int8_sq_per_token-a0.5", "int4_zp-g64")
Q4_1 = ("SmolLM2's weights come from a Q4_1 GGUF (asymmetric 4-bit, block 32): a zero-point grid of 32 holds them "
        "exactly (simulated +0.0 %, lab/format_ablation.py), which would flatter any zero-point format, but TensorRT-LLM "
        "takes groups of 64 / 128 only; no measure of INT4 on real fp16 weights")
NOTES = {
    "int4_wo-g32": "symmetric int4 (TRT-LLM W4A16 grid); the upstream weights are asymmetric Q4_1 g32, so "
                   "only an asymmetric g32 RTN would be lossless (measured-facts.md) — that is no win",
    "int4_zp-g64": Q4_1,
    "fp8_pc_pt-meta": "quantize.options.meta_recipe: attention and layers 0 / 29 in fp16",
    "fp8_pc_pt-meta+kv_fp8": "quantize.options.meta_recipe: attention and layers 0 / 29 in fp16",
    "none (fp16 checkpoint)": "no quantization: the fp16 rounding of the checkpoint alone",
}


def _q(row: dict) -> dict:
    q = {"method": "ptq", "calibration": {k: v for k, v in CALIB.items()}}
    q.update({k: v for k, v in row.items()})
    return q


def _windows(tok, spec: dict):
    from pipeline import data
    from pipeline.host.paths import forge_home
    text = data.load_text(spec["set"], spec["split"], forge_home())
    return data.token_windows(tok, text, spec["samples"], spec["seq_len"], spec["seed"])


def reference_ppl(model: Path, artifact: Path, q, ev, batch: int = 4) -> float:
    """Perplexity of the quantize artifact's TensorRT-LLM checkpoint (fp16, tp 1) in reference numerics on ``ev``;
    ``q`` is the row's quantize section (a QuantizeSection), written as its quantizer resolves it (as the
    checkpoint stage does)."""
    import math
    import tempfile

    from pipeline.eval.metrics import perplexity as batch_ppl
    from pipeline.modelinfo import ModelInfo
    from pipeline.quant.artifact import restore_model
    from pipeline.trtllm.checkpoint import write_checkpoint
    from pipeline.trtllm.contract import check_contract
    from pipeline.trtllm.quantizers import quantizer_of
    from pipeline.trtllm.reference import ReferenceModel

    info = ModelInfo.from_dir(model)
    qz = quantizer_of(q)
    with tempfile.TemporaryDirectory(prefix="forge-qtable-ckpt-") as d:
        m = restore_model(model, artifact)
        write_checkpoint(m, info, model, d, dtype="float16", tp=1, quant=qz.record(q, qz.options_of(q), info))
        del m
        problems = check_contract(d)
        if problems:
            raise RuntimeError(f"checkpoint violates the contract: {problems[:5]}")
        chunks = [ev[i:i + batch] for i in range(0, ev.shape[0], batch)]
        log_sum, n = 0.0, 0
        for x, lg in zip(chunks, ReferenceModel(d, device="cpu").iter_logits(chunks)):
            k = x.shape[0] * (x.shape[1] - 1)
            log_sum += math.log(batch_ppl(lg, x)) * k
            n += k
    return math.exp(log_sum / n)


def run(model: Path, out: Path, only: list[str] | None, force: bool, device: str) -> dict:
    import torch
    from transformers import AutoTokenizer

    from pipeline.host.cpu import cpu_isa_class
    from pipeline.quant.calibrate import load_hf_model, perplexity, quantize_model, set_threads
    from pipeline.recipe import QuantizeSection

    set_threads()
    res_path = out.with_suffix(".json")
    res = json.loads(res_path.read_text()) if res_path.exists() else {}
    if res.get("eval") != EVAL or res.get("model") != str(model):
        res = {}
    res.update({"model": str(model), "eval": EVAL, "device": device,
                "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs, torch threads "
                           f"{torch.get_num_threads()}" if device == "cpu" else device})
    res.setdefault("rows", {})
    tok = AutoTokenizer.from_pretrained(str(model))
    ev = _windows(tok, EVAL)
    calib = _windows(tok, {k: CALIB[k] for k in ("set", "split", "samples", "seq_len", "seed")})
    if "ppl_fp32" not in res:
        t = time.perf_counter()
        res["ppl_fp32"] = perplexity(load_hf_model(model, device), ev, 4, device, "eval FP32")
        res["fp32_eval_seconds"] = time.perf_counter() - t
        res_path.write_text(json.dumps(res, indent=1))
    for name, row in ROWS.items():
        if only and name not in only:
            continue
        q = _q(row)
        old = res["rows"].get(name, {})
        need_ref = name in REFERENCE_ROWS and "ppl_ref" not in old.get("metrics", {})
        if not force and old.get("q") == q and not need_ref:
            continue
        train = _windows(tok, q["qat"]) if q["method"] == "qat" else None
        tmp = Path(tempfile.mkdtemp(prefix="forge-qtable-"))
        try:
            section = QuantizeSection.model_validate(q)
            m = quantize_model(model, section, calib, tmp, train=train, eval_windows=ev, device=device,
                               ppl_fp32=res["ppl_fp32"])
            if name in REFERENCE_ROWS:
                t = time.perf_counter()
                m["ppl_ref"] = reference_ppl(model, tmp, section, ev)
                m["ppl_ref_delta_pct"] = 100.0 * (m["ppl_ref"] - res["ppl_fp32"]) / res["ppl_fp32"]
                m["seconds"]["reference"] = time.perf_counter() - t
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        res["rows"][name] = {"q": q, "metrics": m, "isa": cpu_isa_class(), "date": time.strftime("%Y-%m-%d")}
        res_path.write_text(json.dumps(res, indent=1, default=str))
        print(f"{name}: ppl {m.get('ppl_ptq')} -> qat {m.get('ppl_qat')} (fp32 {res['ppl_fp32']:.3f})", flush=True)
    _write(out, render(res))
    return res


# everything from this line on in the markdown is written by hand (the ONNX Runtime INT8 engines, issue 28) and kept
HAND_WRITTEN = "<!-- hand-written from here on: lab/quant_table.py keeps it -->"


def _write(out: Path, text: str) -> None:
    old = out.read_text() if out.is_file() else ""
    out.write_text(text + ("\n" + old[old.index(HAND_WRITTEN):] if HAND_WRITTEN in old else ""))


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def _note(name: str, r: dict) -> str:
    """The row's note and, for rows measured since rows carry it, the ISA class and date of the machine."""
    where = f"measured on {r['isa']}, {r['date']}" if r.get("isa") else ""
    return "; ".join(x for x in (NOTES.get(name, ""), where) if x)


def render(res: dict) -> str:
    rows = res["rows"]
    fp = res["ppl_fp32"]
    L = ["# Quantization accuracy (ModelOpt, simulated)", "",
         "Generated by `python lab/quant_table.py` — do not edit by hand; raw numbers in `quantization.json`.", "",
         "**What ran:** NVIDIA ModelOpt fake quantization (quantize→dequantize in fp32 PyTorch) of the source model, "
         "i.e. a simulation of each format's numerics (`ppl`); for some rows also the exported TensorRT-LLM "
         "checkpoint (fp16, tp 1) in forge's reference numerics, a torch re-implementation of what TensorRT-LLM "
         "computes from those tensors (`checkpoint ppl`, pipeline/trtllm/reference.py). No TensorRT / TensorRT-LLM "
         "engine was built or run.", "",
         f"- Model: `{res['model']}` (SmolLM2-135M-Instruct, fp32)",
         f"- Machine: {res['machine']} (device `{res['device']}`); shared with other jobs, so seconds are indicative",
         f"- Eval: `{EVAL['set']}/{EVAL['split']}`, {EVAL['samples']} windows x {EVAL['seq_len']} tokens "
         f"(seed {EVAL['seed']}, no BOS); FP32 perplexity **{fp:.3f}**",
         f"- Calibration: `{CALIB['set']}/{CALIB['split']}`, {CALIB['samples']} x {CALIB['seq_len']} tokens, "
         f"batch {CALIB['batch']}, seed {CALIB['seed']}",
         f"- QAT: `{QAT['set']}/{QAT['split']}`, {QAT['samples']} x {QAT['seq_len']} tokens, batch {QAT['batch']}, "
         f"{QAT['epochs']} epochs, AdamW lr {QAT['lr']} {QAT['schedule']} ({QAT['warmup_steps']} warm-up steps), "
         f"embeddings frozen; distillation: KL to the FP32 teacher, T={DISTILL['temperature']}, "
         f"alpha={DISTILL['alpha']}", "",
         "## PTQ", "",
         "| setting | algo | TRT-LLM quant_algo | kv | ppl | Δ vs FP32 | calib s | engine needs | checkpoint ppl "
         "(reference numerics) | Δ vs FP32 | note |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        m, q = r["metrics"], r["q"]
        if q.get("method") == "qat":
            continue
        tq = m["trtllm_quantization"]
        L.append(f"| {name} | {m['algo']} | {tq['quant_algo'] or '—'} | {tq['kv_cache_quant_algo'] or '—'} | "
                 f"{_f(m.get('ppl_ptq'))} | {_f(m.get('ppl_ptq_delta_pct'), '{:+.1f} %')} | "
                 f"{_f(m['seconds'].get('calibrate'), '{:.0f}')} | "
                 f"{'sm' + str(m['needs_sm']) + '+' if m['needs_sm'] else 'any'} | {_f(m.get('ppl_ref'))} | "
                 f"{_f(m.get('ppl_ref_delta_pct'), '{:+.1f} %')} | {_note(name, r)} |")
    qrows = {n: r for n, r in rows.items() if r["q"].get("method") == "qat"}
    if qrows:
        L += ["", "## PTQ vs QAT vs QAT+distill", "",
              "| setting | PTQ ppl (Δ) | QAT ppl (Δ) | gap recovered | steps | train s | loss first → last |",
              "|---|---|---|---|---|---|---|"]
        for name, r in qrows.items():
            m = r["metrics"]
            qm = m["qat"]
            L.append(f"| {name} | {_f(m.get('ppl_ptq'))} ({_f(m.get('ppl_ptq_delta_pct'), '{:+.1f} %')}) | "
                     f"{_f(m.get('ppl_qat'))} ({_f(m.get('ppl_qat_delta_pct'), '{:+.1f} %')}) | "
                     f"{_f(m.get('qat_gap_recovered'), '{:.0%}')} | {qm['steps']} | {qm['seconds']:.0f} | "
                     f"{qm['loss_first']:.3f} → {qm['loss_last']:.3f} |")
    outl = next((r["metrics"]["top_outliers"] for n, r in rows.items() if n.startswith("int8_sq-a0.5")), None)
    if outl:
        L += ["", "## Largest activation outliers (int8_sq α=0.5 calibration)", "",
              "max |x| of a Linear's input channel over the channel median; smoothing factor s = max over channels.", "",
              "| layer | outlier ratio | act amax | channels | SmoothQuant s max |", "|---|---|---|---|---|"]
        for o in outl:
            sf = (o.get("smoothing_factor") or {}).get("max")
            L.append(f"| {o['layer']} | {o['outlier_ratio']:.0f} | {o['act_amax']:.1f} | "
                     f"{', '.join(map(str, o['outlier_channels']))} | {_f(sf, '{:.1f}')} |")
    L += ["", "## Notes", "",
          "- int8_wo / int4_wo are exported to TensorRT-LLM as float weights with quant_algo W8A16 / W4A16 "
          "(TensorRT-LLM quantizes at build time, like its own quantize.py with EMPTY_CFG); the rows above use "
          "ModelOpt's weight-only fake-quant presets so that the loss of the format is visible.",
          "- FP8 (weights/activations or KV cache) can be exported anywhere but its engine needs sm89+ (Ada/Hopper).",
          "- Valid int4 group sizes for SmolLM2 (inputs 576 and 1536 wide): 32, 64, 96, 192; 128 is rejected at plan "
          "time (`quantize.block_size`).",
          "- Per-token SmoothQuant (`int8_sq_per_token`, `W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN`): the same ModelOpt "
          "SmoothQuant calibration and int8 weights as int8_sq, with each token's activations quantized by its own "
          "scale max|x|/127 (`pipeline/quant/per_token.py`). SmolLM2's attention-sink token reaches mean(x^2) "
          "~1.1e6 in the residual stream (issue 17), so a static per-tensor scale that covers it leaves the other "
          "tokens a few int8 steps: that is most of the int8_sq loss. gate_proj and up_proj get one smoothing vector "
          "(their mean, ModelOpt's `preprocess_linear_fusion`), because the plugin path folds it into the RMSNorm "
          "both read; without that step (not a loadable layout) α 0.5 measured +0.98 %. "
          "ModelOpt 0.47 exports only the static layout, so forge rewrites it into the layout TensorRT-LLM 1.2's "
          "plugin path loads (`pipeline/trtllm/sq_per_token.py`, every tensor cited there; contract rule §1.8 in "
          "`contract.py`; reference numerics in `reference.py`).",
          "- Rowwise FP8 (`fp8_pc_pt`, TensorRT-LLM's `FP8_PER_CHANNEL_PER_TOKEN`): E4M3 weights with one scale per "
          "output channel, activations quantized per token at run time (scale max|x| / 448), ModelOpt's "
          "`FP8_PER_CHANNEL_PER_TOKEN_CFG`, whose export is the layout TensorRT-LLM 1.2's `Fp8RowwiseLinear` loads "
          "(contract rule `RULE_FP8_PC_PT` in `contract.py`, the kernel's per-token formula in `reference.py`). Per-tensor "
          "`fp8` quantizes every token of a linear's input with one static scale, which SmolLM2's attention-sink token "
          "sets (as for static int8_sq). TensorRT-LLM builds rowwise FP8 for Llama / Mistral / Qwen2 (its attention has "
          "no q/k norms: Qwen3 and Gemma 3 are refused at plan time), on SM 89+ except SM 100-119; with an FP8 KV "
          "cache trtllm-build turns paged context FMHA off (only per-tensor FP8, W4A8_AWQ and NVFP4 keep it).",
          "- INT4 with zero points (`int4_zp`, written as `W4A16_AWQ` with `has_zero_point: true` and `pre_quant_scale: "
          "false`, `pipeline/trtllm/int4_zp.py`): min/max asymmetric groups of 64 or 128 input channels, the only group "
          "sizes TensorRT-LLM's groupwise GEMM takes (SmolLM2's widths allow 64). **Caveat:** SmolLM2's weights come "
          "from a Q4_1 GGUF (asymmetric 4-bit, block 32), so every block of 32 already lies on an asymmetric 16-level "
          "grid: the same zero-point grid with groups of 32 gives them back exactly (simulated perplexity +0.0 %, "
          "`lab/format_ablation.py`), a figure that would flatter any zero-point format. TensorRT-LLM cannot build "
          "that group size; at 64 two Q4_1 blocks with their own scale and minimum share one grid, and the row above "
          "measures that. Neither number is a measure of INT4 on real fp16 weights (the symmetric rows int4_wo / "
          "int4_awq are off this model's grid altogether).",
          "- `checkpoint ppl (reference numerics)`: the exported fp16, tp 1 TensorRT-LLM checkpoint of the row's "
          "quantize artifact, evaluated on the same windows by `pipeline/trtllm/reference.py`. It differs from the "
          "simulated `ppl` by the fp16 rounding ahead of each quantizer (FP8 casts are the most sensitive to it); the "
          "`none (fp16 checkpoint)` row is that rounding alone.", ""]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("FORGE_TEST_MODEL"),
                    help="HF dir of the FP32 source model (default: $FORGE_TEST_MODEL, else the builtin SmolLM2 conversion)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "quantization.md"))
    ap.add_argument("--only", nargs="*", help=f"rows to (re)run, of: {', '.join(ROWS)}")
    ap.add_argument("--force", action="store_true", help="re-run rows whose settings are unchanged")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from the JSON")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.render_only:
        _write(out, render(json.loads(out.with_suffix(".json").read_text())))
        return
    if a.model is None:
        from pipeline.host.paths import forge_home
        from pipeline.source import DEFAULT_SOURCE, resolve_source
        a.model = resolve_source(DEFAULT_SOURCE, forge_home()).path
    run(Path(a.model), out, a.only, a.force, a.device)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
