"""Our GroupQueryAttention engine satisfies ONNX Runtime GenAI's model contract (issue 15, approach (b))."""

import numpy as np
import pytest


def test_genai_config_for_our_gqa_engine(tiny_onnx_dir, tmp_path):
    """Approach (b) of issue 15: GenAI's runtime on our engine needs only a genai_config.json, and GenAI (when
    installed) generates the same greedy tokens as our runtime on the same graph."""
    from bench.peers import genai_config, oga_on_ours
    from pipeline.ort.engine import OrtEngine

    cfg = genai_config(tiny_onnx_dir)
    assert cfg["search"]["past_present_share_buffer"] is True
    assert cfg["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    d = oga_on_ours(tiny_onnx_dir, tmp_path / "oga")
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(d))
    prompt = [5, 17, 99, 3]
    p = og.GeneratorParams(model)
    p.set_search_options(max_length=len(prompt) + 8, batch_size=1, do_sample=False)
    g = og.Generator(model, p)
    g.append_tokens(np.array([prompt], np.int32))
    while not g.is_done():
        g.generate_next_token()
    assert list(g.get_sequence(0))[len(prompt):] == OrtEngine(tiny_onnx_dir, threads=1).generate(prompt, 8)
