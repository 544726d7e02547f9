"""Our accuracy gates applied to the bench's peers: a peer is "faster" only if it also passes what our engines must.

A peer is scored exactly as ``forge build`` scores our engines: its logits against the FP32 torch model's on the
eval windows of the recipe that built our engine (``validate.eval``), pooled and per set
(``pipeline.stages.evaluate.score_logits``), then held to that recipe's thresholds (``validate.check_gates``).
Our engines' figures come from their own build reports (the same function ran there), so no engine is scored twice.

* ``gate_spec(report)``: the recipe's eval sets and thresholds, from a forge ``report.json`` (the recipe is resolved
  again by name, so the bench gates with what the recipe says now).
* ``score_against_fp32(logits, hf_dir, spec)``: the figures and gates of one peer, given its ``logits(ids [B, T])
  -> [B, T, V]`` (``score_peer`` with any reference and windows).
* ``ours_from_report(report)``: the same figures for our engine, read from its report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

# greedy generations are not compared here: the bench scores logits only (the int8/int4 recipes gate no greedy
# match either); a recipe that does is said to be gated without it
NOT_SCORED = frozenset({"greedy_exact_match", "simulated_ppl_gap"})


def gate_spec(report: dict) -> dict | None:
    """{"recipe", "eval": [{set, split, samples, seq_len, seed}], "thresholds"} of the recipe a forge report
    names, or None when the report names none or it no longer resolves."""
    from pipeline.errors import ForgeError
    from pipeline.recipe.resolving import resolve

    name = report.get("recipe")
    if not name:
        return None
    try:
        r = resolve(name)
    except ForgeError:
        return None
    from pipeline.stages.validate import GATES

    v = r.validate_
    th = v.thresholds.model_dump()
    return {"recipe": name, "eval": [e.model_dump() for e in v.eval], "thresholds": th,
            "not_scored": sorted(m for m, key, _ in GATES if m in NOT_SCORED and th.get(key) is not None)}


def summarize(metrics: dict, spec: dict) -> dict:
    """Pooled figures, per-set figures and the gates of ``spec`` applied to them."""
    from pipeline.stages.validate import check_gates

    gates = check_gates(metrics, spec["thresholds"], skip=NOT_SCORED)
    failed = [f"{g['name']} = {g['value']:.4g} (needs {g['op']} {g['threshold']})" if g["value"] is not None
              else f"{g['name']} not measured" for g in gates if not g["passed"]]
    return {"recipe": spec["recipe"], "ppl_delta_pct": metrics.get("ppl_delta_pct"),
            "top1_agreement": metrics.get("top1_agreement"),
            "per_set": {k: {m: v.get(m) for m in ("ppl_delta_pct", "top1_agreement")}
                        for k, v in (metrics.get("per_set") or {}).items()},
            "passed": bool(gates) and not failed, "failed": failed}


def eval_windows(spec: dict, hf_dir: str | Path, home: Path | None = None) -> list:
    """[(set/split, ids [N, T])]: ``spec``'s eval windows, cut exactly as the evaluate stage cuts them."""
    from pipeline import data as datasets
    from pipeline.host.paths import forge_home
    from pipeline.stages.common import tokenizer

    tok, home = tokenizer(str(hf_dir)), Path(home or forge_home())
    return [(f"{e['set']}/{e['split']}",
             datasets.token_windows(tok, datasets.load_text(e["set"], e["split"], home), e["samples"],
                                    e["seq_len"], e["seed"]))
            for e in spec["eval"]]


def score_peer(logits: Callable, spec: dict, sets: list, reference) -> dict:
    """One peer's figures and gates: its ``logits`` against ``reference`` (``.logits(ids, desc=...)``) on
    ``sets``."""
    from pipeline.stages.evaluate import score_logits

    per_set, total = score_logits(reference, logits, sets, "peer")
    return summarize({**total, "per_set": per_set}, spec)


def score_against_fp32(logits: Callable, hf_dir: str | Path, spec: dict, home: Path | None = None) -> dict:
    """:func:`score_peer` against the FP32 torch model of ``hf_dir`` on ``spec``'s eval windows."""
    from pipeline.eval.reference import TorchReference

    return score_peer(logits, spec, eval_windows(spec, hf_dir, home), TorchReference(str(hf_dir), device="cpu"))


def ours_from_report(report: dict, spec: dict) -> dict | None:
    """Our engine's figures from its build report's evaluate stage, held to ``spec``'s thresholds (the bench's
    gates: those of the recipe that built the int8 engine, so every row is judged alike)."""
    ev = next((s for s in report.get("stages") or [] if s.get("name") == "evaluate"), None)
    m = (ev or {}).get("metrics") or {}
    if "ppl_delta_pct" not in m:
        return None
    if (m.get("reference") or {}).get("kind", "fp32") != "fp32":   # scored against a simulation: use its fp32 part
        m = m.get("fp32") or {}
        if "ppl_delta_pct" not in m:
            return None
    return summarize(m, spec)


def spec_from_reports(reports: dict[str, Path], prefer: str = "int8") -> dict | None:
    """The gate spec of the ``prefer`` engine's report, else of the first report that has one."""
    order = sorted(reports, key=lambda k: k != prefer)
    for k in order:
        spec = gate_spec(json.loads(Path(reports[k]).read_text()))
        if spec is not None:
            return spec
    return None
