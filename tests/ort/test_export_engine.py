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


def test_one_graph_has_kv_inputs_with_dynamic_past(tiny_onnx_dir):
    eng = OrtEngine(tiny_onnx_dir, threads=1)
    names = [i.name for i in eng.session.get_inputs()]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert "past_key_values.1.value" in names and eng.num_layers == 2
    past_dim = eng.session.get_inputs()[3].shape[2]
    assert isinstance(past_dim, str)  # symbolic


def test_logits_match_torch_batch_and_padding(tiny_llama_dir, tiny_onnx_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.numpy()
    got = OrtEngine(tiny_onnx_dir, threads=1).logits(ids)
    assert got.shape == (3, 20, 256)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_kv_decode_equals_full_recompute(tiny_onnx_dir):
    eng = OrtEngine(tiny_onnx_dir, threads=1)
    prompt = [5, 17, 99, 3, 42]
    got = eng.generate(prompt, 10)
    seq = list(prompt)
    for _ in range(10):
        seq.append(int(eng.logits(np.array([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]
    assert len(set(got)) > 1  # not a degenerate constant stream


def test_greedy_equals_torch_greedy(tiny_llama_dir, tiny_onnx_dir):
    from pipeline.eval.reference import TorchReference

    ref = TorchReference(tiny_llama_dir)
    eng = OrtEngine(tiny_onnx_dir, threads=1)
    for prompt in ([1, 2, 3], [200, 7, 7, 9, 100, 31]):
        assert eng.generate(prompt, 12) == ref.generate_greedy(prompt, 12)


def test_batch_generate_with_padding_equals_single(tiny_onnx_dir):
    eng = OrtEngine(tiny_onnx_dir, threads=1)
    prompts = [[1, 2, 3], [200, 7, 7, 9, 100, 31], [77]]
    batch = eng.generate_batch(prompts, 8)
    assert batch == [eng.generate(p, 8) for p in prompts]


def test_eos_and_sampling(tiny_onnx_dir):
    eng = OrtEngine(tiny_onnx_dir, threads=1)
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
