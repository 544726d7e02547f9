"""RMSNorms as one kernel each, by ONNX Runtime's own transformer fusions (onnxruntime.transformers).

The export writes each RMSNorm as ``Pow -> ReduceMean -> Add eps -> Sqrt -> Reciprocal -> Mul -> Mul(weight)``
(seven nodes) and the residual ``Add`` before it as one more. ORT's session-time optimiser fuses none of them: its
SimplifiedLayerNormFusion wants ``Div`` where the export has ``Reciprocal``, and its SkipLayerNormFusion matches
``LayerNormalization`` only (see pipeline.ort.engine.inference_session). ORT's python fusions match the export's
pattern (onnxruntime/python/tools/transformers/fusion_simplified_layernorm.py, ``Reciprocal`` branch):

- ``fuse_rms_norms``: each RMSNorm -> ``SimplifiedLayerNormalization`` (fp32 statistics, ``stash_type`` 1). Used by
  the fp16 conversion (pipeline.ort.fp16) and here.
- ``fuse_cpu_norms``: for CPU graphs, also residual ``Add`` + norm -> ``SkipSimplifiedLayerNormalization`` (the sum
  goes on through its fourth output), the layout ORT GenAI's model builder writes for the CPU. A decode step of
  the default INT8 engine ran 738 nodes and runs 342 (312 with gate/up packed). Not on CUDA fp16: that kernel sums
  x^2 in fp16 (pipeline.ort.fp16).

Only the graph is parsed and rewritten: the weights' data files are copied byte for byte, never loaded, so the pass
costs no memory for the model's size.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

from .export import copy_side_files, graph_files

__all__ = ["fuse_rms_norms", "fuse_cpu_norms"]

# external tensors smaller than this are read into the graph: the fusions read the norms' constants (eps, the
# exponent 2) and the shape inference their small shape tensors
_INLINE_BYTES = 4096


def fuse_rms_norms(om) -> int:
    """Every decomposed RMSNorm of ``om`` (an ``onnxruntime.transformers.onnx_model.OnnxModel``) -> one
    ``SimplifiedLayerNormalization`` node, by ONNX Runtime's own fusion (the Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul
    pattern of our export). Its kernels take fp16 or fp32 in and out and accumulate the statistics in fp32 (ORT's
    LayerNorm kernels, U = float for MLFloat16), so no cast surrounds it: ~11 nodes per norm become 1 in the fp16
    graph (61 norms in SmolLM2, 247 casts -> 3). Returns the number of ``SimplifiedLayerNormalization`` nodes."""
    from onnxruntime.transformers.fusion_simplified_layernorm import FusionSimplifiedLayerNormalization

    FusionSimplifiedLayerNormalization(om).apply()
    om.prune_graph()
    return sum(n.op_type == "SimplifiedLayerNormalization" for n in om.model.graph.node)


def _inline_small_external(model, base: Path) -> set[str]:
    """Read external tensors under ``_INLINE_BYTES`` into the graph; returns the data files the rest live in."""
    from onnx import TensorProto

    files = set()
    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = Path(info["location"])
        if loc.is_absolute() or ".." in loc.parts:
            raise ValueError(f"{base}: tensor {t.name} points outside its directory ({loc})")
        if int(info.get("length", _INLINE_BYTES)) < _INLINE_BYTES:
            # read here rather than by onnx's loader, which refuses a file with several hard links, and the
            # artifact cache hard-links equal files of its entries
            with open(base / loc, "rb") as f:
                f.seek(int(info.get("offset", 0)))
                t.raw_data = f.read(int(info["length"]))
            t.data_location = TensorProto.DEFAULT
            del t.external_data[:]
        else:
            files.add(str(loc))
    return files


def _copy_data(src: Path, dst: Path) -> None:
    # copied, not linked: onnx refuses a data file with several hard links ("potential hardlink attack"), so a
    # second build reading the cache entry meanwhile would fail, and ORT refuses a symbolic link that resolves
    # outside the graph's directory ("External data path escapes model directory", onnxruntime 1.31.1)
    dst.unlink(missing_ok=True)
    shutil.copyfile(src, dst)


def fuse_cpu_norms(in_dir: str | Path, out_dir: str | Path) -> dict:
    """Each graph of ``in_dir`` with its RMSNorms fused for the CPU provider, written to ``out_dir`` with the
    weights' data files copied as they are (never parsed) and the side files copied. Returns
    ``{graph: {"rms_norms": n, "skip_norms": m, "nodes_before": a, "nodes_after": b, "logits_start": bool}}``; a
    graph with no norm to fuse is written unchanged. Each graph also gets the ``logits_start`` input after its final
    norm (pipeline/ort/logits_start.py), so a prompt computes the lm_head for the positions it reads."""
    import onnx
    from onnxruntime.transformers.fusion_skiplayernorm import FusionSkipLayerNormalization
    from onnxruntime.transformers.onnx_model import OnnxModel

    from .logits_start import add_logits_start

    in_dir, out_dir = Path(in_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {}
    for name in graph_files(in_dir):
        model = onnx.load(str(in_dir / name), load_external_data=False)
        data_files = _inline_small_external(model, in_dir)
        before = len(model.graph.node)
        om = OnnxModel(model)
        fuse_rms_norms(om)
        # shape_infer=False: ORT's symbolic shape inference fails on the per-token prompt graph (a TypeError on
        # its ReduceMax row scales) and the fusion then does nothing. Without it the fusion takes Add input 1 as the
        # skip; it already refuses Adds of an initializer (a bias), so what it fuses are the residual adds, whose
        # inputs have one shape. optimize() holds the result to the unfused graph's logits.
        FusionSkipLayerNormalization(om, "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
                                     shape_infer=False).apply()   # = FusionSkipSimplifiedLayerNormalization's
        om.prune_graph()
        om.topological_sort()
        sliced = add_logits_start(om.model)
        ops = Counter(n.op_type for n in om.model.graph.node)
        onnx.save_model(om.model, str(out_dir / name))   # external tensors keep their location, offset, length
        for f in data_files:
            _copy_data(in_dir / f, out_dir / f)
        result[name] = {"rms_norms": ops["SimplifiedLayerNormalization"] + ops["SkipSimplifiedLayerNormalization"],
                        "skip_norms": ops["SkipSimplifiedLayerNormalization"],
                        "nodes_before": before, "nodes_after": len(om.model.graph.node), "logits_start": sliced}
    copy_side_files(in_dir, out_dir)
    return result
