"""A full disk names the disk that is full (issue 24): a copy that runs out of space names its destination's
file system (FORGE_CACHE) and that file system's free space, not the disk its source lies on."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from pipeline import diskspace
from pipeline.diskspace import disk_full, no_space_message


def _copy_fails_with_enospc(monkeypatch, src: Path, dst: Path) -> OSError:
    """shutil.copyfile's own ENOSPC (it sets filename = source, filename2 = destination, shutil.py), faked at
    the kernel call so no disk has to be filled."""
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "sendfile", full)          # Linux: shutil copies with sendfile
    monkeypatch.setattr(shutil, "_USE_CP_SENDFILE", True)
    with pytest.raises(OSError) as e:
        shutil.copyfile(src, dst)
    return e.value


def test_a_full_copy_names_the_destination_disk(tmp_path, monkeypatch):
    home, cache = tmp_path / "home", tmp_path / "shared-cache"
    (home / "models").mkdir(parents=True)
    (cache / "tmp").mkdir(parents=True)
    src = home / "models" / "model.onnx"
    src.write_bytes(b"x" * 100)
    e = _copy_fails_with_enospc(monkeypatch, src, cache / "tmp" / "model.onnx")
    assert Path(e.filename) == src                     # what misled the old message
    free = {cache / "tmp" / "model.onnx": 2.5e6, src: 31.09e9}
    monkeypatch.setattr(diskspace, "free_bytes", lambda p: free[Path(p)])
    evidence = disk_full(e, cache / "tmp")
    msg = no_space_message(evidence, cache, home, None)
    assert msg.startswith(f"no space left on FORGE_CACHE at {cache}: 0.00 GB free"), msg
    assert "31.09" not in msg and "FORGE_HOME" not in msg, msg


def test_a_full_write_without_a_file_name_names_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(diskspace, "free_bytes", lambda p: 1.5e9 if Path(p) == cache else None)
    msg = no_space_message(disk_full(OSError(errno.ENOSPC, "No space left on device")), cache, tmp_path / "h", 2e9)
    assert msg.startswith(f"no space left on FORGE_CACHE at {cache}: 1.50 GB free, the stage needs about 2.00 GB")
