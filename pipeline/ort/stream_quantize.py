"""Weight-only MatMulNBits quantization of the streaming fp16 graph (pipeline/ort/stream_export.py), one weight at a
time (issue 38): the CUDA recipes' quantize stage.

pipeline/ort/quantize.py loads the whole fp32 protobuf and lets ONNX Runtime's ``MatMulNBitsQuantizer`` rewrite it
(plus an fp16 conversion of the result at build time). Here the graph (a few hundred nodes, no weight data) is
rewritten in memory and each weight is read from ``model.onnx.data`` a block of columns at a time, quantized by ONNX
Runtime's own per-tensor routines and appended to the new data file:

- RTN (``int4_wo`` with ``method: rtn``, ``int8`` with ``method: blockwise``, the 8-bit lm_head):
  ``DefaultWeightOnlyQuantizer.qbits_block_quant`` (the C++ ``quantize_matmul_{4,8}bits`` kernels the whole-graph
  quantizer calls). A block covers ``block_size`` rows of one column, so a slice of columns quantizes exactly as the
  whole tensor does; layout as that quantizer writes it: B [N, k_blocks, blob], scales [N, k_blocks], uint8 zero
  points [N, ...] when asymmetric (onnxruntime/python/tools/quantization/matmul_nbits_quantizer.py).
- HQQ (``int4_wo`` with ``method: hqq``): ``HQQWeightOnlyQuantizer.quantize_internal`` on the whole tensor (its early
  stop watches the whole tensor's error, so it is not sliced), scales and float zero points [N * k_blocks].

Scales (and HQQ's zero points) are stored in fp16, the activations' type, as ORT's float16 tool made them before. The
weights are quantized from the fp16 export: for a bf16 checkpoint that is the checkpoint's value (bf16 -> fp16 is
exact above fp16's smallest normal), for an fp32 one the value rounded to fp16 first.

``int8`` other than ``blockwise`` (dynamic MatMulInteger, SmoothQuant, the int8 embedding) needs the fp32 graph and
is refused at plan time for these recipes (pipeline/targets/onnxruntime.py).
"""

from __future__ import annotations

import fnmatch
import json
import time
from pathlib import Path

import numpy as np

from pipeline.errors import ForgeError
from pipeline.progress import progress_bar

from .export import META_FILE, MODEL_FILE, copy_side_files, model_bytes
from .extdata import DataFile, copy_region, read_cols, read_rows

__all__ = ["quantize_stream", "streamable", "STATS_FILE"]

STATS_FILE = "quant_stats.json"
COLS_BYTES = 64 << 20      # fp32 bytes of one column slice handed to the quantizer
WHOLE_BYTES = 256 << 20    # an fp16 weight up to this size is read in one go, larger ones by column slices


def streamable(algo: str, o) -> str | None:
    """Why ``algo`` with options ``o`` cannot run on the streaming fp16 graph (None when it can)."""
    if algo == "int8":
        bad = [f"{k} = {getattr(o, k)!r}" for k, ok in (("method", o.method == "blockwise"),
                                                        ("smoothquant_alpha", o.smoothquant_alpha is None),
                                                        ("embedding", o.embedding == "fp32"),
                                                        ("prefill", o.prefill == "same")) if not ok]
        if bad:
            return (f"quantize.options {', '.join(bad)}: the fp16 graph of build.onnxruntime.precision: fp16 is "
                    "quantized weight-only (MatMulNBits 8-bit): set method: blockwise, smoothquant_alpha: null, "
                    "embedding: fp32, prefill: same")
    return None


def _modules(node) -> list[str]:
    extra = [p.value for p in node.metadata_props if p.key == "forge.modules"]
    return [node.name] + (extra[0].split(",") if extra else [])


def _matches(node, patterns) -> bool:
    return any(fnmatch.fnmatch(m, p) for m in _modules(node) for p in patterns)


def _plan(algo: str, o, nodes, inits) -> tuple[dict[str, dict], list[str]]:
    """node name -> how its weight is quantized ({bits, block, sym, acc, hqq}); and the excluded node names."""
    from .quantize import int4_lm_head_grid

    mm = [n for n in nodes if n.op_type == "MatMul" and n.input[1] in inits]
    excluded = [n.name for n in mm if _matches(n, list(o.exclude))]
    lm8 = int4_lm_head_grid(o) if algo == "int4_wo" else None
    plan = {}
    for n in mm:
        if n.name in excluded:
            continue
        if algo == "int8":
            plan[n.name] = {"bits": 8, "block": o.block_size, "sym": o.symmetric, "acc": o.accuracy_level, "hqq": False}
        elif n.name == "lm_head" and lm8:
            plan[n.name] = {"bits": 8, "block": lm8["block"], "sym": lm8["symmetric"], "acc": o.accuracy_level,
                            "hqq": False}
        elif o.method == "rtn":
            plan[n.name] = {"bits": 4, "block": o.block_size, "sym": o.symmetric, "acc": o.accuracy_level, "hqq": False}
        elif o.method == "hqq":
            plan[n.name] = {"bits": 4, "block": o.block_size, "sym": False, "acc": None, "hqq": True}
        else:
            raise ForgeError(f"quantize.options.method {o.method!r} is not known for int4_wo; use hqq or rtn")
    return plan, excluded


def _rtn(w32: np.ndarray, q: dict):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, \
        DefaultWeightOnlyQuantizer

    cfg = DefaultWeightOnlyQuantConfig(block_size=q["block"], is_symmetric=q["sym"], accuracy_level=q["acc"],
                                       bits=q["bits"])
    return DefaultWeightOnlyQuantizer(cfg).qbits_block_quant(np.ascontiguousarray(w32))


def _hqq(w32: np.ndarray, q: dict):
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    qz = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=q["block"], bits=4))
    t = torch.from_numpy(w32)
    if torch.cuda.is_available():   # as ORT's quantizer does
        t = t.cuda()
    wq, scales, zero = qz.quantize_internal(t.T, bits=4, group_size=q["block"])
    wq = wq.contiguous()
    packed = torch.zeros((wq.shape[0], wq.shape[1] // 2), dtype=torch.uint8, device=wq.device)
    qz.pack_on_row_fast_248bit(packed, wq, 4)
    k, n = w32.shape
    kb = -(-k // q["block"])
    return (packed.cpu().numpy().reshape(n, kb, q["block"] // 2), scales.cpu().numpy().reshape(-1),
            zero.cpu().numpy().reshape(-1))


def quantize_stream(in_dir: str | Path, out_dir: str | Path, *, algo: str, options) -> dict:
    """Quantize the streaming fp16 graph in ``in_dir`` into ``out_dir`` (``algo`` int4_wo or int8 blockwise;
    ``options`` the algo's options model); returns metrics as pipeline.ort.quantize.quantize_onnx does."""
    import onnx
    from onnx import helper

    from .quantize import batch_invariant, typed_options

    in_dir, out_dir = Path(in_dir), Path(out_dir)
    o = typed_options(algo, options)
    if algo not in ("int4_wo", "int8") or (why := streamable(algo, o)):
        raise ForgeError(why or f"quantize.algo {algo!r}: the streaming quantizer takes int4_wo and int8")
    t0 = time.time()
    meta = json.loads((in_dir / META_FILE).read_text())
    model = onnx.load(str(in_dir / MODEL_FILE), load_external_data=False)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    plan, excluded = _plan(algo, o, list(g.node), inits)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in (out_dir / MODEL_FILE, out_dir / (MODEL_FILE + ".data")):
        f.unlink(missing_ok=True)
    data = DataFile(out_dir / (MODEL_FILE + ".data"))

    # the new graph: quantized MatMuls become MatMulNBits; every initializer gets a region of the new file
    new_inits, jobs, copies, nodes = [], [], [], []
    used = set()
    for n in g.node:
        q = plan.get(n.name)
        if q is None:
            nodes.append(n)
            used.update(n.input)
            continue
        b = inits[n.input[1]]
        k, cols = tuple(b.dims)
        kb = -(-k // q["block"])
        blob = q["block"] * q["bits"] // 8
        names = {"B": f"{b.name}_q{q['bits']}", "scales": f"{b.name}_scales"}
        new_inits.append(data.add(names["B"], (cols, kb, blob), np.uint8))
        new_inits.append(data.add(names["scales"], (cols * kb,) if q["hqq"] else (cols, kb), np.float16))
        if q["hqq"]:
            names["zero_points"] = f"{b.name}_zero_points"
            new_inits.append(data.add(names["zero_points"], (cols * kb,), np.float16))
        elif not q["sym"]:
            names["zero_points"] = f"{b.name}_zero_points"
            new_inits.append(data.add(names["zero_points"], (cols, -(-kb * q["bits"] // 8)), np.uint8))
        attrs = {"K": k, "N": cols, "bits": q["bits"], "block_size": q["block"]}
        if q["acc"]:
            attrs["accuracy_level"] = q["acc"]
        nb = helper.make_node("MatMulNBits", [n.input[0], *names.values()], list(n.output), name=n.name,
                              domain="com.microsoft", **attrs)
        nb.metadata_props.extend(n.metadata_props)
        nodes.append(nb)
        jobs.append((n.name, b, q, names))
    for name, init in inits.items():
        if name in used:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                t = data.add(name, tuple(init.dims), helper.tensor_dtype_to_np_dtype(init.data_type))
                new_inits.append(t)
                copies.append((init, name))
            else:
                new_inits.append(init)
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(new_inits)

    stats = {}
    with data, progress_bar(f"quantize {algo} (tensor by tensor)", len(jobs) + len(copies)) as advance:
        for init, name in copies:
            copy_region(init, in_dir, data, name)
            advance(1)
        for node_name, b, q, names in jobs:
            stats[node_name] = _quantize_one(b, in_dir, data, q, names)
            advance(1)
    onnx.save_model(model, str(out_dir / MODEL_FILE))

    if algo == "int8":
        info = {"method": "blockwise", "weights": f"int8 {'sym' if o.symmetric else 'asym'} block {o.block_size}",
                "activations": _acts(o.accuracy_level, o.block_size), "accuracy_level": o.accuracy_level}
    elif o.method == "rtn":
        info = {"method": "MatMulNBits", "weights": f"int4 {'sym' if o.symmetric else 'asym'} block {o.block_size}",
                "activations": _acts(o.accuracy_level, o.block_size), "accuracy_level": o.accuracy_level}
    else:
        info = {"method": "MatMulNBits (HQQ)", "weights": f"int4 block {o.block_size}, float zero points (HQQ)",
                "activations": "fp32 (HQQ's MatMulNBits kernels)"}
    if algo == "int4_wo" and plan.get("lm_head", {}).get("bits") == 8:
        info["lm_head"] = "int8 blockwise (MatMulNBits 8-bit)"
    info["streamed"] = True
    info["excluded_nodes"] = excluded
    info["quantized_matmuls"] = len(jobs)
    copy_side_files(in_dir, out_dir)
    meta["quantization"] = {"algo": algo, **info}
    meta["batch_invariant"] = batch_invariant(meta["quantization"])
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    (out_dir / STATS_FILE).write_text(json.dumps({"algo": algo, "weights": stats, "method": info}, indent=1))
    fp32_bytes = _fp32_equivalent_bytes(in_dir)
    return {"algo": algo, **{k: v for k, v in info.items() if k != "excluded_nodes"}, "excluded": len(excluded),
            "quantize_s": round(time.time() - t0, 2), "model_bytes": model_bytes(out_dir),
            "input_model_bytes": model_bytes(in_dir), "fp32_model_bytes": fp32_bytes,
            "size_ratio": model_bytes(out_dir) / fp32_bytes}


def _acts(acc: int, block: int) -> str:
    return {4: f"int8 per token and {block}-block, computed at run time (accuracy_level 4)",
            1: "fp32 (accuracy_level 1)", 2: "fp16 (accuracy_level 2)", 3: "bf16 (accuracy_level 3)"}.get(acc, str(acc))


def _quantize_one(b, in_dir: Path, data: DataFile, q: dict, names: dict) -> dict:
    """Quantize the fp16 weight ``b`` [K, N] into the regions ``names``, a slice of columns at a time (HQQ: whole)."""
    k, n = tuple(b.dims)
    whole = read_rows(b, in_dir) if k * n * 2 <= WHOLE_BYTES or q["hqq"] else None
    step = n if q["hqq"] else max(1, COLS_BYTES // (4 * k))
    absmax = 0.0
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        part = (whole[:, c0:c1] if whole is not None else read_cols(b, in_dir, c0, c1)).astype(np.float32)
        absmax = max(absmax, float(np.abs(part).max()))
        packed, scales, zp = (_hqq if q["hqq"] else _rtn)(part, q)
        kb = packed.shape[1]
        data.write_rows(names["B"], c0, packed)
        data.write_rows(names["scales"], c0 * kb if q["hqq"] else c0, scales.astype(np.float16))
        if "zero_points" in names:
            data.write_rows(names["zero_points"], c0 * kb if q["hqq"] else c0,
                            zp.astype(np.float16) if q["hqq"] else zp)
    return {"weight": b.name, "shape": [k, n], "weight_absmax": absmax, "bits": q["bits"], "block": q["block"],
            "symmetric": q["sym"], "hqq": q["hqq"]}


def _fp32_equivalent_bytes(model_dir: Path) -> int:
    """The bytes the graph in ``model_dir`` would have with fp32 weights (what ``size_ratio`` divides by, as for
    the fp32 export)."""
    import onnx
    from onnx import TensorProto

    m = onnx.load(str(Path(model_dir) / MODEL_FILE), load_external_data=False)
    total = (Path(model_dir) / MODEL_FILE).stat().st_size
    for i in m.graph.initializer:
        if i.data_location == TensorProto.EXTERNAL:
            length = int({e.key: e.value for e in i.external_data}["length"])
            total += length * 2 if i.data_type == TensorProto.FLOAT16 else length
    return total
