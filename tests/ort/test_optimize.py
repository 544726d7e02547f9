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


def test_cpu_graphs_get_their_rms_norms_fused_and_keep_their_numbers(tiny_onnx_dir, tmp_path):
    """ORT's session optimiser leaves the export's RMSNorms as seven nodes each; at ``extended`` on the CPU they and
    their residual adds become SkipSimplifiedLayerNormalization (ORT's python fusions), held to the unfused graph:
    same logits within the fp32 check, the same greedy tokens, and nothing of the pass left behind. The engine's
    weights are its own file, not a link into the input (a cache entry)."""
    import onnx
    out = tmp_path / "opt"
    m = optimize(tiny_onnx_dir, out, level="extended", threads=1)
    assert m["fused_norms"]["model.onnx"]["rms_norms"] == 5 and m["fused_norms"]["model.onnx"]["skip_norms"] == 4
    ops = [n.op_type for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 4 and ops.count("SimplifiedLayerNormalization") == 1
    assert not {"Pow", "ReduceMean", "Sqrt", "Reciprocal"} & set(ops)
    assert m["ops_before"]["Pow"] == 5 and m["check"] == "max_abs" and m["check_max_abs"] <= 1e-4
    a, b = OrtEngine(tiny_onnx_dir, 1), OrtEngine(out, 1)
    ids = np.random.default_rng(3).integers(3, 256, (2, 10))
    np.testing.assert_allclose(b.logits(ids), a.logits(ids), atol=1e-4)
    prompt = list(map(int, ids[0]))
    assert list(b.generate(prompt, 8, greedy=True)) == list(a.generate(prompt, 8, greedy=True))
    assert [p.name for p in tmp_path.iterdir()] == ["opt"]                     # the pass's temp dir is gone
    assert (out / "model.onnx.data").stat().st_ino != (tiny_onnx_dir / "model.onnx.data").stat().st_ino


def test_basic_level_and_the_cuda_provider_leave_the_norms_alone(tiny_onnx_dir, tmp_path):
    import onnx
    m = optimize(tiny_onnx_dir, tmp_path, level="basic", threads=1)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.node}
    assert m["fused_norms"] is None and {"Pow", "Reciprocal"} <= ops and "SkipSimplifiedLayerNormalization" not in ops


def test_the_norm_pass_reads_only_small_tensors_and_copies_the_weights(tiny_onnx_dir, tmp_path):
    """fuse_cpu_norms rewrites the graph without loading the weights: the output graph refers to a byte-equal copy
    of the data file (not a link: onnx and ORT refuse those), and ORT loads it with the same numbers."""
    import onnx
    from pipeline.ort.norms import fuse_cpu_norms
    r = fuse_cpu_norms(tiny_onnx_dir, tmp_path)
    assert r["model.onnx"]["nodes_after"] < r["model.onnx"]["nodes_before"]
    g = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    big = [t for t in g.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert big and {e.value for t in big for e in t.external_data if e.key == "location"} == {"model.onnx.data"}
    assert (tmp_path / "model.onnx.data").read_bytes() == (tiny_onnx_dir / "model.onnx.data").read_bytes()
    assert not (tmp_path / "model.onnx.data").is_symlink()
    assert (tiny_onnx_dir / "model.onnx.data").stat().st_nlink == 1
    ids = np.random.default_rng(4).integers(3, 256, (1, 7))
    np.testing.assert_allclose(OrtEngine(tmp_path, 1).logits(ids), OrtEngine(tiny_onnx_dir, 1).logits(ids),
                               atol=1e-4)


def test_the_norm_pass_reads_an_input_whose_data_file_has_other_hard_links(tiny_onnx_dir, tmp_path):
    """The artifact cache hard-links equal files of its entries, and onnx's own external-data loader refuses such a
    file ("potential hardlink attack"): the first real build failed so. The pass reads the small tensors itself."""
    import os
    import shutil
    from pipeline.ort.norms import fuse_cpu_norms
    src = tmp_path / "entry"
    shutil.copytree(tiny_onnx_dir, src)
    os.link(src / "model.onnx.data", tmp_path / "twin.data")
    r = fuse_cpu_norms(src, tmp_path / "fused")
    assert r["model.onnx"]["skip_norms"] == 4


def test_the_norm_pass_refuses_a_graph_that_points_outside_its_directory(tiny_onnx_dir, tmp_path):
    import onnx
    import shutil
    from pipeline.ort.norms import fuse_cpu_norms
    src = tmp_path / "entry"
    shutil.copytree(tiny_onnx_dir, src)
    g = onnx.load(str(src / "model.onnx"), load_external_data=False)
    t = next(t for t in g.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in t.external_data if e.key == "location").value = "../../etc/passwd"
    onnx.save_model(g, str(src / "model.onnx"))
    with pytest.raises(ValueError, match="points outside its directory"):
        fuse_cpu_norms(src, tmp_path / "fused")


def test_the_cpu_build_asks_room_for_the_fused_copy_and_the_engine(tmp_path):
    """Free space is checked before a stage runs: on the CPU the build writes the norm-fused copy of the graph
    and the engine, twice the quantized payload; on CUDA only the engine."""
    from pipeline.recipe import resolve
    from pipeline.stages.onnxruntime import OrtBuildStage
    (tmp_path / "model.onnx.data").write_bytes(b"\0" * 1000)
    stage = OrtBuildStage()
    assert stage.output_bytes(resolve("smollm2-135m-int8"), None, {"quantize": tmp_path}) == 2000
    cuda = resolve("smollm2-135m-cuda-fp32")
    assert stage.output_bytes(cuda, None, {"quantize": tmp_path}) == 1000
