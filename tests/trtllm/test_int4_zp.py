"""int4_zp: groupwise int4 with zero points in the W4A16_AWQ layout TensorRT-LLM 1.2 loads (has_zero_point on,
pre_quant_scale off) -- the grid, the rewrite, the contract, the reference numerics, and the plan-time refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.eval.metrics import compare_logits
from pipeline.modelinfo import ModelInfo
from pipeline.quant import zero_point
from pipeline.trtllm import zp_grid
from pipeline.recipe import QuantizeSection
from pipeline.trtllm.build_config import validate_build
from pipeline.trtllm.checkpoint import write_checkpoint
from pipeline.trtllm.contract import check_contract
from pipeline.trtllm.int4_zp import pack, unpack
from pipeline.trtllm.quantizers import QUANTIZERS
from pipeline.trtllm.reference import ReferenceModel

from trtllm_tiny import (as_float32_checkpoint, edit, hf_logits, modelopt_config, mutated_contract, tiny_llama_g64,
                         tiny_qwen2, tokens, torch_model_from_checkpoint)

Q = {"algo": "int4_zp", "block_size": 64}
LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


def quantize(model, q, info):
    import modelopt.torch.quantization as mtq
    calib = tokens(8, 32, seed=11)
    mtq.quantize(model, modelopt_config(q, info), lambda m: [m(calib[i:i + 2]) for i in range(0, 8, 2)])
    assert zero_point.asymmetric_weights(model) == 7 * len(model.model.layers)
    return model


@pytest.fixture(scope="module")
def llama_zp(tmp_path_factory):
    """Tiny Llama with widths groupwise int4 takes; int4_zp g64 checkpoints at tp 1 and tp 2 (+ INT8 KV)."""
    root = tmp_path_factory.mktemp("int4_zp")
    fp32 = tiny_llama_g64(root / "hf")
    info = ModelInfo.from_dir(root / "hf")
    zq = quantize(copy.deepcopy(fp32), Q, info)
    write_checkpoint(zq, info, root / "hf", root / "tp1", dtype="float16", tp=1, quant=Q)
    zkv = quantize(copy.deepcopy(fp32), {**Q, "kv_cache": "int8"}, info)
    write_checkpoint(zkv, info, root / "hf", root / "tp2", dtype="float16", tp=2, quant={**Q, "kv_cache": "int8"})
    return root, fp32, zq


def decode(sd, prefix):
    """The groupwise GEMM's weight from the stored tensors, written out here (independent of reference.py):
    low nibble = even output row, two's complement int4, w = q * scale + zero per group of the input."""
    b = sd[prefix + ".weight"].view(torch.uint8).to(torch.int32)
    q = torch.empty(b.shape[0] * 2, b.shape[1], dtype=torch.int32)
    q[0::2], q[1::2] = b & 15, b >> 4
    q = torch.where(q > 7, q - 16, q).float()
    s = sd[prefix + ".weights_scaling_factor"].float()                 # [out, in / g]
    z = sd[prefix + ".zero"].float().t()                               # stored [in / g, out]
    g = q.shape[1] // s.shape[1]
    return q * s.repeat_interleave(g, dim=1) + z.repeat_interleave(g, dim=1)


# ------------------------------------------------------------------ the grid
def test_grid_holds_an_asymmetric_block_exactly_and_a_symmetric_one_cannot():
    """Weights made the Q4_1 way (codes 0..15 times d plus m, every code used): the zero-point grid gives them back
    exactly, a symmetric int4 grid of the same group does not -- the reason SmolLM2's numbers flatter int4_zp."""
    g = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.randperm(64, generator=g) % 16 for _ in range(8)]).float()   # 8 rows, one group
    d, m = torch.rand(8, 1, generator=g) * 0.01 + 0.001, torch.randn(8, 1, generator=g) * 0.05
    w = codes * d + m
    q, s, z = zp_grid.quantize(w, 64)
    torch.testing.assert_close(zp_grid.dequantize(q, s, z), w, rtol=0, atol=1e-7)
    assert q.min() == -8 and q.max() == 7
    sym = w.abs().amax(1, keepdim=True) / 7
    err_sym = ((w / sym).round().clamp(-8, 7) * sym - w).abs().max()
    assert err_sym > 1e-4


def test_grid_rounded_to_the_model_dtype_picks_codes_against_the_stored_values():
    w = torch.randn(4, 128) * 0.02
    q, s, z = zp_grid.quantize(w, 64, torch.float16)
    assert torch.equal(s, s.half().float()) and torch.equal(z, z.half().float())
    best = torch.round((w.reshape(4, 2, 64) - z[..., None]) / s[..., None]).clamp(-8, 7).reshape(4, 128)
    assert torch.equal(q.float(), best)
    const = torch.full((2, 64), 0.3)                                   # a constant group stays itself
    qc, sc, zc = zp_grid.quantize(const, 64, torch.float16)
    torch.testing.assert_close(zp_grid.dequantize(qc, sc, zc), const, rtol=0, atol=1e-3)


def test_packing_is_modelopts_and_round_trips():
    q = torch.tensor([[-8, 7, 0], [1, -1, 3]], dtype=torch.int8)      # rows 0 and 1 share one byte per column
    p = pack(q)
    assert p.shape == (1, 3) and p.dtype == torch.int8
    assert p.view(torch.uint8).tolist() == [[0x18, 0xF7, 0x30]]       # low nibble row 0, high nibble row 1
    r = torch.randint(-8, 8, (6, 64), dtype=torch.int8)
    assert torch.equal(unpack(pack(r)), r)


# ------------------------------------------------------------------ the checkpoint
def test_layout_and_contract(llama_zp):
    root = llama_zp[0]
    hf = json.loads((root / "hf" / "config.json").read_text())
    for ck, ranks in (("tp1", 1), ("tp2", 2)):
        cfg = json.loads((root / ck / "config.json").read_text())
        q = cfg["quantization"]
        assert (q["quant_algo"], q["group_size"], q["has_zero_point"], q["pre_quant_scale"]) == ("W4A16_AWQ", 64,
                                                                                                 True, False)
        assert q["exclude_modules"] == ["lm_head"]
        assert check_contract(root / ck, hf_config=hf) == []
        for r in range(ranks):
            sd = load_file(str(root / ck / f"rank{r}.safetensors"))
            for lin in LINEARS:
                p = f"transformer.layers.0.{lin}."
                w, s, z = sd[p + "weight"], sd[p + "weights_scaling_factor"], sd[p + "zero"]
                o, i = w.shape[0] * 2, w.shape[1]
                assert w.dtype == torch.int8 and s.shape == (o, i // 64) and z.shape == (i // 64, o)
                assert s.dtype == z.dtype == torch.float16 and (s > 0).all()
                assert p + "prequant_scaling_factor" not in sd
    sd = load_file(str(root / "tp2" / "rank1.safetensors"))
    assert sd["transformer.layers.0.attention.kv_cache_scaling_factor"].dtype == torch.float32   # KV scales kept


def test_reference_is_the_fake_quantized_torch_model_of_the_checkpoint(llama_zp, tmp_path):
    root = llama_zp[0]
    m = torch_model_from_checkpoint(root / "hf", root / "tp1", decode)
    ids = tokens()
    got = ReferenceModel(as_float32_checkpoint(root / "tp1", tmp_path / "f32"), device="cpu").logits(ids)
    torch.testing.assert_close(got, hf_logits(m, ids), rtol=0, atol=2e-4)


def test_checkpoint_carries_the_simulations_codes(llama_zp):
    """The export writes the grid's own weights (zp_grid.on_grid), so the rewrite recovers the simulation's codes
    and only scale and zero are rounded to fp16: the checkpoint matches the quantize stage's simulation closely."""
    root, fp32, zq = llama_zp
    ids = tokens()
    sim = hf_logits(zq, ids)
    for ck in ("tp1", "tp2"):
        r = compare_logits(sim, ReferenceModel(root / ck, device="cpu", kv_cache="context").logits(ids), ids)
        assert r["logits_cosine"] > 0.9999 and r["top1_agreement"] >= 0.98, (ck, r)
    # and the simulation quantizes (it is not the float model)
    assert compare_logits(hf_logits(fp32, ids), sim, ids)["logits_cosine"] < 0.9999


def test_qwen2_bias_and_tp2(tmp_path):
    fp32 = tiny_qwen2(tmp_path / "hf", kv_heads=2, hidden=128)
    info = ModelInfo.from_dir(tmp_path / "hf")
    zq = quantize(copy.deepcopy(fp32), Q, info)
    write_checkpoint(zq, info, tmp_path / "hf", tmp_path / "c", dtype="float16", tp=2, quant=Q)
    assert check_contract(tmp_path / "c", hf_config=json.loads((tmp_path / "hf" / "config.json").read_text())) == []
    sd = load_file(str(tmp_path / "c" / "rank1.safetensors"))
    assert sd["transformer.layers.0.attention.qkv.bias"].dtype == torch.float16      # bias kept as exported
    ids = tokens()
    r = compare_logits(hf_logits(zq, ids), ReferenceModel(tmp_path / "c", device="cpu").logits(ids), ids)
    assert r["logits_cosine"] > 0.9999, r


# ------------------------------------------------------------------ mutations the checks must catch
@pytest.mark.parametrize("mutate,expect", [
    (lambda sd: sd.__setitem__("transformer.layers.0.mlp.fc.zero", sd["transformer.layers.0.mlp.fc.zero"].t()
                               .contiguous()), "mlp.fc.zero: shape"),
    (lambda sd: sd.__setitem__("transformer.layers.1.attention.qkv.weights_scaling_factor",
                               sd["transformer.layers.1.attention.qkv.weights_scaling_factor"].t().contiguous()),
     "qkv.weights_scaling_factor: shape"),
    (lambda sd: sd.pop("transformer.layers.0.mlp.proj.zero"), "proj.zero: required tensor missing"),
    (lambda sd: sd.__setitem__("transformer.layers.0.mlp.gate.prequant_scaling_factor", torch.ones(128).half()),
     "prequant_scaling_factor: unexpected tensor"),
    (lambda sd: sd.__setitem__("transformer.layers.0.attention.dense.weight",
                               unpack(sd["transformer.layers.0.attention.dense.weight"])), "dense.weight: shape"),
])
def test_contract_catches(llama_zp, mutable, mutate, expect):
    p = mutated_contract(mutable, llama_zp[0] / "tp2", 1, mutate)
    assert any(x.startswith("rank1.safetensors") and expect in x for x in p), p


def test_negated_zero_passes_the_contract_and_fails_numerics(llama_zp, mutable):
    root, _, zq = llama_zp
    ckpt = mutable(root / "tp1")
    edit(ckpt / "rank0.safetensors", lambda sd: [sd.__setitem__(k, -sd[k]) for k in list(sd)
                                                  if k.endswith("mlp.proj.zero")])
    assert check_contract(ckpt) == []
    ids = tokens()
    r = compare_logits(hf_logits(zq, ids), ReferenceModel(ckpt, device="cpu").logits(ids), ids)
    assert r["logits_cosine"] < 0.99, r


def test_group_sizes_the_kernel_lacks_fail_the_contract(llama_zp, mutable):
    ckpt = mutable(llama_zp[0] / "tp1")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization"]["group_size"] = 32
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert any("group_size 32" in x and "64 or 128" in x for x in check_contract(ckpt))


# ------------------------------------------------------------------ plan time
SMOL = ModelInfo.bundled("HuggingFaceTB/SmolLM2-135M-Instruct")
BUILD = {"dtype": "float16", "tp": 1, "use_fused_mlp": False}


ZP = QUANTIZERS["int4_zp"]


def plan(block_size=None, info=SMOL) -> list[str]:
    q = QuantizeSection(algo="int4_zp", block_size=block_size)
    return ZP.plan_problems(q, ZP.options_of(q), info)


def test_block_size_defaults_and_refusals():
    q = QuantizeSection(algo="int4_zp")
    assert ZP.record(q, ZP.options_of(q), SMOL)["block_size"] == 64                   # 576 = 4.5 x 128
    assert ZP.group_size(ZP.options_of(q), ModelInfo.bundled("Qwen/Qwen2.5-7B-Instruct")) == 128
    # the symmetric int4 algos keep their own default on SmolLM2 (96: a size the groupwise GEMM does not take)
    assert QUANTIZERS["int4_wo"].group_size(QUANTIZERS["int4_wo"].options_of(QuantizeSection(algo="int4_wo")),
                                            SMOL) == 96
    p = plan(32)
    assert any(x.startswith("quantize.block_size: 32 is not a group size TensorRT-LLM's groupwise int4 GEMM takes")
               and "use 64" in x for x in p), p
    p = plan(128)
    assert any(x.startswith("quantize.block_size: 128 must be a multiple of 32 dividing") and
               x.endswith("allowed for this model: 64") for x in p), p
    assert plan(64) == [] and plan() == []
    q = QuantizeSection(algo="int4_zp", block_size=64)
    assert ZP.checkpoint_quantization(ZP.options_of(q), q.kv_cache, SMOL) == {
        "quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": 64, "has_zero_point": True,
        "pre_quant_scale": False}
    assert not ZP.needs_calibration() and ZP.needs_calibration("int8")     # float export: only a KV cache calibrates


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mistral-7B-v0.1",
                                   "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-8B", "google/gemma-3-270m",
                                   "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_offered_for_every_family(model):
    """A linear swap (ColumnLinear / RowLinear -> WeightOnlyGroupwiseQuant*), so no family is refused for it."""
    info = ModelInfo.bundled(model)
    build = {**BUILD, "dtype": "bfloat16" if "gemma" in model else "float16"}
    assert validate_build(build, Q, info, 90) == []


def test_widths_the_groupwise_layers_would_pad_are_refused():
    p = validate_build({**BUILD, "tp": 3}, Q, SMOL, 90)               # 192 divides every SmolLM2 width
    assert p == []
    gemma = ModelInfo.bundled("google/gemma-3-270m")                   # hidden 640
    build = {**BUILD, "dtype": "bfloat16", "tp": 2}
    assert validate_build(build, Q, gemma, 90) == []                     # 128 divides every width
    p = validate_build(build, {"algo": "int4_zp", "block_size": 128}, gemma, 90)
    assert any(x.startswith("quantize.algo: int4_zp with quantize.block_size 128 and build.tensorrt_llm.tp=2")
               and "multiple of max(64, block_size) x tp = 256" in x and "640" in x for x in p), p


@pytest.mark.parametrize("sm,expect", [
    (75, "quantize.algo: int4_zp (W4A16_AWQ, groupwise int4) needs SM >= 80"),
    (100, "quantize.algo: int4_zp (W4A16_AWQ) is not supported by TensorRT-LLM on SM 100"),
])
def test_gpu_rules(sm, expect):
    p = validate_build(BUILD, Q, SMOL, sm)
    assert any(x.startswith(expect) for x in p), p


def test_quantize_stage_simulates_zero_points_and_saves_a_loadable_artifact(tmp_path):
    from pipeline.quant.artifact import restore_model
    from pipeline.quant.calibrate import quantize_model
    tiny_llama_g64(tmp_path / "hf")
    calib, ev = tokens(8, 32, seed=11), tokens(2, 48)
    q = {"method": "ptq", "calibration": {"samples": 8, "seq_len": 32, "batch": 2, "seed": 0}}
    zp = quantize_model(tmp_path / "hf", QuantizeSection(**q, **Q), calib, tmp_path / "a", eval_windows=ev)
    sym = quantize_model(tmp_path / "hf", QuantizeSection(**q, algo="int4_wo", block_size=64), calib,
                         tmp_path / "b", eval_windows=ev)
    assert zp["zero_point_quantizers"] == 14 and "zero_point_quantizers" not in sym
    assert zp["block_size"] == 64 and zp["trtllm_quantization"]["has_zero_point"] is True
    assert zp["ppl_ptq"] != sym["ppl_ptq"]
    # the artifact restores with torch's weights-only loader (no override pickled); its quantizers are ModelOpt's
    # symmetric ones again, yet the checkpoint is the zero-point format the stage measured (the gate's premise)
    m = restore_model(tmp_path / "hf", tmp_path / "a")
    write_checkpoint(m, ModelInfo.from_dir(tmp_path / "hf"), tmp_path / "hf", tmp_path / "c", tp=2,
                     quant={**q, **Q})
    assert check_contract(tmp_path / "c") == []
    from pipeline.eval.metrics import perplexity
    ppl_ckpt = perplexity(ReferenceModel(tmp_path / "c", device="cpu").logits(ev), ev)
    assert abs(ppl_ckpt / zp["ppl_ptq"] - 1) < 0.01, (ppl_ckpt, zp["ppl_ptq"], sym["ppl_ptq"])


def test_recipe_resolves_plans_and_is_refused_where_the_kernel_is_missing():
    from pipeline.trtllm.memory import plan_for_recipe
    from pipeline.recipe import resolve
    from pipeline.runner import Runner
    from pipeline.stages.tensorrt_llm import TrtllmBuildStage
    r = resolve("qwen7b-int4zp", [])
    assert (r.quantize.algo, r.quantize.block_size, r.build.tensorrt_llm.tp) == ("int4_zp", 128, 2)
    info = Runner(r).model_info()
    for sm in (80, 86, 89, 90):
        assert TrtllmBuildStage().plan_problems(resolve("qwen7b-int4zp", [f"build.tensorrt_llm.gpu_sm={sm}"]),
                                                info) == []
    for sm, why in ((75, "needs SM >= 80"), (100, "not supported by TensorRT-LLM on SM 100")):
        probs = TrtllmBuildStage().plan_problems(resolve("qwen7b-int4zp", [f"build.tensorrt_llm.gpu_sm={sm}"]), info)
        assert any(why in p for p in probs), probs
    plan, _ = plan_for_recipe(r, info, None)
    assert plan.weights["decoder linears"]["dtype"] == "int4"
    assert plan.weights["quant scales"]["bytes"] == 2 * plan.weights["decoder linears"]["params"] // 128 * 2
