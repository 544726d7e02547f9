"""Fixtures: a tiny random Llama exported by forge's ONNX export (seconds), for the tensorrt target's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("FORGE_PROGRESS", "0")


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory) -> Path:
    """forge's KV-cache ONNX export of a 2-layer Llama (hidden 96, GQA 6/3, vocab 320, tied embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.ort.export import export_onnx

    torch.manual_seed(2)
    cfg = LlamaConfig(hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                      intermediate_size=160, vocab_size=320, max_position_embeddings=512, tie_word_embeddings=True,
                      initializer_range=0.2)
    hf = tmp_path_factory.mktemp("tiny_hf")
    LlamaForCausalLM(cfg).eval().save_pretrained(hf)
    out = tmp_path_factory.mktemp("tiny_export")
    export_onnx(hf, out, opset=18, attention="standard",   # the tensorrt target's graph (recipe.export_attention)
                parity={"fp32": {"atol": 1e-4, "rtol": 1e-4}})
    return out


@pytest.fixture(scope="session")
def calib_ids():
    import numpy as np
    return np.random.default_rng(0).integers(0, 320, size=(8, 32), dtype=np.int64)
