"""Small promises of the CLI's output (issue 24): `forge serve` exits 130 when interrupted, `recipes resolve`
writes regression rules with their sign and round-trips, the history table has no exponent notation."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import cli


def _main(monkeypatch, capsys, *args) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["forge", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        cli.main()
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_serve_exits_130_when_interrupted(when, tmp_path, monkeypatch, capsys):
    """Ctrl-C (SIGINT) or kill (SIGTERM) while tritonserver starts or serves: stopped, exit 130 (README)."""
    import pipeline.triton.serve as serve
    repo = tmp_path / "repo"
    (repo / "m").mkdir(parents=True)
    (repo / "m" / "config.pbtxt").write_text('name: "m"\n')
    stopped = []

    class FakeServer:
        url, grpc_url, metrics_url = "http://127.0.0.1:1", "127.0.0.1:2", "http://127.0.0.1:3"

        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            if when == "starting":
                signal.raise_signal(signal.SIGINT)       # the handler `forge serve` installs turns it into Ctrl-C
            return self

        def __exit__(self, *exc):
            stopped.append(True)

        def alive(self):
            signal.raise_signal(signal.SIGTERM)
            return True

    monkeypatch.setattr(serve, "TritonServer", FakeServer)
    monkeypatch.setattr(serve, "endpoints", lambda *a: [])
    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        code, out = _main(monkeypatch, capsys, "serve", repo)
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])
    assert code == 130, out
    # interrupted in __enter__, TritonServer.start stops what it started itself (test_serve.py)
    assert stopped == ([] if when == "starting" else [True]) and "tritonserver stopped" in out


def test_resolve_keeps_the_sign_of_a_rule_and_round_trips(tmp_path, monkeypatch, capsys):
    code, out = _main(monkeypatch, capsys, "recipes", "resolve", "smollm2-135m-int8",
                      "--set", "validate.regression.top1_agreement=-0.01", "--set", "validate.regression.size_ratio=+5%")
    assert code == 0, out
    resolved = yaml.safe_load(out)
    rules = resolved["validate"]["regression"]
    assert rules["top1_agreement"] == "-0.01" and rules["size_ratio"] == "+5%"
    # the output is a recipe: read back, it is the same recipe (same hash)
    (tmp_path / "again.yaml").write_text(out)
    code, again = _main(monkeypatch, capsys, "recipes", "resolve", tmp_path / "again.yaml")
    assert code == 0 and again.splitlines()[-1] == out.splitlines()[-1], again


def test_history_numbers_are_fixed_point():
    from pipeline.history.render import _fmt
    assert _fmt(3.05e-07, "{:.3g}") == "0.000000305"
    assert _fmt(123456.0, "{:.3g}") == "123456"
    assert _fmt(0.75, "{:.3g}") == "0.75" and _fmt(-2.5e-05, "{:+.3g}") == "-0.0000250"
    assert _fmt(None) == "—"


def test_history_table_has_no_exponent(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "history"))
    from test_store import make_run

    from pipeline.history.store import History
    db = tmp_path / "h.sqlite"
    h = History(db)
    h.record(make_run(recipe="tiny", ppl=3.05e-07))
    h.close()
    code, out = _main(monkeypatch, capsys, "history", "--history", db)
    assert code == 0 and "0.000000305" in out and "e-07" not in out, out


@pytest.mark.parametrize("isa", ["x86_64-avx2", "x86_64-avx512vnni", "x86_64-amx"])
def test_history_machine_class_is_the_isa_class_of_the_cache_keys(isa, monkeypatch):
    """The history's machine class is the ISA class cache keys and reports use (README named one `x86_64-amx_int8`)."""
    from pipeline.host import cpu
    from pipeline.history import facts
    monkeypatch.setattr(cpu, "cpu_isa", lambda: {"class": isa, "flags": ["amx_int8"], "source": "emulated"})
    monkeypatch.setattr(facts, "gpus", lambda: ({}, []))
    assert facts.machine_class(facts.machine_facts()) == isa



def test_docs_name_only_isa_classes_that_exist():
    """Every ISA class the README and docs/ name is one forge's keys and reports use (README once named
    `x86_64-amx_int8`, a CPU flag, not a class)."""
    import re

    from pipeline.host.cpu import ISA_CLASSES
    root = Path(__file__).resolve().parents[2]
    named = {(f.name, m) for f in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
             for m in re.findall(r"\b(?:x86_64|aarch64)-[A-Za-z0-9_]+", f.read_text())}
    assert named, "no ISA class named in README/docs: the check reads nothing"
    assert {(f, m) for f, m in named if m not in ISA_CLASSES} == set()


def _closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]           # closed again when the block ends: nothing listens there


def _reports(d: Path, name: str) -> dict:
    import json
    from xml.etree import ElementTree as ET
    rep = json.loads((d / name / "report.json").read_text())
    suite = ET.parse(d / name / "junit.xml").getroot()
    assert int(suite.get("failures")) >= 1, ET.tostring(suite)
    return rep


def test_a_store_that_cannot_be_opened_still_leaves_reports(tmp_path, monkeypatch, capsys):
    """FORGE_CACHE names an S3 bucket whose endpoint is a closed port (remote_cache.py reads AWS_ENDPOINT_URL):
    exit 1 with the store named, and report.json + junit.xml for the recipe, which resolved (issue 24)."""
    pytest.importorskip("s3fs")
    url = "s3://forge-bucket/nightly"
    for k, v in {"FORGE_CACHE": url, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}",
                 "AWS_ACCESS_KEY_ID": "forge", "AWS_SECRET_ACCESS_KEY": "forge", "AWS_DEFAULT_REGION": "us-east-1",
                 "FORGE_PROGRESS": "0", "FORGE_HISTORY": str(tmp_path / "h.sqlite")}.items():
        monkeypatch.setenv(k, v)
    code, out = _main(monkeypatch, capsys, "build", "smollm2-135m-int8", "smollm2-135m-int4", "--keep-going",
                      "--report-dir", tmp_path / "rep")
    assert code == 1 and "cannot reach" in out and url in out, out
    for name in ("smollm2-135m-int8", "smollm2-135m-int4"):
        rep = _reports(tmp_path / "rep", name)
        assert rep["status"] == "failed" and rep["recipe_hash"], rep
        assert rep["stages"][0]["name"] == "start" and url in rep["stages"][0]["message"]
    import json
    assert json.loads((tmp_path / "rep" / "summary.json").read_text()) == {"smollm2-135m-int8": "failed",
                                                                          "smollm2-135m-int4": "failed"}


@pytest.mark.parametrize("error", ["disk", "bug"])
def test_a_failure_after_resolving_leaves_reports(error, tmp_path, monkeypatch, capsys):
    """A full disk (DiskFull, exit 1) or an unexpected exception (a bug, exit 1) before any stage ran."""
    from pipeline import runner
    from pipeline.diskspace import DiskFull

    def fail(self, *a, **k):
        raise DiskFull("no space left on FORGE_CACHE at /x: 0.00 GB free") if error == "disk" else RuntimeError("boom")
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FORGE_PROGRESS", "0")
    monkeypatch.setenv("FORGE_HISTORY", str(tmp_path / "h.sqlite"))
    monkeypatch.setattr(runner.Runner, "build", fail)
    code, out = _main(monkeypatch, capsys, "build", "smollm2-135m-int8", "--report-dir", tmp_path / "rep")
    assert code == 1, out
    rep = _reports(tmp_path / "rep", "smollm2-135m-int8")
    assert rep["status"] == "failed" and rep["stages"][0]["error_type"] == ("DiskFull" if error == "disk" else "RuntimeError")
