"""Our GroupQueryAttention engine satisfies ONNX Runtime GenAI's model contract (issue 15, approach (b))."""

import numpy as np
import pytest


@pytest.mark.parametrize("graph", ["exported", "built"])
def test_genai_config_for_our_gqa_engine(graph, tiny_onnx_dir, tmp_path):
    """Approach (b) of issue 15: GenAI's runtime on our engine needs only a genai_config.json, and GenAI (when
    installed) generates the same greedy tokens as our runtime on the same graph. ``built``: the build stage's
    graph, whose ``logits_start`` input GenAI does not know and never feeds (pipeline/ort/logits_start.py): it gets
    every position's logits, as from the exported graph."""
    from bench.peers import genai_config, oga_on_ours
    from pipeline.ort.engine import OrtEngine

    d = tiny_onnx_dir
    if graph == "built":
        from pipeline.ort.optimize import optimize
        d = tmp_path / "built"
        assert optimize(tiny_onnx_dir, d, level="extended", threads=1)["fused_norms"]["model.onnx"]["logits_start"]
    cfg = genai_config(d)
    assert cfg["search"]["past_present_share_buffer"] is True
    assert cfg["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    oga = oga_on_ours(d, tmp_path / "oga")
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(oga))
    prompt = [5, 17, 99, 3, 42, 7]
    p = og.GeneratorParams(model)
    p.set_search_options(max_length=len(prompt) + 8, batch_size=1, do_sample=False)
    g = og.Generator(model, p)
    g.append_tokens(np.array([prompt], np.int32))
    while not g.is_done():
        g.generate_next_token()
    assert list(g.get_sequence(0))[len(prompt):] == OrtEngine(d, threads=1).generate(prompt, 8)
