"""Model families on tiny random-weight models: checkpoint contract and reference numerics vs HF (issue 13).

For each family (Llama 3.x with llama3 rope scaling, Mistral with a sliding window, Qwen3 with q/k norms,
Gemma 3 with everything it adds) the fp16 checkpoint at tp 1 and at the largest valid tp <= 4 must pass the
contract check and its reference numerics must agree with the HF fp32 model on >= 99.9 % of top-1 tokens.

Random weights give near-flat next-token distributions: some positions have a top-2 gap of a few thousandths,
below fp16 rounding (HF's own fp16 run of the tiny Mistral disagrees with its fp32 run on 0.8 % of tokens).
So top-1 agreement is held to 99.9 % on the positions whose HF top-2 gap is at least MARGIN (about twice the
largest fp16-vs-fp32 logit difference HF itself shows on these models), and to 98 % on all positions.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.errors import ForgeError
from pipeline.eval.metrics import compare_logits
from pipeline.modelinfo import ModelInfo
from pipeline.trtllm.checkpoint import write_checkpoint
from pipeline.trtllm.contract import check_contract
from pipeline.trtllm.families import attention_windows, engine_attention_windows
from pipeline.trtllm.reference import ReferenceModel

from trtllm_tiny import tiny_family, tokens

FAMILIES = ("llama3", "mistral", "qwen3", "gemma3")
MARGIN = 0.08


def decisive_top1(ref32: torch.Tensor, cand: torch.Tensor) -> tuple[float, int]:
    """Top-1 agreement on positions whose reference top-2 gap is >= MARGIN, and how many there are."""
    top = ref32.topk(2, dim=-1).values
    keep = (top[..., 0] - top[..., 1]) >= MARGIN
    agree = (cand.argmax(-1) == ref32.argmax(-1))[keep]
    return float(agree.float().mean()), int(keep.sum())


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: (root / f, tiny_family(f, root / f / "hf")) for f in FAMILIES}


def _ckpt(family_models, fam, tp):
    root, m = family_models[fam]
    out = root / f"ckpt-tp{tp}"
    if not (out / "config.json").exists():
        write_checkpoint(m, ModelInfo.from_dir(root / "hf"), root / "hf", out, dtype="float16", tp=tp, pp=1,
                         quant={"algo": "none"})
    return root / "hf", m, out


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("fam", FAMILIES)
def test_family_contract_and_reference_vs_hf(family_models, fam, tp):
    hf, m, ckpt = _ckpt(family_models, fam, tp)
    hf_cfg = json.loads((hf / "config.json").read_text())
    assert check_contract(ckpt, hf_config=hf_cfg) == []
    ids = tokens(4, 64)
    with torch.no_grad():
        ref32 = m(ids).logits.float()
    cand = ReferenceModel(ckpt, device="cpu").logits(ids)
    r = compare_logits(ref32, cand, ids)
    agree, n = decisive_top1(ref32, cand)
    assert n >= 200 and agree >= 0.999, (fam, tp, agree, n)
    assert r["top1_agreement"] >= 0.98 and r["logits_cosine"] > 0.9999 and abs(r["ppl_delta_pct"]) < 0.1, (fam, tp, r)


def test_family_config_fixups(family_models):
    cfgs = {f: json.loads((_ckpt(family_models, f, 4)[2] / "config.json").read_text()) for f in FAMILIES}
    rs = cfgs["llama3"]["rotary_scaling"]
    assert rs["type"] == "llama3" and rs["factor"] == 8.0 and rs["original_max_position_embeddings"] == 32
    assert cfgs["llama3"]["rotary_base"] == 5e5
    assert cfgs["mistral"]["architecture"] == "MistralForCausalLM" and cfgs["mistral"]["sliding_window"] == 16
    q3 = cfgs["qwen3"]
    assert q3["qwen_type"] == "qwen3" and q3["attn_bias"] is False and q3["head_size"] == 32
    g = cfgs["gemma3"]
    assert g["architecture"] == "Gemma3ForCausalLM" and g["query_pre_attn_scalar"] == 24
    assert g["_sliding_window_pattern"] == 2 and g["sliding_window"] == 8
    assert g["rotary_base"] == 1e6 and g["rope_local_base_freq"] == 1e4
    assert g["use_parallel_embedding"] is True and g["share_embedding_table"] is True
    # what the engine's runtime gets as max_attention_window_size (Triton repository, evaluate runtime)
    L = {f: cfgs[f]["num_hidden_layers"] for f in FAMILIES}
    assert attention_windows(cfgs["mistral"], 64) == [16] * L["mistral"]
    assert attention_windows(cfgs["gemma3"], 64) == [8, 64] * (L["gemma3"] // 2)
    assert attention_windows(cfgs["mistral"], 16) is None          # window >= max_seq_len: runtime default
    assert attention_windows(cfgs["llama3"], 64) is None and attention_windows(cfgs["qwen3"], 64) is None
    with pytest.raises(ForgeError, match="build_config has no max_seq_len"):
        engine_attention_windows({"pretrained_config": cfgs["gemma3"], "build_config": {}})


@pytest.mark.parametrize("fam,mutation,expect", [
    ("qwen3", lambda c: c.update(qwen_type="qwen2"), "builds the q/k layernorms only for qwen3"),
    ("gemma3", lambda c: c.pop("query_pre_attn_scalar"), "Gemma3 field 'query_pre_attn_scalar' missing"),
    ("gemma3", lambda c: c.update(use_parallel_embedding=False), "GemmaConfig forces it"),
])
def test_family_config_mutations_fail_contract(family_models, tmp_path, fam, mutation, expect):
    import shutil
    src = _ckpt(family_models, fam, 4)[2]
    dst = tmp_path / "c"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    mutation(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    assert any(expect in p for p in check_contract(dst)), check_contract(dst)


def test_missing_qk_norm_fails_contract(family_models, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    src = _ckpt(family_models, "qwen3", 1)[2]
    shutil.copytree(src, tmp_path / "c")
    sd = load_file(str(tmp_path / "c" / "rank0.safetensors"))
    del sd["transformer.layers.2.attention.k_layernorm.weight"]
    save_file(sd, str(tmp_path / "c" / "rank0.safetensors"))
    p = check_contract(tmp_path / "c")
    assert any("layers.2.attention.k_layernorm.weight: required tensor missing" in x for x in p), p


@pytest.mark.parametrize("fam,what", [("mistral", "sliding_window"), ("gemma3", "sliding_window"),
                                      ("gemma3", "rope_local_base_freq"), ("llama3", "rotary_scaling"),
                                      ("gemma3", "query_pre_attn_scalar")])
def test_reference_applies_family_semantics(family_models, tmp_path, fam, what):
    """Dropping a family feature from the config must move the reference away from HF (it is used)."""
    import shutil
    hf, m, src = _ckpt(family_models, fam, 1)
    shutil.copytree(src, tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg[what] = None if what != "rope_local_base_freq" else cfg["rotary_base"]
    if what == "query_pre_attn_scalar":
        cfg[what] = cfg["head_size"]
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    ids = tokens(4, 64)
    with torch.no_grad():
        ref32 = m(ids).logits.float()
    good = compare_logits(ref32, ReferenceModel(src, device="cpu").logits(ids), ids)
    bad = compare_logits(ref32, ReferenceModel(tmp_path / "c", device="cpu").logits(ids), ids)
    assert bad["logits_cosine"] < good["logits_cosine"] - 1e-3, (good, bad)


@pytest.mark.parametrize("fam", ["qwen3", "gemma3"])
def test_qk_norm_uses_attention_default_eps(family_models, monkeypatch, fam):
    """The engine's q/k RMSNorm eps is Attention's default 1e-05, whatever the checkpoint's norm_epsilon (issue 27:
    qwen/gemma DecoderLayer pass no eps; reference.QK_NORM_EPS cites the lines). Every q/k norm call gets it, every
    other norm gets norm_epsilon, and the choice reaches the logits."""
    import pipeline.trtllm.reference as reference
    assert reference.QK_NORM_EPS == 1e-5
    hf, m, ckpt = _ckpt(family_models, fam, 1)
    norm_eps = json.loads((ckpt / "config.json").read_text())["norm_epsilon"]
    assert norm_eps != reference.QK_NORM_EPS           # else the test could not tell them apart
    seen = []
    orig = ReferenceModel._rms

    def spy(self, x, w, eps=None):
        seen.append((int(w.shape[-1]), eps))
        return orig(self, x, w, eps)

    monkeypatch.setattr(ReferenceModel, "_rms", spy)
    ids = tokens(2, 16)
    ref = ReferenceModel(ckpt, device="cpu")
    a = ref.logits(ids)
    head = ref.D
    qk = [e for d, e in seen if d == head and e is not None]
    assert qk and set(qk) == {1e-5}, seen[:8]
    assert all(e is None for d, e in seen if d != head or e is None)   # the hidden-size norms: norm_epsilon
    monkeypatch.setattr(reference, "QK_NORM_EPS", 1.0)                  # a far eps must move the logits
    b = ReferenceModel(ckpt, device="cpu").logits(ids)
    assert (a - b).abs().max() > 1e-2


def test_qwen3_qk_norm_cites_upstream_not_the_fork():
    """Issue 27: the Qwen3 q/k-norm source is upstream's qwen/model.py (PR #5650, qwen3_moe in PR #6470), whose
    tensors and semantics the family encodes; the fork's copy (index id 54584513530) is named only as a fork."""
    from pipeline.trtllm import families
    from pipeline.trtllm.reference import QK_NORM_EPS
    q = families.BY_ARCH["Qwen3ForCausalLM"]
    assert q.qk_norm and q.model_class == "QWenForCausalLM" and q.decoder_type == "qwen"
    assert q.extra_layer_tensors == ("attention.q_layernorm.weight", "attention.k_layernorm.weight")
    doc = " ".join(families.__doc__.split())
    assert "qk_layernorm = config.qwen_type in ('qwen3', 'qwen3_moe')" in doc
    assert "PR #5650" in doc and "index id 66032162657" in doc
    assert "Index id 54584513530 is a fork" in doc and "upstream line is still to be cited" not in doc
    assert QK_NORM_EPS == 1e-05 and "Attention's default eps 1e-05" in doc
