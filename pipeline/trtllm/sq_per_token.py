"""Per-token SmoothQuant checkpoint (``W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN``) from ModelOpt's int8_sq export.

ModelOpt 0.47 exports SmoothQuant only as ``W8A8_SQ_PER_CHANNEL`` (static per-tensor activations, TensorRT-LLM's
out-of-the-box ``Int8SmoothQuantLinear``). TensorRT-LLM 1.2 loads per-token activation scales only through its
plugin module swap, which reads another tensor set. This module rewrites each rank file in place, from the same
int8 weights and smoothing vectors. Upstream sources (NVIDIA/TensorRT-LLM):

* which modules are swapped: ``smooth_quantize_plugin`` in ``tensorrt_llm/quantization/quantize.py`` @ 89fd9b7
  -- every RmsNorm except ``ln_f`` becomes ``SmoothQuantRmsNorm``, GatedMLP ``SmoothQuantGatedMLP``, Attention
  ``SmoothQuantAttention``; lm_head stays a plain (float) linear.
* their parameters: ``tensorrt_llm/quantization/layers.py`` (1.x, index id 790827869; same names at 2340c77):
  ``SmoothQuantLinear`` / ``SmoothQuantRowLinear``: ``weight`` int8 ``(out, in)``, ``per_channel_scale`` fp32
  ``(1, out)`` (per-channel mode; QKV is always per channel), no ``act_scale`` with per-token scaling;
  ``SmoothQuantRowLinear.smoother`` fp32 ``(1, in)``, which ``SmoothQuantAttention`` / ``SmoothQuantGatedMLP``
  divide the dense / proj input by before ``quantize_per_token``; ``SmoothQuantRmsNorm.scale_to_int`` ``(1,)`` in
  the model dtype (unused with per-token scaling: the plugin computes each token's scale).
* the values: ``get_tllm_linear_sq_weight`` in ``tensorrt_llm/models/llama/convert.py`` @ 0afa06a, per-token
  branch -- ``per_channel_scale = scale_w_quant_orig.col`` (max|w| of the output channel / 127, i.e. ModelOpt's
  ``weights_scaling_factor``), ``scale_to_int = [1.0]`` on the norm before qkv and fc/gate, the smoother stored for
  dense / proj; and ``smooth_llama_model`` (same file): the qkv and fc+gate smoothing is folded into the
  preceding RMSNorm weight (the norm weight is divided by the smoother, ModelOpt's ``prequant_scaling_factor`` is
  that smoother's inverse).

So, per decoder layer: ``input_layernorm.weight *= qkv.prequant_scaling_factor``, ``post_layernorm.weight *=
fc.prequant_scaling_factor`` (fc and gate share it: ModelOpt resmooths linears with one input), ``dense`` /
``proj`` ``smoother = 1 / prequant_scaling_factor``, every ``weights_scaling_factor`` becomes
``per_channel_scale`` ``(1, out)``, and the static ``activation_scaling_factor`` / ``prequant_scaling_factor`` are
dropped. The KV-cache scale and every float tensor are copied unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ForgeError
from .build_config import QUANT_ALGO

PER_TOKEN_ALGO = QUANT_ALGO["int8_sq_per_token"]
STATIC_ALGO = QUANT_ALGO["int8_sq"]
COLUMN = ("attention.qkv", "mlp.fc", "mlp.gate")
ROW = ("attention.dense", "mlp.proj")
_NORM_OF = {"attention.qkv": "input_layernorm", "mlp.fc": "post_layernorm"}   # mlp.gate shares fc's norm
_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _layer_prefixes(tensors: dict) -> list[str]:
    return sorted({k[:k.index(".attention.qkv.weight")] + "." for k in tensors if k.endswith(".attention.qkv.weight")})


def rewrite_rank(tensors: dict[str, torch.Tensor], dtype: torch.dtype, where: str) -> dict[str, torch.Tensor]:
    """One rank's ModelOpt ``W8A8_SQ_PER_CHANNEL`` tensors in the per-token plugin layout (see the module doc)."""
    out = dict(tensors)
    for pre in _layer_prefixes(tensors):
        for lin in COLUMN + ROW:
            w = tensors.get(pre + lin + ".weight")
            if w is None or w.dtype != torch.int8 or pre + lin + ".prequant_scaling_factor" not in tensors:
                raise ForgeError(f"{where}: {pre}{lin} is not int8 SmoothQuant (dtype "
                                 f"{None if w is None else w.dtype}); TensorRT-LLM's SmoothQuant plugin path quantizes "
                                 f"every decoder linear, so quantize.options.exclude may not leave one in float with "
                                 f"int8_sq_per_token: remove the pattern, or use quantize.algo int8_sq")
            wsf = out.pop(pre + lin + ".weights_scaling_factor").float()
            out[pre + lin + ".per_channel_scale"] = wsf.reshape(1, -1).contiguous()
            out.pop(pre + lin + ".activation_scaling_factor", None)
        for lin, norm in _NORM_OF.items():
            pqs = out.pop(pre + lin + ".prequant_scaling_factor").float()
            if lin == "mlp.fc":
                gate = out.pop(pre + "mlp.gate.prequant_scaling_factor").float()
                if not torch.equal(gate, pqs):
                    raise ForgeError(f"{where}: {pre}mlp.fc and mlp.gate have different smoothing vectors; the "
                                     f"plugin path folds one into post_layernorm (ModelOpt's export resmooths them "
                                     f"to one: re-run `forge build <recipe> --force quantize`)")
            key = pre + norm + ".weight"
            out[key] = (tensors[key].float() * pqs).to(dtype).contiguous()
            out[pre + norm + ".scale_to_int"] = torch.ones(1, dtype=dtype)
        for lin in ROW:
            pqs = out.pop(pre + lin + ".prequant_scaling_factor").float()
            out[pre + lin + ".smoother"] = (1.0 / pqs).reshape(1, -1).contiguous()
    return out


def to_per_token(ckpt_dir: str | Path) -> dict:
    """Rewrite the checkpoint in ``ckpt_dir`` (ModelOpt's ``W8A8_SQ_PER_CHANNEL``) into
    ``W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN``, each rank file replaced atomically, config.json last."""
    ckpt = Path(ckpt_dir)
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    q = dict(cfg.get("quantization") or {})
    if q.get("quant_algo") != STATIC_ALGO:
        raise ForgeError(f"{cfg_path}: quant_algo {q.get('quant_algo')!r}; the per-token rewrite starts from "
                         f"ModelOpt's {STATIC_ALGO} export")
    dtype = _DT[cfg["dtype"]]
    files = sorted(ckpt.glob("rank*.safetensors"))
    for f in files:
        new = rewrite_rank(load_file(str(f)), dtype, f.name)
        tmp = f.with_name(f.name + ".tmp")
        save_file(new, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, f)
    q["quant_algo"] = PER_TOKEN_ALGO
    cfg["quantization"] = q
    tmp = cfg_path.with_name("config.json.tmp")
    tmp.write_text(json.dumps(cfg, indent=4))
    os.replace(tmp, cfg_path)
    return {"ranks_rewritten": len(files), "quant_algo": PER_TOKEN_ALGO}
