"""Files: free disk space (``free_bytes``), and how a file or directory is published without a reader ever seeing
half of it (``atomic_write``, ``atomic_copy``, ``atomic_symlink``, ``publish_dir``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path


def free_bytes(path: Path) -> int | None:
    """Free space for an unprivileged writer on the file system holding ``path`` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


# ---------------------------------------------------------------- publishing files
@contextlib.contextmanager
def _beside(dest: Path):
    """A temp name beside ``dest`` to write to; on success it is renamed over ``dest``, always cleaned up."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write ``path`` through a temp file beside it and a rename: a reader sees the old or the new file, never
    half of one (and a crash leaves at most a stray ``.<name>.*.tmp``)."""
    with _beside(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())    # the rename must not publish a file whose bytes are still in flight
    return Path(path)


def atomic_copy(src: Path, dest: Path) -> Path:
    """Copy a file to ``dest`` through a temp file beside it and a rename."""
    with _beside(dest) as tmp:
        shutil.copy2(src, tmp)
    return Path(dest)


def atomic_symlink(dest: Path, target: str) -> Path:
    """Point the link ``dest`` at ``target`` (replacing what was there) through a temp link and a rename."""
    with _beside(dest) as tmp:
        tmp.symlink_to(target)
    return Path(dest)


def publish_dir(tmp: Path, final: Path) -> bool:
    """Rename a finished temp directory to ``final`` (same file system). False when another process published
    ``final`` first (then ``tmp`` is removed and theirs is kept)."""
    try:
        os.rename(tmp, final)
        return True
    except OSError:
        if not Path(final).is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
