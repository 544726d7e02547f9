"""int8_sq_per_token: ModelOpt's SmoothQuant export rewritten into TensorRT-LLM's per-token plugin layout
(W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN), its contract, its reference numerics, and where it is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import ForgeError
from pipeline.eval.metrics import compare_logits
from pipeline.modelinfo import ModelInfo
from pipeline.recipe import QuantizeSection
from pipeline.trtllm.quantizers import QUANTIZERS
from pipeline.quant.per_token import per_token_activations, per_token_fake_quant
from pipeline.trtllm.build_config import validate_build
from pipeline.trtllm.checkpoint import write_checkpoint
from pipeline.trtllm.contract import check_contract
from pipeline.trtllm.reference import ReferenceModel
from pipeline.trtllm.sq_per_token import rewrite_rank

from trtllm_tiny import edit, hf_logits as logits, int8_sq, tiny_llama, tiny_qwen2, tokens

PT = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"


@pytest.fixture(scope="module")
def llama_pt(tmp_path_factory):
    """The tiny Llama (6 heads / 3 KV) quantized once; checkpoints of it at tp 3 in both layouts + INT8 KV, and
    the per-token ModelOpt simulation."""
    root = tmp_path_factory.mktemp("llama_pt")
    fp32 = tiny_llama(root / "hf")
    q = int8_sq(copy.deepcopy(fp32), kv_int8=True)
    info = ModelInfo.from_dir(root / "hf")
    write_checkpoint(q, info, root / "hf", root / "static", dtype="float16", tp=3,
                     quant={"algo": "int8_sq", "kv_cache": "int8"})
    write_checkpoint(q, info, root / "hf", root / "pt", dtype="float16", tp=3,
                     quant={"algo": "int8_sq_per_token", "kv_cache": "int8"})
    assert per_token_activations(q) == 2 * 7            # q/k/v, o, gate/up/down of 2 layers; lm_head stays off
    return root / "hf", fp32, q, root / "static", root / "pt"


def test_layout_is_the_plugin_path_and_passes_the_contract(llama_pt):
    hf, _, _, static, pt = llama_pt
    cfg = json.loads((pt / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == PT and cfg["quantization"]["kv_cache_quant_algo"] == "INT8"
    assert check_contract(pt, hf_config=json.loads((hf / "config.json").read_text())) == []
    for r in range(3):
        old, new = load_file(str(static / f"rank{r}.safetensors")), load_file(str(pt / f"rank{r}.safetensors"))
        assert not [k for k in new if k.endswith(("activation_scaling_factor", "prequant_scaling_factor",
                                                  "weights_scaling_factor"))]
        p = "transformer.layers.1."
        for lin in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
            assert torch.equal(new[p + lin + ".weight"], old[p + lin + ".weight"])      # the same int8 weights
            assert torch.equal(new[p + lin + ".per_channel_scale"], old[p + lin + ".weights_scaling_factor"][None])
        # qkv / fc+gate smoothing folded into the norm before them; dense / proj divide by 1 / prequant
        want = (old[p + "input_layernorm.weight"].float() * old[p + "attention.qkv.prequant_scaling_factor"].float())
        assert torch.equal(new[p + "input_layernorm.weight"], want.half())
        want = old[p + "post_layernorm.weight"].float() * old[p + "mlp.gate.prequant_scaling_factor"].float()
        assert torch.equal(new[p + "post_layernorm.weight"], want.half())
        for lin in ("attention.dense", "mlp.proj"):
            torch.testing.assert_close(new[p + lin + ".smoother"] * old[p + lin + ".prequant_scaling_factor"].float(),
                                       torch.ones_like(new[p + lin + ".smoother"]))
        assert p + "mlp.fc.smoother" not in new and p + "attention.qkv.smoother" not in new
        assert new[p + "input_layernorm.scale_to_int"].tolist() == [1.0]                 # unused per token
        assert torch.equal(new[p + "attention.kv_cache_scaling_factor"], old[p + "attention.kv_cache_scaling_factor"])


def test_reference_matches_modelopt_per_token_simulation(llama_pt):
    _, fp32, q, static, pt = llama_pt
    ids = tokens()
    sim = logits(q, ids)                                   # ModelOpt's model with per-token activations
    ref = ReferenceModel(pt).logits(ids)
    r = compare_logits(sim, ref, ids)
    # the bar of the static format's own test (test_checkpoint.py): what is left is the checkpoint's fp16 rounding
    assert r["logits_cosine"] > 0.998 and abs(r["ppl_delta_pct"]) < 1.0, r
    # the static checkpoint is a different format: it agrees with the per-token simulation less well
    r_static = compare_logits(sim, ReferenceModel(static).logits(ids), ids)
    assert r_static["logits_cosine"] < r["logits_cosine"], (r, r_static)


def test_rows_are_batch_invariant(llama_pt):
    """Per-token scales depend on the token only: a row alone and beside another row gives the same logits
    (the static per-tensor format shares its scale with nothing either; dynamic per-tensor would not)."""
    pt = llama_pt[4]
    ids = tokens(2, 40)
    ref = ReferenceModel(pt, kv_cache="context")
    alone = ref.logits(ids[:1])
    both = ref.logits(ids)
    assert torch.equal(alone[0], both[0])


def test_per_token_fake_quant_is_row_local():
    x = torch.tensor([[1000.0, 1.0, -3.0], [0.5, -0.25, 0.125], [0.0, 0.0, 0.0]])
    y = per_token_fake_quant(x)
    assert torch.equal(y[2], torch.zeros(3))                       # an all-zero row stays zero, no NaN
    torch.testing.assert_close(y[1], x[1], atol=0.5 / 127, rtol=0)  # its own small scale, not row 0's
    assert y[0, 1] == 0.0                                           # 1 is below half a step of 1000 / 127
    assert torch.equal(per_token_fake_quant(x[1:2]), y[1:2])


# ------------------------------------------------------------------ mutations the checks must catch
def test_inverted_smoother_fails_numerics(llama_pt, tmp_path):
    _, _, q, _, src = llama_pt
    import shutil
    ckpt = tmp_path / "m"
    shutil.copytree(src, ckpt)
    for r in range(3):
        edit(ckpt / f"rank{r}.safetensors", lambda sd: [sd.__setitem__(k, 1.0 / sd[k]) for k in list(sd)
                                                        if k.endswith("mlp.proj.smoother")])
    assert check_contract(ckpt) == []                               # still positive and finite
    ids = tokens()
    r = compare_logits(logits(q, ids), ReferenceModel(ckpt, kv_cache="context").logits(ids), ids)
    assert r["logits_cosine"] < 0.99, r


@pytest.mark.parametrize("mutate,expect", [
    (lambda sd: sd.pop("transformer.layers.0.post_layernorm.scale_to_int"), "scale_to_int: required tensor missing"),
    (lambda sd: sd.pop("transformer.layers.0.attention.dense.smoother"), "dense.smoother: required tensor missing"),
    (lambda sd: sd.__setitem__("transformer.layers.0.mlp.fc.per_channel_scale",
                               sd["transformer.layers.0.mlp.fc.per_channel_scale"].reshape(-1)), "fc.per_channel_scale: shape"),
    (lambda sd: sd.__setitem__("transformer.layers.0.mlp.fc.activation_scaling_factor", torch.ones(1)),
     "activation_scaling_factor: unexpected tensor"),
    (lambda sd: sd.__setitem__("transformer.layers.0.attention.dense.smoother",
                               -sd["transformer.layers.0.attention.dense.smoother"]), "not finite and > 0"),
])
def test_contract_catches(llama_pt, tmp_path, mutate, expect):
    import shutil
    ckpt = tmp_path / "m"
    shutil.copytree(llama_pt[4], ckpt)
    edit(ckpt / "rank1.safetensors", mutate)
    p = check_contract(ckpt)
    assert any(x.startswith("rank1.safetensors") and expect in x for x in p), p


def test_a_float_decoder_linear_is_refused_naming_the_exclude_key():
    sd = {"transformer.layers.0.attention.qkv.weight": torch.zeros(8, 4, dtype=torch.float16),
          "transformer.layers.0.attention.qkv.prequant_scaling_factor": torch.ones(4, dtype=torch.float16)}
    with pytest.raises(ForgeError, match="quantize.options.exclude"):
        rewrite_rank(sd, torch.float16, "rank0.safetensors")


def test_qwen2_bias_and_tp2_duplication_refused_like_int8_sq(tmp_path):
    m = int8_sq(tiny_qwen2(tmp_path / "hf"))                       # 1 KV head: tp 2 would duplicate it
    with pytest.raises(ForgeError, match=r"quantize.algo: int8_sq_per_token with build.tensorrt_llm.tp=2 > 1"):
        write_checkpoint(m, ModelInfo.from_dir(tmp_path / "hf"), tmp_path / "hf", tmp_path / "c", tp=2,
                         quant={"algo": "int8_sq_per_token"})
    write_checkpoint(m, ModelInfo.from_dir(tmp_path / "hf"), tmp_path / "hf", tmp_path / "c", tp=1,
                     quant={"algo": "int8_sq_per_token"})
    assert check_contract(tmp_path / "c") == []
    assert "transformer.layers.0.attention.qkv.bias" in load_file(str(tmp_path / "c" / "rank0.safetensors"))


# ------------------------------------------------------------------ plan time
@pytest.mark.parametrize("model", ["Qwen/Qwen3-8B", "google/gemma-3-270m"])
def test_refused_for_families_the_plugin_path_cannot_build(model):
    info = ModelInfo.bundled(model)
    build = {"dtype": "bfloat16", "use_fused_mlp": False}
    p = validate_build(build, {"algo": "int8_sq_per_token"}, info, 90)
    assert any(x.startswith("quantize.algo: int8_sq_per_token is TensorRT-LLM's SmoothQuant plugin path") for x in p), p
    assert not any("quantize.algo" in x for x in validate_build(build, {"algo": "int8_sq"}, info, 90))


def test_defaults_and_quantization_block():
    smol = ModelInfo.bundled("HuggingFaceTB/SmolLM2-135M-Instruct")
    pt, sq = QUANTIZERS["int8_sq_per_token"], QUANTIZERS["int8_sq"]
    # each algo's default strength is its options model's (pipeline/recipe_options.py), nowhere else
    assert pt.options_of(QuantizeSection(algo="int8_sq_per_token")).alpha == 0.5
    assert sq.options_of(QuantizeSection(algo="int8_sq")).alpha == 1.0
    q = QuantizeSection(algo="int8_sq_per_token", kv_cache="int8")
    assert pt.record(q, pt.options_of(q), smol)["alpha"] == 0.5
    assert pt.checkpoint_quantization(pt.options_of(q), q.kv_cache, smol) == {
        "quant_algo": PT, "kv_cache_quant_algo": "INT8", "smoothquant_val": 0.5}
    assert validate_build({"use_fused_mlp": False}, {"algo": "int8_sq_per_token"}, smol, 90) == []
    p = validate_build({"use_fused_mlp": True}, {"algo": "int8_sq_per_token"}, smol, 90)
    assert any("use_fused_mlp: trtllm-build turns fused MLP off" in x for x in p), p


def test_quantize_stage_simulates_per_token_and_saves_a_loadable_artifact(tmp_path):
    """quantize_model measures the per-token format (not the static one it calibrates with) and its artifact
    restores with torch's weights-only loader (the per-token override is not pickled into it)."""
    from pipeline.quant.artifact import restore_model
    from pipeline.quant.calibrate import quantize_model
    tiny_llama(tmp_path / "hf")
    calib, ev = tokens(8, 32, seed=11), tokens(2, 48)
    q = {"method": "ptq", "calibration": {"samples": 8, "seq_len": 32, "batch": 2, "seed": 0}}
    pt = quantize_model(tmp_path / "hf", QuantizeSection(**q, algo="int8_sq_per_token", alpha=0.5), calib,
                        tmp_path / "a", eval_windows=ev)
    st = quantize_model(tmp_path / "hf", QuantizeSection(**q, algo="int8_sq", alpha=0.5), calib, tmp_path / "b",
                        eval_windows=ev)
    assert pt["per_token_quantizers"] == 14 and "per_token_quantizers" not in st
    assert pt["ppl_ptq"] != st["ppl_ptq"]                       # same calibration, another activation format
    m = restore_model(tmp_path / "hf", tmp_path / "a")
    with torch.no_grad():
        restored = m(ev).logits
    assert torch.isfinite(restored).all()


def test_gate_and_up_get_one_smoothing_vector_without_changing_the_float_function(tmp_path):
    from pipeline.quant.per_token import share_mlp_smoothing
    from modelopt.torch.export.quant_utils import _update_pre_quant_scale
    q = int8_sq(tiny_llama(tmp_path / "hf"))
    mlp = q.model.layers[1].mlp
    _update_pre_quant_scale(mlp.up_proj, mlp.up_proj.input_quantizer.pre_quant_scale * 1.7)   # as calibration may
    assert not torch.equal(mlp.gate_proj.input_quantizer.pre_quant_scale, mlp.up_proj.input_quantizer.pre_quant_scale)
    x = torch.randn(3, 96)
    with torch.no_grad():
        before = [(x * m.input_quantizer.pre_quant_scale) @ m.weight.t() for m in (mlp.gate_proj, mlp.up_proj)]
    assert share_mlp_smoothing(q) == 2
    assert torch.equal(mlp.gate_proj.input_quantizer.pre_quant_scale, mlp.up_proj.input_quantizer.pre_quant_scale)
    with torch.no_grad():
        after = [(x * m.input_quantizer.pre_quant_scale) @ m.weight.t() for m in (mlp.gate_proj, mlp.up_proj)]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
