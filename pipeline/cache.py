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

from filelock import FileLock

from .env import cache_root
from .hashing import sha256_json, tree_digest


def default_root() -> Path:
    return cache_root()


def make_key(components: dict) -> str:
    """Full-width sha256 over canonical JSON of the key components."""
    return sha256_json(components)


@dataclass
class Entry:
    key: str
    path: Path

    @property
    def payload(self) -> Path:
        return self.path / "payload"

    @property
    def meta(self) -> dict:
        return json.loads((self.path / "meta.json").read_text())


class ArtifactCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root or default_root())
        for sub in ("entries", "index", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def _entry_dir(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / key

    # ------------------------------------------------------------ lookup
    def get(self, key: str, verify: bool = True, use_stat_cache: bool = True) -> Entry | None:
        """The committed entry for ``key`` if present and intact; a corrupted one is quarantined."""
        d = self._entry_dir(key)
        meta_file = d / "meta.json"
        if not meta_file.exists():
            return None
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, json.JSONDecodeError):
            self._quarantine(d, "unreadable meta.json")
            return None
        if verify and tree_digest(d / "payload", use_stat_cache) != meta.get("payload_digest"):
            self._quarantine(d, "payload digest mismatch")
            return None
        return Entry(key, d)

    def check(self, key: str) -> str:
        """'hit', 'miss' or 'corrupt' without changing anything (used by plan)."""
        d = self._entry_dir(key)
        if not (d / "meta.json").exists():
            return "miss"
        try:
            meta = json.loads((d / "meta.json").read_text())
            ok = tree_digest(d / "payload") == meta.get("payload_digest")
        except (OSError, json.JSONDecodeError):
            ok = False
        return "hit" if ok else "corrupt"

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
        """Yield a fresh temp payload dir; on clean exit it is committed atomically, on error removed."""
        tmp = self.root / "tmp" / f"{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        (tmp / "payload").mkdir(parents=True)
        try:
            yield tmp / "payload"
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

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
        try:
            os.rename(tmp, dest)
        except OSError:
            # another run committed the same key first: keep theirs if intact
            shutil.rmtree(tmp, ignore_errors=True)
            if self.get(key) is None:
                raise
        return Entry(key, dest)

    # ------------------------------------------------------------ index (why did it change)
    def _index_file(self, recipe: str, stage: str) -> Path:
        return self.root / "index" / recipe / f"{stage}.json"

    def record(self, recipe: str, stage: str, key: str, components: dict) -> None:
        f = self._index_file(recipe, stage)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps({"key": key, "components": components}, sort_keys=True, default=str))
        os.replace(tmp, f)

    def last(self, recipe: str, stage: str) -> dict | None:
        f = self._index_file(recipe, stage)
        try:
            return json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    # ------------------------------------------------------------ maintenance
    def entries(self) -> list[Entry]:
        return [Entry(d.name, d) for d in sorted((self.root / "entries").glob("*/*")) if (d / "meta.json").exists()]

    def verify_all(self) -> list[tuple[str, str]]:
        """Full re-hash of every entry (no stat cache); returns (key, problem) pairs."""
        bad = []
        for e in self.entries():
            try:
                if tree_digest(e.payload, use_stat_cache=False) != e.meta.get("payload_digest"):
                    bad.append((e.key, "payload digest mismatch"))
            except OSError as err:
                bad.append((e.key, str(err)))
        return bad

    def gc(self, keep: set[str] | None = None, older_than_s: float = 3600) -> dict:
        """Remove stale temp dirs (older than ``older_than_s``) and, if ``keep`` is given, entries not in it."""
        removed_tmp = removed = 0
        now = time.time()
        for t in (self.root / "tmp").iterdir():
            if now - t.stat().st_mtime > older_than_s:
                shutil.rmtree(t, ignore_errors=True)
                removed_tmp += 1
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
