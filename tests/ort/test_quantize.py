import json

import numpy as np
import onnx
import pytest

from pipeline.errors import ForgeError
from pipeline.eval.metrics import compare_logits
from pipeline.ort.engine import OrtEngine
from pipeline.ort.quantize import STATS_FILE, quantize_onnx

from broken_engine import break_scales   # tests/ort/broken_engine.py (pytest puts tests/ort on sys.path)


@pytest.fixture(scope="module")
def eval_ids():
    return np.random.default_rng(1).integers(0, 256, (2, 48))


@pytest.fixture(scope="module")
def ref_logits(tiny_onnx_dir, eval_ids):
    return OrtEngine(tiny_onnx_dir, threads=1).logits(eval_ids)


@pytest.fixture(scope="module")
def int8_dir(tiny_onnx_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8")
    calib = np.random.default_rng(0).integers(0, 256, (2, 32))
    m = quantize_onnx(tiny_onnx_dir, out, algo="int8", calib_windows=calib, options={"threads": 1})
    (out / "m.json").write_text(json.dumps(m))
    return out


def _ops(d):
    return {n.op_type for n in onnx.load(str(d / "model.onnx"), load_external_data=False).graph.node}


def test_int8_default_mixed_runs_integer_matmuls_and_records_method(int8_dir, tiny_onnx_dir):
    m = json.loads((int8_dir / "m.json").read_text())
    assert m["method"] == "mixed" and m["quantized_matmuls"] == 2 * 7 + 1  # 7 per layer + lm_head
    assert m["blockwise_nodes"] == 2 + 1  # down_proj per layer + lm_head
    ops = _ops(int8_dir)
    # attention stays float: it lives in GroupQueryAttention (export v2), which the quantizer never touches
    assert "MatMulInteger" in ops and "MatMulNBits" in ops and "GroupQueryAttention" in ops
    meta = json.loads((int8_dir / "forge_ort.json").read_text())
    assert meta["quantization"]["algo"] == "int8" and meta["quantization"]["method"] == "mixed"
    st = json.loads((int8_dir / STATS_FILE).read_text())
    assert len(st["smoothquant"]) == 2 * 2  # q/k/v and gate/up inputs of both layers
    # weights, lm_head and embedding are int8: the weight data shrinks ~4x (the tiny graph's proto dominates size_ratio)
    data = lambda d: (d / "model.onnx.data").stat().st_size
    assert data(int8_dir) < 0.35 * data(tiny_onnx_dir)


def test_int8_stats_have_weight_and_activation_ranges(int8_dir):
    st = json.loads((int8_dir / STATS_FILE).read_text())
    mods = {v["module"] for v in st["weights"].values()}
    assert "model.layers.1.mlp.down_proj" in mods and "lm_head" in mods
    acts = st["activations"]
    assert any("model.layers.0.self_attn.q_proj" in a["consumers"] for a in acts.values())
    for a in acts.values():
        assert a["max"] >= a["min"] and a["channel_absmax_max"] > 0
    assert st["embedding"]["rows"] == 256 and st["embedding"]["max_abs_error"] < 0.05


def test_int8_close_to_fp32(int8_dir, ref_logits, eval_ids):
    m = compare_logits(ref_logits, OrtEngine(int8_dir, threads=1).logits(eval_ids), eval_ids)
    assert abs(m["ppl_delta_pct"]) < 2.0
    # a random tiny model has many near-ties; the real gates are checked on the real model (integration test)
    assert m["top1_agreement"] > 0.75 and m["logits_cosine"] > 0.99


def test_broken_scales_fail_the_compare(int8_dir, ref_logits, eval_ids, tmp_path):
    changed = break_scales(int8_dir, tmp_path)
    assert len(changed) >= 15
    m = compare_logits(ref_logits, OrtEngine(tmp_path, threads=1).logits(eval_ids), eval_ids)
    # the gates: ppl delta <= 5 % and top-1 >= 85 % -- a broken engine must miss them
    assert m["top1_agreement"] < 0.85
    assert m["logits_cosine"] < 0.5


def test_exclude_keeps_lm_head_fp32(tiny_onnx_dir, tmp_path):
    m = quantize_onnx(tiny_onnx_dir, tmp_path, algo="int8", options={"exclude": ["lm_head"]})
    assert m["excluded"] == 1 and m["quantized_matmuls"] == 14


@pytest.mark.parametrize("method,op", [("dynamic", "MatMulInteger"), ("blockwise", "MatMulNBits")])
def test_int8_methods(tiny_onnx_dir, tmp_path, ref_logits, eval_ids, method, op):
    m = quantize_onnx(tiny_onnx_dir, tmp_path, algo="int8", options={"method": method})
    assert m["method"] == method and op in _ops(tmp_path)
    c = compare_logits(ref_logits, OrtEngine(tmp_path, threads=1).logits(eval_ids), eval_ids)
    assert c["logits_cosine"] > 0.99


def test_smoothquant_without_calibration_is_an_error(tiny_onnx_dir, tmp_path):
    with pytest.raises(ForgeError, match="calibration"):
        quantize_onnx(tiny_onnx_dir, tmp_path, algo="int8", options={"smoothquant_alpha": 0.5})


def test_int4_weight_only_uses_matmulnbits(tiny_onnx_dir, tmp_path, ref_logits, eval_ids):
    m = quantize_onnx(tiny_onnx_dir, tmp_path, algo="int4_wo", options={"block_size": 32})
    assert m["method"] == "MatMulNBits (HQQ)" and "block 32" in m["weights"]
    assert "MatMulNBits" in _ops(tmp_path)
    import onnx
    bits = [next(a.i for a in n.attribute if a.name == "bits")
            for n in onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.node if n.op_type == "MatMulNBits"]
    assert bits.count(8) == 1 and bits.count(4) == len(bits) - 1   # the untied lm_head stays 8-bit
    c = compare_logits(ref_logits, OrtEngine(tmp_path, threads=1).logits(eval_ids), eval_ids)
    assert c["logits_cosine"] > 0.85  # Gaussian random weights are far from int4-friendly


def test_int4_rtn_method_is_available(tiny_onnx_dir, tmp_path):
    m = quantize_onnx(tiny_onnx_dir, tmp_path, algo="int4_wo", options={"block_size": 32, "method": "rtn"})
    assert m["method"] == "MatMulNBits" and "asym block 32" in m["weights"]
    with pytest.raises(ForgeError, match="quantize.options.method"):
        quantize_onnx(tiny_onnx_dir, tmp_path / "x", algo="int4_wo", options={"method": "awq"})


def _nbits_nodes(d):
    m = onnx.load(str(d / "model.onnx"), load_external_data=True)
    inits = {i.name: i for i in m.graph.initializer}
    return [(n, {a.name: a.i for a in n.attribute}, inits) for n in m.graph.node if n.op_type == "MatMulNBits"]


@pytest.mark.parametrize("method", ["fit", "gptq", "offsets"])
def test_int4_fitted_methods_write_the_fast_layout_and_beat_rtn(tiny_onnx_dir, tmp_path, ref_logits, eval_ids,
                                                                 method):
    """Issue 41: integer (uint8) zero points and accuracy_level 4 -- the layout MLAS pre-packs for its int8 kernels,
    where HQQ's float zero points are dequantized on every call -- with values fitted to calibration data."""
    calib = np.random.default_rng(0).integers(0, 256, (16, 64))   # 1024 tokens for E[x x^T] of width <= 128
    m = quantize_onnx(tiny_onnx_dir, tmp_path / method, algo="int4_wo", calib_windows=calib,
                      options={"method": method, "threads": 1})
    assert m["method"] == f"MatMulNBits ({method})" and "integer zero points" in m["weights"]
    # the calibration output error each method minimises, against round to nearest's, per MatMul
    assert m["output_error_vs_rtn"]["median"] < 0.95 and m["output_error_vs_rtn"]["max"] <= 1.0 + 1e-6
    nodes = _nbits_nodes(tmp_path / method)
    four = [(n, a, i) for n, a, i in nodes if a["bits"] == 4]
    # per layer q/k/v packed into one, gate/up into one (pipeline/ort/pack_qkv.py): 4 kernels for 7 weights;
    # the untied lm_head stays 8-bit
    assert len(four) == 2 * 4 and len(nodes) == 2 * 4 + 1 and m["packed_qkv"] == m["packed_gate_up"] == 2
    for n, a, inits in four:
        assert a["accuracy_level"] == 4 and a["block_size"] == 32
        assert len(n.input) >= 4 and inits[n.input[3]].data_type == onnx.TensorProto.UINT8
        # offsets: the input is [x, blocksum(x)], K grows by one column per block (hidden 64 / intermediate 128)
        assert a["K"] in ((64 + 2, 128 + 4) if method == "offsets" else (64, 128))
        assert n.input[0].endswith("_blocksums") == (method == "offsets")
    meta = json.loads((tmp_path / method / "forge_ort.json").read_text())
    assert meta["batch_invariant"] is True
    rtn = quantize_onnx(tiny_onnx_dir, tmp_path / "rtn", algo="int4_wo", options={"method": "rtn"})
    assert rtn["method"] == "MatMulNBits"
    err = lambda d: float(np.mean((OrtEngine(d, threads=1).logits(eval_ids) - ref_logits) ** 2))  # noqa: E731
    assert err(tmp_path / method) < err(tmp_path / "rtn")


def test_int4_fitted_method_without_calibration_names_the_recipe_key(tiny_onnx_dir, tmp_path):
    with pytest.raises(ForgeError, match="quantize.calibration"):
        quantize_onnx(tiny_onnx_dir, tmp_path, algo="int4_wo", options={"method": "fit"})
    with pytest.raises(ForgeError, match="quantize.options.bias_correction applies to methods"):
        quantize_onnx(tiny_onnx_dir, tmp_path, algo="int4_wo", options={"method": "offsets", "bias_correction": True})
    # offsets reads the weights only
    m = quantize_onnx(tiny_onnx_dir, tmp_path / "o", algo="int4_wo", options={"method": "offsets"})
    assert m["method"] == "MatMulNBits (offsets)" and "blocksum" in m["weights"]


def test_int4_bias_correction_adds_matmulnbits_bias_inputs(tiny_onnx_dir, tmp_path):
    calib = np.random.default_rng(0).integers(0, 256, (4, 32))
    m = quantize_onnx(tiny_onnx_dir, tmp_path, algo="int4_wo", calib_windows=calib,
                      options={"method": "fit", "bias_correction": True, "threads": 1})
    assert m["bias_correction"] is True
    four = [(n, i) for n, a, i in _nbits_nodes(tmp_path) if a["bits"] == 4]
    assert four and all(len(n.input) == 6 and n.input[4] == "" and n.input[5] in i for n, i in four)
    OrtEngine(tmp_path, threads=1).logits(np.zeros((1, 4), np.int64))     # ORT runs the bias input


def test_none_is_a_copy(tiny_onnx_dir, tmp_path, ref_logits, eval_ids):
    m = quantize_onnx(tiny_onnx_dir, tmp_path, algo="none")
    assert m["size_ratio"] == pytest.approx(1.0, abs=0.01)
    np.testing.assert_array_equal(OrtEngine(tmp_path, threads=1).logits(eval_ids), ref_logits)


def test_unknown_algo_names_recipe_key(tiny_onnx_dir, tmp_path):
    with pytest.raises(ForgeError, match="quantize.algo"):
        quantize_onnx(tiny_onnx_dir, tmp_path, algo="fp4")


def test_smoothquant_fold_is_exact_in_fp32(tiny_onnx_dir, tmp_path, ref_logits, eval_ids):
    import shutil

    from pipeline.ort.quantize import _load, _save, activation_stats, fold_weight_transposes, smooth_fold, weight_matmuls

    model = _load(tiny_onnx_dir)
    fold_weight_transposes(model)
    acts = sorted({n.input[0] for n, _ in weight_matmuls(model)})
    st = activation_stats(tiny_onnx_dir, np.random.default_rng(0).integers(0, 256, (2, 32)), tensors=acts, threads=1)
    info = smooth_fold(model, {t: s["channel_absmax"] for t, s in st.items()}, 0.5)
    kinds = sorted(v["folded_into"] for v in info.values())
    # per layer: input norm (q/k/v), post-attention norm (gate/up), up_proj (down); + final norm (lm_head)
    assert kinds.count("norm") == 2 * 2 + 1 and kinds.count("matmul") == 2
    _save(model, tmp_path)
    shutil.copy2(tiny_onnx_dir / "forge_ort.json", tmp_path / "forge_ort.json")
    np.testing.assert_allclose(OrtEngine(tmp_path, threads=1).logits(eval_ids), ref_logits, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("algo,method,invariant", [("int8", "dynamic", False), ("int8", "mixed", False),
                                                   ("int8", "blockwise", True), ("int4_wo", None, True),
                                                   ("none", None, True)])
def test_batch_invariance_is_known_from_the_engine(tiny_onnx_dir, tmp_path, algo, method, invariant):
    """Dynamic INT8 computes one activation scale over the whole batch: a row's logits depend on its batch-mates
    (found by test_served_tokens_equal_validated_greedy: Triton batched 8 requests and 3 answers changed). The
    engine says so, and the Triton model then runs rows one at a time."""
    import numpy as np
    quantize_onnx(tiny_onnx_dir, tmp_path, algo=algo, options={"method": method} if method else {})
    eng = OrtEngine(tmp_path, threads=1)
    assert eng.batch_invariant is invariant
    rng = np.random.default_rng(3)
    row = rng.integers(0, 200, size=(1, 12))
    alone = eng.logits(row)[0]
    mates = np.concatenate([row, rng.integers(0, 200, size=(3, 12)) * 0 + 199], axis=0)   # large, constant ids
    batched = eng.logits(mates)[0]
    if invariant:
        np.testing.assert_allclose(batched, alone, rtol=1e-4, atol=1e-4)


def test_activation_moments_agree_between_the_diagonal_and_the_full_graph(tiny_onnx_dir):
    """The second moments the int4 fits read: E[x_i^2] by ReduceSumSquare and E[x x^T] by a MatMul of the flattened
    activations are two graphs for one quantity; E[x_i]^2 <= E[x_i^2] (Jensen)."""
    from pipeline.ort.quantize import activation_stats

    m = onnx.load(str(tiny_onnx_dir / "model.onnx"), load_external_data=False)
    tensors = sorted({n.input[0] for n in m.graph.node if n.op_type == "MatMul"})[:3]
    assert tensors
    calib = np.random.default_rng(2).integers(0, 256, (3, 16))
    diag = activation_stats(tiny_onnx_dir, calib, tensors=tensors, threads=1, moments="diag")
    full = activation_stats(tiny_onnx_dir, calib, tensors=tensors, threads=1, moments="full", batch_size=2)
    for t in tensors:
        h = full[t]["second_moment"]
        assert h.shape == (h.shape[0], h.shape[0]) and np.allclose(h, h.T, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.diag(h), diag[t]["channel_meansq"], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(full[t]["channel_mean"], diag[t]["channel_mean"], rtol=1e-4, atol=1e-6)
        assert np.all(diag[t]["channel_mean"] ** 2 <= diag[t]["channel_meansq"] * (1 + 1e-5) + 1e-9)
        assert "channel_meansq" not in activation_stats(tiny_onnx_dir, calib[:1], tensors=[t], threads=1)[t]
    with pytest.raises(ValueError, match="moments"):
        activation_stats(tiny_onnx_dir, calib, tensors=tensors, moments="cov")
