"""The shared artifact store on object storage, behind the local cache (``FORGE_CACHE=s3://bucket/prefix``).

One code path for every fsspec object store that can create an object only if it is absent, server-side:

=========  ==========  ====================================================================================
scheme     package     conditional create used by ``fs.pipe_file(path, data, mode="create")``
=========  ==========  ====================================================================================
s3://      s3fs        ``PutObject(IfNoneMatch="*")`` (s3fs/core.py ``_pipe_file``, s3fs >= 2025.7.0; exclusive
                       write arrived in 2024.12.0 (#917), fixed for small objects in 2025.7.0 (#974)). A refusal
                       is HTTP 412 PreconditionFailed: s3fs/errors.py ``translate_boto_error`` makes it
                       FileExistsError when the error names ``Condition: If-None-Match`` (AWS), else
                       OSError(EINVAL) (SeaweedFS 4.48 sends no Condition): both are handled below.
gs://      gcsfs       upload with ``ifGenerationMatch=0`` (gcsfs/core.py ``simple_upload``/``initiate_upload``
                       ``kw = {"ifGenerationMatch": "0"} if mode == "create"``; 412 -> FileExistsError in
                       gcsfs/retry.py ``validate_response``), fsspec/gcsfs@20c58d0. gcsfs calls it experimental.
az://      adlfs       ``upload_blob(overwrite=False)`` (adlfs/spec.py ``_pipe_file``, fsspec/adlfs@6362b4f), which
                       azure-storage-blob sends as ``If-None-Match: *`` (azure/storage/blob/_upload_helpers.py
                       ``upload_block_blob``); ResourceExistsError -> FileExistsError.
=========  ==========  ====================================================================================

Other fsspec protocols are refused: fsspec's generic ``pipe_file(mode="create")`` checks ``exists()`` and then
writes (fsspec/spec.py), which is not atomic across machines. A shared POSIX directory needs none of this: set
``FORGE_CACHE=/shared/dir`` and the local cache's rename-based commit serves every machine that mounts it.

Layout under ``<scheme>://<bucket>/<prefix>`` (record format 2, content-addressed)::

    blobs/<s[:2]>/<s>                        a file's bytes, named by their sha256 <s>: stored once for every
                                             entry that holds them (an FP32 model that export, a no-op quantize,
                                             build and package all carry is one object)
    entries/<k[:2]>/<k>.json                 the entry record: meta.json fields, ``files`` {path: sha256, size}
                                             and ``dirs`` (empty folders, which an object store cannot hold)
    index/<recipe>/<stage>.json              the last key built for a recipe's stage (gc --keep, plan's "why")
    quarantine/<k>.<time>.json               records set aside because their payload did not verify
    quarantine/blobs/<s>.json                a blob found with bytes that are not its name (the next publisher
                                             of those bytes uploads them over it)
    objects/<k[:2]>/<k>/<upload>/<file>...   format 1 (before blobs): read and verified as before, never written

Publishing (``publish``): upload the blobs the store lacks, holds with another size (truncated) or has marked
bad, then create the record with the conditional create.
The record is one small object written in one request, so a reader sees either no entry or a complete one; a
blob no record names (publisher killed, lost race with other bytes) is never read and ``gc`` removes it once it
is older than the grace period. Two publishers of one key: the first record wins; the second adopts the winner's
entry (its own bytes may differ if the stage is not bit-reproducible; the winner's digest is what every machine
then builds on). Blobs are never deleted by a publisher: another record may name the same bytes. A blob is only
ever written with the bytes its name says, so two machines that re-upload one race harmlessly.

Reading (``fetch``): download the blobs the record names (each distinct one once), recreate its empty folders,
check each file's sha256, the folder list and the tree digest; anything else is a bad entry (BadRemoteEntry names
the missing or wrong blobs), which the caller sets aside (``discard``) together with every record it knows that
names one of those blobs, and rebuilds. A blob with wrong bytes is marked bad rather than deleted: a delete could
land after another machine had already re-uploaded the right bytes. ``discard`` leaves a record that is not the
one found bad (rebuilt by another machine meanwhile). A ``gc`` that removes a blob while a publisher counts on it
makes that entry bad the same way: set aside and rebuilt, never served.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

from .errors import ForgeError, UsageError
from .hashing import empty_dirs, listing_digest, tree_listing

# scheme -> (fsspec protocol, the package that implements it, the pip extra that installs it)
SCHEMES = {
    "s3": ("s3", "s3fs", "s3"), "s3a": ("s3", "s3fs", "s3"),
    "gs": ("gs", "gcsfs", "gcs"), "gcs": ("gs", "gcsfs", "gcs"),
    "az": ("az", "adlfs", "azure"), "abfs": ("abfs", "adlfs", "azure"), "abfss": ("abfs", "adlfs", "azure"),
}
RECORD_FORMAT = 2                # 2: content-addressed blobs/ and empty folders (1: objects/<k>/<upload>/)
ORPHAN_GRACE_S = 24 * 3600      # an upload without a record may still be in flight this long (gc leaves it)
OFFLINE_HINT = "or build with the local cache only: --cache-offline"
_CONNECTION_ERRORS = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError",
                      "ClientConnectorError", "ClientConnectionError", "ServerDisconnectedError", "ServiceRequestError",
                      "ServiceResponseError", "TransportError", "ProxyConnectionError", "ClientOSError",
                      # the connection broke in the middle of a response body (the server died mid-download)
                      "ClientPayloadError", "IncompleteReadError", "ResponseStreamingError"}
_CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                      "DefaultCredentialsError", "ClientAuthenticationError", "RefreshError"}


log = logging.getLogger(__name__)


def quiet_orphaned_io_errors(loop) -> None:
    """Keep a dead connection's leftovers off stderr on the event loop that runs the store's calls (fsspec's IO
    loop: s3fs, gcsfs and adlfs run every request there).

    The cause is in aiohttp (3.14.5, aiohttp/client_reqrep.py): a request with a body writes it from a task of
    its own, ``ClientRequest.write_bytes``. When the connection dies under it (the server killed, a reset) while
    it sends the ``Expect: 100-continue`` preamble (botocore/handlers.py ``add_expect_header`` asks for one on
    every S3 PUT of a file body) or the final chunk, the task ends with that error outside the handlers that hand
    it to the response. The response fails too (that error is what s3fs raises and forge reports in one line),
    and ``ClientResponse._cleanup_writer`` then cancels the writer task, which does nothing to a finished task:
    its error is never retrieved, and asyncio prints it with a traceback when the task is collected ("Task
    exception was never retrieved"; aio-libs/aiohttp PRs #13427 and #13579, open, discuss this path). Such a
    connection error on this loop is logged at debug level here; anything else goes to the handler that was
    there."""
    before = loop.get_exception_handler()
    if getattr(before, "forge_quiet", False):
        return
    try:
        from aiohttp import ClientError
    except ImportError:             # gcsfs and adlfs use aiohttp too; without it only OSError can be left over
        ClientError = OSError      # noqa: N806

    def handler(loop, context):
        exc = context.get("exception")
        if "never retrieved" in str(context.get("message", "")) and isinstance(exc, (OSError, ClientError)):
            log.debug("a store request's connection error, already reported by the request: %r", exc)
            return
        if before is not None:
            before(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.forge_quiet = True
    loop.set_exception_handler(handler)


class RemoteError(ForgeError):
    """The shared store cannot be used (unreachable, denied, no such bucket); the message names the URL and the fix."""


class BadRemoteEntry(Exception):
    """A record whose payload does not verify (missing object, wrong bytes, garbled record). ``blobs``: the sha256
    of each blob found missing or wrong (every record naming one of them is as bad)."""

    def __init__(self, message: str, blobs=()):
        super().__init__(message)
        self.blobs = frozenset(blobs)


def _mtime(info: dict) -> float | None:
    """Last-modified time of an object from s3fs (LastModified), gcsfs (updated) or adlfs (last_modified)."""
    for k in ("LastModified", "last_modified", "updated", "mtime", "created"):
        v = info.get(k)
        if isinstance(v, _dt.datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            with contextlib.suppress(ValueError):
                return _dt.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
    return None


def _same_record(raw: bytes, rec: dict) -> bool:
    """Whether ``raw`` is the record ``rec`` (one publish: same digest, time and publisher), not a newer one."""
    try:
        now = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return True             # garbled: whatever it was, it is not a newer good record
    ident = lambda r: (r.get("payload_digest"), str(r.get("created")), json.dumps(r.get("publisher"), sort_keys=True))  # noqa: E731
    return not isinstance(now, dict) or ident(now) == ident(rec)


class RemoteStore:
    def __init__(self, url: str, fs=None):
        scheme, sep, rest = url.strip().partition("://")
        scheme = scheme.lower()
        if not sep or scheme not in SCHEMES:
            raise UsageError(
                f"FORGE_CACHE={url}: the shared cache needs an object store that can create an object only if it is "
                f"absent: s3://bucket/prefix, gs://bucket/prefix or az://container/prefix (a shared directory is "
                f"FORGE_CACHE=/path/on/the/shared/disk)")
        rest = rest.strip("/")
        if not rest:
            raise UsageError(f"FORGE_CACHE={url}: name a bucket, e.g. {scheme}://forge-cache/nightly")
        self.scheme = scheme
        self.protocol, self.package, self.extra = SCHEMES[scheme]
        self.url = f"{scheme}://{rest}"
        self.root = rest
        self.bucket = rest.split("/", 1)[0]
        self._fs = fs
        self._confirmed: set[str] = set()   # keys whose record this process has seen (no second look needed)
        self._records: dict[str, dict] = {}  # key -> the record this process read or wrote (who names which blob)

    # ------------------------------------------------------------ connection
    @property
    def fs(self):
        if self._fs is None:
            try:
                import fsspec
                self._fs = fsspec.filesystem(self.protocol, **self._storage_options())
            except ImportError:
                raise UsageError(f"FORGE_CACHE={self.url} needs {self.package}: pip install 'forge-engine[{self.extra}]' "
                                 f"(or `make setup`)") from None
            if getattr(self._fs, "async_impl", False) and getattr(self._fs, "loop", None) is not None:
                quiet_orphaned_io_errors(self._fs.loop)
        return self._fs

    def _storage_options(self) -> dict:
        opts = {"skip_instance_cache": True, "use_listings_cache": False}
        if self.protocol == "s3":
            # endpoint and credentials come from the standard AWS chain (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...);
            # a dead endpoint is reported within seconds (botocore's legacy default: 60 s connect timeout, 5
            # attempts); transient errors are still retried (botocore standard mode, then s3fs's own retries)
            opts["config_kwargs"] = {"connect_timeout": 10, "read_timeout": 120,
                                     "retries": {"mode": "standard", "max_attempts": 2}}
        return opts

    def endpoint(self) -> str:
        if self.protocol == "s3":
            ep = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            return ep or "the default AWS S3 endpoint"
        if self.protocol == "gs":
            return "Google Cloud Storage"
        return f"Azure Blob Storage account {os.environ.get('AZURE_STORAGE_ACCOUNT_NAME', '(from the Azure chain)')}"

    def _credentials_hint(self) -> str:
        if self.protocol == "s3":
            return ("AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance role (the standard AWS chain)")
        if self.protocol == "gs":
            return "GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`"
        return "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with a key or an Azure identity"

    def explain(self, e: BaseException, doing: str) -> RemoteError:
        """A RemoteError for an exception of the store's client: what failed, where, and what to do."""
        name = type(e).__name__
        where = f"{self.url} (endpoint {self.endpoint()})"
        detail = str(e).strip().splitlines()[0][:300] if str(e).strip() else name
        if name in _CREDENTIAL_ERRORS:
            return RemoteError(f"no usable credentials for {where} while {doing}: {detail}. Set {self._credentials_hint()}; "
                               f"{OFFLINE_HINT}")
        if isinstance(e, PermissionError):
            return RemoteError(f"access denied to {where} while {doing}: {detail}. Check the credentials forge sees "
                               f"({self._credentials_hint()}) and that they may list, read and write bucket "
                               f"'{self.bucket}'; {OFFLINE_HINT}")
        if isinstance(e, FileNotFoundError) and "bucket" in detail.lower():
            return self._no_bucket()
        if name in _CONNECTION_ERRORS or isinstance(e, (ConnectionError, TimeoutError, socket.gaierror)):
            return RemoteError(f"cannot reach {where} while {doing}: {detail}. Check the network and the endpoint"
                               f"{' (AWS_ENDPOINT_URL for a non-AWS store)' if self.protocol == 's3' else ''}; "
                               f"{OFFLINE_HINT}")
        return RemoteError(f"{doing} {where} failed: {name}: {detail}; {OFFLINE_HINT}")

    def _no_bucket(self) -> RemoteError:
        make = {"s3": f"`aws s3 mb s3://{self.bucket}` (with --endpoint-url for a non-AWS endpoint)",
                "gs": f"`gcloud storage buckets create gs://{self.bucket}`",
                }.get(self.protocol, f"`az storage container create --name {self.bucket}`")
        return RemoteError(f"bucket '{self.bucket}' of FORGE_CACHE={self.url} does not exist at {self.endpoint()}: "
                           f"create it with {make}, or point FORGE_CACHE at an existing bucket; {OFFLINE_HINT}")

    @contextlib.contextmanager
    def _errors(self, doing: str):
        try:
            yield
        except (RemoteError, BadRemoteEntry, UsageError):
            raise
        except Exception as e:
            raise self.explain(e, doing) from None

    def probe(self) -> None:
        """One request that says whether the store is usable: reachable, allowed, the bucket there."""
        try:
            self.fs.info(self.bucket)
        except FileNotFoundError:
            raise self._no_bucket() from None
        except (RemoteError, UsageError):
            raise
        except Exception as e:
            raise self.explain(e, "opening") from None

    # ------------------------------------------------------------ paths
    def _record_path(self, key: str) -> str:
        return f"{self.root}/entries/{key[:2]}/{key}.json"

    def _upload_path(self, key: str, upload: str) -> str:
        return f"{self.root}/objects/{key[:2]}/{key}/{upload}"

    def _blob_path(self, sha: str) -> str:
        return f"{self.root}/blobs/{sha[:2]}/{sha}"

    def _bad_blob_marker(self, sha: str) -> str:
        return f"{self.root}/quarantine/blobs/{sha}.json"

    def _object_of(self, key: str, rec: dict, rel: str) -> str:
        """Where the bytes of payload file ``rel`` of record ``rec`` are (format 2: a blob; 1: the upload)."""
        if rec.get("format", 1) >= 2:
            return self._blob_path(rec["files"][rel]["sha256"])
        return f"{self._upload_path(key, rec['upload'])}/{rel}"

    def record_url(self, key: str) -> str:
        return f"{self.scheme}://{self._record_path(key)}"

    # ------------------------------------------------------------ reading
    def record(self, key: str) -> dict | None:
        """The entry record of ``key``, None when there is none. A garbled record is set aside (None)."""
        with self._errors(f"reading the record of {key[:16]} from"):
            try:
                raw = self.fs.cat_file(self._record_path(key))
            except FileNotFoundError:
                return None
        try:
            rec = self._parse(key, raw)
        except BadRemoteEntry as e:
            self.discard(key, str(e))
            return None
        self._confirmed.add(key)
        self._records[key] = rec
        return rec

    def known_naming(self, blobs) -> dict[str, dict]:
        """``{key: record}`` of every record this process has read or written that names one of these blobs."""
        return {k: r for k, r in self._records.items() if r.get("format", 1) >= 2
                and any(f["sha256"] in blobs for f in r["files"].values())}

    @staticmethod
    def _parse(key: str, raw: bytes) -> dict:
        try:
            rec = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise BadRemoteEntry("record unreadable (not JSON)") from None
        files = rec.get("files") if isinstance(rec, dict) else None
        dirs = rec.get("dirs", []) if isinstance(rec, dict) else None
        fmt = rec.get("format", 1) if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or rec.get("key") != key or not isinstance(rec.get("payload_digest"), str) \
                or not isinstance(files, dict) or fmt not in (1, 2) \
                or (fmt == 1 and not isinstance(rec.get("upload"), str)) \
                or not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs) \
                or not all(isinstance(v, dict) and isinstance(v.get("sha256"), str)
                           and re.fullmatch(r"[0-9a-f]{64}", v["sha256"]) for v in files.values()) \
                or not isinstance(rec.get("components", {}), dict) or not isinstance(rec.get("metrics", {}), dict):
            raise BadRemoteEntry("record is not a forge entry record")
        for rel in [*files, *dirs]:
            if not rel or rel.startswith("/") or ".." in Path(rel).parts:
                raise BadRemoteEntry(f"record names a path outside its payload: {rel!r}")
        if listing_digest({k: v["sha256"] for k, v in files.items()}, dirs) != rec["payload_digest"]:
            raise BadRemoteEntry("record's file list does not match its payload digest")
        return rec

    def fetch(self, key: str, rec: dict, dest: Path) -> None:
        """Download the payload ``rec`` describes into the empty directory ``dest`` and verify every byte.
        BadRemoteEntry when an object is missing or differs, naming every such blob (the caller sets aside each
        entry that names one). A blob whose bytes are not its name is marked bad (quarantine/blobs/), never
        deleted here: the next publisher of those bytes overwrites it, and a blob another machine healed meanwhile
        is left alone (a delete would race that upload)."""
        files = rec["files"]
        fmt2 = rec.get("format", 1) >= 2
        first: dict[str, str] = {}      # object -> the first file downloaded from it (the others are copies)
        for rel in sorted(files):
            first.setdefault(self._object_of(key, rec, rel), rel)
        if files:
            for rel in files:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            with self._errors(f"downloading {key[:16]} from"):
                try:
                    self.fs.get(list(first), [str(dest / rel) for rel in first.values()])
                except FileNotFoundError as e:
                    gone = [rel for obj, rel in sorted(first.items(), key=lambda x: x[1]) if not self.fs.exists(obj)]
                    what = f"{gone[0]}{f' and {len(gone) - 1} more' if len(gone) > 1 else ''}" if gone else e
                    raise BadRemoteEntry(f"payload object missing: {what}",
                                         {files[rel]["sha256"] for rel in gone} if fmt2 else ()) from None
            for rel in files:
                src = first.get(self._object_of(key, rec, rel))
                if src is not None and src != rel and (dest / src).is_file():
                    shutil.copyfile(dest / src, dest / rel)
        for d in rec.get("dirs", []):
            (dest / d).mkdir(parents=True, exist_ok=True)
        got = tree_listing(dest, use_stat_cache=False)
        missing = sorted(set(files) - set(got))
        if missing:
            raise BadRemoteEntry(f"payload object missing: {missing[0]}",
                                 {files[rel]["sha256"] for rel in missing} if fmt2 else ())
        wrong = sorted(rel for rel, want in files.items() if got[rel] != want["sha256"])
        if wrong:
            rel = wrong[0]
            why = (f"payload file {rel}{f' and {len(wrong) - 1} more' if len(wrong) > 1 else ''} differs from its "
                   f"record (sha256 {got[rel][:12]}..., recorded {files[rel]['sha256'][:12]}...)")
            bad = {files[r]["sha256"] for r in wrong} if fmt2 else set()
            self.mark_bad(bad, f"{why}, found fetching {key[:16]}")
            raise BadRemoteEntry(why, bad)
        if listing_digest(got, empty_dirs(dest)) != rec["payload_digest"]:
            raise BadRemoteEntry("payload digest mismatch")

    def mark_bad(self, blobs, why: str) -> None:
        """Mark blobs whose bytes are not their name (quarantine/blobs/<sha>.json), so that the next publisher of
        the right bytes uploads them over the bad ones whichever machine it runs on."""
        note = json.dumps({"reason": why, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "by": socket.gethostname()}).encode()
        with self._errors("marking a bad blob in"):
            for sha in sorted(blobs):
                self.fs.pipe_file(self._bad_blob_marker(sha), note)

    def _marked_bad(self) -> set[str]:
        """The blobs marked bad (one listing)."""
        try:
            paths = self.fs.ls(f"{self.root}/quarantine/blobs", detail=False)
        except FileNotFoundError:
            return set()
        return {p.rsplit("/", 1)[-1].removesuffix(".json") for p in paths if p.endswith(".json")}

    # ------------------------------------------------------------ writing
    def publish(self, key: str, payload: Path, meta: dict) -> tuple[bool, dict]:
        """Upload ``payload`` and create the record of ``key`` if none exists. (True, our record) when ours is the
        entry; (False, the winner's record) when another publisher's record came first (our upload is deleted)."""
        listing = tree_listing(payload)
        dirs = empty_dirs(payload)
        if listing_digest(listing, dirs) != meta["payload_digest"]:
            raise ForgeError(f"the payload of {key[:16]} changed while it was being published: rebuild it")
        files = {rel: {"sha256": sha, "size": (payload / rel).stat().st_size} for rel, sha in listing.items()}
        todo: dict[str, str] = {}       # blob -> a local file with its bytes, for each blob the store lacks
        with self._errors(f"uploading {key[:16]} to"):
            marked = self._marked_bad()
            for rel, sha in sorted(listing.items()):
                blob = self._blob_path(sha)
                # a blob marked bad, missing, or of another size (truncated) is uploaded over: these bytes are
                # its name, so whoever writes them writes the same object
                if blob not in todo and (sha in marked or self._size(blob) != files[rel]["size"]):
                    todo[blob] = str(payload / rel)
            if todo:
                self.fs.put(list(todo.values()), list(todo))
            for sha in sorted(marked & {b.rsplit("/", 1)[-1] for b in todo}):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self._bad_blob_marker(sha))
        record = dict(meta, format=RECORD_FORMAT, files=files, dirs=dirs,
                      publisher={"host": socket.gethostname(), "pid": os.getpid()})
        record.pop("upload", None)
        data = json.dumps(record, indent=1, sort_keys=True, default=str).encode()
        with self._errors(f"publishing the record of {key[:16]} to"):
            try:
                self.fs.pipe_file(self._record_path(key), data, mode="create")
                won = True
            except FileExistsError:
                won = False
            except OSError:
                # SeaweedFS's 412 carries no Condition, so s3fs raises OSError(EINVAL); AWS may answer 409 to
                # two conditional writes in flight: whichever it was, a record that exists now means we lost
                if self.record(key) is None:
                    raise
                won = False
        if won:
            self._confirmed.add(key)
            self._records[key] = record
            return True, record
        winner = self.record(key)
        if winner is None:
            raise RemoteError(f"the record of {key[:16]} at {self.record_url(key)} was there a moment ago and is gone "
                              f"(set aside by another machine?): run the build again")
        return False, winner

    def _size(self, path: str) -> int | None:
        """An object's size; None when there is none."""
        try:
            return int(self.fs.info(path)["size"])
        except FileNotFoundError:
            return None

    def has(self, key: str) -> bool:
        return key in self._confirmed or self.record(key) is not None

    def discard(self, key: str, why: str, expect: dict | None = None) -> bool:
        """Set a bad record aside (quarantine/) so the entry is a miss everywhere and gets rebuilt. Its payload
        objects are left to gc (a reader may be downloading them). ``expect``: the record found bad; a record of
        the key that is not that one (another machine rebuilt and published it meanwhile) is left alone. True when
        a record was set aside."""
        path = self._record_path(key)
        self._confirmed.discard(key)
        self._records.pop(key, None)
        with self._errors(f"setting aside the bad entry {key[:16]} in"):
            try:
                raw = self.fs.cat_file(path)
            except FileNotFoundError:
                return False
            if expect is not None and not _same_record(raw, expect):
                return False
            note = json.dumps({"key": key, "reason": why, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "record": raw.decode("utf-8", "replace")}, indent=1).encode()
            self.fs.pipe_file(f"{self.root}/quarantine/{key}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-"
                              f"{uuid.uuid4().hex[:6]}.json", note)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)
        return True

    def _delete(self, prefix: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(prefix, recursive=True)

    # ------------------------------------------------------------ index
    def write_index(self, recipe: str, stage: str, data: dict) -> None:
        with self._errors(f"recording the last build of {recipe}/{stage} in"):
            self.fs.pipe_file(f"{self.root}/index/{recipe}/{stage}.json",
                              json.dumps(data, sort_keys=True, default=str).encode())

    def read_index(self, recipe: str, stage: str) -> dict | None:
        with self._errors(f"reading the last build of {recipe}/{stage} from"):
            try:
                raw = self.fs.cat_file(f"{self.root}/index/{recipe}/{stage}.json")
            except FileNotFoundError:
                return None
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def index_recipes(self) -> dict[str, list[str]]:
        """``{recipe: [keys of its last build's stages]}`` from index/ (what gc --keep keeps)."""
        out: dict[str, list[str]] = {}
        with self._errors("listing index/ of"):
            try:
                paths = self.fs.find(f"{self.root}/index")
            except FileNotFoundError:
                paths = []
            raws = self.fs.cat(paths) if paths else {}
        for path, raw in raws.items():
            recipe = path.rstrip("/").split("/")[-2]
            try:
                out.setdefault(recipe, []).append(str(json.loads(raw)["key"]))
            except (ValueError, KeyError, TypeError):
                out.setdefault(recipe, [])
        return out

    # ------------------------------------------------------------ maintenance
    def _find(self, sub: str, detail: bool = False):
        with self._errors(f"listing {sub}/ of"):
            try:
                return self.fs.find(f"{self.root}/{sub}", detail=detail)
            except FileNotFoundError:
                return {} if detail else []

    def records(self) -> list[tuple[str, dict | None, str]]:
        """(key, record or None, problem) for every object under entries/."""
        paths = [p for p in self._find("entries") if p.endswith(".json")]
        with self._errors("reading the records of"):
            raws = self.fs.cat(paths, on_error="return") if paths else {}
        out = []
        for path in sorted(raws):
            key = path.rsplit("/", 1)[-1][: -len(".json")]
            raw = raws[path]
            if isinstance(raw, BaseException):
                out.append((key, None, f"record unreadable: {raw}"))
                continue
            try:
                out.append((key, self._parse(key, raw), ""))
            except BadRemoteEntry as e:
                out.append((key, None, str(e)))
        return out

    def _object_sha256(self, path: str) -> str | None:
        """sha256 of an object's bytes; None when there is no such object."""
        h = hashlib.sha256()
        with self._errors(f"reading {path} from"):
            try:
                with self.fs.open(path, "rb", block_size=8 << 20) as f:
                    while chunk := f.read(8 << 20):
                        h.update(chunk)
            except FileNotFoundError:   # caught here, not by _errors: a missing object is a problem, not an outage
                return None
        return h.hexdigest()

    def verify_all(self) -> list[tuple[str, str]]:
        """Re-hash every payload object of every record (each blob once); (key, problem) pairs for every missing
        or differing file of every entry, not only the first. Changes nothing."""
        bad = []
        seen: dict[str, str | None] = {}
        for key, rec, problem in self.records():
            if rec is None:
                bad.append((key, problem))
                continue
            for rel, want in sorted(rec["files"].items()):
                obj = self._object_of(key, rec, rel)
                if obj not in seen:
                    seen[obj] = self._object_sha256(obj)
                if seen[obj] is None:
                    bad.append((key, f"payload object missing: {rel}"))
                elif seen[obj] != want["sha256"]:
                    bad.append((key, f"payload file {rel} differs from its record"))
        return bad

    def uploads(self) -> dict[tuple[str, str], float]:
        """``{(key, upload): newest object time}`` of every upload under objects/."""
        groups: dict[tuple[str, str], float] = {}
        prefix = f"{self.root}/objects/"
        for path, info in self._find("objects", detail=True).items():
            parts = path[len(prefix):].split("/") if path.startswith(prefix) else []
            if len(parts) < 4:
                continue
            g = (parts[1], parts[2])
            groups[g] = max(groups.get(g, 0.0), _mtime(info) or time.time())
        return groups

    def gc(self, keep: set[str] | None = None, older_than_s: float = ORPHAN_GRACE_S) -> dict:
        """Remove uploads no record references once older than ``older_than_s`` (killed or losing publishers),
        quarantined records as old, and, with ``keep``, every entry whose key is not in it (record first)."""
        now = time.time()
        recs = self.records()
        removed_entries = 0
        referenced = set()
        blobs_kept: set[str] = set()
        blobs_dropped: set[str] = set()     # named only by records removed now: removed whatever their age
        for key, rec, _ in recs:
            if rec is None:
                continue
            shas = {f["sha256"] for f in rec["files"].values()} if rec.get("format", 1) >= 2 else set()
            if keep is not None and key not in keep:
                with self._errors(f"removing {key[:16]} from"), contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self._record_path(key))
                removed_entries += 1
                self._confirmed.discard(key)
                if "upload" in rec:
                    self._delete(self._upload_path(key, rec["upload"]))
                blobs_dropped |= shas
                continue
            blobs_kept |= shas
            if "upload" in rec:
                referenced.add((key, rec["upload"]))
        removed_uploads = 0
        for (key, upload), mtime in self.uploads().items():
            if (key, upload) not in referenced and (older_than_s <= 0 or now - mtime > older_than_s):
                with self._errors(f"removing an unreferenced upload of {key[:16]} from"):
                    self._delete(self._upload_path(key, upload))
                removed_uploads += 1
        removed_blobs = 0
        prefix = f"{self.root}/blobs/"
        for path, info in self._find("blobs", detail=True).items():
            sha = path.rsplit("/", 1)[-1]
            if not path.startswith(prefix) or sha in blobs_kept:
                continue
            if sha in blobs_dropped or older_than_s <= 0 or now - (_mtime(info) or now) > older_than_s:
                with self._errors("removing an unreferenced blob from"), contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)
                removed_blobs += 1
        removed_quarantined = 0
        for path, info in self._find("quarantine", detail=True).items():
            if older_than_s <= 0 or now - (_mtime(info) or now) > older_than_s:
                with self._errors("removing a quarantined record from"), contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)
                removed_quarantined += 1
        return {"removed_entries": removed_entries, "removed_blobs": removed_blobs, "removed_uploads": removed_uploads,
                "removed_quarantined": removed_quarantined}
