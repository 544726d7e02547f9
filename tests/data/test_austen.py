"""The Austen extractor's glue: R lazy-load databases decoded with ``rdata``, files read out of a .deb with dpkg-deb.

The R streams are built by hand, byte for byte as R's serialize() writes them (R Internals, "Serialization
Formats"), so the tests need neither R nor the real package.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import shutil
import struct
import subprocess
import zlib

import pytest

from pipeline.data import austen, registries
from pipeline.data.austen import read_lazyload_db, r_unserialize
from pipeline.data.registries import deb_members
from pipeline.errors import ForgeError

I = lambda v: struct.pack(">i", v)  # noqa: E731


def header(version=3):
    h = b"X\n" + I(version) + I(0x040201) + I(0x030500)
    return h + (I(5) + b"UTF-8" if version == 3 else b"")


def charsxp(s, enc=8):               # enc: 8 = UTF-8, 4 = latin-1, 64 = ASCII (the "levels" bits)
    if s is None:
        return I(9) + I(-1)
    raw = s.encode("latin-1" if enc == 4 else "utf-8")
    return I(9 | (enc << 12)) + I(len(raw)) + raw


def strsxp(items):
    return I(16) + I(len(items)) + b"".join(charsxp(*x) if isinstance(x, tuple) else charsxp(x) for x in items)


def names_attr(names):
    # pairlist cell with tag: flags LISTSXP | has_tag; tag = SYMSXP "names"; car = the names; cdr = NILVALUE
    return I(2 | 1024) + I(1) + charsxp("names", 64) + strsxp(names) + I(254)


@pytest.mark.parametrize("version", [2, 3])
def test_character_vector_with_na_and_encodings(version):
    data = header(version) + strsxp(["It is a truth", None, ("Mrs. Bennet – née", 8), ("café", 4), ""])
    assert r_unserialize(data).tolist() == ["It is a truth", None, "Mrs. Bennet – née", "café", ""]
    assert r_unserialize(gzip.compress(data)).tolist()[0] == "It is a truth"     # an .rds is gzip'd


def _lazyload_db(vectors: dict[str, list], compress) -> tuple[bytes, bytes]:
    """An .rdx index (gzip'd named list) pointing at blocks in an .rdb, as R's makeLazyLoadDB writes."""
    blocks, offsets = b"", []
    for vec in vectors.values():
        ser = header() + strsxp(vec)
        if compress is True:                       # compress = TRUE: zlib, no type byte
            body = zlib.compress(ser)
        else:                                      # 2 / 3: a type byte, then bzip2 / xz
            body = b"2" + bz2.compress(ser) if compress == 2 else b"X" + lzma.compress(ser)
        blk = struct.pack(">I", len(ser)) + body
        offsets.append((len(blocks), len(blk)))
        blocks += blk
    pos = lambda o: I(13) + I(2) + I(o[0]) + I(o[1])  # noqa: E731
    variables = I(19 | 512) + I(len(vectors)) + b"".join(pos(o) for o in offsets) + names_attr(list(vectors))
    compressed = I(10) + I(1) + I(1) if compress is True else I(13) + I(1) + I(compress)
    index = I(19 | 512) + I(3) + variables + I(19) + I(0) + compressed \
        + names_attr(["variables", "references", "compressed"])
    return gzip.compress(header() + index), blocks


@pytest.mark.parametrize("compress", [True, 2, 3])
def test_lazyload_database(compress):
    books = {"book1": ["line one", "line two"], "book2": ["Emma Woodhouse", None]}
    objs = read_lazyload_db(*_lazyload_db(books, compress))
    assert {k: v.tolist() for k, v in objs.items()} == books


def test_lazyload_block_length_is_checked():
    rdx, rdb = _lazyload_db({"b": ["x"]}, True)
    bad = struct.pack(">I", struct.unpack(">I", rdb[:4])[0] + 1) + rdb[4:]
    with pytest.raises(ForgeError, match="wrong length"):
        read_lazyload_db(rdx, bad)


needs_dpkg_deb = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb not installed")


def _build_deb(tmp_path, files: dict[str, bytes], compression: str):
    root = tmp_path / f"pkg-{compression}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text("Package: forge-test\nVersion: 1.0\nArchitecture: all\n"
                                             "Maintainer: forge <forge@example.invalid>\nDescription: test\n")
    for name, blob in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(blob)
    deb = tmp_path / f"x-{compression}.deb"
    r = subprocess.run(["dpkg-deb", "--root-owner-group", f"-Z{compression}", "--build", str(root), str(deb)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"dpkg-deb cannot build -Z{compression} here: {r.stderr.strip()}")
    return deb


@needs_dpkg_deb
@pytest.mark.parametrize("compression", ["xz", "gzip", "zstd"])
def test_deb_members_any_compression(tmp_path, compression):
    deb = _build_deb(tmp_path, {"usr/lib/R/x/Rdata.rdb": b"hello rdb", "usr/lib/R/x/other": b"no"}, compression)
    assert deb_members(deb, ["usr/lib/R/x/Rdata.rdb"]) == {"usr/lib/R/x/Rdata.rdb": b"hello rdb"}
    assert deb_members(deb, ["./usr/lib/R/x/Rdata.rdb"]) == {"./usr/lib/R/x/Rdata.rdb": b"hello rdb"}
    with pytest.raises(ForgeError, match=r"missing \['usr/lib/R/x/Rdata.rdx'\]"):
        deb_members(deb, ["usr/lib/R/x/Rdata.rdx"])


@needs_dpkg_deb
def test_deb_members_not_a_deb(tmp_path):
    bad = tmp_path / "bad.deb"
    bad.write_bytes(b"not an archive")
    with pytest.raises(ForgeError, match="not a readable Debian package"):
        deb_members(bad, ["x"])


def test_deb_members_without_dpkg_deb_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(registries.shutil, "which", lambda name: None)
    with pytest.raises(ForgeError) as e:
        deb_members(tmp_path / "x.deb", ["x"])
    assert "needs `dpkg-deb`" in str(e.value) and "apt-get install dpkg" in str(e.value)


@needs_dpkg_deb
def test_extract_reflows_novels_in_manifest_order(tmp_path):
    rdx, rdb = _lazyload_db({"emma": ["EMMA", "", "Emma Woodhouse, handsome,", "clever,  and rich", None, "End."],
                             "persuasion": ["PERSUASION"]}, True)
    deb = _build_deb(tmp_path, {"usr/lib/R/x/Rdata.rdx": rdx, "usr/lib/R/x/Rdata.rdb": rdb}, "xz")
    entry = {"extract": {"rdx": "usr/lib/R/x/Rdata.rdx", "rdb": "usr/lib/R/x/Rdata.rdb",
                         "objects": ["persuasion", "emma"]}, "splits": {"eval": {}}}
    assert austen.extract(deb, entry) == {
        "eval": "PERSUASION\n\nEMMA\n\nEmma Woodhouse, handsome, clever, and rich\n\nEnd.\n"}
    entry["extract"]["objects"] = ["sanditon"]
    with pytest.raises(ForgeError, match="'sanditon' not in"):
        austen.extract(deb, entry)
