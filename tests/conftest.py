"""Shared fixtures: one build of the default recipe per test session, reused by every integration test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("FORGE_PROGRESS", "0")

DEFAULT_RECIPE = os.environ.get("FORGE_SERVE_RECIPE", "smollm2-135m-int8")
# Smaller calibration than the recipe's for CI time; the evaluation set and the gates are the recipe's own.
DEFAULT_OVERRIDES = ["quantize.calibration.samples=8", "quantize.calibration.batch=2",
                     "validate.prompts.limit=4", "validate.prompts.max_new_tokens=16"]


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
