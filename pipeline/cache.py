"""Content-addressed artifact store.

Layout under the cache root (``FORGE_CACHE``, default ``~/.cache/forge/artifacts``)::

    entries/<key[:2]>/<key>/payload/...   the stage's artifact, immutable once committed
    entries/<key[:2]>/<key>/meta.json     key components, payload digest (files and empty folders), metrics, dirs
    index/<recipe>/<stage>.json           components of the last build, for "why did this re-run"
    locks/<key>.lock                      one builder per key at a time
    tmp/                                  work in progress; never read as an entry

An entry exists only after an atomic rename of a complete temp dir, so a crash or kill leaves
nothing that looks valid. The payload digest is checked on every lookup (cheap via the stat
cache); a corrupted entry is moved aside and rebuilt. Failures are never written.

With a shared store (``FORGE_CACHE=s3://bucket/prefix``, :mod:`pipeline.remote_cache`) this directory
(``FORGE_HOME/artifacts``) is a read-through layer in front of it: a miss here that the store has is downloaded
once, verified and committed here; an entry committed here is published to the store first (and a local hit
the store lacks is published then), so every machine sharing the bucket sees every build. The runner downloads an
entry only when it is needed here (:meth:`ArtifactCache.locate` finds it without downloading): a stage that runs
reads its inputs, and a build's outputs (the package) are fetched; a hit nothing here reads stays in the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from .host.files import atomic_write, publish_dir
from .host.paths import cache_root, remote_cache_url
from .errors import ForgeError
from .hashing import empty_dirs, sha256_json, tree_digest
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
    source: str = "local"       # where it was found: "local" (this layer) or the shared store's URL (downloaded now)

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


def open_cache(offline: bool = False) -> "ArtifactCache":
    """The cache ``FORGE_CACHE`` names: a local directory, or a shared store (s3://, gs://, az://) behind the local
    layer under FORGE_HOME, checked to be reachable now (RemoteError naming the URL and the fix otherwise).
    ``offline``: the local layer only, even when FORGE_CACHE names a shared store (--cache-offline)."""
    url = remote_cache_url()
    if url is None or offline:
        return ArtifactCache()
    from .remote_cache import RemoteStore
    remote = RemoteStore(url)
    remote.probe()
    return ArtifactCache(remote=remote)


@dataclass
class Found:
    """An entry found without downloading it (:meth:`ArtifactCache.locate`): ``entry`` is set when it is in this
    layer; otherwise it is in the shared store at ``source`` and :meth:`ArtifactCache.get` downloads it."""
    key: str
    meta: dict
    source: str
    entry: Entry | None = None

    def origin(self) -> dict:
        """Where a hit's output came from, as report.json says it (``stages[].origin``): this machine's local
        layer, or the shared store (``fetched`` once it is downloaded here; ``built_by``: the host that published
        it)."""
        if self.source == "local":
            return {"how": "local", "host": socket.gethostname()}
        return {"how": "shared", "store": self.source, "fetched": False,
                "built_by": (self.meta.get("publisher") or {}).get("host")}


class ArtifactCache:
    def __init__(self, root: Path | None = None, remote=None):
        self.root = Path(root or default_root())
        self.remote = remote            # a pipeline.remote_cache.RemoteStore, or None (local only)
        self.notes: dict[str, str] = {}  # key -> what happened to the shared store's entry (said in the result)
        self.set_aside: set[str] = set()  # keys whose shared entry this process set aside (they did not verify)
        self.bad_blobs: set[str] = set()  # blobs (sha256) this process found missing or wrong in the shared store
        for sub in ("entries", "index", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @property
    def location(self) -> str:
        return f"{self.remote.url} (local layer {self.root})" if self.remote else str(self.root)

    def _entry_dir(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / key

    # ------------------------------------------------------------ lookup
    def get(self, key: str, verify: bool = True, use_stat_cache: bool = True, fetch: bool = True) -> Entry | None:
        """The committed entry for ``key`` if present and intact; a corrupted one is quarantined.

        ``use_stat_cache=False`` re-reads every byte: for what leaves the cache (packaging, serving), where a
        change that kept size and mtime must still be caught. With a shared store (unless ``fetch=False``): a
        local miss the store has is downloaded, verified and kept here; a local hit the store lacks is published.
        """
        entry = self._get_local(key, verify, use_stat_cache)
        if self.remote is None or not fetch:
            return entry
        if entry is not None:
            self._ensure_published(entry)
            return entry
        return self._fetch(key)

    def locate(self, key: str, use_stat_cache: bool = True) -> Found | None:
        """The intact entry of ``key`` here (published to the shared store if it lacks it), or the shared store's
        record of it, without downloading anything; None when neither has it. A corrupt local entry is set aside."""
        entry = self._get_local(key, True, use_stat_cache)
        if entry is not None:
            if self.remote is not None:
                self._ensure_published(entry)
            return Found(key, entry.meta, "local", entry)
        if self.remote is None:
            return None
        rec = self.remote.record(key)
        return Found(key, rec, self.remote.url) if rec is not None else None

    def _get_local(self, key: str, verify: bool = True, use_stat_cache: bool = True) -> Entry | None:
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
        return self.lookup(key)[0]

    def lookup(self, key: str) -> tuple[str, dict | None, str]:
        """(status, meta, where) without downloading anything: 'hit' with the entry's meta and where it is ('local'
        or the shared store's URL), else 'miss' / 'corrupt' (local) with None. A shared entry is a hit when its
        record exists (its bytes are verified when it is downloaded)."""
        d = self._entry_dir(key)
        state = Status.MISS
        if (d / "meta.json").exists():
            try:
                meta = read_meta(d)
                if tree_digest(d / "payload") == meta["payload_digest"]:
                    return Status.HIT, meta, "local"
            except (OSError, BadEntry):
                pass
            state = Status.CORRUPT
        if self.remote is not None:
            rec = self.remote.record(key)
            if rec is not None:
                return Status.HIT, rec, self.remote.url
        return state, None, ""

    # ------------------------------------------------------------ the shared store
    def _fetch(self, key: str) -> Entry | None:
        """Download the shared store's entry into this layer (one process per key at a time), verified."""
        from .remote_cache import BadRemoteEntry
        rec = self.remote.record(key)
        if rec is None:
            return None
        with FileLock(str(self.root / "locks" / f"{key}.fetch.lock")):
            entry = self._get_local(key)
            if entry is not None:       # another process on this machine fetched it meanwhile
                return entry
            with self.writer(key) as out:
                try:
                    self.remote.fetch(key, rec, out)
                except BadRemoteEntry as e:
                    self._set_aside_remote(key, rec, e)
                    return None
                entry = self._commit_local(key, out, rec)
                entry.source = self.remote.url
                return entry

    def _set_aside_remote(self, key: str, rec: dict, e) -> None:
        """The shared entry ``key`` did not verify: set it aside, and with it every other record this process knows
        that names one of its bad blobs (this run would trip over each of them next, one at a time)."""
        self.remote.discard(key, str(e), expect=rec)
        self.set_aside.add(key)
        self.notes[key] = f"the shared cache's entry did not verify ({e}): set aside in {self.remote.url}/quarantine/"
        self.bad_blobs |= e.blobs
        self.set_aside_naming(e.blobs, f"{key[:16]}, {e}")

    def set_aside_naming(self, blobs, found: str) -> set[str]:
        """Set aside every shared record this process knows that names one of these bad blobs (``found``: where
        they were found bad, and why). Returns their keys."""
        out = set()
        for key, rec in self.remote.known_naming(blobs).items():
            if key in self.set_aside:
                continue
            self.remote.discard(key, f"names a blob that did not verify in {found}", expect=rec)
            self.set_aside.add(key)
            self.notes[key] = (f"set aside in {self.remote.url}/quarantine/: it names a blob that did not verify "
                               f"in {found}")
            out.add(key)
        return out

    def _ensure_published(self, entry: Entry) -> None:
        """A local entry the shared store lacks (built offline, or set aside there) is published now."""
        if self.remote.has(entry.key):
            return
        meta = entry.meta
        won, rec = self.remote.publish(entry.key, entry.payload, meta)
        if not won and rec["payload_digest"] != meta["payload_digest"]:
            self._quarantine(entry.path, "another machine published other bytes for this key first")
            self._fetch(entry.key)

    def _commit_local(self, key: str, payload: Path, meta: dict) -> Entry:
        tmp = payload.parent
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        dest = self._entry_dir(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not publish_dir(tmp, dest) and self._get_local(key) is None:   # another run committed it first: keep theirs
            raise ForgeError(f"cache entry {key[:16]} was committed by another run but does not verify; "
                             "`forge cache verify` says more")
        return Entry(key, dest)

    def discard(self, key: str, why: str) -> None:
        """Remove the entry of ``key`` from this layer and the shared store (--force rebuilds it)."""
        d = self._entry_dir(key)
        if d.exists():
            aside = self.root / "tmp" / f"replaced-{key[:16]}-{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(OSError):
                os.replace(d, aside)
                shutil.rmtree(aside, ignore_errors=True)
        if self.remote is not None:
            self.remote.discard(key, why)

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
        """Make the filled temp payload the entry of ``key``: published to the shared store first (when there is
        one), then renamed into place here. If another machine's entry for the key came first with other bytes,
        that entry replaces ours here too, so every machine builds on the same digest."""
        meta = {
            "key": key,
            "components": components,
            "payload_digest": tree_digest(payload),
            "dirs": empty_dirs(payload),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "metrics": metrics or {},
        }
        if self.remote is not None:
            won, rec = self.remote.publish(key, payload, meta)
            if not won and rec["payload_digest"] != meta["payload_digest"]:
                rec = self._adopt(key, payload, rec, meta)
            meta = rec
        return self._commit_local(key, payload, meta)

    def _adopt(self, key: str, payload: Path, rec: dict, meta: dict) -> dict:
        """Another machine's record of ``key`` came first with other bytes: its payload replaces ours in
        ``payload``, so every machine builds on one digest. If it does not verify, it is set aside and ours is
        published in its place. Returns the record the entry is committed with."""
        from .remote_cache import BadRemoteEntry
        theirs = payload.parent / "theirs"
        theirs.mkdir()
        try:
            self.remote.fetch(key, rec, theirs)
        except BadRemoteEntry as e:
            shutil.rmtree(theirs, ignore_errors=True)
            self._set_aside_remote(key, rec, e)
            won, mine = self.remote.publish(key, payload, meta)
            if won or mine["payload_digest"] == meta["payload_digest"]:
                self.notes[key] = f"another machine's entry came first but did not verify ({e}): ours replaced it"
                return mine
            raise ForgeError(f"another machine published {key[:16]} first, twice, and the first did not verify ({e}): "
                             f"run the build again") from None
        shutil.rmtree(payload)
        theirs.rename(payload)
        self.notes[key] = "another machine published this key first: its entry is used"
        return rec

    # ------------------------------------------------------------ index (why did it change)
    def _index_file(self, recipe: str, stage: str) -> Path:
        return self.root / "index" / recipe / f"{stage}.json"

    def record(self, recipe: str, stage: str, key: str, components: dict) -> None:
        atomic_write(self._index_file(recipe, stage),
                     json.dumps({"key": key, "components": components}, sort_keys=True, default=str))
        if self.remote is not None:
            self.remote.write_index(recipe, stage, {"key": key, "components": components})

    def last(self, recipe: str, stage: str) -> dict | None:
        f = self._index_file(recipe, stage)
        try:
            return json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            return self.remote.read_index(recipe, stage) if self.remote is not None else None

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
                    gone = [f for f in meta.get("dirs", []) if not (d / "payload" / f).is_dir()]
                    bad.append((name, f"empty folder {gone[0]}/ missing" if gone else "payload digest mismatch"))
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
