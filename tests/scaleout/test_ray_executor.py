"""forge build/plan --executor ray on a local two-node Ray cluster (head 127.0.0.2, a second node 127.0.0.3 that
advertises a fake ``sm_90``), artifacts only through the shared cache on a real S3 server (SeaweedFS).

CPU ISA classes are emulated (FORGE_TEST_ISA_CLASS, tests/scaleout/fake_stages.py): the head is an x86_64-avx2
node, the second an x86_64-avx512vnni node that also advertises ``isa:x86_64-amx``, a class it does not have (a
misconfigured node, which must refuse what it is sent)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from servers import HERE, REPO, ray_cluster  # noqa: E402

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def cluster(s3_server, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_"))}
    env.update(s3_server.env(), PYTHONPATH=f"{REPO}:{HERE}", FORGE_PROGRESS="0")
    try:
        with ray_cluster(tmp_path_factory.mktemp("ray"), env,
                         {"sm_90": 1, "isa:x86_64-avx512vnni": 1, "isa:x86_64-amx": 1},
                         head_resources={"isa:x86_64-avx2": 1},
                         node_env={HEAD_IP: {"FORGE_TEST_ISA_CLASS": "x86_64-avx2"},
                                   WORKER_IP: {"FORGE_TEST_ISA_CLASS": "x86_64-avx512vnni"}}) as c:
            yield c
    except RuntimeError as e:
        pytest.fail(str(e))


def _ray(cluster, *args):
    return (*args, "--executor", "ray", "--ray-address", cluster.address)


def _stages(report: dict) -> dict:
    return {s["name"]: s for s in report["stages"]}


def test_plan_says_where_each_stage_would_run(cluster, shared):
    m = shared.machine("driver")
    fsm = shared.recipe("fsm", target="tensorrt")
    f80 = shared.recipe("f80", target="tensorrt", sm=80)
    plan = {s["name"]: s for s in json.loads(m.forge(*_ray(cluster, "plan", fsm, "--json")).stdout)["stages"]}
    assert {n: s["status"] for n, s in plan.items()} == dict.fromkeys(("produce", "transform", "gate", "engine"), "miss")
    assert plan["produce"]["where"] == "CPU 1 on any of 2 nodes"
    assert plan["engine"]["where"] == f"CPU 1, sm_90 1 on {WORKER_IP} ({cluster.nodes[WORKER_IP][:8]})"

    p = m.forge(*_ray(cluster, "plan", f80))      # no node has sm_80: said plainly, with the command that fixes it
    text = " ".join(p.stdout.split())
    assert "cannot-run-here" in text and "no node in the Ray cluster has CPU 1, sm_80 1" in text
    assert "ray start --address=HEAD:PORT --resources='{\"sm_80\": 1}'" in text

    # a real TensorRT-LLM recipe (tp 2): CPU stages anywhere; the engine build and evaluation need 2 GPUs of the
    # architecture the recipe names, and no node here has a GPU
    def real_plan(*extra):
        out = m.forge(*_ray(cluster, "plan", "qwen7b-int8", "--json", *extra), real=True).stdout
        return {s["name"]: s for s in json.loads(out)["stages"]}
    plan = real_plan()
    assert "build.tensorrt_llm.gpu_sm is not set" in plan["build"]["reason"]
    plan = real_plan("--set", "build.tensorrt_llm.gpu_sm=90")
    assert plan["quantize"]["status"] == "miss" and plan["quantize"]["where"] == "CPU 1 on any of 2 nodes"
    for stage in ("build", "evaluate"):
        assert plan[stage]["status"] == "cannot-run-here" and plan[stage]["where"] == "nowhere"
        assert plan[stage]["reason"].startswith("no node in the Ray cluster has CPU 1, GPU 2, sm_90 2")
        assert "--num-gpus=2 --resources='{\"sm_90\": 2}'" in plan[stage]["reason"]


def test_two_recipes_build_in_parallel_and_the_sm90_stage_runs_on_its_node(cluster, shared):
    m = shared.machine("driver")
    fa = shared.recipe("fa", sleep=3, tag="a")
    fsm = shared.recipe("fsm", target="tensorrt", sleep=3, tag="b")
    f80 = shared.recipe("f80", target="tensorrt", sm=80, tag="c")
    p = m.forge(*_ray(cluster, "build", fa, fsm, f80, "--keep-going"), check=3)   # f80: incomplete
    assert json.loads((m.cwd / "out" / "summary.json").read_text()) == {
        "fa": "passed", "fsm": "passed", "f80": "incomplete"}
    ra, rs, r80 = (_stages(m.report(n)) for n in ("fa", "fsm", "f80"))
    for n in ("fa", "fsm", "f80"):
        assert (m.cwd / "out" / n / "junit.xml").is_file() and (m.cwd / "out" / n / "summary.txt").is_file()

    # the two slow transforms ran at the same time, one on each node (one CPU each)
    ta, ts = ra["transform"]["metrics"], rs["transform"]["metrics"]
    assert max(ta["started"], ts["started"]) < min(ta["ended"], ts["ended"]), (ta, ts)
    assert {ra["transform"]["node"]["ip"], rs["transform"]["node"]["ip"]} == {"127.0.0.2", WORKER_IP}

    # produce has one key in all three recipes: built once
    produce = [r["produce"] for r in (ra, rs, r80)]
    assert len({x["key"] for x in produce}) == 1
    assert sorted(x["status"] for x in produce) == ["built", "hit", "hit"]

    # the sm90 stage ran on the node that advertises sm_90 (the report says which; so does the stage itself)
    assert rs["engine"]["status"] == "built"
    assert rs["engine"]["node"]["id"] == cluster.nodes[WORKER_IP] == rs["engine"]["metrics"]["node_id"]
    assert r80["engine"]["status"] == "cannot-run-here" and "sm_80" in r80["engine"]["message"]
    assert "no node in the Ray cluster" in " ".join(p.stderr.split())

    # everything went through the bucket: a machine that never built anything hits every stage there
    plan = json.loads(shared.machine("other").forge("plan", fsm, "--json").stdout)["stages"]
    assert [s["status"] for s in plan] == ["hit"] * 4


def test_killed_worker_is_retried_and_the_build_matches_a_local_one(cluster, shared, tmp_path):
    mark = tmp_path / "attempt-1-pid"
    fk = shared.recipe("fk", samples=5, crash_once=str(mark))
    m = shared.machine("driver")
    p = m.forge(*_ray(cluster, "build", fk), wait=False)
    t0 = time.time()
    while not mark.exists() or not mark.read_text():
        assert p.poll() is None and time.time() - t0 < 150, p.communicate()
        time.sleep(0.2)
    killed = int(mark.read_text())
    os.kill(killed, signal.SIGKILL)         # the Ray worker running the transform stage, mid-task
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    ray_report = m.report("fk")
    assert [s["status"] for s in ray_report["stages"]] == ["built"] * 3
    assert _stages(ray_report)["transform"]["metrics"]["pid"] != killed       # a second attempt did it

    local = shared.machine("local")
    local.env["FORGE_CACHE"] = str(tmp_path / "local-cache")                  # this machine only, no Ray
    local.forge("build", fk)
    local_report = local.report("fk")
    assert [s["key"] for s in local_report["stages"]] == [s["key"] for s in ray_report["stages"]]
    from pipeline.cache import ArtifactCache
    from pipeline.remote_cache import RemoteStore
    store, here = RemoteStore(shared.url), ArtifactCache(tmp_path / "local-cache")
    os.environ.update(shared.s3.env())
    try:
        for s in local_report["stages"]:
            assert store.record(s["key"])["payload_digest"] == here.get(s["key"]).meta["payload_digest"]
    finally:
        for k in shared.s3.env():
            os.environ.pop(k, None)
    # report.json is written as the local executor writes it: the same fields, the node added
    assert set(ray_report) == set(local_report)
    assert [set(s) for s in ray_report["stages"]] == [set(s) for s in local_report["stages"]]
    assert all(s["node"] == {} for s in local_report["stages"]) and all(s["node"]["ip"] for s in ray_report["stages"])


def test_isa_keyed_stages_run_only_on_nodes_of_the_drivers_class(cluster, shared):
    fi = shared.recipe("fi", isa=True)
    for isa, ip in (("x86_64-avx512vnni", WORKER_IP), ("x86_64-avx2", HEAD_IP)):
        m = shared.machine(f"driver-{isa}", FORGE_TEST_ISA_CLASS=isa)
        m.forge(*_ray(cluster, "build", fi))
        gate = _stages(m.report("fi"))["gate"]
        assert gate["status"] == "built" and gate["node"]["ip"] == ip, (isa, gate)
        assert gate["metrics"]["isa_class"] == isa            # measured on the class its key names
        assert gate["components"]["hardware"] == f"cpu:{isa}"     # ...and its key names

    # a class no node advertises: not submitted, said with the command that makes a node advertise its class
    m = shared.machine("driver-sve", FORGE_TEST_ISA_CLASS="aarch64-sve")
    m.forge(*_ray(cluster, "build", fi), check=3)
    gate = _stages(m.report("fi"))["gate"]
    assert gate["status"] == "cannot-run-here" and not gate["node"]
    assert "isa:aarch64-sve" in gate["message"] and "python -m pipeline.ray_executor --node-resources" in gate["message"]

    # a node that advertises a class it does not have: it refuses the stage instead of storing a mislabelled result
    m = shared.machine("driver-amx", FORGE_TEST_ISA_CLASS="x86_64-amx")
    m.forge(*_ray(cluster, "build", fi), check=1)
    gate = _stages(m.report("fi"))["gate"]
    assert gate["status"] == "failed" and gate["node"]["ip"] == WORKER_IP
    assert "'cpu:x86_64-avx512vnni' but the driver keyed the stage with 'cpu:x86_64-amx'" in gate["message"]
    assert "--node-resources" in gate["message"]


def test_the_drivers_outputs_are_local(cluster, shared):
    """The package is fetched into the driver's cache layer and out/<recipe>/triton_repo links there; report.json
    names no path in a worker's FORGE_HOME (which does not exist on the driver's machine of a real cluster)."""
    m = shared.machine("driver")
    fp = shared.recipe("fp", target="tensorrt_llm", tag=uuid.uuid4().hex)     # a package no node has yet
    m.forge(*_ray(cluster, "build", fp))
    report = m.report("fp")
    stages = _stages(report)
    assert stages["package"]["status"] == "built"             # (the rest may be in a node's layer already)
    assert stages["package"]["node"]["ip"] in cluster.nodes     # built by a worker, in that node's FORGE_HOME
    repo = m.cwd / "out" / "fp" / "triton_repo"
    assert repo.is_symlink() and repo.resolve().is_relative_to(m.home.resolve())
    assert (repo / "model" / "1" / "engine.bin").read_bytes() == b"sm90" * 64
    assert stages["package"]["payload"] == str(repo.resolve())
    homes = [str(h.resolve()) for h in cluster.homes.values()]
    for s in report["stages"]:
        p = s["payload"]
        assert p.startswith(shared.url + "/") or Path(p).resolve().is_relative_to(m.home.resolve()), s
        assert not any(p.startswith(h) for h in homes), s
    # the stages the driver does not link were not downloaded to it
    assert m.local_keys() == {stages["package"]["key"]}

    # report.json says how the night was built: on which cluster, and where each output came from
    ex = report["executor"]
    assert (ex["kind"], ex["requested"], ex["address"], ex["driver"]) == ("ray", cluster.address, cluster.address,
                                                                          socket.gethostname())
    assert sorted(n["ip"] for n in ex["nodes"]) == sorted(cluster.nodes)
    node = stages["package"]["node"]
    assert stages["package"]["origin"] == {"how": "built", "host": node["host"], "node": node["id"], "ip": node["ip"]}
    for s in report["stages"]:      # built by a task, a hit a task found in its node's layer, or in the bucket
        o = s["origin"]
        assert (o["how"] == "built" and o["node"] == s["node"]["id"]) \
            or (o["how"] == "local" and s["node"]["ip"] in cluster.nodes) \
            or o == {"how": "shared", "store": shared.url, "fetched": False, "built_by": socket.gethostname()}, s


def test_a_bad_blob_a_worker_finds_is_rebuilt_by_the_driver(cluster, shared):
    """A blob two entries name (produce's numbers.json, carried by transform) is truncated in the bucket; the worker
    that runs gate finds it while fetching transform. Both entries are set aside (the driver sets aside produce's,
    which it looked up), rebuilt on the cluster in a second pass, and the bucket is healed."""
    a, m = shared.machine("a"), shared.machine("driver")
    fc = shared.recipe("fc", carry=True, tag=uuid.uuid4().hex)
    a.forge("build", fc)                    # the local executor, into the bucket
    first = _stages(a.report("fc"))
    blob = shared.blob_of(first["transform"]["key"], "numbers.json")
    shared.damage(blob, "truncated")
    p = m.forge(*_ray(cluster, "build", fc, "--force", "gate"))
    assert "Traceback" not in p.stderr and "set aside, rebuilding it" in p.stderr, p.stderr
    got = _stages(m.report("fc"))
    assert [got[n]["key"] for n in got] == [first[n]["key"] for n in first]     # the same bytes again
    assert [got[n]["status"] for n in ("transform", "gate")] == ["built", "built"]
    assert all(got[n]["origin"]["node"] in cluster.nodes.values() for n in ("transform", "gate"))
    # produce's record was set aside with transform's (one blob): rebuilt, or a hit in the local layer of the node
    # that ran it (produce's key is the same in every test here), which publishes it again; never the bad entry
    quarantined = " ".join(shared.keys("quarantine/"))
    assert first["produce"]["key"] in quarantined and first["transform"]["key"] in quarantined
    produce = got["produce"]
    assert produce["origin"]["how"] == "built" or (produce["origin"]["how"] == "local"
                                                   and produce["node"]["ip"] in cluster.nodes), produce
    assert shared.healed(blob)
    assert "0 corrupt entries" in a.forge("cache", "verify").stdout
