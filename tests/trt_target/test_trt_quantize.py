"""ModelOpt ONNX PTQ for the tensorrt target on a tiny exported Llama: the graph TensorRT's parser takes (QDQ only),
what is quantized, that ONNX Runtime's CPU provider runs it, and that the cached input is left untouched."""

from __future__ import annotations

import json

import onnx
import onnxruntime as ort
import pytest

from pipeline.errors import ForgeError
from pipeline.hashing import tree_digest
from pipeline.ort.engine import OrtEngine
from pipeline.recipe_options import TensorrtFp8Options, TensorrtInt8Options
from pipeline.tensorrt.quantize import TRT_UNPARSABLE, module_of, quantize_for_tensorrt, weight_matmuls


def _graph(d):
    return onnx.load(str(d / "model.onnx"), load_external_data=False)


def _quantized_modules(model) -> list[str]:
    prod = {o: n for n in model.graph.node for o in n.output}
    return sorted(module_of(n) if module_of(n) != n.name else n.name for n in model.graph.node
                  if n.op_type == "MatMul" and prod.get(n.input[1]) is not None
                  and prod[n.input[1]].op_type == "DequantizeLinear")


def _zero_point_types(model) -> set[int]:
    inits = {i.name: i.data_type for i in model.graph.initializer}
    return {inits[n.input[2]] for n in model.graph.node if n.op_type == "DequantizeLinear" and len(n.input) > 2}


INT8_COS = 0.99


def _scaled_copy(src, dst, factor: float):
    """A copy of a QDQ graph with the scales of its weight DequantizeLinear nodes multiplied by ``factor``."""
    import shutil
    from onnx import numpy_helper
    shutil.copytree(src, dst)
    g = onnx.load(str(dst / "model.onnx"), load_external_data=True)
    inits = {i.name: i for i in g.graph.initializer}
    prod = {o: n for n in g.graph.node for o in n.output}
    for n in g.graph.node:      # a weight's pair: QuantizeLinear(initializer) -> DequantizeLinear
        q = prod.get(n.input[0])
        if n.op_type == "DequantizeLinear" and q is not None and q.op_type == "QuantizeLinear" and q.input[0] in inits:
            s = numpy_helper.to_array(inits[n.input[1]]) * factor
            g.graph.initializer.append(numpy_helper.from_array(s.astype(s.dtype), n.input[1] + "_broken"))
            n.input[1] = n.input[1] + "_broken"
    for f in dst.glob("model.onnx*"):
        f.unlink()
    onnx.save_model(g, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx_data")
    return dst


def _cosine_top1(ref, got):
    import numpy as np
    r, g = ref.reshape(-1, ref.shape[-1]).astype(np.float64), got.reshape(-1, got.shape[-1]).astype(np.float64)
    cos = (r * g).sum(-1) / (np.linalg.norm(r, axis=-1) * np.linalg.norm(g, axis=-1))
    return float(cos.mean()), float((r.argmax(-1) == g.argmax(-1)).mean())


@pytest.fixture(scope="module")
def fp32_logits(tiny_export, calib_ids):
    return OrtEngine(tiny_export, threads=2).logits(calib_ids[:4])


def test_int8_qdq_on_weight_matmuls_runs_on_ort_cpu(tiny_export, calib_ids, fp32_logits, tmp_path):
    before = tree_digest(tiny_export, use_stat_cache=False)
    out = tmp_path / "int8"
    m = quantize_for_tensorrt(tiny_export, out, algo="int8", precision="fp16", calib_windows=calib_ids,
                              options=TensorrtInt8Options(), batch=4)
    # ModelOpt rewrites its input file in place (shape inference): the export must be staged, never touched
    assert tree_digest(tiny_export, use_stat_cache=False) == before
    g = _graph(out)
    ops = {n.op_type for n in g.graph.node}
    assert not ops & TRT_UNPARSABLE and {n.domain for n in g.graph.node} <= {"", "ai.onnx"}
    # 2 layers x (q, k, v, o, gate, up, down) weight MatMuls; down_proj excluded by default; lm_head (tied) untouched
    assert m["weight_matmuls"] == 14 and m["excluded"] == 2 and m["quantized_matmuls"] == 12
    assert [x for x in _quantized_modules(g) if "down_proj" in x or "lm_head" in x] == []
    assert "ort_session_config" not in json.loads((out / "forge_ort.json").read_text())   # INT8 keeps ORT's fusions
    assert m["smoothquant_alpha"] == 0.5 and m["calibration_method"] == "entropy"
    assert _zero_point_types(g) == {onnx.TensorProto.INT8}
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in g.graph.initializer)   # the rest in fp16
    assert not list(out.glob("*.onnx"))[1:], "intermediate ONNX files left in the payload"
    # a random-weight model has near-tied logits, so top-1 is a weak signal here; SmolLM2's numbers are in
    # tests/integration/test_tensorrt_recipe.py. Measured here: cosine 0.998, top-1 0.88.
    cos, top1 = _cosine_top1(fp32_logits, OrtEngine(out, threads=2).logits(calib_ids[:4]))
    assert INT8_COS < cos < 0.999999 and top1 > 0.8, (cos, top1)   # < 1: something was quantized
    # the bound catches a wrong quantization: the same graph with its weight scales off by 4x misses it
    broken = _scaled_copy(out, tmp_path / "broken", 4.0)
    cos_b, _ = _cosine_top1(fp32_logits, OrtEngine(broken, threads=2).logits(calib_ids[:4]))
    assert cos_b < INT8_COS, cos_b


def test_fp8_qdq_has_e4m3_zero_points_and_runs_on_ort_cpu(tiny_export, calib_ids, fp32_logits, tmp_path):
    out = tmp_path / "fp8"
    m = quantize_for_tensorrt(tiny_export, out, algo="fp8", precision="fp32", calib_windows=calib_ids,
                              options=TensorrtFp8Options(), batch=4)
    g = _graph(out)
    assert m["quantized_matmuls"] == 14 and m["excluded"] == 0 and m["calibration_method"] == "max"
    assert _zero_point_types(g) == {onnx.TensorProto.FLOAT8E4M3FN}
    assert not any(i.data_type == onnx.TensorProto.FLOAT16 for i in g.graph.initializer)   # precision fp32
    # ONNX Runtime 1.31.1's QDQ fusions turn E4M3 Q/DQ into an invalid graph (MatMulIntegerToFloat on float8): the
    # graph's meta asks for them off, and the engine honours it
    assert json.loads((out / "forge_ort.json").read_text())["ort_session_config"] == {"session.disable_quant_qdq": "1"}
    with pytest.raises(Exception, match="float8e4m3fn"):
        ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    cos, top1 = _cosine_top1(fp32_logits, OrtEngine(out, threads=2).logits(calib_ids[:4]))   # measured 0.972, 0.68
    assert 0.95 < cos < 0.999999 and top1 > 0.5, (cos, top1)   # E4M3: 3 mantissa bits, coarser than int8 here


def test_none_fp16_converts_without_qdq(tiny_export, calib_ids, fp32_logits, tmp_path):
    out = tmp_path / "none"
    m = quantize_for_tensorrt(tiny_export, out, algo="none", precision="fp16")
    g = _graph(out)
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in g.graph.node}
    assert g.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64   # I/O types kept
    assert m["algo"] == "none" and (out / "tokenizer_config.json").exists() == (tiny_export / "tokenizer_config.json").exists()
    cos, top1 = _cosine_top1(fp32_logits, OrtEngine(out, threads=2).logits(calib_ids[:4]))
    assert cos > 0.9999 and top1 > 0.97


def test_weight_matmuls_are_the_linear_layers(tiny_export):
    g = onnx.load(str(tiny_export / "model.onnx"), load_external_data=False)
    mods = sorted(module_of(n) for n in weight_matmuls(g))
    assert len(mods) == 14 and all(m.startswith("model.layers.") for m in mods)
    assert {m.rsplit(".", 1)[1] for m in mods} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"}


def test_options_resolve_per_algo_and_name_bad_keys():
    """The tensorrt target's quantizers (pipeline/tensorrt/quantize.py QUANTIZERS): the recipe validates their
    options once, the stage receives the typed model with its defaults."""
    from pipeline.errors import RecipeError
    from pipeline.recipe import resolve
    from pipeline.stages.common import quantize_options

    def opts(algo, *sets):
        return quantize_options(resolve("smollm2-135m-trt-int8", [f"quantize.algo={algo}", *sets]))
    assert opts("int8").exclude == ["*.mlp.down_proj"]
    assert opts("int8", "quantize.options.smoothquant_alpha=0.3").smoothquant_alpha == 0.3
    assert opts("int8", "quantize.options.smoothquant_alpha=null").smoothquant_alpha is None
    assert opts("fp8").calibration_method == "max" and opts("fp8").smoothquant_alpha is None
    for sets, match in ((["quantize.algo=int8", "quantize.options.smoothquant_alpah=0.3"],
                         r"quantize.options.smoothquant_alpah: unknown key; did you mean 'quantize.options.smoothq"),
                        (["quantize.algo=fp8", "quantize.options.calibration_method=percentile"],
                         r"quantize.options.calibration_method: 'percentile' is not allowed"),
                        (["quantize.method=none", "quantize.algo=none", "quantize.options.exclude=[x]"],
                         r"quantize.options.exclude: unknown key \(no key is allowed here\)")):
        with pytest.raises(RecipeError, match=match):
            resolve("smollm2-135m-trt-int8", sets)


def test_needs_calibration_and_a_known_precision(tiny_export, tmp_path):
    with pytest.raises(ForgeError, match="needs calibration data"):
        quantize_for_tensorrt(tiny_export, tmp_path / "a", algo="int8", precision="fp16")
    with pytest.raises(ForgeError, match="fp16 or fp32"):
        quantize_for_tensorrt(tiny_export, tmp_path / "b", algo="none", precision="bf16")
