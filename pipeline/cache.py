"""Content-addressed artifact store.

Layout under the cache root (``FORGE_CACHE``, default ``~/.cache/forge/artifacts``)::

    entries/<key[:2]>/<key>/payload/...   the stage's artifact, immutable once committed
    entries/<key[:2]>/<key>/meta.json     key components, payload digest, metrics
    index/<recipe>/<stage>.json           components of the last build, for "why did this re-run"
    locks/<key>.lock                      one builder per key at a time
    tmp/                                  work in progress; never read as an entry

An entry exists only after an atomic rename of a complete temp dir, so a crash or kill leaves
nothing that looks valid. The payload digest is checked on every lookup (cheap via the stat
cache); a corrupted entry is moved aside and rebuilt. Failures are never written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from .env import atomic_write, cache_root, publish_dir
from .errors import ForgeError
from .hashing import sha256_json, tree_digest
from .status import Status


def default_root() -> Path:
    return cache_root()


def make_key(components: dict) -> str:
    """Full-width sha256 over canonical JSON of the key components."""
    return sha256_json(components)


class BadEntry(Exception):
    """An entry whose meta.json is missing, unreadable or not what forge writes."""


@dataclass
class Entry:
    key: str
    path: Path

    @property
    def payload(self) -> Path:
        return self.path / "payload"

    @property
    def meta(self) -> dict:
        return read_meta(self.path)


def read_meta(entry_dir: Path) -> dict:
    """An entry's meta.json as forge wrote it; BadEntry (never a JSON/OS error) for anything else."""
    try:
        meta = json.loads((entry_dir / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BadEntry(f"meta.json unreadable ({type(e).__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("payload_digest"), str) \
            or not isinstance(meta.get("components", {}), dict) or not isinstance(meta.get("metrics", {}), dict):
        raise BadEntry("meta.json is not a forge entry record")
    return meta


class ArtifactCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root or default_root())
        for sub in ("entries", "index", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def _entry_dir(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / key

    # ------------------------------------------------------------ lookup
    def get(self, key: str, verify: bool = True, use_stat_cache: bool = True) -> Entry | None:
        """The committed entry for ``key`` if present and intact; a corrupted one is quarantined.

        ``use_stat_cache=False`` re-reads every byte: for what leaves the cache (packaging, serving), where a
        change that kept size and mtime must still be caught.
        """
        d = self._entry_dir(key)
        if not (d / "meta.json").exists():
            return None
        try:
            meta = read_meta(d)
        except BadEntry as e:
            self._quarantine(d, str(e))
            return None
        try:
            ok = not verify or tree_digest(d / "payload", use_stat_cache) == meta["payload_digest"]
        except OSError as e:
            self._quarantine(d, f"payload unreadable: {e}")
            return None
        if not ok:
            self._quarantine(d, "payload digest mismatch")
            return None
        return Entry(key, d)

    def check(self, key: str) -> str:
        """'hit', 'miss' or 'corrupt' without changing anything (used by plan)."""
        d = self._entry_dir(key)
        if not (d / "meta.json").exists():
            return Status.MISS
        try:
            ok = tree_digest(d / "payload") == read_meta(d)["payload_digest"]
        except (OSError, BadEntry):
            ok = False
        return Status.HIT if ok else Status.CORRUPT

    def _quarantine(self, d: Path, why: str) -> None:
        dest = self.root / "tmp" / f"corrupt-{d.name}-{uuid.uuid4().hex[:8]}"
        with contextlib.suppress(OSError):
            os.replace(d, dest)
            (dest / "REASON").write_text(why + "\n")

    # ------------------------------------------------------------ writing
    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = -1) -> Iterator[None]:
        with FileLock(str(self.root / "locks" / f"{key}.lock"), timeout=timeout):
            yield

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[Path]:
        """Yield a fresh temp payload dir to fill and :meth:`commit` inside the block; on error (or without a
        commit) it is removed.

        The dir's lock (``tmp/<name>.lock``) is held while it exists, so a later run can tell a dir whose
        owner was killed (lock free: removed by :meth:`clean_stale_tmp`) from one being written now.
        """
        tmp = self.root / "tmp" / f"{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        lock = FileLock(str(tmp) + ".lock")
        lock.acquire()
        try:
            (tmp / "payload").mkdir(parents=True)
            try:
                yield tmp / "payload"
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if tmp.exists():        # ended without commit(): nothing to keep
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            lock.release()
            with contextlib.suppress(OSError):
                os.unlink(str(tmp) + ".lock")

    def clean_stale_tmp(self) -> int:
        """Remove temp dirs whose writer is gone (its lock is free): a killed or SIGTERMed run's leftovers."""
        removed = 0
        tmp = self.root / "tmp"
        try:
            locks = [p for p in tmp.iterdir() if p.name.endswith(".lock")]
        except OSError:
            return 0
        for lf in locks:
            d = lf.with_name(lf.name[: -len(".lock")])
            lock = FileLock(str(lf), timeout=0)
            try:
                lock.acquire()
            except Timeout:
                continue            # its writer is alive
            except OSError:
                continue
            try:
                if d.exists():
                    shutil.rmtree(d, ignore_errors=True)
                    removed += 1
            finally:
                lock.release()
                with contextlib.suppress(OSError):
                    os.unlink(lf)
        return removed

    def commit(self, key: str, payload: Path, components: dict, metrics: dict | None = None) -> Entry:
        tmp = payload.parent
        meta = {
            "key": key,
            "components": components,
            "payload_digest": tree_digest(payload),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "metrics": metrics or {},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        dest = self._entry_dir(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not publish_dir(tmp, dest) and self.get(key) is None:   # another run committed it first: keep theirs
            raise ForgeError(f"cache entry {key[:16]} was committed by another run but does not verify; "
                             "`forge cache verify` says more")
        return Entry(key, dest)

    # ------------------------------------------------------------ index (why did it change)
    def _index_file(self, recipe: str, stage: str) -> Path:
        return self.root / "index" / recipe / f"{stage}.json"

    def record(self, recipe: str, stage: str, key: str, components: dict) -> None:
        atomic_write(self._index_file(recipe, stage),
                     json.dumps({"key": key, "components": components}, sort_keys=True, default=str))

    def last(self, recipe: str, stage: str) -> dict | None:
        f = self._index_file(recipe, stage)
        try:
            return json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    # ------------------------------------------------------------ maintenance
    def entries(self) -> list[Entry]:
        """Committed entries (a dir with a meta.json); anything else under entries/ is left to verify_all."""
        out = []
        for d in sorted((self.root / "entries").glob("*/*")):
            with contextlib.suppress(OSError):
                if d.is_dir() and (d / "meta.json").is_file():
                    out.append(Entry(d.name, d))
        return out

    def verify_all(self) -> list[tuple[str, str]]:
        """Full re-hash of every entry (no stat cache); returns (key or path, problem) pairs. Never raises on
        garbage: an unreadable meta.json, a missing payload or a stray file is a problem in the list."""
        bad = []
        for d in sorted((self.root / "entries").glob("*/*")):
            name = d.name
            try:
                if not d.is_dir() or not (d / "meta.json").is_file():
                    bad.append((name, "not an entry (no meta.json): left over or foreign; remove it"))
                    continue
                meta = read_meta(d)
                if meta.get("key", name) != name:
                    bad.append((name, f"meta.json names another key ({str(meta.get('key'))[:16]}...)"))
                elif not (d / "payload").is_dir():
                    bad.append((name, "payload missing"))
                elif tree_digest(d / "payload", use_stat_cache=False) != meta["payload_digest"]:
                    bad.append((name, "payload digest mismatch"))
            except BadEntry as e:
                bad.append((name, str(e)))
            except OSError as e:
                bad.append((name, f"unreadable: {e.strerror or e}"))
        return bad

    def gc(self, keep: set[str] | None = None, older_than_s: float = 3600) -> dict:
        """Remove temp dirs of dead writers (at once) and other temp items older than ``older_than_s``, and,
        if ``keep`` is given, entries not in it."""
        removed_tmp = self.clean_stale_tmp()
        removed = 0
        now = time.time()
        for t in sorted((self.root / "tmp").iterdir()):
            try:
                if t.name.endswith(".lock") or now - t.lstat().st_mtime <= older_than_s:
                    continue
                if t.with_name(t.name + ".lock").exists():
                    continue        # a live writer's dir (a dead one's was removed above)
                shutil.rmtree(t) if t.is_dir() and not t.is_symlink() else t.unlink()
                removed_tmp += 1
            except OSError:
                continue
        if keep is not None:
            for e in self.entries():
                if e.key not in keep:
                    shutil.rmtree(e.path, ignore_errors=True)
                    removed += 1
        return {"removed_entries": removed, "removed_tmp": removed_tmp}

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "entries").rglob("*") if p.is_file())


def diff_components(old: dict | None, new: dict) -> list[str]:
    """Dotted paths of key components that differ (why a stage misses)."""
    if old is None:
        return ["never built"]
    out: list[str] = []

    def walk(a, b, prefix):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
        elif a != b:
            out.append(prefix)

    walk(old, new, "")
    return out
