"""The build stage's ``logits_start`` input (pipeline/ort/logits_start.py): a prompt that reads its rows' last
positions asks the lm_head for those only; a caller that does not feed it gets every position, as before (ONNX
Runtime GenAI on the built graph: tests/ort/test_genai_contract.py)."""

import numpy as np
import onnx
import pytest

from pipeline.ort.engine import LOGITS_START, OrtEngine, inference_session, session_options
from pipeline.ort.logits_start import add_logits_start
from pipeline.ort.optimize import optimize


@pytest.fixture(scope="module")
def built(tiny_onnx_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("built")
    m = optimize(tiny_onnx_dir, out, level="extended", threads=1)
    assert m["fused_norms"]["model.onnx"]["logits_start"] is True
    return out


def test_the_input_is_optional_and_every_position_comes_without_it(built, tiny_onnx_dir):
    g = onnx.load(str(built / "model.onnx"), load_external_data=False).graph
    assert LOGITS_START in {i.name for i in g.input} and LOGITS_START in {i.name for i in g.initializer}
    eng = OrtEngine(built, threads=1)
    ids = np.random.default_rng(0).integers(3, 256, (2, 11))
    full = eng.logits(ids)
    assert full.shape[:2] == (2, 11)
    np.testing.assert_allclose(full, OrtEngine(tiny_onnx_dir, threads=1).logits(ids), atol=1e-3)
    # a session fed without it (ONNX Runtime GenAI, any other caller): every position
    sess = inference_session(str(built / "model.onnx"), session_options(1, "disable"), ["CPUExecutionProvider"])
    feeds = {i.name: np.zeros([d if isinstance(d, int) else 2 if "batch" in str(d) else 0 for d in i.shape],
                              np.float32) for i in sess.get_inputs() if i.name.startswith("past_key_values")}
    feeds.update(input_ids=ids, attention_mask=np.ones((2, 11), np.int64))
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}
    assert sess.run(["logits"], feeds)[0].shape[:2] == (2, 11)
    # fed, the logits start there: the lm_head ran for those positions only
    got = sess.run(["logits"], {**feeds, LOGITS_START: np.array([8], np.int64)})[0]
    assert got.shape[:2] == (2, 3)
    np.testing.assert_allclose(got, full[:, 8:], atol=1e-4)


def test_a_prompt_computes_the_last_positions_and_gives_the_same_rows(built):
    """Ragged rows (right padding): the slice starts at the shortest row's last position; each row's last logits
    are the ones a full call gives; generation after it is unchanged (the decode steps rebind 0)."""
    eng = OrtEngine(built, threads=1)
    assert eng._sliced == {id(eng.session)}          # the engine found the input and feeds it
    rows = [np.random.default_rng(s).integers(3, 256, n) for s, n in ((1, 6), (2, 13), (3, 9))]
    batch, lens = np.zeros((3, 13), np.int64), np.array([len(r) for r in rows])
    for i, r in enumerate(rows):
        batch[i, :len(r)] = r
    last = eng.forward(batch, lens, eng.cache(3, 13), last_only=True)
    full = eng.forward(batch, lens, eng.cache(3, 13))
    assert last.shape == (3, full.shape[-1])
    np.testing.assert_allclose(last, full[np.arange(3), lens - 1], rtol=1e-5, atol=1e-5)
    for r in rows:
        np.testing.assert_allclose(eng.prefill(r[None])[0], eng.logits(r[None])[0, -1], rtol=1e-5, atol=1e-5)
    plain = OrtEngine(built, threads=1)
    plain._sliced = set()          # the same graph, never fed: every position, as before this input existed
    for r in rows:
        assert eng.generate(r, max_new_tokens=6, greedy=True) == plain.generate(r, max_new_tokens=6, greedy=True)


def test_added_once_and_only_where_the_lm_head_path_is_alone(built, tiny_onnx_dir):
    m = onnx.load(str(built / "model.onnx"), load_external_data=False)
    assert add_logits_start(m) is False                      # already there
    raw = onnx.load(str(tiny_onnx_dir / "model.onnx"), load_external_data=False)
    assert add_logits_start(raw) is False                    # unfused norms: no final norm node to slice after

