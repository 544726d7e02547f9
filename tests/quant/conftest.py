import os
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
os.environ.setdefault("FORGE_PROGRESS", "0")



@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Llama (hidden 64 = 2 x 32, MLP 96) saved as an HF dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg)
    # a few large input channels so SmoothQuant / outlier statistics have something to find
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[[3, 17]] = 25.0
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d)
    return d


def make_windows(n: int, t: int, seed: int, vocab: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=g)


def real_model() -> Path:
    return Path(os.environ.get("FORGE_TEST_MODEL", "/nonexistent-set-FORGE_TEST_MODEL"))


@pytest.fixture
def windows():
    """``windows(n, t, seed)``: random token windows for the tiny model."""
    return make_windows
