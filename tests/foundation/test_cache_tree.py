"""Issue 24, local side: payload trees with empty folders, `forge build --verify`, and recipe keys that change no
artifact (the S3 side is in tests/scaleout/test_shared_tree.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pipeline.cache import ArtifactCache
from pipeline.hashing import empty_dirs, sha256_json, tree_digest, tree_listing
from pipeline.recipe import resolve
from pipeline.stages import flow_for

sys.path.insert(0, str(Path(__file__).parent))
import fake_flow  # noqa: E402


def test_an_empty_folder_is_part_of_the_tree(tmp_path):
    cache = ArtifactCache(tmp_path / "c")
    with cache.writer("k" * 64) as out:
        (out / "ensemble" / "1").mkdir(parents=True)
        (out / "ensemble" / "config.pbtxt").write_text("name: ensemble")
        entry = cache.commit("k" * 64, out, {"stage": "package"})
    assert entry.meta["dirs"] == ["ensemble/1"] == empty_dirs(entry.payload)
    assert cache.verify_all() == []
    (entry.payload / "ensemble" / "1").rmdir()      # what a copy through an object store did before
    assert cache.verify_all() == [("k" * 64, "empty folder ensemble/1/ missing")]
    assert cache.get("k" * 64) is None              # set aside, rebuilt by the next build


def test_a_tree_without_empty_folders_keeps_its_digest(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    before = tree_digest(tmp_path, use_stat_cache=False)
    assert before == sha256_json(tree_listing(tmp_path))   # the digest before folders counted: no entry re-keyed
    (tmp_path / "e").mkdir()
    assert tree_digest(tmp_path, use_stat_cache=False) != before
    (tmp_path / "e").rmdir()
    assert tree_digest(tmp_path, use_stat_cache=False) == before


def test_build_verify_rehashes_what_the_stat_cache_trusts(tmp_path):
    first = fake_flow.runner(tmp_path).build()
    big = ArtifactCache(tmp_path).get(first[1].key).payload / "big.bin"
    st = big.stat()
    with open(big, "r+b") as f:         # rot one byte in place: same inode, size and mtime
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [x.status for x in fake_flow.runner(tmp_path).build()] == ["hit", "hit", "hit"]    # by design: stat cache
    r = fake_flow.runner(tmp_path)
    r.verify = True                     # forge build --verify
    assert [x.status for x in r.build()] == ["hit", "built", "hit"]
    assert ArtifactCache(tmp_path).verify_all() == []


def _keys(recipe) -> list[tuple[str, dict]]:
    """(stage, config) of every stage of the recipe's flow: the only key component a recipe decides besides the data
    sets it names (Stage.components; the data digests read calibration/eval sets, which these edits leave alone)."""
    return [(s.name, s.config(recipe)) for s in flow_for(recipe.build.target)]


@pytest.mark.parametrize("name", ["smollm2-135m-int8", "qwen7b-fp16", "smollm2-135m-int4"])
def test_a_regression_rule_or_description_change_reruns_no_stage(name, tmp_path):
    base = resolve(name)
    changed = resolve(name, ["validate.regression.ppl_delta_pct=+0.37", "validate.regression.stage_s=+50%",
                             "description=another night"])
    assert base.hash != changed.hash and base.package_hash == changed.package_hash
    assert _keys(base) == _keys(changed)
    # a threshold is a gate: it re-runs validate (and what follows), as it must
    gated = resolve(name, ["validate.thresholds.ppl_delta_pct_max=7.77"])
    assert [n for (n, k), (_, k2) in zip(_keys(base), _keys(gated)) if k != k2][0].startswith("validate")


def test_the_manifest_records_no_regression_rule():
    from pipeline.recipe import NOT_IN_ARTIFACTS
    r = resolve("smollm2-135m-int8", ["validate.regression.ppl_delta_pct=+0.37"])
    d = r.package_dict()
    assert "regression" not in d["validate"] and "description" not in d
    assert {"validate", "package", "build", "quantize"} <= set(d) and NOT_IN_ARTIFACTS
