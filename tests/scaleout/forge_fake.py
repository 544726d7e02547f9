"""``python forge_fake.py ARGS...``: the real ``forge`` CLI with the fake stages of fake_stages.py as every recipe's
flow (a recipe whose build.target is not onnxruntime gets the extra sm90 stage; tensorrt_llm also a package stage). Environment hooks for the failure tests:

FORGE_TEST_PAUSE_UPLOAD=path: after uploading the first payload file of an entry, write ``path`` and sleep
    (the test kills the publisher there: uploaded objects, no record).
FORGE_TEST_BARRIER=dir:n: before creating an entry record, wait until ``n`` processes have reached this point
    (two publishers of one key race for the conditional create).
FORGE_TEST_RAY_LOST=message: ``--executor ray`` "connects" to no cluster and the run then raises ForgeError(message)
    (a cluster lost after the driver joined it).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fake_stages  # noqa: E402
import pipeline.runner  # noqa: E402
from pipeline import remote_cache  # noqa: E402

pipeline.runner.flow_for = lambda target: fake_stages.flow(sm90=target != "onnxruntime",
                                                           package=target == "tensorrt_llm")

pause = os.environ.get("FORGE_TEST_PAUSE_UPLOAD")
barrier = os.environ.get("FORGE_TEST_BARRIER")
if pause or barrier:
    Store = remote_cache.RemoteStore
    fs_prop = Store.fs

    class _Fs:
        """The store's filesystem with a pause after the first uploaded file or a barrier before the record."""

        def __init__(self, fs):
            self._fs = fs

        def __getattr__(self, name):
            return getattr(self._fs, name)

        def put(self, lpaths, rpaths, **kw):
            if pause and len(lpaths) > 1:
                self._fs.put(lpaths[:1], rpaths[:1], **kw)
                Path(pause).write_text(str(os.getpid()))
                time.sleep(120)
            return self._fs.put(lpaths, rpaths, **kw)

        def pipe_file(self, path, data, mode="overwrite", **kw):
            if barrier and mode == "create":
                root, n = barrier.rsplit(":", 1)
                d = Path(root, Path(path).name)          # one barrier per record
                d.mkdir(parents=True, exist_ok=True)
                (d / str(os.getpid())).write_text("here")
                t0 = time.time()
                while len(list(d.iterdir())) < int(n) and time.time() - t0 < 60:
                    time.sleep(0.02)
            return self._fs.pipe_file(path, data, mode=mode, **kw)

    Store.fs = property(lambda self: _Fs(fs_prop.fget(self)))

lost = os.environ.get("FORGE_TEST_RAY_LOST")
if lost:
    from pipeline import ray_executor
    from pipeline.errors import ForgeError

    class _LostBuild:
        nodes: list = []

        def __init__(self, runners, *a, **kw):
            self.cache = runners[0].cache

        def run(self):
            raise ForgeError(lost)

    ray_executor.connect = lambda address: "fake-cluster:6379"
    ray_executor.RayBuild = _LostBuild

from pipeline import cli  # noqa: E402

sys.argv = ["forge", *sys.argv[1:]]
cli.main()
