"""results.md of the GPU bench (bench/gpu.py): the figures of every entry, decode as a % of the run's own
bandwidth bound, ratios between entries of the same run, the builds, and the summary against issue 38's goals.
Everything here is arithmetic on results.json; nothing is measured."""

from __future__ import annotations

from .bound import bound_tok_s
from .measure import ratio

RATIOS = [("FP16 / FP32", "fp16", "fp32"), ("INT4 / FP16", "int4", "fp16"),
          ("FP16 CUDA graph / off", "fp16+graph", "fp16"), ("INT4 CUDA graph / off", "int4+graph", "int4"),
          ("INT4 CUDA graph / FP16 CUDA graph", "int4+graph", "fp16+graph"),
          ("INT8 w/o CUDA graph / FP16 CUDA graph", "int8wo+graph", "fp16+graph"),
          ("FP16 CUDA graph / ORT GenAI fp16 CUDA graph", "fp16+graph", "oga-fp16+graph"),
          ("FP16 CUDA graph / ORT GenAI fp16", "fp16+graph", "oga-fp16"),
          ("INT4 CUDA graph / ORT GenAI INT4 CUDA graph", "int4+graph", "oga-int4+graph"),
          ("INT4 CUDA graph / ORT GenAI INT4", "int4+graph", "oga-int4"),
          ("FP16 CUDA graph / PyTorch compiled fp16", "fp16+graph", "torch-static-fp16"),
          ("FP16 / PyTorch static-KV fp16", "fp16", "torch-static-fp16"),
          ("INT4 CUDA graph / PyTorch compiled INT4", "int4+graph", "torch-static-int4"),
          ("PyTorch INT4 / PyTorch fp16", "torch-static-int4", "torch-static-fp16"),
          ("ORT GenAI INT4 / fp16, CUDA graph", "oga-int4+graph", "oga-fp16+graph"),
          ("ORT GenAI INT4 / fp16", "oga-int4", "oga-fp16"),
          ("FP16 / PyTorch eager fp16 (transformers)", "fp16", "torch-fp16"),
          ("FP16 CUDA graph / PyTorch eager fp16 (transformers)", "fp16+graph", "torch-fp16")]

OURS_FP16, OURS_INT4 = ["fp16+graph", "fp16"], ["int4+graph", "int4"]
OGA_FP16, OGA_INT4 = ["oga-fp16+graph", "oga-fp16"], ["oga-int4+graph", "oga-int4"]


def fig(r: dict | None, *path: str):
    cur = r
    for k in path:
        cur = (cur or {}).get(k) if isinstance(cur, dict) else None
    return cur


def first(engines: dict, names: list[str], *path: str) -> tuple[str | None, float | None]:
    """The first of ``names`` that has the figure at ``path``."""
    for n in names:
        v = fig(engines.get(n), *path)
        if v is not None:
            return n, v
    return None, None


def bandwidth(results: dict) -> float | None:
    return fig(results.get("engines", {}).get("bandwidth"), "copy", "bytes_per_s")


def step_bytes(results: dict) -> int | None:
    return fig(results.get("bound"), "step", "step_bytes")


def pct_of_bound(results: dict, tok_s: float | None, batch: int, own_bytes: int | None = None) -> float | None:
    b = bound_tok_s(bandwidth(results), own_bytes or step_bytes(results), batch)
    return None if tok_s is None or not b else 100 * tok_s / b


def _measured(r: dict) -> bool:
    return bool(r.get("prefill") or r.get("decode") or r.get("ttft"))


def _prefill_key(results: dict) -> str | None:
    keys = [k for r in results.get("engines", {}).values() for k in (r.get("prefill") or {})]
    return "1x2048" if "1x2048" in keys else (keys[0] if keys else None)


def header(results: dict) -> list[str]:
    lines = [f"GPU: {results.get('gpu')}"]
    bw, sb = bandwidth(results), step_bytes(results)
    bwr = fig(results.get("engines", {}).get("bandwidth"), "copy", "bytes_per_s_spread")
    step = fig(results.get("bound"), "step") or {}
    if bw:
        lines.append(f"Device-to-device copy (read + write): {bw / 1e9:,.0f} GB/s"
                     + (f" [{bwr['min'] / 1e9:,.0f}-{bwr['max'] / 1e9:,.0f}], median of {bwr['n']}" if bwr else "")
                     + ".")
    if sb:
        lines.append(f"One decode step reads {sb / 1e9:.2f} GB ({step['step_params']:,} parameters at "
                     f"{step['bytes_per_param']:g} bytes: every weight but the embedding table; from the "
                     f"{step['source']}).")
    if bw and sb:
        lines.append(f"Decode bound: {bound_tok_s(bw, sb, 1):,.1f} tok/s at batch 1 (B x that at batch B; K/V reads "
                     "not counted).")
    if fig(results.get("bound"), "error"):
        lines.append(f"Decode-step bytes unknown: {results['bound']['error']}")
    return lines


def figures_table(results: dict) -> list[str]:
    eng = results.get("engines", {})
    names = [n for n, r in eng.items() if r.get("kind") not in ("bandwidth", "oga-build") and n != "bandwidth"
             and not n.endswith("-build") and (_measured(r) or "error" in r)]
    if not names:
        return []
    pre = sorted({k for n in names for k in (eng[n].get("prefill") or {})}, key=_shape_order)
    dec = sorted({int(k) for n in names for k in (eng[n].get("decode") or {})})
    rows: list[tuple[str, list[str]]] = []
    for k in pre:
        rows.append((f"prefill {k} tok/s", [_num(fig(eng[n], "prefill", k, "tokens_per_s")) for n in names]))
    ttft_n = sorted({fig(eng[n], "ttft", "prompt_tokens") for n in names if fig(eng[n], "ttft")})
    for t in ttft_n:
        rows.append((f"TTFT ms ({t}-token prompt)", [
            _num(1e3 * v, 2) if (v := fig(eng[n], "ttft", "median_s")) is not None
            and fig(eng[n], "ttft", "prompt_tokens") == t else "-" for n in names]))
    for b in dec:
        rows.append((f"decode b{b} tok/s", [_num(fig(eng[n], "decode", str(b), "tokens_per_s")) for n in names]))
        if bandwidth(results) and step_bytes(results):
            rows.append((f"decode b{b} % of fp16 bound", [
                _pct(pct_of_bound(results, fig(eng[n], "decode", str(b), "tokens_per_s"), b)) for n in names]))
    if bandwidth(results) and any(eng[n].get("weights_step_bytes") for n in names):
        rows.append(("decode b1 % of own-bytes bound", [
            _pct(pct_of_bound(results, fig(eng[n], "decode", "1", "tokens_per_s"), 1, eng[n]["weights_step_bytes"]))
            if eng[n].get("weights_step_bytes") else "-" for n in names]))
        rows.append(("own decode-step bytes GB", [_num(eng[n]["weights_step_bytes"] / 1e9, 2)
                                                  if eng[n].get("weights_step_bytes") else "-" for n in names]))
    rows.append(("GPU MiB (process)", [_num(eng[n].get("gpu_memory_mb")) for n in names]))
    rows.append(("entry wall s", [_num(eng[n].get("wall_s")) for n in names]))
    out = ["| figure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return out


def ratios_table(results: dict) -> list[str]:
    eng = results.get("engines", {})
    pre = sorted({k for r in eng.values() for k in (r.get("prefill") or {})}, key=_shape_order)
    dec = sorted({int(k) for r in eng.values() for k in (r.get("decode") or {})})
    rows = []
    for label, a, b in RATIOS:
        ra, rb = eng.get(a), eng.get(b)
        if not ra or not rb or not _measured(ra) or not _measured(rb):
            continue
        cells = [_x(ratio(fig(ra, "prefill", k, "tokens_per_s"), fig(rb, "prefill", k, "tokens_per_s"))) for k in pre]
        cells += [_x(ratio(fig(ra, "decode", str(d), "tokens_per_s"), fig(rb, "decode", str(d), "tokens_per_s")))
                  for d in dec]
        same = fig(ra, "ttft", "prompt_tokens") == fig(rb, "ttft", "prompt_tokens")
        cells.append(_x(ratio(fig(rb, "ttft", "median_s"), fig(ra, "ttft", "median_s")) if same else None))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    head = [f"prefill {k}" for k in pre] + [f"decode b{d}" for d in dec] + ["TTFT (b / a)"]
    return ["| ratio (a / b) | " + " | ".join(head) + " |", "|---|" + "---|" * len(head), *rows]


def builds_table(results: dict) -> list[str]:
    eng = results.get("engines", {})
    total = fig(results.get("bound"), "step", "params_total")
    rows = []
    for n, r in eng.items():
        b = r.get("build")
        if r.get("kind") != "oga-build" or not b:
            continue
        rss = b.get("peak_rss_bytes")
        rows.append(f"| {n} | {b.get('args', '')} | "
                    + ("reused" if b.get("reused") else _num(b.get("build_s"))) + " | "
                    + (_num(rss / 1e9, 1) if rss else "-") + " | "
                    + (_x(rss / (2 * total)) if rss and total else "-") + " | "
                    + (_num(r["weights_step_bytes"] / 1e9, 2) if r.get("weights_step_bytes") else "-") + " |")
    if not rows:
        return []
    return ["| build | builder arguments | wall s | peak host RSS GB | / fp16 weight bytes | decode-step GB |",
            "|---|---|---|---|---|---|", *rows]


def summary(results: dict) -> list[dict]:
    """Issue 38's headline comparisons, each from the first entry of its list that has the figure."""
    eng = results.get("engines", {})
    rows = []

    def add(label, value, src, goal=None, higher=True, unit="x"):
        if value is None:
            return
        verdict = ""
        if goal is not None:
            ok = value >= goal if higher else value <= goal
            verdict = "met" if ok else f"missed: {value / goal:.2f} of the goal"
        rows.append({"figure": label, "value": value, "unit": unit, "from": src,
                     "goal": None if goal is None else (f">= {goal:g}{unit}" if higher else f"<= {goal:g}{unit}"),
                     "verdict": verdict})

    def vs(label, a_names, b_names, path, goal=None):
        na, va = first(eng, a_names, *path)
        nb, vb = first(eng, b_names, *path)
        add(label, ratio(va, vb), f"{na} / {nb}", goal)

    for b, goal in (("1", 1.05), ("8", 1.05)):
        vs(f"our fp16 decode b{b} / ORT GenAI fp16", OURS_FP16, OGA_FP16, ("decode", b, "tokens_per_s"), goal)
    for b, goal in (("1", 1.25), ("8", 1.25)):
        vs(f"our INT4 decode b{b} / ORT GenAI INT4", OURS_INT4, OGA_INT4, ("decode", b, "tokens_per_s"), goal)
    vs("our INT4 decode b1 / our fp16", OURS_INT4, OURS_FP16, ("decode", "1", "tokens_per_s"), 2.5)
    key = _prefill_key(results)
    if key:
        vs(f"our fp16 prefill {key} / PyTorch eager fp16", ["fp16", "fp16+graph"], ["torch-static-fp16"],
           ("prefill", key, "tokens_per_s"), 1.5)
    na, ta = first(eng, ["fp16", "fp16+graph"], "ttft", "median_s")
    nb, tb = first(eng, ["oga-fp16"], "ttft", "median_s")
    if fig(eng.get(na), "ttft", "prompt_tokens") == fig(eng.get(nb), "ttft", "prompt_tokens"):
        add("our fp16 TTFT / ORT GenAI fp16 TTFT (lower is better)", ratio(ta, tb), f"{na} / {nb}", higher=False)
    for label, names, b, goal in (("our fp16", OURS_FP16, 1, 80), ("our fp16", OURS_FP16, 8, 80),
                                  ("our fp16", OURS_FP16, 32, 80), ("our INT4", OURS_INT4, 1, None),
                                  ("PyTorch compiled fp16", ["torch-static-fp16"], 1, None),
                                  ("PyTorch compiled fp16", ["torch-static-fp16"], 8, None),
                                  ("ORT GenAI fp16", OGA_FP16, 1, None), ("ORT GenAI fp16", OGA_FP16, 8, None)):
        n, v = first(eng, names, "decode", str(b), "tokens_per_s")
        eager = " (ran eager)" if fig(eng.get(n), "compiled") is False else ""
        add(f"{label} decode b{b} / fp16 bound", pct_of_bound(results, v, b), f"{n}{eager}", goal, unit=" %")
    vs("PyTorch INT4 / PyTorch fp16, decode b1", ["torch-static-int4"], ["torch-static-fp16"],
       ("decode", "1", "tokens_per_s"))
    vs("ORT GenAI INT4 / fp16, decode b1", OGA_INT4, OGA_FP16, ("decode", "1", "tokens_per_s"))
    return rows


def summary_table(results: dict) -> list[str]:
    rows = summary(results)
    if not rows:
        return []
    out = ["| figure | value | from (a / b) | goal (issue 38) | |", "|---|---|---|---|---|"]
    for r in rows:
        v = f"{r['value']:.2f}x" if r["unit"] == "x" else f"{r['value']:.0f} %"
        out.append(f"| {r['figure']} | {v} | {r['from']} | {r['goal'] or '-'} | {r['verdict']} |")
    return out


def notes(results: dict) -> list[str]:
    out = []
    for n, r in results.get("engines", {}).items():
        if isinstance(r.get("skipped"), str):
            out.append(f"- {n}: skipped: {r['skipped']}")
        elif r.get("skipped"):           # figures the entry's API cannot give (bench.measure)
            out += [f"- {n}, {k}: not measured: {v}" for k, v in r["skipped"].items()]
        if r.get("running"):
            out.append(f"- {n}: running when these tables were written")
        if "error" in r:
            out.append(f"- {n}: {str(r['error']).strip().splitlines()[0][-300:]}")
        for fig_, e in (r.get("errors") or {}).items():
            out.append(f"- {n}, {fig_}: {str(e).strip().splitlines()[0][-300:]}")
        if r.get("kind") == "torch-static" and r.get("compiled") is False and _measured(r):
            out.append(f"- {n}: decode ran EAGER, not as a CUDA graph" + (f" ({r['compile_error']})"
                                                                           if r.get("compile_error") else ""))
    return ["Skipped, failed and partial entries:", *out] if out else []


def markdown(results: dict) -> str:
    parts = [header(results), figures_table(results), ratios_table(results), builds_table(results),
             summary_table(results), notes(results)]
    return "\n\n".join("\n".join(p) for p in parts if p) + "\n"


def _shape_order(k: str):
    b, _, t = k.partition("x")
    return (int(t or 0), int(b)) if b.isdigit() and (t or "0").isdigit() else (0, 0)


def _num(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0f} %"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"
