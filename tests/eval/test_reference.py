import pytest
import torch

from pipeline.eval.reference import TorchReference
from pipeline.errors import ForgeError


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256, max_position_embeddings=256)
    d = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    return d


def test_logits_shape_and_batching_invariance(tiny_llama):
    ref = TorchReference(tiny_llama, batch_size=2)
    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(1))
    lg = ref.logits(ids)
    assert lg.shape == (3, 10, 256) and lg.dtype == torch.float32
    one = TorchReference(tiny_llama, batch_size=1).logits(ids)
    torch.testing.assert_close(lg, one, atol=1e-5, rtol=1e-5)


def test_greedy_with_cache_equals_full_recompute(tiny_llama):
    ref = TorchReference(tiny_llama)
    prompt = [5, 17, 99, 3]
    got = ref.generate_greedy(prompt, 8)
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(ref.logits(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]
    assert len(got) == 8


def test_eos_stops(tiny_llama):
    ref = TorchReference(tiny_llama)
    first = ref.generate_greedy([1, 2, 3], 1)[0]
    assert ref.generate_greedy([1, 2, 3], 10, eos_token_id=first) == [first]


def test_missing_dir_is_clear(tmp_path):
    with pytest.raises(ForgeError, match="config.json"):
        TorchReference(tmp_path)
