"""`forge history --html PAGE`: one self-contained page (inline CSS and SVG, no script, nothing fetched).

Per recipe: a status strip with one mark per night (a failing night links to its report), and one plot
per metric over the nights, with the recipe's gate as a dashed line and the regression limit (last good
value + the allowed worsening) as ticks where a rule applied.
"""

from __future__ import annotations

import html
import math
import os
from pathlib import Path

from ..host.files import atomic_write
from .diff import brief, changes
from .facts import utc_now
from .regression import catalog
from .render import HEADLINE, headline, peak_rss, regression_failures
from .store import Run

W, H = 284, 184
ML, MR, MT, MB = 50, 12, 28, 34
COLORS = {"passed": "#1a7f37", "failed": "#cf222e", "incomplete": "#bf8700"}
GATE_STAGES = ("validate", "validate_checkpoint")

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1f2328;background:#f6f8fa}
header{background:#24292f;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#d0d7de;font-size:12px}nav a{color:#9ecbff;margin-right:12px}
section.recipe{background:#fff;margin:16px 24px;padding:12px 18px;border:1px solid #d0d7de;border-radius:6px}
section.recipe h2{margin:0 0 2px;font-size:17px}.meta{color:#57606a;font-size:12px;margin:0 0 8px}
.badge{font-size:12px;padding:1px 8px;border-radius:10px;color:#fff;margin-left:8px;vertical-align:middle}
.plots{display:flex;flex-wrap:wrap;gap:10px}svg.plot{background:#fff;border:1px solid #eaeef2;border-radius:4px}
svg text{font-family:system-ui,sans-serif}.axis{stroke:#8c959f;stroke-width:1}.grid{stroke:#eaeef2}
.line{fill:none;stroke:#0969da;stroke-width:2}.gate{fill:none;stroke:#cf222e;stroke-width:1.5;stroke-dasharray:6 4}
.limit{stroke:#bf8700;stroke-width:2}table.nights{border-collapse:collapse;font-size:12px;margin-top:8px}
table.nights td,table.nights th{border-bottom:1px solid #eaeef2;padding:3px 8px;text-align:left;vertical-align:top}
.legend{font-size:12px;color:#57606a;margin:6px 0}.legend span{margin-right:14px}
details summary{cursor:pointer;color:#57606a;font-size:12px;margin-top:6px}
"""


def _e(s) -> str:
    return html.escape(str(s), quote=True)


def _nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    span = hi - lo
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out, v = [], first
    while v <= hi + step * 1e-9:
        out.append(round(v, 12))
        v += step
    return out


def _tick_label(v: float) -> str:
    return f"{v:.4g}"


def plot_svg(metric: str, title: str, runs: list[Run], values: list[float | None],
             gates: list[float | None], limits: list[float | None], gate_op: str | None) -> str:
    """One metric over the nights: line + points (coloured by the night's status), gate, regression limits."""
    n = len(runs)
    ys = [v for v in values + gates + limits if v is not None]
    lo, hi = min(ys), max(ys)
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    else:
        pad = (hi - lo) * 0.12
        lo, hi = lo - pad, hi + pad
    pw, ph = W - ML - MR, H - MT - MB

    def x(i: int) -> float:
        return ML + (pw * (i + 0.5) / n)

    def y(v: float) -> float:
        return MT + ph * (1 - (v - lo) / (hi - lo))

    out = [f'<svg class="plot" data-metric="{_e(metric)}" data-points="{sum(v is not None for v in values)}" '
           f'xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
           f'aria-label="{_e(title)}">', f'<text x="{ML}" y="17" font-size="13" font-weight="600">{_e(title)}</text>']
    for t in _nice_ticks(lo, hi):
        out.append(f'<line class="grid" x1="{ML}" x2="{W - MR}" y1="{y(t):.1f}" y2="{y(t):.1f}"/>'
                   f'<text x="{ML - 6}" y="{y(t) + 4:.1f}" font-size="10" text-anchor="end" fill="#57606a">'
                   f'{_e(_tick_label(t))}</text>')
    out.append(f'<line class="axis" x1="{ML}" x2="{ML}" y1="{MT}" y2="{MT + ph}"/>'
               f'<line class="axis" x1="{ML}" x2="{W - MR}" y1="{MT + ph}" y2="{MT + ph}"/>')
    every = max(1, math.ceil(n / 8))
    for i, r in enumerate(runs):
        if i % every == 0 or i == n - 1:
            out.append(f'<text x="{x(i):.1f}" y="{H - MB + 14}" font-size="10" text-anchor="middle" fill="#57606a">'
                       f'{_e(r.label)}</text>')
    out.append(f'<text x="{W - MR}" y="{H - 4}" font-size="10" text-anchor="end" fill="#8c959f">night</text>')
    # gate as a step line across the nights that had one
    seg: list[str] = []
    for i, g in enumerate(gates):
        if g is None:
            if seg:
                out.append(f'<path class="gate" d="{" ".join(seg)}"/>')
                seg = []
            continue
        x0, x1 = max(ML, x(i) - pw / n / 2), min(W - MR, x(i) + pw / n / 2)
        seg.append(f"{'M' if not seg else 'L'}{x0:.1f},{y(g):.1f} L{x1:.1f},{y(g):.1f}")
    if seg:
        out.append(f'<path class="gate" d="{" ".join(seg)}"/>')
    last_gate = next((g for g in reversed(gates) if g is not None), None)
    if last_gate is not None:
        out.append(f'<text x="{W - MR - 2}" y="{y(last_gate) - 4:.1f}" font-size="10" text-anchor="end" '
                   f'fill="#cf222e">gate {_e(gate_op or "")} {_e(_tick_label(last_gate))}</text>')
    for i, lim in enumerate(limits):
        if lim is not None:
            out.append(f'<line class="limit" x1="{x(i) - 7:.1f}" x2="{x(i) + 7:.1f}" y1="{y(lim):.1f}" '
                       f'y2="{y(lim):.1f}"><title>regression limit {_e(_tick_label(lim))}</title></line>')
    pts = [(i, v) for i, v in enumerate(values) if v is not None]
    run_of: list[list[tuple[int, float]]] = []
    for i, v in pts:   # break the line where a night did not measure the metric
        if run_of and run_of[-1][-1][0] == i - 1:
            run_of[-1].append((i, v))
        else:
            run_of.append([(i, v)])
    for part in run_of:
        if len(part) > 1:
            out.append('<polyline class="line" points="' + " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in part)
                       + '"/>')
    for i, v in pts:
        r = runs[i]
        out.append(f'<circle class="pt {r.status}" cx="{x(i):.1f}" cy="{y(v):.1f}" r="4" '
                   f'fill="{COLORS.get(r.status, "#57606a")}"><title>{_e(r.label)} {_e(r.finished)} {r.status}: '
                   f'{_e(metric)} = {_e(f"{v:.6g}")}</title></circle>')
    out.append("</svg>")
    return "".join(out)


def _report_href(run: Run, page_dir: Path) -> str | None:
    if not run.report_path:
        return None
    return Path(os.path.relpath(run.report_path, page_dir)).as_posix()


def strip_svg(runs: list[Run], page_dir: Path) -> str:
    """One mark per night, coloured by status; a failing night links to its report."""
    cw, gap = 22, 4
    width = max(len(runs) * (cw + gap) + 8, 60)
    out = [f'<svg class="strip" xmlns="http://www.w3.org/2000/svg" width="{width}" height="46" '
           f'viewBox="0 0 {width} 46" role="img" aria-label="status by night">']
    prev = None
    for i, r in enumerate(runs):
        why = [f"{r.label} {r.finished} {r.status}"]
        why += [g["message"] for g in regression_failures(r)]
        why += [f"{s['name']} failed: {s['message'][:200]}" for s in r.stages
                if s["status"] == "failed" and s["name"] != "regression"]
        if prev is not None:
            why.append(f"changed vs {prev.label}: {brief(changes(prev, r), 3)}")
        rect = (f'<rect class="night {r.status}" data-run="{r.id}" x="{4 + i * (cw + gap)}" y="4" width="{cw}" '
                f'height="22" rx="3" fill="{COLORS.get(r.status, "#57606a")}"><title>{_e(" | ".join(why))}</title></rect>'
                f'<text x="{4 + i * (cw + gap) + cw / 2}" y="40" font-size="9" text-anchor="middle" fill="#57606a">'
                f'{_e(r.id)}</text>')
        href = _report_href(r, page_dir) if r.status == "failed" else None
        out.append(f'<a class="report" href="{_e(href)}">{rect}</a>' if href else rect)
        prev = r
    out.append("</svg>")
    return "".join(out)


def _gate_of(run: Run, metric: str) -> tuple[float | None, str | None]:
    g = next((g for g in run.gates if g["stage"] in GATE_STAGES and g["name"] == metric), None)
    return (g["threshold"], g["op"]) if g else (None, None)


def _limit_of(run: Run, metric: str) -> float | None:
    g = next((g for g in run.gates if g["stage"] == "regression" and g["name"] == metric), None)
    return g["threshold"] if g else None


def recipe_section(recipe: str, runs: list[Run], page_dir: Path) -> str:
    cat = catalog()
    latest = runs[-1]
    badge = f'<span class="badge" style="background:{COLORS.get(latest.status, "#57606a")}">latest: {latest.status}</span>'
    parts = [f'<section class="recipe" id="{_e("r-" + recipe)}" data-recipe="{_e(recipe)}">',
             f"<h2>{_e(recipe)}{badge}</h2>",
             f'<p class="meta">target {_e(latest.target)} · {len(runs)} night{"s" if len(runs) != 1 else ""} · '
             f'machine class {_e(latest.machine_class)} · latest commit {_e((latest.git_commit or "?")[:9])}</p>',
             strip_svg(runs, page_dir),
             '<div class="legend"><span style="color:#1a7f37">■ passed</span><span style="color:#cf222e">■ failed '
             '(links to its report)</span><span style="color:#bf8700">■ incomplete</span><span style="color:#cf222e">'
             '- - gate</span><span style="color:#bf8700">— regression limit</span></div>', '<div class="plots">']
    heads = [headline(r) for r in runs]
    for label, name, _ in HEADLINE:
        vals = [h.get(name) for h in heads]
        if all(v is None for v in vals):
            continue
        gates = [_gate_of(r, name) for r in runs]
        op = next((o for _, o in gates if o), None)
        m = cat[name]
        title = f"{label} ({'lower' if m.worse == 'higher' else 'higher'} is better)"
        parts.append(plot_svg(name, title, runs, vals, [g for g, _ in gates], [_limit_of(r, name) for r in runs], op))
    for name, title, vals in (("wall_s", "build wall time, s", [r.wall_s for r in runs]),
                              ("peak_rss_mb", "peak RSS of a built stage, MB", [peak_rss(r) for r in runs])):
        if any(v is not None for v in vals):
            parts.append(plot_svg(name, title, runs, vals, [None] * len(runs), [None] * len(runs), None))
    parts.append("</div>")
    rows = []
    prev = None
    for r in reversed(runs[-30:]):
        idx = runs.index(r)
        prev = runs[idx - 1] if idx else None
        href = _report_href(r, page_dir)
        link = f'<a href="{_e(href)}">report</a>' if href else ""
        note = brief(changes(prev, r), 3) if prev else "first night"
        fails = "; ".join(g["message"] for g in regression_failures(r))
        rows.append(f"<tr><td>{_e(r.label)}</td><td>{_e(r.finished)}</td><td style=\"color:"
                    f"{COLORS.get(r.status, '#57606a')}\">{_e(r.status)}</td><td>{link}</td><td>{_e(note)}"
                    f"{'<br><b>' + _e(fails) + '</b>' if fails else ''}</td></tr>")
    parts.append('<details><summary>nights (newest first)</summary><table class="nights"><tr><th>night</th>'
                 '<th>finished (UTC)</th><th>status</th><th></th><th>what changed since the night before</th></tr>'
                 + "".join(rows) + "</table></details></section>")
    return "".join(parts)


def render_page(runs_by_recipe: dict[str, list[Run]], page: Path, db_path: str = "") -> str:
    page_dir = Path(page).absolute().parent
    nights = sum(len(v) for v in runs_by_recipe.values())
    nav = " ".join(f'<a href="#{_e("r-" + k)}">{_e(k)}</a>' for k in runs_by_recipe)
    body = "".join(recipe_section(k, v, page_dir) for k, v in runs_by_recipe.items() if v)
    if not body:
        body = '<section class="recipe"><p>No nights recorded yet: run <code>forge build</code>.</p></section>'
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>forge nightly history</title>"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<style>{CSS}</style></head><body><header><h1>forge nightly history</h1>"
            f"<p>{nights} night{'s' if nights != 1 else ''} of {len(runs_by_recipe)} recipe"
            f"{'s' if len(runs_by_recipe) != 1 else ''} · generated {_e(utc_now())} · {_e(db_path)}</p>"
            f"<nav>{nav}</nav></header>{body}</body></html>\n")


def write_page(runs_by_recipe: dict[str, list[Run]], page: Path, db_path: str = "") -> Path:
    page = Path(page)
    return atomic_write(page, render_page(runs_by_recipe, page, db_path))
