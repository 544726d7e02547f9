"""Per-token dynamic INT8 (pipeline/ort/per_token.py, quantize.options.method: per_token): the rewrite computes
what it says, on ONNX Runtime, and the engine's metadata carries what its session needs."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import ForgeError
from pipeline.ort.engine import SATURATING_U8S8_CONFIG_KEY, OrtEngine, inference_session, session_options
from pipeline.ort.per_token import SESSION_CONFIG, per_token_int8, quantize_weight_per_channel
from pipeline.ort.quantize import STATS_FILE, batch_invariant, dynamic_int8_weights, isa_accuracy_risk, quantize_onnx


def _two_matmuls(w1, w2):
    """y1 = x @ w1, y2 = x @ w2 (one input read by two MatMuls), z = y1 @ w2.T-shaped third: [x] -> [y1, y2]."""
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["y1"], name="a"), helper.make_node("MatMul", ["x", "w2"], ["y2"], name="b")],
        "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", w1.shape[0]])],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, None), helper.make_tensor_value_info("y2", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _reference(x, w, bits):
    """The same arithmetic in numpy: x per row to u8 (scale max|x|/127, +128), w per column to s8, exact integer
    product, then the two scales."""
    m = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-12))
    xq = np.round(x * (np.float32(127) / m)).astype(np.int64)          # = u8 - 128
    wq, ws = quantize_weight_per_channel(w, bits)
    acc = (xq @ wq.astype(np.int64)).astype(np.float32)
    return acc * (m / np.float32(127)) * ws


@pytest.mark.parametrize("bits", [8, 7])
def test_per_token_graph_is_the_integer_arithmetic_it_claims(bits):
    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal((64, 48)) * 0.1).astype(np.float32), (rng.standard_normal((64, 32))).astype(np.float32)
    m = _two_matmuls(w1, w2)
    info = per_token_int8(m, ["a", "b"], weight_bits=bits)
    assert info == {"per_token_matmuls": 2, "quantized_inputs": 1, "weight_bits": bits,   # x quantized once
                    "fp32_outlier_channels": 0}
    ops = [n.op_type for n in m.graph.node]
    assert "MatMul" not in ops and ops.count("MatMulIntegerToFloat") == 2 and ops.count("ReduceMax") == 1
    assert not {"w1", "w2"} & {i.name for i in m.graph.initializer}      # the fp32 weights are gone
    x = rng.standard_normal((2, 5, 64)).astype(np.float32) * np.array([1, 300], np.float32)[:, None, None]
    x[1, 2] = 0.0                                                          # an all-zero row: scale eps, output 0
    so = session_options(1, "disable")
    y1, y2 = inference_session(m.SerializeToString(), so, ["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y1, _reference(x, w1, bits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y2, _reference(x, w2, bits), rtol=1e-5, atol=1e-4)
    assert np.all(y1[1, 2] == 0)
    # close to fp32: 8-bit per-channel weights, 8-bit per-row activations
    rel = np.abs(y1 - x @ w1).max() / np.abs(x @ w1).max()
    assert rel < (0.02 if bits == 8 else 0.04), rel


def test_outlier_channels_stay_fp32_and_the_rest_are_quantized_without_them():
    """LLM.int8()'s decomposition: the named input channels multiply their weight rows in fp32; the row's scale and
    the weight's channel scales are taken without them. One channel 1000x the others: without the split every other
    channel of that row falls into a few int8 steps; with it the product is as close as an ordinary row's."""
    rng = np.random.default_rng(1)
    w1, w2 = (rng.standard_normal((64, 48)) * 0.1).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    x[..., 7] *= 1000.0
    idx = np.array([7, 40])
    m = _two_matmuls(w1, w2)
    info = per_token_int8(m, ["a", "b"], weight_bits=8, outliers={"x": idx})
    assert info["fp32_outlier_channels"] == 2 and info["quantized_inputs"] == 1
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("Gather") == 1 and ops.count("MatMul") == 2 and ops.count("MatMulIntegerToFloat") == 2
    y1, y2 = inference_session(m.SerializeToString(), session_options(1, "disable"),
                               ["CPUExecutionProvider"]).run(None, {"x": x})
    inl = np.ones(64, np.float32)
    inl[idx] = 0
    for y, w in ((y1, w1), (y2, w2)):
        wi = w * inl[:, None]
        ref = _reference(x * inl, wi, 8) + x[..., idx] @ w[idx]
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-3)
    plain = _two_matmuls(w1, w2)
    per_token_int8(plain, ["a", "b"], weight_bits=8)
    p1, _ = inference_session(plain.SerializeToString(), session_options(1, "disable"),
                              ["CPUExecutionProvider"]).run(None, {"x": x})
    exact = x @ w1
    err_split, err_plain = np.abs(y1 - exact).max(), np.abs(p1 - exact).max()
    assert err_split < err_plain / 20, (err_split, err_plain)
    # still per row: a row alone gives the bits it gives in the batch
    sess = inference_session(m.SerializeToString(), session_options(1, "disable"), ["CPUExecutionProvider"])
    alone = sess.run(None, {"x": x[1:2, 2:3]})[0]
    assert np.array_equal(alone[0, 0], y1[1, 2])


def test_outlier_channels_are_the_largest_after_smoothing():
    from pipeline.ort.quantize import outlier_channels

    act = {"t": {"channel_absmax": np.array([1.0, 50.0, 3.0, 40.0], np.float32)},
           "u": {"channel_absmax": np.array([5.0, 1.0, 2.0], np.float32)}}
    # smoothing divides t's channel 1 by 100: channel 3 and 2 are now the largest
    got = outlier_channels(act, {"t": np.array([1, 100, 1, 1], np.float32)}, 2)
    assert got["t"].tolist() == [2, 3] and got["u"].tolist() == [0, 2]
    assert outlier_channels(act, {}, 0) == {} and outlier_channels(None, {}, 4) == {}


def test_weight_quantization_rounds_half_to_even_and_keeps_zero_columns():
    w = np.array([[1.0, 0.0], [-0.5, 0.0], [0.25, 0.0]], np.float32)
    q, s = quantize_weight_per_channel(w, 8)
    assert s.tolist() == [pytest.approx(1 / 127), 1.0] and q[:, 0].tolist() == [127, -64, 32] and not q[:, 1].any()
    with pytest.raises(ValueError, match="weight_bits must be 7 or 8"):
        per_token_int8(_two_matmuls(w, w), ["a"], weight_bits=4)


def test_per_token_engine_records_its_session_config_and_is_portable(tiny_onnx_dir, tmp_path, monkeypatch):
    """The quantize stage's graph: every weight MatMul per token, the session option that keeps full-range s8 exact
    on CPUs without VNNI in its metadata (the engine applies it), batch-invariant, no ISA accuracy risk."""
    calib = np.random.default_rng(0).integers(3, 256, (4, 32))
    info = quantize_onnx(tiny_onnx_dir, tmp_path, algo="int8", calib_windows=calib, options={"method": "per_token"})
    meta = json.loads((tmp_path / "forge_ort.json").read_text())
    q = meta["quantization"]
    assert meta[SATURATING_U8S8_CONFIG_KEY] == SESSION_CONFIG and "ort_session_config" not in meta
    assert q["method"] == "per_token" and q["weight_bits"] == 8
    assert batch_invariant(q) and dynamic_int8_weights(q) is None
    assert dynamic_int8_weights({"algo": "int8", "options": {"method": "per_token"}}) is None   # a recipe's section
    for isa in ("x86_64-avx2", "x86_64-avx512", "x86_64-avx512vnni", "x86_64-amx"):
        assert isa_accuracy_risk(q, isa) is None
    ops = {n.op_type for n in onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.node}
    assert "MatMulIntegerToFloat" in ops and "MatMul" not in ops
    # every input smoothed (down_proj's through up_proj) unless smoothquant_only is set
    stats = json.loads((tmp_path / STATS_FILE).read_text())
    # 2 layers x (attention input, MLP input, down_proj input) + the final norm's output, read by the lm_head
    assert len(stats["smoothquant"]) == 2 * 3 + 1
    assert {v["folded_into"] for v in stats["smoothquant"].values()} == {"norm", "matmul"}
    # 15 projections, every one quantized, in 9 integer products (q/k/v and gate/up packed)
    assert info["quantized_matmuls"] == 15 and info["per_token_matmuls"] == 9
    # the U8U8 kernels where u8 x s8 saturates only: with VNNI the option also takes them (0.56x the prompt speed)
    for saturates in (True, False):
        monkeypatch.setattr("pipeline.ort.engine.u8s8_saturates", lambda: saturates)
        opts = OrtEngine(tmp_path, threads=1).options
        if saturates:
            assert opts.get_session_config_entry("session.x64quantprecision") == "1"
        else:
            with pytest.raises(RuntimeError, match="does not have configuration"):
                opts.get_session_config_entry("session.x64quantprecision")
    monkeypatch.undo()
    eng = OrtEngine(tmp_path, threads=1)
    ids = np.random.default_rng(1).integers(3, 256, (1, 12))
    ref = OrtEngine(tiny_onnx_dir, threads=1).logits(ids)
    got = eng.logits(ids)
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() > 0.99, cos.min()


def test_an_unknown_int8_method_names_the_key_and_the_choices(tiny_onnx_dir, tmp_path):
    with pytest.raises(Exception) as e:
        quantize_onnx(tiny_onnx_dir, tmp_path, algo="int8", options={"method": "per_row"})
    assert "per_token" in str(e.value) and "method" in str(e.value)
    assert isinstance(e.value, (ForgeError, ValueError))


def test_a_blockwise_engine_with_a_per_token_prompt_graph(tiny_onnx_dir, tmp_path):
    """quantize.options.prefill: per_token: the blockwise graph for decode steps and prefill.onnx for prompts. A
    prompt (a call on an empty cache) runs on the prompt graph, decode steps on the other, so a row's numbers
    depend on its own phase only: alone and batched they are bitwise equal; the build stage optimises and checks
    both graphs."""
    from pipeline.ort.optimize import optimize
    calib = np.random.default_rng(0).integers(3, 256, (4, 32))
    q = tmp_path / "q"
    info = quantize_onnx(tiny_onnx_dir, q, algo="int8", calib_windows=calib,
                         options={"method": "blockwise", "prefill": "per_token"})
    meta = json.loads((q / "forge_ort.json").read_text())
    assert meta["prefill_model_file"] == "prefill.onnx" and meta[SATURATING_U8S8_CONFIG_KEY] == SESSION_CONFIG
    assert info["prefill"]["per_token_matmuls"] == 9 and info["prefill"]["packed_gate_up"] == 2 and meta["batch_invariant"] is True
    ops = lambda f: {n.op_type for n in onnx.load(str(q / f), load_external_data=False).graph.node}  # noqa: E731
    assert "MatMulNBits" in ops("model.onnx") and "MatMulIntegerToFloat" not in ops("model.onnx")
    assert "MatMulIntegerToFloat" in ops("prefill.onnx") and "MatMulNBits" not in ops("prefill.onnx")

    both, decode_only = OrtEngine(q, threads=1), OrtEngine(q, threads=1, prefill_graph=False)
    assert both.prefill_session is not None and decode_only.prefill_session is None
    ids = np.random.default_rng(1).integers(3, 256, (1, 12))
    # prompts: the prompt graph's numbers differ from the decode graph's (another quantizer), both near FP32
    ref = OrtEngine(tiny_onnx_dir, threads=1).logits(ids)
    a, b = both.logits(ids), decode_only.logits(ids)
    assert not np.array_equal(a, b)
    for got in (a, b):
        cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
        assert cos.min() > 0.99
    # a decode step runs on the decode graph: after the same prompt-graph prefill, the step's logits are the
    # decode graph's (the engine with the prompt graph turned off gives them from its own prefill's K/V)
    cache = both.cache(1, 16)
    both.forward(ids, np.array([12]), cache)
    step = both.decode(np.array([7]), cache)
    cache2 = decode_only.cache(1, 16)
    decode_only.forward(ids, np.array([12]), cache2)
    assert np.abs(step - decode_only.decode(np.array([7]), cache2)).max() < 0.05 * np.abs(step).max()

    rows = [list(map(int, r)) for r in np.random.default_rng(7).integers(3, 256, (3, 9))]
    rows[1] = rows[1][:4]
    together = both.generate_batch(rows, 5, greedy=True)
    assert [list(t) for t in together] == [list(both.generate(r, 5, greedy=True)) for r in rows]

    out = tmp_path / "opt"
    m = optimize(q, out, level="all", threads=1)
    assert (out / "prefill.onnx").exists() and m["graphs"] == ["model.onnx", "prefill.onnx"]
    assert [c["check_graph"] for c in m["checks"]] == ["model", "prompt"]
    assert all(c["check_cosine"] > 0.999 for c in m["checks"])
    # both graphs had their norms fused (2 layers x 2 + the final one; all but the first read a residual add)
    assert sorted(m["fused_norms"]) == m["graphs"]
    assert all(f["rms_norms"] == 5 and f["skip_norms"] == 4 and f["nodes_after"] < f["nodes_before"]
               for f in m["fused_norms"].values())
    assert ops("model.onnx") >= {"Pow", "Reciprocal"} and "SkipSimplifiedLayerNormalization" not in ops("model.onnx")
    for f in ("model.onnx", "prefill.onnx"):
        fused = {n.op_type for n in onnx.load(str(out / f), load_external_data=False).graph.node}
        assert "SkipSimplifiedLayerNormalization" in fused and not {"Pow", "Reciprocal"} & fused


@pytest.mark.parametrize("method", ["mixed", "dynamic", "per_token"])
def test_a_prompt_graph_is_refused_beside_other_methods(method, tiny_onnx_dir, tmp_path):
    with pytest.raises(ForgeError, match="quantize.options.prefill: per_token adds a prompt graph to method blockwise"):
        quantize_onnx(tiny_onnx_dir, tmp_path, algo="int8", options={"method": method, "prefill": "per_token"})


@pytest.mark.parametrize("flags, expect", [("fpu avx2 fma", True), ("avx2 avx512f avx512_vnni", False),
                                           ("avx2 avx_vnni", False), ("avx2 avx512f amx_int8 amx_tile", False),
                                           ("sse4_2", False)])
def test_the_triton_stub_probe_reads_the_kernel_flags(flags, expect, monkeypatch, tmp_path):
    """In Triton's python stub (no pipeline/), the engine module reads /proc/cpuinfo's flags: saturating u8 x s8 is
    AVX2 without AVX-VNNI, AVX512-VNNI or AMX, as pipeline/host/cpu.py's U8S8_SATURATING classes."""
    import builtins
    import io
    import sys

    from pipeline.ort import engine
    monkeypatch.setitem(sys.modules, "pipeline.host.cpu", None)      # import fails as in the stub
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: io.StringIO(f"processor : 0\nflags : {flags}\n")
                        if f == "/proc/cpuinfo" else real_open(f, *a, **k))
    assert engine.u8s8_saturates() is expect


def test_the_probe_agrees_with_the_cpu_classes_here():
    from pipeline.host.cpu import U8S8_SATURATING, cpu_isa_class
    from pipeline.ort import engine
    assert engine.u8s8_saturates() == (cpu_isa_class() in U8S8_SATURATING)


def test_blockwise_int8_packs_qkv_and_gate_up_and_computes_the_same_logits(tiny_onnx_dir, tmp_path, monkeypatch):
    """The blockwise graph's q/k/v are one MatMulNBits per attention and its gate/up one per MLP (fewer kernel calls
    per decode step) holding the very weights ORT's quantizer made: logits bitwise equal to the unpacked graph's,
    and the same greedy tokens alone and batched."""
    info = quantize_onnx(tiny_onnx_dir, tmp_path / "packed", algo="int8", options={"method": "blockwise"})
    assert info["packed_qkv"] == 2 and info["packed_gate_up"] == 2 and info["quantized_matmuls"] == 15
    ops = [n.op_type for n in onnx.load(str(tmp_path / "packed" / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 15 - 2 * 2 - 2 and ops.count("Split") == 2
    monkeypatch.setattr("pipeline.ort.quantize._pack_projections", lambda model: {})
    quantize_onnx(tiny_onnx_dir, tmp_path / "plain", algo="int8", options={"method": "blockwise"})
    ops = [n.op_type for n in onnx.load(str(tmp_path / "plain" / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 15
    ids = np.random.default_rng(3).integers(3, 256, (2, 9))
    packed, plain = OrtEngine(tmp_path / "packed", threads=1), OrtEngine(tmp_path / "plain", threads=1)
    np.testing.assert_array_equal(packed.logits(ids), plain.logits(ids))
    rows = [[5, 17, 33, 3, 60, 61, 9], [7, 8, 100, 4]]
    assert packed.generate_batch(rows, 10) == plain.generate_batch(rows, 10)


@pytest.mark.parametrize("sets, ok", [
    (["quantize.options.outlier_channels=8"], False),                       # blockwise alone: no per-token graph
    (["quantize.options.outlier_channels=8", "quantize.options.prefill=per_token"], True),
    (["quantize.options.outlier_channels=8", "quantize.options.method=per_token"], True),
    (["quantize.options.outlier_channels=65", "quantize.options.method=per_token"], False),
])
def test_outlier_channels_need_a_per_token_graph_and_a_bound(sets, ok):
    from pipeline.recipe import resolve

    if ok:
        assert resolve("smollm2-135m-int8", sets).quantize.options["outlier_channels"] == 8
        return
    with pytest.raises(ForgeError) as e:
        resolve("smollm2-135m-int8", sets)
    assert "quantize.options" in str(e.value) and "outlier_channels" in str(e.value)


def test_the_per_token_layout_keys_only_the_recipes_that_make_a_per_token_graph():
    """A change to the per-token graph (pipeline/ort/per_token.py LAYOUT) rebuilds the recipes that make one; the
    default's blockwise quantize key does not hold it, so it is not rebuilt for nothing."""
    from pipeline.ort.per_token import LAYOUT
    from pipeline.recipe import resolve
    from pipeline.stages.onnxruntime import OrtQuantize

    cfg = OrtQuantize().config
    assert "per_token_layout" not in cfg(resolve("smollm2-135m-int8"))
    for sets in (["quantize.options.prefill=per_token"], ["quantize.options.method=per_token"]):
        assert cfg(resolve("smollm2-135m-int8", sets))["per_token_layout"] == LAYOUT


def test_a_per_token_engine_with_outlier_channels_end_to_end(tiny_onnx_dir, tmp_path):
    """method per_token with outlier_channels through the quantizer: every quantized input keeps K channels in fp32,
    the engine's rows are bitwise equal alone and batched, and without calibration the option is refused by name."""
    calib = np.random.default_rng(0).integers(3, 256, (4, 32))
    info = quantize_onnx(tiny_onnx_dir, tmp_path / "q", algo="int8", calib_windows=calib,
                         options={"method": "per_token", "outlier_channels": 4})
    assert info["fp32_outlier_channels"] == 4 * info["quantized_inputs"] and info["quantized_inputs"] == 2 * 4 + 1
    eng = OrtEngine(tmp_path / "q", threads=1)
    rows = [np.random.default_rng(s).integers(3, 256, n) for s, n in ((1, 9), (2, 14))]
    batch, mask = np.zeros((2, 14), np.int64), np.zeros((2, 14), np.int64)
    for i, r in enumerate(rows):
        batch[i, :len(r)], mask[i, :len(r)] = r, 1
    together = eng.logits(batch, mask)
    for i, r in enumerate(rows):
        assert np.array_equal(eng.logits(r[None])[0], together[i, :len(r)])
    ref = OrtEngine(tiny_onnx_dir, threads=1).logits(batch[1:])
    cos = (together[1] * ref[0]).sum(-1) / (np.linalg.norm(together[1], axis=-1) * np.linalg.norm(ref[0], axis=-1))
    assert cos.min() > 0.99, cos.min()
    with pytest.raises(ForgeError, match="outlier_channels"):
        quantize_onnx(tiny_onnx_dir, tmp_path / "nocalib", algo="int8",
                      options={"method": "per_token", "outlier_channels": 4})
