"""Error types the CLI shows as plain messages (no traceback); their exit codes are in pipeline/status.py."""

from __future__ import annotations

MAX_PROBLEMS_SHOWN = 50  # a recipe with thousands of mistakes is reported by its first ones


class ForgeError(Exception):
    """A problem the user can fix; the message says what and how."""


class UsageError(ForgeError):
    """Bad input: a recipe, an override, a name or a command-line argument (exit 2)."""


class RecipeError(UsageError):
    """One or more problems in a recipe; all are reported at once (the first MAX_PROBLEMS_SHOWN of them)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        shown = [f"- {p}" for p in self.problems[:MAX_PROBLEMS_SHOWN]]
        if len(self.problems) > MAX_PROBLEMS_SHOWN:
            shown.append(f"- ... and {len(self.problems) - MAX_PROBLEMS_SHOWN} more problems not shown")
        super().__init__("\n".join(shown))


class StageFailed(ForgeError):
    """A stage ran and its result is not acceptable (parity check, validation gate, ...)."""

    def __init__(self, message: str, metrics: dict | None = None):
        self.metrics = dict(metrics or {})
        super().__init__(message)


class CannotRunHere(ForgeError):
    """A stage needs something this machine lacks (a GPU, tensorrt_llm, ...)."""

    def __init__(self, missing: str, finish_hint: str = ""):
        self.missing = missing
        self.finish_hint = finish_hint
        msg = f"cannot run here: {missing}"
        if finish_hint:
            msg += f"; finish on a machine that has it with: {finish_hint}"
        super().__init__(msg)

