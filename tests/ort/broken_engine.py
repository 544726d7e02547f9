"""A deliberately broken copy of a quantized model, to prove that validation rejects a broken engine."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ForgeError
from pipeline.ort.export import copy_side_files
from pipeline.ort.quantize import _load, _save


def break_scales(model_dir: str | Path, out_dir: str | Path, *, factor: float = 0.0) -> list[str]:
    """Write a deliberately broken copy of a quantized model: every quantization scale initializer multiplied by
    ``factor`` (0 = zeroed). Used to prove that validation rejects a broken engine. Returns the scales changed."""
    from onnx import numpy_helper

    model = _load(Path(model_dir))
    changed = []
    for init in model.graph.initializer:
        n = init.name
        if n.endswith(("_scale", "_rowscale", "_scales")) or n.endswith("scale"):
            arr = numpy_helper.to_array(init)
            if arr.dtype.kind == "f":
                init.CopyFrom(numpy_helper.from_array((arr * factor).astype(arr.dtype), n))
                changed.append(n)
    if not changed:
        raise ForgeError(f"{model_dir} has no quantization scales to break")
    _save(model, Path(out_dir))
    copy_side_files(Path(model_dir), Path(out_dir))
    return changed
