"""fp8_pc_pt: TensorRT-LLM's rowwise FP8 (FP8_PER_CHANNEL_PER_TOKEN) -- ModelOpt's export in the layout 1.2's
Fp8RowwiseLinear loads, its contract, its reference numerics, and the families / GPUs it is refused on."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import ForgeError
from pipeline.eval.metrics import compare_logits
from pipeline.errors import RecipeError
from pipeline.modelinfo import ModelInfo
from pipeline.recipe import QuantizeSection, resolve
from pipeline.trtllm.build_config import validate_build
from pipeline.trtllm.checkpoint import write_checkpoint
from pipeline.trtllm.contract import check_contract
from pipeline.trtllm.quantizers import QUANTIZERS, needs_sm
from pipeline.trtllm.reference import ReferenceModel

from trtllm_tiny import (as_float32_checkpoint, edit, hf_logits, modelopt_config, mutated_contract, tiny_llama,
                         tiny_qwen2, tokens, torch_model_from_checkpoint)

ALGO = "FP8_PER_CHANNEL_PER_TOKEN"
LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


def quantize(model, q, info):
    import modelopt.torch.quantization as mtq
    calib = tokens(8, 32, seed=11)
    mtq.quantize(model, modelopt_config(q, info), lambda m: [m(calib[i:i + 2]) for i in range(0, 8, 2)])
    return model


@pytest.fixture(scope="module")
def llama_rowwise(tmp_path_factory):
    """The tiny Llama (6 heads / 3 KV) in fp8_pc_pt, checkpoints at tp 1 and tp 3 (+ FP8 KV), and per-tensor fp8 at
    tp 1 for contrast."""
    root = tmp_path_factory.mktemp("fp8_rowwise")
    fp32 = tiny_llama(root / "hf")
    info = ModelInfo.from_dir(root / "hf")
    rw = quantize(copy.deepcopy(fp32), {"algo": "fp8_pc_pt"}, info)
    write_checkpoint(rw, info, root / "hf", root / "tp1", dtype="float16", tp=1, quant={"algo": "fp8_pc_pt"})
    rwkv = quantize(copy.deepcopy(fp32), {"algo": "fp8_pc_pt", "kv_cache": "fp8"}, info)
    write_checkpoint(rwkv, info, root / "hf", root / "tp3", dtype="float16", tp=3,
                     quant={"algo": "fp8_pc_pt", "kv_cache": "fp8"})
    pt = quantize(copy.deepcopy(fp32), {"algo": "fp8"}, info)
    write_checkpoint(pt, info, root / "hf", root / "per_tensor", dtype="float16", tp=1, quant={"algo": "fp8"})
    return root, fp32, rw, rwkv


def per_token_fp8(x: torch.Tensor) -> torch.Tensor:
    """The plugin's per-token e4m3 quantization written out from the kernel (perTokenQuantization with
    hasFp8MinScaling, quantization.cu): max|x| starts at 1e-6, scale = max(max|x| / 448, 1 / (448 * 512)), the
    value is cast to e4m3 after times min(448 / max|x|, 448 * 512). Independent of reference.py on purpose."""
    xf = x.float()
    amax = torch.maximum(xf.abs().amax(-1, keepdim=True), torch.tensor(1e-6))
    scale = torch.maximum(amax / 448.0, torch.tensor(1.0 / (448 * 512)))
    mult = torch.minimum(448.0 / amax, torch.tensor(448.0 * 512))
    return ((xf * mult).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def test_layout_is_what_fp8_rowwise_linear_loads(llama_rowwise):
    root = llama_rowwise[0]
    hf = json.loads((root / "hf" / "config.json").read_text())
    for ck, ranks in (("tp1", 1), ("tp3", 3)):
        cfg = json.loads((root / ck / "config.json").read_text())
        assert cfg["quantization"]["quant_algo"] == ALGO and "lm_head" in cfg["quantization"]["exclude_modules"]
        assert check_contract(root / ck, hf_config=hf) == []
        for r in range(ranks):
            sd = load_file(str(root / ck / f"rank{r}.safetensors"))
            for lin in LINEARS:
                p = f"transformer.layers.1.{lin}."
                w, s = sd[p + "weight"], sd[p + "per_channel_scale"]
                assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (w.shape[0],)
                assert not [k for k in sd if k.startswith(p) and k.endswith(("activation_scaling_factor",
                                                                            "weights_scaling_factor"))]
            assert sd["transformer.layers.0.input_layernorm.weight"].dtype == torch.float16   # no scale_to_int
            assert not [k for k in sd if k.endswith("scale_to_int")]
    assert json.loads((root / "tp3" / "config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"


def test_reference_is_the_fake_quantized_torch_model_of_the_checkpoint(llama_rowwise, tmp_path):
    """Bit-level semantics: float32 reference of the tp 1 checkpoint == HF torch model with the checkpoint's fp8
    weights x per_channel_scale and every linear input (not lm_head) quantized per token as the kernel does."""
    root = llama_rowwise[0]

    def dequant(sd, prefix):
        return sd[prefix + ".weight"].float() * sd[prefix + ".per_channel_scale"].float()[:, None]
    m = torch_model_from_checkpoint(root / "hf", root / "tp1", dequant)
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            mod.register_forward_pre_hook(lambda _m, args: (per_token_fp8(args[0]),))
    ids = tokens()
    want = hf_logits(m, ids)
    got = ReferenceModel(as_float32_checkpoint(root / "tp1", tmp_path / "f32"), device="cpu").logits(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    # the activation quantization is there: without it the same weights give other logits
    plain = hf_logits(torch_model_from_checkpoint(root / "hf", root / "tp1", dequant), ids)
    assert (plain - want).abs().max() > 1e-2


def test_reference_tracks_the_modelopt_simulation(llama_rowwise):
    """The fp16 checkpoint against ModelOpt's own simulation (fp32): what is left is fp16 rounding ahead of the
    per-token FP8 casts. The per-tensor FP8 checkpoint of the same model is further from it (another format)."""
    root, fp32, rw, _ = llama_rowwise
    ids = tokens()
    sim = hf_logits(rw, ids)
    r = compare_logits(sim, ReferenceModel(root / "tp1", device="cpu").logits(ids), ids)
    assert r["logits_cosine"] > 0.99 and abs(r["ppl_delta_pct"]) < 3.0, r
    r_pt = compare_logits(sim, ReferenceModel(root / "per_tensor", device="cpu").logits(ids), ids)
    assert r_pt["logits_cosine"] < r["logits_cosine"], (r, r_pt)


def test_tp3_quantizes_each_rank_shard_per_token(llama_rowwise):
    """Row-parallel inputs are quantized per token on each rank's shard (the plugin sees the local tensor), so
    tp 3 is not tp 1's numbers, though close; the FP8 KV cache is read as in every other format."""
    root = llama_rowwise[0]
    ids = tokens()
    r = compare_logits(ReferenceModel(root / "tp1", device="cpu").logits(ids),
                       ReferenceModel(root / "tp3", device="cpu", kv_cache="context").logits(ids), ids)
    assert 0.98 < r["logits_cosine"] < 0.99999, r


def test_per_token_rows_are_independent_and_safe():
    """A row's scale is its own (batch invariant); an all-zero row stays zero; a row below 448 * 2^-9 / 448 uses the
    kernel's minimum scale instead of dividing by ~0."""
    from pipeline.trtllm.reference import ReferenceModel as R, _Linear
    ref = R.__new__(R)
    ref.dtype, ref.clamp = torch.float32, None
    lin = _Linear(torch.eye(4), lambda t: t, act="fp8_token")
    x = torch.tensor([[1000.0, 1.0, -3.0, 0.5], [0.0, 0.0, 0.0, 0.0], [1e-7, -2e-7, 0.0, 1e-7]])
    y = R._apply(ref, lin, x)
    assert torch.equal(y, per_token_fp8(x))
    assert torch.equal(y[1], torch.zeros(4)) and torch.isfinite(y).all()
    assert torch.equal(R._apply(ref, lin, x[2:]), y[2:])              # alone or batched: the same row
    ref.clamp = [-2.0, 2.0]                                           # clamp_val, when a config sets one
    assert R._apply(ref, lin, x)[0].abs().max() <= 2.0


# ------------------------------------------------------------------ mutations the checks must catch
@pytest.mark.parametrize("mutate,expect", [
    (lambda sd: sd.__setitem__("transformer.layers.0.mlp.fc.per_channel_scale",
                               sd["transformer.layers.0.mlp.fc.per_channel_scale"][None]), "fc.per_channel_scale: shape"),
    (lambda sd: sd.pop("transformer.layers.1.attention.dense.per_channel_scale"),
     "dense.per_channel_scale: required tensor missing"),
    (lambda sd: sd.__setitem__("transformer.layers.0.mlp.proj.activation_scaling_factor", torch.ones(1)),
     "activation_scaling_factor: unexpected tensor"),
    (lambda sd: sd.__setitem__("transformer.layers.0.attention.qkv.per_channel_scale",
                               -sd["transformer.layers.0.attention.qkv.per_channel_scale"]), "not finite and > 0"),
    (lambda sd: sd.__setitem__("transformer.layers.0.mlp.gate.weight",
                               sd["transformer.layers.0.mlp.gate.weight"].half()), "dtype F16"),
])
def test_contract_catches(llama_rowwise, mutable, mutate, expect):
    p = mutated_contract(mutable, llama_rowwise[0] / "tp3", 2, mutate)
    assert any(x.startswith("rank2.safetensors") and expect in x for x in p), p


def test_shuffled_channel_scales_pass_the_contract_and_fail_numerics(llama_rowwise, mutable):
    root, _, rw, _ = llama_rowwise
    ckpt = mutable(root / "tp1")
    edit(ckpt / "rank0.safetensors", lambda sd: [sd.__setitem__(k, sd[k].flip(0)) for k in list(sd)
                                                  if k.endswith("per_channel_scale") and "layers.0." in k])
    assert check_contract(ckpt) == []
    ids = tokens()
    r = compare_logits(hf_logits(rw, ids), ReferenceModel(ckpt, device="cpu").logits(ids), ids)
    assert r["logits_cosine"] < 0.95, r


# ------------------------------------------------------------------ where it is offered
BUILD = {"dtype": "bfloat16", "tp": 1, "use_fused_mlp": False, "use_paged_context_fmha": False}


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mistral-7B-v0.1",
                                   "Qwen/Qwen2.5-7B-Instruct"])
def test_offered_for_llama_mistral_qwen2(model):
    info = ModelInfo.bundled(model)
    assert validate_build(BUILD, {"algo": "fp8_pc_pt", "kv_cache": "fp8"}, info, 90) == []
    assert validate_build(BUILD, {"algo": "fp8_pc_pt"}, info, 89) == []


@pytest.mark.parametrize("model", ["Qwen/Qwen3-8B", "google/gemma-3-270m"])
def test_refused_for_families_with_q_k_norms(model):
    info = ModelInfo.bundled(model)
    p = validate_build(BUILD, {"algo": "fp8_pc_pt"}, info, 90)
    assert any(x.startswith("quantize.algo: fp8_pc_pt is TensorRT-LLM's FP8 rowwise path, whose attention has no "
                            "q/k norms") and "use quantize.algo fp8" in x for x in p), p
    assert not any(x.startswith("quantize.algo") for x in validate_build(BUILD, {"algo": "fp8"}, info, 90))


def test_checkpoint_of_a_refused_family_fails_the_contract(llama_rowwise, mutable):
    ckpt = mutable(llama_rowwise[0] / "tp1")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(architecture="Qwen3ForCausalLM", qwen_type="qwen3")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert any(f"quant_algo {ALGO} for Qwen3ForCausalLM" in x for x in check_contract(ckpt))


@pytest.mark.parametrize("change,sm,expect", [
    ({}, 80, "quantize.algo/quantize.kv_cache: FP8 needs SM >= 89"),
    ({}, 100, "quantize.algo: fp8_pc_pt (FP8_PER_CHANNEL_PER_TOKEN) is not supported by TensorRT-LLM on SM 100"),
    ({"use_fused_mlp": True}, 90, "build.tensorrt_llm.use_fused_mlp: trtllm-build turns fused MLP off"),
    ({"use_paged_context_fmha": True}, 90, "build.tensorrt_llm.use_paged_context_fmha: trtllm-build turns paged "
                                           "context FMHA off with an FP8 KV cache"),
    ({"tp": 8}, 90, "quantize.algo: fp8_pc_pt with build.tensorrt_llm.tp=8 > 4 KV heads"),
])
def test_build_rules(change, sm, expect):
    p = validate_build({**BUILD, **change}, {"algo": "fp8_pc_pt", "kv_cache": "fp8"},
                       ModelInfo.bundled("Qwen/Qwen2.5-7B-Instruct"), sm)
    assert any(x.startswith(expect) for x in p), p


def test_sm_120_is_not_refused_like_sm_100():
    """trtllm-build's per-channel / per-token refusal covers 100 <= SM < 120 only (builder.py)."""
    p = validate_build(BUILD, {"algo": "fp8_pc_pt"}, ModelInfo.bundled("Qwen/Qwen2.5-7B-Instruct"), 120)
    assert p == []


def test_kv_duplication_refused_at_export(tmp_path):
    m = tiny_qwen2(tmp_path / "hf")                     # 1 KV head: tp 2 would duplicate its per-channel scales
    info = ModelInfo.from_dir(tmp_path / "hf")
    quantize(m, {"algo": "fp8_pc_pt"}, info)
    with pytest.raises(ForgeError, match=r"quantize.algo: fp8_pc_pt with build.tensorrt_llm.tp=2 > 1 KV heads"):
        write_checkpoint(m, info, tmp_path / "hf", tmp_path / "c", tp=2, quant={"algo": "fp8_pc_pt"})


def block(q: dict, info) -> dict:
    """The checkpoint's quantization block the fp8_pc_pt quantizer writes for a quantize section given as a dict."""
    s = QuantizeSection.model_validate(q)
    qz = QUANTIZERS[s.algo]
    return qz.checkpoint_quantization(qz.options_of(s), s.kv_cache, info)


def test_quantization_block_and_sm():
    smol = ModelInfo.bundled("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert block({"algo": "fp8_pc_pt", "kv_cache": "fp8"}, smol) == {"quant_algo": ALGO, "kv_cache_quant_algo": "FP8"}
    qz, q = QUANTIZERS["fp8_pc_pt"], QuantizeSection(algo="fp8_pc_pt")
    assert needs_sm("fp8_pc_pt") == 89 and qz.record(q, qz.options_of(q), smol)["algo"] == "fp8_pc_pt"
    assert qz.needs_calibration() and qz.fake_quant_export      # ModelOpt exports its fp8 weights and scales


def test_quantize_stage_simulates_rowwise_and_saves_a_loadable_artifact(tmp_path):
    from pipeline.quant.artifact import restore_model
    from pipeline.quant.calibrate import quantize_model
    tiny_llama(tmp_path / "hf")
    calib, ev = tokens(8, 32, seed=11), tokens(2, 48)
    q = {"method": "ptq", "calibration": {"samples": 8, "seq_len": 32, "batch": 2, "seed": 0}}
    rw = quantize_model(tmp_path / "hf", QuantizeSection(**q, algo="fp8_pc_pt"), calib, tmp_path / "a",
                        eval_windows=ev)
    pt = quantize_model(tmp_path / "hf", QuantizeSection(**q, algo="fp8"), calib, tmp_path / "b", eval_windows=ev)
    assert rw["needs_sm"] == 89 and rw["trtllm_quantization"]["quant_algo"] == ALGO
    assert rw["ppl_ptq"] != pt["ppl_ptq"]
    m = restore_model(tmp_path / "hf", tmp_path / "a")
    write_checkpoint(m, ModelInfo.from_dir(tmp_path / "hf"), tmp_path / "hf", tmp_path / "c", tp=3,
                     quant={**q, "algo": "fp8_pc_pt"})
    assert check_contract(tmp_path / "c") == []


# ------------------------------------------------------------------ the Meta recipe (quantize.options.meta_recipe)
META = {"algo": "fp8_pc_pt", "kv_cache": "fp8", "options": {"meta_recipe": True}}


@pytest.fixture(scope="module")
def llama_meta(tmp_path_factory):
    """A 4-layer tiny Llama in fp8_pc_pt with the Meta recipe and FP8 KV, tp 1 and tp 3."""
    root = tmp_path_factory.mktemp("fp8_meta")
    fp32 = tiny_llama(root / "hf", layers=4)
    info = ModelInfo.from_dir(root / "hf")
    q = quantize(copy.deepcopy(fp32), META, info)
    for tp in (1, 3):
        write_checkpoint(q, info, root / "hf", root / f"tp{tp}", dtype="float16", tp=tp, quant=META)
    return root, q


def test_meta_recipe_layout(llama_meta):
    """Attention of every layer and layers 0 and 3 entirely in fp16; the other MLPs rowwise FP8; the config says
    use_meta_recipe (not ModelOpt's exclude list, which would leave input_layernorm swapped); KV scales kept."""
    root = llama_meta[0]
    for ck, ranks in (("tp1", 1), ("tp3", 3)):
        q = json.loads((root / ck / "config.json").read_text())["quantization"]
        assert (q["quant_algo"], q["use_meta_recipe"], q["exclude_modules"], q["kv_cache_quant_algo"]) == (
            ALGO, True, ["lm_head"], "FP8")
        assert check_contract(root / ck) == []
        for r in range(ranks):
            sd = load_file(str(root / ck / f"rank{r}.safetensors"))
            for layer in range(4):
                for lin in LINEARS:
                    p = f"transformer.layers.{layer}.{lin}."
                    fp8 = lin.startswith("mlp") and layer in (1, 2)
                    assert sd[p + "weight"].dtype == (torch.float8_e4m3fn if fp8 else torch.float16), p
                    assert (p + "per_channel_scale" in sd) == fp8, p
                assert f"transformer.layers.{layer}.attention.kv_cache_scaling_factor" in sd


def test_meta_recipe_reference_is_its_fake_quantized_torch_model(llama_meta, tmp_path):
    root = llama_meta[0]

    def dequant(sd, prefix):
        w = sd[prefix + ".weight"].float()
        return w * sd[prefix + ".per_channel_scale"].float()[:, None] if prefix + ".per_channel_scale" in sd else w
    m = torch_model_from_checkpoint(root / "hf", root / "tp1", dequant)
    for i in (1, 2):                                   # per-token FP8 on the quantized MLPs' inputs only
        for mod in m.model.layers[i].mlp.children():
            if isinstance(mod, torch.nn.Linear):
                mod.register_forward_pre_hook(lambda _m, args: (per_token_fp8(args[0]),))
    ids = tokens()
    ckpt = as_float32_checkpoint(root / "tp1", tmp_path / "f32")
    got = ReferenceModel(ckpt, device="cpu", kv_cache="context").logits(ids)
    torch.testing.assert_close(got, hf_logits(m, ids), rtol=0, atol=2e-4)


def test_meta_recipe_contract_catches_a_quantized_attention(llama_meta, mutable):
    src = llama_meta[0] / "tp1"
    fp8 = load_file(str(src / "rank0.safetensors"))["transformer.layers.1.mlp.fc.weight"]
    p = mutated_contract(mutable, src, 0, lambda sd: sd.__setitem__(
        "transformer.layers.2.attention.dense.weight", fp8[:96, :96].contiguous()))
    assert any("layers.2.attention.dense.weight: dtype F8_E4M3" in x and "use_meta_recipe" in x for x in p), p


def refused(*sets) -> list[str]:
    with pytest.raises(RecipeError) as e:
        resolve("qwen7b-fp8", list(sets))
    return e.value.problems


def test_meta_recipe_options_and_memory():
    from pipeline.trtllm.memory import plan_memory
    qwen = ModelInfo.bundled("Qwen/Qwen2.5-7B-Instruct")
    r = resolve("qwen7b-fp8", [])                                      # the recipe's section: META as written
    qz = QUANTIZERS["fp8_pc_pt"]
    assert r.quantize.options == META["options"] and qz.options_of(r.quantize).meta_recipe is True
    assert qz.plan_problems(r.quantize, qz.options_of(r.quantize), qwen) == []
    assert block(META, qwen)["use_meta_recipe"] is True and "use_meta_recipe" not in block({"algo": "fp8_pc_pt"}, qwen)
    p = refused("quantize.options.exclude=['*down_proj']")
    assert any("quantize.options.exclude" in x and "meta_recipe" in x for x in p), p
    p = refused("quantize.algo=fp8", "quantize.options.meta_recipe=true")
    assert any("quantize.options.meta_recipe" in x for x in p), p     # an fp8_pc_pt option only
    kw = dict(quant_algo="fp8_pc_pt", tp=2, max_batch_size=1, max_seq_len=1024)
    plain, meta = plan_memory(qwen, **kw).weights, plan_memory(qwen, meta_recipe=True, **kw).weights
    h, d, n, k, i, L = 3584, 128, 28 // 2, 4 // 2, 18944 // 2, 28
    attn = h * (n + 2 * k) * d + n * d * h                             # qkv + dense per layer and rank
    mlp = 3 * h * i
    extra = L * attn * (2 - 1) + 2 * mlp * (2 - 1)                     # fp16 instead of 1-byte fp8
    assert meta["decoder linears"]["bytes"] - plain["decoder linears"]["bytes"] == extra
    assert plain["quant scales"]["bytes"] - meta["quant scales"]["bytes"] == 4 * (L * ((n + 2 * k) * d + h)
                                                                                   + 2 * (2 * i + h))
