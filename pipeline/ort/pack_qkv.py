"""Packed projections: QKV for GroupQueryAttention graphs (one projection MatMul per attention instead of three),
and the MLP's gate and up (``pack_gate_up``: one MatMulNBits and a Split instead of two).

Each attention of the export reads ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)``: three MatMuls of one input. Their
weights are concatenated along the output axis into one MatMul whose output GroupQueryAttention takes as packed QKV,
with its key and value inputs left empty (contract: onnxruntime/core/graph/contrib_ops/bert_defs.cc,
microsoft/onnxruntime@e5481648, the GroupQueryAttention schema: input 0 "Query with shape (batch_size,
sequence_length, hidden_size), or packed QKV with shape (batch_size, sequence_length, d) where d is (num_heads *
head_size + 2 * kv_num_heads * head_size)", inputs 1 and 2 ``OpSchema::Optional``; q, k, v in that order, as the
concatenation lays them out). The numbers do not change (the same dot products), but a decode step launches two
fewer kernels per layer, and decode of a small model on a GPU is bound by kernel launches.

Plain ``MatMul`` (weight [K, N]: concatenated on axis 1) and weight-only ``MatMulNBits`` (B [N, blocks, blob],
scales and zero points by row of N: concatenated on axis 0, ``N`` summed; contract
onnxruntime/core/graph/contrib_ops/contrib_defs.cc MatMulNBits, microsoft/onnxruntime@6fa5002d: B
``[N][n_blocks_per_col][blob_size]``, scales ``[N * n_blocks_per_col]``; packed uint8 zero points are padded to a
whole byte per row of N (ORT's quantizer writes ``N * ceil(n_blocks * bits / 8)`` bytes, e.g. 5,760 for N 576 and
19 blocks), so rows concatenate whole -- tests/ort/test_pack_qkv.py checks it bitwise with one block per row) are
packed; anything else (mixed ops, other
attributes, ``g_idx``/bias inputs, an output read by something other than the attention) is left as it is.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack_gate_up", "pack_qkv"]

_NBITS_SAME = ("K", "bits", "block_size", "accuracy_level")


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _drop_unused_initializers(g) -> None:
    """The weights the packed node replaced: nothing reads them any more."""
    used = {i for n in g.node for i in n.input}
    for init in list(g.initializer):
        if init.name not in used:
            g.initializer.remove(init)


def _packed_nbits(nodes, inits) -> tuple[dict, dict] | None:
    """One weight-only MatMulNBits over ``nodes``' weights, rows of N concatenated: ({input position: (key,
    array)}, attributes), or None when they cannot be one (other attributes, ``g_idx``/bias inputs, inputs present
    in one and not another, weights not in the graph)."""
    from onnx import numpy_helper

    ats = [_attrs(p) for p in nodes]
    if any(len(p.input) > 4 or any(i not in inits for i in p.input[1:] if i) for p in nodes) or \
            len({tuple(bool(i) for i in p.input) for p in nodes}) != 1 or \
            any(tuple(a.get(k) for k in _NBITS_SAME) != tuple(ats[0].get(k) for k in _NBITS_SAME) for a in ats):
        return None
    tensors = {}
    for j, key in enumerate(("B", "scales", "zero_points"), start=1):
        if j < len(nodes[0].input) and nodes[0].input[j]:
            tensors[j] = (key, np.concatenate([numpy_helper.to_array(inits[p.input[j]]) for p in nodes], axis=0))
    return tensors, {**ats[0], "N": int(sum(a["N"] for a in ats))}


def _packed_matmul(nodes, inits) -> tuple[dict, dict, list] | None:
    """One plain MatMul over ``nodes``' 2-D weights [K, N_i], concatenated on axis 1: ({1: ("w", array)}, {},
    [each weight's shape]), or None when the weights differ in K or type."""
    from onnx import numpy_helper

    ws = [numpy_helper.to_array(inits[p.input[1]]) for p in nodes]
    if any(w.ndim != 2 or w.shape[0] != ws[0].shape[0] or w.dtype != ws[0].dtype for w in ws):
        return None
    return {1: ("w", np.concatenate(ws, axis=1))}, {}, [w.shape for w in ws]


def _add_initializers(g, tensors: dict, prefix: str) -> list[str]:
    """``tensors`` ({input position: (key, array)}) as initializers named ``prefix_key``: the node's weight inputs,
    in place (position 1 first; "" where an optional input is absent)."""
    from onnx import numpy_helper

    inputs = [""] * max(tensors)
    for j, (key, arr) in tensors.items():
        inputs[j - 1] = f"{prefix}_{key}"
        g.initializer.append(numpy_helper.from_array(arr, inputs[j - 1]))
    return inputs


def pack_qkv(model) -> int:
    """Rewrite ``model`` (an ``onnx.ModelProto`` loaded with its external data) in place; returns the number of
    attentions packed."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    for o in g.output:
        readers[o.name] = readers.get(o.name, 0) + 1

    packed = 0
    for att in [n for n in g.node if n.op_type == "GroupQueryAttention"]:
        if len(att.input) < 3 or not att.input[1] or not att.input[2]:
            continue
        projs = [producer.get(x) for x in att.input[:3]]
        if any(p is None for p in projs) or len({p.op_type for p in projs}) != 1 or \
                len({p.input[0] for p in projs}) != 1 or any(readers.get(p.output[0]) != 1 for p in projs):
            continue
        op = projs[0].op_type
        if op == "MatMul":
            packable = _packed_matmul(projs, inits) if all(p.input[1] in inits for p in projs) else None
            if packable is None:
                continue
            tensors, attrs = packable[:2]
        elif op == "MatMulNBits":
            packable = _packed_nbits(projs, inits)
            if packable is None:
                continue
            tensors, attrs = packable
        else:
            continue
        base = projs[0].name or att.name
        names = _add_initializers(g, tensors, f"{base}_qkv")
        out = f"{projs[0].output[0]}_qkv"
        node = helper.make_node(op, [projs[0].input[0], *names], [out], name=f"{base}_qkv",
                                domain=projs[0].domain, **attrs)
        at = list(g.node).index(projs[0])
        g.node.insert(at, node)
        for p in projs:
            g.node.remove(p)
        att.input[0], att.input[1], att.input[2] = out, "", ""
        packed += 1
    if packed:
        _drop_unused_initializers(g)
    return packed


def pack_gate_up(model) -> int:
    """Rewrite ``model`` in place: every pair of weight-only ``MatMulNBits`` that read one input with the same
    ``K``/``bits``/``block_size``/``accuracy_level`` (the MLP's gate and up projections), or of plain MatMuls with
    weights in the graph (the per-token prompt graph packs its fp32 graph before quantizing), becomes one node
    over both weights (rows of N concatenated, as in :func:`pack_qkv`) and a ``Split`` on the last axis that gives
    each output its old name, so the readers are untouched. Each output row is its own dot products over the same
    quantized activation blocks, so the numbers do not change (tests/ort/test_pack_qkv.py checks bitwise equal
    logits); a decode step runs one kernel and one activation quantization fewer per layer. Returns the pairs
    packed. Only pairs: q/k/v (three readers) are pack_qkv's, anything else is left as it is."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    outputs = {o.name for o in g.output}
    readers: dict[str, list] = {}
    for n in g.node:
        if n.op_type == "MatMulNBits" or (n.op_type == "MatMul" and n.input[1] in inits):
            readers.setdefault(n.input[0], []).append(n)
    packed = 0
    for x, pair in readers.items():
        if len(pair) != 2 or pair[0].op_type != pair[1].op_type or any(p.output[0] in outputs for p in pair):
            continue
        if pair[0].op_type == "MatMul":
            packable = _packed_matmul(pair, inits)
            halves = [int(t[1]) for t in packable[2]] if packable else []
        else:
            packable = _packed_nbits(pair, inits)
            halves = [_attrs(p)["N"] for p in pair]
        if packable is None:
            continue
        tensors, attrs = packable[:2]
        base = pair[0].name or f"gate_up_{packed}"
        names = _add_initializers(g, tensors, f"{base}_gate_up")
        both = f"{pair[0].output[0]}_gate_up"
        sizes = f"{base}_gate_up_split"
        g.initializer.append(numpy_helper.from_array(np.array(halves, np.int64), sizes))
        node = helper.make_node(pair[0].op_type, [x, *names], [both], name=f"{base}_gate_up",
                                domain=pair[0].domain, **attrs)
        split = helper.make_node("Split", [both, sizes], [pair[0].output[0], pair[1].output[0]],
                                 name=f"{base}_gate_up_split", axis=-1)
        at = min(list(g.node).index(p) for p in pair)
        for p in pair:
            g.node.remove(p)
        g.node.insert(at, split)
        g.node.insert(at, node)
        packed += 1
    if packed:
        _drop_unused_initializers(g)
    return packed
