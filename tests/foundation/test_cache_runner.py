"""Behaviour of the artifact cache and runner on a model-free flow (fast, no network)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cache import ArtifactCache, diff_components, make_key

sys.path.insert(0, str(Path(__file__).parent))
import fake_flow  # noqa: E402

SCRIPT = Path(__file__).parent / "fake_flow.py"
REPO = Path(__file__).resolve().parents[2]


def _run_script(cache, *args, env_extra=None, wait=True):
    env = dict(os.environ, PYTHONPATH=str(REPO), FORGE_PROGRESS="0", **(env_extra or {}))
    p = subprocess.Popen([sys.executable, str(SCRIPT), str(cache), *args], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out, errout = p.communicate(timeout=120)
    assert p.returncode == 0, errout
    return json.loads(out.strip().splitlines()[-1])


def test_build_then_everything_hits(tmp_path):
    r = fake_flow.runner(tmp_path)
    first = r.build()
    assert [x.status for x in first] == ["built", "built", "built"]
    second = fake_flow.runner(tmp_path).build()
    assert [x.status for x in second] == ["hit", "hit", "hit"]
    assert [x.key for x in first] == [x.key for x in second]
    assert [p.status for p in fake_flow.runner(tmp_path).plan()] == ["hit", "hit", "hit"]


def test_key_is_stable_across_processes(tmp_path):
    in_proc = [x.key for x in fake_flow.runner(tmp_path / "a").build()]
    other = [x["key"] for x in _run_script(tmp_path / "b")]
    assert in_proc == other
    assert all(len(k) == 64 for k in in_proc)   # full-width sha256


@pytest.mark.parametrize("component", ["stage", "impl_version", "config", "upstream", "data", "tools", "hardware"])
def test_each_key_component_changes_the_key(component):
    base = {"stage": "s", "impl_version": "1", "config": {"a": 1}, "upstream": {"u": "d1"}, "data": {"x": "h1"},
            "tools": {"torch": "2.13.0"}, "hardware": "cpu:x86_64"}
    changed = dict(base)
    changed[component] = {"changed": True} if isinstance(base[component], dict) else base[component] + "-2"
    assert make_key(base) != make_key(changed)
    assert diff_components(base, changed)[0].startswith(component)


def test_threshold_change_reruns_only_downstream_and_plan_names_the_key(tmp_path):
    fake_flow.runner(tmp_path).build()
    r = fake_flow.runner(tmp_path, {"validate.thresholds.ppl_delta_pct_max": 50.0})
    plans = r.plan()
    assert [p.status for p in plans] == ["hit", "hit", "miss"]
    assert "config.thresholds.ppl_delta_pct_max" in plans[2].reason
    res = r.build()
    assert [x.status for x in res] == ["hit", "hit", "built"]


def test_upstream_change_propagates(tmp_path):
    fake_flow.runner(tmp_path).build()
    plans = fake_flow.runner(tmp_path, {"quantize.calibration.samples": 9}).plan()
    assert plans[0].status == "miss" and "config.samples" in plans[0].reason
    assert plans[1].status == "miss" and plans[2].status == "miss"


def test_failure_is_not_cached_and_stops_the_flow(tmp_path):
    r = fake_flow.runner(tmp_path, {"validate.thresholds.ppl_delta_pct_max": 0.001})
    res = r.build()
    assert res[2].status == "failed" and "above" in res[2].message
    assert ArtifactCache(tmp_path).check(res[2].key) == "miss"
    assert r.build()[2].status == "failed"      # ran again, not replayed from cache


def test_flipped_byte_is_detected_and_rebuilt(tmp_path):
    res = fake_flow.runner(tmp_path).build()
    cache = ArtifactCache(tmp_path)
    payload = cache.get(res[1].key).payload / "big.bin"
    data = bytearray(payload.read_bytes())
    data[5000] ^= 0xFF
    time.sleep(0.01)
    payload.write_bytes(bytes(data))
    assert cache.check(res[1].key) == "corrupt"
    again = fake_flow.runner(tmp_path).build()
    assert [x.status for x in again] == ["hit", "built", "hit"]
    assert cache.get(res[1].key) is not None
    assert cache.verify_all() == []


def test_verify_all_catches_corruption_without_stat_cache(tmp_path):
    res = fake_flow.runner(tmp_path).build()
    cache = ArtifactCache(tmp_path)
    f = cache.get(res[0].key).payload / "numbers.json"
    st = f.stat()
    f.write_text(f.read_text().replace("1", "7"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))   # same mtime and size: only a full re-hash sees it
    assert [k for k, _ in cache.verify_all()] == [res[0].key]


def test_sigkill_mid_write_leaves_no_valid_entry(tmp_path):
    mark = tmp_path / "mark"
    p = _run_script(tmp_path / "c", env_extra={"FAKE_SLOW": "30", "FAKE_MARK": str(mark)}, wait=False)
    for _ in range(300):
        if mark.exists():
            break
        time.sleep(0.1)
    assert mark.exists(), p.stderr.read() if p.poll() is not None else "stage never started"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    cache = ArtifactCache(tmp_path / "c")
    stages = [e.meta["components"]["stage"] for e in cache.entries()]
    assert stages == ["produce"]                      # transform was never committed
    res = _run_script(tmp_path / "c")
    assert [x["status"] for x in res] == ["hit", "built", "built"]


def test_two_concurrent_builds_both_succeed_with_one_entry(tmp_path):
    env = {"FAKE_SLOW": "2", "FAKE_MARK": str(tmp_path / "m")}
    a = _run_script(tmp_path / "d", env_extra=env, wait=False)
    b = _run_script(tmp_path / "d", env_extra=env, wait=False)
    outs = []
    for p in (a, b):
        out, errout = p.communicate(timeout=120)
        assert p.returncode == 0, errout
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0][-1]["key"] == outs[1][-1]["key"]
    statuses = sorted(x["status"] for x in (outs[0][1], outs[1][1]))
    assert statuses == ["built", "hit"]               # the second waited on the lock and reused
    cache = ArtifactCache(tmp_path / "d")
    assert len(cache.entries()) == 3 and cache.verify_all() == []


def test_force_and_from_and_until(tmp_path):
    fake_flow.runner(tmp_path).build()
    r = fake_flow.runner(tmp_path)
    assert [x.status for x in r.build(force={"transform"})] == ["hit", "built", "hit"]
    assert [x.status for x in r.build(from_stage="transform")] == ["hit", "built", "built"]
    assert [x.status for x in r.build(until="produce")] == ["hit", "skipped", "skipped"]
    from pipeline.errors import ForgeError
    with pytest.raises(ForgeError, match="no such stage"):
        r.build(from_stage="nope")


def test_interrupt_removes_partial_work(tmp_path):
    """KeyboardInterrupt inside a stage: the temp dir goes, nothing is committed."""
    r = fake_flow.runner(tmp_path)

    def boom(ctx):
        (ctx.out / "partial").write_text("x")
        raise KeyboardInterrupt

    r.stages[1].run = boom
    with pytest.raises(KeyboardInterrupt):
        r.build()
    cache = ArtifactCache(tmp_path)
    assert [e.meta["components"]["stage"] for e in cache.entries()] == ["produce"]
    assert list((tmp_path / "tmp").iterdir()) == []
