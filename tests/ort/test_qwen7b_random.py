"""Issue 26's 7B-class CUDA recipes on CPU: they resolve and plan (the GPU stages say why they cannot run here), and
lab/random_hf_model.py, which makes their SEEDED RANDOM weights on the GPU machine, is deterministic per tensor."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from pipeline.recipe import resolve

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "pipeline/model_configs/Qwen--Qwen2.5-7B-Instruct.json"


def _gen():
    spec = importlib.util.spec_from_file_location("random_hf_model", ROOT / "lab/random_hf_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """Qwen2.5-7B's config at a tiny width (same architecture: GQA, q/k/v biases, untied lm_head)."""
    c = json.loads(QWEN.read_text())
    c.update(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
             vocab_size=256)
    p = tmp_path_factory.mktemp("cfg") / "tiny.json"
    p.write_text(json.dumps(c))
    return p


def _digest(p: Path) -> str:
    return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()


def test_qwen7b_cuda_recipes_resolve_with_gates_for_random_weights():
    fp16, int4 = resolve("qwen2.5-7b-cuda-fp16"), resolve("qwen2.5-7b-cuda-int4")
    for r in (fp16, int4):
        assert r.model.source == "/tmp/forge-random/qwen2.5-7b-l4-seed0"
        assert (r.build.target, r.build.onnxruntime.provider, r.build.onnxruntime.precision) == \
            ("onnxruntime", "cuda", "fp16")
    assert fp16.quantize.method == "none" and int4.quantize.algo == "int4_wo" and int4.quantize.block_size == 32
    # logits cosine is the gate that separates a broken engine (cosine ~0) from noise on flat random logits
    t16, t4 = fp16.validate_.thresholds, int4.validate_.thresholds
    assert (t16.ppl_delta_pct_max, t16.top1_agreement_min, t16.logits_cosine_min) == (1.0, 0.95, 0.999)
    assert (t4.ppl_delta_pct_max, t4.top1_agreement_min, t4.logits_cosine_min) == (5.0, 0.30, 0.98)


@pytest.mark.parametrize("recipe", ["qwen2.5-7b-cuda-fp16", "qwen2.5-7b-cuda-int4"])
def test_qwen7b_cuda_recipe_plans_on_cpu(recipe, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from pipeline import cli
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "250")
    res = CliRunner().invoke(cli.app, ["plan", recipe])
    assert res.exit_code == 0, res.output
    for stage in ("source", "export", "quantize", "build", "evaluate", "validate", "package"):
        assert f"│ {stage}" in res.output


def test_random_model_is_deterministic_per_seed_and_per_tensor(tiny_config, tmp_path):
    g = _gen()
    a = g.make(tiny_config, tmp_path / "a", layers=2, seed=0, device="cpu", tokenizer_from=None)
    b = g.make(tiny_config, tmp_path / "b", layers=2, seed=0, device="cpu", tokenizer_from=None)
    c = g.make(tiny_config, tmp_path / "c", layers=2, seed=1, device="cpu", tokenizer_from=None)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") != _digest(tmp_path / "c")
    assert a["random_weights"] is True and a["num_hidden_layers"] == 2 and a["device"] == "cpu"
    assert json.loads((tmp_path / "a/config.json").read_text())["num_hidden_layers"] == 2

    from safetensors.torch import load_file
    sa = load_file(tmp_path / "a/model.safetensors")
    assert a["parameters"] == sum(t.numel() for t in sa.values())
    # the layer count does not move any other tensor: each tensor has its own seed
    full = g.random_state_dict(__import__("transformers").AutoConfig.from_pretrained(
        tmp_path / "a", num_hidden_layers=1), seed=0)
    assert set(full) < set(sa) and all((full[k] == sa[k]).all() for k in full)
    # Qwen2's shape: q/k/v biases, an untied lm_head, RMSNorm weights 1, the rest N(0, 0.02)
    assert {"model.layers.1.self_attn.q_proj.bias", "lm_head.weight"} <= set(sa)
    assert (sa["model.norm.weight"] == 1).all()
    w = sa["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(w.mean()) < 0.002 and 0.018 < w.std() < 0.022
    assert g.tensor_seed(0, "x") == g.tensor_seed(0, "x") != g.tensor_seed(0, "y")


def test_random_model_loads_and_runs(tiny_config, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    _gen().make(tiny_config, tmp_path / "m", layers=1, seed=0, device="cpu", tokenizer_from=None)
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    with torch.no_grad():
        out = m(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 256) and torch.isfinite(out).all()


@pytest.mark.parametrize("layers", [0, 4])
def test_random_model_rejects_a_layer_count_the_config_lacks(tiny_config, tmp_path, layers):
    with pytest.raises(SystemExit, match="the config has 3 layers"):
        _gen().make(tiny_config, tmp_path / "x", layers=layers, seed=0, device="cpu", tokenizer_from=None)
