"""Issue 24 on a real S3 server (SeaweedFS): content-addressed blobs (each distinct file once in the bucket), a home
downloads only what it hands over, and `forge cache verify` reports every problem of the store."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _records(shared) -> dict[str, dict]:
    s3 = shared.s3.client()
    return {k.rsplit("/", 1)[1][:-5]: json.loads(s3.get_object(Bucket=shared.bucket, Key=f"{shared.prefix}/{k}")
                                                 ["Body"].read()) for k in shared.keys("entries/")}


def _blob_sizes(shared) -> dict[str, int]:
    out = {}
    for page in shared.s3.client().get_paginator("list_objects_v2").paginate(Bucket=shared.bucket,
                                                                             Prefix=f"{shared.prefix}/blobs/"):
        out.update({o["Key"].rsplit("/", 1)[1]: o["Size"] for o in page.get("Contents", [])})
    return out


def _local_bytes(home: Path) -> int:
    return sum(p.stat().st_size for p in (home / "artifacts" / "entries").rglob("*") if p.is_file()
               and p.parent.name != "meta.json" and "payload" in p.parts)


def test_each_distinct_file_is_stored_once_and_a_home_downloads_its_hand_off(shared):
    a, b = shared.machine("a"), shared.machine("b")
    # samples 8 and 264: other numbers (produce), the same 300 KiB transform bytes (len % 256) and gate bytes
    fa, fb = shared.recipe("fa", samples=8, size_kb=300), shared.recipe("fb", samples=264, size_kb=300)
    a.forge("build", fa)
    a.forge("build", fb)
    recs = _records(shared)
    assert len(recs) == 5       # the two transforms have one digest, so one gate key serves both recipes
    distinct = {f["sha256"]: f["size"] for r in recs.values() for f in r["files"].values()}
    blobs = _blob_sizes(shared)
    assert blobs == distinct                     # each distinct file once, nothing else
    stored = sum(f["size"] for r in recs.values() for f in r["files"].values())
    assert stored - sum(blobs.values()) >= 300 * 1024   # the second 300 KiB transform file was not stored again

    b.forge("build", fb)                         # fully cached: downloads gate (its hand-off), not transform
    got = {s["name"]: s for s in b.report("fb")["stages"]}
    assert [s["status"] for s in got.values()] == ["hit"] * 3
    gate = recs[got["gate"]["key"]]
    assert _local_bytes(b.home) == sum(f["size"] for f in gate["files"].values()) < 1024

    b.forge("build", fb, "--force", "gate")     # gate runs: now its input (transform) is downloaded, not produce
    assert got["transform"]["key"] in b.local_keys() and got["produce"]["key"] not in b.local_keys()


def test_cache_verify_reports_every_problem_of_the_store(shared):
    a = shared.machine("a")
    fa = shared.recipe("fa")
    a.forge("build", fa)
    recs = _records(shared)
    s3 = shared.s3.client()
    gone = {}
    for key, rec in recs.items():       # delete one file's blob of produce and of gate
        if rec["components"]["stage"] in ("produce", "gate"):
            rel, f = sorted(rec["files"].items())[0]
            s3.delete_object(Bucket=shared.bucket, Key=f"{shared.prefix}/blobs/{f['sha256'][:2]}/{f['sha256']}")
            gone[key] = rel
    p = a.forge("cache", "verify", check=1)
    err = " ".join(p.stderr.split())
    for key, rel in gone.items():
        assert f"{key}: payload object missing: {rel}" in err, err
    assert "2 corrupt entries" in p.stdout and "Traceback" not in p.stderr
