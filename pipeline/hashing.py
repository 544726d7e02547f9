"""Content digests: canonical JSON keys and file/tree hashing with a stat cache.

Large weights are hashed once: the stat cache maps (path, size, mtime_ns, inode) to sha256,
so a no-op build does not re-read gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from pathlib import Path

_CHUNK = 1 << 20
_lock = threading.Lock()


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def sha256_json(obj) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stat_db() -> sqlite3.Connection | None:
    from .host.paths import forge_home
    home = forge_home()
    try:
        home.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(home / "statcache.sqlite", timeout=30)
        db.execute("CREATE TABLE IF NOT EXISTS stat (path TEXT PRIMARY KEY, size INT, mtime INT, inode INT, sha TEXT)")
        return db
    except (OSError, sqlite3.Error):
        return None


def _hash_file_raw(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | Path, use_stat_cache: bool = True) -> str:
    """sha256 of a file's bytes; reuses a previous result while size, mtime and inode are unchanged."""
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    db = _stat_db() if use_stat_cache and st.st_size >= _CHUNK else None
    if db is not None:
        with _lock:
            row = db.execute("SELECT sha FROM stat WHERE path=? AND size=? AND mtime=? AND inode=?", key).fetchone()
        if row:
            db.close()
            return row[0]
    digest = _hash_file_raw(path)
    if db is not None:
        with _lock:
            try:
                db.execute("INSERT OR REPLACE INTO stat VALUES (?,?,?,?,?)", (*key, digest))
                db.commit()
            except sqlite3.Error:
                pass
        db.close()
    return digest


def tree_files(root: str | Path) -> list[Path]:
    root = Path(root)
    return sorted(p for p in root.rglob("*") if p.is_file())


def tree_listing(root: str | Path, use_stat_cache: bool = True) -> dict[str, str]:
    """``{relative posix path: sha256}`` of every file under ``root``."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): file_digest(p, use_stat_cache) for p in tree_files(root)}


def empty_dirs(root: str | Path) -> list[str]:
    """Relative posix paths of the directories under ``root`` that hold nothing (an object store keeps no object
    for them, so they are recorded and recreated: a Triton model's version folder ``ensemble/1/`` is one)."""
    root = Path(root)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_dir() and not p.is_symlink() and not any(p.iterdir()))


DIR_MARK = "dir"    # an empty directory in a listing: "<rel>/": "dir" (a file's relative path never ends in "/")


def listing_digest(listing: dict[str, str], dirs: list[str] | tuple = ()) -> str:
    """The tree digest of a :func:`tree_listing` plus its :func:`empty_dirs` (what :func:`tree_digest` returns for
    a directory). A tree without empty directories has the digest it had before they were counted."""
    return sha256_json({**listing, **{f"{d}/": DIR_MARK for d in dirs}})


def tree_digest(root: str | Path, use_stat_cache: bool = True) -> str:
    """Digest over relative paths and file digests of every file under ``root``, and its empty directories (or
    of one file)."""
    root = Path(root)
    if root.is_file():
        return file_digest(root, use_stat_cache)
    return listing_digest(tree_listing(root, use_stat_cache), empty_dirs(root))
