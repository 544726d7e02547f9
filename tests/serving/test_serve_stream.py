"""Issue 28: the onnxruntime-target repository written with ``package.triton.decoupled: true`` streams in the
real tritonserver: /generate_stream and gRPC streaming send one response per new token (then a final one), and
the streamed tokens are the non-streamed greedy answer."""

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from serve_helpers import NEEDS_TRITONSERVER, grpc_inputs, prompt
from tiny_engine import expected_tokens
from pipeline.triton.serve import TritonServer, front_models

pytestmark = NEEDS_TRITONSERVER


def as_list(v):
    return v if isinstance(v, list) else [v]   # the generate extension returns a 1-element array as a scalar


def post(url, body):
    """(HTTP status, body) of one POST; /generate_stream answers server-sent events."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def events(raw):
    return [json.loads(line[len(b"data: "):]) for line in raw.splitlines() if line.startswith(b"data: ")]


@pytest.fixture(scope="module")
def server(tiny_repo_decoupled):
    with TritonServer(tiny_repo_decoupled[0]) as srv:
        yield srv


@pytest.mark.parametrize("front", ["bls", "ensemble"])
def test_generate_stream_sends_each_token(server, front):
    ids = [1, 2, 5]
    want = expected_tokens(ids, 6)
    code, raw = post(f"{server.url}/v2/models/{front}/generate_stream",
                     {"text_input": prompt(ids), "max_tokens": 6, "stream": True})
    assert code == 200, raw
    got = events(raw)
    assert len(got) > 1 and not any("error" in e for e in got), got
    streamed = [t for e in got for t in as_list(e["output_ids"])]
    code, one = post(f"{server.url}/v2/models/{front}/generate", {"text_input": prompt(ids), "max_tokens": 6})
    answer = json.loads(one)
    assert code == 200 and streamed == as_list(answer["output_ids"]) == want
    # each event's text is its token's ("w38", ...); the tiny tokenizer's decoder joins words with spaces
    assert " ".join(e["text_output"] for e in got) == answer["text_output"] == prompt(want)


@pytest.mark.parametrize("front", ["bls", "ensemble"])
def test_grpc_stream_ends_with_a_final_response(server, front):
    import tritonclient.grpc as grpc

    ids = [4, 9]
    inputs = []
    for name, dt, a in (("text_input", "BYTES", np.array([[prompt(ids).encode()]], dtype=object)),
                        ("max_tokens", "INT32", np.array([[5]], np.int32)), ("stream", "BOOL", np.array([[True]]))):
        t = grpc.InferInput(name, list(a.shape), dt)
        t.set_data_from_numpy(a)
        inputs.append(t)
    got = []
    c = grpc.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.append((result, error)))
    try:
        c.async_stream_infer(front, inputs, request_id="s", enable_empty_final_response=True)
    finally:
        c.stop_stream()    # waits for the responses in flight
    assert [e for _, e in got] == [None] * len(got)
    final = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in got]
    assert len(got) > 2 and final == [False] * (len(got) - 1) + [True]
    # the BLS's final response is empty; Triton's ensemble may put the final flag on the last token's response
    tokens = [t for r, _ in got if r.as_numpy("output_ids") is not None for t in r.as_numpy("output_ids").reshape(-1).tolist()]
    assert tokens == expected_tokens(ids, 5)
    assert front != "bls" or got[-1][0].as_numpy("output_ids") is None


def test_stream_of_two_prompts_is_refused_and_served_without(server):
    import tritonclient.grpc as grpc

    got = []
    c = grpc.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.append((result, error)))
    try:
        c.async_stream_infer("ensemble", grpc_inputs([prompt([1, 2]), prompt([7])], 3, False), request_id="two")
        c.async_stream_infer("ensemble", grpc_inputs([prompt([1, 2]), prompt([7])], 3, True), request_id="two-stream")
    finally:
        c.stop_stream()
    results = {r.get_response().id: r for r, e in got if e is None}
    errors = [str(e) for r, e in got if e is not None]
    ids = results["two"].as_numpy("output_ids")
    assert ids[0, 0].tolist() == expected_tokens([1, 2], 3) and ids[1, 0].tolist() == expected_tokens([7], 3)
    assert any("streaming=true takes one row per request" in e for e in errors), errors
    assert front_models(server.repo_dir) == {"bls": True, "ensemble": True}
