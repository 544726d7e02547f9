"""``calibration_data/manifest.yaml``: what each text set is, where it comes from, and its sha256.

Reading the manifest is cheap and needs no data: stages put ``set_digest`` into their cache keys.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from ..host.paths import forge_home
from ..errors import ForgeError

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "calibration_data"
MANIFEST = DATA_DIR / "manifest.yaml"
PROMPTS = DATA_DIR / "prompts.txt"


def manifest_path(path: Path | None = None) -> Path:
    """``path``, else ``$FORGE_DATA_MANIFEST`` (tests, forks), else the checkout's manifest."""
    return Path(path or os.environ.get("FORGE_DATA_MANIFEST") or MANIFEST)


def load_manifest(path: Path | None = None) -> dict:
    path = manifest_path(path)
    if not path.is_file():
        raise ForgeError(f"data manifest {path} not found; it ships with the forge source tree "
                         "(calibration_data/manifest.yaml) -- run forge from a checkout or set FORGE_DATA_MANIFEST")
    return yaml.safe_load(path.read_text())


def set_entry(set_name: str, manifest: dict | None = None) -> dict:
    sets = (manifest or load_manifest())["sets"]
    if set_name not in sets:
        raise ForgeError(f"data set {set_name!r} is not in calibration_data/manifest.yaml; known sets: "
                         + ", ".join(sorted(sets)))
    return sets[set_name]


def split_entry(set_name: str, split: str, manifest: dict | None = None) -> dict:
    entry = set_entry(set_name, manifest)
    if split not in entry["splits"]:
        raise ForgeError(f"data set {set_name!r} has no split {split!r}; its splits: "
                         + ", ".join(entry["splits"]) + " (calibration_data/manifest.yaml)")
    return entry["splits"][split]


def set_digest(set_name: str, split: str) -> str:
    """The manifest's sha256 of the set/split's UTF-8 text (cheap; nothing is read but the manifest)."""
    return split_entry(set_name, split)["sha256"]


def split_path(set_name: str, split: str, home: Path) -> Path:
    """Where a split's text lives: committed sets (registry ``forge``) in the checkout, others under ``home``."""
    entry = set_entry(set_name)
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
