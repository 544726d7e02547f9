"""GPU only: build real TensorRT-LLM engines from forge checkpoints and check them against FP32 and against
the checkpoint's reference numerics. Skipped where tensorrt_llm or a CUDA GPU is missing (our CI machines)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from trtllm_tiny import int8_sq, tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None, reason="tensorrt_llm is not installed"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]

BUILD = {"dtype": "float16", "max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 256,
         "kv_cache_type": "paged", "tokens_per_block": 32, "gemm_plugin": "auto", "gpt_attention_plugin": "auto",
         "context_fmha": True, "use_paged_context_fmha": True, "remove_input_padding": True, "use_fused_mlp": False,
         "reduce_fusion": False, "user_buffer": False, "multiple_profiles": False, "workers": 1,
         "gather_context_logits": True}


def _engine(model, hf, tmp_path, quant, build=BUILD):
    from pipeline.modelinfo import ModelInfo
    from pipeline.trtllm.build import build_engine
    from pipeline.trtllm.build_config import trtllm_build_args
    from pipeline.trtllm.contract import check_contract
    ckpt, eng = tmp_path / "ckpt", tmp_path / "engine"
    from pipeline.trtllm.checkpoint import write_checkpoint
    write_checkpoint(model, ModelInfo.from_dir(hf), hf, ckpt, dtype="float16", tp=1, pp=1, quant=quant)
    assert check_contract(ckpt) == []
    m = build_engine(ckpt, eng, trtllm_build_args(build, ckpt, eng, None, eng / "timing.cache"))
    assert m["engines"] == ["rank0.engine"] and (eng / "trtllm-build.cmd").exists()
    return ckpt, eng


def test_fp16_engine_matches_fp32(tmp_path):
    from pipeline.trtllm.runtime import LABEL, validate_engine
    fp32 = tiny_llama(tmp_path / "hf")
    ids = torch.randint(0, fp32.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = fp32(ids).logits.float()
    _, eng = _engine(copy.deepcopy(fp32), tmp_path / "hf", tmp_path, {"algo": "none"})
    res = validate_engine(eng, ref, ids)
    assert res["label"] == LABEL
    assert res["top1_agreement"] >= 0.99, res


def test_int8_sq_engine_matches_reference_numerics(tmp_path):
    from pipeline.eval.metrics import compare_logits
    from pipeline.trtllm.reference import ReferenceModel
    from pipeline.trtllm.runtime import engine_outputs
    fp32 = tiny_llama(tmp_path / "hf")
    q = int8_sq(copy.deepcopy(fp32), kv_int8=False)
    ckpt, eng = _engine(q, tmp_path / "hf", tmp_path, {"algo": "int8_sq"},
                        dict(BUILD, use_paged_context_fmha=True))
    ids = torch.randint(0, fp32.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = ReferenceModel(ckpt).logits(ids)
    got = engine_outputs(eng, ids)["context_logits"][..., :ref.shape[-1]]
    res = compare_logits(ref, got, ids)
    assert res["top1_agreement"] >= 0.95 and res["logits_cosine"] >= 0.99, res


def test_timing_cache_is_reused(tmp_path):
    from pipeline.trtllm.build import build_engine
    from pipeline.trtllm.build_config import trtllm_build_args
    fp32 = tiny_llama(tmp_path / "hf")
    ckpt, eng = _engine(copy.deepcopy(fp32), tmp_path / "hf", tmp_path, {"algo": "none"})
    eng2 = tmp_path / "engine2"
    m = build_engine(ckpt, eng2, trtllm_build_args(BUILD, ckpt, eng2, eng / "timing.cache", eng2 / "timing.cache"),
                     eng / "timing.cache")
    assert m["timing_cache_in"] and "--input_timing_cache" in m["command"]
