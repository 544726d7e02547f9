"""forge's generated TensorRT-LLM repository in the real tritonserver (nvidia-pytriton's), with the C++
``tensorrt_llm`` model replaced by a decoupled python-backend stand-in (tests/serving/trtllm_standin.py, a
test fixture, not an engine) that enforces the backend's contract. The ensemble, preprocessing,
postprocessing and BLS models are the generated ones, unchanged.

What this catches: a BLS call ``exec(decoupled=False)`` into the decoupled engine (python_backend refuses
it), a ``tensorrt_llm`` config without the parameters the backend requires (the stand-in refuses to load),
and the endpoints each front model really serves.
"""

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from serve_helpers import NEEDS_TRITONSERVER, grpc_inputs, prompt
from tiny_engine import EOS, WORDS, expected_tokens
from pipeline.errors import ForgeError
from pipeline.triton.pbtxt import parse_config, to_pbtxt, write_config
from pipeline.triton.repo_trtllm import write_trtllm_repo
from pipeline.triton.serve import TritonServer, endpoints, front_models

HERE = Path(__file__).parent

pytestmark = NEEDS_TRITONSERVER

ENGINE_CFG = {  # the keys of a trtllm-build config.json that forge reads; tp 1
    "pretrained_config": {"architecture": "LlamaForCausalLM", "logits_dtype": "float16",
                          "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}},
    "build_config": {"max_batch_size": 8, "max_beam_width": 1, "max_seq_len": 256, "kv_cache_type": "PAGED",
                     "gather_context_logits": True,
                     "plugin_config": {"context_fmha": True, "use_paged_context_fmha": True}},
}

# Negative control: a non-decoupled python model that calls tensorrt_llm the way forge's BLS did before
# (exec() without decoupled=True). python_backend must refuse it.
CALLER_CONFIG = {"name": "caller_without_decoupled", "backend": "python", "max_batch_size": 0,
                 "input": [{"name": "input_ids", "data_type": "TYPE_INT32", "dims": [-1]}],
                 "output": [{"name": "output_ids", "data_type": "TYPE_INT32", "dims": [-1]}],
                 "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}
CALLER_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            ids = pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy().reshape(1, -1)
            req = pb_utils.InferenceRequest(
                model_name="tensorrt_llm", requested_output_names=["output_ids", "sequence_length"],
                inputs=[pb_utils.Tensor("input_ids", ids.astype(np.int32)),
                        pb_utils.Tensor("input_lengths", np.array([[ids.shape[1]]], np.int32)),
                        pb_utils.Tensor("request_output_len", np.array([[2]], np.int32))])
            try:
                res = req.exec()
                err = res.error().message() if res.has_error() else None
            except Exception as e:
                err = str(e)
            if err:
                out.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(err)))
            else:
                ids = pb_utils.get_output_tensor_by_name(res, "output_ids").as_numpy().reshape(-1)
                out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("output_ids", ids)]))
        return out
'''


def standin_repo(root: Path, tokenizer_dir: Path) -> Path:
    """The generated decoupled repository with ``tensorrt_llm`` served by the stand-in."""
    eng = root / "engine"
    eng.mkdir(parents=True)
    (eng / "config.json").write_text(json.dumps(ENGINE_CFG))
    (eng / "rank0.engine").write_bytes(b"test fixture: not an engine")
    repo = root / "repo"
    write_trtllm_repo(repo, engine_dir=eng, tokenizer_dir=tokenizer_dir, engine_config=ENGINE_CFG,
                      triton={"max_batch_size": 8, "decoupled": True, "enable_kv_cache_reuse": False})
    cfg_path = repo / "tensorrt_llm" / "config.pbtxt"
    cfg = parse_config(cfg_path)
    assert cfg.backend == "tensorrtllm"
    cfg.backend = "python"          # the only change to the generated config
    cfg_path.write_text(to_pbtxt(cfg))
    shutil.copy2(HERE / "trtllm_standin.py", repo / "tensorrt_llm" / "1" / "model.py")
    shutil.copy2(HERE / "trtllm_backend_contract.py", repo / "tensorrt_llm" / "1" / "trtllm_backend_contract.py")
    write_config(repo / CALLER_CONFIG["name"], CALLER_CONFIG)
    (repo / CALLER_CONFIG["name"] / "1").mkdir()
    (repo / CALLER_CONFIG["name"] / "1" / "model.py").write_text(CALLER_MODEL)
    return repo


@pytest.fixture(scope="module")
def server(tiny_artifacts, tmp_path_factory):
    repo = standin_repo(tmp_path_factory.mktemp("standin"), tiny_artifacts["tokenizer_dir"])
    with TritonServer(repo) as srv:
        yield srv


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def stream(url, body):
    """Server-sent events of /generate_stream, as the list of their JSON payloads."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(line[len(b"data: "):]) for line in r.read().splitlines() if line.startswith(b"data: ")]
    for e in events:
        assert "error" not in e, e
    return events


def as_list(v):
    return v if isinstance(v, list) else [v]   # the generate extension returns a 1-element array as a scalar


def test_all_models_load(server):
    assert server.loaded == ["caller_without_decoupled", "ensemble", "postprocessing", "preprocessing",
                             "tensorrt_llm", "tensorrt_llm_bls"]
    assert server.skipped == []


@pytest.mark.parametrize("front", ["tensorrt_llm_bls", "ensemble"])
def test_non_streaming_generate(server, front):
    ids = [1, 2, 5]
    r = post(f"{server.url}/v2/models/{front}/generate", {"text_input": prompt(ids), "max_tokens": 6})
    want = expected_tokens(ids, 6)
    assert as_list(r["output_ids"]) == want == [38, 13, 30, 21, 22, 29]
    assert r["text_output"] == prompt(want)


def test_non_streaming_stops_at_end_id(server):
    # next_token(36) == 63 == the tokenizer's eos: one token, then the stand-in stops, as the executor does
    r = post(f"{server.url}/v2/models/tensorrt_llm_bls/generate", {"text_input": prompt([36]), "max_tokens": 10})
    assert as_list(r["output_ids"]) == [EOS]


@pytest.mark.parametrize("front", ["tensorrt_llm_bls", "ensemble"])
def test_streaming_sends_one_event_per_token(server, front):
    ids = [4, 9]
    want = expected_tokens(ids, 5)
    events = stream(f"{server.url}/v2/models/{front}/generate_stream",
                    {"text_input": prompt(ids), "max_tokens": 5, "stream": True})
    assert [as_list(e["output_ids"]) for e in events] == [[t] for t in want]
    assert [e["text_output"] for e in events] == [WORDS[t] for t in want]


def test_bls_refuses_stream_of_two_prompts_but_answers_two_without(server):
    import tritonclient.grpc as grpc

    got = []
    c = grpc.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.append((result, error)))
    try:
        c.async_stream_infer("tensorrt_llm_bls", grpc_inputs([prompt([1, 2]), prompt([7])], 3, False), request_id="two")
        c.async_stream_infer("tensorrt_llm_bls", grpc_inputs([prompt([1, 2]), prompt([7])], 3, True), request_id="two-stream")
    finally:
        c.stop_stream()    # waits for the responses in flight
    results = {r.get_response().id: r for r, e in got if e is None}
    errors = [str(e) for r, e in got if e is not None]
    ids = results["two"].as_numpy("output_ids")
    assert ids[0, 0].tolist() == expected_tokens([1, 2], 3)
    assert ids[1, 0, :3].tolist() == expected_tokens([7], 3)
    assert any("stream=true takes one text_input per request" in e for e in errors), errors


def test_decoupled_front_models_refuse_kserve_infer(server):
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    c = http.InferenceServerClient(server.url.removeprefix("http://"))
    t = http.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[prompt([1]).encode()]], dtype=object))
    m = http.InferInput("max_tokens", [1, 1], "INT32")
    m.set_data_from_numpy(np.array([[2]], np.int32))
    for model in ("ensemble", "tensorrt_llm_bls"):
        with pytest.raises(InferenceServerException, match="decoupled"):
            c.infer(model, [t, m])
    # and forge serve says so
    assert front_models(Path(server.repo_dir)) == {"ensemble": True, "tensorrt_llm_bls": True}
    lines = "\n".join(endpoints(server.repo_dir, server.url, server.grpc_url))
    assert f"{server.url}/v2/models/ensemble/generate_stream" in lines
    assert f"not served: {server.url}/v2/models/ensemble/infer" in lines


def test_python_backend_refuses_non_decoupled_exec(server):
    """The bug the issue found: BLS exec(decoupled=False) into the decoupled tensorrt_llm fails."""
    with pytest.raises(urllib.error.HTTPError) as e:
        post(f"{server.url}/v2/models/caller_without_decoupled/generate", {"input_ids": [1, 2]})
    assert "decoupled=True" in e.value.read().decode()


def test_standin_refuses_config_without_required_parameters(tiny_artifacts, tmp_path):
    """The stand-in fails to load like the C++ backend when a required parameter is missing."""
    repo = standin_repo(tmp_path, tiny_artifacts["tokenizer_dir"])
    cfg_path = repo / "tensorrt_llm" / "config.pbtxt"
    cfg = parse_config(cfg_path)
    del cfg.parameters["guided_decoding_backend"]
    cfg_path.write_text(to_pbtxt(cfg))
    for name in ("ensemble", "tensorrt_llm_bls", "caller_without_decoupled"):   # keep the load small
        shutil.rmtree(repo / name)
    with pytest.raises(ForgeError, match="guided_decoding_backend: missing"):
        TritonServer(repo, ready_timeout_s=90).start()
