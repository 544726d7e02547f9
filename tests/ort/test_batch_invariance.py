"""Issue 28: rows of the default INT8 engine can share a batch.

The same rows run alone and batched with rows of other lengths (right padding); the default recipe's INT8 method
must give bitwise-equal logits and greedy tokens, and the engine's metadata (forge_ort.json ``batch_invariant``,
which the Triton model reads) must say so. The dynamic ``mixed`` method computes one activation scale per tensor
over the whole batch: it must be measurably NOT invariant, so that its ``batch_invariant: false`` is truthful.
"""

import json

import numpy as np
import pytest

from pipeline.ort.engine import OrtEngine
from pipeline.ort.quantize import quantize_onnx
from pipeline.recipe import resolve

LENGTHS = (5, 17, 11)   # different lengths: the short rows are padded in the batch


def _rows() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, size=n) for n in LENGTHS]


def _batched(rows):
    T = max(len(r) for r in rows)
    ids = np.zeros((len(rows), T), np.int64)
    mask = np.zeros((len(rows), T), np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return ids, mask


def _engine(src, out, options):
    calib = np.random.default_rng(0).integers(3, 256, (4, 32))   # SmoothQuant's ranges, as the recipe calibrates
    quantize_onnx(src, out, algo="int8", calib_windows=calib, options=options)
    return OrtEngine(out, threads=1)


def _differences(eng) -> list[float]:
    """max |alone - batched| of each row's logits (0.0: bitwise equal)."""
    rows = _rows()
    ids, mask = _batched(rows)
    batched = eng.logits(ids, mask)
    out = []
    for i, r in enumerate(rows):
        alone, together = eng.logits(r[None])[0], batched[i, :len(r)]
        out.append(0.0 if np.array_equal(alone, together) else float(np.abs(alone - together).max()))
    return out

def test_default_int8_rows_are_bitwise_equal_alone_and_batched(tiny_onnx_dir, tmp_path):
    opts = resolve("smollm2-135m-int8").quantize.options
    assert opts.get("method") == "blockwise"     # the default recipe's method, which this test covers
    eng = _engine(tiny_onnx_dir, tmp_path, opts)
    assert json.loads((tmp_path / "forge_ort.json").read_text())["batch_invariant"] is True
    assert eng.batch_invariant is True
    assert _differences(eng) == [0.0] * len(LENGTHS)
    # generation too: each row's greedy tokens batched (prefill with padding, then batched decode) equal alone
    rows = [list(map(int, r)) for r in _rows()]
    together = eng.generate_batch(rows, 6, greedy=True)
    assert [list(t) for t in together] == [list(eng.generate(r, 6, greedy=True)) for r in rows]


@pytest.mark.parametrize("method", ["mixed", "dynamic"])
def test_dynamic_int8_is_not_batch_invariant_and_says_so(tiny_onnx_dir, tmp_path, method):
    eng = _engine(tiny_onnx_dir, tmp_path, {"method": method})
    assert json.loads((tmp_path / "forge_ort.json").read_text())["batch_invariant"] is False
    assert eng.batch_invariant is False
    diffs = _differences(eng)
    assert max(diffs) > 1e-4, diffs   # a row's numbers change with its batch-mates: the metadata is truthful


def test_per_token_int8_rows_are_bitwise_equal_alone_and_batched(tiny_onnx_dir, tmp_path):
    """per_token quantizes each row's activations with its own scale (pipeline/ort/per_token.py): padding and
    batch-mates take no part, and the metadata says the engine may batch."""
    eng = _engine(tiny_onnx_dir, tmp_path, {"method": "per_token"})
    meta = json.loads((tmp_path / "forge_ort.json").read_text())
    assert meta["batch_invariant"] is True and eng.batch_invariant is True
    assert meta["quantization"]["method"] == "per_token" and meta["quantization"]["per_token_matmuls"] == 9 \
        and meta["quantization"]["packed_qkv"] == 2 and meta["quantization"]["packed_gate_up"] == 2   # 2 layers: qkv, o, gate_up, down; lm_head
    assert _differences(eng) == [0.0] * len(LENGTHS)
    rows = [list(map(int, r)) for r in _rows()]
    together = eng.generate_batch(rows, 6, greedy=True)
    assert [list(t) for t in together] == [list(eng.generate(r, 6, greedy=True)) for r in rows]
