"""A real tritonserver (from the nvidia-pytriton wheel) serving the tiny onnxruntime-target repository."""

import concurrent.futures as cf
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from serve_helpers import NEEDS_TRITONSERVER, prompt, start_forge_serve
from tiny_engine import expected_tokens
from pipeline.errors import ForgeError
from pipeline.triton import serve as serve_mod
from pipeline.triton.serve import TritonServer, find_tritonserver, port_in_use

pytestmark = NEEDS_TRITONSERVER


def post_json(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _listing(repo):
    return sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*"))


@pytest.fixture(scope="module")
def server(tiny_repo):
    repo, _ = tiny_repo
    before = _listing(repo)
    srv = TritonServer(repo)
    with srv:
        assert srv.alive()
        yield srv
    assert not srv.alive()
    # serving writes nothing into the (content-addressed) repository: no __pycache__ next to model.py
    assert _listing(repo) == before
    # after the context: the process and its ports are gone
    assert srv.proc is None
    for p in (srv.http_port, srv.grpc_port, srv.metrics_port):
        assert not port_in_use(p), f"port {p} still bound after stop"


def test_loads_servable_models(server):
    assert server.loaded == ["bls", "ensemble", "onnxruntime_llm", "postprocessing", "preprocessing"]
    assert server.skipped == ["llm_graph"]  # backend "onnxruntime" is not in the wheel's server


def test_generate_endpoint(server):
    ids = [1, 2, 5]
    r = post_json(f"{server.url}/v2/models/ensemble/generate", {"text_input": prompt(ids), "max_tokens": 6})
    want = expected_tokens(ids, 6)
    assert r["output_ids"] == want == [38, 13, 30, 21, 22, 29]
    assert r["text_output"] == prompt(want)


def test_generate_stops_at_eos(server):
    # next_token(36) == 63 == eos: generation ends there
    r = post_json(f"{server.url}/v2/models/ensemble/generate", {"text_input": prompt([36]), "max_tokens": 10})
    assert r["output_ids"] == 63  # the generate extension returns a 1-element array as a scalar
    # an explicit end_id overrides the tokenizer's eos: 63 is then an ordinary token
    r = post_json(f"{server.url}/v2/models/ensemble/generate", {"text_input": prompt([36]), "max_tokens": 3, "end_id": 5})
    assert r["output_ids"] == expected_tokens([36], 3, eos=5) == [63, 60, 39]


def _kserve_http(url, text, n):
    import tritonclient.http as http

    c = http.InferenceServerClient(url.removeprefix("http://"))
    t = http.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    m = http.InferInput("max_tokens", [1, 1], "INT32")
    m.set_data_from_numpy(np.array([[n]], dtype=np.int32))
    r = c.infer("ensemble", [t, m])
    return r.as_numpy("output_ids")[0, 0].tolist(), r.as_numpy("text_output")[0, 0].decode()


def test_kserve_infer_http_and_grpc(server):
    import tritonclient.grpc as grpc

    ids = [4, 9]
    want = expected_tokens(ids, 5)
    got_ids, got_text = _kserve_http(server.url, prompt(ids), 5)
    assert got_ids == want and got_text == prompt(want)

    c = grpc.InferenceServerClient(server.grpc_url)
    t = grpc.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[prompt(ids).encode()]], dtype=object))
    m = grpc.InferInput("max_tokens", [1, 1], "INT32")
    m.set_data_from_numpy(np.array([[5]], dtype=np.int32))
    r = c.infer("ensemble", [t, m])
    assert r.as_numpy("output_ids")[0, 0].tolist() == want
    assert c.get_model_config("onnxruntime_llm").config.backend == "python"


def test_eight_concurrent_requests(server):
    prompts = [[i, (3 * i + 1) % 60] for i in range(8)]
    lengths = [3 + i for i in range(8)]
    with cf.ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(_kserve_http, server.url, prompt(p), n) for p, n in zip(prompts, lengths)]
        results = [f.result(timeout=120) for f in futs]
    for (got, text), p, n in zip(results, prompts, lengths):
        assert got == expected_tokens(p, n)
        assert text == prompt(got)


def test_bls_same_answer(server):
    ids = [7, 8]
    r = post_json(f"{server.url}/v2/models/bls/generate", {"text_input": prompt(ids), "max_tokens": 4})
    assert r["output_ids"] == expected_tokens(ids, 4)


def test_bad_request_is_an_error_not_a_crash(server):
    with pytest.raises(urllib.error.HTTPError) as e:
        post_json(f"{server.url}/v2/models/ensemble/generate", {"text_input": prompt([1]), "max_tokens": 0})
    assert "max_tokens must be in" in e.value.read().decode()
    # the server still answers
    assert post_json(f"{server.url}/v2/models/ensemble/generate", {"text_input": prompt([1]), "max_tokens": 1})["output_ids"] == 10


def test_start_failure_shows_log(tmp_path, tiny_repo):
    import shutil

    repo, _ = tiny_repo
    bad = tmp_path / "repo"
    shutil.copytree(repo, bad)
    (bad / "preprocessing" / "1" / "model.py").write_text("raise RuntimeError('boom at import')\n")
    srv = TritonServer(bad, ready_timeout_s=60)
    with pytest.raises(ForgeError, match="(?s)tritonserver.*boom at import"):
        srv.start()
    assert srv.proc is None
    assert not port_in_use(srv.http_port)


def test_missing_binary_message(monkeypatch):
    monkeypatch.setattr(serve_mod, "_pytriton_root", lambda: None)
    monkeypatch.delenv("FORGE_TRITONSERVER", raising=False)
    with pytest.raises(ForgeError, match=r"pip install --no-deps nvidia-pytriton==0.7.0"):
        find_tritonserver()


def test_busy_port_refused(tiny_repo):
    import socket

    repo, _ = tiny_repo
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ForgeError, match=f"port {s.getsockname()[1]} on 127.0.0.1 is in use"):
            TritonServer(repo, http_port=s.getsockname()[1]).start()


def test_forge_serve_cli_stops_cleanly_on_sigterm(tiny_repo):
    """`forge serve REPO`: endpoints up, then SIGTERM (as from `kill` / `docker stop`) stops the server and frees the port."""
    import signal
    import urllib.request

    repo_dir = tiny_repo[0] if isinstance(tiny_repo, tuple) else tiny_repo
    p, lines, port = start_forge_serve(repo_dir)
    try:
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5).status == 200
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        err = p.stderr.read()
        out = "".join(lines)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err        # interrupted, like every command (README); the server is stopped
    assert f"http://127.0.0.1:{port}" in out and "tritonserver stopped" in err
    assert not any(port_in_use(q) for q in (port, port + 1, port + 2))


def test_interrupt_while_starting_leaves_no_server(tiny_repo, monkeypatch):
    """Ctrl-C / SIGTERM during start-up: the half-started tritonserver is stopped, its ports freed."""
    from pipeline.triton.serve import free_port

    repo_dir = tiny_repo[0] if isinstance(tiny_repo, tuple) else tiny_repo
    port = free_port()
    srv = TritonServer(repo_dir, http_port=port, grpc_port=free_port(), metrics_port=free_port())

    def interrupted(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(TritonServer, "_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        srv.start()
    assert srv.proc is None
    assert not any(port_in_use(q) for q in (srv.http_port, srv.grpc_port, srv.metrics_port))
