"""Reference numerics with one rank per process (issue 18): torchrun, gloo on CPU / NCCL on GPUs.

Each run is ``torchrun --standalone`` (its rendezvous takes a free port) in its own session, killed as a group on
timeout or when done (``distributed.launch``), so no worker outlives a test. One thread per worker (2-core machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline.trtllm import distributed as D

TIMEOUT_S = 180


def torchrun(ckpt: Path, nproc: int, out: Path, *extra: str, device: str = "cpu") -> dict:
    """``python -m pipeline.trtllm.distributed`` under torchrun, one thread per rank; rank 0's result.json."""
    return D.launch(ckpt, nproc, out, *extra, device=device, timeout_s=TIMEOUT_S)


def _check_ranks(res: dict, tp: int, pp: int, backend: str):
    assert (res["tp"], res["pp"], res["world"], res["backend"]) == (tp, pp, tp * pp, backend)
    ranks = res["ranks"]
    assert [r["rank"] for r in ranks] == list(range(tp * pp))
    assert [(r["stage"], r["tp_rank"]) for r in ranks] == [(s, t) for s in range(pp) for t in range(tp)]
    assert len({r["pid"] for r in ranks}) == tp * pp                      # one process per rank
    layers = res["_layers"]
    for r in ranks:
        # every decoder layer of the rank's stage did its two all-reduces (attention, MLP) per batch
        per_stage = layers // pp
        n_batches = -(-res["samples"] // res["batch"])
        mine = {k for k in r["allreduce_s_by_layer"] if k != "embedding"}
        assert mine == {str(r["stage"] * per_stage + i) for i in range(per_stage)}, r
        emb = 1 if r["stage"] == 0 else 0                                   # parallel embedding, stage 0 only
        assert r["allreduce_calls"] == n_batches * (2 * per_stage + emb), r
        assert (r["handoff_s"] > 0) == (pp > 1), r


def test_tp2_int8_sq_kv_int8_matches_single_process(qwen_sq_tp2, tmp_path):
    res = torchrun(qwen_sq_tp2, 2, tmp_path, "--samples", "3", "--seq-len", "40", "--batch", "2", "--compare",
                   "--resident")
    res["_layers"] = 4
    _check_ranks(res, 2, 1, "gloo")
    assert (res["quant_algo"], res["kv_cache_quant_algo"]) == ("W8A8_SQ_PER_CHANNEL", "INT8")
    c = res["compare"]
    # two float32 partial sums add the same in either order: the same bits as the single-process reference
    assert c["max_abs"] == 0.0 and c["top1_agreement"] == 1.0 and c["batches_bit_identical"] == 2, c
    assert c["ppl_per_rank"] == c["ppl_single_process"]


def test_tp2_pp2_four_processes_match_single_process(qwen_fp16_tp2_pp2, tmp_path):
    ckpt = qwen_fp16_tp2_pp2[2]                     # 1 KV head: duplicated on both TP ranks
    res = torchrun(ckpt, 4, tmp_path, "--samples", "2", "--seq-len", "24", "--batch", "1", "--compare",
                   "--bench-allreduce")
    res["_layers"] = 4
    _check_ranks(res, 2, 2, "gloo")
    c = res["compare"]
    assert c["max_abs"] <= 1e-3 and c["top1_agreement"] == 1.0 and c["logits_cosine"] > 0.999999, c
    b = res["allreduce_bench"]
    assert b["ranks"] == 2 and b["shape"] == [1, 24, 64] and b["median_s"] > 0


@pytest.mark.parametrize("case", ["int8_sq kv int8 tp 2", "fp16 tp 2 x pp 2"])
def test_forge_memory_weights_per_rank_match_the_checkpoint_files(request, case):
    """`forge memory`'s per-rank weights against the bytes of each rank{N}.safetensors ModelOpt wrote: the decoder
    linears and the (parallel) embedding exactly, the whole within 0.1 %; replicating the embedding (the planner's
    old assumption) would be (tp - 1) / tp of the table too much."""
    from pipeline.trtllm.memory import plan_memory, rank_weight_bytes
    from pipeline.modelinfo import ModelInfo
    if case.startswith("int8_sq"):
        ckpt, quant, kv, tp, pp = request.getfixturevalue("qwen_sq_tp2"), "int8_sq", "int8", 2, 1
    else:
        ckpt, quant, kv, tp, pp = request.getfixturevalue("qwen_fp16_tp2_pp2")[2], "none", None, 2, 2
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["use_parallel_embedding"] is True and cfg["embedding_sharding_dim"] == 0
    info = ModelInfo.from_dir(ckpt.parent / "hf")
    plan = plan_memory(info, quant_algo=quant, kv_cache=kv, tp=tp, pp=pp, max_batch_size=1, max_seq_len=64,
                       parallel_embedding=True)
    ranks = [rank_weight_bytes(ckpt, r) for r in range(tp * pp)]
    for m in ranks:
        assert m["decoder linears"] == plan.weights["decoder linears"]["bytes"]
        if "embedding" in m:
            assert m["embedding"] == plan.weights.get("embedding", {}).get("bytes", m["embedding"])
    worst = max(sum(m.values()) for m in ranks)
    assert abs(plan.weights_bytes - worst) <= 1e-3 * worst, (plan.weights, ranks)
    replicated = plan_memory(info, quant_algo=quant, kv_cache=kv, tp=tp, pp=pp, max_batch_size=1, max_seq_len=64)
    if pp == 1:
        assert replicated.weights_bytes - plan.weights_bytes == info.vocab_size * info.hidden_size * 2 - \
            ranks[0]["embedding"]


def test_without_torchrun_exit_2_with_the_launch_line(capsys, monkeypatch, tmp_path):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert D.main([str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "torchrun --standalone --nproc-per-node" in capsys.readouterr().err


def test_world_size_must_be_tp_times_pp(qwen_sq_tp2):
    """One process for a tp 2 checkpoint: a message naming the nproc to launch, not a hang."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(ValueError, match=r"tp_size 2 x pp_size 1 = 2 ranks, but 1 processes.*--nproc-per-node 2"):
            D.DistributedReference(qwen_sq_tp2, device="cpu")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs 2 CUDA GPUs for NCCL, {torch.cuda.device_count()} visible")
def test_nccl_tp2_on_two_gpus_matches_single_process(qwen_sq_tp2, tmp_path):
    res = torchrun(qwen_sq_tp2, 2, tmp_path, "--samples", "4", "--seq-len", "64", "--compare", "--resident",
                   "--bench-allreduce", device="cuda")
    res["_layers"] = 4
    _check_ranks(res, 2, 1, "nccl")
    assert [r["device"] for r in res["ranks"]] == ["cuda:0", "cuda:1"]
    assert all(r["peak_gpu_bytes"] > 0 for r in res["ranks"])
    c = res["compare"]
    assert c["top1_agreement"] >= 0.999 and c["logits_cosine"] > 0.99999 and c["max_abs"] < 0.05, c
    assert res["allreduce_bench"]["busbw_gbs"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4,
                    reason=f"needs 4 CUDA GPUs for tp 2 x pp 2 over NCCL, {torch.cuda.device_count()} visible")
def test_nccl_tp2_pp2_on_four_gpus_matches_single_process(qwen_fp16_tp2_pp2, tmp_path):
    res = torchrun(qwen_fp16_tp2_pp2[2], 4, tmp_path, "--samples", "2", "--seq-len", "48", "--compare",
                   device="cuda")
    res["_layers"] = 4
    _check_ranks(res, 2, 2, "nccl")
    c = res["compare"]
    assert c["top1_agreement"] >= 0.999 and c["logits_cosine"] > 0.99999 and c["max_abs"] < 0.05, c
