"""The default model through ModelOpt (minutes on 2 CPU cores): PTQ int8_sq + int8 KV, artifact restore."""

import pytest
import torch

from pipeline.quant import quantize_model, restore_model
from pipeline.recipe import QuantizeSection
from pipeline.quant.calibrate import perplexity



def real_model():
    import os
    from pathlib import Path
    return Path(os.environ.get("FORGE_TEST_MODEL", "/nonexistent-set-FORGE_TEST_MODEL"))

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir():
    d = real_model()
    if not (d / "config.json").exists():
        pytest.skip(f"FORGE_TEST_MODEL={d} has no config.json (set FORGE_TEST_MODEL to an HF dir of SmolLM2-135M)")
    return d


@pytest.fixture(scope="module")
def tok_windows(model_dir):
    from transformers import AutoTokenizer

    from pipeline import data
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    from pipeline.host.paths import forge_home
    home = forge_home()
    calib = data.token_windows(tok, data.load_text("sotu", "calib", home), 4, 128, 0)
    ev = data.token_windows(tok, data.load_text("wiki", "eval", home), 2, 128, 0)
    return calib, ev


def test_int8_sq_kv_int8_on_default_model(model_dir, tok_windows, tmp_path):
    calib, ev = tok_windows
    q = {"algo": "int8_sq", "alpha": 0.5, "kv_cache": "int8",
         "calibration": {"samples": 4, "seq_len": 128, "batch": 2, "seed": 0}}
    m = quantize_model(model_dir, QuantizeSection.model_validate(q), calib, tmp_path / "a", eval_windows=ev)
    assert 5 < m["ppl_fp32"] < 100
    assert m["ppl_ptq"] > m["ppl_fp32"] * 0.97               # quantization does not make it much better
    assert m["ppl_ptq_delta_pct"] < 50                       # and alpha 0.5 does not wreck it
    assert m["trtllm_quantization"] == {"quant_algo": "W8A8_SQ_PER_CHANNEL", "kv_cache_quant_algo": "INT8",
                                        "smoothquant_val": 0.5}
    # SmolLM2's layer-0 inputs carry the big outliers (measured: smoothing factors ~1300 with alpha 1.0)
    assert m["top_outliers"][0]["outlier_ratio"] > 20
    restored = restore_model(model_dir, tmp_path / "a")
    attn = restored.model.layers[3].self_attn
    assert attn.k_bmm_quantizer.is_enabled and float(attn.k_bmm_quantizer.amax) > 0
    assert perplexity(restored, ev, 2) == pytest.approx(m["ppl_ptq"], rel=1e-5)


@pytest.mark.gpu
def test_cuda_path(model_dir, tok_windows, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    calib, ev = tok_windows
    m = quantize_model(model_dir, QuantizeSection(algo="int4_awq", block_size=64,
                                                  calibration={"samples": 4, "seq_len": 128, "batch": 2, "seed": 0}),
                       calib, tmp_path / "g", eval_windows=ev, device="cuda")
    assert m["ppl_ptq_delta_pct"] < 30
    assert restore_model(model_dir, tmp_path / "g", device="cuda").lm_head.weight.is_cuda
