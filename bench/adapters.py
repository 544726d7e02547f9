"""Adapter around our ONNX Runtime engine (pipeline.ort.engine.OrtEngine) for bench.measure."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np


def dir_size(path: str | Path) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


class OursAdapter:
    """Our engine as built by the pipeline. ``engine`` is any object with the OrtEngine API."""

    supports_batch_prefill = True

    def __init__(self, name: str, engine, what: str):
        self.name, self.engine, self.what = name, engine, what
        gen = getattr(engine, "generate_batch", None)
        self.generate_batch = self._gen_batch if gen is not None else None

    @classmethod
    def load(cls, name: str, model_dir: str, threads: int) -> "OursAdapter":
        import importlib
        import os

        import onnxruntime as ort

        # FORGE_BENCH_ENGINE=module:Class swaps the engine class (tests use a fake with the same API)
        mod, _, cls_name = os.environ.get("FORGE_BENCH_ENGINE", "pipeline.ort.engine:OrtEngine").partition(":")
        OrtEngine = getattr(importlib.import_module(mod), cls_name)
        eng = OrtEngine(model_dir, threads=threads) if "threads" in inspect.signature(OrtEngine).parameters \
            else OrtEngine(model_dir, threads)
        return cls(name, eng, f"forge ONNX Runtime engine ({name}), onnxruntime {ort.__version__} "
                              f"CPUExecutionProvider, {threads} threads")

    def prefill(self, ids: np.ndarray):
        return self.engine.prefill(ids)

    def generate(self, ids: np.ndarray, n: int):
        return self.engine.generate(_row(ids), max_new_tokens=n, greedy=True)

    def logits(self, ids) -> np.ndarray:
        """[B, T, V] for ids [B, T] (bench/gates.py scores a peer run by our runtime with it)."""
        return self.engine.logits(np.asarray(ids, dtype=np.int64))

    def _gen_batch(self, ids: np.ndarray, n: int):
        return self.engine.generate_batch([_row(r) for r in np.asarray(ids)], max_new_tokens=n, greedy=True)


def _row(ids: np.ndarray):
    return [int(x) for x in np.asarray(ids).reshape(-1)]
