"""An HF model's safetensors weights read a few rows at a time, and the torch model materialised from them one tensor
at a time (issue 38: export, parity and evaluation of a 7B-class model within 2.5x its fp16 bytes of host RAM).

``from_pretrained(dtype=float32)`` of a bf16 checkpoint peaked at 3.2x the model's fp16 bytes of host RAM (measured:
8.37 GB for the 2.65 GB Qwen2.5-7B-shaped 1-layer model): the memory-mapped file stays resident while the fp32
copies are made, then ``.to("cuda")`` copies once more. Here each read opens the file with safetensors' ``safe_open``
(memory-mapped), copies the rows it needs and closes it, which unmaps them (the same rule as
pipeline/trtllm/reference.py): what stays resident is the destination tensors, on the device they are made for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .errors import ForgeError

__all__ = ["HFWeights", "check_names", "load_causal_lm", "CHUNK_BYTES"]

CHUNK_BYTES = 64 << 20   # bytes read per slice: the transient cost of a read, whatever the tensor's size


class HFWeights:
    """The tensors of an HF model dir: ``model.safetensors``, or the shards ``model.safetensors.index.json`` names
    (or every ``*.safetensors`` there). Only headers are read here; :meth:`rows` reads data."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted({self.dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ForgeError(f"{self.dir} has no *.safetensors weights; the streaming export and loader read "
                             "safetensors only (save the model with save_pretrained(safe_serialization=True))")
        self.file: dict[str, Path] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    s = h.get_slice(name)
                    self.file[name], self.shape[name], self.dtype[name] = f, tuple(s.get_shape()), s.get_dtype()

    def names(self) -> list[str]:
        return list(self.file)

    def nbytes(self, name: str) -> int:
        size = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(self.dtype[name])
        if size is None:
            raise ForgeError(f"{self.file[name]}: tensor {name} is {self.dtype[name]}; the streaming reader takes "
                             "F32, F16, BF16 and F64 weights")
        n = 1
        for d in self.shape[name]:
            n *= d
        return n * size

    def rows(self, name: str, start: int, stop: int):
        """Rows ``start:stop`` of tensor ``name`` (first axis) as a torch tensor that owns its memory."""
        from safetensors import safe_open

        with safe_open(str(self.file[name]), framework="pt") as h:
            return h.get_slice(name)[start:stop]   # a copy: valid after the file is closed (unmapped)

    def iter_rows(self, name: str, chunk_bytes: int | None = None) -> Iterator[tuple[int, object]]:
        """``(start, rows)`` slices of ``name`` covering it in order, each about ``chunk_bytes`` (default
        :data:`CHUNK_BYTES`; at least one row)."""
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        shape = self.shape[name]
        total = shape[0] if shape else 1
        if not shape:
            yield 0, self.rows(name, 0, 1)
            return
        row = max(1, self.nbytes(name) // max(total, 1))
        step = max(1, chunk_bytes // row)
        for s in range(0, total, step):
            yield s, self.rows(name, s, min(total, s + step))

    def tensor(self, name: str, dtype=None, device: str = "cpu"):
        """The whole tensor ``name`` (as ``dtype``, on ``device``), filled slice by slice."""
        import torch

        dt = dtype or {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16}[self.dtype[name]]
        out = torch.empty(self.shape[name], dtype=dt, device=device)
        if not self.shape[name]:
            return out.copy_(self.rows(name, 0, 1).reshape(()))
        for s, part in self.iter_rows(name):
            out[s:s + part.shape[0]].copy_(part)
        return out


def check_names(w: HFWeights, model) -> None:
    """The checkpoint's tensors are exactly ``model``'s parameters, with matching shapes (a tied ``lm_head`` may be
    absent or present); a ForgeError naming the first differences otherwise."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    extra = [n for n in w.names() if n not in params]
    missing = [n for n in params if n not in w.shape and not (tied and n == "lm_head.weight")]
    shapes = [f"{n} {list(w.shape[n])} vs {list(p.shape)}" for n, p in params.items()
              if n in w.shape and tuple(p.shape) != w.shape[n]]
    problems = ([f"tensors {extra[:5]} are not parameters of {type(model).__name__}"] if extra else []) + \
               ([f"it lacks {missing[:5]} ({len(missing)} parameters)"] if missing else []) + \
               ([f"shapes differ: {shapes[:3]}"] if shapes else [])
    if problems:
        raise ForgeError(f"{w.dir}: the checkpoint does not match its config.json ({'; '.join(problems)}); the "
                         "streaming reader takes checkpoints whose tensor names are the model's own")


def load_causal_lm(hf_dir: str | Path, *, dtype=None, device: str = "cpu"):
    """``AutoModelForCausalLM`` of ``hf_dir`` in ``dtype`` (default float32) on ``device``, filled tensor by tensor
    (see the module doc): peak host memory is the model on ``device`` plus one slice. The checkpoint's tensor names
    must be exactly the model's parameters (a tied ``lm_head`` may be absent or present); anything else is a
    ForgeError naming the tensors."""
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or torch.float32
    cfg = AutoConfig.from_pretrained(hf_dir)
    with init_empty_weights():   # parameters on the meta device; buffers (rotary inv_freq) computed for real
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    w = HFWeights(hf_dir)
    check_names(w, model)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name in w.names():
        if tied and name == "lm_head.weight":
            continue
        set_module_tensor_to_device(model, name, device, value=w.tensor(name, dtype=dtype, device=device))
    if tied:
        model.tie_weights()
    return model.to(device).eval()
