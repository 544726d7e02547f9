"""Plan and run the stage graph of a recipe against the artifact cache."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .cache import ArtifactCache, diff_components, make_key, open_cache
from .diskspace import check_free_space, disk_full, no_space_message
from .host.paths import forge_home
from .host.rss import PeakRss
from .errors import CannotRunHere, ForgeError, RecipeError, StageFailed, UsageError
from . import random_weights
from .modelinfo import ModelInfo
from .recipe import Recipe
from .stages import flow_for
from .stage_walk import StageResult, StageWalk, built_here, forced_stages
from .stages.base import Stage, StageContext
from .status import Status


@dataclass
class StagePlan:
    name: str
    status: Status              # HIT | MISS | CANNOT_RUN_HERE | BLOCKED | CORRUPT
    key: str | None = None
    reason: str = ""
    components: dict | None = None
    changed: list[str] = field(default_factory=list)
    where: str = ""             # --executor ray: the nodes that could run it


class _InputsCorrupt(Exception):
    """Entries of these stages were set aside in this pass (an input changed on disk; the shared store's entry did
    not verify, with every entry naming the same bad blob): the next pass rebuilds them."""

    def __init__(self, stages, why: str):
        self.stages = sorted(stages)
        self.why = why
        super().__init__(f"{', '.join(self.stages)}: {why}")


class InputsSetAside(ForgeError):
    """--executor ray: what a stage needs is not in the cache (set aside because it did not verify, or removed):
    the driver rebuilds ``stages`` and runs the stage again."""

    def __init__(self, stages, message: str):
        self.stages = sorted(stages)
        super().__init__(message)


def model_info_for(recipe: Recipe, home: Path, source_payload: Path | None = None) -> ModelInfo | None:
    """Model facts for plan-time checks: from the built source, a local dir, or a bundled public config."""
    if source_payload is not None and (source_payload / "tokenizer" / "config.json").exists():
        return ModelInfo.from_dir(source_payload / "tokenizer")
    src = recipe.model.source
    if random_weights.is_random(src):          # the bundled config at the recipe's depth
        name = random_weights.config_name(src)
        return ModelInfo.from_hf_config(random_weights.model_config(
            name, random_weights.effective_layers(name, recipe.model.layers)))
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
                 stages: list[Stage] | None = None, log_dir: Path | None = None, verify: bool = False):
        self.recipe = recipe
        # --verify: every entry a stage uses is re-hashed in full (the stat cache trusts size + mtime + inode)
        self.verify = verify
        self._found: dict[str, object] = {}     # key -> cache.Found of this run's hits
        self._pending: dict[str, str] = {}      # stage -> key of a hit in the shared store not downloaded yet
        self._keys: dict[str, str] = {}         # stage -> its key in this pass
        self._fetched: set[str] = set()         # stages whose shared entry this pass downloaded
        self._built: set[str] = set()           # stages this pass built
        self.cache = cache or open_cache()
        self.home = Path(home or forge_home())
        self.stages: list[Stage] = stages if stages is not None else flow_for(recipe.build.target)
        self._components: dict[str, dict] = {}     # each run stage's key components (for the run history)
        self.log_dir = Path(log_dir) if log_dir else self.cache.root / "logs" / recipe.name

    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def _check_stage_name(self, name: str | None, flag: str) -> None:
        if name is not None and name not in self.stage_names():
            raise UsageError(f"{flag} {name}: no such stage for target '{self.recipe.build.target}' "
                             f"(stages: {', '.join(self.stage_names())})")

    def _cached_source_payload(self) -> Path | None:
        src = next((s for s in self.stages if s.name == "source"), None)
        if src is None:
            return None
        entry = self.cache.get(make_key(src.components(self.recipe, self.home, {})), verify=False, fetch=False)
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
    def plan(self, force: set[str] = frozenset(), placement=None) -> list[StagePlan]:
        """``placement(stage) -> (what is missing or None, where it would run)`` replaces this machine's
        ``stage.missing()`` when the stages run elsewhere (--executor ray)."""
        def missing_where(s):
            return placement(s) if placement else (s.missing(self.recipe), "")
        for f in force:
            self._check_stage_name(f, "--force")
        digests: dict[str, str] = {}
        out: list[StagePlan] = []
        for s in self.stages:
            blocked = [n for n in s.needs if n not in digests]
            if blocked:
                up = next(p for p in out if p.name == blocked[0])
                after = ", ".join(blocked)
                missing, where = missing_where(s)
                if missing:
                    out.append(StagePlan(s.name, Status.CANNOT_RUN_HERE, reason=missing, where=where))
                elif up.status in (Status.CANNOT_RUN_HERE, Status.BLOCKED):
                    out.append(StagePlan(s.name, Status.BLOCKED, reason=f"runs after {after} (which cannot run here)"))
                else:
                    out.append(StagePlan(s.name, Status.MISS, reason=f"runs after {after} (rebuilt first)", where=where))
                continue
            comps = s.components(self.recipe, self.home, digests)
            key = make_key(comps)
            state, meta, found = self.cache.lookup(key)
            last = self.cache.last(self.recipe.name, s.name)
            changed = [] if last and last.get("key") == key else diff_components(last and last.get("components"), comps)
            if state == Status.HIT and s.name not in force:
                digests[s.name] = meta["payload_digest"]
                out.append(StagePlan(s.name, Status.HIT, key, "cached" if found == "local" else f"cached in {found}", comps))
                continue
            missing, where = missing_where(s)
            if missing:
                out.append(StagePlan(s.name, Status.CANNOT_RUN_HERE, key, missing, comps, changed, where))
            else:
                reason = "forced" if s.name in force else ("corrupt entry, rebuild" if state == Status.CORRUPT else
                                                         "changed: " + ", ".join(changed[:6]))
                out.append(StagePlan(s.name, Status.MISS, key, reason, comps, changed, where))
        return out

    # ------------------------------------------------------------ build
    def check_stage_args(self, from_stage: str | None = None, until: str | None = None,
                         force: set[str] = frozenset()) -> None:
        """--from / --until / --force name stages of this recipe's target, in an order that builds something."""
        self._check_stage_name(from_stage, "--from")
        self._check_stage_name(until, "--until")
        for f in force:
            self._check_stage_name(f, "--force")
        names = self.stage_names()
        if from_stage and until and names.index(until) < names.index(from_stage):
            raise UsageError(f"--until {until} comes before --from {from_stage} (stages: {', '.join(names)})")

    def build(self, *, from_stage: str | None = None, until: str | None = None,
              force: set[str] = frozenset(), on_stage=None) -> list[StageResult]:
        """Run every stage that is not cached. Bad arguments or recipe problems raise UsageError/RecipeError
        before anything runs; any failure of a stage after that is a failed StageResult (never an exception),
        except an interrupt."""
        self.check_stage_args(from_stage, until, force)
        forced = forced_stages(self.stage_names(), from_stage, force)
        problems = self.plan_problems()
        if problems:
            raise RecipeError(problems)
        self.cache.clean_stale_tmp()
        set_aside: set[str] = set()
        while True:
            try:
                return self._build_once(forced, until, on_stage, frozenset(set_aside))
            except _InputsCorrupt as e:
                # entries this pass needed were set aside (changed on disk; did not verify in the shared store,
                # with every entry naming the same bad blob): the next pass rebuilds them (a stage that is
                # bit-identical hits again). Each pass sets aside stages no earlier pass did, so this ends.
                set_aside |= set(e.stages)
                forced = forced - self._built       # --force/--from: what the last pass built is not built twice

    def _build_once(self, forced: set[str], until: str | None, on_stage,
                    set_aside: frozenset = frozenset()) -> list[StageResult]:
        """The local executor: the walk's ready stages run here, one at a time, in flow order. ``set_aside``: the
        stages whose entries earlier passes set aside (one that is bad again now is an error, not another pass)."""
        walk = StageWalk(self.stages, forced, until, on_result=on_stage)
        payloads: dict[str, Path] = {}
        self._components: dict[str, dict] = {}
        self._pending, self._found, self._keys, self._fetched, self._built = {}, {}, {}, set(), set()
        while (s := walk.next()) is not None:
            try:
                res = self._run_stage(s, walk.digests(), payloads, walk.metrics(), s.name in forced,
                                      walk.keys(s.needs), set_aside)
            except _InputsCorrupt as e:
                if on_stage:
                    on_stage(StageResult(s.name, Status.SKIPPED, message=e.why))
                raise
            res.components = self._components.get(s.name)
            if res.status == Status.BUILT:
                self._built.add(s.name)
            digest = None
            if res.status in (Status.HIT, Status.BUILT):
                try:
                    found = self._found.get(res.key) if res.status == Status.HIT else None
                    if found is not None and found.entry is None:   # in the shared store: fetched when needed
                        digest = found.meta["payload_digest"]
                        self._pending[s.name] = res.key
                    else:
                        entry = found.entry if found is not None else self.cache.get(res.key, verify=False)
                        digest = entry.meta["payload_digest"]
                        payloads[s.name] = entry.payload
                except Exception as e:      # the entry vanished or is unreadable right after use
                    res = self._failed(s, res.key, 0.0, 0.0, e)
            walk.finish(res, digest)
        results = walk.in_order()
        self._fetch_outputs(results, payloads, set_aside, on_stage)
        for res in results:     # hits in the shared store that this run downloaded
            if res.name in self._fetched and res.origin.get("how") == "shared":
                res.origin["fetched"] = True
        return results

    def _fetch_outputs(self, results: list[StageResult], payloads: dict[str, Path], set_aside: frozenset,
                       on_stage=None) -> None:
        """Download what this build hands over (its hand-off stages, and the last stage it completed unless one
        after it failed) when it is only in the shared store; every other hit stays there (nothing here read it)."""
        done = [r for r in results if r.status in (Status.HIT, Status.BUILT)]
        failed = any(r.status == Status.FAILED for r in results)
        wanted = {s.name for s in self.stages if s.hands_off} | ({done[-1].name} if done and not failed else set())
        for res in done:
            if res.name not in wanted or res.name not in self._pending:
                continue
            try:
                self._materialise([res.name], payloads, set_aside)
                res.payload = str(payloads[res.name])
            except _InputsCorrupt as e:
                if on_stage:
                    on_stage(StageResult(res.name, Status.SKIPPED, message=e.why))
                raise
            except ForgeError as e:
                i = results.index(res)
                results[i] = self._failed(next(s for s in self.stages if s.name == res.name), res.key, 0.0, 0.0, e)

    def _materialise(self, names, payloads: dict[str, Path], set_aside: frozenset) -> None:
        """Download the shared store's entries of these stages that this run found there but has not fetched. One
        that did not verify is set aside there (cache.notes says why), with every entry naming the same bad blob:
        the build's next pass rebuilds each stage of this build among them."""
        for n in names:
            key = self._pending.get(n)
            if key is None:
                continue
            entry = self.cache.get(key, use_stat_cache=not self.verify)
            if entry is None:
                gone = {n} | {m for m, k in self._keys.items() if k in self.cache.set_aside}
                if gone - set_aside:
                    raise _InputsCorrupt(gone - set_aside, f"{', '.join(sorted(gone))}: "
                                         f"{self.cache.notes.get(key) or 'gone from the shared cache'}; rebuilding")
                raise ForgeError(f"the output of {n} ({key[:16]}) was in {self.cache.location} a moment ago but "
                                 f"{self.cache.notes.get(key) or 'is gone now'}; build again")
            del self._pending[n]
            self._fetched.add(n)
            payloads[n] = entry.payload

    def _hit(self, s: Stage, key: str, comps: dict, t0: float | None = None) -> StageResult | None:
        """A hit result for ``key`` if this layer or the shared store has its entry (nothing is downloaded)."""
        found = self.cache.locate(key, use_stat_cache=not self.verify)
        if found is None:
            return None
        self._found[key] = found
        self.cache.record(self.recipe.name, s.name, key, comps)
        return StageResult(s.name, Status.HIT, key, time.perf_counter() - t0 if t0 else 0.0,
                           metrics=found.meta.get("metrics", {}),
                           payload=str(found.entry.payload) if found.entry else None, origin=found.origin())

    def _run_stage(self, s: Stage, digests, payloads, metrics, forced: bool, input_keys: dict[str, str],
                   set_aside: frozenset = frozenset()) -> StageResult:
        t0 = time.perf_counter()
        key = need = None
        sampler = PeakRss()
        try:
            comps = self._components[s.name] = s.components(self.recipe, self.home, digests)
            key = self._keys[s.name] = make_key(comps)
            if not forced:
                hit = self._hit(s, key, comps)
                if hit is not None:
                    return hit
            missing = s.missing(self.recipe)
            if missing:
                return StageResult(s.name, Status.CANNOT_RUN_HERE, key,
                                   message=f"{missing}; finish with: {s.finish_hint(self.recipe)}")
            with self.cache.lock(key):
                if not forced:
                    hit = self._hit(s, key, comps, t0)  # a concurrent run may have built it while we waited
                    if hit is not None:
                        return hit
                self._materialise([*s.needs, "source"], payloads, set_aside)  # what it reads, downloaded only now
                if s.hands_off:
                    self._verify_inputs(s, input_keys, set_aside)
                info = model_info_for(self.recipe, self.home, payloads.get("source"))
                need = s.output_bytes(self.recipe, info, dict(payloads))
                check_free_space(self.cache.root / "tmp", need)
                with self.cache.writer(key) as out, sampler:
                    ctx = StageContext(self.recipe, self.home, out, dict(payloads), dict(metrics), info,
                                       extra={"upstream_digests": dict(digests), "output_bytes": need})
                    stage_metrics = s.run(ctx) or {}
                    if forced:
                        self.cache.discard(key, "replaced by forge build --force/--from")
                    entry = self.cache.commit(key, out, comps, stage_metrics)
                    if key in self.cache.notes:     # another machine's entry came first: its metrics go with it
                        stage_metrics = entry.meta.get("metrics", stage_metrics)
            self.cache.record(self.recipe.name, s.name, key, comps)
        except (KeyboardInterrupt, _InputsCorrupt):
            raise
        except CannotRunHere as e:
            return StageResult(s.name, Status.CANNOT_RUN_HERE, key, time.perf_counter() - t0, message=str(e))
        except Exception as e:      # any failure of a stage is its result, whatever raised it
            return self._failed(s, key, time.perf_counter() - t0, sampler.peak / 2**20, e, need)
        return StageResult(s.name, Status.BUILT, key, time.perf_counter() - t0, sampler.peak / 2**20,
                           stage_metrics, self.cache.notes.pop(key, ""), payload=str(entry.payload),
                           origin=built_here())

    def run_after(self, s: Stage, upstream: dict[str, dict], forced: bool = False) -> tuple[StageResult, str | None]:
        """Run one stage given the results of the stages before it (``{name: {"key", "digest", "metrics"}}``),
        their payloads fetched from the cache: a stage on another machine (--executor ray). Returns the result and
        its payload digest (None unless it hit or was built)."""
        self.cache.clean_stale_tmp()
        keys = {n: u["key"] for n, u in upstream.items()}
        digests = {n: u["digest"] for n, u in upstream.items()}
        metrics = {n: u.get("metrics") or {} for n, u in upstream.items()}
        set_aside: set[str] = set()
        while True:
            payloads = {}
            for n in upstream:
                if n not in s.needs and n != "source":      # source: the model facts every stage is given
                    continue
                entry = self.cache.get(keys[n])
                if entry is None:       # the driver rebuilds it (and every input set aside with it), then this
                    gone = {n} | {m for m, k in keys.items() if k in self.cache.set_aside}
                    why = self.cache.notes.get(keys[n]) or "removed since it was built"
                    raise InputsSetAside(gone, f"the output of {', '.join(sorted(gone))} is not in the cache "
                                         f"{self.cache.location} ({why})")
                payloads[n] = entry.payload
            try:
                res = self._run_stage(s, digests, payloads, metrics, forced, {n: keys[n] for n in s.needs},
                                      frozenset(set_aside))
                res.components = self._components.get(s.name)
                break
            except _InputsCorrupt as e:     # set aside here: fetched again from the shared store
                set_aside |= set(e.stages)
        digest = None
        if res.status in (Status.HIT, Status.BUILT):
            found = self._found.get(res.key)
            entry = self.cache.get(res.key, verify=False, fetch=False)
            digest = entry.meta["payload_digest"] if entry else (found.meta["payload_digest"] if found else None)
        return res, digest

    def _verify_inputs(self, s: Stage, input_keys: dict[str, str], set_aside: frozenset) -> None:
        """Full content digests (not the stat cache) of what this stage hands off; a changed entry is set aside."""
        bad = [n for n, k in input_keys.items() if self.cache.get(k, verify=True, use_stat_cache=False) is None]
        again = [n for n in bad if n in set_aside]
        if again:
            raise ForgeError(f"the cached output of {', '.join(again)} changed on disk again after it was rebuilt: "
                             f"check the disk under {self.cache.root} (`forge cache verify`)")
        if bad:
            raise _InputsCorrupt(bad, "an input changed on disk since it was cached: set aside, rebuilding it")

    def _failed(self, s: Stage, key: str | None, duration: float, peak_mb: float, e: BaseException,
                need: int | None = None) -> StageResult:
        full = disk_full(e, self.cache.root / "tmp")
        if full is not None:
            message = no_space_message(full, self.cache.root, self.home, need)
        elif isinstance(e, ForgeError):
            message = str(e)
        else:
            message = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        log = self._write_log(s, key, e, message)
        return StageResult(s.name, Status.FAILED, key, duration, peak_mb, getattr(e, "metrics", {}) or {}, message,
                           error_type=type(e).__name__, log=log)

    def _write_log(self, s: Stage, key: str | None, e: BaseException, message: str) -> str | None:
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            path = self.log_dir / f"{s.name}.log"
            path.write_text(f"recipe: {self.recipe.name}\nstage: {s.name}\nkey: {key}\n"
                            f"time: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
                            f"error: {type(e).__name__}\nmessage: {message}\n\n"
                            + "".join(traceback.format_exception(e)))
            return str(path)
        except OSError:             # the log's disk may be the full one: the result still says what happened
            return None

