"""Token windows: the fixed-length, seeded samples of a text that calibration, QAT and evaluation use."""

from __future__ import annotations

from typing import Any

from ..errors import ForgeError
from ..hashing import sha256_bytes

_TOKEN_MEMO: dict[tuple, Any] = {}   # (tokenizer identity, text sha256) -> 1-D LongTensor; a few entries


def _token_ids(tokenizer, text: str):
    """Token ids of ``text`` (no special tokens) as a LongTensor, memoised per process for named tokenizers."""
    import torch

    name = getattr(tokenizer, "name_or_path", None)
    key = (type(tokenizer).__name__, name, len(tokenizer), sha256_bytes(text.encode("utf-8"))) if name else None
    if key is not None and key in _TOKEN_MEMO:
        return _TOKEN_MEMO[key]
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
    if key is not None:
        if len(_TOKEN_MEMO) >= 4:
            _TOKEN_MEMO.pop(next(iter(_TOKEN_MEMO)))
        _TOKEN_MEMO[key] = ids
    return ids


def token_windows(tokenizer, text: str, samples: int, seq_len: int, seed: int, key_prefix: str = ""):
    """``samples`` non-overlapping ``seq_len``-token windows of ``text`` (no BOS), chosen by ``seed``.

    The text is tokenized once (memoised per process) and cut into consecutive slots of ``seq_len``
    tokens; a seeded permutation picks ``samples`` slots, returned in text order. Same inputs -> same
    tensor. ``key_prefix`` (e.g. ``"quantize.calibration"``) makes errors name the recipe keys.
    """
    import torch

    k = f"{key_prefix}." if key_prefix else ""
    if samples < 1 or seq_len < 1:
        raise ForgeError(f"token windows need {k}samples >= 1 and {k}seq_len >= 1 "
                         f"(got samples={samples}, seq_len={seq_len})")
    ids = _token_ids(tokenizer, text)
    slots = len(ids) // seq_len
    if samples > slots:
        raise ForgeError(f"the text has {len(ids)} tokens: at most {slots} non-overlapping windows of "
                         f"{k}seq_len={seq_len}, but {k}samples={samples} were asked for; lower {k}samples to "
                         f"<= {slots} or {k}seq_len to <= {len(ids) // samples}")
    g = torch.Generator().manual_seed(int(seed))
    chosen = torch.randperm(slots, generator=g)[:samples].sort().values
    return ids[: slots * seq_len].view(slots, seq_len)[chosen].contiguous()
