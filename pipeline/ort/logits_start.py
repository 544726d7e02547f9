"""Logits only from a given position on: the graph input ``logits_start`` (CPU graphs, added by the build stage).

A prompt's forward pass computes the lm_head for every position, [B, T, vocab]: on SmolLM2 the lm_head is 576 x
49,152, about a fifth of a token's projection work, and a 4 x 256 prompt writes 201 MB of logits. Generation reads
each row's last position only (TensorRT-LLM's default likewise leaves context logits out, ``gather_context_logits``).
The build stage slices the final norm's output on the sequence axis from ``logits_start`` before the lm_head, so
``logits`` is [B, T - start, V]. ``logits_start`` is an initializer that is also a graph input (an overridable
initializer, ONNX IR >= 4): a caller that does not feed it, the evaluate stage or ONNX Runtime GenAI, gets every
position as before. The engine (pipeline/ort/engine.py) feeds it on every call of a graph that has it: the lowest
last real position of the rows for a prompt whose last positions are all it needs, else 0.
"""

from __future__ import annotations

import numpy as np

from .engine import LOGITS_START as INPUT

__all__ = ["INPUT", "add_logits_start"]

_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def add_logits_start(model) -> bool:
    """Rewrite ``model`` (an ``onnx.ModelProto``, topologically sorted, RMSNorms fused) in place: the last norm's
    output, when everything after it is the lm_head's path to the ``logits`` output (no attention, no other graph
    output), is sliced from ``logits_start`` on axis 1. Returns whether it was added (False: already there, no
    ``logits`` output or no such norm)."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    if INPUT in {i.name for i in g.input} or "logits" not in {o.name for o in g.output}:
        return False
    nodes = list(g.node)
    last = max((k for k, n in enumerate(nodes) if n.op_type in _NORMS), default=None)
    if last is None:
        return False
    hidden = nodes[last].output[0]
    after = nodes[last + 1:]
    # the lm_head's path only: nothing after the final norm attends or writes another graph output
    if any(n.op_type == "GroupQueryAttention" for n in after) or \
            {o.name for o in g.output} & {o for n in after for o in n.output} != {"logits"}:
        return False
    sliced = f"{hidden}/from_{INPUT}"
    for n in after:
        for k, i in enumerate(n.input):
            if i == hidden:
                n.input[k] = sliced
    g.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), INPUT),
                          numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), f"{INPUT}/end"),
                          numpy_helper.from_array(np.array([1], np.int64), f"{INPUT}/axis")])
    g.input.append(helper.make_tensor_value_info(INPUT, TensorProto.INT64, [1]))
    g.node.insert(last + 1, helper.make_node("Slice", [hidden, INPUT, f"{INPUT}/end", f"{INPUT}/axis"], [sliced],
                                             name=f"/{INPUT}/Slice"))
    return True
