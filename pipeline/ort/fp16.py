"""FP16 graphs for the CUDA provider: ONNX Runtime's own float16 converter with forge's block list.

What stays fp32 and why (SmolLM2's exported graph, measured): the RMSNorm of the export is decomposed
(``Pow -> ReduceMean -> Add eps -> Sqrt -> Reciprocal``); ``x**2`` overflows fp16 (max 65504) once a hidden
activation exceeds 256 in magnitude, and the residual stream of this model has outlier channels in the
thousands (see pipeline/ort/quantize.py), so those statistic ops run in fp32 and the converter inserts the casts.
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

__all__ = ["FP32_OPS", "KEEP_FP32_IO", "convert_fp16", "fp32_nodes"]

FP32_OPS = ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax")
KEEP_FP32_IO = ("logits",)


def convert_fp16(in_dir: str | Path, out_dir: str | Path) -> dict:
    """``in_dir/model.onnx`` (fp32, or weight-only quantized with fp32 scales) -> ``out_dir/model.onnx`` in fp16
    (external data), side files copied and ``forge_ort.json`` updated (``dtype: fp16``). Returns metrics."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST
    from onnxruntime.transformers.onnx_model import OnnxModel

    in_dir, out_dir = Path(in_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    om = OnnxModel(onnx.load(str(in_dir / MODEL_FILE)))
    # OnnxModel's wrapper, not float16.convert_float_to_float16 directly: it runs ORT's symbolic shape inference
    # (which knows the contrib ops) first and sorts the graph after. The bare converter with onnx's shape inference
    # mis-typed this graph (value infos of com.microsoft outputs unknown): all-zero logits, measured on CPU.
    # The op list covers the model's own ops; DEFAULT_OP_BLOCK_LIST (ops without fp16 kernels) is ORT's.
    om.convert_float_to_float16(keep_io_types=list(KEEP_FP32_IO),
                                op_block_list=list(DEFAULT_OP_BLOCK_LIST) + list(FP32_OPS),
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
    return {"fp32_nodes": dict(Counter(n.op_type for n in fp32_nodes(model16))),
            "fp32_ops": list(FP32_OPS), "fp32_io": list(KEEP_FP32_IO), "duplicate_nodes_dropped": dropped}


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
