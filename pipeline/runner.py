"""Plan and run the stage graph of a recipe against the artifact cache."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .cache import ArtifactCache, diff_components, make_key
from .env import forge_home
from .errors import CannotRunHere, ForgeError, StageFailed
from .modelinfo import ModelInfo
from .recipe import Recipe
from .stages import flow_for
from .stages.base import Stage, StageContext


@dataclass
class StagePlan:
    name: str
    status: str                 # hit | miss | cannot-run-here | blocked | corrupt
    key: str | None = None
    reason: str = ""
    components: dict | None = None
    changed: list[str] = field(default_factory=list)


@dataclass
class StageResult:
    name: str
    status: str                 # hit | built | failed | cannot-run-here | skipped
    key: str | None = None
    duration_s: float = 0.0
    peak_rss_mb: float = 0.0
    metrics: dict = field(default_factory=dict)
    message: str = ""
    payload: str | None = None


class _RssSampler:
    """Peak resident memory of this process (and children) while a stage runs."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._proc = psutil.Process()

    def _sample(self):
        try:
            rss = self._proc.memory_info().rss
            for c in self._proc.children(recursive=True):
                try:
                    rss += c.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, rss)
        except psutil.Error:
            pass

    def __enter__(self):
        self._sample()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sample()


def model_info_for(recipe: Recipe, home: Path, source_payload: Path | None = None) -> ModelInfo | None:
    """Model facts for plan-time checks: from the built source, a local dir, or a bundled public config."""
    if source_payload is not None and (source_payload / "tokenizer" / "config.json").exists():
        return ModelInfo.from_dir(source_payload / "tokenizer")
    src = recipe.model.source
    if Path(src).is_dir() and (Path(src) / "config.json").exists():
        return ModelInfo.from_dir(src)
    for name in (recipe.model.config, src.removeprefix("builtin:")):
        if name:
            info = ModelInfo.bundled(name)
            if info:
                return info
    return None


class Runner:
    def __init__(self, recipe: Recipe, cache: ArtifactCache | None = None, home: Path | None = None,
                 stages: list[Stage] | None = None):
        self.recipe = recipe
        self.cache = cache or ArtifactCache()
        self.home = Path(home or forge_home())
        self.stages: list[Stage] = stages if stages is not None else flow_for(recipe.build.target)

    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def _check_stage_name(self, name: str | None, flag: str) -> None:
        if name is not None and name not in self.stage_names():
            raise ForgeError(f"{flag} {name}: no such stage for target '{self.recipe.build.target}' "
                             f"(stages: {', '.join(self.stage_names())})")

    def _cached_source_payload(self) -> Path | None:
        src = next((s for s in self.stages if s.name == "source"), None)
        if src is None:
            return None
        entry = self.cache.get(make_key(src.components(self.recipe, self.home, {})), verify=False)
        return entry.payload if entry else None

    def model_info(self) -> ModelInfo | None:
        return model_info_for(self.recipe, self.home, self._cached_source_payload())

    def plan_problems(self) -> list[str]:
        """Recipe checks that need model facts (TP vs heads, group sizes, ...), all at once."""
        info = self.model_info()
        problems = []
        for s in self.stages:
            problems += [f"{self.recipe.path}: {p}" for p in s.plan_problems(self.recipe, info)]
        return problems

    # ------------------------------------------------------------ plan
    def plan(self, force: set[str] = frozenset()) -> list[StagePlan]:
        digests: dict[str, str] = {}
        out: list[StagePlan] = []
        for s in self.stages:
            blocked = [n for n in s.needs if n not in digests]
            if blocked:
                up = next(p for p in out if p.name == blocked[0])
                after = ", ".join(blocked)
                missing = s.missing(self.recipe)
                if missing:
                    out.append(StagePlan(s.name, "cannot-run-here", reason=missing))
                elif up.status in ("cannot-run-here", "blocked"):
                    out.append(StagePlan(s.name, "blocked", reason=f"runs after {after} (which cannot run here)"))
                else:
                    out.append(StagePlan(s.name, "miss", reason=f"runs after {after} (rebuilt first)"))
                continue
            comps = s.components(self.recipe, self.home, digests)
            key = make_key(comps)
            state = self.cache.check(key)
            last = self.cache.last(self.recipe.name, s.name)
            changed = [] if last and last.get("key") == key else diff_components(last and last.get("components"), comps)
            missing = s.missing(self.recipe)
            if state == "hit" and s.name not in force:
                digests[s.name] = self.cache.get(key, verify=False).meta["payload_digest"]
                out.append(StagePlan(s.name, "hit", key, "cached", comps))
            elif missing:
                out.append(StagePlan(s.name, "cannot-run-here", key, missing, comps, changed))
            else:
                reason = "forced" if s.name in force else ("corrupt entry, rebuild" if state == "corrupt" else
                                                         "changed: " + ", ".join(changed[:6]))
                out.append(StagePlan(s.name, "miss", key, reason, comps, changed))
        return out

    # ------------------------------------------------------------ build
    def build(self, *, from_stage: str | None = None, until: str | None = None,
              force: set[str] = frozenset(), on_stage=None) -> list[StageResult]:
        self._check_stage_name(from_stage, "--from")
        self._check_stage_name(until, "--until")
        for f in force:
            self._check_stage_name(f, "--force")
        names = self.stage_names()
        forced = set(force)
        if from_stage:
            forced |= set(names[names.index(from_stage):])
        problems = self.plan_problems()
        if problems:
            from .errors import RecipeError
            raise RecipeError(problems)

        results: list[StageResult] = []
        digests: dict[str, str] = {}
        payloads: dict[str, Path] = {}
        metrics: dict[str, dict] = {}
        stop = False
        for s in self.stages:
            if stop:
                results.append(StageResult(s.name, "skipped", message="after --until" if until else "upstream did not complete"))
                continue
            if any(n not in digests for n in s.needs):
                results.append(StageResult(s.name, "skipped", message="upstream did not complete"))
                continue
            res = self._run_stage(s, digests, payloads, metrics, s.name in forced)
            results.append(res)
            if on_stage:
                on_stage(res)
            if res.status in ("hit", "built"):
                entry = self.cache.get(res.key, verify=False)
                digests[s.name] = entry.meta["payload_digest"]
                payloads[s.name] = entry.payload
                metrics[s.name] = res.metrics
            if res.status == "failed":
                stop = True
            if until and s.name == until:
                stop = True
        return results

    def _run_stage(self, s: Stage, digests, payloads, metrics, forced: bool) -> StageResult:
        comps = s.components(self.recipe, self.home, digests)
        key = make_key(comps)
        if not forced:
            entry = self.cache.get(key)
            if entry is not None:
                self.cache.record(self.recipe.name, s.name, key, comps)
                return StageResult(s.name, "hit", key, metrics=entry.meta.get("metrics", {}), payload=str(entry.payload))
        missing = s.missing(self.recipe)
        if missing:
            return StageResult(s.name, "cannot-run-here", key,
                               message=f"{missing}; finish with: {s.finish_hint(self.recipe)}")
        t0 = time.perf_counter()
        with self.cache.lock(key):
            if not forced:
                entry = self.cache.get(key)   # a concurrent run may have built it while we waited
                if entry is not None:
                    self.cache.record(self.recipe.name, s.name, key, comps)
                    return StageResult(s.name, "hit", key, time.perf_counter() - t0,
                                       metrics=entry.meta.get("metrics", {}), payload=str(entry.payload))
            info = model_info_for(self.recipe, self.home, payloads.get("source"))
            sampler = _RssSampler()
            try:
                with self.cache.writer(key) as out, sampler:
                    ctx = StageContext(self.recipe, self.home, out, dict(payloads), dict(metrics), info,
                                       extra={"upstream_digests": dict(digests)})
                    stage_metrics = s.run(ctx) or {}
                    if forced and self.cache.get(key) is not None:
                        self._replace(key)
                    entry = self.cache.commit(key, out, comps, stage_metrics)
            except StageFailed as e:
                return StageResult(s.name, "failed", key, time.perf_counter() - t0, sampler.peak / 2**20,
                                   e.metrics, str(e))
            except CannotRunHere as e:
                return StageResult(s.name, "cannot-run-here", key, time.perf_counter() - t0, message=str(e))
            except ForgeError as e:
                return StageResult(s.name, "failed", key, time.perf_counter() - t0, sampler.peak / 2**20,
                                   message=str(e))
        self.cache.record(self.recipe.name, s.name, key, comps)
        return StageResult(s.name, "built", key, time.perf_counter() - t0, sampler.peak / 2**20,
                           stage_metrics, payload=str(entry.payload))

    def _replace(self, key: str) -> None:
        """--force: move the old entry aside so the fresh build can take its place."""
        old = self.cache.get(key, verify=False)
        if old is not None:
            aside = self.cache.root / "tmp" / f"replaced-{key[:16]}-{uuid.uuid4().hex[:8]}"
            os.replace(old.path, aside)
            shutil.rmtree(aside, ignore_errors=True)
