"""Fixtures: tiny checkpoints for the TensorRT-LLM target tests."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("FORGE_PROGRESS", "0")

from trtllm_tiny import int8_sq, tiny_llama, tiny_qwen2  # noqa: E402


@pytest.fixture(scope="session")
def qwen_fp16_tp2_pp2(tmp_path_factory):
    """(hf_dir, fp32 model, checkpoint dir, write metrics) for the tiny Qwen2, fp16, tp 2 x pp 2."""
    from pipeline.modelinfo import ModelInfo
    from pipeline.trtllm.checkpoint import write_checkpoint
    root = tmp_path_factory.mktemp("qwen")
    m = tiny_qwen2(root / "hf")
    met = write_checkpoint(m, ModelInfo.from_dir(root / "hf"), root / "hf", root / "ckpt", dtype="float16",
                           tp=2, pp=2, quant={"algo": "none"})
    return root / "hf", m, root / "ckpt", met


@pytest.fixture(scope="session")
def llama_sq_tp3(tmp_path_factory):
    """(hf_dir, fp32 model, fake-quant model, checkpoint dir) for the tiny Llama, int8_sq + INT8 KV, tp 3."""
    from pipeline.modelinfo import ModelInfo
    from pipeline.trtllm.checkpoint import write_checkpoint
    root = tmp_path_factory.mktemp("llama")
    fp32 = tiny_llama(root / "hf")
    q = int8_sq(copy.deepcopy(fp32), kv_int8=True)
    write_checkpoint(q, ModelInfo.from_dir(root / "hf"), root / "hf", root / "ckpt", dtype="float16", tp=3, pp=1,
                     quant={"algo": "int8_sq", "kv_cache": "int8"})
    return root / "hf", fp32, q, root / "ckpt"


@pytest.fixture(scope="session")
def qwen_sq_tp2(tmp_path_factory):
    """Checkpoint dir of a tiny Qwen2 with 2 KV heads, int8_sq + INT8 KV, tp 2: the 7B tp 2 case's shape in small."""
    from pipeline.modelinfo import ModelInfo
    from pipeline.trtllm.checkpoint import write_checkpoint
    root = tmp_path_factory.mktemp("qwen_sq")
    q = int8_sq(tiny_qwen2(root / "hf", kv_heads=2), kv_int8=True)
    write_checkpoint(q, ModelInfo.from_dir(root / "hf"), root / "hf", root / "ckpt", dtype="float16", tp=2, pp=1,
                     quant={"algo": "int8_sq", "kv_cache": "int8"})
    return root / "ckpt"


@pytest.fixture
def mutable(tmp_path):
    """Copy a checkpoint dir to a scratch place so a test can mutate it."""
    def _copy(src: Path) -> Path:
        dst = tmp_path / "mut"
        shutil.copytree(src, dst)
        return dst
    return _copy
