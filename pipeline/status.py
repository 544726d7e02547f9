"""The one vocabulary of outcomes (plan, stage, recipe) and the one map from a run's outcome to its exit code.

``Status`` is a ``StrEnum``: members are their strings, so report.json, junit.xml and older code that compares
with ``"hit"`` read the same values."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    # a stage in a plan (forge plan)
    HIT = "hit"                          # cached and intact
    MISS = "miss"                        # will run
    CANNOT_RUN_HERE = "cannot-run-here"  # needs what this machine lacks (a GPU, tensorrt_llm)
    BLOCKED = "blocked"                  # after a stage that cannot run here
    CORRUPT = "corrupt"                  # cached but changed on disk: rebuilt
    # a stage in a build (forge build): HIT, CANNOT_RUN_HERE, or
    BUILT = "built"
    FAILED = "failed"
    SKIPPED = "skipped"                  # after a failure, or after --until
    # a recipe's build: FAILED, or
    PASSED = "passed"
    INCOMPLETE = "incomplete"            # a stage could not run here
    INVALID = "invalid"                  # bad recipe, override or argument: nothing ran


# Exit codes of every forge command (README "Exit codes").
EXIT_OK = 0
EXIT_FAILED = 1          # a stage failed, a check found a problem
EXIT_BAD_INPUT = 2       # bad recipe, override, name or argument
EXIT_INCOMPLETE = 3      # a stage cannot run on this machine
EXIT_INTERRUPTED = 130   # Ctrl-C / SIGTERM; partial work removed

# A recipe's outcome -> exit code; with several recipes the first of these that any recipe has wins.
EXIT_CODES = {Status.INVALID: EXIT_BAD_INPUT, Status.FAILED: EXIT_FAILED, Status.INCOMPLETE: EXIT_INCOMPLETE,
              Status.PASSED: EXIT_OK}


def exit_code(outcomes) -> int:
    seen = set(outcomes)
    return next((code for outcome, code in EXIT_CODES.items() if outcome in seen), EXIT_OK)


def overall(stage_statuses) -> Status:
    """A recipe's outcome from its stages' statuses."""
    seen = set(stage_statuses)
    if Status.FAILED in seen:
        return Status.FAILED
    if Status.CANNOT_RUN_HERE in seen:
        return Status.INCOMPLETE
    return Status.PASSED
