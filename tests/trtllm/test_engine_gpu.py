"""GPU only: build real TensorRT-LLM engines from forge checkpoints and check them against FP32 and against
the checkpoint's reference numerics. Skipped where tensorrt_llm or a CUDA GPU is missing (our CI machines)."""

from __future__ import annotations

import copy
import importlib.util
import shutil

import pytest
import torch

from trtllm_tiny import int8_sq, tiny_llama, tiny_qwen2

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


def _engine(model, hf, tmp_path, quant, build=BUILD, tp=1, name="engine"):
    from pipeline.modelinfo import ModelInfo
    from pipeline.trtllm.build import build_engine
    from pipeline.trtllm.build_config import trtllm_build_args
    from pipeline.trtllm.contract import check_contract
    ckpt, eng = tmp_path / f"ckpt-tp{tp}", tmp_path / name
    from pipeline.trtllm.checkpoint import write_checkpoint
    if not ckpt.exists():
        write_checkpoint(model, ModelInfo.from_dir(hf), hf, ckpt, dtype="float16", tp=tp, pp=1, quant=quant)
    assert check_contract(ckpt) == []
    m = build_engine(ckpt, eng, trtllm_build_args(build, ckpt, eng, None, eng / "timing.cache"))
    assert m["engines"] == [f"rank{r}.engine" for r in range(tp)] and (eng / "trtllm-build.cmd").exists()
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


def test_session_loads_once_and_serves_logits_and_generation(tmp_path):
    """One EngineSession answers repeated chunks and a greedy generation; the tokens follow the logits' argmax."""
    from pipeline.trtllm.runtime import EngineSession
    fp32 = tiny_llama(tmp_path / "hf")
    _, eng = _engine(copy.deepcopy(fp32), tmp_path / "hf", tmp_path, {"algo": "none"})
    ids = torch.randint(0, fp32.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with EngineSession(eng) as s:
        a, b = s.context_logits(ids), s.context_logits(ids)
        assert a.shape == (2, 32, fp32.config.vocab_size) and torch.equal(a, b)
        prompt = ids[0, :8].tolist()
        gen = s.generate(prompt, 4)
        first = s.context_logits(torch.tensor([prompt]))[0, -1].argmax().item()
    assert len(gen) == 4 and gen[0] == first


def test_logits_dtype_float32_stores_the_same_values(tmp_path):
    """Why recipes use --logits_dtype float16: the lm_head GEMM output is already float16, float32 only widens it."""
    from pipeline.trtllm.runtime import engine_outputs
    fp32 = tiny_llama(tmp_path / "hf")
    _, e16 = _engine(copy.deepcopy(fp32), tmp_path / "hf", tmp_path, {"algo": "none"},
                     dict(BUILD, logits_dtype="float16"), name="e16")
    _, e32 = _engine(copy.deepcopy(fp32), tmp_path / "hf", tmp_path, {"algo": "none"},
                     dict(BUILD, logits_dtype="float32"), name="e32")
    ids = torch.randint(0, fp32.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    l16, l32 = engine_outputs(e16, ids)["context_logits"], engine_outputs(e32, ids)["context_logits"]
    assert torch.equal(l32, l32.half().float())          # every float32 logit is a float16 value
    assert (l16 - l32).abs().max().item() <= 1e-3 * l32.abs().max().item()


@pytest.mark.skipif(torch.cuda.device_count() < 2 or shutil.which("mpirun") is None, reason="needs 2 GPUs and mpirun")
def test_tp2_engine_one_mpirun_for_the_session(tmp_path):
    from pipeline.eval.metrics import compare_logits
    from pipeline.trtllm.runtime import EngineSession
    fp32 = tiny_qwen2(tmp_path / "hfq")   # 4 heads / 1 KV head: tp 2 (the tiny Llama's 6/3 heads need tp 3)
    _, eng = _engine(copy.deepcopy(fp32), tmp_path / "hfq", tmp_path, {"algo": "none"}, tp=2)
    ids = torch.randint(0, fp32.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = fp32(ids).logits.float()
    with EngineSession(eng) as s:
        got = [s.context_logits(ids) for _ in range(3)]
        worker = s._worker
        assert worker is not None and worker.proc.poll() is None     # one mpirun, still serving
    assert worker.proc.returncode == 0
    assert torch.equal(got[0], got[2])
    assert compare_logits(ref, got[0][..., :ref.shape[-1]], ids)["top1_agreement"] >= 0.99


def test_deploy_engine_agrees_with_the_evaluation_engine(tmp_path):
    """Issue 27: one checkpoint, two engines that differ only in --gather_context_logits; the deploy engine's greedy
    tokens equal the evaluation engine's, and engines_record accepts the pair."""
    import json

    from pipeline.trtllm.agreement import engines_record, greedy_agreement, greedy_tokens
    fp32 = tiny_llama(tmp_path / "hf")
    _, ev = _engine(copy.deepcopy(fp32), tmp_path / "hf", tmp_path, {"algo": "none"})
    _, de = _engine(copy.deepcopy(fp32), tmp_path / "hf", tmp_path, {"algo": "none"},
                    build=BUILD | {"gather_context_logits": False}, name="engine-deploy")
    rec = engines_record(json.loads((ev / "config.json").read_text()), json.loads((de / "config.json").read_text()))
    assert list(rec["differ_in"].values()) == [[True, False]]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, fp32.config.vocab_size, (24,), generator=g).tolist() for _ in range(3)]
    res = greedy_agreement(greedy_tokens(ev, prompts, 16), greedy_tokens(de, prompts, 16), 1.0)
    assert res["agreement"] == 1.0 and res["positions"] == 48
