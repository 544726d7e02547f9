"""`forge serve` when tritonserver dies on its own (out of memory, a crashing backend, `kill -9`): exit 1 with the
server's exit code and log, never 0 as if someone had stopped it."""

from __future__ import annotations

import os
import signal
import subprocess

from serve_helpers import NEEDS_TRITONSERVER, start_forge_serve

pytestmark = NEEDS_TRITONSERVER


def test_a_server_that_dies_on_its_own_is_a_failure(tiny_repo):
    repo_dir = tiny_repo[0] if isinstance(tiny_repo, tuple) else tiny_repo
    p, lines, port = start_forge_serve(repo_dir)
    try:
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
