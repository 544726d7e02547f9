"""A three-stage flow with no models, to test the cache and runner behaviour in isolation.

Run as a script it builds the flow once: ``python fake_flow.py CACHE_DIR [--set k=v ...]``;
env FAKE_SLOW=seconds makes the middle stage sleep mid-write (for kill/interrupt tests).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pipeline.cache import ArtifactCache
from pipeline.errors import StageFailed
from pipeline.recipe import Recipe
from pipeline.runner import Runner
from pipeline.stages.base import Stage


class Produce(Stage):
    name = "produce"
    tools = ("pyyaml",)

    def config(self, r):
        return {"samples": r.quantize.calibration.samples}

    def run(self, ctx):
        n = ctx.recipe.quantize.calibration.samples
        (ctx.out / "numbers.json").write_text(json.dumps(list(range(n))))
        return {"count": n}


class Transform(Stage):
    name = "transform"
    needs = ("produce",)

    def config(self, r):
        return {"seq_len": r.quantize.calibration.seq_len}

    def run(self, ctx):
        nums = json.loads((ctx.inputs["produce"] / "numbers.json").read_text())
        out = ctx.out / "big.bin"
        with open(out, "wb") as f:
            f.write(b"x" * 1024)
            f.flush()
            slow = float(os.environ.get("FAKE_SLOW", "0"))
            if slow:
                Path(os.environ["FAKE_MARK"]).write_text("started")
                time.sleep(slow)
            f.write(bytes([len(nums) % 256]) * (2 << 20))
        return {"sum": sum(nums) * ctx.recipe.quantize.calibration.seq_len}


class Gate(Stage):
    name = "gate"
    needs = ("transform",)

    def config(self, r):
        return {"thresholds": r.validate_.thresholds.model_dump()}

    def run(self, ctx):
        limit = ctx.recipe.validate_.thresholds.ppl_delta_pct_max
        value = ctx.upstream_metrics["transform"]["sum"]
        if value > limit * 1000:
            raise StageFailed(f"sum {value} above {limit * 1000}", {"sum": value})
        (ctx.out / "ok").write_text("ok")
        return {"passed": True}


def flow():
    return [Produce(), Transform(), Gate()]


def runner(cache_root, overrides: dict | None = None, home=None) -> Runner:
    data = {"name": "fake", "quantize": {"calibration": {"samples": 8, "seq_len": 16}},
            "validate": {"thresholds": {"ppl_delta_pct_max": 100.0}}}
    for k, v in (overrides or {}).items():
        node = data
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    r = Recipe.model_validate(data)
    return Runner(r, ArtifactCache(Path(cache_root)), home=home or Path(cache_root) / "home", stages=flow())


if __name__ == "__main__":
    root = sys.argv[1]
    overrides = {}
    for item in sys.argv[2:]:
        k, v = item.split("=", 1)
        overrides[k] = json.loads(v)
    res = runner(root, overrides).build()
    print(json.dumps([{"name": x.name, "status": x.status, "key": x.key} for x in res]))
