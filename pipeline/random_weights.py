"""``model.source: random:<bundled config>``: a Hugging Face directory with SEEDED RANDOM weights in a real model's
shape (``model.seed``, ``model.layers``), made by forge itself.

What it is for: building, gating, serving and benchmarking an engine of a model's real shape (hidden size, heads, KV
heads, intermediate size, vocabulary, biases, tied or untied lm_head) on a machine that has no weights and no network
(the GPU machines of docs/gpu-runs.md). The weights are random, not the model's: the gates then check that the engine
computes the same function as the torch model, never the model's accuracy (:data:`NOTE`, said in every report).

How the numbers are made:

- the config is the bundled public one (``pipeline/model_configs/<name>.json``) with ``num_hidden_layers`` cut to
  ``model.layers`` (full width; default the config's depth);
- every tensor has its own generator, seeded from ``sha256("<seed>:<tensor name>")`` (:func:`tensor_seed`), so a
  tensor depends neither on the order nor on the set of the others (a 4-layer model's tensors are the first 4 layers
  of the 28-layer model's); linear and embedding weights and biases are N(0, initializer_range), norm weights 1;
- ALWAYS drawn on torch's CPU generator, in fp32, then cast to the config's dtype (bf16 for Qwen2.5). torch's CUDA
  generator (Philox) gives other numbers than the CPU one (mt19937) for the same seed, so drawing on the GPU would make
  the model, and every cache key under it, depend on where it was made; on the CPU every machine makes the same bytes
  (tests/source/test_random_source.py checks the digest). Tensors are drawn in parallel threads (one generator each:
  the thread count changes no number); a 7.6 B model takes about a minute on 16 cores;
- written tensor by tensor into safetensors shards of at most :data:`SHARD_BYTES` (HF's sharded layout with
  ``model.safetensors.index.json``), so making the model holds at most one shard plus the tensors being drawn, never
  the whole model.

The tokenizer is the builtin SmolLM2's (``builtin:smollm2-135m-instruct``, the only one a machine without network
has): its files are copied from that builtin's conversion. Its ids (< 49,152) index any bundled vocabulary, so
evaluation text runs; the random model's own ids above that decode to nothing. The config keeps its own bos/eos ids.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from filelock import FileLock

from .diskspace import DiskFull
from .errors import ForgeError
from .hashing import file_digest, sha256_json
from .host.files import free_bytes, publish_dir
from .modelinfo import BUNDLED

PREFIX = "random:"
NOTE = "random weights: gates check the engine computes the same function, not accuracy"
TOKENIZER_SOURCE = "builtin:smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja")
# Bump when the bytes made for a (config, seed, layers) change: it enters the directory name and the source key.
GENERATOR_VERSION = 1
SHARD_BYTES = 2 << 30
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def is_random(spec: str | None) -> bool:
    return bool(spec) and spec.strip().startswith(PREFIX)


def configs() -> list[str]:
    """The bundled configs a random source can take (``pipeline/model_configs/*.json`` stems)."""
    return sorted(p.stem for p in BUNDLED.glob("*.json") if p.is_file())


def config_name(spec: str) -> str:
    """The bundled config a ``random:<name>`` spec names; ForgeError (exit 2) naming model.source otherwise.
    The name is looked up among the bundled files, never joined to a path as given (``random:../../etc``)."""
    name = spec.strip()[len(PREFIX):]
    known = configs()
    if name not in known or not _NAME.match(name) or ".." in name:
        import difflib
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean 'random:{close[0]}'?" if close else ""
        raise ForgeError(f"model.source {spec.strip()[:200]!r}: no bundled config named {name[:120]!r}{hint} "
                         f"(random:<name> takes one of: {', '.join(known)})")
    return name


def config_file(name: str) -> Path:
    return BUNDLED / f"{name}.json"


def base_config(name: str) -> dict:
    return json.loads(config_file(name).read_text())


def depth(name: str) -> int:
    """The bundled config's own number of decoder layers (``model.layers``' default and upper bound)."""
    return int(base_config(name)["num_hidden_layers"])


def model_problems(spec: str, seed: int, layers: int | None) -> list[str]:
    """The ``model`` section's rules for generated weights, each message naming its key: the spec names a bundled
    config, ``model.layers`` fits it, and ``model.seed`` / ``model.layers`` differ from their defaults (0, null)
    only for a random source (a recipe that extends a random one and names a real model can set them back)."""
    if not is_random(spec):
        given = ([("seed", seed, "0")] if seed != 0 else []) + ([("layers", layers, "null")] if layers is not None
                                                               else [])
        return [f"model.{k} = {v}: read only for model.source random:<bundled config> (generated weights); "
                f"model.source {spec[:200]!r} is a real model: remove it (or set model.{k}: {d})" for k, v, d in given]
    try:
        name = config_name(spec)
    except ForgeError as e:
        return [str(e)]
    n = depth(name)
    if layers is not None and not 1 <= layers <= n:
        return [f"model.layers = {layers}: the bundled config {name} has {n} decoder layers; use 1 to {n} "
                f"(e.g. --set model.layers=4; left out, it is {n})"]
    return []


def effective_layers(name: str, layers: int | None) -> int:
    return depth(name) if layers is None else int(layers)


def model_config(name: str, layers: int) -> dict:
    """The bundled config cut to ``layers`` decoder layers (full width)."""
    raw = base_config(name)
    raw["num_hidden_layers"] = layers
    if "max_window_layers" in raw:
        raw["max_window_layers"] = min(raw["max_window_layers"], layers)
    if isinstance(raw.get("layer_types"), list):
        raw["layer_types"] = raw["layer_types"][:layers]
    return raw


def dtype_name(cfg: dict) -> str:
    """The config's own dtype (``torch_dtype``, or transformers 5's ``dtype``); bf16 when it names none."""
    return _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bfloat16")


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: stable across runs, machines and Python versions (not hash())."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``AutoModelForCausalLM.from_config(config)`` and its shape, without allocating it; a tied
    lm_head is left out (it is the embedding)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def draw(name: str, shape: tuple[int, ...], seed: int, std: float, dtype):
    """One tensor as the module docstring says, on the CPU generator (the same numbers on every machine)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g).to(dtype)


def shard_plan(shapes: dict[str, tuple[int, ...]], itemsize: int, limit: int = SHARD_BYTES) -> list[list[str]]:
    """Tensor names in the model's order, cut into shards of at most ``limit`` bytes (a larger tensor alone)."""
    shards, cur, size = [], [], 0
    for name, shape in shapes.items():
        n = itemsize
        for d in shape:
            n *= d
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur:
        shards.append(cur)
    return shards


def write_weights(config, out: Path, seed: int, dtype_str: str, *, workers: int | None = None,
                  shard_bytes: int = SHARD_BYTES) -> dict:
    """Draw every tensor of ``config`` and write it to ``out`` as safetensors shards (HF layout), one shard at a
    time; returns what was made."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, dtype_str)
    shapes = tensor_shapes(config)
    std = float(getattr(config, "initializer_range", 0.02))
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = shard_plan(shapes, itemsize, shard_bytes)
    need = sum(itemsize * math.prod(s) for s in shapes.values())
    free = free_bytes(out)
    if free is not None and free < need * 1.05:   # said before a 15 GB write, not after it fails half way
        raise DiskFull(f"model.source random:...: {free / 1e9:.2f} GB free at {out.parent}, the model needs about "
                       f"{need / 1e9:.2f} GB ({dtype_str} weights); free space there or point FORGE_HOME at a larger "
                       "disk (or --set model.layers=N for fewer layers)", out)
    files = ["model.safetensors"] if len(plan) == 1 else \
        [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map, total, params = {}, 0, 0
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for fname, names in zip(files, plan):
            tensors = dict(zip(names, pool.map(lambda n: draw(n, shapes[n], seed, std, dtype), names)))
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            for n, t in tensors.items():
                weight_map[n] = fname
                total += t.numel() * t.element_size()
                params += t.numel()
            del tensors
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    return {"parameters": params, "bytes": total, "shards": len(files)}


def dir_key(name: str, seed: int, layers: int, tokenizer_digest: str) -> str:
    """What the generated directory's bytes depend on (its name's hash and the source stage's data)."""
    return sha256_json({"config": file_digest(config_file(name)), "seed": seed, "layers": layers,
                        "generator": GENERATOR_VERSION, "tokenizer": tokenizer_digest})[:12]


def random_dir(name: str, seed: int, layers: int, home: Path, tokenizer_digest: str) -> Path:
    return Path(home) / "models" / f"random-{name}-l{layers}-s{seed}-{dir_key(name, seed, layers, tokenizer_digest)}"


def _complete(path: Path) -> bool:
    return (path / "forge_source.json").is_file()    # written last, inside the temp dir, before the rename


def materialise(name: str, seed: int, layers: int, home: Path, tokenizer_dir: Path, tokenizer_digest: str) -> Path:
    """Make the random model once under ``home/models/`` (atomic rename, a file lock against a second process);
    reuse it afterwards."""
    final = random_dir(name, seed, layers, home, tokenizer_digest)
    if _complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if _complete(final):
            return final
        if final.exists():
            shutil.rmtree(final)
        for stale in final.parent.glob(f".tmp-{final.name}-*"):      # a killed run's (we hold its lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            make(name, seed, layers, tmp, tokenizer_dir)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)                         # mkdtemp made it 0700
            publish_dir(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def make(name: str, seed: int, layers: int, out: Path, tokenizer_dir: Path | None, **kw) -> dict:
    """Write the random model's directory into ``out``: config, weights, tokenizer files, ``forge_source.json``."""
    from transformers import AutoConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = model_config(name, layers)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    config = AutoConfig.from_pretrained(out)
    dt = dtype_name(raw)
    made = write_weights(config, out, seed, dt, **kw)
    if tokenizer_dir is not None:
        copy_tokenizer(Path(tokenizer_dir), out, int(raw["vocab_size"]))
    info = {"random_weights": True, "config": name, "seed": seed, "num_hidden_layers": layers, "dtype": dt,
            "generator": "torch CPU generator per tensor, seed sha256('<seed>:<name>'), N(0, initializer_range), "
                         "norm weights 1", "generator_version": GENERATOR_VERSION, "tokenizer_from": TOKENIZER_SOURCE,
            "note": NOTE, **made}
    (out / "forge_source.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info


def copy_tokenizer(src: Path, out: Path, vocab_size: int) -> None:
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not copied:
        raise ForgeError(f"model.source random:...: no tokenizer files in {src} (from {TOKENIZER_SOURCE})")
    for f in copied:
        shutil.copy2(src / f, out / f)
    from transformers import AutoTokenizer
    n = len(AutoTokenizer.from_pretrained(out))
    if n > vocab_size:
        raise ForgeError(f"model.source random:...: the tokenizer of {TOKENIZER_SOURCE} has {n} ids, more than the "
                         f"config's vocabulary ({vocab_size}); its ids would index past the embedding")
