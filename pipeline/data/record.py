"""Re-recording the manifest's ``chars``/``sha256`` after an intended change (``forge data record``)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..errors import ForgeError
from ..hashing import sha256_bytes
from .manifest import REPO_ROOT, load_manifest, manifest_path
from .store import produce


def record(set_names: list[str] | None = None, path: Path | None = None) -> dict:
    """Re-produce sets from their pinned sources and write their sha256/chars into the manifest."""
    path = manifest_path(path)
    manifest = load_manifest(path)
    unknown = sorted(set(set_names or ()) - set(manifest["sets"]))
    if unknown:
        raise ForgeError(f"{path}: no data set {', '.join(unknown)}; known sets: {', '.join(manifest['sets'])}")
    work = Path(tempfile.mkdtemp(prefix="forge-record-"))
    try:
        for name in set_names or list(manifest["sets"]):
            e = manifest["sets"][name]
            if e["registry"] == "forge":
                texts = {s: (REPO_ROOT / e["file"]).read_bytes().decode("utf-8") for s in e["splits"]}
            else:
                texts = produce(name, e, work)
            for s, t in texts.items():
                e["splits"][s]["chars"] = len(t)
                e["splits"][s]["sha256"] = sha256_bytes(t.encode("utf-8"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path.write_text(update_records(path.read_text(), manifest))
    return manifest


def update_records(text: str, manifest: dict) -> str:
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
