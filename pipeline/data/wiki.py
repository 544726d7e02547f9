"""``wiki``: the English Wikipedia sample in the ``gensim`` wheel's test data, cleaned to plain text.

Markup is removed by gensim's own ``filter_wiki`` from the installed ``gensim`` package, which must be the
version the manifest pins (the produced text, and so its sha256, depends on gensim's regexes).
A few plain-text finishing rules follow (``clean_wiki_article``).
"""

from __future__ import annotations

import bz2
import io
import re
import zipfile
from pathlib import Path
from typing import Callable, Iterator
from xml.etree.ElementTree import iterparse

from ..errors import ForgeError
from ..hashing import sha256_bytes

WIKI_MIN_WORDS = 50   # gensim's ARTICLE_MIN_WORDS


def gensim_filter_wiki(version: str) -> Callable[[str], str]:
    """``gensim.corpora.wikicorpus.filter_wiki`` of the installed gensim, which must be ``version``."""
    try:
        import gensim
        from gensim.corpora.wikicorpus import filter_wiki
    except ImportError as e:
        raise ForgeError(f"data set 'wiki' is cleaned with gensim's filter_wiki, but gensim is not importable ({e}); "
                         f"install it with `pip install gensim=={version}` (a dependency of forge)") from None
    if gensim.__version__ != version:
        raise ForgeError(f"data set 'wiki' is cleaned with gensim {version}'s filter_wiki (calibration_data/manifest.yaml)"
                         f" but gensim {gensim.__version__} is installed; `pip install gensim=={version}`")
    return filter_wiki


# Plain-text finishing after filter_wiki (which leaves headings, bold/italic quotes, list markers and
# table debris); each rule is one regex:
_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*\1\s*$", re.M)          # "== History ==" -> "History"
_QUOTES = re.compile(r"'{2,}")                                        # ''italic'' / '''bold'''
_LIST = re.compile(r"^[ \t]*[*#:;]+[ \t]*", re.M)                     # "* item" -> "item"
_NO_WORD = re.compile(r"^[^\w\n]*$", re.M)                            # lines without letters/digits
_SPACES = re.compile(r"[ \t\xa0]+")
_BLANKS = re.compile(r"\n{3,}")


def clean_wiki_article(filtered: str) -> str:
    t = _HEADING.sub(r"\2", filtered)
    t = _QUOTES.sub("", t)
    t = _LIST.sub("", t)
    t = "\n".join(_SPACES.sub(" ", ln).strip() for ln in t.split("\n"))
    t = _NO_WORD.sub("", t)
    return _BLANKS.sub("\n\n", t).strip()


def extract(wheel: Path, entry: dict) -> dict[str, str]:
    """Main-namespace, non-redirect articles of the dump in file order: title, blank line, cleaned text."""
    rule = entry["extract"]
    filter_wiki = gensim_filter_wiki(str(entry["version"]))
    with zipfile.ZipFile(wheel) as z:
        raw = z.read(rule["member"])
    if sha256_bytes(raw) != rule["member_sha256"]:
        raise ForgeError(f"{wheel.name}: {rule['member']} has sha256 {sha256_bytes(raw)}, "
                         f"calibration_data/manifest.yaml pins {rule['member_sha256']}")
    articles = []
    for title, text in _pages(bz2.decompress(raw)):
        body = clean_wiki_article(filter_wiki(text))
        if len(body.split()) >= WIKI_MIN_WORDS:
            articles.append(f"{title}\n\n{body}")
    split = next(iter(entry["splits"]))
    return {split: "\n\n".join(articles) + "\n"}


def _pages(xml: bytes) -> Iterator[tuple[str, str]]:
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
