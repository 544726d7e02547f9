"""One recipe's walk through its stage graph, for every executor: which stages are forced (--force, --from), which
may start now, which are skipped and why (a failure, --until, an upstream that did not complete).

The local executor (runner.Runner) takes the ready stages one at a time; the Ray executor (ray_executor.RayBuild)
submits every ready stage at once. Both tell the walk each result; neither decides what runs next.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from .status import Status


@dataclass
class StageResult:
    name: str
    status: Status              # HIT | BUILT | FAILED | CANNOT_RUN_HERE | SKIPPED
    key: str | None = None
    duration_s: float = 0.0
    peak_rss_mb: float = 0.0
    metrics: dict = field(default_factory=dict)
    message: str = ""
    payload: str | None = None
    error_type: str = ""        # a failure's exception type (StageFailed for a gate or check that said no)
    log: str | None = None      # a failure's log: message, traceback, stage and key
    components: dict | None = None  # the stage's key components (run history: what changed between nights)
    node: dict = field(default_factory=dict)    # --executor ray: the node it ran on (id, ip, host)
    # where its output came from (hit or built): {"how": "built", "host"[, "node", "ip"]} (built in this run, on
    # which host and Ray node), {"how": "local", "host"} (a hit in that host's local layer) or {"how": "shared",
    # "store", "fetched", "built_by"} (a hit in the shared store; fetched: downloaded to this machine in this run)
    origin: dict = field(default_factory=dict)

DONE = (Status.HIT, Status.BUILT)


def built_here() -> dict:
    """The origin of an output built by this process (a Ray task adds its node)."""
    return {"how": "built", "host": socket.gethostname()}


def forced_stages(names: list[str], from_stage: str | None, force) -> set[str]:
    """--force S (each S) and --from S (S and every stage after it): the stages rebuilt even when cached."""
    out = set(force or ())
    if from_stage:
        out |= set(names[names.index(from_stage):])
    return out


@dataclass
class StageWalk:
    stages: list                      # the target's flow, in order
    forced: set[str]
    until: str | None = None
    on_result: object = None          # called with each StageResult as it is known (skips included)
    results: dict = field(default_factory=dict)    # stage -> StageResult
    upstream: dict = field(default_factory=dict)   # stage that hit or was built -> {"key", "digest", "metrics"}
    running: set = field(default_factory=set)      # started, result not back yet
    stopped: bool = False             # a stage failed or --until was reached: nothing new starts

    def ready(self) -> list:
        """The stages that may start now, in flow order; a stage that never will is finished as skipped here."""
        out = []
        for s in self.stages:
            if s.name in self.results or s.name in self.running:
                continue
            if self.stopped:
                self.finish(StageResult(s.name, Status.SKIPPED, message="after --until" if self.until
                                        else "upstream did not complete"))
            elif any(n not in self.results for n in s.needs):
                continue                                  # starts when what it needs is back
            elif any(n not in self.upstream for n in s.needs):
                self.finish(StageResult(s.name, Status.SKIPPED, message="upstream did not complete"))
            else:
                out.append(s)
        return out

    def next(self):
        """The first stage that may start now (the local executor runs one at a time), or None when done."""
        ready = self.ready()
        return ready[0] if ready else None

    def start(self, name: str) -> None:
        self.running.add(name)

    def finish(self, res, digest: str | None = None) -> None:
        """Record a stage's result; ``digest``: its payload digest when it hit or was built (later stages' keys)."""
        self.running.discard(res.name)
        self.results[res.name] = res
        if res.status in DONE and digest:
            self.upstream[res.name] = {"key": res.key, "digest": digest, "metrics": res.metrics}
        if res.status == Status.FAILED or (self.until and res.name == self.until):
            self.stopped = True
        if self.on_result:
            self.on_result(res)

    def digests(self) -> dict[str, str]:
        return {n: u["digest"] for n, u in self.upstream.items()}

    def metrics(self) -> dict[str, dict]:
        return {n: u["metrics"] for n, u in self.upstream.items()}

    def keys(self, names) -> dict[str, str]:
        return {n: self.upstream[n]["key"] for n in names}

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.stages)

    @property
    def failed(self) -> bool:
        return any(r.status == Status.FAILED for r in self.results.values())

    def in_order(self) -> list:
        return [self.results[s.name] for s in self.stages]
