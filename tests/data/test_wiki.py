"""The wiki extractor: gensim's own filter_wiki (installed, version pinned by the manifest) + our finishing rules."""

from __future__ import annotations

import bz2
import hashlib
import zipfile

import pytest

from pipeline.data import wiki
from pipeline.errors import ForgeError

ARTICLE = ("'''Anarchism''' is a [[political philosophy]] that advocates [[self-governance|self-governed]] societies "
           "based on voluntary institutions.<ref>Citation here</ref> {{Infobox|x=1}}\n\n== History ==\n"
           "* Early forms appear in [[Ancient Greece]] &amp; China.\n[[File:Flag.svg|thumb|A flag]]\n"
           + "Words follow here to pass the minimum length of an article. " * 6)


def _dump(pages: list[tuple[str, int, str]]) -> bytes:
    body = "".join(f"<page><title>{t}</title><ns>{ns}</ns><revision><text>{x.replace('&', '&amp;').replace('<', '&lt;')}"
                   f"</text></revision></page>" for t, ns, x in pages)
    return f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">{body}</mediawiki>'.encode()


def test_filter_wiki_is_gensims_and_known_output():
    f = wiki.gensim_filter_wiki("4.4.0")
    assert f.__module__ == "gensim.corpora.wikicorpus"
    out = wiki.clean_wiki_article(f(ARTICLE))
    # links keep their text, references/templates go, the image keeps its caption, &amp; is decoded;
    # the heading rule also eats the blank line before a heading (as when the manifest's digest was recorded)
    assert out.startswith("Anarchism is a political philosophy that advocates self-governed societies based on "
                          "voluntary institutions.\nHistory\nEarly forms appear in Ancient Greece & China.\nA flag\n")
    assert "ref" not in out and "Infobox" not in out and "File:" not in out and "[[" not in out


def test_installed_gensim_must_be_the_manifest_version(monkeypatch):
    import gensim
    monkeypatch.setattr(gensim, "__version__", "4.3.3")
    with pytest.raises(ForgeError) as e:
        wiki.gensim_filter_wiki("4.4.0")
    assert "gensim 4.3.3 is installed" in str(e.value) and "pip install gensim==4.4.0" in str(e.value)


def test_extract_keeps_long_main_namespace_articles(tmp_path):
    member = "gensim/test/test_data/sample.xml.bz2"
    raw = bz2.compress(_dump([("Anarchism", 0, ARTICLE), ("Talk:Anarchism", 1, ARTICLE),
                              ("Anarchy", 0, "#REDIRECT [[Anarchism]]"), ("Stub", 0, "Too short.")]))
    wheel = tmp_path / "gensim.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, raw)
    entry = {"version": "4.4.0", "splits": {"eval": {}},
             "extract": {"member": member, "member_sha256": hashlib.sha256(raw).hexdigest()}}
    text = wiki.extract(wheel, entry)["eval"]
    assert text.startswith("Anarchism\n\nAnarchism is a political philosophy") and text.endswith("article.\n")
    assert text.count("Anarchism\n\n") == 1 and "Stub" not in text and "REDIRECT" not in text
    entry["extract"]["member_sha256"] = "0" * 64
    with pytest.raises(ForgeError, match="pins 0000"):
        wiki.extract(wheel, entry)
