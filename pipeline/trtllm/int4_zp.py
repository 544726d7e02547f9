"""INT4 with zero points (quantize.algo int4_zp): a float TensorRT-LLM checkpoint rewritten into the groupwise int4
layout with zeros that TensorRT-LLM 1.2 loads (quant_algo ``W4A16_AWQ``, ``has_zero_point: true``,
``pre_quant_scale: false``).

Why this layout. TensorRT-LLM has two groupwise int4 checkpoint formats. ``W4A16_GPTQ`` checkpoints hold weights
already run through ``preprocess_weights_for_mixed_gemm`` (the legacy converters do it), whose interleave depends on
the GPU's SM, and the checkpoint loader does not redo it (``preprocess_perlayer_weights`` has no GPTQ branch:
tensorrt_llm/models/modeling_utils.py, 1.x, index id 1189552800). ``W4A16_AWQ`` checkpoints hold the plain packed
codes ModelOpt writes, and the loader interleaves them for the build machine's SM; the layer it builds is the same
``WeightOnlyGroupwiseQuantLinear``, with ``zero=quant_config.has_zero_point`` and
``pre_quant_scale=quant_config.pre_quant_scale`` read from config.json (``weight_only_groupwise_quantize``,
tensorrt_llm/quantization/quantize.py @ 89fd9b7, index id 235018984). So forge writes the AWQ layout, zeros on and
the AWQ smoothing vector off. No upstream tool writes that combination; every piece of it is read by the code cited
here, and the engine build on a GPU is what proves it.

Tensors per decoder linear (``attention.qkv``, ``attention.dense``, ``mlp.fc``, ``mlp.gate``, ``mlp.proj``), with
``o`` / ``i`` the rank's output / input width and ``g`` the group size:

* ``weight`` int8 ``(o / 2, i)``: signed int4 codes, two output rows per byte (low nibble: the even row), the packing
  of ModelOpt's ``pack_int4_in_uint8`` (modelopt/torch/export/quant_utils.py) viewed as int8 as ModelOpt's export
  does. The loader calls ``preprocess_weights_for_mixed_gemm(param.transpose(-1, -2), torch.quint4x2, ...)`` on int8
  weights (modeling_utils.py, above), i.e. it reads ``(i, o / 2)`` with the low nibble the even output column: the
  layout TensorRT-LLM's own GPTQ loading builds (``qweight[:, 1::2] * 16 + qweight[:, ::2]`` in
  ``postprocess_weight_only_groupwise``, tensorrt_llm/quantization/functional.py, 1.x, index id 240578642).
* ``weights_scaling_factor`` ``(o, i / g)`` in the model dtype: the loader transposes it to the layer's
  ``(i / g, o)`` and casts it to the model dtype (modeling_utils.py, above).
* ``zero`` ``(i / g, o)`` in the model dtype: the layer's own shape (``self.zero = Parameter(shape=scale_shape)``,
  ``scale_shape = (in_features // group_size, out_features)``: tensorrt_llm/quantization/layers.py, 1.x, index id
  790827869); the loader's AWQ branch leaves it as stored. The plugin computes ``w = q * scale + zero``
  (pipeline/trtllm/zp_grid.py), so ``zero = min + 8 * scale`` of each group.
* no ``prequant_scaling_factor`` (pre_quant_scale false); a bias (Qwen2's qkv) stays as exported.

Group sizes are 64 or 128 (the fine-grained GEMM's only ones) and every width a multiple of max(64, g) x tp (the
layer pads otherwise); both are refused at plan time (build_config.py). lm_head stays float (``exclude_modules``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ForgeError
from . import zp_grid
from .build_config import QUANT_ALGO
from .quantizers import GROUPWISE_SIZES, QUANTIZERS

ZP_ALGO = QUANT_ALGO["int4_zp"]
LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def quantization_block(group: int) -> dict:
    """The checkpoint's ``quantization`` fields of int4_zp (besides kv_cache_quant_algo): its quantizer's block
    (quantizers.py, the one home) with lm_head kept float."""
    qz = QUANTIZERS["int4_zp"]
    q = qz.checkpoint_quantization(qz.options.model_validate({"block_size": int(group)}))
    del q["kv_cache_quant_algo"]
    return {**q, "exclude_modules": ["lm_head"]}


def pack(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes ``[o, i]`` -> int8 ``[o / 2, i]``, two output rows per byte (ModelOpt's packing)."""
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8
    o, i = q.shape
    if o % 2:
        raise ForgeError(f"an int4 weight needs an even number of output rows, got {o}")
    # codes are integers already: a unit scale makes pack_int4_in_uint8's round/clamp the identity
    return pack_int4_in_uint8(q.float(), torch.ones(o, 1), i).view(torch.int8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int8 ``[o / 2, i]`` -> signed int4 codes ``[o, i]`` (inverse of :func:`pack`)."""
    u = packed.view(torch.uint8).to(torch.int16)
    lo, hi = u & 0xF, u >> 4
    q = torch.stack([lo, hi], dim=1).reshape(-1, packed.shape[-1])     # rows 2j (low nibble), 2j + 1 (high)
    return torch.where(q >= 8, q - 16, q).to(torch.int8)


def rewrite_rank(tensors: dict[str, torch.Tensor], dtype: torch.dtype, group: int, where: str) -> dict[str, torch.Tensor]:
    """One rank's float decoder linears in the int4 zero-point layout (module doc); other tensors unchanged."""
    out = dict(tensors)
    names = [k for k in tensors if k.endswith(".weight") and any(k.endswith(f"{lin}.weight") for lin in LINEARS)]
    if not names:
        raise ForgeError(f"{where}: no decoder linear weights to quantize")
    for name in names:
        w = tensors[name]
        if not w.is_floating_point():
            raise ForgeError(f"{where}: {name} is {w.dtype}, not float; the int4_zp rewrite starts from the float "
                             f"export (re-run `forge build <recipe> --force checkpoint`)")
        if w.shape[1] % group:
            raise ForgeError(f"{where}: {name} input width {w.shape[1]} is not a multiple of quantize.block_size "
                             f"{group}; use a block size dividing every linear's width on each rank")
        q, scale, zero = zp_grid.quantize(w, group, dtype)
        pre = name[:-len("weight")]
        out[name] = pack(q).contiguous()
        out[pre + "weights_scaling_factor"] = scale.to(dtype).contiguous()
        out[pre + "zero"] = zero.to(dtype).t().contiguous()
    return out


def to_zero_point(ckpt_dir: str | Path, group: int) -> dict:
    """Rewrite the float checkpoint in ``ckpt_dir`` into int4_zp, each rank file replaced atomically, config.json
    last (so an interrupted rewrite leaves a checkpoint that says float, which the contract check then refuses)."""
    if group not in GROUPWISE_SIZES:
        raise ForgeError(f"quantize.block_size {group}: TensorRT-LLM's groupwise int4 GEMM takes "
                         f"{' or '.join(map(str, GROUPWISE_SIZES))}")
    ckpt = Path(ckpt_dir)
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    q = dict(cfg.get("quantization") or {})
    if q.get("quant_algo") is not None:
        raise ForgeError(f"{cfg_path}: quant_algo {q.get('quant_algo')!r}; the int4_zp rewrite starts from a float "
                         f"export (quant_algo null)")
    dtype = _DT[cfg["dtype"]]
    files = sorted(ckpt.glob("rank*.safetensors"))
    for f in files:
        new = rewrite_rank(load_file(str(f)), dtype, group, f.name)
        tmp = f.with_name(f.name + ".tmp")
        save_file(new, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, f)
    q.update(quantization_block(group))
    cfg["quantization"] = q
    tmp = cfg_path.with_name("config.json.tmp")
    tmp.write_text(json.dumps(cfg, indent=4))
    os.replace(tmp, cfg_path)
    return {"ranks_rewritten": len(files), "quant_algo": ZP_ALGO, "group_size": int(group)}
