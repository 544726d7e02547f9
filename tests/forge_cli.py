"""The in-process `forge` command of the tests that check exit codes and messages (``pipeline.cli.main``, so many
cases take seconds). A test module takes it with ``sys.path.insert(0, <tests/>)`` and ``from forge_cli import
run_cli`` (tests/ is no package; several conftest.py modules share that name, so it cannot live in one)."""

from __future__ import annotations

import sys

import pytest

from pipeline import cli


def run_cli(capsys, monkeypatch, *args) -> tuple[int, str]:
    """(exit code, stdout + stderr with whitespace collapsed) of one in-process `forge` command; never a traceback."""
    monkeypatch.setattr(sys, "argv", ["forge", *map(str, args)])
    monkeypatch.setattr(cli, "DEBUG", False)
    for c in (cli.console, cli.err):
        monkeypatch.setattr(c, "width", 400)
    with pytest.raises(SystemExit) as e:
        cli.main()
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text, text
    return e.value.code, " ".join(text.split())
