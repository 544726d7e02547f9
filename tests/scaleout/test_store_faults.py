"""Faults of the shared store on a real S3 server (SeaweedFS on loopback): a bad blob in the bucket is rebuilt in the
same run and healed, two builders on one bad blob both succeed, and a server that dies or refuses mid-build is one
line on stderr with exit 1, never a traceback.

The fake flow's ``carry`` knob makes the transform stage carry produce's numbers.json, so that one blob is named by
two entries (as the tokenizer is by source and export)."""

from __future__ import annotations

import json
import socket
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from servers import Proxy, Shared, seaweedfs  # noqa: E402

NOISE = ("Traceback", "never retrieved")     # what a store fault must never print


def _stages(report: dict) -> dict:
    return {s["name"]: s for s in report["stages"]}


@pytest.mark.parametrize("fault", ["truncated", "deleted", "bit-flipped"])
def test_a_bad_shared_blob_is_rebuilt_in_the_same_run_and_healed(shared, fault):
    a, b, c = shared.machine("a"), shared.machine("b"), shared.machine("c")
    fc = shared.recipe("fc", carry=True)
    a.forge("build", fc)
    built = _stages(a.report("fc"))
    produce, transform = built["produce"]["key"], built["transform"]["key"]
    blob = shared.blob_of(transform, "numbers.json")
    assert blob == shared.blob_of(produce, "numbers.json")        # one blob, named by both entries
    shared.damage(blob, fault)

    # a fresh machine hands over transform: fetching it finds the blob bad; produce names it too, so both are set
    # aside at once and both rebuilt here, in this run (before: exit 1, "set aside ...; build again")
    p = b.forge("build", fc, "--until", "transform")
    assert not any(n in p.stderr for n in NOISE), p.stderr
    got = _stages(b.report("fc"))
    assert [got[n]["status"] for n in ("produce", "transform", "gate")] == ["built", "built", "skipped"]
    assert [got[n]["key"] for n in ("produce", "transform")] == [produce, transform]     # the same bytes again
    assert "did not verify" in got["transform"]["message"] and "numbers.json" in got["transform"]["message"]
    assert f"names a blob that did not verify in {transform[:16]}" in got["produce"]["message"]
    assert got["produce"]["origin"] == got["transform"]["origin"] == {"how": "built", "host": socket.gethostname()}
    quarantined = " ".join(shared.keys("quarantine/"))
    assert produce in quarantined and transform in quarantined

    # the re-upload healed the bucket: every record verifies, and a third machine builds on it
    assert shared.healed(blob)
    assert "0 corrupt entries" in a.forge("cache", "verify").stdout
    c.forge("build", fc, "--force", "gate")         # gate runs there: transform is downloaded and verified
    assert [s["status"] for s in c.report("fc")["stages"]] == ["hit", "hit", "built"]


def test_a_blob_of_one_entry_is_healed_by_its_rebuild(shared):
    """A bad blob only one entry names: that entry alone is set aside and rebuilt (produce stays a hit)."""
    a, b = shared.machine("a"), shared.machine("b")
    fc = shared.recipe("fc", carry=True)
    a.forge("build", fc)
    transform = _stages(a.report("fc"))["transform"]["key"]
    blob = shared.blob_of(transform, "sub/big.bin")
    shared.damage(blob, "truncated")
    b.forge("build", fc, "--force", "gate")
    got = _stages(b.report("fc"))
    assert [got[n]["status"] for n in ("produce", "transform", "gate")] == ["hit", "built", "built"]
    assert got["produce"]["origin"]["how"] == "shared" and got["produce"]["origin"]["fetched"]   # transform's input
    assert shared.healed(blob)


def test_two_builders_on_one_bad_blob_both_succeed_and_leave_one_good_copy(shared):
    """Both fresh machines find the shared blob bad, rebuild, heal it and race for each record (a barrier makes
    them create each at the same moment); transform writes random bytes, so the loser adopts the winner's."""
    a, b, c = shared.machine("a"), shared.machine("b"), shared.machine("c")
    fc = shared.recipe("fc", carry=True, salt=True)
    a.forge("build", fc)
    first = _stages(a.report("fc"))
    transform = first["transform"]["key"]
    blob = shared.blob_of(transform, "numbers.json")
    shared.damage(blob, "bit-flipped")        # the same size: only the mark of a bad blob makes it re-uploaded
    env = {"FORGE_TEST_BARRIER": f"{shared.tmp / 'barrier'}:2"}
    procs = [m.forge("build", fc, "--until", "transform", wait=False, env=env) for m in (b, c)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and not any(n in err for n in NOISE), err
    rb, rc = _stages(b.report("fc")), _stages(c.report("fc"))
    for r in (rb, rc):      # each rebuilt both: found them bad itself, or set aside by the other one
        assert [r[n]["status"] for n in ("produce", "transform")] == ["built", "built"]
    assert any("did not verify" in r[n]["message"] for r in (rb, rc) for n in ("produce", "transform"))
    assert [rb[n]["key"] for n in ("produce", "transform")] == [rc[n]["key"] for n in ("produce", "transform")]
    # the rebuilt records (and a's gate, untouched), one copy of the blob with its right bytes, every record verifies
    assert shared.keys("entries/") == sorted(f"entries/{k[:2]}/{k}.json" for k in (s["key"] for s in first.values()))
    assert shared.keys(blob) == [blob] and shared.healed(blob)
    assert "0 corrupt entries" in a.forge("cache", "verify").stdout
    winner = json.loads(shared.get(f"entries/{transform[:2]}/{transform}.json"))["payload_digest"]
    for m in (b, c):        # both machines hold the winner's bytes
        meta = m.home / "artifacts" / "entries" / transform[:2] / transform / "meta.json"
        assert json.loads(meta.read_text())["payload_digest"] == winner


# ------------------------------------------------------------------ the server fails under a build
@pytest.fixture
def own_server(tmp_path):
    """A SeaweedFS server of this test's own (the test kills it)."""
    with seaweedfs(tmp_path / "weed") as server:
        server.new_bucket("forge-fault")
        yield server


@pytest.mark.parametrize("fault", ["killed mid-upload", "reset mid-upload", "killed mid-download",
                                   "reset mid-download"])
def test_a_server_that_fails_mid_transfer_is_one_line_never_a_traceback(own_server, tmp_path, fault):
    """A proxy between forge and the server watches the bytes of each connection; once 4 MiB of one transfer
    went through, it kills the server (SIGKILL) or resets every connection (RST, the server alive)."""
    shared = Shared(own_server, "forge-fault", f"t-{uuid.uuid4().hex[:12]}", tmp_path)
    fb = shared.recipe("fb", size_kb=48 * 1024)
    killed = fault.startswith("killed")
    if fault.endswith("download"):
        shared.machine("a").forge("build", fb)     # in the bucket; the next machine downloads it
    host, port = own_server.endpoint.rsplit("/", 1)[1].split(":")
    with Proxy((host, int(port)), trigger=4 << 20, on_trigger=own_server.kill if killed else None,
               reset=not killed, direction="down" if fault.endswith("download") else "up") as proxy:
        m = shared.machine("b", AWS_ENDPOINT_URL=proxy.endpoint)
        p = m.forge("build", fb, "--force", "gate", check=None, timeout=300)
    assert proxy.fired.is_set(), "the fault was never injected"
    assert not any(n in p.stderr for n in NOISE), p.stderr
    if not killed:          # one reset: the client's retry goes through
        assert p.returncode == 0, p.stderr
        return
    assert p.returncode == 1, p.stderr
    said = [line for line in p.stderr.splitlines() if "cannot reach" in line]
    assert len(said) == 1 and proxy.endpoint in said[0] and "--cache-offline" in said[0], p.stderr
    report = m.report("fb")
    assert report["status"] == "failed"
    failed = [s for s in report["stages"] if s["status"] == "failed"]
    assert len(failed) == 1 and "cannot reach" in failed[0]["message"]


def test_credentials_that_may_not_write_are_one_line(shared):
    """Credentials that may read and list the bucket but not write it: the first write (a hit records the last
    build in index/) fails that stage, in one line."""
    a = shared.machine("a")
    fa = shared.recipe("fa")
    a.forge("build", fa)
    r = shared.machine("reader", **shared.s3.env(reader=True))
    p = r.forge("build", fa, check=1)
    assert not any(n in p.stderr for n in NOISE), p.stderr
    failed = [s for s in r.report("fa")["stages"] if s["status"] == "failed"]
    assert len(failed) == 1 and "access denied" in failed[0]["message"] and shared.url in failed[0]["message"]
    assert len([line for line in p.stderr.splitlines() if "access denied" in line]) == 1, p.stderr
