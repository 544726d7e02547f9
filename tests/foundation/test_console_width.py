"""No output of forge depends on the terminal's width (issue 24): on every CPU class (emulated here, with a class
name longer than any real one) and at 40, 80 and 200 columns, in a pty and in a log, the plan table shows every
hardware name whole, and a log never wraps a line."""

from __future__ import annotations

import os
import threading

import pytest
from typer.testing import CliRunner

from pipeline import cli
from pipeline.host import cpu
from pipeline.console import UNBOUNDED, make_console

LONG = "x86_64-avx512vnni-emulated-class-longer-than-any-real-one"


@pytest.fixture
def isa(monkeypatch, tmp_path, request):
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu, "cpu_isa", lambda: {"class": request.param, "flags": [], "source": "emulated"})
    return request.param


def _pty_console(monkeypatch, columns: int):
    """A console on a real pseudo-terminal of ``columns`` columns, and a function returning what it received."""
    import fcntl
    import struct
    import termios
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    monkeypatch.setenv("COLUMNS", str(columns))
    chunks: list[bytes] = []

    def drain():
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:
                return
            if not b:
                return
            chunks.append(b)
    t = threading.Thread(target=drain, daemon=True)
    t.start()
    f = os.fdopen(slave, "w", encoding="utf-8")
    c = make_console(file=f)
    assert c.is_terminal

    def received() -> str:
        f.flush()
        f.close()
        t.join(5)
        os.close(master)
        return b"".join(chunks).decode()
    return c, received


@pytest.mark.parametrize("isa", ["x86_64-avx512vnni", LONG], indirect=True)
@pytest.mark.parametrize("columns", [40, 80, 200])
def test_plan_shows_whole_hardware_names_in_a_log(isa, columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))      # CI systems set COLUMNS; a log must not follow it
    monkeypatch.setattr(cli, "console", make_console())
    res = CliRunner().invoke(cli.app, ["plan", "smollm2-135m-int8"])
    assert res.exit_code == 0, res.output
    rows = [ln for ln in res.output.splitlines() if f"cpu:{isa}" in ln]
    # build and evaluate are keyed by the ISA class: each row is one line with the stage, status and whole class
    assert [ln.split()[1] for ln in rows] == ["build", "evaluate"], res.output
    assert all("miss" in ln for ln in rows), res.output


@pytest.mark.parametrize("isa", ["x86_64-avx512vnni", LONG], indirect=True)
@pytest.mark.parametrize("columns", [40, 80, 200])
def test_plan_shows_whole_hardware_names_in_a_terminal(isa, columns, monkeypatch):
    c, received = _pty_console(monkeypatch, columns)
    monkeypatch.setattr(cli, "console", c)
    res = CliRunner().invoke(cli.app, ["plan", "smollm2-135m-int8"])
    assert res.exit_code == 0, res.output
    text = received()
    # the terminal may fold the long line on screen, but the bytes carry the name whole
    assert text.count(f"cpu:{isa}") == 2, text
    assert "…" not in text, text


@pytest.mark.parametrize("columns", [40, 80])
def test_a_log_never_wraps_text(columns, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(columns))
    c = make_console()
    assert c.width == UNBOUNDED
    note = "regression rule skipped: " + " ".join(f"word{i}" for i in range(200))
    c.print(note)
    assert capsys.readouterr().out == note + "\n"


def test_an_explicit_width_is_kept():
    import io
    c = make_console(file=io.StringIO(), width=30)
    c.print("a " * 30)
    assert max(len(ln) for ln in c.file.getvalue().splitlines()) <= 30


def test_report_summary_keeps_long_notes_on_one_line(tmp_path):
    from pipeline.report import write_reports
    note = "m" * 300
    report = {"recipe": "r", "target": "onnxruntime", "status": "failed", "wall_s": 1.0,
              "stages": [{"name": "evaluate", "status": "failed", "duration_s": 1.0, "peak_rss_mb": 10.0, "key": None,
                          "message": note, "metrics": {}}]}
    write_reports(report, tmp_path)
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert any(note in ln and "evaluate" in ln for ln in lines), lines


@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
def test_a_long_cache_root_in_a_table_title_stays_whole(terminal, tmp_path, monkeypatch):
    """`forge cache ls` titles its table with the cache root: Rich wraps a title to the table's width, which cut a
    long FORGE_CACHE path in a log (`forge cache ls | cat`) and on a terminal alike."""
    root = tmp_path / ("x" * 60) / ("y" * 60)
    monkeypatch.setenv("FORGE_CACHE", str(root))
    if terminal:
        c, received = _pty_console(monkeypatch, 80)
    else:
        import io
        monkeypatch.setenv("COLUMNS", "80")
        c = make_console(file=io.StringIO())
        received = c.file.getvalue
    monkeypatch.setattr(cli, "console", c)
    res = CliRunner().invoke(cli.app, ["cache", "ls"])
    assert res.exit_code == 0, res.output
    text = received()
    assert str(root) in text, text
