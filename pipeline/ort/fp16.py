"""FP16 graphs for the CUDA provider: ONNX Runtime's own float16 converter with forge's block list.

The norm statistics must not be computed in fp16: ``x**2`` overflows fp16 (max 65504) once a hidden activation
exceeds 256 in magnitude, and SmolLM2's attention-sink token (position 0) has mean(x^2) of 1.08e6 from layer 12 on
(measured, fp32 torch). So the exported RMSNorms (``Pow -> ReduceMean -> Add eps -> Sqrt -> Reciprocal -> Mul``)
are first fused into ``SimplifiedLayerNormalization`` (fp32 statistics inside the kernel, ``fuse_rms_norms``).
A norm the fusion does not match keeps its statistic ops in fp32 (``FP32_OPS``, casts inserted), and its
``Add eps`` between them is an ``Add`` like the residual adds, so it is kept fp32 by node name
(``norm_statistic_adds``): a fp16 Add turns that 1.08e6 into inf, Sqrt/Reciprocal into 0 and the normed row into
all zeros. On the CPU provider ORT runs fp16 nodes it has no fp16 kernel for in fp32, which hid this; on CUDA it
cost +40 % perplexity (H200, onnxruntime-gpu 1.31.1).
``Softmax`` (none in the GroupQueryAttention graph, which keeps its softmax inside the op in fp32 on CUDA, but the
standard-attention export has one per layer) stays fp32 too. The ``logits`` output stays fp32 (evaluate compares
it against FP32 torch); the KV cache inputs/outputs become fp16 so the runtime binds them in fp16 and the
GroupQueryAttention op keeps updating them in place (a fp32 KV with casts around the op would copy per step).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .export import META_FILE, MODEL_FILE, copy_side_files
from .norms import fuse_rms_norms
from .pack_qkv import pack_qkv

__all__ = ["FP32_OPS", "KEEP_FP32_IO", "convert_fp16", "fp32_nodes", "fuse_rms_norms", "norm_statistic_adds"]

FP32_OPS = ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax")
KEEP_FP32_IO = ("logits",)


def convert_fp16(in_dir: str | Path, out_dir: str | Path, *, fuse_norms: bool = True, fuse_qkv: bool = True) -> dict:
    """``in_dir/model.onnx`` (fp32, or weight-only quantized with fp32 scales) -> ``out_dir/model.onnx`` in fp16
    (external data), side files copied and ``forge_ort.json`` updated (``dtype: fp16``). ``fuse_norms``: RMSNorms
    become ``SimplifiedLayerNormalization`` first (see ``fuse_rms_norms``); ``fuse_qkv``: each attention's q/k/v
    projections become one (pipeline.ort.pack_qkv). Both keep the numbers and cut the kernels of a decode step.
    Returns metrics."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST
    from onnxruntime.transformers.onnx_model import OnnxModel

    in_dir, out_dir = Path(in_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    om = OnnxModel(onnx.load(str(in_dir / MODEL_FILE)))
    packed = pack_qkv(om.model) if fuse_qkv else 0
    fused = fuse_rms_norms(om) if fuse_norms else 0
    eps_adds = norm_statistic_adds(om.model)   # norms the fusion did not match
    # OnnxModel's wrapper, not float16.convert_float_to_float16 directly: it runs ORT's symbolic shape inference
    # (which knows the contrib ops) first and sorts the graph after. The bare converter with onnx's shape inference
    # mis-typed this graph (value infos of com.microsoft outputs unknown): all-zero logits, measured on CPU.
    # The op list covers the model's own ops; DEFAULT_OP_BLOCK_LIST (ops without fp16 kernels) is ORT's.
    om.convert_float_to_float16(keep_io_types=list(KEEP_FP32_IO),
                                op_block_list=list(DEFAULT_OP_BLOCK_LIST) + list(FP32_OPS),
                                node_block_list=eps_adds,
                                use_symbolic_shape_infer=True)
    model16 = om.model
    dropped = drop_duplicate_nodes(model16)
    for f in (out_dir / MODEL_FILE, out_dir / (MODEL_FILE + ".data")):
        f.unlink(missing_ok=True)
    onnx.save_model(model16, str(out_dir / MODEL_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=MODEL_FILE + ".data", size_threshold=1024)
    copy_side_files(in_dir, out_dir)
    meta = json.loads((in_dir / META_FILE).read_text()) if (in_dir / META_FILE).exists() else {}
    meta["dtype"] = "fp16"
    meta["fp16"] = {"tool": "onnxruntime.transformers.onnx_model.OnnxModel.convert_float_to_float16",
                    "fp32_ops": list(FP32_OPS), "fp32_io": list(KEEP_FP32_IO)}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    return {"fp32_nodes": dict(Counter(n.op_type for n in fp32_nodes(model16))), "fp32_eps_adds": len(eps_adds),
            "fused_rms_norms": fused, "packed_qkv": packed,
            "fp32_ops": list(FP32_OPS), "fp32_io": list(KEEP_FP32_IO), "duplicate_nodes_dropped": dropped}


def norm_statistic_adds(model) -> list[str]:
    """Names of the ``Add`` nodes that read a ``ReduceMean`` of a ``Pow`` (the ``+ eps`` of an RMSNorm or a
    LayerNorm's variance): kept fp32 with the statistics around them. Nameless ones get a name (the converter's
    node block list is by name)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    names = []
    for i, n in enumerate(model.graph.node):
        if n.op_type != "Add":
            continue
        srcs = [producer.get(x) for x in n.input]
        if any(s is not None and s.op_type == "ReduceMean" and (p := producer.get(s.input[0])) is not None
               and p.op_type == "Pow" for s in srcs):
            if not n.name:
                n.name = f"forge_norm_eps_add_{i}"
            names.append(n.name)
    return names


def drop_duplicate_nodes(model) -> int:
    """Remove nodes identical to an earlier one (op, inputs, outputs, attributes, name) and repeated value_infos.

    ONNX Runtime 1.31's float16 converter inserts one Cast per consumer of an fp16 value that an fp32-kept op reads,
    all with the same node name and output name, and ORT then refuses the model ("two nodes with same node name";
    measured on the H200 machine with onnxruntime-gpu 1.31.1). 1.32 shares one Cast per value (microsoft/onnxruntime
    onnxruntime/python/tools/transformers/float16.py, ``cast_output_names``): dropping the repeats gives its graph."""
    seen, keep, dropped = set(), [], 0
    for n in model.graph.node:
        key = (n.domain, n.op_type, n.name, tuple(n.input), tuple(n.output),
               tuple(a.SerializeToString() for a in n.attribute))
        if key in seen:
            dropped += 1
            continue
        seen.add(key)
        keep.append(n)
    if dropped:
        del model.graph.node[:]
        model.graph.node.extend(keep)
    names, infos = set(), []
    for v in model.graph.value_info:
        if v.name not in names:
            names.add(v.name)
            infos.append(v)
    if len(infos) != len(model.graph.value_info):
        del model.graph.value_info[:]
        model.graph.value_info.extend(infos)
    return dropped


def fp32_nodes(model) -> list:
    """Nodes of a converted graph that compute in fp32 (other than casts): those with a float output, read from the
    graph's value infos (the symbolic shape inference of the conversion records every tensor's type)."""
    import onnx
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*model.graph.value_info, *model.graph.output, *model.graph.input)}
    return [n for n in model.graph.node if n.op_type != "Cast"
            and any(types.get(o) == onnx.TensorProto.FLOAT for o in n.output)]
