"""Helpers shared by stage wrappers: the model dir, tokenizer and token windows of the recipe's data."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from .. import data as datasets
from .. import target_registry as registry
from ..errors import ForgeError
from ..recipe import Recipe
from ..source import resolve_source


def model_dir(ctx) -> Path:
    """The local HF dir of the model the source stage recorded, found on this machine (a builtin is converted
    again if its conversion was removed) and checked to be that model (same digest)."""
    if "model_dir" in ctx.extra:
        return ctx.extra["model_dir"]
    meta = json.loads((ctx.inputs["source"] / "source.json").read_text())
    info = resolve_source(meta["spec"], ctx.home, seed=meta.get("seed") or 0, layers=meta.get("layers"))
    if info.digest != meta["digest"]:
        raise ForgeError(f"model.source {meta['spec']!r}: the model at {info.path} is not the one the cached source "
                         f"stage recorded (digest {info.digest[:12]} vs {meta['digest'][:12]}); rebuild from the "
                         f"source with `forge build {ctx.recipe.name} --force source`")
    ctx.extra["model_dir"] = info.path
    return info.path


def source_note(ctx) -> str | None:
    """What every report says about a model with generated (random) weights (pipeline/random_weights.NOTE), from
    the source stage's record; None for a real model."""
    p = ctx.inputs.get("source")
    if p is None or not (Path(p) / "source.json").is_file():
        return None
    return json.loads((Path(p) / "source.json").read_text()).get("note")


@lru_cache(maxsize=4)
def tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def windows(ctx, set_name: str, split: str, samples: int, seq_len: int, seed: int):
    tok = tokenizer(str(model_dir(ctx)))
    text = datasets.load_text(set_name, split, ctx.home)
    return datasets.token_windows(tok, text, samples, seq_len, seed)


def quantizer(r: Recipe):
    """The quantizer of the recipe's quantize section, from its target's table (pipeline/quantizer.py)."""
    return registry.get(r.build.target).quantizer(r.quantize)


def quantize_options(r: Recipe):
    """The typed options of the recipe's quantize section (the recipe validated them; defaults are the model's)."""
    return registry.get(r.build.target).quantize_options(r.quantize)


def set_digests(r: Recipe, sets: list[tuple[str, str]]) -> dict:
    return {f"{s}/{sp}": datasets.set_digest(s, sp) for s, sp in sets}


def calibration_digests(r: Recipe) -> dict:
    """The calibration set's digest, for quantize stages that calibrate whenever quantize.algo is not none."""
    c = r.quantize.calibration
    return set_digests(r, [(c.set, c.split)]) if r.quantize.algo != "none" else {}


def calibration_windows(ctx):
    c = ctx.recipe.quantize.calibration
    return windows(ctx, c.set, c.split, c.samples, c.seq_len, c.seed)


def eval_sets(r: Recipe) -> list[tuple[str, str]]:
    return [(e.set, e.split) for e in r.validate_.eval]
