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
    from pipeline import env
    from pipeline.history import facts
    monkeypatch.setattr(env, "cpu_isa", lambda: {"class": isa, "flags": ["amx_int8"], "source": "emulated"})
    monkeypatch.setattr(facts, "gpus", lambda: ({}, []))
    assert facts.machine_class(facts.machine_facts()) == isa
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "amx_int8`" not in readme
