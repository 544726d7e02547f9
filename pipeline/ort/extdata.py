"""ONNX external data written and read a slice at a time: the one file ``model.onnx.data`` beside a graph whose
initializers all point into it (onnx's external-data fields: location, offset, length; onnx.external_data_helper).

Tensors of 1 MiB and more start at a 64 KiB-aligned offset: ONNX Runtime memory-maps an external initializer only when
its offset is a multiple of the allocation granularity, 4 KiB on Linux and 64 KiB on Windows
(include/onnxruntime/core/graph/model_saving_options.h, microsoft/onnxruntime@d07a6207: ``align_threshold`` 1 MiB),
so a session over this file reads the weights from the page cache instead of copying them. Reads and writes are
``pread``/``pwrite`` of row ranges or of a block of columns (one call per row), never a mapping of the file: what a
reader or writer keeps resident is the slice it handles, however large the tensor or the model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["DataFile", "external_region", "read_rows", "read_cols", "copy_region", "ALIGN", "ALIGN_ABOVE"]

ALIGN, ALIGN_ABOVE = 65536, 1 << 20


class DataFile:
    """Lays out tensors in one external data file (:meth:`add` gives each its region and its TensorProto), then
    :meth:`open` sizes the file and :meth:`write_rows` / :meth:`write_cols` fill regions slice by slice."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.end = 0
        self.fd: int | None = None
        self.regions: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}

    def add(self, name: str, shape, dtype):
        """Reserve a region for tensor ``name`` and return its TensorProto (external, no data)."""
        from onnx import TensorProto, helper

        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        off = -(-self.end // ALIGN) * ALIGN if nbytes >= ALIGN_ABOVE else self.end
        self.end = off + nbytes
        self.regions[name] = (off, shape, dtype)
        t = TensorProto()
        t.name, t.data_type = name, helper.np_dtype_to_tensor_dtype(dtype)
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        # the fields onnx.external_data_helper.set_external_data writes (it wants the data in raw_data first)
        for key, value in (("location", self.path.name), ("offset", str(off)), ("length", str(nbytes))):
            e = t.external_data.add()
            e.key, e.value = key, value
        return t

    def open(self) -> "DataFile":
        """Create the file at its full size (sparse until written); the writes below go into it."""
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.end)
        return self

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "DataFile":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, name: str, value: np.ndarray) -> tuple[int, tuple[int, ...]]:
        off, shape, dtype = self.regions[name]
        if value.dtype != dtype:
            raise TypeError(f"{name}: writing {value.dtype} into a {dtype} tensor")
        return off, shape

    def write_rows(self, name: str, row: int, value: np.ndarray) -> None:
        """``tensor[row:row + len(value)] = value`` (rows of the first axis; a 0-d or 1-d tensor is one row each
        element)."""
        off, shape = self._check(name, value)
        row_bytes = value.dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else \
            value.dtype.itemsize
        _pwrite_all(self.fd, np.ascontiguousarray(value), off + row * row_bytes)

    def write_cols(self, name: str, col: int, value: np.ndarray) -> None:
        """``tensor[:, col:col + value.shape[1]] = value`` of a 2-d tensor: one write per row."""
        off, shape = self._check(name, value)
        rows, cols = shape
        if value.shape[0] != rows:
            raise ValueError(f"{name}: {value.shape[0]} rows for a tensor of {rows}")
        item = value.dtype.itemsize
        value = np.ascontiguousarray(value)
        for r in range(rows):
            _pwrite_all(self.fd, value[r], off + (r * cols + col) * item)


def _pwrite_all(fd: int, arr: np.ndarray, offset: int) -> None:
    view = memoryview(arr).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def external_region(tensor, model_dir: str | Path) -> tuple[Path, int, int]:
    """(file, offset, length) of an external initializer."""
    info = {e.key: e.value for e in tensor.external_data}
    return Path(model_dir) / info["location"], int(info.get("offset", 0)), int(info["length"])


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    view = memoryview(out).cast("B")
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError("external data ends early")
        view, offset = view[n:], offset + n


def read_rows(tensor, model_dir: str | Path, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``start:stop`` (first axis) of an external initializer, as numpy."""
    from onnx import helper

    path, off, _ = external_region(tensor, model_dir)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    shape = tuple(tensor.dims) or (1,)
    stop = shape[0] if stop is None else stop
    row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    out = np.empty((stop - start, *shape[1:]), dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        _pread_into(fd, out, off + start * row)
    finally:
        os.close(fd)
    return out


def read_cols(tensor, model_dir: str | Path, start: int, stop: int) -> np.ndarray:
    """Columns ``start:stop`` of a 2-d external initializer (one read per row), as numpy [rows, stop - start]."""
    from onnx import helper

    path, off, _ = external_region(tensor, model_dir)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    rows, cols = tuple(tensor.dims)
    out = np.empty((rows, stop - start), dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        for r in range(rows):
            _pread_into(fd, out[r], off + (r * cols + start) * dtype.itemsize)
    finally:
        os.close(fd)
    return out


def copy_region(tensor, src_dir: str | Path, dst: DataFile, name: str, chunk: int = 64 << 20) -> None:
    """Copy an external initializer's bytes from ``src_dir`` into ``dst``'s region ``name`` (same size), by chunks."""
    path, off, length = external_region(tensor, src_dir)
    doff = dst.regions[name][0]
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            buf = os.pread(fd, min(chunk, length - done), off + done)
            if not buf:
                raise OSError(f"{path}: external data of {tensor.name} ends early")
            _pwrite_all(dst.fd, np.frombuffer(buf, np.uint8), doff + done)
            done += len(buf)
    finally:
        os.close(fd)
