"""pipeline.ort.pack_qkv: the q/k/v projections of each attention as one MatMul (packed QKV into
GroupQueryAttention), and the MLP's gate/up MatMulNBits as one and a Split. The rewrites must not change a number:
same logits, same generated tokens, for plain MatMul and weight-only MatMulNBits graphs, and they must leave alone
what they cannot pack."""

import shutil

import numpy as np
import pytest

PROMPTS = [[5, 17, 33, 3, 60, 61, 9], [7, 8, 100, 4]]


def _packed_copy(src, dst, pack=None):
    import onnx
    from pipeline.ort.export import copy_side_files
    from pipeline.ort.pack_qkv import pack_qkv
    m = onnx.load(str(src / "model.onnx"))
    n = (pack or pack_qkv)(m)
    dst.mkdir(parents=True, exist_ok=True)
    onnx.save_model(m, str(dst / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    copy_side_files(src, dst)
    return n, m


def _unpacked_int4(src, dst, monkeypatch, **options):
    """An int4_wo graph as ORT's quantizer leaves it: the quantize stage's own packing turned off."""
    from pipeline.ort.quantize import quantize_onnx
    with monkeypatch.context() as mp:
        mp.setattr("pipeline.ort.quantize._pack_projections", lambda model: {})
        quantize_onnx(src, dst, algo="int4_wo", options=options)
    return dst


def _same_engine(a_dir, b_dir, atol):
    from pipeline.ort.engine import OrtEngine
    ids = np.random.default_rng(0).integers(3, 256, size=(2, 20))
    a, b = OrtEngine(a_dir, threads=1), OrtEngine(b_dir, threads=1)
    np.testing.assert_allclose(b.logits(ids), a.logits(ids), atol=atol, rtol=0)
    assert b.generate_batch(PROMPTS, 12) == a.generate_batch(PROMPTS, 12)


def test_packs_every_attention_of_a_matmul_graph_without_changing_logits(tiny_onnx_dir, tmp_path):
    n, m = _packed_copy(tiny_onnx_dir, tmp_path / "packed")
    gqa = [x for x in m.graph.node if x.op_type == "GroupQueryAttention"]
    assert n == len(gqa) == 2
    assert all(x.input[1] == "" and x.input[2] == "" for x in gqa)
    ops = [x.op_type for x in m.graph.node]
    assert ops.count("MatMul") == 2 * (7 - 2) + 1      # per layer q,k,v -> 1 (+ o, gate, up, down), + lm_head
    _same_engine(tiny_onnx_dir, tmp_path / "packed", atol=1e-4)


def test_packs_matmulnbits_int4_without_changing_logits(tiny_onnx_dir, tmp_path, monkeypatch):
    q = _unpacked_int4(tiny_onnx_dir, tmp_path / "int4", monkeypatch, block_size=32)
    n, m = _packed_copy(q, tmp_path / "packed")
    assert n == 2
    packed = [x for x in m.graph.node if x.op_type == "MatMulNBits" and x.name.endswith("_qkv")]
    assert len(packed) == 2
    assert {a.name: a.i for a in packed[0].attribute}["N"] == 64 + 2 * 32   # 4 heads + 2 x 2 kv heads of 16
    _same_engine(q, tmp_path / "packed", atol=1e-4)


def test_packs_rtn_int4_with_integer_zero_points_without_changing_logits(tiny_onnx_dir, tmp_path, monkeypatch):
    """Round-to-nearest int4: uint8 zero points, two per byte, by row of N (2 blocks per row here: no padding)."""
    q = _unpacked_int4(tiny_onnx_dir, tmp_path / "rtn", monkeypatch, block_size=32, method="rtn")
    n, m = _packed_copy(q, tmp_path / "packed")
    assert n == 2
    _same_engine(q, tmp_path / "packed", atol=1e-4)


def test_leaves_an_attention_whose_projection_is_read_elsewhere(tiny_onnx_dir, tmp_path):
    """A k projection also read by another node cannot be folded away: that attention stays unpacked."""
    import onnx
    from onnx import helper
    from pipeline.ort.pack_qkv import pack_qkv
    m = onnx.load(str(tiny_onnx_dir / "model.onnx"))
    att = next(x for x in m.graph.node if x.op_type == "GroupQueryAttention")
    m.graph.node.append(helper.make_node("Identity", [att.input[1]], ["k_probe"]))
    m.graph.output.append(helper.make_tensor_value_info("k_probe", onnx.TensorProto.FLOAT, None))
    assert pack_qkv(m) == 1
    assert att.input[1] != ""


def test_converted_fp16_graph_is_packed_and_fused(tiny_onnx_dir, tmp_path):
    from pipeline.ort.fp16 import convert_fp16
    metrics = convert_fp16(tiny_onnx_dir, tmp_path / "fp16")
    assert metrics["packed_qkv"] == 2 and metrics["fused_rms_norms"] == 5
    unpacked = convert_fp16(tiny_onnx_dir, tmp_path / "fp16_unpacked", fuse_qkv=False)
    assert unpacked["packed_qkv"] == 0
    _same_engine(tmp_path / "fp16_unpacked", tmp_path / "fp16", atol=2e-2)


@pytest.mark.parametrize("method", ["rtn", "hqq"])
def test_packs_gate_and_up_of_int4_graphs_into_one_kernel_and_a_split(method, tiny_onnx_dir, tmp_path, monkeypatch):
    """Integer (rtn: uint8, two per byte) and float (hqq) zero points: rows of N concatenated, a Split gives each
    projection's output its old name; the logits are bitwise equal. After pack_qkv nothing else is paired."""
    import onnx
    from pipeline.ort.engine import OrtEngine
    from pipeline.ort.pack_qkv import pack_gate_up, pack_qkv
    q = _unpacked_int4(tiny_onnx_dir, tmp_path / method, monkeypatch, block_size=32, method=method)
    n, m = _packed_copy(q, tmp_path / "packed", pack=lambda m: (pack_qkv(m), pack_gate_up(m)))
    assert n == (2, 2)
    fused = [x for x in m.graph.node if x.op_type == "MatMulNBits" and x.name.endswith("_gate_up")]
    assert [{a.name: a.i for a in x.attribute}["N"] for x in fused] == [2 * 128, 2 * 128]
    assert sum(x.op_type == "Split" for x in m.graph.node) == 2
    onnx.checker.check_model(str(tmp_path / "packed" / "model.onnx"))   # raises on an invalid graph
    ids = np.random.default_rng(5).integers(3, 256, (2, 11))
    np.testing.assert_array_equal(OrtEngine(tmp_path / "packed", threads=1).logits(ids),
                                  OrtEngine(q, threads=1).logits(ids))
    _same_engine(q, tmp_path / "packed", atol=0)


def test_gate_up_packing_leaves_what_it_cannot_pair(tiny_onnx_dir, tmp_path, monkeypatch):
    """A pair whose output is also a graph output, and a pair of different block sizes are left as they are."""
    import onnx
    from onnx import helper
    from pipeline.ort.pack_qkv import pack_gate_up
    q = _unpacked_int4(tiny_onnx_dir, tmp_path / "rtn", monkeypatch, block_size=32, method="rtn")
    m = onnx.load(str(q / "model.onnx"))
    readers = {}
    for x in m.graph.node:
        if x.op_type == "MatMulNBits":
            readers.setdefault(x.input[0], []).append(x)
    pairs = [v for v in readers.values() if len(v) == 2]
    assert len(pairs) == 2
    m.graph.output.append(helper.make_tensor_value_info(pairs[0][0].output[0], onnx.TensorProto.FLOAT, None))
    next(a for a in pairs[1][1].attribute if a.name == "block_size").i = 64
    assert pack_gate_up(m) == 0


def test_packs_int4_whose_zero_points_end_a_row_in_half_a_byte(tiny_onnx_dir, tmp_path, monkeypatch):
    """Block 64 over K 64: one 4-bit zero point per row, padded to a byte. Rows concatenate whole (the pack used to
    refuse such graphs, which left the int4 `offsets` recipe, 19 blocks per row, with no packing at all)."""
    from pipeline.ort.engine import OrtEngine
    from pipeline.ort.pack_qkv import pack_gate_up, pack_qkv
    q = _unpacked_int4(tiny_onnx_dir, tmp_path / "rtn64", monkeypatch, block_size=64, method="rtn")
    n, m = _packed_copy(q, tmp_path / "packed", pack=lambda m: (pack_qkv(m), pack_gate_up(m)))
    assert n == (2, 2)
    ids = np.random.default_rng(6).integers(3, 256, (2, 13))
    np.testing.assert_array_equal(OrtEngine(tmp_path / "packed", threads=1).logits(ids),
                                  OrtEngine(q, threads=1).logits(ids))


@pytest.mark.parametrize("options", [{"method": "offsets"}, {"method": "rtn", "lm_head_bits": 4},
                                     {"method": "hqq"}])
def test_the_int4_quantizer_packs_its_own_graph_with_the_same_logits(options, tiny_onnx_dir, tmp_path, monkeypatch):
    """quantize_onnx int4_wo packs q/k/v and gate/up in every route (8-bit lm_head or not), and the packed engine
    computes bitwise what the unpacked one does."""
    from pipeline.ort.engine import OrtEngine
    from pipeline.ort.quantize import quantize_onnx
    calib = np.random.default_rng(0).integers(3, 256, (4, 32))
    info = quantize_onnx(tiny_onnx_dir, tmp_path / "packed", algo="int4_wo", calib_windows=calib,
                         options={"block_size": 32, **options})
    assert info["packed_qkv"] == 2 and info["packed_gate_up"] == 2
    with monkeypatch.context() as mp:
        mp.setattr("pipeline.ort.quantize._pack_projections", lambda model: {})
        quantize_onnx(tiny_onnx_dir, tmp_path / "plain", algo="int4_wo", calib_windows=calib,
                      options={"block_size": 32, **options})
    ids = np.random.default_rng(8).integers(3, 256, (2, 10))
    np.testing.assert_array_equal(OrtEngine(tmp_path / "packed", threads=1).logits(ids),
                                  OrtEngine(tmp_path / "plain", threads=1).logits(ids))


def test_plain_matmul_gate_up_pack_too_and_compute_the_same(tiny_onnx_dir, tmp_path):
    """The fp32 graph's gate/up MatMuls (weights in the graph) pack into one MatMul and a Split, and q/k/v into one
    MatMul (the per-token prompt graph packs before it quantizes); the logits are those of the unpacked graph."""
    from pipeline.ort.engine import OrtEngine
    from pipeline.ort.pack_qkv import pack_gate_up, pack_qkv
    n, m = _packed_copy(tiny_onnx_dir, tmp_path / "packed", pack=lambda m: (pack_qkv(m), pack_gate_up(m)))
    assert n == (2, 2)
    ops = [x.op_type for x in m.graph.node]
    assert ops.count("Split") == 2 and ops.count("MatMul") == 2 * (1 + 1 + 1 + 1) + 1   # qkv, o, gate_up, down; lm_head
    ids = np.random.default_rng(7).integers(3, 256, (2, 13))
    np.testing.assert_allclose(OrtEngine(tmp_path / "packed", threads=1).logits(ids),
                               OrtEngine(tiny_onnx_dir, threads=1).logits(ids), rtol=1e-5, atol=1e-5)
