"""One `forge build RECIPE...`: resolve and check each recipe, walk its stages through an executor (this machine,
or a Ray cluster), then check each result against the recipe's regression rules, write its report.json /
junit.xml, record the night in the run history and link out/<recipe>/<output>. A recipe that cannot start (bad
input, no shared store, the cluster lost) still leaves a report, so a nightly CI always sees a result.

What may run next inside one recipe is the stage walk's to decide (pipeline/stage_walk.py); what happens across
recipes (keep-going, the summary) and around a recipe (reports, history, links) is this module's.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.markup import escape

from .errors import ForgeError, RecipeError, UsageError
from .host.files import atomic_symlink
from .stage_walk import forced_stages
from .status import Status


def shown(name: str) -> str:
    """A recipe argument as messages show it: a garbage argument of kilobytes is cut (files keep it whole)."""
    return name if len(name) <= 80 else name[:77] + "..."


def link(dest: Path, target: str | None) -> None:
    if target and Path(target).is_dir():    # --executor ray: the entry may lie only in the shared store
        atomic_symlink(dest, target)
    elif dest.is_symlink():                 # not on this machine: no link, rather than last run's
        dest.unlink()


class BuildRun:
    """The recipes of one command, their options, and ``statuses`` (recipe -> overall status) as they finish."""

    def __init__(self, *, overrides, from_stage, until, force, keep_going: bool, report_dir: Path, nightly, cache,
                 verify: bool, out, err):
        self.overrides, self.from_stage, self.until, self.force = overrides, from_stage, until, set(force or [])
        self.keep_going, self.report_dir, self.nightly, self.verify = keep_going, report_dir, nightly, verify
        self.cache = cache          # () -> ArtifactCache, opened on first use (a bad recipe needs no store)
        self.out, self.err = out, err
        self.statuses: dict[str, str] = {}
        self.notes: dict[str, str] = {}           # recipes built from generated weights: what their gates mean
        self.executor: dict | None = None   # report.json's "executor" (local, or the Ray cluster joined)

    # ------------------------------------------------------------ executors
    def local(self, recipes: list[str]) -> None:
        """Each recipe in turn on this machine; after a failure the rest only with --keep-going."""
        from .report import local_executor
        self.executor = local_executor()
        for name in recipes:
            t0 = time.perf_counter()
            r = None
            try:
                r = self._resolve(name)
                runner = self._runner(r)
                self.err.print(f"[bold]forge build {r.name}[/] (target {r.build.target}, cache "
                               f"{escape(runner.cache.location)})")
                results = runner.build(from_stage=self.from_stage, until=self.until, force=self.force,
                                       on_stage=self._on_stage)
            except ForgeError as e:
                self._not_started(e, name, r, time.perf_counter() - t0)
                if not self.keep_going:
                    break
                continue
            except Exception as e:          # a bug (main() says so): the resolved recipe still leaves its reports
                self._not_started_reports(r, e, time.perf_counter() - t0)
                raise
            self.finish(runner, results, time.perf_counter() - t0)
            if self.statuses[r.name] == Status.FAILED and not self.keep_going:
                break

    def ray(self, recipes: list[str], ray_address: str | None) -> None:
        """Every recipe's stages on the Ray cluster at once, each as soon as what it needs is done."""
        from .ray_executor import SHARED_CACHE_NEEDED, RayBuild, connect, executor_info
        self.executor = executor_info(ray_address)
        runners, forced = [], {}
        for name in recipes:
            r = None
            try:
                r = self._resolve(name)
                runner = self._runner(r)
                problems = runner.plan_problems()
                if problems:
                    raise RecipeError(problems)
            except ForgeError as e:
                self._not_started(e, name, r if not isinstance(e, UsageError) else None)
                if not self.keep_going:
                    return
                continue
            forced[r.name] = forced_stages(runner.stage_names(), self.from_stage, self.force)
            runners.append(runner)
        if not runners:
            return

        def not_started(runs, e: BaseException) -> None:     # whatever stops the cluster run, each recipe reports
            for runner in runs:
                self.statuses[runner.recipe.name] = Status.FAILED
                self._not_started_reports(runner.recipe, e, 0.0)

        if runners[0].cache.remote is None:
            e = UsageError(SHARED_CACHE_NEEDED)
            not_started(runners, e)
            raise e
        try:
            joined = connect(ray_address)
            build = RayBuild(runners, forced, self.until, self.keep_going, on_stage=self._on_ray_stage)
            self.executor = executor_info(ray_address, build.nodes)
            n, nodes = len(runners), len(build.nodes)
            self.err.print(f"[bold]forge build --executor ray[/]: {n} recipe{'s' if n != 1 else ''} on "
                           f"{escape(joined)} ({nodes} node{'s' if nodes != 1 else ''}), cache "
                           f"{escape(build.cache.location)}")
            outcomes = build.run()
        except Exception as e:       # no cluster, the cluster lost, a bug: every recipe still reports
            not_started(runners, e)
            raise
        for runner, (results, wall) in zip(runners, outcomes):
            if results is None:
                why = ForgeError("not finished: a stage of another recipe failed and nothing new starts after a "
                                 "failure without --keep-going")
                self.err.print(f"[yellow]{runner.recipe.name}: {why}")
                not_started([runner], why)
                continue
            self.finish(runner, results, wall)

    # ------------------------------------------------------------ one recipe
    def _resolve(self, name: str):
        from .recipe import resolve
        return resolve(name, self.overrides or [])

    def _runner(self, r):
        """The recipe's runner on the cache (opened now: a store that cannot be opened fails a resolved recipe)."""
        from .runner import Runner
        runner = Runner(r, self.cache(), log_dir=self.report_dir / r.name / "logs", verify=self.verify)
        runner.check_stage_args(self.from_stage, self.until, self.force)
        return runner

    def finish(self, runner, results, wall_s: float) -> None:
        """Regression rules, reports, history, links and the outcome of one built recipe (either executor)."""
        from .report import build_report, overall_status, write_reports
        r = runner.recipe
        results += self.nightly.check(r, results)   # regression rules vs the last good night (never cached)
        report = build_report(r, results, wall_s, self.executor)
        out = self.report_dir / r.name
        self.nightly.record(r, report, out / "report.json")
        self._write_safely(lambda: write_reports(report, out, self.out))
        by_name = {x.name: x for x in results}
        for stage in runner.stages:     # out/<recipe>/engine, triton_repo, ...: what each stage of the target declares
            if stage.out_link and stage.name in by_name:
                self._write_safely(lambda: link(out / stage.out_link, by_name[stage.name].payload))
        self.statuses[r.name] = overall_status(results)
        if report.get("note"):
            self.notes[r.name] = report["note"]
        for x in results:
            if x.status == Status.CANNOT_RUN_HERE:
                self.err.print(f"[yellow]{r.name}: stopped at '{x.name}':[/] {escape(x.message)}")
                break

    def _not_started(self, e: ForgeError, name: str, r=None, wall_s: float = 0.0) -> None:
        """A recipe that could not start: bad recipe or arguments (status invalid, exit 2, an invalid report) or a
        problem outside any stage (the shared store cannot be opened, a full disk: failed, with a failed report
        when the recipe resolved)."""
        from .report import invalid_report, report_dir_name, write_reports
        if isinstance(e, UsageError):
            self.err.print(f"[red]{escape(shown(name))}: bad recipe or arguments:[/]\n{escape(str(e))}")
            self.statuses[name] = Status.INVALID      # the name as given, whole: summary.json keys are never cut
            self._write_safely(lambda: write_reports(invalid_report(name, e), self.report_dir / report_dir_name(name)))
        else:
            self.err.print(f"[red]{escape(shown(name))}:[/] {escape(str(e))}")
            self.statuses[r.name if r is not None else name] = Status.FAILED
            self._not_started_reports(r, e, wall_s)

    def _not_started_reports(self, r, e: BaseException, wall_s: float) -> None:
        from .report import not_started_report, write_reports
        if r is not None:
            self._write_safely(lambda: write_reports(not_started_report(r, e, wall_s, self.executor),
                                                     self.report_dir / r.name))

    def summary(self) -> None:
        """summary.json and a table of every recipe's outcome (a run of several recipes)."""
        from rich.table import Table

        from .report import write_summary
        self._write_safely(lambda: write_summary(self.statuses, self.report_dir))
        notes = self.notes
        t = Table("recipe", "status", *(["note"] if notes else []), title="nightly summary")
        for k, v in self.statuses.items():
            t.add_row(escape(shown(k)), v, *([escape(notes.get(k, ""))] if notes else []))
        self.out.print(t)

    # ------------------------------------------------------------ output
    def _on_stage(self, res) -> None:
        note = f" — {escape(res.message)}" if res.message else ""
        log = f" (log: {escape(res.log)})" if res.log else ""
        where = f" ({escape(res.origin['store'])})" if res.origin.get("how") == "shared" else ""
        self.err.print(f"  {res.name}: {res.status}{where}{note}{log}")

    def _on_ray_stage(self, recipe: str, res) -> None:
        node = f" on {res.node.get('ip')} ({str(res.node.get('id', ''))[:8]})" if res.node else ""
        self.err.print(f"  {recipe}/{res.name}: {res.status}{node}"
                       + (f" — {escape(res.message)}" if res.message else "")
                       + (f" (log: {escape(res.log)})" if res.log else ""))

    def _write_safely(self, write) -> None:
        """Reports are written whatever happened; a report that cannot be written (full disk) is said, not raised."""
        try:
            write()
        except OSError as e:
            self.err.print(f"[red]could not write a report:[/] {escape(str(e))}")
