"""The stage walk both executors take (pipeline/stage_walk.py): --from/--force, --until, what a failure skips."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.stage_walk import StageResult, StageWalk, forced_stages
from pipeline.status import Status

# a -> b -> d, a -> c (c and b are independent; d needs b)
FLOW = [SimpleNamespace(name="a", needs=()), SimpleNamespace(name="b", needs=("a",)),
        SimpleNamespace(name="c", needs=("a",)), SimpleNamespace(name="d", needs=("b",))]


def _run(walk: StageWalk, outcome: dict[str, Status], parallel: bool = False) -> list[str]:
    """Drive the walk as an executor would; returns the stages started, in order."""
    started = []
    while True:
        ready = walk.ready() if parallel else ([walk.next()] if walk.next() else [])
        if not ready:
            return started
        for s in ready:
            walk.start(s.name)
            started.append(s.name)
        for s in ready:
            st = outcome.get(s.name, Status.BUILT)
            walk.finish(StageResult(s.name, st, key=f"k-{s.name}"), f"d-{s.name}" if st == Status.BUILT else None)


def test_forced_stages_from_and_force():
    names = [s.name for s in FLOW]
    assert forced_stages(names, "c", ["a"]) == {"a", "c", "d"}
    assert forced_stages(names, None, None) == set()


def test_a_failure_skips_what_needs_it_and_stops_new_starts():
    seen = []
    walk = StageWalk(FLOW, set(), on_result=lambda r: seen.append((r.name, r.status)))
    assert _run(walk, {"b": Status.FAILED}) == ["a", "b"]
    assert [(r.name, r.status) for r in walk.in_order()] == [
        ("a", "built"), ("b", "failed"), ("c", "skipped"), ("d", "skipped")]
    assert walk.results["d"].message == "upstream did not complete" and walk.done and walk.failed
    assert len(seen) == 4          # every result, skips included, is told to the executor's printer


def test_until_stops_after_the_stage_named():
    walk = StageWalk(FLOW, set(), until="b")
    assert _run(walk, {}) == ["a", "b"]
    assert walk.results["c"].message == "after --until" and walk.results["d"].status == Status.SKIPPED


def test_parallel_executor_gets_independent_stages_at_once_and_the_same_outcome():
    walk = StageWalk(FLOW, set())
    assert _run(walk, {}, parallel=True) == ["a", "b", "c", "d"]
    assert walk.ready() == [] and walk.done and not walk.failed
    assert walk.keys(["a", "b"]) == {"a": "k-a", "b": "k-b"} and walk.digests()["d"] == "d-d"


def test_a_stage_that_cannot_run_here_blocks_only_what_needs_it():
    walk = StageWalk(FLOW, set())
    _run(walk, {"b": Status.CANNOT_RUN_HERE})
    assert [r.status for r in walk.in_order()] == ["built", "cannot-run-here", "built", "skipped"]


def test_the_stage_orders_the_docs_print_are_the_registry_s():
    """README's and docs/stages.md's stage lines are copies of each target's stages(): a stage added to a target
    (tensorrt_llm's build_deploy was missing from both) fails here until the docs say it."""
    import re
    from pathlib import Path
    from pipeline import target_registry

    root = Path(__file__).resolve().parents[2]
    for doc in ("README.md", "docs/stages.md"):
        text = (root / doc).read_text()
        lines = dict(re.findall(r"^(\w+)\s*:\s*(source →.*)$", text, re.M))
        assert set(lines) == set(target_registry.names()), doc
        for name, line in lines.items():
            assert line.split(" → ") == [s.name for s in target_registry.get(name).stages()], (doc, name)
