"""ONNX -> TensorRT engine with the TensorRT Python API (GPU machines with `tensorrt` installed).

The timing cache is loaded from and saved back to ``timing_cache_dir`` (one per GPU SM), so rebuilds
reuse tactic timings; the exact build settings are written beside the engine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .errors import CannotRunHere, StageFailed


def build_tensorrt_engine(onnx_dir: Path, out_dir: Path, cfg: dict, timing_cache_dir: Path) -> dict:
    try:
        import tensorrt as trt
    except ImportError as e:
        raise CannotRunHere(f"tensorrt is not importable ({e})", "pip install -e '.[tensorrt]' on a GPU machine") from None
    onnx_path = next(Path(onnx_dir).glob("*.onnx"), None)
    if onnx_path is None:
        raise StageFailed(f"no .onnx file in {onnx_dir}")
    t0 = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
                                     if cfg["precision"] in ("int8", "fp8") else 0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise StageFailed("TensorRT could not parse the ONNX graph:\n  " + "\n  ".join(errors))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(cfg["workspace_gib"] * (1 << 30)))
    if cfg["precision"] == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    # dynamic shapes: batch x sequence for every 2-D int input (input_ids, attention_mask, position_ids)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        shape = list(t.shape)
        lo = [1 if d == -1 else d for d in shape]
        opt = [max(1, cfg["max_batch_size"] // 2) if j == 0 and d == -1 else (cfg["max_seq_len"] // 2 if d == -1 else d)
               for j, d in enumerate(shape)]
        hi = [cfg["max_batch_size"] if j == 0 and d == -1 else (cfg["max_seq_len"] if d == -1 else d)
              for j, d in enumerate(shape)]
        profile.set_shape(t.name, lo, opt, hi)
    config.add_optimization_profile(profile)
    timing_cache_dir.mkdir(parents=True, exist_ok=True)
    cache_file = timing_cache_dir / "tensorrt.timing.cache"
    cache = config.create_timing_cache(cache_file.read_bytes() if cache_file.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise StageFailed("TensorRT engine build failed (see the TensorRT log above)")
    (Path(out_dir) / "model.plan").write_bytes(bytes(plan))
    tmp = cache_file.with_suffix(".tmp")
    tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
    tmp.replace(cache_file)
    settings = {"tensorrt": trt.__version__, **cfg, "onnx": onnx_path.name}
    (Path(out_dir) / "build_settings.json").write_text(json.dumps(settings, indent=2))
    return {"build_s": time.perf_counter() - t0, "engine_bytes": len(plan), "tensorrt": trt.__version__}
