"""Tiny random-weight Llama / Qwen2 models for the TensorRT-LLM target tests (seconds each)."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch

os.environ.setdefault("FORGE_PROGRESS", "0")
VOCAB = 301  # odd on purpose: lm_head / embedding padding to a multiple of tp is exercised


def tiny_qwen2(path: Path, kv_heads: int = 1, layers: int = 4, hidden: int = 64):
    """Qwen2 with qkv bias, 4 heads / 1 KV head (kv_heads < tp for tp 2), 4 layers (pp 2 splits evenly).
    ``kv_heads=2``: int8_sq at tp 2 (ModelOpt cannot duplicate per-channel k/v scales). ``hidden=128``: widths
    groupwise int4 takes (multiples of 64 x tp; intermediate 2 x hidden)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      rope_theta=1e6, tie_word_embeddings=False, initializer_range=0.15)
    m = Qwen2ForCausalLM(cfg).eval()
    for layer in m.model.layers:   # non-trivial biases so a wrong bias split shows up
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(lin.bias, std=0.3)
    m.save_pretrained(path)
    return m


def tiny_llama(path: Path, *, hidden: int = 96, heads: int = 6, kv_heads: int = 3, seed: int = 1, layers: int = 2):
    """Llama with tied embeddings, 6 heads / 3 KV heads (tp 3 like SmolLM2), rope_theta 1e5, 2 layers,
    intermediate 2 x hidden."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      rope_theta=1e5, tie_word_embeddings=True, initializer_range=0.15)
    m = LlamaForCausalLM(cfg).eval()
    m.save_pretrained(path)
    return m


def tiny_llama_g64(path: Path):
    """Llama whose every linear width is a multiple of 128 (hidden 128, 4 heads of 32 / 2 KV heads, intermediate
    256): the groupwise int4 layout with group 64 at tp 1 and 2 (widths multiples of 64 x tp)."""
    return tiny_llama(path, hidden=128, heads=4, kv_heads=2, seed=2)


def tokens(n=2, t=48, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, t), generator=g)


def hf_logits(model, ids):
    """Float32 logits of a (fake-quantized) HF model."""
    with torch.no_grad():
        return model(ids).logits.float()


def edit(path, fn):
    """Apply ``fn`` to a safetensors file's tensor dict in place (the mutation tests)."""
    from safetensors.torch import load_file, save_file
    sd = load_file(str(path))
    fn(sd)
    save_file(sd, str(path))


def mutated_contract(mutable, src, rank: int, mutate) -> list[str]:
    """Contract problems of a copy of checkpoint ``src`` whose ``rank{rank}.safetensors`` ``mutate`` edited."""
    from pipeline.trtllm.contract import check_contract
    ckpt = mutable(src)
    edit(ckpt / f"rank{rank}.safetensors", mutate)
    return check_contract(ckpt)


def modelopt_config(q: dict, info) -> dict:
    """The ModelOpt config of a quantize section written as a dict, through its quantizer (trtllm/quantizers.py):
    the section validated by the recipe schema, the options by the quantizer's model, as the quantize stage does."""
    from pipeline.recipe import QuantizeSection
    from pipeline.trtllm.quantizers import quantizer_of
    s = QuantizeSection.model_validate(q)
    qz = quantizer_of(s)
    return qz.modelopt_config(qz.options_of(s), s.kv_cache, info)


def int8_sq(model, kv_int8=False):
    import modelopt.torch.quantization as mtq
    cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
    if kv_int8:   # INT8 KV cache: 8-bit k/v bmm quantizers (as ModelOpt's FP8_KV_CFG with num_bits 8)
        cfg["quant_cfg"].append({"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": 8, "axis": None}})
    calib = tokens(8, 32, seed=11)
    mtq.quantize(model, cfg, lambda m: [m(calib[i:i + 2]) for i in range(0, 8, 2)])
    return model




# ---------------------------------------------------------------- one tiny model per family (issue 13)
# Each: 4 heads / 2 KV heads (tp 4 duplicates KV heads, the largest valid tp <= 4), 4 layers, odd vocab, and
# weights large enough that the next-token distribution is peaked (top-1 comparisons are meaningful).
FAMILY_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     initializer_range=0.15, tie_word_embeddings=False)


def tiny_family(name: str, path: Path, seed: int = 3):
    """Tiny random model of ``name`` (llama3 | mistral | qwen3 | gemma3), saved to ``path``; returns it (fp32)."""
    import transformers as tf
    torch.manual_seed(seed)
    c = dict(FAMILY_COMMON)
    if name == "llama3":      # rope_scaling llama3 with a short original context so every band is exercised
        cfg = tf.LlamaConfig(**c, rope_theta=5e5, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
        cls = tf.LlamaForCausalLM
    elif name == "mistral":   # window shorter than the test sequences
        cfg = tf.MistralConfig(**c, sliding_window=16, head_dim=16, rope_theta=1e4)
        cls = tf.MistralForCausalLM
    elif name == "qwen3":     # head_dim != hidden / heads, as in Qwen3
        cfg = tf.Qwen3Config(**c, head_dim=32, rope_theta=1e6)
        cls = tf.Qwen3ForCausalLM
    elif name == "gemma3":    # 1 KV head like gemma-3-270m; global every 2nd layer; window 8
        c.update(num_key_value_heads=1, tie_word_embeddings=True)
        cfg = tf.Gemma3TextConfig(**c, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "full_attention"] * 2,
                                  rope_theta=1e6, rope_local_base_freq=1e4)
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(name)
    m = cls(cfg).eval()
    with torch.no_grad():     # non-trivial norm weights (HF inits them to 1 / 0), so a wrong norm shows up
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    m.save_pretrained(path)
    return m


def torch_model_from_checkpoint(hf_dir: Path, ckpt_dir: Path, weight):
    """The HF model of ``hf_dir`` (fp32) carrying a tp 1 checkpoint's tensors: ``weight(tensors, prefix)`` gives the
    float weight [out, in] of the TensorRT-LLM linear ``prefix`` (e.g. "transformer.layers.0.attention.qkv");
    norms, embedding and biases are copied as stored. The fake-quantized torch model the reference numerics are held
    to (the formats' tests add the activation quantization as forward pre-hooks)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    sd = load_file(str(Path(ckpt_dir) / "rank0.safetensors"))
    m = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    c = m.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    nq, nkv = c.num_attention_heads * d, c.num_key_value_heads * d
    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(sd["transformer.vocab_embedding.weight"].float())
        m.model.norm.weight.copy_(sd["transformer.ln_f.weight"].float())
        for i, layer in enumerate(m.model.layers):
            p = f"transformer.layers.{i}."
            layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"].float())
            layer.post_attention_layernorm.weight.copy_(sd[p + "post_layernorm.weight"].float())
            at, mlp = layer.self_attn, layer.mlp
            qkv = weight(sd, p + "attention.qkv")
            for lin, rows in zip((at.q_proj, at.k_proj, at.v_proj), qkv.split([nq, nkv, nkv])):
                lin.weight.copy_(rows)
            if p + "attention.qkv.bias" in sd:
                for lin, b in zip((at.q_proj, at.k_proj, at.v_proj), sd[p + "attention.qkv.bias"].float().split(
                        [nq, nkv, nkv])):
                    lin.bias.copy_(b)
            at.o_proj.weight.copy_(weight(sd, p + "attention.dense"))
            mlp.gate_proj.weight.copy_(weight(sd, p + "mlp.fc"))      # TensorRT-LLM's fc is HF's gate_proj
            mlp.up_proj.weight.copy_(weight(sd, p + "mlp.gate"))      # and its gate HF's up_proj
            mlp.down_proj.weight.copy_(weight(sd, p + "mlp.proj"))
    return m


def as_float32_checkpoint(ckpt_dir: Path, dst: Path) -> Path:
    """A copy of ``ckpt_dir`` whose config says float32: the reference then rounds nothing between layers, so it is
    comparable bit for bit (up to float32 summation order) with a float32 torch model of the same tensors."""
    import json
    shutil.copytree(ckpt_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
