"""The `forge` command line."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import (EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, ForgeError, RecipeError, UsageError,
                     exit_code)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build validated inference engines and Triton model repositories from recipes.")
recipes_app = typer.Typer(no_args_is_help=True, help="List, show and resolve recipes.")
cache_app = typer.Typer(no_args_is_help=True, help="Inspect and maintain the artifact cache.")
data_app = typer.Typer(no_args_is_help=True, help="Calibration and evaluation data sets.")
app.add_typer(recipes_app, name="recipes")
app.add_typer(cache_app, name="cache")
app.add_typer(data_app, name="data")

console = Console()
err = Console(stderr=True)

SetOpt = typer.Option(None, "--set", help="dotted override, e.g. --set quantize.calibration.samples=64 (repeatable)")


def _resolve(name: str, overrides: list[str] | None):
    from .recipe import resolve
    return resolve(name, overrides or [])


# ------------------------------------------------------------------ recipes
@recipes_app.command("list")
def recipes_list():
    """Recipes shipped in recipes/."""
    from .recipe import list_recipes, resolve
    t = Table("name", "target", "algo", "description")
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
    console.print(yaml.safe_dump(r.to_dict(), sort_keys=False), end="")
    console.print(f"# hash: {r.hash}")


# ------------------------------------------------------------------ plan / build
def _plan_table(runner, plans) -> Table:
    t = Table(title=f"plan: {runner.recipe.name} [{runner.recipe.build.target}]")
    t.add_column("stage")
    t.add_column("status")
    t.add_column("key")
    t.add_column("why")
    colors = {"hit": "green", "miss": "cyan", "cannot-run-here": "yellow", "blocked": "yellow", "corrupt": "red"}
    for p in plans:
        t.add_row(p.name, f"[{colors.get(p.status, 'white')}]{p.status}", (p.key or "")[:12], escape(p.reason))
    return t


@app.command()
def plan(recipe: str, set_: Optional[List[str]] = SetOpt,
         force: Optional[List[str]] = typer.Option(None, "--force"),
         as_json: bool = typer.Option(False, "--json")):
    """Show every stage as hit / miss / cannot-run-here, and why, without running anything."""
    from .runner import Runner
    r = _resolve(recipe, set_)
    runner = Runner(r)
    problems = runner.plan_problems()
    plans = runner.plan(set(force or []))
    if as_json:
        console.print_json(json.dumps({"recipe": r.name, "hash": r.hash, "problems": problems, "stages": [
            {"name": p.name, "status": p.status, "key": p.key, "reason": p.reason, "changed": p.changed}
            for p in plans]}))
    else:
        console.print(_plan_table(runner, plans))
        if not problems:
            _print_memory_brief(runner)
    if problems:
        raise RecipeError(problems)


def _print_memory_brief(runner) -> None:
    if runner.recipe.build.target != "tensorrt_llm":
        return
    try:
        from .memory import plan_for_recipe, render_memory
        info = runner.model_info()
        if info is not None:
            plan_, verdicts = plan_for_recipe(runner.recipe, info, None)
            render_memory(plan_, verdicts, console)
    except ForgeError as e:
        err.print(f"memory plan not shown: {escape(str(e))}")


def _link(dest: Path, target: str | None) -> None:
    if not target:
        return
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, dest)


@app.command()
def build(recipes: List[str] = typer.Argument(..., help="recipe names or paths (several for nightly runs)"),
          set_: Optional[List[str]] = SetOpt,
          from_: Optional[str] = typer.Option(None, "--from", help="rebuild this stage and everything after it"),
          until: Optional[str] = typer.Option(None, "--until", help="stop after this stage"),
          force: Optional[List[str]] = typer.Option(None, "--force", help="rebuild this stage even if cached"),
          keep_going: bool = typer.Option(False, "--keep-going", help="build the remaining recipes after a failure"),
          report_dir: Path = typer.Option(Path("out"), "--report-dir", help="where report.json/junit.xml go")):
    """Build recipes: run every stage that is not cached, then validate and package."""
    from .report import (build_report, invalid_report, overall_status, report_dir_name, write_reports,
                         write_summary)
    from .runner import Runner
    statuses: dict[str, str] = {}

    def on_stage(res):
        note = f" — {escape(res.message)}" if res.message else ""
        log = f" (log: {escape(res.log)})" if res.log else ""
        err.print(f"  {res.name}: {res.status}{note}{log}")

    for name in recipes:
        t0 = time.perf_counter()
        shown = name if len(name) <= 80 else name[:77] + "..."
        try:
            r = _resolve(name, set_)
            runner = Runner(r, log_dir=report_dir / r.name / "logs")
            runner.check_stage_args(from_, until, set(force or []))
            err.print(f"[bold]forge build {r.name}[/] (target {r.build.target}, cache {runner.cache.root})")
            results = runner.build(from_stage=from_, until=until, force=set(force or []), on_stage=on_stage)
        except UsageError as e:
            err.print(f"[red]{escape(shown)}: bad recipe or arguments:[/]\n{escape(str(e))}")
            statuses[shown] = "invalid"
            _write_safely(lambda: write_reports(invalid_report(name, e), report_dir / report_dir_name(name)))
            if not keep_going:
                break
            continue
        except ForgeError as e:         # a problem outside any stage (e.g. the cache location is unusable)
            err.print(f"[red]{escape(shown)}:[/] {escape(str(e))}")
            statuses[shown] = "failed"
            if not keep_going:
                break
            continue
        report = build_report(r, results, time.perf_counter() - t0)
        out = report_dir / r.name
        _write_safely(lambda: write_reports(report, out, console))
        by_name = {x.name: x for x in results}
        if "build" in by_name:
            _write_safely(lambda: _link(out / "engine", by_name["build"].payload))
        if "package" in by_name:
            _write_safely(lambda: _link(out / "triton_repo", by_name["package"].payload))
        statuses[r.name] = overall_status(results)
        for x in results:
            if x.status == "cannot-run-here":
                err.print(f"[yellow]{r.name}: stopped at '{x.name}':[/] {escape(x.message)}")
                break
        if statuses[r.name] == "failed" and not keep_going:
            break
    if len(recipes) > 1:
        _write_safely(lambda: write_summary(statuses, report_dir))
        t = Table("recipe", "status", title="nightly summary")
        for k, v in statuses.items():
            t.add_row(escape(k), v)
        console.print(t)
    raise typer.Exit(exit_code(statuses.values()))


def _write_safely(write) -> None:
    """Reports are written whatever happened; a report that cannot be written (full disk) is said, not raised."""
    try:
        write()
    except OSError as e:
        err.print(f"[red]could not write a report:[/] {escape(str(e))}")


# ------------------------------------------------------------------ cache
@cache_app.command("ls")
def cache_ls():
    """Entries in the artifact cache."""
    from .cache import ArtifactCache, BadEntry
    c = ArtifactCache()
    t = Table("key", "stage", "created", "MB", title=str(c.root))
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


@cache_app.command("verify")
def cache_verify():
    """Re-hash every entry (no stat cache); non-zero exit if any is corrupt."""
    from .cache import ArtifactCache
    bad = ArtifactCache().verify_all()
    for k, why in bad:
        err.print(f"[red]{escape(k)}: {escape(why)}")
    console.print(f"{len(bad)} corrupt entr{'y' if len(bad) == 1 else 'ies'}")
    raise typer.Exit(EXIT_FAILED if bad else 0)


@cache_app.command("gc")
def cache_gc(keep_recipes: Optional[List[str]] = typer.Option(None, "--keep", help="keep only entries of these recipes' last builds")):
    """Remove temp dirs of dead runs; with --keep, also entries no listed recipe's last build uses."""
    from .cache import ArtifactCache
    c = ArtifactCache()
    keep = None
    if keep_recipes:
        keep = set()
        for name in keep_recipes:
            index = c.root / "index" / name
            files = sorted(index.glob("*.json")) if "/" not in name and index.is_dir() else []
            if not files:
                known = sorted(p.name for p in (c.root / "index").iterdir() if p.is_dir())
                raise UsageError(f"--keep {name}: no build of that recipe is recorded in {c.root} (nothing would be "
                                 f"kept for it); recipes with builds: {', '.join(known) or 'none'}")
            for f in files:
                try:
                    keep.add(str(json.loads(f.read_text())["key"]))
                except (OSError, ValueError, KeyError, TypeError):
                    err.print(f"[yellow]skipping unreadable index record {escape(str(f))}")
    console.print(c.gc(keep))


# ------------------------------------------------------------------ data
@data_app.command("fetch")
def data_fetch(sets: Optional[List[str]] = typer.Argument(None), force: bool = typer.Option(False, "--force")):
    """Fetch and verify data sets (all by default) from their registries."""
    from . import data as datasets
    from .env import forge_home
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


# ------------------------------------------------------------------ environment
@app.command()
def doctor(as_json: bool = typer.Option(False, "--json"),
           recipe: Optional[str] = typer.Option(None, "--recipe", help="check where this recipe's TP/PP ranks land "
                                                "on this host's GPUs (links, NUMA, numactl per rank)"),
           set_: Optional[List[str]] = SetOpt):
    """Versions, GPUs (NVML), GPU-to-GPU topology and problems with their fixes."""
    from .doctor import render_doctor, run_doctor
    tp = pp = None
    if recipe is not None:
        b = _resolve(recipe, set_).build.tensorrt_llm
        tp, pp = b.tp, b.pp
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
    from .memory import plan_for_recipe, render_memory
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
    """Check a packaged repository's manifest against this environment (TensorRT/TRT-LLM versions, GPU SM)."""
    from .triton.manifest import MANIFEST, verify_deploy as check
    if not (repo / MANIFEST).is_file():
        raise UsageError(f"{repo}: no {MANIFEST} here; give the directory of a packaged repository "
                         f"(out/RECIPE/triton_repo after `forge build RECIPE`)")
    problems = check(repo)
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
    except KeyboardInterrupt:   # also while starting: TritonServer stops what it started
        err.print("stopping tritonserver ...")
    err.print("tritonserver stopped")


def _package_of(recipe: str, set_) -> Path:
    from .runner import Runner
    r = _resolve(recipe, set_)
    plans = {p.name: p for p in Runner(r).plan()}
    p = plans.get("package")
    if p is None or p.status != "hit":
        raise ForgeError(f"recipe {r.name} has no packaged repository in the cache: run `forge build {r.name}` first")
    from .cache import ArtifactCache
    entry = ArtifactCache().get(p.key, verify=True, use_stat_cache=False)   # every byte: it leaves the cache
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
