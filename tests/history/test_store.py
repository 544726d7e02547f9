"""The history database: schema versions and migrations, WAL and concurrent writers, and a corrupt or
locked database that never fails a build."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.history import store
from pipeline.history.store import History, HistoryUnavailable, Run

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import forge, write_recipe  # noqa: E402
from test_nights import nightly_env  # noqa: E402,F401


def make_run(recipe="r", status="passed", ppl=1.0, n=0, machine_class="x86_64-test", **kw) -> Run:
    stages = kw.pop("stages", [
        {"name": "quantize", "status": "built", "key": "k" * 64, "duration_s": 10.0 + n, "peak_rss_mb": 100.0,
         "message": "", "components": {"stage": "quantize", "config": {"samples": 32}}},
        {"name": "evaluate", "status": "built", "key": "e" * 64, "duration_s": 5.0, "peak_rss_mb": 50.0,
         "message": "", "components": {"stage": "evaluate", "config": {}}}])
    return Run(None, recipe, "h" * 64, "onnxruntime", status, "2026-12-01T02:00:00Z", f"2026-12-01T02:{n % 60:02d}:00Z",
               15.0, {"name": recipe, "validate": {"regression": kw.pop("rules", {})}}, machine_class,
               {"cpu_model": "test cpu", "tools": {"onnxruntime": "1.0"}}, "c" * 40, False, None, stages,
               {"evaluate": {"ppl_delta_pct": ppl, "top1_agreement": 0.9, "per_set.wiki/eval.ppl": 12.5,
                             "subject": "engine"}},
               [{"stage": "validate", "name": "ppl_delta_pct", "value": ppl, "op": "<=", "threshold": 5.0,
                 "key": "validate.thresholds.ppl_delta_pct_max", "passed": True}], **kw)


def test_fresh_database_is_at_the_current_schema_in_wal_mode(tmp_path):
    h = History(tmp_path / "h.sqlite")
    assert h.db.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION == len(store.MIGRATIONS)
    assert h.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    rid = h.record(make_run(ppl=0.75))
    got = h.get(rid)
    assert got.metrics["evaluate"]["ppl_delta_pct"] == 0.75 and got.metrics["evaluate"]["subject"] == "engine"
    assert got.metrics["evaluate"]["per_set.wiki/eval.ppl"] == 12.5
    assert [s["name"] for s in got.stages] == ["quantize", "evaluate"]
    assert got.stages[0]["components"] == {"stage": "quantize", "config": {"samples": 32}}
    assert got.gates[0]["threshold"] == 5.0 and got.gates[0]["passed"] is True
    assert got.git_commit == "c" * 40 and got.machine["tools"] == {"onnxruntime": "1.0"}


def test_migration_upgrades_an_older_database_and_keeps_its_nights(tmp_path, monkeypatch):
    db = tmp_path / "h.sqlite"
    h = History(db)
    rid = h.record(make_run(ppl=0.5))
    h.close()
    monkeypatch.setattr(store, "MIGRATIONS", store.MIGRATIONS + [["ALTER TABLE runs ADD COLUMN note TEXT",
                                                                  "UPDATE runs SET note = 'migrated'"]])
    monkeypatch.setattr(store, "SCHEMA_VERSION", len(store.MIGRATIONS))
    h2 = History(db)
    assert h2.db.execute("PRAGMA user_version").fetchone()[0] == 2
    assert h2.db.execute("SELECT note FROM runs WHERE id=?", (rid,)).fetchone()[0] == "migrated"
    assert h2.get(rid).metrics["evaluate"]["ppl_delta_pct"] == 0.5


def test_a_failing_migration_leaves_the_database_as_it_was(tmp_path, monkeypatch):
    db = tmp_path / "h.sqlite"
    History(db).close()
    monkeypatch.setattr(store, "MIGRATIONS", store.MIGRATIONS + [["ALTER TABLE runs ADD COLUMN x TEXT",
                                                                  "THIS IS NOT SQL"]])
    monkeypatch.setattr(store, "SCHEMA_VERSION", len(store.MIGRATIONS))
    with pytest.raises(HistoryUnavailable):
        History(db)
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA user_version").fetchone()[0] == 1
    assert "x" not in [r[1] for r in con.execute("PRAGMA table_info(runs)")]


def test_newer_schema_is_refused_with_the_fix(tmp_path):
    db = tmp_path / "h.sqlite"
    History(db).close()
    con = sqlite3.connect(db)
    con.execute("PRAGMA user_version = 99")
    con.close()
    with pytest.raises(HistoryUnavailable, match="schema version 99, written by a newer forge"):
        History(db)


def _writer(db: str, n: int, tag: int) -> None:
    h = History(Path(db))
    for i in range(n):
        h.record(make_run(recipe=f"w{tag}", ppl=float(i), n=i))
    h.close()


def test_concurrent_writers_lose_nothing(tmp_path):
    """Four processes race to create, migrate and fill one fresh database."""
    db = tmp_path / "h.sqlite"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(db), 15, t)) for t in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    h = History(db)
    for t in range(4):
        runs = h.runs(f"w{t}")
        assert [r.metrics["evaluate"]["ppl_delta_pct"] for r in runs] == [float(i) for i in range(15)]
        assert all(len(r.stages) == 2 and len(r.gates) == 1 for r in runs)
    assert h.db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 60


def test_corrupt_database_does_not_fail_the_build(nightly_env, monkeypatch, capsys):
    d = nightly_env
    db = d / "history.sqlite"
    db.write_bytes(b"this is not an sqlite database\n" * 200)
    code, _, err = forge(monkeypatch, capsys, "build", write_recipe(d / "recipes"), "--report-dir", d / "out")
    assert code == 0
    err = " ".join(err.split())                                # undo the console's line wrapping
    assert f"{db} is corrupt" in err and "move it aside" in err
    rep = json.loads((d / "out/nightly-synthetic/report.json").read_text())
    assert rep["status"] == "passed" and "history" not in rep
    reg = next(s for s in rep["stages"] if s["name"] == "regression")
    assert reg["status"] == "skipped" and "run history unavailable" in reg["message"]
    assert db.read_bytes().startswith(b"this is not")          # left for the user to inspect / recover


# argv[2] exclusive: nobody else may even read (a process that holds the file in exclusive locking mode);
# immediate: another writer holds the write lock (readers go on, writers wait out the busy timeout)
LOCKER = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
if sys.argv[2] == "exclusive":
    con.execute("PRAGMA locking_mode = EXCLUSIVE")
con.execute("BEGIN " + sys.argv[2].upper())
con.execute("INSERT INTO metrics VALUES (1, 'x', 'y', 1.0, NULL)")
print("locked", flush=True)
time.sleep(60)
"""


@pytest.fixture
def locked(nightly_env):
    """The history database held under an exclusive lock by another process."""
    db = nightly_env / "history.sqlite"
    History(db).close()
    p = subprocess.Popen([sys.executable, "-c", LOCKER, str(db), "exclusive"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    yield db
    p.kill()
    p.wait()


def test_locked_database_does_not_fail_the_build(nightly_env, locked, monkeypatch, capsys):
    d = nightly_env
    monkeypatch.setattr(store, "BUSY_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    code, _, err = forge(monkeypatch, capsys, "build", write_recipe(d / "recipes"), "--report-dir", d / "out")
    assert code == 0 and time.monotonic() - t0 < 30
    assert f"{locked} is locked by another process" in " ".join(err.split())
    rep = json.loads((d / "out/nightly-synthetic/report.json").read_text())
    assert rep["status"] == "passed"
    assert next(s for s in rep["stages"] if s["name"] == "regression")["status"] == "skipped"


def test_a_lock_taken_during_the_build_only_skips_recording(nightly_env, monkeypatch):
    from pipeline.history import Nightly
    from pipeline.recipe import resolve
    d = nightly_env
    monkeypatch.setattr(store, "BUSY_TIMEOUT_S", 0.5)
    warnings = []
    night = Nightly(d / "history.sqlite", warn=warnings.append)
    assert night.history is not None
    p = subprocess.Popen([sys.executable, "-c", LOCKER, str(d / "history.sqlite"), "immediate"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        recipe = resolve(str(write_recipe(d / "recipes")))
        report = {"recipe": recipe.name, "recipe_hash": recipe.hash, "target": "onnxruntime", "status": "passed",
                  "wall_s": 1.0, "finished": "2026-12-01T02:00:00Z", "stages": []}
        assert night.record(recipe, report, d / "out/report.json") is None
    finally:
        p.kill()
        p.wait()
    assert len(warnings) == 1 and "locked" in warnings[0] and "history" not in report


def test_history_reads_a_read_only_mount(tmp_path):
    """`forge history` on a history whose directory and file cannot be written (a read-only mount, another
    user's file) reads it: SQLite opened read-only, no WAL index created (issue 24). Root ignores file modes, so
    as root the command runs as `nobody`."""
    import os
    import stat
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="forge-ro-history-"))       # pytest's tmp_path is private to its owner
    try:
        db = d / "history.sqlite"
        h = History(db)
        h.record(make_run(recipe="ro-recipe", ppl=0.75))
        h.close()                                                  # the last close removes -wal and -shm
        assert sorted(p.name for p in d.iterdir()) == ["history.sqlite"]
        db.chmod(0o444)
        d.chmod(0o555)
        cmd = [sys.executable, "-m", "pipeline.cli", "history", "--history", str(db), "--json"]
        if os.geteuid() == 0:
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), HOME=str(d))
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=d, timeout=120)
        assert p.returncode == 0, p.stderr
        nights = json.loads(p.stdout)["ro-recipe"]
        assert len(nights) == 1 and nights[0]["metrics"]["evaluate"]["ppl_delta_pct"] == 0.75
        assert sorted(x.name for x in d.iterdir()) == ["history.sqlite"]     # nothing written beside it
        assert stat.S_IMODE(db.stat().st_mode) == 0o444
    finally:
        d.chmod(0o755)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def test_read_only_history_refuses_a_missing_file(tmp_path):
    with pytest.raises(HistoryUnavailable, match="no run history at"):
        History(tmp_path / "none.sqlite", read_only=True)
    assert not (tmp_path / "none.sqlite").exists()


def test_serving_bench_figures_join_the_nights_other_bench_figures(tmp_path):
    """bench/serve.py's figures are added next to bench/run.py's on the same night (add-bench of serve.json must
    not wipe the prefill/decode figures), and a re-measured figure replaces its old value."""
    from pipeline.history.bench import flat

    h = History(tmp_path / "h.sqlite")
    rid = h.record(make_run())
    kw = dict(source="x", label="l", facts={}, recorded="2026-12-01T03:00:00Z", gates=[], status=None)
    h.attach_bench(rid, {"prefill_b4": 900.0, "decode_b1": 80.0}, **kw)
    serve = {"serve": {"protocols": {"http": {"1": {"req_s": 2.0}, "4": {"req_s": 5.0}, "16": {"req_s": 7.0}}},
                       "mismatches": 0, "errors": 0}}
    figs = flat(serve)
    assert figs["serve_http_c1_req_s"] == 2.0 and figs["serve_http_c16_over_c1"] == 3.5
    assert figs["serve_http_c4_over_c1"] == 2.5 and figs["serve_mismatches"] == 0
    h.attach_bench(rid, {k: v for k, v in figs.items() if v is not None}, **kw)
    h.attach_bench(rid, {"decode_b1": 81.0}, **kw)
    got = dict(h.db.execute("SELECT name, value FROM bench WHERE run_id=?", (rid,)).fetchall())
    assert got["prefill_b4"] == 900.0 and got["decode_b1"] == 81.0 and got["serve_http_c16_over_c1"] == 3.5
