"""Post-training quantization of forge's FP32 ONNX graphs with onnxruntime.quantization.

Algorithms (``algo``):

* ``int8``    -- 8-bit weights for every weight MatMul and the embedding; ``options.method`` picks
  ``dynamic`` (per-channel 8-bit weights, per-tensor uint8 activations computed at run time, which ORT's CPU kernels
  run as DynamicQuantizeMatMul / MatMulInteger; weights 7-bit s8 by default, exact on every x86 ISA), ``blockwise`` (MatMulNBits 8-bit, block 32, accuracy_level 4:
  activations quantized per token and block at run time) or ``mixed`` (default: ``blockwise`` for the MatMuls
  matching ``options.blockwise`` -- the outlier-heavy down_proj inputs and lm_head -- ``dynamic`` elsewhere),
  after SmoothQuant (``smoothquant_alpha``, calibrated on ``calib_windows``) folded into the RMSNorm weights.
  Options and their defaults (with the measurements behind them) are declared in ``pipeline/recipe_options.py``.
* ``int4_wo`` -- weight-only INT4 through ORT's ``MatMulNBits`` (block size ``options.block_size``: the recipe's ``quantize.block_size``, default 32).

``options`` is the algo's options model (:data:`OPTIONS`), validated once by the recipe: its defaults are the only
ones (a dict is validated into it here, for callers without a recipe).
* ``none``    -- the FP32 graph copied unchanged.

Graph preparation (the FP32 export ties ``embed_tokens`` and ``lm_head``): the embedding ``Gather`` gets its own
int8 per-row weight (``Gather(q) * Gather(scale)``, standard ONNX ops), and ``lm_head`` keeps its own transposed
initializer so it can be quantized per output channel. Attention MatMuls whose both inputs are activations are never
quantized (``MatMulConstBOnly``).

Statistics (weight ranges / scales per quantized MatMul and, with calibration windows, activation ranges per input
tensor) are written to ``out_dir/quant_stats.json``.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import ForgeError
from pipeline.progress import progress_bar
from pipeline.quantizer import Quantizer
from pipeline.recipe_options import NoOptions, OrtInt4Options, OrtInt8Options

from .export import META_FILE, MODEL_FILE, copy_side_files, model_bytes

# onnxruntime's quantizers log one INFO line per graph node (thousands); what ran is in our metrics instead
logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)

__all__ = ["quantize_onnx", "weight_grid", "ALGOS", "activation_stats", "isa_accuracy_risk", "dynamic_int8_weights", "int8_dynamic",
           "INT8_DEFAULTS", "batch_invariant"]

# quantize.algo -> its quantizer (pipeline/quantizer.py; the options models with each option's default and the
# measurements behind it: pipeline/recipe_options.py): the onnxruntime target's one algo table. The block size is
# written quantize.block_size, as for tensorrt_llm (issue 25); the options model's block_size is what runs.
QUANTIZERS = {
    "none": Quantizer(NoOptions, summary="the FP32 graph, unchanged"),
    "int8": Quantizer(OrtInt8Options, {"block_size": "block_size"},
                      summary="8-bit weights: dynamic MatMulInteger, MatMulNBits blockwise, or both (mixed)"),
    "int4_wo": Quantizer(OrtInt4Options, {"block_size": "block_size"},
                         summary="weight-only INT4 through MatMulNBits (HQQ or round to nearest)"),
}
OPTIONS = {a: q.options for a, q in QUANTIZERS.items()}       # the options model of each algo
ALGOS = tuple(OPTIONS)
INT8 = OrtInt8Options()
INT8_DEFAULTS = INT8.model_dump(include={"method", "blockwise", "smoothquant_alpha", "smoothquant_only", "weight_type",
                                         "reduce_range", "per_channel", "weight_symmetric"})
STATS_FILE = "quant_stats.json"
PREFILL_FILE = "prefill.onnx"     # quantize.options.prefill: per_token -- the prompt's graph


# ---------------------------------------------------------------------------------------------- graph helpers

def _load(model_dir: Path):
    import onnx

    path = Path(model_dir) / MODEL_FILE
    if not path.exists():
        raise ForgeError(f"quantize: no {MODEL_FILE} in {model_dir}; run the export stage first")
    return onnx.load(str(path), load_external_data=True)


def _save(model, out_dir: Path, name: str = MODEL_FILE) -> Path:
    import onnx

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    for f in (path, out_dir / (name + ".data")):
        f.unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=name + ".data", size_threshold=1024)
    return path


def _pack_projections(model) -> dict:
    """``model``'s q/k/v MatMulNBits of each attention packed into one, then each MLP's gate and up into one and a
    Split, in place (pipeline/ort/pack_qkv.py): the same dot products (logits bitwise equal), three fewer kernel
    calls per layer and decode step. Measured on SmolLM2's blockwise INT8 (x86_64-avx512vnni, lab, paired, 8 rounds
    in alternating order, docs/search.md): q/k/v 1.06x decode b1 and 1.02x b8, gate/up a further 1.15x b1 and 1.08x
    b8. Returns the counts packed."""
    from .pack_qkv import pack_gate_up, pack_qkv
    return {"packed_qkv": pack_qkv(model), "packed_gate_up": pack_gate_up(model)}


def outlier_channels(act: dict | None, scales: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """The ``k`` input channels of each calibrated activation with the largest max |x| after smoothing (``scales``:
    :func:`smooth_fold`'s), kept in fp32 by the per-token graph (pipeline/ort/per_token.py)."""
    if not k or not act:
        return {}
    out = {}
    for t, s in act.items():
        amax = np.asarray(s["channel_absmax"], np.float32)
        amax = amax / scales[t] if t in scales else amax
        out[t] = np.sort(np.argsort(amax, kind="stable")[-k:])
    return out


def _per_token_graph(model, out_dir: Path, exclude: list[str], meta: dict, name: str = MODEL_FILE, *,
                     outliers: dict[str, np.ndarray] | None = None) -> dict:
    """The weight MatMuls of ``model`` that ``exclude`` (fnmatch patterns) leaves, per token with 8-bit weights
    (pipeline/ort/per_token.py), saved as ``name``; ``meta`` gets the session option the graph needs where u8 x s8
    saturates. Returns what ran.

    With nothing excluded, q/k/v and gate/up are packed first (pipeline/ort/pack_qkv.py): one integer product, one
    row scale and one fp32 outlier product per input instead of one per projection. Each output column keeps its
    own weight scale and the input its one quantization, so the numbers are those of the unpacked graph."""
    from .engine import SATURATING_U8S8_CONFIG_KEY
    from .per_token import SESSION_CONFIG, per_token_int8

    packed = {} if exclude else _pack_projections(model)
    names = [n.name for n, _ in weight_matmuls(model) if not _matches(n, exclude)]
    done = per_token_int8(model, names, weight_bits=8, outliers=outliers)
    _save(model, out_dir, name)
    meta[SATURATING_U8S8_CONFIG_KEY] = SESSION_CONFIG
    return {"method": "per_token", "weights": "int8 per-channel symmetric",
            "activations": "int8 per token (a scale per row), computed at run time", **done, **packed}


def _prefill_graph(fp32_dir: Path, out_dir: Path, o: OrtInt8Options, act: dict | None, alpha: float | None,
                   meta: dict) -> dict:
    """``prefill: per_token``: the prompt's graph (:data:`PREFILL_FILE`) beside the blockwise decode graph, from the
    same FP32 export and calibration (``act``; ``alpha`` as :func:`quantize_onnx` resolved it): SmoothQuant on every
    input it can fold, then every weight MatMul not excluded per token. MatMulNBits is fast at M = 1 and not at a
    prompt's M (docs/quantization.md); the engine runs a prompt on an empty cache here and decode steps on the
    other graph (pipeline/ort/engine.py)."""
    model = _load(fp32_dir)
    fold_weight_transposes(model)
    _prune_unused_initializers(model)
    if o.embedding == "int8":
        quantize_embedding_int8(model, meta["vocab_size"])
        _prune_unused_initializers(model)
    scales: dict[str, np.ndarray] = {}
    smooth = smooth_fold(model, {t: s["channel_absmax"] for t, s in act.items()}, float(alpha), scales=scales) \
        if alpha is not None else {}
    info = _per_token_graph(model, out_dir, list(o.exclude), meta, PREFILL_FILE,
                            outliers=outlier_channels(act, scales, o.outlier_channels))
    meta["prefill_model_file"] = PREFILL_FILE
    return {"file": PREFILL_FILE, **info, "smoothed_inputs": len(smooth)}


def _inits(model) -> dict:
    return {i.name: i for i in model.graph.initializer}


def weight_matmuls(model) -> list[tuple[Any, str]]:
    """(node, weight initializer name) of every MatMul whose B input is an initializer."""
    inits = _inits(model)
    return [(n, n.input[1]) for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def _embedding_gather(model, vocab: int):
    inits = _inits(model)
    for n in model.graph.node:
        if n.op_type == "Gather" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2 \
                and inits[n.input[0]].dims[0] == vocab:
            return n
    return None


def quantize_embedding_int8(model, vocab: int) -> dict | None:
    """Replace the embedding Gather's FP32 table by an int8 table with one symmetric scale per row.

    ``emb = Gather(W, ids)`` becomes ``Cast(Gather(Wq, ids)) * Gather(scale, ids)`` (standard ONNX ops).
    Other users of the FP32 table (a tied lm_head not yet untied) keep it. Returns stats or None (no embedding).
    """
    from onnx import TensorProto, helper, numpy_helper

    g = _embedding_gather(model, vocab)
    if g is None:
        return None
    inits = _inits(model)
    w = numpy_helper.to_array(inits[g.input[0]]).astype(np.float32)
    absmax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    base = g.input[0]
    qn, sn = base + "_int8", base + "_rowscale"
    model.graph.initializer.extend([numpy_helper.from_array(q, qn), numpy_helper.from_array(scale, sn)])
    out = g.output[0]
    gq, gs, cast = out + "_q", out + "_s", out + "_f"
    idx = list(model.graph.node).index(g)
    new = [helper.make_node("Gather", [qn, g.input[1]], [gq], name=g.name + "_int8", axis=0),
           helper.make_node("Gather", [sn, g.input[1]], [gs], name=g.name + "_scale", axis=0),
           helper.make_node("Cast", [gq], [cast], name=g.name + "_cast", to=TensorProto.FLOAT),
           helper.make_node("Mul", [cast, gs], [out], name=g.name + "_dequant")]
    model.graph.node.remove(g)
    for k, n in enumerate(new):
        model.graph.node.insert(idx + k, n)
    still_used = any(base in n.input for n in model.graph.node)
    if not still_used:
        model.graph.initializer.remove(inits[base])
    err = float(np.abs(q.astype(np.float32) * scale - w).max())
    return {"tensor": base, "rows": int(w.shape[0]), "scale_min": float(scale.min()),
            "scale_max": float(scale.max()), "max_abs_error": err}


def fold_weight_transposes(model) -> list[str]:
    """Give every ``MatMul(x, Transpose(W))`` with an initializer ``W`` its own transposed initializer.

    The dynamo export keeps a tied ``lm_head`` as ``MatMul(x, Transpose(embed_tokens.weight))``: without this the
    quantizer sees no constant weight and leaves the largest MatMul in FP32. Returns the MatMul names rewired."""
    from onnx import numpy_helper

    inits = _inits(model)
    prod = {o: n for n in model.graph.node for o in n.output}
    done = []
    for n in list(model.graph.node):
        if n.op_type != "MatMul" or n.input[1] in inits:
            continue
        t = prod.get(n.input[1])
        if t is None or t.op_type != "Transpose" or t.input[0] not in inits:
            continue
        w = numpy_helper.to_array(inits[t.input[0]])
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), list(range(w.ndim))[::-1])
        if w.ndim != 2 or perm != [1, 0]:
            continue
        name = t.input[0] + "_T_" + n.name
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), name))
        n.input[1] = name
        done.append(n.name)
    used = {i for n in model.graph.node for i in n.input}
    for n in list(model.graph.node):
        if n.op_type == "Transpose" and n.output[0] not in used and n.input[0] in inits:
            model.graph.node.remove(n)
    return done


def smooth_fold(model, act_absmax: dict[str, np.ndarray], alpha: float, *, only: list[str] | None = None,
                scales: dict[str, np.ndarray] | None = None) -> dict:
    """SmoothQuant (Xiao et al. 2023) folded exactly into the FP32 graph's initializers.

    For an activation ``t`` read only by weight MatMuls, per input channel ``s = max|X|^a / max|W|^(1-a)``:
    the consumers' weight rows are multiplied by ``s`` and ``t``'s producer divides by ``s`` -- either a ``Mul`` by a
    per-channel initializer (an RMSNorm weight) or a ``Mul`` by the output of a weight MatMul whose columns are then
    divided (the MLP's ``silu(gate) * up`` feeding ``down_proj``). Tensors with any other producer are left alone.
    Returns per-tensor smoothing stats; ``scales``, when given, gets each smoothed tensor's ``s``."""
    from onnx import numpy_helper

    inits = _inits(model)
    prod = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    out = {}

    def arr(name):
        return numpy_helper.to_array(inits[name]).astype(np.float32)

    def put(name, value):
        inits[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))

    for t, amax in act_absmax.items():
        cons = readers.get(t, [])
        if not cons or any(n.op_type != "MatMul" or n.input[0] != t or n.input[1] not in inits for n in cons):
            continue
        if only and not any(_matches(n, only) for n in cons):
            continue
        p = prod.get(t)
        if p is None or p.op_type != "Mul":
            continue
        ws = [arr(n.input[1]) for n in cons]
        if any(sum(1 for r in readers.get(n.input[1], [])) != 1 for n in cons):
            continue  # a weight shared with another node cannot be rescaled alone
        wmax = np.max([np.abs(w).max(axis=1) for w in ws], axis=0)
        sc = np.power(np.maximum(amax, 1e-5), alpha) / np.power(np.maximum(wmax, 1e-5), 1 - alpha)
        sc = np.clip(sc, 1e-4, 1e4).astype(np.float32)
        fold = None
        for k, side in enumerate(p.input):
            if side in inits and arr(side).shape == sc.shape:
                if len(readers[side]) > 1:  # the exporter dedups equal norm weights: give this Mul its own copy
                    own = f"{side}_smooth_{p.name}"
                    model.graph.initializer.append(numpy_helper.from_array(arr(side), own))
                    inits[own] = model.graph.initializer[-1]
                    readers[side].remove(p)
                    readers[own] = [p]
                    p.input[k] = own
                    side = own
                fold = ("norm", side)
                break
            q = prod.get(side)
            if q is not None and q.op_type == "MatMul" and q.input[1] in inits and len(readers[side]) == 1 \
                    and len(readers[q.input[1]]) == 1 and arr(q.input[1]).shape[-1] == sc.shape[0]:
                fold = ("matmul", q.input[1])
                break
        if fold is None:
            continue
        kind, name = fold
        put(name, arr(name) / sc if kind == "norm" else arr(name) / sc[None, :])
        for n, w in zip(cons, ws):
            put(n.input[1], w * sc[:, None])
        if scales is not None:
            scales[t] = sc
        out[t] = {"consumers": [module_name(n) for n in cons], "folded_into": kind, "scale_min": float(sc.min()),
                  "scale_max": float(sc.max()), "act_absmax_before": float(amax.max()),
                  "act_absmax_after": float((amax / sc).max())}
    return out


def _prune_unused_initializers(model) -> None:
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    for init in list(model.graph.initializer):
        if init.name not in used:
            model.graph.initializer.remove(init)


def module_name(node) -> str:
    """The torch module a node came from (``model.layers.3.mlp.down_proj``, ``lm_head``), read from the dynamo
    exporter's ``pkg.torch.onnx.name_scopes`` metadata; the node name when absent."""
    import ast

    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = [x for x in ast.literal_eval(p.value) if x]
            except (ValueError, SyntaxError):
                break
            mods = [x for x in scopes if x.startswith("m.") or x == "m"]
            if mods:
                return mods[-1][2:] if mods[-1].startswith("m.") else mods[-1]
    return node.name


def _matches(node, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(node.name, p) or fnmatch.fnmatch(module_name(node), p) for p in patterns)


# ---------------------------------------------------------------------------------------------- calibration

def activation_stats(model_dir: Path, windows, *, tensors: list[str], threads: int = 2,
                     batch_size: int = 1, moments: str | None = None) -> dict[str, dict]:
    """Per-channel |max| and min/max of the named activation tensors of the FP32 graph over ``windows``
    ([N, T] token ids), via extra ReduceMax/ReduceMin outputs added to a temporary copy of the graph.

    ``moments``: also the first and second moments over all tokens: ``channel_mean`` (E[x_i]) and ``"diag"``
    (``channel_meansq``: E[x_i^2] per channel) or ``"full"`` (``second_moment``: E[x x^T], [C, C], and its diagonal
    as ``channel_meansq``)."""
    import onnx
    from onnx import TensorProto, helper

    from .engine import OrtEngine

    if moments not in (None, "diag", "full"):
        raise ValueError(f"moments={moments!r}: use None, 'diag' or 'full'")
    model = _load(model_dir)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    new_reduce = opset >= 18  # ReduceMax takes axes as an input from opset 18
    extra = []
    for k, t in enumerate(tensors):
        a, mx, mn, amax = f"_fs_abs{k}", f"_fs_max{k}", f"_fs_min{k}", f"_fs_chmax{k}"
        model.graph.node.extend([
            helper.make_node("Abs", [t], [a]),
            helper.make_node("ReduceMax", [t], [mx], keepdims=0),
            helper.make_node("ReduceMin", [t], [mn], keepdims=0),
            # per channel (last axis) of a rank-3 activation [B, T, C]
            helper.make_node("ReduceMax", [a, "_fs_axes01"], [amax], keepdims=0) if new_reduce
            else helper.make_node("ReduceMax", [a], [amax], keepdims=0, axes=[0, 1]),
        ])
        mom = tot = None
        if moments:
            tot = f"_fs_sum{k}"
            model.graph.node.append(
                helper.make_node("ReduceSum", [t, "_fs_axes01"], [tot], keepdims=0) if new_reduce
                else helper.make_node("ReduceSum", [t], [tot], keepdims=0, axes=[0, 1]))
        if moments == "diag":
            mom = f"_fs_sq{k}"
            model.graph.node.append(
                helper.make_node("ReduceSumSquare", [t, "_fs_axes01"], [mom], keepdims=0) if new_reduce
                else helper.make_node("ReduceSumSquare", [t], [mom], keepdims=0, axes=[0, 1]))
        elif moments == "full":    # X^T X over the tokens of the batch: [C, C]
            x2, xt, mom = f"_fs_2d{k}", f"_fs_t{k}", f"_fs_xtx{k}"
            model.graph.node.extend([helper.make_node("Flatten", [t], [x2], axis=-1),   # [B * T, C]
                                     helper.make_node("Transpose", [x2], [xt], perm=[1, 0]),
                                     helper.make_node("MatMul", [xt, x2], [mom])])
        extra += [(t, mx, mn, amax, mom, tot)]
    if new_reduce:
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0, 1], np.int64), "_fs_axes01"))
    for _, mx, mn, amax, mom, tot in extra:
        model.graph.output.extend([helper.make_tensor_value_info(mx, TensorProto.FLOAT, []),
                                   helper.make_tensor_value_info(mn, TensorProto.FLOAT, []),
                                   helper.make_tensor_value_info(amax, TensorProto.FLOAT, None)])
        if mom:
            model.graph.output.extend([helper.make_tensor_value_info(mom, TensorProto.FLOAT, None),
                                       helper.make_tensor_value_info(tot, TensorProto.FLOAT, None)])
    with tempfile.TemporaryDirectory(prefix="forge-calib-") as td:
        _save(model, Path(td))
        shutil.copy2(Path(model_dir) / META_FILE, Path(td) / META_FILE)
        eng = OrtEngine(td, threads=threads)
        per = 5 if moments else 3
        names = [x for _, mx, mn, amax, mom, tot in extra for x in (mx, mn, amax, mom, tot)[:per]]
        stats: dict[str, dict] = {t: {"max": -np.inf, "min": np.inf, "channel_absmax": None} for t in tensors}
        sums: dict[str, np.ndarray] = {}
        firsts: dict[str, np.ndarray] = {}
        ids = np.asarray(windows.numpy() if hasattr(windows, "numpy") else windows, dtype=np.int64)
        with progress_bar("calibration (activation ranges)", ids.shape[0]) as advance:
            for s in range(0, ids.shape[0], batch_size):
                w = ids[s:s + batch_size]
                outs = eng.session.run(names, eng.prefill_feed(w))   # the graph's own layout (gqa or standard)
                for k, (t, *_rest) in enumerate(extra):
                    mx, mn, ch = outs[per * k: per * k + 3]
                    st = stats[t]
                    st["max"] = max(st["max"], float(mx))
                    st["min"] = min(st["min"], float(mn))
                    st["channel_absmax"] = ch if st["channel_absmax"] is None else np.maximum(st["channel_absmax"], ch)
                    if moments:   # summed in float64: thousands of tokens of values up to ~1e3
                        sums[t] = sums.get(t, 0) + outs[per * k + 3].astype(np.float64)
                        firsts[t] = firsts.get(t, 0) + outs[per * k + 4].astype(np.float64)
                advance(w.shape[0])
    for t, tot in sums.items():   # calibration windows have no padding: every position is a token
        mean = tot / ids.size
        stats[t]["channel_mean"] = firsts[t] / ids.size
        if moments == "full":
            stats[t]["second_moment"] = mean
            stats[t]["channel_meansq"] = np.diag(mean).copy()
        else:
            stats[t]["channel_meansq"] = mean
    return stats


def _summarise_channels(ch: np.ndarray) -> dict:
    med = float(np.median(ch))
    return {"channel_absmax_max": float(ch.max()), "channel_absmax_median": med,
            "outlier_ratio": float(ch.max() / med) if med > 0 else None,
            "top_channels": [int(i) for i in np.argsort(-ch)[:8]]}


# ---------------------------------------------------------------------------------------------- algorithms

def _weight_stats(model, nodes: list[tuple[Any, str]]) -> dict[str, dict]:
    from onnx import numpy_helper

    inits = _inits(model)
    out = {}
    for node, wname in nodes:
        w = numpy_helper.to_array(inits[wname])
        col = np.abs(w).max(axis=0)  # per output channel (MatMul B is [in, out])
        out[node.name] = {"module": module_name(node), "weight": wname, "shape": list(w.shape), "weight_absmax": float(col.max()),
                          "per_channel_scale_min": float(col.min() / 127), "per_channel_scale_max": float(col.max() / 127)}
    return out


def typed_options(algo: str, options=None):
    """``options`` as the model of ``algo`` (:data:`OPTIONS`): a model is checked to be the right one, a dict (or
    None) validated into it; a problem is a ForgeError naming the recipe key."""
    from pydantic import BaseModel, ValidationError

    if algo not in OPTIONS:
        raise ForgeError(f"quantize.algo {algo!r} is not supported by the onnxruntime target; use one of {ALGOS}")
    model = OPTIONS[algo]
    if isinstance(options, BaseModel):
        if not isinstance(options, model):
            raise TypeError(f"algo {algo}: options must be {model.__name__}, got {type(options).__name__}")
        return options
    try:
        return model.model_validate(dict(options or {}))
    except ValidationError as e:
        raise ForgeError("; ".join(f"quantize.options.{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                   for err in e.errors())) from None


def int8_dynamic(model, out_dir: Path, options: OrtInt8Options | dict | None = None,
                 excluded: list[str] | tuple = ()) -> dict:
    """Dynamic INT8 for every weight MatMul of ``model`` not in ``excluded`` (ORT's ``quantize_dynamic``): weights
    per output channel, activations quantized to uint8 per tensor at run time (DynamicQuantizeMatMul /
    MatMulIntegerToFloat). Reads ``weight_type`` (uint8 | int8), ``reduce_range``, ``per_channel`` and
    ``weight_symmetric`` of ``options``. Writes ``out_dir/model.onnx``; returns what ran."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    o = typed_options("int8", options)
    with tempfile.TemporaryDirectory(prefix="forge-q-") as td:
        src = _save(model, Path(td))
        quantize_dynamic(str(src), str(Path(out_dir) / MODEL_FILE), op_types_to_quantize=["MatMul"],
                         per_channel=o.per_channel, reduce_range=o.reduce_range,
                         weight_type=QuantType.QInt8 if o.weight_type == "int8" else QuantType.QUInt8,
                         nodes_to_exclude=list(excluded), use_external_data_format=True,
                         extra_options={"MatMulConstBOnly": True, "WeightSymmetric": o.weight_symmetric})
    weights, per_channel, sym = _dynamic_weights(o.model_dump()), o.per_channel, o.weight_symmetric
    return {"method": "dynamic", "weights": f"{weights} {'per-channel' if per_channel else 'per-tensor'} "
                                            f"{'symmetric' if sym else 'asymmetric'}",
            "activations": "uint8 per-tensor, computed at run time", "dynamic_weights": weights}


def _nbits(model, out_dir: Path, excluded: list[str], *, bits: int, block: int, sym: bool, acc: int,
           include: list[str] | None = None, pack: bool = False) -> dict:
    """MatMulNBits (``bits``-bit blockwise weights) for the weight MatMuls of ``model`` (``include``: only these);
    ``pack``: q/k/v and gate/up packed before the graph is saved (:func:`_pack_projections`)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=sym, accuracy_level=acc,
                             nodes_to_exclude=excluded, nodes_to_include=include, op_types_to_quantize=("MatMul",))
    q.process()
    packed = _pack_projections(q.model.model) if pack else {}
    _save(q.model.model, out_dir)
    # accuracy_level 4 = MLAS int8 compute: activations quantized to int8 per row and block at run time
    acts = {4: f"int8 per token and {block}-block, computed at run time (accuracy_level 4)",
            1: "fp32 (accuracy_level 1)", 2: "fp16 (accuracy_level 2)", 3: "bf16 (accuracy_level 3)"}.get(acc, str(acc))
    return {"method": "MatMulNBits", "weights": f"int{bits} {'sym' if sym else 'asym'} block {block}",
            "activations": acts, "accuracy_level": acc, **packed}


# int4_wo methods that fit their values to calibration data -> the activation moments they read
INT4_CALIBRATED = {"fit": "diag", "gptq": "full"}
# int4_wo methods written by _int4_fitted (offsets reads the weights only: weighting its offset rows by E[x^2]
# measured no better on SmolLM2, +0.17 % against +0.10 % perplexity)
INT4_OWN = (*INT4_CALIBRATED, "offsets")


def _int4_fitted(model, out_dir: Path, o: OrtInt4Options, excluded: list[str], act: dict[str, dict] | None) -> dict:
    """4-bit MatMulNBits with integer zero points fitted by ``options.method`` (pipeline/ort/int4_fit.py).

    ORT's own quantizer writes the nodes (MatMulNBits, bits 4, asymmetric: uint8 zero points, the block size and
    accuracy level), then each node's B / scales / zero_points are replaced by the fitted values in the same layout.
    ``offsets``: each quantized MatMul's input becomes [x, blocksum(x)] (:func:`int4_fit.block_sum_input`, built once
    per input tensor) and its weight gains the offset rows (:func:`int4_fit.offsets_int4`)."""
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from .int4_fit import (block_sum_input, effective_weight, fit_int4, gptq_int4, offsets_int4, pack_int4, rtn_int4,
                           weighted_error)

    block, inits = o.block_size, _inits(model)
    todo = {n.output[0]: (n.name, n.input[0], numpy_helper.to_array(inits[w]).astype(np.float32))
            for n, w in weight_matmuls(model) if n.name not in excluded}
    q = MatMulNBitsQuantizer(model, bits=4, block_size=block, is_symmetric=False, accuracy_level=o.accuracy_level,
                             nodes_to_exclude=excluded, op_types_to_quantize=("MatMul",))
    q.process()
    m = q.model.model
    inits = _inits(m)
    ratios, augmented = {}, {}
    nodes = [n for n in m.graph.node if n.op_type == "MatMulNBits" and n.output[0] in todo]
    with progress_bar(f"int4 {o.method} (integer zero points)", len(nodes)) as advance:
        for node in nodes:
            name, x, w = todo.pop(node.output[0])
            if len(node.input) != 4:
                raise ForgeError(f"quantize: ORT's MatMulNBits for {name} has inputs {list(node.input)}, expected "
                                 "A, B, scales, zero_points (asymmetric)")
            hh = mu = k_aug = None
            if o.method == "offsets":
                qv, s, z, k_aug = offsets_int4(w, None, block)
            else:
                st = (act or {}).get(x) or {}
                if st.get("channel_meansq") is None:
                    raise ForgeError(f"quantize: no calibration statistics for {name}'s input {x}")
                mu = np.asarray(st["channel_mean"], np.float64)
                # with bias correction the mean of the output error goes into a bias, so the fit minimises the
                # rest: the error under the inputs' covariance instead of their second moment
                if o.method == "gptq":
                    hh = st["second_moment"] - (np.outer(mu, mu) if o.bias_correction else 0)
                    qv, s, z = gptq_int4(w, hh, block)
                else:
                    hh = np.maximum(st["channel_meansq"] - (mu * mu if o.bias_correction else 0), 0)
                    qv, s, z = fit_int4(w, hh, block)
            packed = pack_int4(qv, s, z, block)
            if o.method == "offsets":
                if x not in augmented:         # [x, blocksum(x)], placed before the first reader of x
                    augmented[x] = f"{x}_blocksums"
                    extra_nodes, extra_inits = block_sum_input(x, block, augmented[x])
                    at = list(m.graph.node).index(node)
                    for k, n in enumerate(extra_nodes):
                        m.graph.node.insert(at + k, n)
                    m.graph.initializer.extend(extra_inits)
                node.input[0] = augmented[x]
                for a in node.attribute:
                    if a.name == "K":
                        a.CopyFrom(helper.make_attribute("K", int(k_aug)))
                for arr, iname in zip(packed, node.input[1:4]):   # new widths: the operator's own shapes
                    inits[iname].CopyFrom(numpy_helper.from_array(arr, iname))
            else:
                for arr, iname in zip(packed, node.input[1:4]):
                    t = inits[iname]
                    if int(np.prod(t.dims)) != arr.size or numpy_helper.to_array(t).dtype != arr.dtype:
                        raise ForgeError(f"quantize: {iname} is {list(t.dims)} {numpy_helper.to_array(t).dtype}, "
                                         f"the fit wrote {arr.size} {arr.dtype}: ORT's MatMulNBits layout changed")
                    t.CopyFrom(numpy_helper.from_array(arr.reshape(tuple(t.dims)), iname))
            if o.bias_correction:    # E[x] (W - W_q): MatMulNBits' optional bias input (index 5; g_idx left empty)
                wq = effective_weight(qv, s, z, block, w.shape[0])
                bias = (mu @ (w.astype(np.float64) - wq)).astype(np.float32)
                m.graph.initializer.append(numpy_helper.from_array(bias, node.input[1] + "_bias_correction"))
                node.input.extend(["", node.input[1] + "_bias_correction"])
            # the error the method minimises (calibration output error: E[x x^T] for gptq, its diagonal for fit;
            # plain squared error for offsets), against round-to-nearest's on the same weight
            ratios[name] = weighted_error(w, qv, s, z, block, hh) / max(
                weighted_error(w, *rtn_int4(w, block), block, hh), 1e-30)
            advance(1)
    if todo:
        raise ForgeError(f"quantize: ORT's quantizer left {sorted(v[0] for v in todo.values())[:5]} as MatMul")
    _save(m, out_dir)
    r = np.array(list(ratios.values()))
    how = {"offsets": "integer zero points + per-block float offsets as extra input columns [x, blocksum(x)]"}.get(
        o.method, f"integer zero points ({o.method}, calibration-weighted)")
    return {"method": f"MatMulNBits ({o.method})", "weights": f"int4 asym block {block}, {how}",
            "bias_correction": o.bias_correction,
            "activations": {4: f"int8 per token and {block}-block, computed at run time (accuracy_level 4)"}.get(
                o.accuracy_level, f"accuracy_level {o.accuracy_level}"), "accuracy_level": o.accuracy_level,
            "output_error_vs_rtn": {"median": float(np.median(r)), "max": float(r.max()), "min": float(r.min())}}


def _int4_wo(model, out_dir: Path, o: OrtInt4Options, excluded: list[str], lm_head: list[str],
             act: dict[str, dict] | None = None) -> dict:
    """Weight-only INT4 (MatMulNBits). ``options.method``: ``hqq`` (default; ORT's half-quadratic quantizer, float
    zero points), ``rtn`` (round-to-nearest, integer zero point), ``fit`` / ``gptq`` (integer zero points fitted to
    calibration data: :func:`_int4_fitted`). ``lm_head``: the lm_head's node names (tied or not); it is quantized as
    :func:`int4_lm_head_grid` says (``options.lm_head_bits``)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, MatMulNBitsQuantizer

    method, block = o.method, o.block_size
    lm8 = [n for n in lm_head if n not in excluded] if int4_lm_head_grid(o) else []
    if o.bias_correction and method not in INT4_CALIBRATED:
        raise ForgeError(f"quantize.options.bias_correction applies to methods {sorted(INT4_CALIBRATED)} (it reads "
                         f"calibration data), not {method}: drop it or pick one of those methods")
    if method in INT4_CALIBRATED and act is None:
        raise ForgeError(f"quantize.options.method {method} fits the weights to calibration data: set "
                         "quantize.calibration (e.g. {set: sotu, split: calib, samples: 32, seq_len: 256})")
    if method in INT4_OWN:
        info = _int4_fitted(model, out_dir, o, excluded + lm8, act)
    elif method == "rtn":
        info = _nbits(model, out_dir, excluded + lm8, bits=4, block=block, sym=o.symmetric, acc=o.accuracy_level)
    elif method == "hqq":
        q = MatMulNBitsQuantizer(model, algo_config=HQQWeightOnlyQuantConfig(block_size=block, bits=4),
                                 nodes_to_exclude=excluded + lm8, op_types_to_quantize=("MatMul",))
        q.process()
        _save(q.model.model, out_dir)
        info = {"method": "MatMulNBits (HQQ)", "weights": f"int4 block {block}, float zero points (HQQ)",
                "activations": "fp32 (HQQ's MatMulNBits kernels)"}
    else:
        raise ForgeError(f"quantize.options.method {method!r} is not known for int4_wo; use hqq, rtn, fit or gptq")
    import onnx
    m = onnx.load(str(out_dir / MODEL_FILE), load_external_data=True)
    if lm8:   # the 8-bit lm_head, then the packing, in the one save
        lm = _nbits(m, out_dir, excluded, bits=8, block=block, sym=_lm_head8_symmetric(o), acc=o.accuracy_level,
                    include=lm8, pack=True)
        info.update({k: v for k, v in lm.items() if k.startswith("packed_")})
        info["lm_head"] = "int8 blockwise (MatMulNBits 8-bit)"
    else:
        packed = _pack_projections(m)
        if any(packed.values()):
            _save(m, out_dir)
        info.update(packed)
    return info


def _lm_head8_symmetric(o: OrtInt4Options) -> bool:
    """int4_wo's 8-bit lm_head: symmetric unless options.symmetric is set (its default, False, is int4 rtn's)."""
    return o.symmetric if "symmetric" in o.model_fields_set else True


def int4_lm_head_grid(o: OrtInt4Options) -> dict | None:
    """int4_wo's lm_head where it differs from the other weights, the one home of this rule (the whole-graph and
    the streaming quantizers and the simulation read it): 8-bit blockwise when ``lm_head_bits`` is 8 (its default;
    4-bit costs ~15 % perplexity on SmolLM2), tied to the embedding or not; None when it is 4 (the 4-bit grid)."""
    if o.lm_head_bits != 8:
        return None
    return {"bits": 8, "block": o.block_size, "symmetric": _lm_head8_symmetric(o)}


def weight_grid(algo: str, options=None, *, scale_dtype: str = "float32") -> dict:
    """The weights' grids :func:`quantize_onnx` writes for ``algo`` / ``options``, as the spec the torch simulation
    reads (pipeline/eval/fake_quant.py ``simulate_model``): ``linear`` (bits, block, symmetric) for every weight
    MatMul, ``lm_head`` where it differs, ``embedding``, ``exclude`` (module-name patterns) and ``scale_dtype``
    (the scales' type in the engine's graph: float16 after the CUDA build's fp16 conversion).

    int4_wo's lm_head grid: :func:`int4_lm_head_grid`, tied or not. Only the round-to-nearest grids have a closed
    form: ForgeError (exit 2, naming the key) for HQQ, dynamic or mixed INT8 (activation scales over the batch), or
    SmoothQuant (rescaled weights)."""
    o = typed_options(algo, options)
    why = "validate.reference: simulated"
    if algo == "int4_wo":
        if o.method != "rtn":
            raise ForgeError(f"{why} needs quantize.options.method: rtn for int4_wo (HQQ's optimised zero points "
                             f"have no closed form to simulate); got {o.method!r}")
        lm = int4_lm_head_grid(o)
        return {"algo": algo, "linear": {"bits": 4, "block": o.block_size, "symmetric": o.symmetric},
                "lm_head": lm, "embedding": None, "exclude": list(o.exclude), "scale_dtype": scale_dtype}
    if algo == "int8":
        if o.method != "blockwise":
            raise ForgeError(f"{why} needs quantize.options.method: blockwise for int8 (dynamic INT8 quantizes "
                             f"activations with one scale over the batch: no weight-only grid); got {o.method!r}")
        if o.smoothquant_alpha is not None:
            raise ForgeError(f"{why} needs quantize.options.smoothquant_alpha: null (SmoothQuant rescales the "
                             "weights by calibrated activation ranges before they are quantized)")
        return {"algo": algo, "linear": {"bits": 8, "block": o.block_size, "symmetric": o.symmetric}, "lm_head": None,
                "embedding": "int8_rows" if o.embedding == "int8" else None, "exclude": list(o.exclude),
                "scale_dtype": scale_dtype}
    raise ForgeError(f"{why}: quantize.algo {algo!r} writes no weight-only grid to simulate (int4_wo or int8 "
                     "blockwise do); use validate.reference: fp32")


def quantize_onnx(fp32_dir: str | Path, out_dir: str | Path, *, algo: str, calib_windows=None,
                  options=None) -> dict:
    """Quantize the FP32 forge ONNX model in ``fp32_dir`` into ``out_dir``; returns metrics + what ran.

    ``options``: the options model of ``algo`` (:data:`OPTIONS`; the recipe hands it over validated), or a dict
    validated into it; each option's meaning and default is declared in ``pipeline/recipe_options.py``."""
    fp32_dir, out_dir = Path(fp32_dir), Path(out_dir)
    o = typed_options(algo, options)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    meta = json.loads((fp32_dir / META_FILE).read_text())
    stats: dict[str, Any] = {"algo": algo}
    if algo == "none":
        for f in (MODEL_FILE, MODEL_FILE + ".data"):
            shutil.copy2(fp32_dir / f, out_dir / f)
        info = {"method": "none"}
    else:
        model = _load(fp32_dir)
        untied = fold_weight_transposes(model)
        _prune_unused_initializers(model)
        stats["untied"] = untied
        nodes = weight_matmuls(model)
        excluded = [n.name for n, _ in nodes if _matches(n, list(o.exclude))]
        act = None
        if calib_windows is not None:
            acts = sorted({n.input[0] for n, _ in nodes})
            act = activation_stats(fp32_dir, calib_windows, tensors=acts, threads=o.threads,
                                   moments=INT4_CALIBRATED.get(o.method) if algo == "int4_wo" else None)
            consumers = {}
            for n, _ in nodes:
                consumers.setdefault(n.input[0], []).append(module_name(n))
            stats["activations"] = {t: {"consumers": consumers[t], "min": s["min"], "max": s["max"],
                                        **_summarise_channels(s["channel_absmax"])} for t, s in act.items()}
        if algo == "int8" and o.outlier_channels and act is None:
            raise ForgeError("quantize.options.outlier_channels picks channels from calibration data "
                             "(quantize.calibration); set it or drop outlier_channels")
        alpha = o.smoothquant_alpha if algo == "int8" else None
        scales: dict[str, np.ndarray] = {}
        if "smoothquant_alpha" not in o.model_fields_set and calib_windows is None:
            alpha = None  # default smoothing needs calibration; without data the default is plain int8
            stats["smoothquant"] = "skipped: no calibration windows"
        if alpha is not None and algo == "int8":
            if calib_windows is None:
                raise ForgeError("quantize.options.smoothquant_alpha needs calibration data "
                                 "(quantize.calibration); set it or drop smoothquant_alpha")
            # per_token quantizes every input per token: outlier channels hurt it everywhere (down_proj's included,
            # folded into up_proj), so it smooths every input unless told otherwise
            only = None if o.method == "per_token" and "smoothquant_only" not in o.model_fields_set \
                else o.smoothquant_only
            stats["smoothquant"] = smooth_fold(model, {t: s["channel_absmax"] for t, s in act.items()},
                                               float(alpha), only=only, scales=scales)
        stats["weights"] = _weight_stats(model, [(n, w) for n, w in nodes if n.name not in excluded])
        emb = None
        if algo == "int8" and o.embedding == "int8":
            emb = quantize_embedding_int8(model, meta["vocab_size"])
            _prune_unused_initializers(model)
        stats["embedding"] = emb
        if algo == "int8":
            method = o.method
            if o.prefill != "same" and method != "blockwise":
                raise ForgeError(f"quantize.options.prefill: {o.prefill} adds a prompt graph to method blockwise, "
                                 f"not {method!r}; use method: blockwise, or drop prefill")
            if method == "dynamic":
                info = int8_dynamic(model, out_dir, o, excluded)
            elif method == "mixed":
                # dynamic per-tensor INT8 where activations are tame, blockwise (per-token) INT8 where calibration
                # shows outlier channels (options.blockwise: fnmatch patterns of module names)
                pats = list(o.blockwise)
                blockwise = [n.name for n, _ in nodes if n.name not in excluded and _matches(n, pats)]
                info = int8_dynamic(model, out_dir, o, excluded + blockwise)
                import onnx

                dyn = onnx.load(str(out_dir / MODEL_FILE), load_external_data=True)
                info2 = _nbits(dyn, out_dir, excluded, bits=8, block=o.block_size, sym=o.symmetric,
                               acc=o.accuracy_level, include=blockwise)
                info = {"method": "mixed", "weights": f"{info['weights']}; {len(blockwise)} MatMuls int8 per "
                                                     f"32-block symmetric",
                        "activations": f"{info['activations']}; {len(blockwise)} MatMuls ({pats}) "
                                       f"{info2['activations']}", "blockwise_nodes": len(blockwise),
                        "dynamic_weights": info["dynamic_weights"]}
            elif method == "blockwise":
                info = _nbits(model, out_dir, excluded, bits=8, block=o.block_size, sym=o.symmetric,
                              acc=o.accuracy_level, pack=True)
                info["method"] = "blockwise"
                if o.prefill == "per_token":
                    del model   # the prompt graph is made from the export again: one fp32 model in memory
                    info["prefill"] = _prefill_graph(fp32_dir, out_dir, o, act, alpha, meta)
            elif method == "per_token":
                info = _per_token_graph(model, out_dir, list(o.exclude), meta,
                                        outliers=outlier_channels(act, scales, o.outlier_channels))
            else:
                raise ForgeError(f"quantize.options.method {method!r} is not known for int8; use blockwise, "
                                 "per_token, mixed or dynamic")
        else:
            # the lm_head: the one fold_weight_transposes untied from the embedding, or the model's own
            lm_head = untied + [n.name for n, _ in nodes if module_name(n) == "lm_head" and n.name not in untied]
            info = _int4_wo(model, out_dir, o, excluded, lm_head, act)
        info["excluded_nodes"] = excluded
        info["quantized_matmuls"] = len(nodes) - len(excluded)
    copy_side_files(fp32_dir, out_dir)
    meta["quantization"] = {"algo": algo, **info}
    # read by the engine and the Triton model (pipeline/ort/engine.py): may rows of different requests share a batch
    meta["batch_invariant"] = batch_invariant(meta["quantization"])
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    stats["method"] = info
    (out_dir / STATS_FILE).write_text(json.dumps(stats, indent=1, default=float))
    return {"algo": algo, **{k: v for k, v in info.items() if k != "excluded_nodes"},
            "excluded": len(info.get("excluded_nodes", [])), "quantize_s": round(time.time() - t0, 2),
            "model_bytes": model_bytes(out_dir), "fp32_model_bytes": model_bytes(fp32_dir),
            "size_ratio": model_bytes(out_dir) / model_bytes(fp32_dir)}


# ---------------------------------------------------------------------------------------------- batching

def batch_invariant(quantization: dict) -> bool:
    """Whether an engine quantized as ``quantization`` (its metadata's record) gives a row the same logits alone
    as batched with other rows (measured bitwise: tests/ort/test_batch_invariance.py).

    Dynamic INT8 MatMuls (methods ``dynamic``, ``mixed``) quantize their activations with ONE scale per tensor,
    computed over the whole batch, padding included: a row's numbers depend on its batch-mates. MatMulNBits
    (``blockwise``, INT4) quantizes activations per row and block, FP32 not at all."""
    return dynamic_int8_weights(quantization) is None



def dynamic_int8_weights(quantization: dict) -> str | None:
    """How the dynamically quantized MatMuls of an engine hold their weights: ``int8`` (full-range s8: MLAS runs
    them with its u8 x s8 kernels), ``int8-7bit`` (reduce_range), ``uint8``, or None when there are none.

    ``quantization`` is an engine's recorded quantization (its metadata's ``quantization``) or a recipe's quantize
    section (algo + options). Engines recorded before ``dynamic_weights`` existed were all full-range s8."""
    if quantization.get("algo") != "int8":
        return None
    if "dynamic_weights" in quantization:
        return quantization["dynamic_weights"]
    if "quantized_matmuls" in quantization:   # an engine's record from before the field: forge made only s8
        return "int8" if quantization.get("method") in ("dynamic", "mixed") else None
    return _dynamic_weights({**INT8.model_dump(), **(quantization.get("options") or {})})


def _dynamic_weights(opts: dict) -> str | None:
    if opts.get("method") in ("blockwise", "per_token"):   # no activation scale over the batch
        return None
    if opts.get("weight_type", "int8") == "uint8":
        return "uint8"
    return "int8-7bit" if opts.get("reduce_range") else "int8"


def isa_accuracy_risk(quantization: dict, isa_class: str) -> str | None:
    """Why an engine quantized as ``quantization`` is known to lose accuracy on a CPU of ``isa_class``
    (pipeline/host/cpu.py), or None when it is not known to.

    MLAS runs u8 activations x s8 weights on AVX2 and AVX-512 without VNNI with vpmaddubsw, which sums pairs of
    products in saturating 16-bit lanes: 2 x 255 x 127 overflows, so full-range int8 weights lose accuracy there
    (microsoft/onnxruntime onnxruntime/core/mlas/lib/platform.cpp: MlasGemmU8S8KernelAvx2 / ...Avx512Core; the
    session option ``session.x64quantprecision`` documents the same overflow). 7-bit weights (2 x 255 x 64) and u8
    weights (MLAS's u8 x u8 kernels widen to 16 bits before multiplying) are exact on every class."""
    from pipeline.host.cpu import U8S8_SATURATING

    if isa_class in U8S8_SATURATING and dynamic_int8_weights(quantization) == "int8":
        return (f"dynamic INT8 MatMuls with full-range s8 weights run on MLAS's u8 x s8 kernels, which on "
                f"{isa_class} (no VNNI/AMX) sum pairs of products in saturating 16-bit lanes")
    return None
