"""Streaming reference numerics: one pass per call, files closed between layers, CPU == CUDA (issue 13)."""

from __future__ import annotations

import pytest
import torch

from pipeline.eval.metrics import compare_logits
from pipeline.trtllm import reference as R
from pipeline.trtllm.reference import ReferenceModel

from trtllm_tiny import tokens


def test_streams_one_layer_at_a_time(qwen_fp16_tp2_pp2, monkeypatch):
    """Every layer of every rank is read exactly once per pass, however many batches, and no rank file stays
    open while the next layer is read."""
    ckpt = qwen_fp16_tp2_pp2[2]
    rm = ReferenceModel(ckpt, device="cpu")
    loads, open_handles, max_open = [], [0], [0]
    orig_open, orig_load = rm._open, rm._load_layer

    class Counted:
        def __init__(self, h):
            self.h = h

        def __enter__(self):
            open_handles[0] += 1
            max_open[0] = max(max_open[0], open_handles[0])
            return self.h.__enter__()

        def __exit__(self, *exc):
            open_handles[0] -= 1
            return self.h.__exit__(*exc)

    monkeypatch.setattr(rm, "_open", lambda rank: Counted(orig_open(rank)))
    monkeypatch.setattr(rm, "_load_layer", lambda rank, i: loads.append((rank, i)) or orig_load(rank, i))
    batches = [tokens(2, 16, seed=s) for s in range(3)]
    outs = list(rm.iter_logits(batches))
    assert len(loads) == 4 * 2 and len(set(loads)) == 8          # 4 ranks x 2 local layers, once each
    assert max_open[0] == 1 and open_handles[0] == 0
    for b, o in zip(batches, outs):                               # one pass == one call per batch
        assert torch.equal(o, ReferenceModel(ckpt, device="cpu").logits(b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("fixture", ["qwen_fp16_tp2_pp2", "llama_sq_tp3"])
def test_cuda_matches_cpu(request, fixture):
    ckpt = request.getfixturevalue(fixture)[2 if fixture == "qwen_fp16_tp2_pp2" else 3]
    ids = tokens()
    cpu = ReferenceModel(ckpt, device="cpu").logits(ids)
    cuda = ReferenceModel(ckpt, device="cuda").logits(ids)
    r = compare_logits(cpu, cuda, ids)
    assert r["top1_agreement"] >= 0.999 and r["logits_cosine"] > 0.99999, r
    assert (cpu - cuda).abs().max() < 0.05


def test_default_device_follows_cuda():
    assert R.default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
