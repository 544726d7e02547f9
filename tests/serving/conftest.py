import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import tiny_engine  # noqa: E402
from tiny_engine import EOS, WORDS  # noqa: E402


def make_graph(path: str) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.full((tiny_engine.VOCAB, tiny_engine.VOCAB), -5.0, np.float32)
    for t in range(tiny_engine.VOCAB):
        w[t, tiny_engine.next_token(t)] = 5.0
    graph = helper.make_graph(
        [helper.make_node("Gather", ["W", "input_ids"], ["logits"], axis=0)], "tiny_lm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", tiny_engine.VOCAB])],
        [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)

def make_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins word tokens with spaces
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    engine = root / "engine"
    engine.mkdir()
    make_graph(str(engine / "model.onnx"))
    (engine / "engine.json").write_text(json.dumps({"kind": "test-only tiny graph"}))
    make_tokenizer(root / "tokenizer")
    return {"engine_dir": engine, "tokenizer_dir": root / "tokenizer", "engine_module": HERE / "tiny_engine.py"}


@pytest.fixture(scope="session")
def tiny_repo(tiny_artifacts, tmp_path_factory):
    from pipeline.triton.repo_onnxruntime import write_onnxruntime_repo

    out = tmp_path_factory.mktemp("repo") / "triton"
    recipe = {"package": {"triton": {"max_batch_size": 8, "instance_count": 1}}, "build": {"onnxruntime": {"intra_op_threads": 1}}}
    summary = write_onnxruntime_repo(out, engine_dir=tiny_artifacts["engine_dir"], tokenizer_dir=tiny_artifacts["tokenizer_dir"],
                                     recipe=recipe, metrics={"greedy_match": 1.0},
                                     engine_module=tiny_artifacts["engine_module"])
    return out, summary


@pytest.fixture(scope="session")
def tiny_repo_decoupled(tiny_artifacts, tmp_path_factory):
    """The tiny repository written with package.triton.decoupled: true (streaming)."""
    from pipeline.triton.repo_onnxruntime import write_onnxruntime_repo

    out = tmp_path_factory.mktemp("repo-decoupled") / "triton"
    recipe = {"package": {"triton": {"max_batch_size": 8, "instance_count": 1, "decoupled": True}},
              "build": {"onnxruntime": {"intra_op_threads": 1}}}
    summary = write_onnxruntime_repo(out, engine_dir=tiny_artifacts["engine_dir"], tokenizer_dir=tiny_artifacts["tokenizer_dir"],
                                     recipe=recipe, metrics={"greedy_match": 1.0},
                                     engine_module=tiny_artifacts["engine_module"])
    return out, summary
