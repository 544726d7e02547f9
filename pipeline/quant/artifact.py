"""The quantize stage's artifact: ModelOpt state + weights, the resolved config, and calibration statistics.

Layout of ``out_dir``::

    modelopt_model.pth   mto.save(): {"modelopt_state", "model_state_dict"} (fake-quant model, fp32 weights)
    quant_config.json    resolved quantize section, ModelOpt config, TensorRT-LLM quantization block, sm needs
    calib_stats.json     per-layer statistics (stats.py) and the top activation-outlier layers
    metrics.json         what quantize_model returned

Downstream stages call :func:`restore_model` with the source HF dir and this directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pipeline.errors import ForgeError

MODEL_FILE = "modelopt_model.pth"
CONFIG_FILE = "quant_config.json"
STATS_FILE = "calib_stats.json"
METRICS_FILE = "metrics.json"


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


def save_artifact(model: nn.Module, out_dir: Path, config: dict) -> None:
    """Write the ModelOpt state + weights and the config record into ``out_dir``."""
    import modelopt.torch.opt as mto

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mto.save(model, str(out_dir / MODEL_FILE))
    (out_dir / CONFIG_FILE).write_text(json.dumps(_jsonable(config), indent=1))


def load_hf_model(hf_dir: Path | str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The FP causal LM from a local HF dir, in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype)
    return model.to(device).eval()


def load_config(artifact_dir: Path) -> dict:
    return json.loads((Path(artifact_dir) / CONFIG_FILE).read_text())


def restore_model(hf_dir: Path, artifact_dir: Path, device: str = "cpu") -> nn.Module:
    """The fake-quantized model of a quantize artifact (eval mode, on ``device``), ready for
    ``modelopt.torch.export.export_tensorrt_llm_checkpoint``."""
    import warnings
    warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
    import modelopt.torch.opt as mto

    f = Path(artifact_dir) / MODEL_FILE
    if not f.exists():
        raise ForgeError(f"{f} is missing: the quantize artifact is incomplete; rebuild it with "
                         f"`forge build <recipe> --force quantize`")
    model = load_hf_model(hf_dir, device="cpu")
    model = mto.restore(model, str(f), map_location="cpu")
    return model.to(device).eval()
