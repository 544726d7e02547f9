"""Triton model repository for the ``onnxruntime`` target.

    <repo>/ensemble/          text_input, max_tokens [, end_id, pad_id, top_k, top_p, temperature, seed]
                              -> text_output, output_ids
    <repo>/preprocessing/     python: tokenizer (copied into 1/tokenizer/)
    <repo>/onnxruntime_llm/   python: KV-cache generate loop (forge's engine module copied into 1/)
    <repo>/postprocessing/    python: detokenizer
    <repo>/bls/               python: the same interface as BLS (optional)
    <repo>/llm_graph/         backend "onnxruntime": the engine graph itself (for a full Triton image;
                              its version folder holds the engine files the python model runs)

With ``package.triton.decoupled: true`` the engine model, the BLS and so the ensemble are decoupled: they
stream (``"stream": true``: /generate_stream, gRPC streaming) and do not serve KServe /infer, as on the
tensorrt_llm target.
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

from pipeline.errors import ForgeError
from pipeline.triton import templates
from pipeline.triton.pbtxt import params, parse_all_configs, tensor, write_config

ENGINE_MODEL = "onnxruntime_llm"
GRAPH_MODEL = "llm_graph"
DEFAULT_ENGINE_MODULE = Path(__file__).resolve().parents[1] / "ort" / "engine.py"
BATCHER_MODULE = Path(__file__).resolve().parents[1] / "ort" / "batcher.py"   # copied as forge_batcher.py
STUB_IMPORTS = {"numpy", "onnxruntime", "tokenizers"}

_ONNX_TO_TRITON = {1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 4: "TYPE_UINT16", 5: "TYPE_INT16", 6: "TYPE_INT32",
                   7: "TYPE_INT64", 8: "TYPE_STRING", 9: "TYPE_BOOL", 10: "TYPE_FP16", 11: "TYPE_FP64", 12: "TYPE_UINT32",
                   13: "TYPE_UINT64", 16: "TYPE_BF16"}


def check_engine_module(path: Path) -> None:
    """The engine module runs inside tritonserver's python stub: stdlib + numpy/onnxruntime/tokenizers only
    (an import inside ``try: ... except (ImportError|Exception)`` is optional and allowed)."""
    tree = ast.parse(Path(path).read_text(), filename=str(path))
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is None or (isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError", "Exception"))
                or (isinstance(h.type, ast.Tuple) and any(isinstance(e, ast.Name) and e.id in ("ImportError", "ModuleNotFoundError", "Exception") for e in h.type.elts))
                for h in node.handlers):
            for stmt in node.body:
                guarded.update(id(n) for n in ast.walk(stmt))
    bad = set()
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                bad.add("." * node.level + (node.module or ""))
                continue
            names = [(node.module or "").split(".")[0]]
        else:
            continue
        bad.update(n for n in names if n not in STUB_IMPORTS and n not in sys.stdlib_module_names and n != "__future__")
    if bad:
        raise ForgeError(f"{path} imports {sorted(bad)}; the Triton python model copies this file alone into the "
                         f"repository, so it may import only the standard library and {sorted(STUB_IMPORTS)} "
                         "(optional imports inside try/except ImportError are fine)")


def graph_file(engine_dir: Path) -> Path:
    meta = engine_dir / "forge_ort.json"  # written by pipeline.ort: names the graph file
    if meta.exists():
        import json

        name = json.loads(meta.read_text()).get("model_file")
        if name and (engine_dir / name).exists():
            return engine_dir / name
    if (engine_dir / "model.onnx").exists():
        return engine_dir / "model.onnx"
    onnx_files = sorted(engine_dir.glob("*.onnx"))
    if len(onnx_files) != 1:
        raise ForgeError(f"{engine_dir}: expected model.onnx or exactly one *.onnx file, found {[p.name for p in onnx_files]}")
    return onnx_files[0]


def instance_kind(recipe: dict) -> str:
    """KIND_GPU for a package built for the CUDA provider (build.onnxruntime.provider: cuda), else KIND_CPU."""
    b = (((recipe or {}).get("build") or {}).get("onnxruntime") or {})
    return "KIND_GPU" if b.get("provider") == "cuda" else "KIND_CPU"


def graph_config(onnx_path: Path, *, threads: int = 0, kind: str = "KIND_CPU") -> dict:
    """Plain ``backend: "onnxruntime"`` config with inputs/outputs read from the graph (no batching:
    KV-cache tensors of different requests do not stack, so max_batch_size is 0 and dims are full)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)

    def io(values):
        out = []
        for v in values:
            tt = v.type.tensor_type
            dt = _ONNX_TO_TRITON.get(tt.elem_type)
            if dt is None:
                raise ForgeError(f"{onnx_path}: tensor {v.name!r} has ONNX type {tt.elem_type}, which Triton cannot serve")
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
            out.append(tensor(v.name, dt, dims))
        return out

    init = {i.name for i in model.graph.initializer}
    cfg = {"name": GRAPH_MODEL, "backend": "onnxruntime", "max_batch_size": 0,
           "default_model_filename": onnx_path.name,
           "input": io([v for v in model.graph.input if v.name not in init]), "output": io(model.graph.output),
           "instance_group": [{"count": 1, "kind": kind}]}
    if threads:
        cfg["parameters"] = params(intra_op_thread_count=threads)
    return cfg


def triton_options(recipe: dict) -> dict:
    t = dict(((recipe or {}).get("package") or {}).get("triton") or {})
    t.setdefault("max_batch_size", 8)
    t.setdefault("instance_count", 1)
    t.setdefault("max_queue_delay_microseconds", 0)
    t.setdefault("decoupled", False)
    t.setdefault("max_queue_size", 64)
    return t


def write_onnxruntime_repo(out_dir, *, engine_dir, tokenizer_dir, recipe: dict, metrics: dict,
                           engine_module: str | Path | None = None, include_bls: bool = True,
                           max_new_tokens: int = 4096, add_special_tokens: bool = False) -> dict:
    """Write the repository; returns a summary (models, engine graph file, options) for the manifest.

    ``add_special_tokens`` must match how the validate stage tokenised its prompts (forge: False), so
    the served model sees the token ids that were validated.
    ``recipe`` is the resolved recipe dict (``package.triton.*``, ``build.onnxruntime.intra_op_threads``
    are read); ``metrics`` (the validate stage's) are returned in the summary for ``write_manifest``.
    """
    out = Path(out_dir)
    engine_dir = Path(engine_dir)
    if out.exists() and any(out.iterdir()):
        raise ForgeError(f"{out} is not empty; the package stage writes a fresh repository")
    if not engine_dir.is_dir():
        raise ForgeError(f"engine_dir {engine_dir} does not exist; run the build stage first")
    module = Path(engine_module) if engine_module else DEFAULT_ENGINE_MODULE
    if not module.exists():
        raise ForgeError(f"engine module {module} not found; it is copied into the repository as forge_ort_engine.py")
    check_engine_module(module)
    check_engine_module(BATCHER_MODULE)
    opts = triton_options(recipe)
    threads = int((((recipe or {}).get("build") or {}).get("onnxruntime") or {}).get("intra_op_threads", 0) or 0)
    mbs, inst = int(opts["max_batch_size"]), int(opts["instance_count"])
    onnx_path = graph_file(engine_dir)
    out.mkdir(parents=True, exist_ok=True)

    decoupled = bool(opts["decoupled"])
    templates.write_common(out, Path(tokenizer_dir), mbs, inst, add_special_tokens=add_special_tokens)
    # decoupled: the ensemble takes ``stream`` too (and is decoupled, stepping through a decoupled engine model)
    write_config(out / "ensemble", templates.ensemble(mbs, ENGINE_MODEL, streaming=decoupled))
    (out / "ensemble" / "1").mkdir(parents=True, exist_ok=True)

    # the engine files, once: in the graph model's version folder
    gdir = out / GRAPH_MODEL / "1"
    shutil.copytree(engine_dir, gdir)
    kind = instance_kind(recipe)
    b = (((recipe or {}).get("build") or {}).get("onnxruntime") or {})
    gpu = {"provider": "cuda", "cuda_graph": "1" if b.get("cuda_graph") else "0"} if kind == "KIND_GPU" else {}
    write_config(out / GRAPH_MODEL, graph_config(onnx_path, threads=threads, kind=kind))

    eng = {"name": ENGINE_MODEL, "backend": "python", "max_batch_size": mbs,
           "dynamic_batching": {"max_queue_delay_microseconds": int(opts["max_queue_delay_microseconds"])},
           "input": [tensor(n, dt, dims, optional=o) for n, dt, dims, o in templates.ENGINE_INPUTS],
           "output": [tensor(n, dt, dims) for n, dt, dims in templates.ENGINE_OUTPUTS],
           "parameters": params(engine_dir=f"../{GRAPH_MODEL}/1", engine_module="forge_ort_engine", engine_class="OrtEngine",
                                intra_op_threads=threads, max_new_tokens=max_new_tokens,
                                max_queue_size=int(opts["max_queue_size"]), **gpu),
           "instance_group": [{"count": inst, "kind": kind}]}
    if decoupled:   # a python model sends one response per request unless decoupled: streaming needs it
        eng["model_transaction_policy"] = {"decoupled": True}
    write_config(out / ENGINE_MODEL, eng)
    templates.copy_python_model("ort_llm", out / ENGINE_MODEL, {"forge_ort_engine.py": module,
                                                                "forge_batcher.py": BATCHER_MODULE})

    models = ["ensemble", "preprocessing", ENGINE_MODEL, "postprocessing", GRAPH_MODEL]
    if include_bls:
        write_config(out / "bls", templates.bls("bls", mbs, ENGINE_MODEL, decoupled=decoupled, instance_count=inst))
        templates.copy_python_model("bls", out / "bls")
        models.append("bls")
    parse_all_configs(out)
    return {"target": "onnxruntime", "repo_dir": str(out), "models": sorted(models), "engine_model": ENGINE_MODEL,
            "graph_model": GRAPH_MODEL, "graph_file": onnx_path.name, "triton": opts, "intra_op_threads": threads,
            "instance_kind": kind, "provider": "cuda" if gpu else "cpu",
            "metrics": dict(metrics or {})}
