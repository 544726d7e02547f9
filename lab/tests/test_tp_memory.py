"""lab/tp_memory.py (issue 18's per-GPU memory run beside `forge memory`'s plan): its plan-only comparison at the
Qwen2.5-7B shape, and the script end to end on CPU (gloo). Moved from tests/trtllm/test_distributed.py: a lab script's
tests live in the lab (`make lab-test`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tp_memory as tpm     # lab/tp_memory.py (lab/tests/conftest.py puts lab/ on the path)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_forge_memory_weights_at_qwen7b_shape_match_the_contract(tp):
    """Qwen2.5-7B shape, int8_sq + INT8 KV: the plan's per-rank weights vs the bytes of the tensors the contract
    puts in each rank file (no file written). The plan leaves out only the 4-byte KV-cache scale per layer."""
    res = tpm.plan_only(json.loads(Path(tpm.QWEN7B).read_text()), tp, None, 8, 4096)
    assert res["layers"] == 28
    for r in res["ranks"]:
        assert r["contract_bytes"] - res["plan_weights_bytes"] == 28 * 4, r
        assert r["by_part"]["embedding"] == -(-152064 // tp) * 3584 * 2


def test_tp_memory_script_on_cpu(tmp_path):
    """lab/tp_memory.py end to end on a tiny shape (gloo): synthetic int8_sq + INT8-KV checkpoint, torchrun,
    plan beside it. On CPU there is no GPU memory to report; the rank files must match the plan's weights."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 301,
                               "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                               "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}))
    assert tpm.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--config", str(cfg),
                     "--tp", "2", "--samples", "2", "--seq-len", "16", "--device", "cpu", "--compare"]) == 0
    res = json.loads((tmp_path / "out/tp_memory.json").read_text())
    (run,) = res["runs"]
    assert run["tp"] == 2 and run["backend"] == "gloo" and run["compare"]["max_abs"] == 0.0
    for r in run["ranks"]:
        assert abs(r["plan_weights_vs_rank_file"] - 1) < 1e-3, r
        assert r["resident_gpu_bytes"] is None and r["peak_gpu_bytes"] is None
    assert run["plan"]["args"]["tp"] == 2 and run["plan"]["args"]["max_batch_size"] == 2
    md = (tmp_path / "out/tp_memory.md").read_text()
    assert md.count("\n| 2 | ") == 2
