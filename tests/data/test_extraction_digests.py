"""The extractors reproduce the manifest's digests byte for byte from the pinned packages.

The digests in calibration_data/manifest.yaml were recorded by the previous, hand-written extraction
(R XDR reader, ar reader, gensim's filter rebuilt from the wheel's source); equality here shows the
rdata / dpkg-deb / installed-gensim extraction produces the identical text, so no cache key changed.
Runs offline on the packages a previous `forge data fetch` left in $FORGE_HOME/data/_downloads.
"""

from __future__ import annotations

import hashlib
import shutil

import pytest

from pipeline.data import load_manifest, store
from pipeline.host.paths import forge_home
from pipeline.hashing import file_digest


@pytest.mark.parametrize("name", ["sotu", "wiki", "austen", "code_docs", "licenses"])
def test_extraction_reproduces_manifest_digests(name, tmp_path):
    entry = load_manifest()["sets"][name]
    pkg = forge_home() / "data" / "_downloads" / entry["source_file"]
    if not pkg.is_file() or file_digest(pkg, use_stat_cache=False) != entry["source_sha256"]:
        pytest.skip(f"{pkg} not downloaded yet (run `forge data fetch {name}`)")
    if name == "austen" and shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb not installed")
    shutil.copy(pkg, tmp_path / pkg.name)          # produce() reuses a verified download: no network
    texts = store.produce(name, entry, tmp_path)
    assert set(texts) == set(entry["splits"])
    for split, text in texts.items():
        want = entry["splits"][split]
        assert (len(text), hashlib.sha256(text.encode("utf-8")).hexdigest()) == (want["chars"], want["sha256"])
