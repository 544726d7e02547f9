"""A full disk, said plainly: recognise ENOSPC however a library wraps it, and check space before big writes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .host.files import free_bytes
from .errors import ForgeError

GB = 1e9
# Libraries that lose the errno: torch's stream writer ("file write failed"), onnx's external-data writer
# ("problem writing element"). Those count as a full disk only when the disk is in fact (nearly) full.
_WRITE_FAILURES = ("file write failed", "problem writing", "write error")
NEARLY_FULL = 64 * 2**20


class DiskFull(ForgeError):
    """Not enough space for a stage's output (found before it ran, or the write failed with ENOSPC)."""

    def __init__(self, message: str, path: Path | None = None):
        self.path = path
        super().__init__(message)


def disk_full(exc: BaseException, where: Path | None = None) -> DiskFull | OSError | Path | None:
    """The evidence that ``exc`` (or an exception it wraps) is a full disk, else None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFull):
            return e
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        text = str(e)
        if "No space left on device" in text or "ENOSPC" in text:
            return e if isinstance(e, OSError) else (where or Path("."))
        if where is not None and any(w in text for w in _WRITE_FAILURES):
            free = free_bytes(where)
            if free is not None and free < NEARLY_FULL:
                return where
        e = e.__cause__ or e.__context__
    return None


def _place(path: Path, cache_root: Path, home: Path) -> str:
    p = Path(path).absolute()
    for label, root in (("FORGE_CACHE", cache_root), ("FORGE_HOME", home)):
        if p == root or root in p.parents:
            return f"{label} at {root}"
    return f"the disk of {p}"


def written_path(evidence) -> Path | None:
    """The file whose write ran out of space: a failed copy or move (shutil.copyfile, os.rename) names its
    source in ``filename`` and its destination in ``filename2``, and only the destination is written."""
    if not isinstance(evidence, OSError):
        return None
    name = evidence.filename2 or evidence.filename
    return Path(os.fsdecode(name)) if isinstance(name, (str, bytes, os.PathLike)) else None


def no_space_message(evidence, cache_root: Path, home: Path, need: int | None) -> str:
    if isinstance(evidence, DiskFull):
        return str(evidence)
    path = written_path(evidence) or (evidence if isinstance(evidence, Path) else cache_root)
    free = free_bytes(path)
    have = f"{free / GB:.2f} GB free" if free is not None else "free space unknown"
    needs = f"the stage needs about {need / GB:.2f} GB" if need else "the stage's need is not known beforehand"
    return (f"no space left on {_place(path, cache_root, home)}: {have}, {needs}; free space "
            "(`forge cache gc --keep RECIPE` removes entries the named recipes' last builds do not use) "
            "or point FORGE_CACHE at a larger disk")


def check_free_space(where: Path, need: int | None, margin: float = 1.1) -> None:
    """Raise DiskFull when ``need`` bytes (times a margin) will not fit on the file system of ``where``."""
    if not need:
        return
    free = free_bytes(where)
    if free is not None and free < need * margin:
        raise DiskFull(f"not enough space on FORGE_CACHE at {Path(where).parent}: {free / GB:.2f} GB free, the stage "
                       f"needs about {need / GB:.2f} GB; free space (`forge cache gc --keep RECIPE` removes entries "
                       "the named recipes' last builds do not use) or point FORGE_CACHE at a larger disk", Path(where))
