"""Text views of the history: the per-recipe table, `forge history diff`, and the CI step summary (Markdown)."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone

from rich.table import Table

from .diff import Change, brief, changes, recipe_changes, short
from .regression import catalog, value_of
from .store import History, Run

# headline metrics shown per night (catalog names; the stage-wise ones are summarised as wall / peak RSS)
HEADLINE = [("ppl Δ %", "ppl_delta_pct", "{:.3g}"), ("top-1", "top1_agreement", "{:.4f}"),
            ("cosine", "logits_cosine", "{:.4f}"), ("greedy", "greedy_exact_match", "{:.3f}"),
            ("size ratio", "size_ratio", "{:.3f}"), ("prefill tok/s", "prefill_tok_s", "{:.0f}"),
            ("decode tok/s", "decode_tok_s", "{:.1f}"), ("TTFT s", "ttft_s", "{:.3f}")]
STATUS_MARK = {"passed": "✅", "failed": "❌", "incomplete": "⚠️"}


def parse_since(text: str, now: datetime | None = None) -> str:
    """'7d', '36h', '2w', '30m' or a date / timestamp (2026-12-01, 2026-12-01T02:00) -> ISO UTC bound."""
    now = now or datetime.now(timezone.utc)
    m = re.fullmatch(r"\s*(\d+)\s*([mhdw])\s*", text)
    if m:
        unit = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}[m.group(2)]
        t = now - timedelta(**{unit: int(m.group(1))})
    else:
        try:
            t = datetime.fromisoformat(text.strip().rstrip("Z"))
        except ValueError:
            raise ValueError(f"--since {text!r}: expected a duration like 7d, 36h, 2w or a date like 2026-12-01") from None
        t = t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def headline(run: Run) -> dict[str, float]:
    cat = catalog()
    out = {}
    for _, name, _ in HEADLINE:
        v = value_of(run, cat[name])
        if v is not None:
            out[name] = v
    return out


def peak_rss(run: Run) -> float | None:
    vals = [s["peak_rss_mb"] for s in run.stages if s["status"] == "built" and s.get("peak_rss_mb")]
    return max(vals) if vals else None


def _fmt(v, fmt="{:.4g}") -> str:
    """``fmt`` applied to ``v``, but never in exponent notation: 3.05e-07 is written 0.000000305 (a table and a
    log are read by eye and grepped; 1e-07 next to 0.12 reads as the larger number)."""
    if v is None:
        return "—"
    text = fmt.format(v)
    m = re.search(r"\.(\d+)g", fmt)
    if m and "e" in text and isinstance(v, (int, float)) and math.isfinite(v) and v != 0:
        sig = int(m.group(1))
        decimals = max(0, sig - 1 - math.floor(math.log10(abs(v))))
        text = f"{v:{'+' if fmt.startswith('{:+') else ''}.{decimals}f}"
    return text


def regression_failures(run: Run) -> list[dict]:
    return [g for g in run.gates if g["stage"] == "regression" and not g["passed"]]


def night_note(prev: Run | None, run: Run) -> str:
    parts = []
    if prev is None:
        parts.append("first night here")
    else:
        ch = changes(prev, run)
        parts.append(f"vs {prev.label}: {brief(ch, 2)}" if ch else f"vs {prev.label}: nothing changed")
    for g in regression_failures(run):
        parts.append(f"REGRESSION {g['name']} {_fmt(g['value'])} vs {_fmt(g['baseline'])} (#{g['baseline_run']})")
    bad = [s for s in run.stages if s["status"] == "failed" and s["name"] != "regression"]
    if bad:
        parts.append(f"{bad[0]['name']} failed: {bad[0]['message'][:120]}")
    return "; ".join(parts)


def history_table(recipe: str, runs: list[Run]) -> Table:
    """One row per night; what changed and why it failed are in ``history_notes`` (too long for a cell)."""
    cols = [(label, name, fmt) for label, name, fmt in HEADLINE if any(name in headline(r) for r in runs)]
    t = Table(title=f"{recipe} — {len(runs)} night{'s' if len(runs) != 1 else ''}", title_justify="left")
    for c in ("night", "finished (UTC)", "status", "commit", *[c[0] for c in cols], "wall s", "peak RSS MB"):
        t.add_column(c, no_wrap=True)
    colors = {"passed": "green", "failed": "red", "incomplete": "yellow"}
    for r in runs:
        h = headline(r)
        t.add_row(r.label, r.finished.replace("T", " ").rstrip("Z")[:16],
                  f"[{colors.get(r.status, 'white')}]{r.status}",
                  (r.git_commit or "")[:9] + ("+" if r.git_dirty else ""), *[_fmt(h.get(n), f) for _, n, f in cols],
                  _fmt(r.wall_s, "{:.1f}"), _fmt(peak_rss(r), "{:.0f}"))
    return t


def history_notes(runs: list[Run]) -> list[str]:
    """Per night: what changed since the night before, and why it failed."""
    out, prev = [], None
    for r in runs:
        out.append(f"{r.label}: {night_note(prev, r)}")
        prev = r
    return out


def _by_group(chs: list[Change]) -> dict[str, list[Change]]:
    out: dict[str, list[Change]] = {}
    for c in chs:
        out.setdefault(c.kind, []).append(c)
    return out


def diff_text(a: Run, b: Run) -> str:
    """What changed from night ``a`` to night ``b``, next to how the metrics moved."""
    lines = [f"{a.label} {a.recipe} {a.finished} {a.status} (commit {(a.git_commit or '?')[:9]}, {a.machine_class})",
             f"{b.label} {b.recipe} {b.finished} {b.status} (commit {(b.git_commit or '?')[:9]}, {b.machine_class})", ""]
    if a.recipe != b.recipe:
        lines += [f"note: different recipes ({a.recipe} vs {b.recipe})", ""]
    if a.machine_class != b.machine_class:
        lines += [f"note: different machine classes: numbers are not comparable", ""]
    chs = changes(a, b)
    groups = _by_group(chs)
    titles = {"component": "key components (cause a stage to rebuild)", "output": "stage outputs",
              "tools": "tool versions (not in any stage key)", "machine": "machine", "commit": "forge source"}
    lines.append(f"What changed {a.label} -> {b.label}:")
    if not chs and not recipe_changes(a, b):
        lines.append("  nothing: same key components, tool versions, machine and commit")
    for kind in ("component", "output", "tools", "machine", "commit"):
        if kind in groups:
            lines.append(f"  {titles[kind]}:")
            lines += [f"    {c.text()}" for c in groups[kind]]
    rc = recipe_changes(a, b)
    if rc:
        lines.append("  recipe keys:")
        lines += [f"    {c.path}: {short(c.old)} -> {short(c.new)}" for c in rc]
    lines += ["", "Metrics:", f"  {'metric':<28}{a.label:>14}{b.label:>14}  change"]
    ha, hb = headline(a), headline(b)
    cat = catalog()
    for _, name, _ in HEADLINE:
        if name in ha or name in hb:
            lines.append("  " + _metric_row(name, ha.get(name), hb.get(name), cat[name].worse))
    for label, va, vb in (("wall_s", a.wall_s, b.wall_s), ("peak_rss_mb (max stage)", peak_rss(a), peak_rss(b))):
        lines.append("  " + _metric_row(label, va, vb, "higher"))
    lines += ["", "Stages:", f"  {'stage':<22}{a.label:>24}{b.label:>24}"]
    names = [s["name"] for s in b.stages] + [s["name"] for s in a.stages if not b.stage(s["name"])]
    for n in names:
        sa, sb = a.stage(n), b.stage(n)
        lines.append(f"  {n:<22}{_stage_cell(sa):>24}{_stage_cell(sb):>24}")
    gates = [g for g in b.gates if not g["passed"]]
    if gates:
        lines += ["", f"Failed gates / regression rules of {b.label}:"]
        lines += [f"  {g.get('message') or _gate_text(g)}" for g in gates]
    return "\n".join(lines)


def _gate_text(g: dict) -> str:
    return f"{g['name']} = {_fmt(g['value'])} needs {g['op']} {_fmt(g['threshold'])} ({g['key']})"


def _stage_cell(s: dict | None) -> str:
    if s is None:
        return "—"
    t = f" {s['duration_s']:.1f}s" if s["status"] == "built" and s.get("duration_s") is not None else ""
    return f"{s['status']}{t}"


def _metric_row(name: str, va, vb, worse: str) -> str:
    change = ""
    if va is not None and vb is not None:
        d = vb - va
        rel = f" ({d / abs(va) * 100:+.1f} %)" if va else ""
        tag = "" if d == 0 else ("  worse" if (d > 0) == (worse == "higher") else "  better")
        change = f"{_fmt(d, '{:+.4g}')}{rel}{tag}"
    return f"{name:<28}{_fmt(va):>14}{_fmt(vb):>14}  {change}"


# ---------------------------------------------------------------- CI step summary
def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def summary_md(history: History, recipes: list[str]) -> str:
    """Tonight (each recipe's newest night) vs its last good night, as a GitHub step-summary table."""
    rows, notes, used = [], [], []
    pairs = []
    for name in recipes:
        ids = history.run_ids(name, limit=1)
        if not ids:
            notes.append(f"- {name}: no nights recorded")
            continue
        tonight = history.get(ids[0])
        good = history.last_good(name, tonight.machine_class, before=tonight.id)
        pairs.append((tonight, good))
        used += [n for n in list(headline(tonight)) + list(headline(good) if good else []) if n not in used]
    cols = [(label, n, fmt) for label, n, fmt in HEADLINE if n in used]
    cat = catalog()
    for tonight, good in pairs:
        ht, hg = headline(tonight), headline(good) if good else {}
        cells = []
        for _, n, fmt in cols:
            v, g = ht.get(n), hg.get(n)
            cell = _fmt(v, fmt)
            if v is not None and g is not None and v != g:
                worse = (v > g) == (cat[n].worse == "higher")
                cell += f" ({_fmt(v - g, '{:+.3g}')} {'worse' if worse else 'better'})"
            cells.append(cell)
        what = brief(changes(good, tonight), 3) if good else "no earlier good night"
        rows.append(f"| {tonight.recipe} | {STATUS_MARK.get(tonight.status, '')} {tonight.status} {tonight.label} "
                    f"| {good.label + ' ' + good.finished[:10] if good else '—'} | " + " | ".join(cells) +
                    f" | {_fmt(tonight.wall_s, '{:.0f}')} | {_md(what)} |")
        for g in regression_failures(tonight):
            notes.append(f"- **{tonight.recipe}** {_md(g['message'])}")
        for s in tonight.stages:
            if s["status"] == "failed" and s["name"] != "regression":
                notes.append(f"- **{tonight.recipe}** stage `{s['name']}` failed: {_md(s['message'][:300])}")
    head = ["recipe", "tonight", "last good", *[c[0] for c in cols], "wall s", "what changed since last good"]
    out = ["### forge nightly: tonight vs last good", "", "| " + " | ".join(head) + " |",
           "|" + "---|" * len(head), *rows]
    if notes:
        out += ["", *notes]
    return "\n".join(out) + "\n"
