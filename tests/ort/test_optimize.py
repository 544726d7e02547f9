import json

import numpy as np
import pytest

from pipeline.errors import ForgeError
from pipeline.ort.engine import OrtEngine
from pipeline.ort.optimize import optimize
from pipeline.ort.quantize import quantize_onnx


@pytest.fixture(scope="module")
def int8_plain(tiny_onnx_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8_plain")
    quantize_onnx(tiny_onnx_dir, out, algo="int8")
    return out


def test_extended_fuses_dynamic_quant_and_keeps_logits(int8_plain, tmp_path):
    m = optimize(int8_plain, tmp_path, level="extended", threads=1)
    assert m["ops_before"].get("MatMulInteger", 0) > 0
    fused = m["ops_after"].get("DynamicQuantizeMatMul", 0) + m["ops_after"].get("MatMulIntegerToFloat", 0)
    assert fused >= m["ops_before"]["MatMulInteger"]
    assert m["check_max_abs"] <= 1e-3
    assert (tmp_path / "model.onnx.data").exists()
    meta = json.loads((tmp_path / "forge_ort.json").read_text())
    assert meta["optimization"]["level"] == "extended" and meta["optimization"]["threads"] == 1
    ids = np.arange(24).reshape(2, 12)
    np.testing.assert_allclose(OrtEngine(tmp_path, 1).logits(ids), OrtEngine(int8_plain, 1).logits(ids), atol=1e-3)


def test_bad_level_names_recipe_key(int8_plain, tmp_path):
    with pytest.raises(ForgeError, match="build.onnxruntime.opt_level"):
        optimize(int8_plain, tmp_path, level="O3")
