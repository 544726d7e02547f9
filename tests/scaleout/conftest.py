"""Fixtures of the scale-out tests (servers.py starts and stops the servers)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from servers import REPO, Shared, ray_cluster, seaweedfs  # noqa: E402


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    try:
        with seaweedfs(tmp_path_factory.mktemp("weed")) as server:
            server.bucket = server.new_bucket("forge-tests")
            yield server
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture
def shared(s3_server, tmp_path) -> Shared:
    """A fresh prefix in the test bucket and helpers for "machines" that share it."""
    return Shared(s3_server, s3_server.bucket, f"t-{uuid.uuid4().hex[:12]}", tmp_path)
