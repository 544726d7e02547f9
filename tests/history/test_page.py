"""The trend page in a real headless Chromium, and the CI step summary, from three synthetic nights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import headless  # noqa: E402
from synthetic import forge  # noqa: E402
from test_nights import nightly_env, three_nights  # noqa: E402,F401

PROBE = """JSON.stringify({
  plots: [...document.querySelectorAll('section.recipe svg.plot')].map(s => {
    const r = s.getBoundingClientRect();
    return {metric: s.dataset.metric, points: +s.dataset.points, circles: s.querySelectorAll('circle').length,
            lines: s.querySelectorAll('polyline.line').length, gates: s.querySelectorAll('path.gate').length,
            limits: s.querySelectorAll('line.limit').length, w: r.width, h: r.height};
  }),
  nights: [...document.querySelectorAll('svg.strip rect.night')].map(r => [+r.dataset.run, r.getAttribute('class'),
           r.getBoundingClientRect().width]),
  links: [...document.querySelectorAll('svg.strip a.report')].map(a => a.getAttribute('href')),
  external: [...document.querySelectorAll('[src],link[href],script')].length,
})"""


def _needs_browser():
    if headless.chromium() is None:
        pytest.skip("chromium is not installed (Debian/Ubuntu: apt-get install -y chromium; `make setup` does it "
                    "where apt-get exists)")
    pytest.importorskip("websocket", reason="websocket-client is not installed (pip install -e '.[dev]')")


def test_history_page_renders_in_chromium(nightly_env, monkeypatch, capsys):
    _needs_browser()
    d = nightly_env
    three_nights(d, monkeypatch, capsys)
    page = d / "site" / "history.html"
    code, _, err = forge(monkeypatch, capsys, "history", "--html", page)
    assert code == 0, err
    html = page.read_text()
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in html

    res = headless.load(page, PROBE)
    shot = d / "history.png"          # the screenshot is kept with the test's files
    shot.write_bytes(res["png"])
    assert res["errors"] == []
    info = json.loads(res["value"])
    assert info["external"] == 0
    plots = {p["metric"]: p for p in info["plots"]}
    assert {"ppl_delta_pct", "top1_agreement", "logits_cosine", "greedy_exact_match", "size_ratio",
            "wall_s"} <= set(plots)
    for p in plots.values():           # drawn, with a point per night that measured the metric
        assert p["w"] > 250 and p["h"] > 150 and p["circles"] == p["points"]
    assert plots["ppl_delta_pct"]["points"] == 3 and plots["ppl_delta_pct"]["lines"] == 1
    assert plots["ppl_delta_pct"]["gates"] == 1 and plots["top1_agreement"]["gates"] == 1   # gate lines
    assert plots["ppl_delta_pct"]["limits"] == 2            # nights 2 and 3 were held to a regression limit
    assert [(n[0], n[1]) for n in info["nights"]] == [(1, "night passed"), (2, "night passed"), (3, "night failed")]
    assert all(n[2] > 10 for n in info["nights"])
    assert len(info["links"]) == 1                          # only the failing night links to its report
    target = (page.parent / info["links"][0]).resolve()
    assert target == (d / "night3" / "nightly-synthetic" / "report.json").resolve() and target.is_file()

    PIL = pytest.importorskip("PIL.Image")
    img = PIL.open(shot).convert("RGB")
    assert img.size == (1280, 900)
    colours = {c for _, c in img.getcolors(maxcolors=1 << 21)}
    assert (0xcf, 0x22, 0x2e) in colours and (0x1a, 0x7f, 0x37) in colours   # the failed and passed marks


def test_summary_md_tonight_vs_last_good(nightly_env, monkeypatch, capsys):
    d = nightly_env
    three_nights(d, monkeypatch, capsys)
    summary = d / "step_summary.md"
    summary.write_text("earlier step\n")
    code, _, err = forge(monkeypatch, capsys, "history", "nightly-synthetic", "--summary-md", summary)
    assert code == 0, err
    text = summary.read_text()
    assert text.startswith("earlier step\n")               # appended, like $GITHUB_STEP_SUMMARY wants
    table = [line for line in text.splitlines() if line.startswith("| nightly-synthetic")]
    assert len(table) == 1
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    assert cells[1] == "❌ failed #3" and cells[2].startswith("#2 ")
    assert cells[3] == "1.5 (+0.75 worse)"
    assert "quantize.calibration.samples: 32 -> 8" in cells[-1]
    assert any(line.startswith("- **nightly-synthetic** regression: ppl_delta_pct") for line in text.splitlines())
