"""lab/late_stream.sh: the GPU lab scripts' big files, cut into parts and carved back whole (and not before)."""

import hashlib
import os
import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "late_stream.sh"


def sh(script: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f". {LIB}\nlate_files() {{ echo a.bin b.bin c.bin; }}\n{script}"],
                          cwd=cwd, capture_output=True, text=True)


def test_pack_then_carve_gives_every_file_back_and_refuses_a_partial_one(tmp_path):
    wh, d = tmp_path / "wh", tmp_path / "d"
    wh.mkdir(); (d / "c1").mkdir(parents=True)
    blobs = {n: os.urandom(sz) for n, sz in (("a.bin", 2500), ("b.bin", 7000), ("c.bin", 10))}
    for n, b in blobs.items():
        (wh / n).write_bytes(b)
    (d / "c1" / "small.txt").write_bytes(b"x" * 1000)           # c1 carries other things: its spare room comes first
    cap = 16384
    blobs["b.bin"] = os.urandom(3 * cap)
    (wh / "b.bin").write_bytes(blobs["b.bin"])
    p = sh(f'late_pack {d} {wh} {cap} {tmp_path}/late.bin 2', tmp_path)
    assert p.returncode == 0, p.stderr
    parts = sorted(d.glob("c*/late.p*"))
    assert [x.parent.name for x in parts][:2] == ["c1", "c2"] and len(parts) >= 3
    c1 = subprocess.run(["du", "-sb", str(d / "c1")], capture_output=True, text=True).stdout.split()[0]
    assert int(c1) <= cap and all(x.stat().st_size <= cap for x in parts)     # every call's carry within the cap
    assert sum(x.stat().st_size for x in parts) == sum(map(len, blobs.values()))
    carry, out = tmp_path / "carry", tmp_path / "out"
    carry.mkdir(); out.mkdir()
    (carry / "late.manifest").write_bytes((d / "c1" / "late.manifest").read_bytes())
    (carry / "late.p00").write_bytes(parts[0].read_bytes())      # only the first part has come
    assert sh(f"late_carve b.bin {out} {carry}", tmp_path).returncode != 0
    for x in parts[1:]:
        (carry / x.name).write_bytes(x.read_bytes())
    for n, b in blobs.items():
        assert sh(f"late_carve {n} {out} {carry}", tmp_path).returncode == 0
        assert hashlib.sha256((out / n).read_bytes()).digest() == hashlib.sha256(b).digest()


def test_pack_names_a_missing_file(tmp_path):
    (tmp_path / "d" / "c1").mkdir(parents=True); (tmp_path / "wh").mkdir()
    p = sh(f"late_pack {tmp_path}/d {tmp_path}/wh 4096 {tmp_path}/late.bin 2", tmp_path)
    assert p.returncode != 0 and "missing" in p.stderr and "a.bin" in p.stderr
