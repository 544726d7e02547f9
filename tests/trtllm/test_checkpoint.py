"""Checkpoint export + fix-ups, contract check and reference numerics on tiny models; mutations must fail."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import ForgeError
from pipeline.eval.metrics import compare_logits
from pipeline.modelinfo import ModelInfo
from pipeline.trtllm.checkpoint import write_checkpoint
from pipeline.trtllm.contract import check_contract
from pipeline.trtllm.reference import LABEL, ReferenceModel

from trtllm_tiny import edit, hf_logits, int8_sq, tiny_qwen2, tokens


# ------------------------------------------------------------------ fix-ups + contract
def test_qwen_config_fixups(qwen_fp16_tp2_pp2):
    hf, _, ckpt, met = qwen_fp16_tp2_pp2
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architecture"] == "Qwen2ForCausalLM" and cfg["qwen_type"] == "qwen2"
    assert cfg["rotary_base"] == 1e6 and cfg["rotary_scaling"] is None and cfg["attn_bias"] is True
    assert cfg["mapping"]["tp_size"] == 2 and cfg["mapping"]["pp_size"] == 2 and cfg["mapping"]["world_size"] == 4
    assert cfg["num_key_value_heads"] == 1 and cfg["vocab_size"] == 301   # originals, not duplicated / padded
    assert met["ranks"] == 4 and met["seconds"] > 0 and met["peak_rss_bytes"] >= met["start_rss_bytes"]
    assert check_contract(ckpt, hf_config=json.loads((hf / "config.json").read_text())) == []


def test_llama_sq_config_and_contract(llama_sq_tp3):
    hf, _, _, ckpt = llama_sq_tp3
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["rotary_base"] == 1e5 and cfg["architecture"] == "LlamaForCausalLM" and cfg["attn_bias"] is False
    assert cfg["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    assert cfg["quantization"]["kv_cache_quant_algo"] == "INT8"
    assert check_contract(ckpt, hf_config=json.loads((hf / "config.json").read_text())) == []
    sd = load_file(str(ckpt / "rank1.safetensors"))
    assert sd["transformer.layers.0.attention.qkv.weight"].dtype == torch.int8
    assert tuple(sd["transformer.layers.0.attention.qkv.weight"].shape) == ((2 + 2 * 1) * 16, 96)
    assert tuple(sd["lm_head.weight"].shape) == (101, 96)                # 301 padded to 303, / 3


def test_int8_sq_kv_duplication_refused(tmp_path):
    m = int8_sq(tiny_qwen2(tmp_path / "hf"))
    with pytest.raises(ForgeError, match=r"quantize.algo: int8_sq with build.tensorrt_llm.tp=2 > 1 KV heads"):
        write_checkpoint(m, ModelInfo.from_dir(tmp_path / "hf"), tmp_path / "hf", tmp_path / "c", tp=2,
                         quant={"algo": "int8_sq"})


# ------------------------------------------------------------------ reference numerics
def test_reference_fp16_tp2_pp2_matches_hf(qwen_fp16_tp2_pp2):
    _, m, ckpt, _ = qwen_fp16_tp2_pp2
    ids = tokens()
    ref = ReferenceModel(ckpt)
    assert ref.label == LABEL == "checkpoint, reference numerics"
    r = compare_logits(hf_logits(m, ids), ref.logits(ids), ids)
    assert r["top1_agreement"] >= 0.99, r
    assert abs(r["ppl_delta_pct"]) < 0.5 and r["logits_cosine"] > 0.9999, r


def test_reference_int8_sq_tp3_matches_fake_quant(llama_sq_tp3):
    _, fp32, q, ckpt = llama_sq_tp3
    ids = tokens()
    sim = hf_logits(q, ids)                      # ModelOpt's own simulation of the quantized model
    ref = ReferenceModel(ckpt).logits(ids)
    r = compare_logits(sim, ref, ids)
    # random tiny weights give near-flat distributions, so compare logits, not argmax flips
    assert r["logits_cosine"] > 0.998 and abs(r["ppl_delta_pct"]) < 1.0, r
    # perplexity delta vs FP32 within 1 point of the simulated figure (the brief's gate)
    ref32 = hf_logits(fp32, ids)
    d_sim = compare_logits(ref32, sim, ids)["ppl_delta_pct"]
    d_ckpt = compare_logits(ref32, ref, ids)["ppl_delta_pct"]
    assert abs(d_ckpt - d_sim) < 1.0, (d_sim, d_ckpt)


# ------------------------------------------------------------------ mutations the checks must catch
def test_wrong_tp_split_dim_fails_contract(qwen_fp16_tp2_pp2, mutable):
    ckpt = mutable(qwen_fp16_tp2_pp2[2])
    name = "transformer.layers.0.attention.dense.weight"        # row-parallel: split on dim 1
    shards = [load_file(str(ckpt / f"rank{r}.safetensors"))[name] for r in (0, 1)]
    full = torch.cat(shards, dim=1)
    edit(ckpt / "rank0.safetensors", lambda sd: sd.__setitem__(name, full.chunk(2, dim=0)[0].contiguous()))
    p = check_contract(ckpt)
    assert any(name in x and "shape [32, 64] != expected [64, 32]" in x and "row-parallel" in x for x in p), p


def test_swapped_tp_shards_fail_numerics(qwen_fp16_tp2_pp2, mutable):
    _, m, src, _ = qwen_fp16_tp2_pp2
    ckpt = mutable(src)
    name = "transformer.layers.1.mlp.fc.weight"                 # same shape on both ranks: contract can't see it
    a = load_file(str(ckpt / "rank0.safetensors"))[name]
    b = load_file(str(ckpt / "rank1.safetensors"))[name]
    edit(ckpt / "rank0.safetensors", lambda sd: sd.__setitem__(name, b))
    edit(ckpt / "rank1.safetensors", lambda sd: sd.__setitem__(name, a))
    assert check_contract(ckpt) == []
    ids = tokens()
    r = compare_logits(hf_logits(m, ids), ReferenceModel(ckpt).logits(ids), ids)
    assert r["top1_agreement"] < 0.99, r


@pytest.mark.parametrize("tensor", ["prequant_scaling_factor", "weights_scaling_factor"])
def test_inverted_scale_direction_fails_numerics(llama_sq_tp3, mutable, tensor):
    _, _, q, src = llama_sq_tp3
    ckpt = mutable(src)
    for r in range(3):
        edit(ckpt / f"rank{r}.safetensors",
             lambda sd: [sd.__setitem__(k, (1.0 / sd[k].float()).to(sd[k].dtype))
                         for k in list(sd) if k.endswith(tensor) and "layers.0.mlp" in k])
    assert check_contract(ckpt) == []                            # still positive and finite
    ids = tokens()
    r = compare_logits(hf_logits(q, ids), ReferenceModel(ckpt).logits(ids), ids)
    assert r["logits_cosine"] < 0.99 and abs(r["ppl_delta_pct"]) > 1.0, r


def test_renamed_tensor_fails_contract(llama_sq_tp3, mutable):
    ckpt = mutable(llama_sq_tp3[3])
    old, new = "transformer.layers.1.mlp.gate.weight", "transformer.layers.1.mlp.up.weight"
    edit(ckpt / "rank2.safetensors", lambda sd: sd.__setitem__(new, sd.pop(old)))
    p = check_contract(ckpt)
    assert any(x.startswith(f"rank2.safetensors: {old}: required tensor missing") for x in p), p
    assert any(x.startswith(f"rank2.safetensors: {new}: unexpected tensor") for x in p), p


def test_unpadded_vocab_and_dtype_fail_contract(llama_sq_tp3, mutable):
    ckpt = mutable(llama_sq_tp3[3])
    edit(ckpt / "rank1.safetensors", lambda sd: sd.__setitem__("lm_head.weight", sd["lm_head.weight"][:100].clone()))
    edit(ckpt / "rank0.safetensors", lambda sd: sd.__setitem__(
        "transformer.layers.0.mlp.proj.weights_scaling_factor",
        sd["transformer.layers.0.mlp.proj.weights_scaling_factor"].half()))
    p = check_contract(ckpt)
    assert any("rank1.safetensors: lm_head.weight: shape [100, 96] != expected [101, 96]" in x and "vocab padded" in x
               for x in p), p
    assert any("mlp.proj.weights_scaling_factor: dtype F16 not in ['F32']" in x for x in p), p


def test_missing_fixups_and_ranks_fail_contract(qwen_fp16_tp2_pp2, mutable):
    hf, _, src, _ = qwen_fp16_tp2_pp2
    ckpt = mutable(src)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["rotary_base"], cfg["qwen_type"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    p = check_contract(ckpt)
    assert any("'rotary_base' missing" in x and "default rotary_base 10000" in x for x in p), p
    cfg["rotary_base"] = 10000.0
    (ckpt / "config.json").write_text(json.dumps(cfg))
    p = check_contract(ckpt, hf_config=json.loads((hf / "config.json").read_text()))
    assert any("qwen_type None missing or invalid" in x for x in p), p
    cfg["qwen_type"] = "qwen2"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    p = check_contract(ckpt, hf_config=json.loads((hf / "config.json").read_text()))
    assert p == ["config.json: rotary_base 10000.0 != source model's 1000000.0 (rule §1.2/§3: the config keeps the HF values)"]
    (ckpt / "rank3.safetensors").unlink()
    assert "rank3.safetensors: missing; mapping.world_size is 4 (rule §1.1: one file per rank)" in check_contract(ckpt)


def test_pp_layer_moved_fails_contract(qwen_fp16_tp2_pp2, mutable):
    ckpt = mutable(qwen_fp16_tp2_pp2[2])
    # a global layer index on the second stage (layers must be local: 0..1 there, §1.5)
    edit(ckpt / "rank2.safetensors", lambda sd: [sd.__setitem__(k.replace("layers.1.", "layers.3."), sd.pop(k))
                                                 for k in [k for k in sd if ".layers.1." in k]])
    p = check_contract(ckpt)
    assert any("rank2.safetensors: transformer.layers.3.attention.qkv.weight: unexpected tensor" in x for x in p), p
    assert any("rank2.safetensors: transformer.layers.1.attention.qkv.weight: required tensor missing" in x for x in p), p


def test_kv_cache_scale_used_in_generation_semantics(llama_sq_tp3, mutable):
    ckpt = mutable(llama_sq_tp3[3])
    ids = tokens()
    base_gen = ReferenceModel(ckpt).logits(ids)
    base_ctx = ReferenceModel(ckpt, kv_cache="context").logits(ids)
    for r in range(3):   # a 20x too large KV scale: int8 K/V lose nearly all resolution
        edit(ckpt / f"rank{r}.safetensors", lambda sd: [sd.__setitem__(k, sd[k] * 20) for k in list(sd)
                                                       if k.endswith("kv_cache_scaling_factor")])
    assert torch.equal(ReferenceModel(ckpt, kv_cache="context").logits(ids), base_ctx)
    gen = ReferenceModel(ckpt).logits(ids)
    assert torch.equal(gen[:, 0], base_gen[:, 0])               # position 0 has no cached tokens
    assert (gen[:, 1:] - base_gen[:, 1:]).abs().max() > 1e-2


def test_weight_only_int8_exports_float_weights(tmp_path):
    m = tiny_qwen2(tmp_path / "hf")
    ids = tokens()
    ref32 = hf_logits(m, ids)
    write_checkpoint(m, ModelInfo.from_dir(tmp_path / "hf"), tmp_path / "hf", tmp_path / "c", tp=2,
                     quant={"algo": "int8_wo"})
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "W8A16"
    assert load_file(str(tmp_path / "c" / "rank0.safetensors"))["transformer.layers.0.mlp.fc.weight"].dtype == torch.float16
    assert check_contract(tmp_path / "c") == []
    r = compare_logits(ref32, ReferenceModel(tmp_path / "c").logits(ids), ids)
    assert r["logits_cosine"] > 0.999 and abs(r["ppl_delta_pct"]) < 1, r


def test_weight_only_export_keeps_the_kv_cache_scales(tmp_path):
    """int8_wo / int4_wo / int4_zp export float linears, but a quantized KV cache keeps its scales and algo (the
    export once disabled the k/v BMM quantizers with the linears' and wrote a checkpoint without KV quantization)."""
    import modelopt.torch.quantization as mtq

    from trtllm_tiny import modelopt_config
    m = tiny_qwen2(tmp_path / "hf")
    info = ModelInfo.from_dir(tmp_path / "hf")
    q = {"algo": "int8_wo", "kv_cache": "int8"}
    calib = tokens(4, 32, seed=11)
    mtq.quantize(m, modelopt_config(q, info), lambda mm: [mm(calib[i:i + 2]) for i in range(0, 4, 2)])
    write_checkpoint(m, info, tmp_path / "hf", tmp_path / "c", dtype="float16", tp=1, quant=q)
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "W8A16" and cfg["quantization"]["kv_cache_quant_algo"] == "INT8"
    sd = load_file(str(tmp_path / "c" / "rank0.safetensors"))
    assert sd["transformer.layers.0.attention.kv_cache_scaling_factor"].item() > 0
    assert sd["transformer.layers.0.mlp.fc.weight"].dtype == torch.float16        # the linears stay float
    assert check_contract(tmp_path / "c") == []
