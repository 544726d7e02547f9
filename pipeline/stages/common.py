"""Helpers shared by stage wrappers: the model dir, tokenizer and token windows of the recipe's data."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from .. import data as datasets
from ..recipe import Recipe
from ..source import resolve_source


def model_dir(ctx) -> Path:
    """The local HF dir of the source stage (re-materialised if a builtin conversion was removed)."""
    meta = json.loads((ctx.inputs["source"] / "source.json").read_text())
    p = Path(meta["path"])
    if not (p / "config.json").exists():
        p = resolve_source(meta["spec"], ctx.home).path
    return p


@lru_cache(maxsize=4)
def tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def windows(ctx, set_name: str, split: str, samples: int, seq_len: int, seed: int):
    tok = tokenizer(str(model_dir(ctx)))
    text = datasets.load_text(set_name, split, ctx.home)
    return datasets.token_windows(tok, text, samples, seq_len, seed)


def set_digests(r: Recipe, sets: list[tuple[str, str]]) -> dict:
    return {f"{s}/{sp}": datasets.set_digest(s, sp) for s, sp in sets}


def calibration_windows(ctx):
    c = ctx.recipe.quantize.calibration
    return windows(ctx, c.set, c.split, c.samples, c.seq_len, c.seed)


def eval_sets(r: Recipe) -> list[tuple[str, str]]:
    return [(e.set, e.split) for e in r.validate_.eval]
