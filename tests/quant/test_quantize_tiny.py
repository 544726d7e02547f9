"""PTQ / QAT / artifact round trip on a tiny random Llama (seconds)."""

import json

import pytest
import torch

from pipeline.quant import quantize_model, restore_model
from pipeline.quant.calibrate import calibrate, load_hf_model, perplexity
from pipeline.quant.stats import scales_fingerprint
from pipeline.recipe import QuantizeSection
from pipeline.trtllm.quantizers import QUANTIZERS


def section(q: dict) -> QuantizeSection:
    """A quantize section as a recipe holds it (validated by the schema, the one validation)."""
    return QuantizeSection.model_validate(q)



def _scales(model_dir, q, calib):
    from pipeline.modelinfo import ModelInfo
    info = ModelInfo.from_dir(model_dir)
    m = load_hf_model(model_dir)
    qs = section(q)
    qz = QUANTIZERS[qs.algo]
    m, act = calibrate(m, qz.modelopt_config(qz.options_of(qs), qs.kv_cache, info), calib, batch=2)
    return scales_fingerprint(m), act


def test_calibration_reproducible_same_seed_identical_scales(tiny_llama, windows):
    q = {"algo": "int8_sq", "alpha": 0.5, "kv_cache": "int8"}
    s1, a1 = _scales(tiny_llama, q, windows(8, 32, seed=1))
    s2, a2 = _scales(tiny_llama, q, windows(8, 32, seed=1))
    assert s1 and s1.keys() == s2.keys()
    assert any(k.endswith("input_quantizer._pre_quant_scale") for k in s1)   # SmoothQuant really ran
    assert any("k_bmm_quantizer" in k for k in s1)                            # KV quantizers calibrated
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k
    for k in a1:
        assert torch.equal(a1[k], a2[k]), k


def test_calibration_other_data_changes_scales(tiny_llama, windows):
    q = {"algo": "int8_sq", "alpha": 0.5}
    s1, _ = _scales(tiny_llama, q, windows(8, 32, seed=1))
    s3, _ = _scales(tiny_llama, q, windows(8, 32, seed=2))
    assert any(not torch.equal(s1[k], s3[k]) for k in s1 if k.endswith("input_quantizer._amax"))


def test_alpha_changes_smoothing(tiny_llama, windows):
    c = windows(8, 32, seed=1)
    s5, _ = _scales(tiny_llama, {"algo": "int8_sq", "alpha": 0.5}, c)
    s9, _ = _scales(tiny_llama, {"algo": "int8_sq", "alpha": 0.9}, c)
    k = next(k for k in s5 if k.endswith("_pre_quant_scale"))
    assert not torch.allclose(s5[k], s9[k])


def test_int4_block_size_reaches_modelopt(tiny_llama, windows):
    s, _ = _scales(tiny_llama, {"algo": "int4_wo", "block_size": 32}, None)
    amax = s["model.layers.0.mlp.down_proj.weight_quantizer._amax"]
    # down_proj: out 64 x in 96 -> 96 / 32 = 3 blocks per row
    assert amax.numel() == 64 * 3


def test_quantize_model_ptq_writes_artifact_and_restores(tiny_llama, tmp_path, windows):
    calib, ev = windows(8, 32, seed=1), windows(4, 32, seed=9)
    m = quantize_model(tiny_llama, section({"method": "ptq", "algo": "int8_sq", "alpha": 0.5,
                                            "calibration": {"samples": 8, "seq_len": 32, "batch": 2, "seed": 1}}),
                       calib, tmp_path / "a", eval_windows=ev)
    assert m["ppl_fp32"] > 1 and m["ppl_ptq"] > 1
    assert m["ppl_ptq_delta_pct"] == pytest.approx(100 * (m["ppl_ptq"] - m["ppl_fp32"]) / m["ppl_fp32"])
    assert m["trtllm_quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    assert len(m["top_outliers"]) == 5
    assert m["top_outliers"][0]["outlier_ratio"] >= m["top_outliers"][-1]["outlier_ratio"]
    # the planted large RMSNorm channels make layer 0's q/k/v/gate/up inputs the top outliers
    assert m["top_outliers"][0]["layer"].startswith("model.layers.0.")
    assert set(m["top_outliers"][0]["outlier_channels"][:2]) == {3, 17}
    stats = json.loads((tmp_path / "a" / "calib_stats.json").read_text())
    q0 = next(r for r in stats["layers"] if r["layer"] == "model.layers.0.self_attn.q_proj")
    assert q0["smoothing_factor"]["max"] > 1 and q0["input_quantizer"]["amax"]["max"] > 0
    assert q0["weight_quantizer"]["amax"]["numel"] == 64        # per output channel

    restored = restore_model(tiny_llama, tmp_path / "a")
    assert perplexity(restored, ev, 2) == pytest.approx(m["ppl_ptq"], rel=1e-5)
    assert restored.model.layers[0].self_attn.q_proj.input_quantizer.is_enabled


def test_quantize_model_qat_distill_lowers_train_loss(tiny_llama, tmp_path, windows):
    calib, train, ev = windows(8, 32, seed=1), windows(16, 32, seed=3), windows(4, 32, seed=9)
    q = {"method": "qat", "algo": "int4_wo", "block_size": 32,
         "calibration": {"samples": 8, "seq_len": 32, "batch": 2, "seed": 1},
         "qat": {"epochs": 2, "lr": 1e-3, "batch": 4, "samples": 16, "seq_len": 32, "warmup_steps": 1,
                 "distill": {"enabled": True, "temperature": 2.0, "alpha": 1.0}}}
    m = quantize_model(tiny_llama, section(q), calib, tmp_path / "q", train=train, eval_windows=ev)
    assert m["qat"]["steps"] == 8 and m["qat"]["distill"] is True
    assert len(m["qat"]["loss_curve"]) == 8
    assert m["qat"]["epoch_loss"][1] < m["qat"]["epoch_loss"][0]
    assert "ppl_qat" in m and "qat_gap_recovered" in m
    # QAT weights were saved: the restored model reproduces the post-QAT perplexity
    assert perplexity(restore_model(tiny_llama, tmp_path / "q"), ev, 2) == pytest.approx(m["ppl_qat"], rel=1e-5)


def test_quantize_model_rejects_bad_config(tiny_llama, tmp_path, windows):
    from pipeline.errors import RecipeError
    with pytest.raises(RecipeError, match=r"quantize\.block_size"):
        quantize_model(tiny_llama, section({"algo": "int4_awq", "block_size": 48}), windows(2, 16, 0),
                       tmp_path / "x")


def test_quantize_payload_is_reproducible(tiny_llama, tmp_path, windows):
    """Two runs of the same PTQ give byte-identical payloads (no timings or memory peaks in metrics.json),
    so the cache key of every stage after quantize is the same on any machine or FORGE_HOME."""
    from pipeline.hashing import tree_digest
    q = {"method": "ptq", "algo": "int8_sq", "alpha": 0.5,
         "calibration": {"samples": 8, "seq_len": 32, "batch": 2, "seed": 1}}
    runs = [quantize_model(tiny_llama, section(q), windows(8, 32, seed=1), tmp_path / d,
                           eval_windows=windows(4, 32, seed=9))
            for d in ("a", "b")]
    assert "seconds" in runs[0] and "peak_rss_mb" in runs[0]                   # still reported ...
    assert "seconds" not in json.loads((tmp_path / "a" / "metrics.json").read_text())   # ... not in the payload
    assert tree_digest(tmp_path / "a", use_stat_cache=False) == tree_digest(tmp_path / "b", use_stat_cache=False)
