"""Issue 3 gates on the real default model (minutes): export, default INT8, validate vs FP32 side by side.

Set FORGE_TEST_ONNX_FP32 to an existing FP32 export dir of the same model to skip the (slow) export.
"""
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def real_model_dir() -> Path:
    d = Path(os.environ.get("FORGE_TEST_MODEL", "/nonexistent-set-FORGE_TEST_MODEL"))
    if not (d / "config.json").exists():
        pytest.skip(f"real model not found at {d} (set FORGE_TEST_MODEL to an HF model dir)")
    return d


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory, request):
    src = real_model_dir()
    pre = os.environ.get("FORGE_TEST_ONNX_FP32")
    if pre and (Path(pre) / "model.onnx").exists():
        return Path(pre)
    if not os.environ.get("FORGE_TEST_EXPORT_FRESH"):
        # reuse the session's default-recipe build (same model, same exporter) instead of a second 3-min export
        _, results = request.getfixturevalue("default_build")
        if results["export"].status in ("built", "hit"):
            return Path(results["export"].payload)
    from pipeline.ort.export import export_onnx

    out = tmp_path_factory.mktemp("fp32")
    m = export_onnx(src, out, parity={"fp32": {"atol": 1e-3, "rtol": 1e-3}})
    assert m["parity_prefill_max_abs"] < 1e-3 and m["parity_decode_max_abs"] < 1e-3
    return out


def test_default_int8_meets_gates(fp32_dir, tmp_path):
    from transformers import AutoTokenizer

    from pipeline import data
    from pipeline.eval.metrics import LogitsComparer
    from pipeline.ort.engine import OrtEngine
    from pipeline.ort.export import model_bytes
    from pipeline.ort.quantize import quantize_onnx

    tok = AutoTokenizer.from_pretrained(fp32_dir)
    from pipeline.host.paths import forge_home
    home = forge_home()
    try:
        calib_text, eval_text = data.load_text("sotu", "calib", home), data.load_text("wiki", "eval", home)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"calibration/eval text not materialised ({e}); run `forge data fetch` first")
    calib = data.token_windows(tok, calib_text, 8, 256, 0)
    q = quantize_onnx(fp32_dir, tmp_path, algo="int8", calib_windows=calib, options={})
    assert q["method"] == "mixed"
    ev = data.token_windows(tok, eval_text, 8, 256, 1).numpy()
    ref, cand = OrtEngine(fp32_dir, 2), OrtEngine(tmp_path, 2)
    c = LogitsComparer()
    for s in range(0, len(ev), 4):
        c.update(ref.logits(ev[s:s + 4]), cand.logits(ev[s:s + 4]), ev[s:s + 4])
    r = c.result()
    assert r["ppl_delta_pct"] <= 5.0, r
    assert r["top1_agreement"] >= 0.85, r
    size = model_bytes(tmp_path) / model_bytes(fp32_dir)
    assert size <= 0.35, size
    # The >= 1.3x prefill speed gate is measured by `make bench` (side by side, medians, machine stated),
    # not by a timed test: CI timing on a shared 2-core box is not a measurement.
