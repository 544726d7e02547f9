"""A Hugging Face model directory with SEEDED RANDOM weights in a real model's shape (issue 26: the 7B-class CUDA
engine on a GPU machine with no network and no real weights).

    python lab/random_hf_model.py --config pipeline/model_configs/Qwen--Qwen2.5-7B-Instruct.json \
        --layers 4 --seed 0 --device cuda --tokenizer-from <an HF dir> --out /tmp/qwen2.5-7b-random-l4

The weights are random, not Qwen's: a model made here says nothing about Qwen2.5-7B's accuracy. What it keeps is
the shape (hidden, heads, KV heads, intermediate, vocabulary, q/k/v biases), so memory, bytes per decode step and
kernel choice are those of the real model; ``--layers`` keeps full width and drops depth (a 28-layer model is
``--layers 28``). Every tensor is drawn from its own generator, seeded from (seed, tensor name), so a tensor does
not depend on the order or the set of the others; linear and embedding weights and the q/k/v biases are
N(0, initializer_range), RMSNorm weights 1. The numbers depend on the generator's device (torch's CPU and CUDA
generators differ), which ``forge_source.json`` records. Saved in bfloat16, Qwen2.5's own dtype: every value is
then exact in fp32 (the reference) and, above fp16's smallest normal, in fp16 (the fp16 engine).

The tokenizer is copied from ``--tokenizer-from`` (on the GPU machine: SmolLM2's, the only one there). Its ids
(< 49,152) index this vocabulary, so evaluation text runs; the random model's own ids above that decode to nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model")


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: stable across runs, machines and Python versions (not hash())."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def random_state_dict(config, seed: int, device: str = "cpu", dtype=None) -> dict:
    """Every parameter of ``AutoModelForCausalLM.from_config(config)``, drawn as the module docstring says."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.bfloat16
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    std = float(getattr(config, "initializer_range", 0.02))
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
            continue
        g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
        t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=g)
        out[name] = t.to(dtype).cpu()
    return out


def make(config_json: Path, out: Path, *, layers: int | None, seed: int, device: str,
         tokenizer_from: Path | None) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    raw = json.loads(Path(config_json).read_text())
    if layers is not None:
        if not 0 < layers <= raw["num_hidden_layers"]:
            raise SystemExit(f"--layers {layers}: the config has {raw['num_hidden_layers']} layers")
        raw["num_hidden_layers"] = layers
        raw["max_window_layers"] = min(raw.get("max_window_layers", layers), layers)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    config = AutoConfig.from_pretrained(out)
    t0 = time.time()
    sd = random_state_dict(config, seed, device)
    gen_s = time.time() - t0
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_from:
        for f in TOKENIZER_FILES:
            if (Path(tokenizer_from) / f).is_file():
                shutil.copy2(Path(tokenizer_from) / f, out / f)
    info = {"random_weights": True, "seed": seed, "device": device, "config": Path(config_json).name,
            "num_hidden_layers": config.num_hidden_layers, "dtype": "bfloat16",
            "parameters": sum(t.numel() for t in sd.values()),
            "tokenizer_from": str(tokenizer_from) if tokenizer_from else None, "generate_s": round(gen_s, 2),
            "save_s": round(time.time() - t0 - gen_s, 2)}
    (out / "forge_source.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="an HF config.json (pipeline/model_configs/...)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (full width)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the generators run: cpu or cuda")
    ap.add_argument("--tokenizer-from", type=Path, default=None)
    a = ap.parse_args(argv)
    print(json.dumps(make(a.config, a.out, layers=a.layers, seed=a.seed, device=a.device,
                          tokenizer_from=a.tokenizer_from)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
