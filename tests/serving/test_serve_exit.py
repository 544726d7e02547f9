"""`forge serve` when tritonserver dies on its own (out of memory, a crashing backend, `kill -9`): exit 1 with the
server's exit code and log, never 0 as if someone had stopped it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipeline.triton.serve import find_tritonserver, free_port

try:
    find_tritonserver()
    _missing = ""
except Exception as e:      # noqa: BLE001 - the serve tests' own skip reason
    _missing = str(e)

pytestmark = [pytest.mark.serve, pytest.mark.skipif(bool(_missing), reason=f"tritonserver missing: {_missing}")]


def test_a_server_that_dies_on_its_own_is_a_failure(tiny_repo):
    repo_dir = tiny_repo[0] if isinstance(tiny_repo, tuple) else tiny_repo
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", str(repo_dir), "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
    try:
        deadline = time.time() + 120
        while not any("Ctrl-C stops it" in x for x in lines):
            assert p.poll() is None, p.stderr.read()
            assert time.time() < deadline, "forge serve never reported the endpoints"
            time.sleep(0.2)
        pids = subprocess.run(["pgrep", "-f", "--", f"--http-port={port}"], capture_output=True, text=True).stdout.split()
        server = [int(x) for x in pids if int(x) != p.pid]
        assert server, "no tritonserver process found"
        for pid in server:
            os.kill(pid, signal.SIGKILL)
        p.wait(timeout=60)
        err = " ".join(p.stderr.read().split())
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, err
    assert "tritonserver exited on its own (exit code -9)" in err and "Traceback" not in err, err
