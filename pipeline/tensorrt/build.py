"""The QDQ ONNX graph -> a TensorRT engine, built through Polygraphy (GPU machines with ``tensorrt`` installed).

The network is parsed strongly typed: every tensor's type comes from the graph (the quantize stage wrote the
QDQ INT8/FP8 pairs and the fp16/fp32 rest), so no builder precision flags are set -- TensorRT 11 removed them and
always builds strongly typed (``include/NvInfer.h``, NetworkDefinitionCreationFlag::kSTRONGLY_TYPED "deprecated
and ignored"). Two optimisation profiles cover the KV-cache graph: ``context`` (prefill: past length 0, up to
``max_seq_len`` new tokens) and ``generation`` (decode: one new token, past up to ``max_seq_len - 1``); a runtime
selects the profile per call.

The tactic timing cache is shared per GPU SM and TensorRT version under ``$FORGE_HOME/timing_cache/``: each build
works on a private copy (a unique temp name beside it) that Polygraphy loads and extends, and the copy replaces
the shared file atomically, so concurrent builds never read a half-written cache.

Polygraphy API used (names checked against NVIDIA/TensorRT@a892d22267d9cd2dedc1a0893e6892ac901f6d3d and the
polygraphy 0.53.6 wheel): ``tools/Polygraphy/polygraphy/backend/trt/loader.py`` --
``NetworkFromOnnxPath(path, strongly_typed=...)``, ``EngineBytesFromNetwork(network, config, save_timing_cache)``;
``.../backend/trt/config.py`` -- ``CreateConfig(profiles=, load_timing_cache=, memory_pool_limits=,
builder_optimization_level=)``; ``.../backend/trt/profile.py`` -- ``Profile().add(name, min, opt, max)``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from ..errors import CannotRunHere, ForgeError, StageFailed

INSTALL_HINT = "pip install -e '.[tensorrt]' on a machine with an NVIDIA GPU (wheels from NVIDIA's package index)"


def graph_inputs(onnx_path: Path) -> dict[str, list]:
    """Input name -> dims (int for a fixed dim, the symbolic name or None for a dynamic one), weights not loaded."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    return {i.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in i.type.tensor_type.shape.dim] for i in model.graph.input}


def profile_shapes(inputs: dict[str, list], max_batch: int, max_seq: int) -> dict[str, dict[str, tuple]]:
    """min/opt/max shapes of every input for the ``context`` and ``generation`` profiles of a forge KV-cache graph
    (``input_ids``/``position_ids`` [B, T], ``attention_mask`` [B, past + T], ``past_key_values.*`` [B, kv, past, hd])."""
    if max_seq < 2:
        raise ForgeError("build.tensorrt.max_seq_len must be at least 2 (one prompt token and one generated)")
    opt_b = max(1, max_batch // 2)
    half = max(1, max_seq // 2)
    # (new tokens T, past length P) as min / opt / max per profile
    plans = {"context": ((1, 0), (half, 0), (max_seq, 0)),
             "generation": ((1, 1), (1, half), (1, max_seq - 1))}
    out: dict[str, dict[str, tuple]] = {}
    for prof, tp in plans.items():
        shapes = {}
        for name, dims in inputs.items():
            rows = []
            for (t, p), b in zip(tp, (1, opt_b, max_batch)):
                if name in ("input_ids", "position_ids"):
                    rows.append((b, t))
                elif name == "attention_mask":
                    rows.append((b, p + t))
                elif name.startswith("past_key_values."):
                    if len(dims) != 4 or not all(isinstance(d, int) and d > 0 for d in (dims[1], dims[3])):
                        raise ForgeError(f"{name} has dims {dims}; forge's KV graph has [batch, kv_heads, past, head_dim]")
                    rows.append((b, dims[1], p, dims[3]))
                else:
                    raise ForgeError(f"the ONNX graph has an input {name!r} that forge's export does not write")
            shapes[name] = tuple(rows)
        out[prof] = shapes
    return out


def polygraphy_loaders(onnx_path: Path, cfg: dict, timing_cache: Path, trt):
    """The Polygraphy loader chain that builds the engine (nothing runs until it is called):
    ``EngineBytesFromNetwork(NetworkFromOnnxPath(strongly typed), CreateConfig(profiles, timing cache, workspace))``.
    ``trt`` is the tensorrt module (only its enums are read here)."""
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile

    profiles = []
    for shapes in profile_shapes(graph_inputs(onnx_path), cfg["max_batch_size"], cfg["max_seq_len"]).values():
        p = Profile()
        for name, (lo, opt, hi) in shapes.items():
            p.add(name, min=lo, opt=opt, max=hi)
        profiles.append(p)
    network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)
    config = CreateConfig(profiles=profiles, load_timing_cache=str(timing_cache),
                          memory_pool_limits={trt.MemoryPoolType.WORKSPACE: int(cfg["workspace_gib"] * (1 << 30))},
                          builder_optimization_level=cfg.get("builder_optimization_level"))
    return EngineBytesFromNetwork(network, config=config, save_timing_cache=str(timing_cache))


def private_timing_cache(shared: Path) -> Path:
    """A copy of the shared timing cache under a unique name beside it (empty file when there is none yet)."""
    shared.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{shared.name}.", suffix=".tmp", dir=shared.parent)
    with os.fdopen(fd, "wb") as f:
        if shared.exists():
            f.write(shared.read_bytes())
    return Path(tmp)


def build_tensorrt_engine(onnx_dir: Path, out_dir: Path, cfg: dict, timing_cache_dir: Path) -> dict:
    try:
        import tensorrt as trt
    except ImportError as e:
        raise CannotRunHere(f"tensorrt is not importable ({e})", INSTALL_HINT) from None
    onnx_path = Path(onnx_dir) / "model.onnx"
    if not onnx_path.exists():
        raise StageFailed(f"no model.onnx in {onnx_dir} (the quantize stage's output)")
    shared = Path(timing_cache_dir) / f"tensorrt-{trt.__version__}.cache"
    tmp = private_timing_cache(shared)
    t0 = time.perf_counter()
    try:
        try:
            engine = polygraphy_loaders(onnx_path, cfg, tmp, trt)()
        except Exception as e:    # Polygraphy reports parser/builder errors as PolygraphyException
            raise StageFailed(f"TensorRT could not build {onnx_path.name}: {e}") from None
        os.replace(tmp, shared)
    finally:
        tmp.unlink(missing_ok=True)
    plan = bytes(engine)      # an IHostMemory buffer
    (Path(out_dir) / "model.plan").write_bytes(plan)
    settings = {"tensorrt": trt.__version__, **cfg, "onnx": onnx_path.name, "strongly_typed": True,
                "profiles": list(profile_shapes(graph_inputs(onnx_path), cfg["max_batch_size"], cfg["max_seq_len"]))}
    (Path(out_dir) / "build_settings.json").write_text(json.dumps(settings, indent=2))
    return {"build_s": round(time.perf_counter() - t0, 2), "engine_bytes": len(plan), "tensorrt": trt.__version__}
