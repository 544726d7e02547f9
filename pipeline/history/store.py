"""The run history: one SQLite database (stdlib ``sqlite3``) that every `forge build` appends a night to.

Where: ``--history PATH``, else ``$FORGE_HISTORY``, else ``FORGE_HOME/history.sqlite`` (``env.history_db``).

Safe to share: WAL journal (readers never block the writer), a busy timeout for concurrent writers (the
matrix legs of one nightly), and one transaction per recorded night, so a killed build leaves either the
whole night or nothing. Opening or writing raises ``HistoryUnavailable`` when the file is corrupt, locked
past the timeout, or written by a newer forge; the build's hook (``history.Nightly``) turns that into a
warning -- a build never fails because of its history.

Schema versions live in ``PRAGMA user_version``; ``MIGRATIONS[i]`` takes a database from version i to
i + 1 and runs under the write lock, so two processes opening a fresh file migrate it once.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

BUSY_TIMEOUT_S = 30.0   # a night's write takes milliseconds; this only waits out other writers

MIGRATIONS: list[list[str]] = [
    [  # 0 -> 1
        """CREATE TABLE runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            recipe TEXT NOT NULL,
            recipe_hash TEXT NOT NULL,
            target TEXT NOT NULL,
            status TEXT NOT NULL,              -- passed | failed | incomplete (after the regression check)
            started TEXT NOT NULL,             -- ISO-8601 UTC
            finished TEXT NOT NULL,
            wall_s REAL,
            recipe_json TEXT NOT NULL,         -- the resolved recipe
            machine_class TEXT NOT NULL,       -- baselines come from nights of the same class
            machine_json TEXT NOT NULL,        -- CPU model / ISA, GPUs, OS, python, tool versions
            git_commit TEXT,
            git_dirty INTEGER,
            report_path TEXT                   -- the night's report.json
        )""",
        "CREATE INDEX runs_by_recipe ON runs(recipe, id)",
        """CREATE TABLE stages (
            run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            name TEXT NOT NULL,
            status TEXT NOT NULL,              -- hit | built | failed | cannot-run-here | skipped
            key TEXT,
            duration_s REAL,
            peak_rss_mb REAL,
            message TEXT,
            components_json TEXT,              -- the stage's cache-key components
            PRIMARY KEY (run_id, name)
        )""",
        "CREATE INDEX stages_by_key ON stages(name, key)",
        """CREATE TABLE metrics (
            run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            stage TEXT NOT NULL,
            name TEXT NOT NULL,                -- dotted for nested metrics: per_set.wiki/eval.ppl
            value REAL,                        -- numbers (and booleans as 0/1)
            text TEXT,                         -- anything else
            PRIMARY KEY (run_id, stage, name)
        )""",
        """CREATE TABLE gates (
            run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            stage TEXT NOT NULL,               -- validate / validate_checkpoint, or regression
            name TEXT NOT NULL,
            value REAL,
            op TEXT,
            threshold REAL,                    -- for regression: the last good value + the allowed worsening
            key TEXT,                          -- the recipe key that sets it
            passed INTEGER NOT NULL,
            baseline REAL,                     -- regression only: the last good night's value
            baseline_run INTEGER,
            message TEXT,
            PRIMARY KEY (run_id, stage, name)
        )""",
        """CREATE TABLE bench (
            run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            name TEXT NOT NULL,                -- prefill_b4, decode_b1, ttft_s, ... (bench/run.py's flat())
            value REAL,
            PRIMARY KEY (run_id, name)
        )""",
        """CREATE TABLE bench_runs (
            run_id INTEGER PRIMARY KEY REFERENCES runs(id) ON DELETE CASCADE,
            recorded TEXT NOT NULL,
            source TEXT,                       -- the results.json it came from
            label TEXT,                        -- the engine's label in it
            facts_json TEXT                    -- bench machine facts and settings
        )""",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)


class HistoryUnavailable(Exception):
    """The database cannot be used (corrupt, locked past the timeout, newer schema); the build carries on."""


@dataclass
class Run:
    """One night of one recipe, as stored (or, before it is stored, as built: ``id`` None)."""
    id: int | None
    recipe: str
    recipe_hash: str
    target: str
    status: str
    started: str
    finished: str
    wall_s: float | None
    recipe_dict: dict
    machine_class: str
    machine: dict
    git_commit: str | None = None
    git_dirty: bool | None = None
    report_path: str | None = None
    stages: list[dict] = field(default_factory=list)           # name, status, key, duration_s, peak_rss_mb, message, components
    metrics: dict[str, dict] = field(default_factory=dict)     # stage -> {name: value (float or str)}
    gates: list[dict] = field(default_factory=list)
    bench: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"#{self.id}" if self.id is not None else "tonight"

    def stage(self, name: str) -> dict | None:
        return next((s for s in self.stages if s["name"] == name), None)


def flatten_metrics(metrics: dict, prefix: str = "") -> Iterable[tuple[str, float | None, str | None]]:
    """(dotted name, number, text) for every leaf; lists are kept whole as JSON text."""
    for k, v in (metrics or {}).items():
        name = f"{prefix}{k}"
        if k == "gates" and not prefix:
            continue   # stored in the gates table
        if isinstance(v, dict):
            yield from flatten_metrics(v, name + ".")
        elif isinstance(v, bool):
            yield name, float(v), None
        elif isinstance(v, (int, float)):
            yield name, (float(v) if math.isfinite(v) else None), (None if math.isfinite(v) else str(v))
        elif isinstance(v, str):
            try:   # report.json writes non-finite floats as strings
                f = float(v)
                yield name, None, v if not math.isfinite(f) else None
                continue
            except ValueError:
                pass
            yield name, None, v
        elif v is not None:
            yield name, None, json.dumps(v, default=str)


def _num(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


class History:
    """An open run-history database."""

    def __init__(self, path: Path, timeout: float | None = None, read_only: bool = False):
        self.path = Path(path)
        if read_only:
            self._open_read_only()
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # autocommit mode: transactions are explicit (BEGIN IMMEDIATE takes the write lock up front)
            self.db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S if timeout is None else timeout,
                                      isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise HistoryUnavailable(f"cannot open {self.path}: {e}") from None
        try:
            self.db.execute("PRAGMA foreign_keys = ON")
            mode = self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise HistoryUnavailable(f"{self.path}: cannot switch to WAL journal (got {mode})")
            self._migrate()
        except sqlite3.Error as e:
            self.db.close()
            raise HistoryUnavailable(_explain(self.path, e)) from None
        except HistoryUnavailable:
            self.db.close()
            raise

    def _open_read_only(self) -> None:
        """Open for reading only, so a history on a read-only mount (or owned by another user) can be read:
        ``mode=ro`` first; when SQLite cannot create the WAL index (-shm) beside a read-only file, ``immutable=1``
        (https://www.sqlite.org/uri.html: safe here because nothing of ours writes to it while we read)."""
        if not self.path.is_file():
            raise HistoryUnavailable(f"no run history at {self.path}: `forge build` records one (or name another "
                                     f"with --history or $FORGE_HISTORY)")
        from urllib.parse import quote
        uri = f"file:{quote(str(self.path.absolute()))}?mode=ro"
        last: sqlite3.Error | None = None
        for extra in ("", "&immutable=1"):
            try:
                self.db = sqlite3.connect(uri + extra, uri=True, isolation_level=None)
            except sqlite3.Error as e:
                last = e
                continue
            try:
                v = self._version()
            except sqlite3.Error as e:
                self.db.close()
                last = e
                continue
            if v != SCHEMA_VERSION:
                self.db.close()
                raise HistoryUnavailable(
                    f"{self.path} has schema version {v}, this forge reads {SCHEMA_VERSION}: "
                    + ("upgrade forge" if v > SCHEMA_VERSION else "open it writable once (`forge build` or "
                       "`forge history` where it can be written) to migrate it"))
            return
        raise HistoryUnavailable(_explain(self.path, last)) from None

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------ schema
    def _version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        if self._version() == SCHEMA_VERSION:
            return
        self.db.execute("BEGIN IMMEDIATE")
        try:
            v = self._version()   # again under the lock: another process may have migrated meanwhile
            if v > SCHEMA_VERSION:
                raise HistoryUnavailable(f"{self.path} has schema version {v}, written by a newer forge "
                                         f"(this one knows up to {SCHEMA_VERSION}): upgrade forge or use another "
                                         f"--history file")
            for i in range(v, SCHEMA_VERSION):
                for stmt in MIGRATIONS[i]:
                    self.db.execute(stmt)
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------ writing
    def record(self, run: Run) -> int:
        """Store one night in one transaction; returns its id. Raises HistoryUnavailable."""
        with self._write():
            cur = self.db.execute(
                "INSERT INTO runs (recipe, recipe_hash, target, status, started, finished, wall_s, recipe_json,"
                " machine_class, machine_json, git_commit, git_dirty, report_path)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run.recipe, run.recipe_hash, run.target, run.status, run.started, run.finished, run.wall_s,
                 json.dumps(run.recipe_dict, sort_keys=True), run.machine_class,
                 json.dumps(run.machine, sort_keys=True, default=str), run.git_commit,
                 None if run.git_dirty is None else int(run.git_dirty), run.report_path))
            rid = cur.lastrowid
            for seq, st in enumerate(run.stages):
                self.db.execute(
                    "INSERT INTO stages VALUES (?,?,?,?,?,?,?,?,?)",
                    (rid, seq, st["name"], st["status"], st.get("key"), _num(st.get("duration_s")),
                     _num(st.get("peak_rss_mb")), st.get("message") or "",
                     json.dumps(st.get("components"), sort_keys=True, default=str)
                     if st.get("components") is not None else None))
            for stage, ms in run.metrics.items():
                self.db.executemany("INSERT INTO metrics VALUES (?,?,?,?,?)",
                                    [(rid, stage, n, v, t) for n, v, t in flatten_metrics(ms)])
            self._insert_gates(rid, run.gates)
        run.id = rid
        return rid

    def _insert_gates(self, rid: int, gates: list[dict]) -> None:
        self.db.executemany(
            "INSERT OR REPLACE INTO gates VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            [(rid, g["stage"], g["name"], _num(g.get("value")), g.get("op"), _num(g.get("threshold")), g.get("key"),
              int(bool(g.get("passed"))), _num(g.get("baseline")), g.get("baseline_run"), g.get("message"))
             for g in gates])

    def attach_bench(self, run_id: int, figures: dict, *, source: str, label: str, facts: dict, recorded: str,
                     gates: list[dict], status: str | None) -> None:
        """Bench figures of a night's engine (+ the bench rules' verdicts, and the night's new status)."""
        with self._write():
            # only the figures given are replaced: the serving bench (bench/serve.py) adds serve_* figures to
            # a night that bench/run.py already measured
            self.db.executemany("DELETE FROM bench WHERE run_id=? AND name=?", [(run_id, k) for k in figures])
            self.db.executemany("INSERT INTO bench VALUES (?,?,?)", [(run_id, k, _num(v)) for k, v in figures.items()])
            self.db.execute("INSERT OR REPLACE INTO bench_runs VALUES (?,?,?,?,?)",
                            (run_id, recorded, source, label, json.dumps(facts, sort_keys=True, default=str)))
            self._insert_gates(run_id, gates)
            if status:
                self.db.execute("UPDATE runs SET status=? WHERE id=?", (status, run_id))

    @contextlib.contextmanager
    def _write(self):
        """One write transaction (BEGIN IMMEDIATE takes the write lock up front); sqlite errors become
        HistoryUnavailable, anything else rolls back and propagates."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            raise HistoryUnavailable(_explain(self.path, e)) from None

    # ------------------------------------------------------------ reading
    def _q(self, sql: str, args=()) -> list[tuple]:
        try:
            return self.db.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise HistoryUnavailable(_explain(self.path, e)) from None

    def recipes(self) -> list[str]:
        return [r[0] for r in self._q("SELECT DISTINCT recipe FROM runs ORDER BY recipe")]

    def run_ids(self, recipe: str | None = None, since: str | None = None, limit: int | None = None) -> list[int]:
        """Ids, oldest first; ``limit`` keeps the newest."""
        sql, args = "SELECT id FROM runs WHERE 1=1", []
        if recipe:
            sql, args = sql + " AND recipe=?", args + [recipe]
        if since:
            sql, args = sql + " AND finished>=?", args + [since]
        sql += " ORDER BY id DESC"
        if limit:
            sql, args = sql + " LIMIT ?", args + [limit]
        return sorted(r[0] for r in self._q(sql, args))

    def get(self, run_id: int) -> Run | None:
        rows = self._q("SELECT id, recipe, recipe_hash, target, status, started, finished, wall_s, recipe_json,"
                       " machine_class, machine_json, git_commit, git_dirty, report_path FROM runs WHERE id=?",
                       (run_id,))
        if not rows:
            return None
        (rid, recipe, rhash, target, status, started, finished, wall, rjson, mclass, mjson, commit, dirty,
         report) = rows[0]
        run = Run(rid, recipe, rhash, target, status, started, finished, wall, json.loads(rjson), mclass,
                  json.loads(mjson), commit, None if dirty is None else bool(dirty), report)
        for name, status_, key, dur, rss, msg, comps in self._q(
                "SELECT name, status, key, duration_s, peak_rss_mb, message, components_json FROM stages"
                " WHERE run_id=? ORDER BY seq", (rid,)):
            run.stages.append({"name": name, "status": status_, "key": key, "duration_s": dur, "peak_rss_mb": rss,
                               "message": msg, "components": json.loads(comps) if comps else None})
        for stage, name, value, text in self._q("SELECT stage, name, value, text FROM metrics WHERE run_id=?",
                                                (rid,)):
            run.metrics.setdefault(stage, {})[name] = value if value is not None else text
        cols = ("stage", "name", "value", "op", "threshold", "key", "passed", "baseline", "baseline_run", "message")
        for row in self._q(f"SELECT {', '.join(cols)} FROM gates WHERE run_id=? ORDER BY rowid", (rid,)):
            g = dict(zip(cols, row))
            g["passed"] = bool(g["passed"])
            run.gates.append(g)
        run.bench = {n: v for n, v in self._q("SELECT name, value FROM bench WHERE run_id=?", (rid,))}
        return run

    def runs(self, recipe: str | None = None, since: str | None = None, limit: int | None = None) -> list[Run]:
        return [r for r in (self.get(i) for i in self.run_ids(recipe, since, limit)) if r is not None]

    def last_good(self, recipe: str, machine_class: str, *, before: int | None = None,
                  built_stage: str | None = None, with_bench: bool = False) -> Run | None:
        """The newest good night (passed, or incomplete with nothing failed) of ``recipe`` on ``machine_class``.

        ``built_stage``: only nights that built that stage (cache hits are not timed);
        ``with_bench``: only nights that have bench figures."""
        sql = ("SELECT r.id FROM runs r WHERE r.recipe=? AND r.machine_class=? "
               "AND r.status IN ('passed', 'incomplete')")
        args: list = [recipe, machine_class]
        if before is not None:
            sql, args = sql + " AND r.id<?", args + [before]
        if built_stage:
            sql += " AND EXISTS (SELECT 1 FROM stages s WHERE s.run_id=r.id AND s.name=? AND s.status='built')"
            args.append(built_stage)
        if with_bench:
            sql += " AND EXISTS (SELECT 1 FROM bench b WHERE b.run_id=r.id)"
        rows = self._q(sql + " ORDER BY r.id DESC LIMIT 1", args)
        return self.get(rows[0][0]) if rows else None

    def runs_with_stage_key(self, stage: str, key: str) -> list[int]:
        """The newest night of every recipe whose ``stage`` had ``key`` (bench results -> nights)."""
        return [r[0] for r in self._q("SELECT MAX(run_id) FROM stages JOIN runs ON runs.id = stages.run_id"
                                      " WHERE stages.name=? AND stages.key=? GROUP BY runs.recipe", (stage, key))]


def _explain(path: Path, e: sqlite3.Error) -> str:
    msg = str(e)
    if "locked" in msg or "busy" in msg:
        return f"{path} is locked by another process ({msg}); this night is not recorded there"
    if isinstance(e, sqlite3.DatabaseError) and ("not a database" in msg or "malformed" in msg or "corrupt" in msg):
        return (f"{path} is corrupt ({msg}): move it aside (a fresh one is created on the next build) or try "
                f"`sqlite3 {path} .recover`")
    return f"{path}: {type(e).__name__}: {msg}"
