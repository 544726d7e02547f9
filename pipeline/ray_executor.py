"""Builds spread over a Ray cluster: ``forge build RECIPE... --executor ray [--ray-address ADDR]``.

The driver (the ``forge`` process) resolves and plans every recipe, runs each stage that is not cached as one
Ray task as soon as the stages it needs are done, and hands the StageResults to the CLI, which writes
report.json / junit.xml / summary.json exactly as for the local executor. Independent recipes (and independent
stages) run at once; a stage two recipes share (same key) runs once.

Stages exchange artifacts only through the shared cache (``FORGE_CACHE=s3://...``): a task fetches its inputs
from the store into its node's local layer (``FORGE_HOME/artifacts`` there) and publishes what it builds; Ray
carries only small results (status, key, digest, metrics, the node). Every node needs forge and the same tool
versions (one image), its data sets (``forge data fetch``) and credentials for the store.

Scheduling is by resources (``Stage.ray_resources``, from the stage's typed hardware, pipeline/hardware.py): a
CPU stage whose output is the same on every CPU asks for one CPU and runs anywhere; a stage keyed by the CPU's ISA
class asks also for a sliver of ``isa:<the driver's class>`` (the driver keys it with its own class), so it runs
only on nodes of that class; a GPU stage asks for its GPUs (tp x pp for TensorRT-LLM engine build/evaluate, one
for ONNX Runtime's CUDA stages) and the custom resource naming the GPU architecture (``sm_90``). Nodes advertise
them: ``ray start ... --resources "$(python -m pipeline.ray_executor --node-resources)"``. The worker checks that
its own hardware is the one the driver keyed the stage with and fails the stage, saying so, if not (docs/ray.md).

The driver's outputs are local: the payload of a stage that hands off (the Triton package) is fetched into the
driver's cache layer, ``out/<recipe>/triton_repo`` links there, and report.json names only paths on the driver or
the store's URLs, never a worker's FORGE_HOME. A stage no node can run is not submitted (Ray would wait
for it forever): it is ``cannot-run-here`` with the resources it lacks. A task lost with its worker or node is
retried by Ray (``MAX_RETRIES``); a killed attempt leaves no entry (the record is written last, conditionally),
so a retry produces the same result a first attempt would.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .cache import ArtifactCache, Found, make_key
from .errors import ForgeError, UsageError
from .hardware import ISA_RESOURCE_PREFIX, isa_resource, sm_resource
from .runner import InputsSetAside, Runner
from .stage_walk import StageResult, StageWalk

MAX_RETRIES = 3                          # Ray re-runs a task whose worker or node died this many times
LOCAL_OBJECT_STORE_BYTES = 100 * 2**20   # a cluster started for one build: results are small, artifacts go via S3
SHARED_CACHE_NEEDED = ("--executor ray needs a shared cache every node reads and writes: set "
                       "FORGE_CACHE=s3://bucket/prefix (or gs://, az://); stages exchange artifacts only there")


def _ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install 'forge-engine[ray]' (or `make setup`)") from None
    return ray


def _target(address: str | None) -> str | None:
    """The cluster asked for: ``--ray-address``, else ``$RAY_ADDRESS``; None: forge starts one on this machine."""
    return address or os.environ.get("RAY_ADDRESS") or None


def connect(address: str | None) -> str:
    """Join the Ray cluster at ``address`` (else ``$RAY_ADDRESS``; else start one on this machine, which ends with
    this process). Returns a description of what was joined."""
    ray = _ray()
    if ray.is_initialized():
        return "the Ray cluster already joined"
    target = _target(address)
    host, _, port = (target or "").rpartition(":")
    if host and port.isdigit() and "://" not in target:
        try:        # ray.init retries a dead address for minutes: say so in seconds
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as e:
            raise ForgeError(f"cannot reach the Ray head at {target} ({e.strerror or e}): start it with "
                             f"`ray start --head --port={port}`, or fix --ray-address / RAY_ADDRESS") from None
    try:
        if target:
            ray.init(address=target, logging_level="ERROR", configure_logging=True)
        else:
            # this machine's ISA class and GPU architectures, as `ray start` on a forge node advertises them
            ray.init(logging_level="ERROR", include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                     resources=node_resources())
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ForgeError(f"cannot join the Ray cluster at {target}: {str(e).splitlines()[0] if str(e) else type(e).__name__}. "
                         f"Start one with `ray start --head` (and `ray start --address=HEAD:PORT` on each other node), "
                         f"or fix --ray-address / RAY_ADDRESS") from None
    return f"Ray cluster at {target}" if target else "a Ray instance started on this machine"


@dataclass
class Node:
    id: str
    ip: str
    resources: dict

    def label(self) -> str:
        return f"{self.ip} ({self.id[:8]})"


def executor_info(address: str | None, nodes: list["Node"] | None = None) -> dict:
    """report.json's ``executor`` of a build on Ray: the cluster asked for (``requested``: --ray-address /
    RAY_ADDRESS; None when forge started a Ray instance on this machine), the address of the cluster joined (its
    GCS, once joined), the driver's host and the nodes that were alive at the start."""
    out = {"kind": "ray", "requested": _target(address), "address": None, "driver": socket.gethostname()}
    if nodes is not None:
        ray = _ray()
        out["address"] = ray.get_runtime_context().gcs_address if ray.is_initialized() else out["requested"]
        out["nodes"] = [{"id": n.id, "ip": n.ip} for n in nodes]
    return out


def cluster_nodes() -> list[Node]:
    ray = _ray()
    return [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), dict(n.get("Resources", {})))
            for n in ray.nodes() if n.get("Alive")]


def request(stage, recipe) -> dict[str, float]:
    """The stage's Ray request as node resource names: ``{"CPU": 1, "GPU": 2, "sm_90": 2}`` (zeros left out)."""
    res = stage.ray_resources(recipe)
    out = {"CPU": float(res.get("num_cpus", 1)), "GPU": float(res.get("num_gpus", 0))}
    out.update({k: float(v) for k, v in res.get("resources", {}).items()})
    return {k: v for k, v in out.items() if v > 0}


def _fmt(req: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in req.items()) or "nothing"


def place(stage, recipe, nodes: list[Node]) -> tuple[str | None, str]:
    """(what is missing or None, where it would run) for a stage on these nodes: the plan's and the driver's view."""
    unplaceable = stage.hardware(recipe).unplaceable(recipe.name)
    if unplaceable:
        return unplaceable, ""
    req = request(stage, recipe)
    ok = [n for n in nodes if all(n.resources.get(k, 0.0) >= v for k, v in req.items())]
    if not ok:
        isa_req = any(k.startswith(ISA_RESOURCE_PREFIX) for k in req)
        shown = lambda k: k in ("CPU", "GPU") or k.startswith("sm_") or (isa_req and k.startswith(ISA_RESOURCE_PREFIX))  # noqa: E731
        have = "; ".join(f"{n.label()}: {_fmt({k: v for k, v in n.resources.items() if shown(k)})}"
                         for n in nodes) or "none"
        gpus = int(req.get("GPU", 0))
        custom = {k: (1 if k.startswith(ISA_RESOURCE_PREFIX) else int(v)) for k, v in req.items()
                  if k not in ("CPU", "GPU")}
        start = "ray start --address=HEAD:PORT" + (f" --num-gpus={gpus}" if gpus else "") + \
                (f" --resources='{json.dumps(custom)}'" if custom else "")
        isa = "" if not isa_req else (
            " (a node of that CPU ISA class advertises it: `ray start ... --resources \"$(python -m "
            "pipeline.ray_executor --node-resources)\"`)")
        return (f"no node in the Ray cluster has {_fmt(req)} (nodes: {have}); add one that has: `{start}`{isa}",
                "nowhere")
    where = f"any of {len(ok)} nodes" if len(ok) == len(nodes) and len(ok) > 1 else ", ".join(n.label() for n in ok)
    return None, f"{_fmt(req)} on {where}"


# ------------------------------------------------------------------ the task (runs on a worker)
def run_stage_task(recipe, stages, stage_name: str, upstream: dict, forced: bool, cache_url: str,
                   keyed_hardware: str | None = None) -> dict:
    """One stage on the node Ray chose: its inputs come from the shared store into this node's local layer,
    its output goes back there. Returns the StageResult as a dict, its payload digest, and a failure's log.
    ``keyed_hardware``: the hardware the driver keyed the stage with; a node whose own differs refuses it."""
    import ray
    from .remote_cache import RemoteStore
    node = {"id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(), "pid": os.getpid()}
    stage = next(s for s in stages if s.name == stage_name)
    log_dir = Path(tempfile.mkdtemp(prefix="forge-ray-log-"))
    try:
        here = stage.hardware(recipe)
        if keyed_hardware is not None and str(here) != keyed_hardware:
            res = StageResult(stage_name, "failed", message=(
                f"on node {node['ip']} ({node['host']}): this node's hardware for {stage_name} is '{here}' but the "
                f"driver keyed the stage with '{keyed_hardware}', and its result would be stored under a key that "
                f"names other hardware than it ran on. The node advertises a Ray resource it does not have: start "
                f"it with `ray start ... --resources \"$(python -m pipeline.ray_executor --node-resources)\"`"),
                error_type="HardwareMismatch")
            res.node = node
            return {"result": asdict(res), "digest": None, "log_text": None}
        set_aside: list[str] = []
        bad_blobs: list[str] = []
        try:
            remote = RemoteStore(cache_url)
            remote.probe()
            runner = Runner(recipe, ArtifactCache(remote=remote), stages=stages, log_dir=log_dir)
        except ForgeError as e:         # this node cannot use the store (credentials, network): say which node
            res = StageResult(stage_name, "failed", message=f"on node {node['ip']} ({node['host']}): {e}",
                              error_type=type(e).__name__)
            digest = None
        else:
            try:
                res, digest = runner.run_after(stage, upstream, forced)
            except InputsSetAside as e:     # the driver rebuilds them, then sends this stage again
                res, digest, set_aside = StageResult(stage_name, "skipped", message=f"{e}: set aside, rebuilding it",
                                                     error_type=type(e).__name__), None, e.stages
                bad_blobs = sorted(runner.cache.bad_blobs)
            except ForgeError as e:         # the store failed under it while its inputs were fetched
                res = StageResult(stage_name, "failed", message=f"on node {node['ip']} ({node['host']}): {e}",
                                  error_type=type(e).__name__)
                digest = None
        if res.origin.get("how") == "built":
            res.origin.update(node=node["id"], ip=node["ip"])
        log_text = None
        if res.log:
            try:
                log_text = Path(res.log).read_text()
            except OSError:
                pass
        res.node = node
        return {"result": asdict(res), "digest": digest, "log_text": log_text, "set_aside": set_aside,
                "bad_blobs": bad_blobs}
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


# ------------------------------------------------------------------ the driver
@dataclass
class _Recipe:
    runner: Runner
    walk: StageWalk          # what may start, what is skipped: the same walk the local executor takes
    wall_s: float = 0.0      # from the start of the run to this recipe's last result
    set_aside: set = None    # stages whose entries a task set aside (did not verify): rebuilt by a next pass
    again: bool = False      # a task set aside something new: walk the recipe once more when this pass ends


class RayBuild:
    """Submit, wait, collect: the driver's loop over every recipe of one ``forge build --executor ray``."""

    def __init__(self, runners: list[Runner], forced: dict[str, set], until: str | None, keep_going: bool,
                 on_stage=None):
        self.ray = _ray()
        self.cache = runners[0].cache
        if self.cache.remote is None:
            raise UsageError(SHARED_CACHE_NEEDED)
        self.url = self.cache.remote.url
        self.on_stage = on_stage or (lambda recipe, res: None)
        self.recipes = [self._recipe(r, forced.get(r.recipe.name, set()), until) for r in runners]
        self.keep_going = keep_going
        self.task = self.ray.remote(run_stage_task)
        self.nodes = cluster_nodes()
        self.by_ref: dict = {}           # ObjectRef -> (key, [(recipe state, stage)])
        self.by_key: dict = {}           # key -> ObjectRef (a key two recipes share runs once)
        self.halted = False              # a failure without --keep-going: nothing new is submitted

    def _recipe(self, runner: Runner, forced: set, until: str | None) -> _Recipe:
        st = _Recipe(runner, StageWalk(runner.stages, forced, until), set_aside=set())
        st.walk.on_result = lambda res: self._finished(st, res)
        return st

    def _walk_again(self, st: _Recipe) -> None:
        """A next pass of a recipe whose inputs were set aside: they are misses now and are rebuilt. A stage
        forced (--force/--from) and built in the last pass is not forced again."""
        last = st.walk
        forced = {n for n in last.forced if not (n in last.results and last.results[n].status == "built")}
        st.walk = StageWalk(st.runner.stages, forced, last.until)
        st.walk.on_result = lambda res: self._finished(st, res)
        st.again = False

    def run(self) -> list[tuple[list[StageResult] | None, float]]:
        """(results in stage order, wall seconds) per recipe in the order given; results None for a recipe cut
        short (a failure elsewhere without --keep-going)."""
        self.t0 = time.perf_counter()
        try:
            for st in self.recipes:
                self._advance(st)
            while True:
                while self.by_ref:
                    ready, _ = self.ray.wait(list(self.by_ref), num_returns=1)
                    self._collect(ready[0])
                    for st in self.recipes:
                        self._advance(st)
                again = [st for st in self.recipes if st.again and not self.halted]
                if not again:
                    break
                for st in again:    # each pass sets aside stages no earlier pass did, so this ends
                    self._walk_again(st)
                    self._advance(st)
        except KeyboardInterrupt:
            for ref in list(self.by_ref):   # each task's writer removes its temp dir on the interrupt
                try:
                    self.ray.cancel(ref)
                except Exception:
                    pass
            raise
        for st in self.recipes:
            if st.walk.done:
                for s in st.runner.stages:
                    self._localise(s, st.walk.results[s.name])
        return [(st.walk.in_order() if st.walk.done else None, st.wall_s) for st in self.recipes]

    def _localise(self, stage, res: StageResult) -> None:
        """Point the result at this machine: a worker's payload path lies in that node's FORGE_HOME. What hands
        off (the package) is fetched into the driver's layer; any other payload is named by its local path if the
        driver has it, else by the store's URL (not downloaded: the driver needs only what it links)."""
        if res.status not in ("hit", "built") or not res.key:
            return
        try:
            entry = self.cache.get(res.key, fetch=stage.hands_off)
        except ForgeError as e:
            entry = None
            res.message = (res.message + "; " if res.message else "") + f"not fetched to this machine: {e}"
        res.payload = str(entry.payload) if entry is not None else self.cache.remote.record_url(res.key)
        if entry is not None and entry.source != "local" and res.origin.get("how") == "shared":
            res.origin["fetched"] = True

    def _finished(self, st: _Recipe, res: StageResult) -> None:
        if res.status == "failed" and not self.keep_going:
            self.halted = True
        if st.walk.done:
            st.wall_s = time.perf_counter() - self.t0
        self.on_stage(st.runner.recipe.name, res)

    def _advance(self, st: _Recipe) -> None:
        r, runner, walk = st.runner.recipe, st.runner, st.walk
        known = -1
        while len(walk.results) != known:   # a hit makes the stages after it ready at once
            known = len(walk.results)
            self._start_ready(st, r, runner, walk)

    def _start_ready(self, st: _Recipe, r, runner: Runner, walk: StageWalk) -> None:
        for s in walk.ready():
            if self.halted:
                return                      # not started: another recipe failed (no --keep-going)
            comps = s.components(r, runner.home, walk.digests())
            key = make_key(comps)
            forced = s.name in walk.forced
            if not forced:
                state, meta, found = self.cache.lookup(key)
                if state == "hit":
                    if found == "local":    # only the driver has it: publish it, workers fetch from the store
                        self.cache.get(key)
                    walk.finish(StageResult(s.name, "hit", key, metrics=meta.get("metrics", {}),
                                            payload=self.cache.remote.record_url(key),
                                            origin=Found(key, meta, found).origin()), meta["payload_digest"])
                    continue
            missing, _ = place(s, r, self.nodes)
            if missing:
                walk.finish(StageResult(s.name, "cannot-run-here", key, message=missing))
                continue
            walk.start(s.name)
            if key in self.by_key and not forced:
                self.by_ref[self.by_key[key]][1].append((st, s.name))
                continue
            res = s.ray_resources(r)
            ref = self.task.options(num_cpus=res.get("num_cpus", 1), num_gpus=res.get("num_gpus", 0),
                                    resources=res.get("resources") or None, max_retries=MAX_RETRIES,
                                    retry_exceptions=False, name=f"forge:{r.name}:{s.name}") \
                .remote(r, runner.stages, s.name, dict(walk.upstream), forced, self.url, str(s.hardware(r)))
            self.by_key[key] = ref
            self.by_ref[ref] = (key, [(st, s.name)])

    def _collect(self, ref) -> None:
        key, waiters = self.by_ref.pop(ref)
        self.by_key.pop(key, None)
        try:
            out = self.ray.get(ref)
            base = StageResult(**out["result"])
            digest, log_text, set_aside = out["digest"], out["log_text"], set(out.get("set_aside") or ())
        except Exception as e:              # the task itself was lost (retries spent) or could not run
            text = str(e).strip().splitlines()
            base = StageResult(waiters[0][1], "failed", key, message=f"the Ray task was lost after {MAX_RETRIES} "
                               f"retries: {type(e).__name__}: {text[0][:500] if text else ''}", error_type=type(e).__name__)
            digest, log_text, set_aside, out = None, None, set(), {}
        # the driver looked up every hit: it sets aside the other records it knows that name the task's bad blobs
        gone = self.cache.set_aside_naming(set(out.get("bad_blobs") or ()), f"an input of {waiters[0][1]}") \
            if set_aside else set()
        first = True
        for st, name in waiters:
            res = StageResult(**{**asdict(base), "name": name})
            names = set_aside | {n for n, r in st.walk.results.items() if r.key in gone}
            if names and names <= st.set_aside:     # rebuilt by an earlier pass and bad again
                res.status = "failed"
                res.message = (f"{base.message.removesuffix(': set aside, rebuilding it')} again after it was "
                               f"rebuilt: build again")
            elif names:
                st.set_aside |= names
                st.again = True
            if not first and res.status == "built":   # the same key for another recipe: built once, here a hit
                res.status, res.duration_s, res.peak_rss_mb = "hit", 0.0, 0.0
                res.message = f"built once in this run for {waiters[0][0].runner.recipe.name}"
            if log_text is not None:
                res.log = self._write_log(st.runner, name, log_text)
            first = False
            st.walk.finish(res, digest)

    @staticmethod
    def _write_log(runner: Runner, stage: str, text: str) -> str | None:
        try:
            runner.log_dir.mkdir(parents=True, exist_ok=True)
            path = runner.log_dir / f"{stage}.log"
            path.write_text(text)
            return str(path)
        except OSError:
            return None


# ------------------------------------------------------------------ what a node advertises
def node_resources() -> dict[str, float]:
    """The custom resources this machine's Ray node should advertise so that stages bound to its hardware are
    scheduled on it: its CPU's ISA class (``isa:x86_64-avx2``: 1, a marker ISA-keyed stages take a sliver of) and
    one ``sm_<N>`` per GPU of that compute capability."""
    from .host.cpu import cpu_isa_class
    from .host.gpu import gpus
    out: dict[str, float] = {isa_resource(cpu_isa_class()): 1}
    for g in gpus():
        out[sm_resource(g["sm"])] = out.get(sm_resource(g["sm"]), 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m pipeline.ray_executor", description=(
        "What this machine's Ray node must advertise for forge: `ray start ... --resources \"$(python -m "
        "pipeline.ray_executor --node-resources)\"` (add --num-gpus as usual)."))
    ap.add_argument("--node-resources", action="store_true", help="print the JSON for `ray start --resources`")
    args = ap.parse_args(argv)
    if not args.node_resources:
        ap.print_help()
        return 2
    print(json.dumps(node_resources(), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
