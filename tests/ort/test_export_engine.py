import ast

import numpy as np
import onnx
import pytest
import torch

from pipeline.errors import ForgeError, StageFailed
from pipeline.ort.engine import OrtEngine, sample_next
from pipeline.ort.export import META_FILE, MODEL_FILE, check_parity, export_onnx, load_meta


def _metrics(d):
    return ast.literal_eval((d / "export_metrics.txt").read_text())


def test_export_writes_checked_model_with_external_data(tiny_onnx_dir):
    assert (tiny_onnx_dir / MODEL_FILE).exists() and (tiny_onnx_dir / (MODEL_FILE + ".data")).exists()
    onnx.checker.check_model(str(tiny_onnx_dir / MODEL_FILE))
    meta = load_meta(tiny_onnx_dir)
    assert meta["num_layers"] == 2 and meta["num_kv_heads"] == 2 and meta["head_dim"] == 16
    m = _metrics(tiny_onnx_dir)
    assert m["parity_prefill_max_abs"] < 1e-4 and m["parity_decode_max_abs"] < 1e-4
    assert m["model_bytes"] > 256 * 64 * 4  # at least the embedding


def test_gqa_graph_has_genai_inputs_and_in_place_kv(tiny_onnx_dir):
    eng = OrtEngine(tiny_onnx_dir, threads=1)
    names = [i.name for i in eng.session.get_inputs()]
    assert names[:2] == ["input_ids", "attention_mask"] and "position_ids" not in names
    assert "past_key_values.1.value" in names and eng.num_layers == 2 and eng.layout == "shared"
    past_dim = eng.session.get_inputs()[2].shape[2]
    assert isinstance(past_dim, str)  # symbolic
    model = onnx.load(str(tiny_onnx_dir / MODEL_FILE), load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.domain == "com.microsoft" for n in gqa)
    assert {o.domain: o.version for o in model.opset_import}["com.microsoft"] == 1
    meta = load_meta(tiny_onnx_dir)
    assert meta["kv_layout"] == "shared" and meta["max_seq_len"] == 256   # tiny model's max_position_embeddings


def test_standard_graph_keeps_position_ids(tiny_onnx_standard_dir):
    eng = OrtEngine(tiny_onnx_standard_dir, threads=1)
    names = [i.name for i in eng.session.get_inputs()]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"] and eng.layout == "concat"
    ops = {n.op_type for n in onnx.load(str(tiny_onnx_standard_dir / MODEL_FILE), load_external_data=False).graph.node}
    assert "GroupQueryAttention" not in ops


def test_decode_writes_the_preallocated_buffers_in_place(tiny_onnx_dir):
    """The KV cache is allocated once: every decode step's present is the past buffer itself."""
    eng = OrtEngine(tiny_onnx_dir, threads=1)
    cache = eng.cache(2, 16)
    before = [v.data_ptr() for v in cache.values]
    eng.forward(np.array([[5, 6, 7], [8, 9, 0]]), np.array([3, 2]), cache)
    k0 = cache.values[0].numpy().copy()
    for _ in range(3):
        eng.forward(np.array([[1], [2]]), np.array([1, 1]), cache)
    assert [v.data_ptr() for v in cache.values] == before
    assert cache.lengths.tolist() == [6, 5] and cache.width == 6
    k1 = cache.values[0].numpy()
    # row 1 (prompt of 2) got its first decoded token at position 2, overwriting the padded slot
    assert np.array_equal(k1[0, :, :3], k0[0, :, :3]) and not np.allclose(k1[1, :, 2], k0[1, :, 2])
    # a second request of the same batch size reuses the buffers
    assert eng.cache(2, 10) is cache


def test_logits_match_torch_batch_and_padding(tiny_llama_dir, tiny_any_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.numpy()
    eng = OrtEngine(tiny_any_dir, threads=1)
    got = eng.logits(ids)
    assert got.shape == (3, 20, 256)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
    mask = np.ones((3, 20), np.int64)
    mask[1, 12:] = 0   # right padding: row 1 has 12 tokens
    padded = eng.logits(ids, mask)
    with torch.no_grad():
        ref1 = model(input_ids=ids[1:2, :12]).logits.numpy()[0]
    np.testing.assert_allclose(padded[1, :12], ref1, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="right padding"):
        eng.logits(ids, 1 - mask)


def test_kv_decode_equals_full_recompute(tiny_any_dir):
    eng = OrtEngine(tiny_any_dir, threads=1)
    prompt = [5, 17, 99, 3, 42]
    got = eng.generate(prompt, 10)
    seq = list(prompt)
    for _ in range(10):
        seq.append(int(eng.logits(np.array([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]
    assert len(set(got)) > 1  # not a degenerate constant stream


def test_greedy_equals_torch_greedy(tiny_llama_dir, tiny_any_dir):
    from pipeline.eval.reference import TorchReference

    ref = TorchReference(tiny_llama_dir)
    eng = OrtEngine(tiny_any_dir, threads=1)
    for prompt in ([1, 2, 3], [200, 7, 7, 9, 100, 31]):
        assert eng.generate(prompt, 12) == ref.generate_greedy(prompt, 12)


def test_batch_generate_with_padding_equals_single(tiny_any_dir):
    eng = OrtEngine(tiny_any_dir, threads=1)
    prompts = [[1, 2, 3], [200, 7, 7, 9, 100, 31], [77]]
    batch = eng.generate_batch(prompts, 8)
    assert batch == [eng.generate(p, 8) for p in prompts]
    # per-row lengths and settings (how the Triton model batches requests): each row as if alone
    mixed = eng.generate_batch(prompts, [3, 8, 5], greedy=[True, False, True], top_k=[0, 5, 0], seed=[0, 4, 0])
    assert mixed[0] == batch[0][:3] and mixed[2] == batch[2][:5]
    assert mixed[1] == eng.generate(prompts[1], 8, greedy=False, top_k=5, seed=4)


def test_eos_and_sampling(tiny_any_dir):
    eng = OrtEngine(tiny_any_dir, threads=1)
    first = eng.generate([1, 2, 3], 1)[0]
    assert eng.generate([1, 2, 3], 10, eos_token_id=first) == [first]
    a = eng.generate([1, 2, 3], 10, greedy=False, temperature=1.0, top_k=20, seed=1)
    b = eng.generate([1, 2, 3], 10, greedy=False, temperature=1.0, top_k=20, seed=1)
    assert a == b and len(a) == 10


def test_sample_next_filters():
    rng = np.random.default_rng(0)
    logits = np.array([[0.0, 5.0, 4.9, -3.0]] * 200)
    top1 = sample_next(logits, rng, greedy=False, top_k=1)
    assert (top1 == 1).all()
    nucleus = sample_next(logits, rng, greedy=False, top_p=0.5)
    assert set(nucleus.tolist()) == {1}
    both = sample_next(logits, rng, greedy=False, top_k=2)
    assert set(both.tolist()) == {1, 2}


def test_parity_check_detects_a_different_model(tiny_llama_dir, tiny_onnx_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ok = check_parity(model, tiny_onnx_dir, atol=1e-4, rtol=1e-4, threads=1)
    assert ok["ok"]
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    bad = check_parity(model, tiny_onnx_dir, atol=1e-4, rtol=1e-4, threads=1)
    assert not bad["ok"] and bad["prefill_max_abs"] > 1e-4


def test_parity_failure_raises_stage_failed(tiny_llama_dir, tmp_path, monkeypatch):
    import pipeline.ort.export as ex

    monkeypatch.setattr(ex, "check_parity", lambda *a, **k: {"ok": False, "prefill_max_abs": 0.5,
                                                               "decode_max_abs": 0.25})
    with pytest.raises(StageFailed, match="export.parity.fp32") as e:
        export_onnx(tiny_llama_dir, tmp_path, parity={"fp32": {"atol": 1e-3, "rtol": 1e-3}})
    assert e.value.metrics["parity_prefill_max_abs"] == 0.5


def test_missing_tolerance_names_recipe_key(tiny_llama_dir, tmp_path):
    with pytest.raises(ForgeError, match="export.parity"):
        export_onnx(tiny_llama_dir, tmp_path, parity={"fp16": {"atol": 1e-2}})


def test_prefill_returns_each_rows_first_token_logits(tiny_onnx_dir):
    """engine.prefill is what generation's first token costs: the last position of every row, equal to the full
    logits' last column."""
    from pipeline.ort.engine import OrtEngine
    eng = OrtEngine(tiny_onnx_dir, threads=1)
    ids = np.random.default_rng(3).integers(3, 256, size=(3, 9))
    np.testing.assert_array_equal(eng.prefill(ids), eng.logits(ids)[:, -1])
    np.testing.assert_array_equal(eng.prefill(ids[0]), eng.logits(ids[:1])[:, -1])


def test_gather_rows_picks_each_rows_position_where_the_logits_live(tiny_onnx_dir):
    """The one-node GatherND (batch_dims 1) session behind the GPU's last-position logits, run here on the CPU
    provider: row b gets logits[b, idx[b]], for right-padded rows too."""
    import onnxruntime as ort
    from pipeline.ort.engine import OrtEngine
    eng = OrtEngine(tiny_onnx_dir, threads=1)
    x = np.random.default_rng(4).standard_normal((3, 7, 256)).astype(np.float32)
    idx = np.array([6, 0, 3])
    got = eng._gather_rows(ort.OrtValue.ortvalue_from_numpy(x), idx)
    np.testing.assert_array_equal(got, x[np.arange(3), idx])
