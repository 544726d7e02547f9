"""The R XDR serialisation reader, on hand-built streams (what R's serialize() writes)."""

from __future__ import annotations

import gzip
import io
import lzma
import struct
import tarfile
import zlib

import pytest

from pipeline.data import deb_members, r_named, r_unserialize, read_lazyload_db
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


def strsxp(items, attr=b""):
    flags = 16 | (512 if attr else 0)
    return I(flags) + I(len(items)) + b"".join(charsxp(*x) if isinstance(x, tuple) else charsxp(x) for x in items) + attr


def names_attr(names, sym=None):
    # pairlist cell with tag: flags LISTSXP | has_tag; tag = SYMSXP (or a REFSXP to it); car; cdr = NILVALUE
    tag = sym if sym is not None else I(1) + charsxp("names", 64)
    return I(2 | 1024) + tag + strsxp(names) + I(254)


@pytest.mark.parametrize("version", [2, 3])
def test_character_vector_with_na_and_encodings(version):
    data = header(version) + strsxp(["It is a truth", None, ("Mrs. Bennet – née", 8), ("café", 4), ""])
    assert r_unserialize(data) == ["It is a truth", None, "Mrs. Bennet – née", "café", ""]


def test_gzip_rds_and_named_list_with_symbol_reference():
    # list(a = c(1L, NA), b = "x") with a names attribute; a second names attribute refers back to the symbol
    ints = I(13) + I(2) + I(1) + I(-(2 ** 31))
    inner = strsxp(["x"], attr=names_attr(["only"]))                       # defines the symbol `names`
    vec = I(19 | 512) + I(2) + ints + inner + names_attr(["a", "b"], sym=I((1 << 8) | 255))  # REFSXP 1 -> `names`
    obj = r_unserialize(gzip.compress(header() + vec))
    d = r_named(obj)
    assert d["a"] == [1, None] and d["b"] == ["x"] and d["b"].attrs == {"names": ["only"]}


def test_reals_logicals_and_long_length_marker():
    body = I(14) + I(2) + struct.pack(">2d", 0.5, -2.0)
    assert r_unserialize(header() + body) == [0.5, -2.0]
    assert r_unserialize(header() + I(10) + I(3) + I(1) + I(0) + I(-(2 ** 31))) == [True, False, None]
    long_len = I(16) + I(-1) + I(0) + I(1) + charsxp("x")   # length -1 -> two ints (hi, lo)
    assert r_unserialize(header() + long_len) == ["x"]


def test_rejects_what_it_cannot_read():
    with pytest.raises(ForgeError, match="XDR"):
        r_unserialize(b"A\n3\n")
    with pytest.raises(ForgeError, match="SEXP type 4"):
        r_unserialize(header() + I(4) + I(0))                 # environments are not supported
    with pytest.raises(ForgeError, match="truncated"):
        r_unserialize(header() + I(16) + I(2) + charsxp("x"))


def test_lazyload_database_roundtrip():
    """An .rdx index (gzip'd named list) pointing at zlib blocks in an .rdb, as R's makeLazyLoadDB writes."""
    blocks, offsets = b"", []
    for vec in (["line one", "line two"], ["Emma Woodhouse"]):
        ser = header() + strsxp(vec)
        blk = struct.pack(">I", len(ser)) + zlib.compress(ser)
        offsets.append((len(blocks), len(blk)))
        blocks += blk
    pos = lambda o: I(13) + I(2) + I(o[0]) + I(o[1])  # noqa: E731
    variables = I(19 | 512) + I(2) + pos(offsets[0]) + pos(offsets[1]) + names_attr(["book1", "book2"])
    index = I(19 | 512) + I(3) + variables + I(19) + I(0) + I(10) + I(1) + I(1) \
        + names_attr(["variables", "references", "compressed"])
    objs = read_lazyload_db(gzip.compress(header() + index), blocks)
    assert objs == {"book1": ["line one", "line two"], "book2": ["Emma Woodhouse"]}


def test_deb_members_reads_ar_and_xz_tar(tmp_path):
    tbuf = io.BytesIO()
    with tarfile.open(fileobj=tbuf, mode="w") as tar:
        payload = b"hello rdb"
        ti = tarfile.TarInfo("./usr/lib/R/x/Rdata.rdb")
        ti.size = len(payload)
        tar.addfile(ti, io.BytesIO(payload))
    data = lzma.compress(tbuf.getvalue())

    def member(name, blob):
        hdr = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(blob):<10}`\n".encode()
        return hdr + blob + (b"\n" if len(blob) % 2 else b"")

    deb = tmp_path / "x.deb"
    deb.write_bytes(b"!<arch>\n" + member("debian-binary", b"2.0\n") + member("control.tar.xz", b"c")
                    + member("data.tar.xz", data))
    assert deb_members(deb, ["usr/lib/R/x/Rdata.rdb"]) == {"usr/lib/R/x/Rdata.rdb": b"hello rdb"}
    with pytest.raises(ForgeError, match="missing"):
        deb_members(deb, ["usr/lib/R/x/Rdata.rdx"])
