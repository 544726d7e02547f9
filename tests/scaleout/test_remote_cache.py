"""The shared cache on a real S3 server (SeaweedFS on loopback): two "machines" (two FORGE_HOMEs) share a bucket."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from servers import REPO, Machine, free_port, link_home  # noqa: E402


def _stages(report: dict) -> dict:
    return {s["name"]: s for s in report["stages"]}


def _record(shared, key: str) -> dict:
    return shared.record(key)


def _blob(shared, key: str, rel: str) -> str:
    """The bucket object holding payload file ``rel`` of entry ``key`` (content-addressed: blobs/<sha>)."""
    return f"{shared.prefix}/{shared.blob_of(key, rel)}"


def _plan(machine, recipe) -> dict:
    return {s["name"]: s for s in json.loads(machine.forge("plan", recipe, "--json").stdout)["stages"]}


def test_second_machine_downloads_instead_of_rebuilding(shared):
    a, b = shared.machine("a"), shared.machine("b")
    fa = shared.recipe("fa", size_kb=300)
    a.forge("build", fa)
    built = _stages(a.report("fa"))
    assert [s["status"] for s in built.values()] == ["built"] * 3
    # report.json says how the night was built: on this machine, every output built here
    assert a.report("fa")["executor"] == {"kind": "local", "host": socket.gethostname()}
    assert [s["origin"] for s in built.values()] == [{"how": "built", "host": socket.gethostname()}] * 3

    plan = _plan(b, fa)      # nothing local on b: every stage is a hit in the bucket
    assert {n: (p["status"], p["reason"]) for n, p in plan.items()} == {
        n: ("hit", f"cached in {shared.url}") for n in built}
    assert [p["key"] for p in plan.values()] == [s["key"] for s in built.values()]

    p = b.forge("build", fa)
    got = _stages(b.report("fa"))
    assert [s["status"] for s in got.values()] == ["hit"] * 3
    # where each hit came from: the bucket, published by a; only the last stage was downloaded here
    assert [s["origin"] for s in got.values()] == [
        {"how": "shared", "store": shared.url, "fetched": n == "gate", "built_by": socket.gethostname()}
        for n in got]
    assert f"gate: hit ({shared.url})" in p.stderr
    assert got["transform"]["metrics"]["pid"] == built["transform"]["metrics"]["pid"]   # a's run, not b's
    # only what the build hands over (its last stage) is downloaded: nothing here had to run on the others
    assert b.local_keys() == {built["gate"]["key"]}
    assert got["gate"]["payload"] and got["produce"]["payload"] is None
    from pipeline.cache import ArtifactCache
    mine = ArtifactCache(b.home / "artifacts").get(built["gate"]["key"])    # the same bytes as a's, verified
    assert mine.meta["payload_digest"] == ArtifactCache(a.home / "artifacts").get(built["gate"]["key"]).meta["payload_digest"]
    assert (mine.payload / "model" / "1").is_dir()      # the empty folder came through the bucket
    b.forge("build", fa)
    assert [s["status"] for s in b.report("fa")["stages"]] == ["hit"] * 3
    assert [s["origin"] for s in b.report("fa")["stages"]][1:] == [      # gate: in b's local layer now
        {"how": "shared", "store": shared.url, "fetched": False, "built_by": socket.gethostname()},
        {"how": "local", "host": socket.gethostname()}]

    b.forge("build", fa, "--force", "gate")      # --force replaces the shared entry too
    assert [s["status"] for s in b.report("fa")["stages"]] == ["hit", "hit", "built"]
    assert len(shared.keys(f"quarantine/{built['gate']['key']}")) == 1

    # ls and verify see the store; gc --keep keeps what a recipe's last build uses, anywhere
    ls = b.forge("cache", "ls").stdout
    assert shared.url in ls and all(s["key"][:16] in ls for s in built.values())
    assert "0 corrupt entries" in b.forge("cache", "verify").stdout
    fb = shared.recipe("fb", samples=9)
    b.forge("build", fb)
    other = {s["key"] for s in b.report("fb")["stages"]}
    a.forge("cache", "gc", "--keep", "fa")     # a never built fb; the store's index says what fa's last build is
    records = [k for k in shared.keys("entries/")]
    assert sorted(k.rsplit("/", 1)[1][:-5] for k in records) == sorted(s["key"] for s in built.values())
    assert not any(k in "".join(shared.keys("objects/")) for k in other)


def test_flipped_byte_in_the_bucket_is_detected_and_rebuilt(shared):
    a, b = shared.machine("a"), shared.machine("b")
    fa = shared.recipe("fa")
    a.forge("build", fa)
    first = _stages(a.report("fa"))
    key = first["transform"]["key"]
    s3 = shared.s3.client()
    obj = _blob(shared, key, "sub/big.bin")
    data = bytearray(s3.get_object(Bucket=shared.bucket, Key=obj)["Body"].read())
    data[1000] ^= 0x01
    s3.put_object(Bucket=shared.bucket, Key=obj, Body=bytes(data))

    bad = a.forge("cache", "verify", check=1)
    assert key in bad.stderr and "sub/big.bin differs" in bad.stderr and shared.url in bad.stderr

    b.forge("build", fa)        # transform's entry is not needed on b (gate is a hit): not downloaded, not noticed
    assert [s["status"] for s in b.report("fa")["stages"]] == ["hit"] * 3
    b.forge("build", fa, "--force", "gate")     # gate runs: transform is downloaded, does not verify, is rebuilt
    got = _stages(b.report("fa"))
    assert [got[n]["status"] for n in ("produce", "transform", "gate")] == ["hit", "built", "built"]
    assert "did not verify" in got["transform"]["message"] and "big.bin" in got["transform"]["message"]
    assert got["transform"]["key"] == key and got["gate"]["key"] == first["gate"]["key"]   # same bytes again
    assert len([q for q in shared.keys("quarantine/") if key in q]) == 1     # (and gate's, replaced by --force)
    assert "0 corrupt entries" in b.forge("cache", "verify").stdout      # the republished entry verifies


def test_publisher_killed_mid_upload_leaves_no_entry(shared):
    a, b = shared.machine("a"), shared.machine("b")
    fa = shared.recipe("fa")
    mark = shared.tmp / "paused"
    p = a.forge("build", fa, wait=False, env={"FORGE_TEST_PAUSE_UPLOAD": str(mark)})
    t0 = time.time()
    while not mark.exists():
        assert p.poll() is None and time.time() - t0 < 120, p.communicate()
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)        # mid-upload: one payload blob of transform is in the bucket
    p.communicate()

    plan = _plan(b, fa)
    key = plan["transform"]["key"]
    assert plan["produce"]["status"] == "hit" and plan["transform"]["status"] == "miss"
    assert len(shared.keys("blobs/")) == 2      # produce's file, and one of transform's: uploaded, never named
    assert not shared.keys(f"entries/{key[:2]}/{key}")
    b.forge("cache", "gc")                  # within the grace period an upload may still be in flight: kept
    assert len(shared.keys("blobs/")) == 2
    assert "'removed_blobs': 1" in b.forge("cache", "gc", "--older-than", "0").stdout
    assert shared.keys("blobs/") == [_blob(shared, plan["produce"]["key"], "numbers.json")[len(shared.prefix) + 1:]]
    b.forge("build", fa)
    assert [s["status"] for s in b.report("fa")["stages"]] == ["hit", "built", "built"]


def test_two_publishers_of_one_key_leave_exactly_one_entry(shared):
    """Both machines build the same keys at once and race for each record (a barrier makes them create it at the
    same moment); the transform stage writes random bytes, so the loser must adopt the winner's payload."""
    a, b = shared.machine("a"), shared.machine("b")
    fa = shared.recipe("fa", salt=True)
    env = {"FORGE_TEST_BARRIER": f"{shared.tmp / 'barrier'}:2"}
    procs = [m.forge("build", fa, wait=False, env=env) for m in (a, b)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    ra, rb = _stages(a.report("fa")), _stages(b.report("fa"))
    assert [s["key"] for s in ra.values()] == [s["key"] for s in rb.values()]
    assert all(s["status"] == "built" for s in (*ra.values(), *rb.values()))
    messages = [ra["transform"]["message"], rb["transform"]["message"]]
    assert sorted(bool(m) for m in messages) == [False, True]
    assert "another machine published this key first" in "".join(messages)
    records = shared.keys("entries/")
    assert len(records) == 3
    for s in ra.values():
        rec = _record(shared, s["key"])
        for rel in rec["files"]:            # every blob the winner's record names is there
            assert _blob(shared, s["key"], rel)[len(shared.prefix) + 1:] in shared.keys("blobs/")
        for m in (a, b):    # both machines hold the winner's bytes
            assert json.loads((m.home / "artifacts" / "entries" / s["key"][:2] / s["key"] / "meta.json").read_text()
                              )["payload_digest"] == rec["payload_digest"]
    assert "0 corrupt entries" in a.forge("cache", "verify").stdout
    # the loser's salt.txt (its only bytes that differ) is a blob no record names: gc removes it, nothing else
    assert "'removed_blobs': 1" in a.forge("cache", "gc", "--older-than", "0").stdout
    assert "0 corrupt entries" in b.forge("cache", "verify").stdout


def test_unusable_store_is_a_clear_error_and_offline_builds_locally(shared):
    fa = shared.recipe("fa")
    cases = {   # what is wrong, the commands tried, what the message says
        "no network": ({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}, shared.url, ("build", "plan"),
                       "cannot reach"),
        "denied": ({"AWS_SECRET_ACCESS_KEY": "wrong"}, shared.url, ("build", "cache"), "access denied"),
        "no bucket": ({}, "s3://no-such-bucket-forge/x", ("build",), "aws s3 mb s3://no-such-bucket-forge"),
    }
    for why, (env, url, commands, said) in cases.items():
        m = shared.machine(why.replace(" ", "-"), **env)
        m.env["FORGE_CACHE"] = url
        for cmd in commands:
            p = m.forge(*{"build": ("build", fa), "plan": ("plan", fa), "cache": ("cache", "ls")}[cmd], check=1)
            err = " ".join(p.stderr.split())
            assert said in err and url in err and "--cache-offline" in err and "Traceback" not in err, (why, err)
    p = m.forge("build", fa, "--cache-offline")     # asked for: local only, said loudly
    assert "warning: --cache-offline" in p.stderr and url in " ".join(p.stderr.split())
    assert [s["status"] for s in m.report("fa")["stages"]] == ["built"] * 3
    assert len(m.local_keys()) == 3


def test_unsupported_cache_url_is_a_usage_error(tmp_path):
    m = Machine(tmp_path / "h", dict(os.environ, PYTHONPATH=str(REPO), FORGE_HOME=str(tmp_path / "h"),
                                     FORGE_CACHE="memory://x/y", FORGE_PROGRESS="0"), tmp_path)
    p = m.forge("plan", "smollm2-135m-int8", check=2)
    assert "memory://x/y" in p.stderr and "s3://" in p.stderr and "Traceback" not in p.stderr


def test_ray_executor_needs_a_shared_cache(tmp_path):
    m = Machine(tmp_path / "h", dict(os.environ, PYTHONPATH=str(REPO), FORGE_HOME=str(tmp_path / "h"),
                                     FORGE_CACHE=str(tmp_path / "c"), FORGE_PROGRESS="0"), tmp_path)
    (tmp_path / "fa.yaml").write_text("name: fa\nquantize: {method: none}\n")
    for cmd in (("plan", tmp_path / "fa.yaml"), ("build", tmp_path / "fa.yaml")):
        p = m.forge(*cmd, "--executor", "ray", check=2)
        assert "FORGE_CACHE=s3://" in " ".join(p.stderr.split())
    p = m.forge("build", tmp_path / "fa.yaml", "--executor", "ray", "--cache-offline", check=2)
    assert "--cache-offline" in p.stderr


@pytest.mark.integration
def test_real_recipe_source_stage_is_shared(shared):
    """The real source stage of the default recipe through the bucket: machine b (its own FORGE_HOME, the same
    converted model) finds a's entry, downloads and verifies it, and every later key agrees."""
    from pipeline.host.paths import forge_home
    a, b = shared.machine("a"), shared.machine("b")
    for m in (a, b):
        link_home(forge_home(), m.home)
    a.forge("build", "smollm2-135m-int8", "--until", "source", real=True)
    built = _stages(a.report("smollm2-135m-int8"))["source"]
    assert built["status"] == "built"
    plan = {s["name"]: s for s in json.loads(b.forge("plan", "smollm2-135m-int8", "--json", real=True).stdout)["stages"]}
    assert (plan["source"]["status"], plan["source"]["key"]) == ("hit", built["key"])
    assert plan["source"]["reason"] == f"cached in {shared.url}"
    b.forge("build", "smollm2-135m-int8", "--until", "source", real=True)
    assert _stages(b.report("smollm2-135m-int8"))["source"]["status"] == "hit"
    assert built["key"] in b.local_keys()
    assert "0 corrupt entries" in b.forge("cache", "verify", real=True).stdout


def test_unreachable_ray_head_is_a_clear_error(shared):
    m = shared.machine("driver")
    fa = shared.recipe("fa")
    address = f"127.0.0.2:{free_port()}"
    for cmd in ("plan", "build"):
        p = m.forge(cmd, fa, "--executor", "ray", "--ray-address", address, check=1, timeout=60)
        err = " ".join(p.stderr.split())
        assert f"cannot reach the Ray head at {address}" in err and "ray start --head" in err, err
        assert "Traceback" not in err
    # a nightly CI still sees a result: the failed start, with why, and the JUnit file
    report = m.report("fa")
    assert report["status"] == "failed"
    assert [(s["name"], s["status"]) for s in report["stages"]] == [("start", "failed")]
    assert f"cannot reach the Ray head at {address}" in report["stages"][0]["message"]
    assert "failures=\"1\"" in (m.cwd / "out" / "fa" / "junit.xml").read_text()


def test_a_cluster_lost_mid_run_still_leaves_every_recipes_reports(shared):
    m = shared.machine("driver", FORGE_TEST_RAY_LOST="the Ray cluster went away (node lost)")
    fa, fb = shared.recipe("fa"), shared.recipe("fb")
    p = m.forge("build", fa, fb, "--executor", "ray", check=1, timeout=60)
    assert "the Ray cluster went away" in p.stderr and "Traceback" not in p.stderr, p.stderr
    for name in ("fa", "fb"):
        report = m.report(name)
        assert (report["status"], report["stages"][0]["name"]) == ("failed", "start")
        assert "the Ray cluster went away" in report["stages"][0]["message"]
        assert (m.cwd / "out" / name / "junit.xml").is_file()
    # no shared store at all: a usage error (exit 2), and still a report per recipe
    p = m.forge("build", fa, "--executor", "ray", "--report-dir", "out2", check=2, env={"FORGE_CACHE": ""})
    assert "needs a shared cache" in " ".join(p.stderr.split())
    assert "needs a shared cache" in " ".join(m.report("fa", out="out2")["stages"][0]["message"].split())


@pytest.mark.integration
def test_package_built_in_one_home_serves_in_another(shared, default_build, default_package, default_overrides):
    """The default recipe's package (built once per session, in the user's FORGE_HOME) goes through the bucket to a
    home that never built it: `forge serve RECIPE` there fetches it (empty version folders included) and answers."""
    import threading
    import urllib.request

    from pipeline.host.paths import forge_home
    from pipeline.triton.serve import find_tritonserver, free_port
    try:
        find_tritonserver()
    except Exception as e:      # noqa: BLE001 - the serve tests' own skip reason
        pytest.skip(f"tritonserver missing: {e}")
    recipe = default_build[0].name
    sets = [x for o in default_overrides for x in ("--set", o)]
    a, b = shared.machine("a"), shared.machine("b")
    a.env["FORGE_HOME"] = str(forge_home())     # every stage a local hit there: published to the bucket now
    a.forge("build", recipe, *sets, real=True, timeout=900)
    link_home(forge_home(), b.home)             # the converted model only (the plan's source key reads it)
    port = free_port(3)     # forge serve takes P, P+1, P+2
    p = b.forge("serve", recipe, *sets, "--port", port, real=True, wait=False)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
    try:
        t0 = time.time()
        while not any("Ctrl-C stops it" in x for x in lines):
            assert p.poll() is None, p.stderr.read()
            assert time.time() - t0 < 300, "forge serve never reported the endpoints"
            time.sleep(0.3)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/ensemble/generate", method="POST",
                                     data=json.dumps({"text_input": "The capital of France is", "max_tokens": 4}).encode(),
                                     headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(60)
    assert isinstance(answer.get("text_output"), str) and answer["text_output"].strip()
    package = {s["name"]: s for s in a.report(recipe)["stages"]}["package"]["key"]
    assert b.local_keys() == {package}          # only the package came down