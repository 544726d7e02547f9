"""docs/quantization.md rendering from the results JSON (fast; no model)."""

import json
from pathlib import Path

import quant_table as table     # lab/quant_table.py, the docs generator (lab/tests/conftest.py puts lab/ on the path)


def _metrics(algo, ppl, delta, **kw):
    m = {"algo": algo, "ppl_ptq": ppl, "ppl_ptq_delta_pct": delta, "seconds": {"calibrate": 12.0},
         "needs_sm": 89 if algo == "fp8" else None,
         "trtllm_quantization": {"quant_algo": {"fp8": "FP8", "int4_wo": "W4A16"}.get(algo, "W8A8_SQ_PER_CHANNEL"),
                                 "kv_cache_quant_algo": None},
         "top_outliers": [{"layer": "model.layers.0.self_attn.q_proj", "outlier_ratio": 150.0, "act_amax": 80.0,
                           "act_channel_median": 0.5, "outlier_channels": [3, 17],
                           "smoothing_factor": {"max": 36.0}}]}
    m.update(kw)
    return m


def test_render_shows_ptq_qat_side_by_side():
    res = {"model": "/m", "device": "cpu", "machine": "x86_64, 2 logical CPUs", "ppl_fp32": 30.0, "rows": {
        "int8_sq-a0.5": {"q": {"method": "ptq"}, "metrics": _metrics("int8_sq", 31.0, 3.33)},
        "fp8": {"q": {"method": "ptq"}, "metrics": _metrics("fp8", 30.3, 1.0)},
        "int4_wo-g64 QAT+distill": {"q": {"method": "qat"}, "metrics": _metrics(
            "int4_wo", 36.0, 20.0, ppl_qat=32.4, ppl_qat_delta_pct=8.0, qat_gap_recovered=0.6,
            qat={"steps": 12, "seconds": 600.0, "loss_first": 1.5, "loss_last": 0.4})},
    }}
    md = table.render(res)
    assert "FP32 perplexity **30.000**" in md
    assert "| int8_sq-a0.5 | int8_sq | W8A8_SQ_PER_CHANNEL | — | 31.00 | +3.3 % |" in md
    assert "| fp8 | fp8 | FP8 | — | 30.30 | +1.0 % | 12 | sm89+ |" in md
    assert "| int4_wo-g64 QAT+distill | 36.00 (+20.0 %) | 32.40 (+8.0 %) | 60% | 12 | 600 | 1.500 → 0.400 |" in md
    assert "| model.layers.0.self_attn.q_proj | 150 | 80.0 | 3, 17 | 36.0 |" in md
    assert "not an engine" in md.lower() or "no tensorrt" in md.lower()


def test_checked_in_doc_matches_its_json():
    doc = Path(__file__).resolve().parents[2] / "docs" / "quantization.md"
    j = doc.with_suffix(".json")
    if not (j.exists() and doc.exists()):
        import pytest
        pytest.skip("docs/quantization.json not generated yet (python lab/quant_table.py)")
    text = doc.read_text()
    generated = text.split("\n" + table.HAND_WRITTEN)[0]   # what _write wrote before the hand-written tail
    assert generated == table.render(json.loads(j.read_text()))


def test_regenerating_keeps_the_hand_written_tail(tmp_path):
    out = tmp_path / "q.md"
    out.write_text("old table\n\n" + table.HAND_WRITTEN + "\n\nby hand\n")
    table._write(out, "new table\n")
    assert out.read_text() == "new table\n\n" + table.HAND_WRITTEN + "\n\nby hand\n"
    table._write(tmp_path / "fresh.md", "only\n")
    assert (tmp_path / "fresh.md").read_text() == "only\n"
