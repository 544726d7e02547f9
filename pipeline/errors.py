"""Error types the CLI shows as plain messages (no traceback)."""

from __future__ import annotations


class ForgeError(Exception):
    """A problem the user can fix; the message says what and how."""


class RecipeError(ForgeError):
    """One or more problems in a recipe; all are reported at once."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(f"- {p}" for p in self.problems))


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
