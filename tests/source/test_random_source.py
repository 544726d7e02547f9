"""model.source random:<bundled config> (issue 38, pipeline/random_weights.py): seeded random weights in a real
model's shape, made by forge, deterministic on any machine, hashed into the source key, said in every report, and
bad specs or layer counts refused with exit 2 naming the key."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from pipeline import random_weights as rw
from pipeline import source
from pipeline.cache import make_key
from pipeline.errors import ForgeError
from pipeline.recipe import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/forge_cli.py
from forge_cli import run_cli  # noqa: E402

QWEN = "random:Qwen--Qwen2.5-7B-Instruct"
SMOL = "random:HuggingFaceTB--SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tiny_config():
    """Qwen2.5-7B's architecture (GQA, q/k/v biases, untied lm_head) at a tiny width, bf16 like the bundled one."""
    from transformers import AutoConfig
    raw = rw.model_config("Qwen--Qwen2.5-7B-Instruct", 2)
    raw.update(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    return AutoConfig.for_model(**raw)


def _bytes_digest(d: Path) -> str:
    """sha256 over every weight file's tensors (names, dtypes, bytes), independent of how they were sharded."""
    from safetensors.torch import load_file
    h = hashlib.sha256()
    tensors = {}
    for f in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(f))
    for k in sorted(tensors):
        t = tensors[k]
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ the generator

def test_same_seed_same_bytes_whatever_the_threads_workers_and_shards(tiny_config, tmp_path):
    """What could differ between two machines: torch's thread count, the pool's size, the shard cut. None moves a
    number (each tensor its own CPU generator), so the model is the same bytes on every machine."""
    import torch
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = rw.write_weights(tiny_config, _mk(tmp_path / "a"), 0, "bfloat16", workers=1)
        torch.set_num_threads(max(2, threads))
        b = rw.write_weights(tiny_config, _mk(tmp_path / "b"), 0, "bfloat16", workers=3, shard_bytes=20_000)
    finally:
        torch.set_num_threads(threads)
    c = rw.write_weights(tiny_config, _mk(tmp_path / "c"), 1, "bfloat16")
    assert a["shards"] == 1 and b["shards"] > 3 and a["parameters"] == b["parameters"]
    assert (tmp_path / "b/model.safetensors.index.json").is_file()
    assert _bytes_digest(tmp_path / "a") == _bytes_digest(tmp_path / "b") != _bytes_digest(tmp_path / "c")


def test_tensors_are_seeded_by_name_and_shaped_like_the_model(tiny_config, tmp_path):
    from safetensors.torch import load_file
    rw.write_weights(tiny_config, _mk(tmp_path / "m"), 0, "bfloat16")
    sd = load_file(tmp_path / "m/model.safetensors")
    assert {"model.layers.1.self_attn.q_proj.bias", "lm_head.weight"} <= set(sd)       # Qwen2: biases, untied
    assert all(t.dtype == __import__("torch").bfloat16 for t in sd.values())
    assert (sd["model.norm.weight"] == 1).all() and (sd["model.layers.0.input_layernorm.weight"] == 1).all()
    w = sd["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(w.mean()) < 0.003 and 0.018 < w.std() < 0.022
    # a tensor depends only on (seed, its name): the first layer of a 1-layer model is the 2-layer model's
    one = tiny_config.to_dict() | {"num_hidden_layers": 1}
    one.pop("layer_types", None)            # transformers derives it from the depth
    rw.write_weights(type(tiny_config)(**one), _mk(tmp_path / "one"), 0, "bfloat16")
    sd1 = load_file(tmp_path / "one/model.safetensors")
    assert set(sd1) < set(sd) and all((sd1[k] == sd[k]).all() for k in sd1)
    assert rw.tensor_seed(0, "x") == rw.tensor_seed(0, "x") != rw.tensor_seed(0, "y") != rw.tensor_seed(1, "x")


def test_the_model_loads_and_runs(tiny_config, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    d = _mk(tmp_path / "m")
    tiny_config.save_pretrained(d)
    rw.write_weights(tiny_config, d, 0, "bfloat16", shard_bytes=30_000)      # sharded: HF's index is read
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        out = m(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 256) and torch.isfinite(out).all() and out.std() > 0


def test_memory_is_one_shard_at_a_time():
    """A 28-layer Qwen2.5-7B is cut into shards of at most 2 GiB, so making it never holds the whole model."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(**rw.model_config("Qwen--Qwen2.5-7B-Instruct", 28))
    shapes = rw.tensor_shapes(cfg)
    plan = rw.shard_plan(shapes, 2)
    sizes = [sum(2 * __import__("math").prod(shapes[n]) for n in names) for names in plan]
    assert sum(sizes) / 1e9 == pytest.approx(15.23, abs=0.01)          # 7.62 B parameters in bf16
    assert max(sizes) <= rw.SHARD_BYTES and len(plan) == 8
    assert [n for names in plan for n in names] == list(shapes)         # every tensor once, in order


def _mk(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


# ------------------------------------------------------------------ the source spec and the recipe keys

@pytest.mark.parametrize("spec, expect", [
    ("random:../../etc", "no bundled config named '../../etc'"),
    ("random:/etc/passwd", "no bundled config named '/etc/passwd'"),
    ("random:Qwen--Qwen2.5-7B-Instruc", "did you mean 'random:Qwen--Qwen2.5-7B-Instruct'?"),
    ("random:", "random:<name> takes one of: "),
    ("random:Qwen/Qwen2.5-7B-Instruct", "no bundled config named 'Qwen/Qwen2.5-7B-Instruct'"),
])
def test_a_spec_names_a_bundled_config_and_nothing_else(spec, expect, tmp_path):
    with pytest.raises(ForgeError, match="model.source") as e:
        source.resolve_source(spec, tmp_path)
    assert expect in str(e.value)
    assert not (tmp_path / "models").exists()           # nothing made, nothing read outside the bundle


@pytest.mark.parametrize("recipe, sets, expect", [
    ("qwen2.5-7b-cuda-fp16", ["model.layers=0"], "model.layers = 0: must be an integer in [1, 1024]"),
    ("qwen2.5-7b-cuda-fp16", ["model.layers=29"], "model.layers = 29: the bundled config Qwen--Qwen2.5-7B-Instruct "
                                                  "has 28 decoder layers; use 1 to 28"),
    ("qwen2.5-7b-cuda-fp16", ["model.layers=-1"], "model.layers = -1: must be an integer in [1, 1024]"),
    ("qwen2.5-7b-cuda-fp16", ["model.layers='4'"], "model.layers = '4'"),
    ("qwen2.5-7b-cuda-fp16", ["model.seed=-3"], "model.seed = -3: must be an integer in [0, 4294967295]"),
    ("qwen2.5-7b-cuda-fp16", ["model.source=random:../../etc"], "model.source 'random:../../etc': no bundled config"),
    ("qwen2.5-7b-cuda-fp16", ["model.source=random:nope"], "random:<name> takes one of: "),
    ("smollm2-135m-int8", ["model.layers=2"], "model.layers = 2: read only for model.source random:<bundled config>"),
    ("smollm2-135m-int8", ["model.seed=1"], "model.seed = 1: read only for model.source random:<bundled config>"),
    ("qwen2.5-7b-cuda-fp16", ["model.source=builtin:smollm2-135m-instruct", "model.layers=4"],
     "remove it (or set model.layers: null)"),
])
@pytest.mark.parametrize("command", ["plan", "build"])
def test_bad_random_sources_exit_2_naming_the_key(recipe, sets, expect, command, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    args = [command, recipe] + [x for s in sets for x in ("--set", s)]
    code, out = run_cli(capsys, monkeypatch, *args)
    assert code == 2 and expect in out, out
    assert not (tmp_path / "cache" / "entries").exists() or not any((tmp_path / "cache" / "entries").iterdir())


def _source_key(recipe_name: str, sets: list[str], home: Path) -> str:
    from pipeline.stages.source import SourceStage
    return make_key(SourceStage().components(resolve(recipe_name, sets), home, {}))


def test_seed_and_layers_move_the_source_key_and_the_default_depth_does_not(tmp_path):
    k = {s: _source_key("qwen2.5-7b-cuda-fp16", list(s), tmp_path) for s in [
        (), ("model.layers=28",), ("model.layers=4",), ("model.seed=1",), ("model.layers=4", "model.seed=1")]}
    assert k[()] == k[("model.layers=28",)]                 # left out = the config's depth
    assert len({k[s] for s in k if s != ("model.layers=28",)}) == 4
    # the fp16 and int4 recipes read the same source: one generated model, one source entry
    assert _source_key("qwen2.5-7b-cuda-int4", [], tmp_path) == k[()]
    from pipeline.stages.source import SourceStage
    comps = SourceStage().components(resolve("qwen2.5-7b-cuda-fp16", ["model.layers=4"]), tmp_path, {})
    assert comps["config"] == {"source": QWEN, "seed": 0, "layers": 4}
    assert comps["data"]["generator"] == rw.GENERATOR_VERSION and "torch" in comps["tools"]
    # the bundled config's bytes are in the key: editing it would make another model
    assert comps["data"]["model"] == __import__("pipeline.hashing", fromlist=["x"]).file_digest(
        rw.config_file("Qwen--Qwen2.5-7B-Instruct"))


def test_a_recipe_that_extends_a_random_one_can_name_a_real_model():
    """The parent's seed (0, the default) is inherited harmlessly; a layer count is set back with null."""
    r = resolve("qwen2.5-7b-cuda-fp16", ["model.source=builtin:smollm2-135m-instruct"])
    assert r.model.seed == 0 and "seed" not in r.to_dict()["model"]
    r = resolve("qwen2.5-7b-cuda-fp16", ["model.source=builtin:smollm2-135m-instruct", "model.layers=null"])
    assert r.model.layers is None


def test_real_sources_keep_their_keys_and_hashes():
    """seed / layers are hashed for random sources only: no other recipe's hash or source key moved."""
    r = resolve("smollm2-135m-int8")
    assert "seed" not in r.to_dict()["model"] and "layers" not in r.to_dict()["model"]
    from pipeline.stages.source import SourceStage
    assert SourceStage().config(r) == {"source": "builtin:smollm2-135m-instruct"}
    q = resolve("qwen2.5-7b-cuda-fp16")
    assert q.to_dict()["model"] == {"source": QWEN, "config": None, "seed": 0, "layers": None}


def test_recipes_and_docs_name_no_tmp_model_folder():
    root = Path(__file__).resolve().parents[2]
    for p in (root / "recipes").glob("*.yaml"):
        assert "/tmp" not in p.read_text(), p
    for r in ("qwen2.5-7b-cuda-fp16", "qwen2.5-7b-cuda-int4"):
        assert resolve(r).model.source == QWEN


def test_plan_facts_come_from_the_bundled_config_at_the_recipe_depth(tmp_path):
    from pipeline.runner import model_info_for
    info = model_info_for(resolve("qwen2.5-7b-cuda-int4", ["model.layers=3"]), tmp_path)
    assert (info.num_layers, info.hidden_size, info.vocab_size, info.tie_word_embeddings) == (3, 3584, 152064, False)


# ------------------------------------------------------------------ made through the source stage

@pytest.fixture
def home_with_builtin(tmp_path, monkeypatch):
    """A fresh FORGE_HOME whose builtin tokenizer source is the shared home's conversion (converting it again
    takes a minute; the random model's own making is what is tested)."""
    from pipeline.host.paths import forge_home
    try:
        shared = source.materialise_builtin("smollm2-135m-instruct", forge_home())
    except ForgeError as e:
        pytest.skip(f"builtin SmolLM2 not available: {e}")
    monkeypatch.setattr(source, "materialise_builtin", lambda name, home: shared)
    return tmp_path / "home"


def test_resolve_makes_the_model_once_with_the_builtin_tokenizer(home_with_builtin):
    a = source.resolve_source(SMOL, home_with_builtin, seed=0, layers=1)
    assert a.kind == "random" and (a.seed, a.layers) == (0, 1)
    made = json.loads((a.path / "forge_source.json").read_text())
    assert made["random_weights"] is True and made["note"] == rw.NOTE and made["tokenizer_from"] == rw.TOKENIZER_SOURCE
    assert json.loads((a.path / "config.json").read_text())["num_hidden_layers"] == 1
    assert (a.path / "tokenizer.json").is_file() and not source.missing_parts(a.path)
    assert a.to_dict() == {"digest": a.digest, "kind": "random", "spec": SMOL, "seed": 0, "layers": 1, "note": rw.NOTE}
    mtime = (a.path / "model.safetensors").stat().st_mtime_ns
    b = source.resolve_source(SMOL, home_with_builtin, seed=0, layers=1)      # reused, not made again
    assert b.digest == a.digest and (b.path / "model.safetensors").stat().st_mtime_ns == mtime
    c = source.resolve_source(SMOL, home_with_builtin, seed=1, layers=1)
    assert c.path != a.path and c.digest != a.digest
    assert not list((home_with_builtin / "models").glob(".tmp-*"))


def test_report_and_summary_say_random_weights(tmp_path):
    from pipeline.report import build_report, write_reports
    r = resolve("qwen2.5-7b-cuda-int4", ["model.layers=4"])
    rep = build_report(r, [], 1.0)
    assert rep["note"] == (f"{rw.NOTE} (model.source {QWEN}, seed 0, layers 4)")
    write_reports(rep, tmp_path)
    assert f"note: {rw.NOTE}" in (tmp_path / "summary.txt").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["note"].startswith(
        "random weights: gates check the engine computes the same function, not accuracy")
    assert "note" not in build_report(resolve("smollm2-135m-int8"), [], 1.0)


def test_a_disk_too_small_is_said_before_writing(tiny_config, tmp_path, monkeypatch):
    from pipeline.diskspace import DiskFull
    monkeypatch.setattr(rw, "free_bytes", lambda p: 1000)
    with pytest.raises(DiskFull, match=r"GB free at .*the model needs about .*point FORGE_HOME at a larger disk"):
        rw.write_weights(tiny_config, _mk(tmp_path / "m"), 0, "bfloat16")
    assert not list((tmp_path / "m").iterdir())
