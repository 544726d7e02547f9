"""Run history of nightly builds: a SQLite store, regression rules against the last good night, and
the views on it (`forge history` tables, `forge history diff`, the HTML trend page, CI step summaries).

``Nightly`` is the one hook `forge build` uses: ``check`` adds the regression verdict to a build's
stage results, ``record`` stores the finished night. Neither ever fails a build: an unusable history
is warned about and skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .facts import machine_facts, night_from_report
from .regression import check as _check
from .store import History, HistoryUnavailable, Run

__all__ = ["History", "HistoryUnavailable", "Nightly", "Run"]


class Nightly:
    def __init__(self, path: Path | None = None, warn: Callable[[str], None] = print):
        from ..host.paths import history_db
        self.path = Path(path) if path else history_db()
        self.warn = warn
        self.unavailable = ""
        try:
            self.history: History | None = History(self.path)
        except HistoryUnavailable as e:
            self.history, self.unavailable = None, str(e)
            warn(f"run history not used: {e}")
        self.facts = machine_facts()

    # Both hooks catch everything: the history is a by-product, and a nightly must not die of it. An
    # unexpected error is warned with its type so it gets reported rather than silently swallowed.
    def check(self, recipe, results) -> list:
        """[] or [the `regression` StageResult] for this build, compared with the last good night."""
        from ..report import build_report
        try:
            tonight = night_from_report(build_report(recipe, results, 0.0), recipe.to_dict(), self.facts)
            verdict = _check(self.history, recipe, tonight, self.unavailable)
        except Exception as e:
            self.warn(f"regression rules not checked: {type(e).__name__}: {e}")
            return []
        return [verdict] if verdict is not None else []

    def record(self, recipe, report: dict, report_path: Path) -> int | None:
        """Store the night; adds ``report["history"]`` (db, run id). Warns and returns None on failure."""
        if self.history is None:
            return None
        try:
            run = night_from_report(report, recipe.to_dict(), self.facts, str(Path(report_path).absolute()))
            rid = self.history.record(run)
        except HistoryUnavailable as e:
            self.warn(f"run history: {e}")
            return None
        except Exception as e:
            self.warn(f"run history: this night is not recorded: {type(e).__name__}: {e}")
            return None
        report["history"] = {"db": str(self.path), "run": rid, "machine_class": run.machine_class}
        return rid
