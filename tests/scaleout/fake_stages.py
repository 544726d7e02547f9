"""Fast stages without models for the shared-cache and Ray tests (importable by Ray workers: the test cluster's
nodes have this directory on PYTHONPATH).

Knobs come from the recipe's free ``quantize.options`` (so they enter the stage keys like any config):
``sleep`` (seconds the transform stage takes), ``crash_once`` (a marker path: the transform stage's first attempt
writes its pid there and waits to be killed), ``size_kb`` (transform payload size), ``salt`` (nondeterministic
bytes: each run writes different ones, to tell a loser's payload from the winner's), ``isa`` (the gate stage is
keyed by the CPU's ISA class, as ONNX Runtime's build/evaluate are), ``carry`` (the transform stage carries
produce's numbers.json in its payload, as export carries the source's tokenizer: one blob in the bucket that both
entries name). ``flow(sm90=True)`` adds a stage bound to GPU
architecture ``sm`` (default 90) that needs the custom Ray resource ``sm_90`` (forge_fake.py gives it to recipes
whose build.target is not onnxruntime); ``flow(package=True)`` a package stage that hands off (tensorrt_llm).

FORGE_TEST_ISA_CLASS emulates the CPU's ISA class in this process (a driver, or a Ray node started with it).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict

import dataclasses

from pipeline import targets
from pipeline.hardware import Hardware
from pipeline.stages.base import Stage, cpu_isa_hardware


class FakeKnobs(BaseModel):
    """The knobs above ride in quantize.options, which forge's schema (each target's quantizers, pipeline/targets) closes for algo
    none; with these fake flows any knob is accepted there (here and in every Ray worker that imports this)."""
    model_config = ConfigDict(extra="allow")


if os.environ.get("FORGE_TEST_ISA_CLASS"):
    import pipeline.host.cpu
    pipeline.host.cpu.cpu_isa_class = lambda: os.environ["FORGE_TEST_ISA_CLASS"]

for _t in targets.all_targets():
    targets.register(dataclasses.replace(_t, quantizers={**_t.quantizers, "none": targets.Quantizer(FakeKnobs)}))


def _opt(r, name, default=None):
    return (r.quantize.options or {}).get(name, default)


def _where() -> dict:
    node = ""
    try:
        import ray
        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return {"pid": os.getpid(), "host": socket.gethostname(), "node_id": node}


class Produce(Stage):
    name = "produce"

    def config(self, r):
        return {"samples": r.quantize.calibration.samples}

    def run(self, ctx):
        n = ctx.recipe.quantize.calibration.samples
        (ctx.out / "numbers.json").write_text(json.dumps(list(range(n))))
        return {"count": n, **_where()}


class Transform(Stage):
    name = "transform"
    needs = ("produce",)

    def config(self, r):
        return {"options": r.quantize.options}

    def run(self, ctx):
        r = ctx.recipe
        t0 = time.time()
        crash = _opt(r, "crash_once")
        if crash and not Path(crash).exists():
            Path(crash).write_text(str(os.getpid()))      # the test kills this process now
            time.sleep(120)
        nums = json.loads((ctx.inputs["produce"] / "numbers.json").read_text())
        (ctx.out / "sub").mkdir()
        (ctx.out / "sub" / "big.bin").write_bytes(bytes([len(nums) % 256]) * (int(_opt(r, "size_kb", 512)) * 1024))
        (ctx.out / "empty.txt").write_bytes(b"")
        if _opt(r, "carry"):
            (ctx.out / "numbers.json").write_bytes((ctx.inputs["produce"] / "numbers.json").read_bytes())
        if _opt(r, "salt"):
            (ctx.out / "salt.txt").write_text(uuid.uuid4().hex)
        time.sleep(float(_opt(r, "sleep", 0)))
        return {"sum": sum(nums), "started": t0, "ended": time.time(), **_where()}


class Gate(Stage):
    name = "gate"
    needs = ("transform",)

    def hardware(self, r):
        return cpu_isa_hardware() if _opt(r, "isa") else super().hardware(r)

    def run(self, ctx):
        from pipeline.host.cpu import cpu_isa_class
        (ctx.out / "ok").write_text("ok")
        (ctx.out / "model" / "1").mkdir(parents=True)     # an empty folder, as Triton's ensemble/1/
        return {"passed": True, "isa_class": cpu_isa_class(), **_where()}


class GpuArch(Stage):
    """Output bound to a GPU architecture (option ``sm``, default 90): on the test cluster only a node advertising
    ``sm_<sm>`` runs it (no GPU is asked for: the test machines have none)."""
    name = "engine"
    needs = ("gate",)

    def hardware(self, r):
        return Hardware.gpu_arch(int(_opt(r, "sm", 90)), "quantize.options.sm")

    def gpus(self, r):
        return 0

    def run(self, ctx):
        (ctx.out / "engine.bin").write_bytes(self.hardware(ctx.recipe).encode() * 64)
        return _where()


class Package(Stage):
    """Hands off what the engine stage made (a Triton-like repository)."""
    name = "package"
    needs = ("engine",)
    hands_off = True
    out_link = "triton_repo"

    def config(self, r):
        return {"options": r.quantize.options}

    def run(self, ctx):
        (ctx.out / "model" / "1").mkdir(parents=True)
        (ctx.out / "model" / "1" / "engine.bin").write_bytes((ctx.inputs["engine"] / "engine.bin").read_bytes())
        return _where()


def flow(sm90: bool = False, package: bool = False) -> list[Stage]:
    return [Produce(), Transform(), Gate()] + ([GpuArch()] if sm90 else []) + ([Package()] if package else [])
