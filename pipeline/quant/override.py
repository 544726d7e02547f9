"""Instance overrides of ModelOpt's ``TensorQuantizer._fake_quantize``: the formats ModelOpt 0.47 cannot simulate
(per-token int8 activations, per_token.py; zero-point int4 weights, zero_point.py) put their own quantize-dequantize
on the quantizers ModelOpt inserted. An override is an instance attribute, not ModelOpt state: :func:`remove` takes
it off before ``mto.save`` (which would pickle the function, and ``torch.load(weights_only=True)`` refuses it)."""

from __future__ import annotations

from typing import Callable

from torch import nn


def install(model: nn.Module, suffix: str, fn: Callable, check: Callable | None = None) -> int:
    """Give every enabled quantizer of ``model`` whose name ends with ``suffix`` the fake-quantize ``fn`` (after
    ``check(name, quantizer)``, which may raise); returns how many."""
    from modelopt.torch.quantization.nn import TensorQuantizer
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, TensorQuantizer) and name.endswith(suffix) and mod.is_enabled:
            if check is not None:
                check(name, mod)
            mod._fake_quantize = fn
            n += 1
    return n


def remove(model: nn.Module, fn: Callable) -> int:
    """Undo :func:`install` of ``fn``; returns how many quantizers it reset."""
    n = 0
    for mod in model.modules():
        if mod.__dict__.get("_fake_quantize") is fn:
            del mod.__dict__["_fake_quantize"]
            n += 1
    return n
