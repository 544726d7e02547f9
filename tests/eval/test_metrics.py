import math

import numpy as np
import pytest
import torch

from pipeline.eval.metrics import LogitsComparer, compare_logits, greedy_match, perplexity


def _data(B=2, T=16, V=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 3
    ids = torch.randint(0, V, (B, T), generator=g)
    return logits, ids


def test_identical_logits_are_perfect():
    logits, ids = _data()
    m = compare_logits(logits, logits.clone(), ids)
    assert m["ppl"] == pytest.approx(m["ref_ppl"])
    assert m["ppl_delta_pct"] == pytest.approx(0.0, abs=1e-9)
    assert m["top1_agreement"] == 1.0
    assert m["logits_cosine"] == pytest.approx(1.0)
    assert m["logits_max_abs"] == 0.0
    assert m["tokens"] == 32 and m["predictions"] == 30


def test_perplexity_matches_cross_entropy():
    logits, ids = _data()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))
    assert perplexity(logits, ids) == pytest.approx(math.exp(ce.item()), rel=1e-6)
    assert compare_logits(logits, logits, ids)["ref_ppl"] == pytest.approx(math.exp(ce.item()), rel=1e-6)


def test_uniform_logits_have_vocab_perplexity():
    _, ids = _data(V=50)
    assert perplexity(torch.zeros(2, 16, 50), ids) == pytest.approx(50.0)


def test_streaming_equals_one_shot_and_numpy_accepted():
    ref, ids = _data(B=4)
    cand = ref + 2.0 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
    whole = compare_logits(ref, cand, ids)
    c = LogitsComparer()
    for i in range(4):
        c.update(ref[i:i + 1].numpy(), cand[i:i + 1].numpy(), ids[i:i + 1].numpy())
    part = c.result()
    for k in ("ref_ppl", "ppl", "ppl_delta_pct", "top1_agreement", "logits_cosine", "logits_max_abs"):
        assert part[k] == pytest.approx(whole[k], rel=1e-6), k
    assert part["windows"] == 4
    assert whole["ppl"] > whole["ref_ppl"]  # noise hurts
    assert 0 < whole["top1_agreement"] < 1


def test_top1_and_cosine_and_maxabs_values():
    ref = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    cand = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    m = compare_logits(ref, cand, torch.tensor([[0, 1]]))
    assert m["top1_agreement"] == 0.5
    assert m["logits_cosine"] == pytest.approx(0.5)
    assert m["logits_max_abs"] == 1.0


def test_broken_candidate_fails_metrics():
    ref, ids = _data()
    zero = compare_logits(ref, torch.zeros_like(ref), ids)
    assert zero["ppl"] == pytest.approx(32.0)  # uniform over the vocab
    assert zero["logits_cosine"] == 0.0 and zero["top1_agreement"] < 0.2
    nan = compare_logits(ref, torch.full_like(ref, float("nan")), ids)
    assert nan["ppl"] == math.inf and nan["logits_max_abs"] == math.inf


def test_attention_mask_excludes_padding():
    ref, ids = _data(B=1, T=8)
    cand = ref.clone()
    cand[0, 6:] += 100.0  # garbage only at padded positions
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    m = compare_logits(ref, cand, ids, attention_mask=mask)
    assert m["logits_max_abs"] == 0.0 and m["top1_agreement"] == 1.0
    assert m["predictions"] == 5 and m["tokens"] == 6


def test_shape_mismatch_raises():
    ref, ids = _data()
    with pytest.raises(ValueError, match="differ in shape"):
        compare_logits(ref, ref[:, :-1], ids)


def test_greedy_match():
    r = greedy_match([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 9], [5, 6]])
    assert r["exact_match"] == 0.5
    assert r["prefix_ratio"] == pytest.approx((0.5 + 1.0) / 2)
    assert r["prefix_lengths"] == [2, 2]
    assert greedy_match([[]], [[]])["exact_match"] == 1.0
    with pytest.raises(ValueError):
        greedy_match([[1]], [])
