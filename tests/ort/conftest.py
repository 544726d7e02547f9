import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, GQA 4/2, vocab 256) saved as an HF dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256, max_position_embeddings=256, eos_token_id=2,
                      bos_token_id=1, tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("tiny_llama")
    model = LlamaForCausalLM(cfg).eval()
    # Larger-than-init weights so logits are not all near zero (greedy ties would make tests vacuous).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(d)
    return d


def _export(tiny_llama_dir, tmp_path_factory, attention: str) -> Path:
    from pipeline.ort.export import export_onnx

    os.environ.setdefault("FORGE_PROGRESS", "0")
    out = tmp_path_factory.mktemp(f"tiny_onnx_{attention}")
    metrics = export_onnx(tiny_llama_dir, out, opset=18, parity={"fp32": {"atol": 1e-4, "rtol": 1e-4}},
                          attention=attention)
    (out / "export_metrics.txt").write_text(repr(metrics))
    return out


@pytest.fixture(scope="session")
def tiny_onnx_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The default export: GroupQueryAttention graph with the in-place (shared) KV cache."""
    return _export(tiny_llama_dir, tmp_path_factory, "gqa")


@pytest.fixture(scope="session")
def tiny_onnx_standard_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The plain-ONNX export (standard attention, concatenating KV cache) that the tensorrt target reads."""
    return _export(tiny_llama_dir, tmp_path_factory, "standard")


@pytest.fixture(params=["gqa", "standard"])
def tiny_any_dir(request, tiny_onnx_dir, tiny_onnx_standard_dir) -> Path:
    """Both graph layouts: the runtime must give the same answers on either."""
    return tiny_onnx_dir if request.param == "gqa" else tiny_onnx_standard_dir
