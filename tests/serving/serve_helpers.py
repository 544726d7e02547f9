"""What the real-tritonserver tests share: the skip when no tritonserver is installed, the tiny engine's prompt
text, gRPC inputs of the generate contract, and `forge serve` started as a user starts it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tiny_engine import WORDS
from pipeline.triton.serve import find_tritonserver, free_port

try:
    find_tritonserver()
    SERVER_MISSING = ""
except Exception as e:      # noqa: BLE001 - the skip reason says what is missing
    SERVER_MISSING = str(e) or "pip install --no-deps nvidia-pytriton==0.7.0"

# every module that starts a real tritonserver: `pytestmark = NEEDS_TRITONSERVER`
NEEDS_TRITONSERVER = [pytest.mark.serve,
                      pytest.mark.skipif(bool(SERVER_MISSING), reason=f"tritonserver missing: {SERVER_MISSING}")]


def prompt(ids) -> str:
    """The tiny engine's text for token ids."""
    return " ".join(WORDS[i] for i in ids)


def grpc_inputs(texts: list[str], max_tokens: int, stream: bool) -> list:
    """tritonclient gRPC inputs of the generate contract: one row per text."""
    import tritonclient.grpc as grpc

    out = []
    for name, dt, a in (("text_input", "BYTES", np.array([[t.encode()] for t in texts], dtype=object)),
                        ("max_tokens", "INT32", np.full((len(texts), 1), max_tokens, np.int32)),
                        ("stream", "BOOL", np.full((len(texts), 1), stream))):
        t = grpc.InferInput(name, list(a.shape), dt)
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def start_forge_serve(repo_dir, timeout_s: float = 120) -> tuple[subprocess.Popen, list[str], int]:
    """`forge serve REPO --port P` in its own process, returned once it says the endpoints are up
    ("Ctrl-C stops it"): (the process, its stdout lines so far and to come, P)."""
    port = free_port(3)     # forge serve takes P, P+1, P+2
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", str(repo_dir), "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
    deadline = time.time() + timeout_s
    while not any("Ctrl-C stops it" in x for x in lines):
        if p.poll() is not None:
            raise AssertionError(f"forge serve exited {p.returncode}: {p.stderr.read()}")
        if time.time() > deadline:
            p.kill()
            raise AssertionError("forge serve never reported the endpoints")
        time.sleep(0.2)
    return p, lines, port
