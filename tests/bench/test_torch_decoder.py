"""bench/torch_decoder.py, the GPU bench's PyTorch peer, on CPU: its eager math against transformers' own model on
tiny random Qwen2 (GQA, q/k/v biases, untied head, rope theta 1e6) and Llama (one KV head, tied head, llama3 rope
scaling) configs -- prefill logits, every cached decode step's logits, greedy tokens, batch > 1 -- the INT4 path
against the same model with fake-quantized weights, and where torch.compile's CUDA-graph mode is chosen."""

import numpy as np
import pytest
import torch

from bench import torch_decoder as td

transformers = pytest.importorskip("transformers")


def _random_model(kind: str, tmp_path):
    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    else:
        cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=1, vocab_size=512,
                                       tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():       # every tensor random, biases and norms too (HF initialises biases to 0, norms to 1)
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.2) + (1.0 if "norm" in name else 0.0))
    m.save_pretrained(tmp_path)
    return m


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_static_decoder_matches_transformers_logits_and_greedy_tokens(kind, tmp_path):
    hf = _random_model(kind, tmp_path)
    if kind == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0     # the biases are exercised
    ours = td.load(tmp_path, "cpu", torch.float32, max_seq=512)
    gen = td.Generator(ours, compile=True)
    assert gen.compiled is False                       # CPU: eager, whatever was asked
    ids = torch.randint(0, 512, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = gen.prefill_logits(ids, last_only=False)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
    # the cached decode path: feed 6 more tokens one at a time, each step's logits vs a full forward of transformers
    ext = torch.cat([ids, torch.randint(0, 512, (3, 6), generator=torch.Generator().manual_seed(2))], dim=1)
    with torch.no_grad():
        full = hf(ext).logits
        ours.use_cache(3, ext.shape[1])
        ours(ids, torch.arange(11), prefill=True)
        for t in range(11, ext.shape[1]):
            step = ours(ext[:, t:t + 1], torch.tensor([t]), prefill=False)
            diff = (step[:, 0] - full[:, t]).abs().max()
            assert torch.allclose(step[:, 0], full[:, t], atol=1e-4, rtol=1e-4), (t, diff)
    out = gen.generate(ids, 10)
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                       do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    assert out.tolist() == want.tolist()


def test_rope_theta_and_scaling_reach_the_tables(tmp_path):
    hf = _random_model("llama", tmp_path)
    spec = td.spec_from_config(hf.config)
    assert spec.rope_type == "llama3" and spec.rope_theta == 500000.0
    cos, _ = td.rope_tables(hf.config, spec, 64)
    plain = td.rope_tables(hf.config, td.Spec(**{**spec.__dict__, "rope_type": "default"}), 64)[0]
    assert not torch.allclose(cos, plain)              # llama3 scaling changed the low frequencies


def test_int4_decoder_equals_the_model_with_fake_quantized_weights(tmp_path):
    hf = _random_model("qwen2", tmp_path)
    q4 = td.load(tmp_path, "cpu", torch.float32, int4_group=128, max_seq=512)
    with torch.no_grad():
        for mod in hf.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(td.dequantize_int4(*td.quantize_int4(mod.weight, 128, torch.float32), 128))
        ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3))
        ref = hf(ids).logits
    got = td.Generator(q4).prefill_logits(ids, last_only=False)
    assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (got - ref).abs().max()
    wb = q4.weight_bytes()
    dense = td.load(tmp_path, "cpu", torch.float16, max_seq=512).weight_bytes()
    assert wb["step_bytes"] < dense["step_bytes"]       # packed 4-bit + scales/zeros, not dense weights


def test_int4_quantizer_rounds_to_the_grid():
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    q, sz = td.quantize_int4(w, 128, torch.float32)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15 and sz.shape == (2, 16, 2)
    err = (td.dequantize_int4(q, sz, 128) - w).abs()
    step = sz[..., 0].T.repeat_interleave(128, dim=1)
    assert bool((err <= step / 2 + 1e-6).all())       # round to nearest: at most half a step off
    with pytest.raises(ValueError, match="group 128 does not divide"):
        td.quantize_int4(torch.zeros(8, 200), 128)


class _Dev:
    def __init__(self, kind):
        self.device = torch.device(kind)


def test_cuda_graph_compile_is_chosen_only_on_cuda(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    _, compiled = td.decode_step(_Dev("cuda"), compile=True)
    assert compiled is True and seen == [{"mode": "reduce-overhead", "fullgraph": True}]
    for dev, want in (("cpu", True), ("cuda", False)):
        _, compiled = td.decode_step(_Dev(dev), compile=want)
        assert compiled is False
    assert len(seen) == 1


def test_adapter_on_cpu_says_eager_and_generates(tmp_path):
    _random_model("qwen2", tmp_path)
    a = td.TorchStaticAdapter("torch", str(tmp_path), "fp16", device="cpu")
    assert "eager" in a.what and "CUDA" in a.what and a.facts()["compiled"] is False
    ids = np.arange(1, 9, dtype=np.int64).reshape(1, -1)
    assert len(a.generate(ids, 4)) == 4
    assert a.generate_batch(np.vstack([ids, ids]), 3).shape == (2, 3)
    with pytest.raises(ValueError, match="fp16 or int4"):
        td.TorchStaticAdapter("x", str(tmp_path), "int8", device="cpu")


def test_unsupported_configs_are_refused_with_the_reason():
    cfg = transformers.Qwen2Config(use_sliding_window=True, sliding_window=64)
    with pytest.raises(ValueError, match="sliding-window"):
        td.spec_from_config(cfg)
    with pytest.raises(ValueError, match="gpt2"):
        td.spec_from_config(transformers.GPT2Config())


def test_a_decode_step_that_fails_to_compile_falls_back_to_eager_and_says_so(tmp_path, monkeypatch):
    hf = _random_model("qwen2", tmp_path)
    gen = td.Generator(td.load(tmp_path, "cpu", torch.float32, max_seq=512))

    def broken(tok, pos):
        raise RuntimeError("inductor: no C compiler")
    gen.step, gen.compiled = broken, True              # as if torch.compile had been chosen and then failed
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    ids = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(4))
    out = gen.generate(ids, 5)
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                       do_sample=False, pad_token_id=0)[:, 7:]
    assert out.tolist() == want.tolist()
    assert gen.compiled is False and "no C compiler" in gen.compile_error


def test_kv_cache_per_batch_and_capacity_is_kept_and_sized_to_the_need(tmp_path):
    _random_model("qwen2", tmp_path)
    m = td.load(tmp_path, "cpu", torch.float32, max_seq=4096)
    assert m.use_cache(1, 2049) == 2304
    assert m.use_cache(1, 96) == 256                    # a short decode does not attend over the long cache
    k = m.layers[0].k_cache
    assert k.shape == (1, 2, 256, 32)
    m.use_cache(8, 96)
    assert m.layers[0].k_cache.shape[0] == 8
    m.use_cache(1, 33)
    assert m.layers[0].k_cache is k                     # the same buffers again (a captured graph's addresses)
    with pytest.raises(ValueError, match="max_seq"):
        m.use_cache(1, 5000)
